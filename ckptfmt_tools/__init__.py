"""Tools around the ckptfmt library: the command line, the fault fixture, the restore drill, the
benchmarks, the demo and its continuation receipt.

The import graph runs one way: these modules import ``ckptfmt`` and the public APIs of
``bridges``; neither of those imports anything here (``python -m ckptfmt`` reaches the command
line through a lazy import in ``ckptfmt/__main__.py``). Importing this package imports nothing.
"""
