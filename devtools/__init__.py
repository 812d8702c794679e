"""Developer harnesses: this project's own investigations (where a save's time goes, inode churn,
save CPU, DCP's writer, LoRA adapters, the cooperative restore, architecture figures). Not packaged: the wheel holds
``ckptfmt``, ``bridges`` and ``ckptfmt_tools`` (the user commands) only, and nothing packaged
imports this folder (tests/test_layering.py). Run from a clone: ``python -m devtools.<module>``.
"""
