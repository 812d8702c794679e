"""torchtitan: its checkpoint manager, with each training checkpoint committed through ckptfmt.

torchtitan 0.3.0's extension point is its checkpointer contract: ``BaseCheckpointManager`` (a
``Configurable`` ABC whose subclasses implement ``_save``/``_load``/``_maybe_wait_for_staging``/
``_wait_for_saving``/``_close`` and declare a nested ``Config``), chosen by the trainer's
``checkpoint`` config field, with two implementations (``CheckpointManager`` over DCP and one over
``torch_checkpointing``). :class:`CkptfmtCheckpointManager` subclasses the DCP one and routes its
two storage calls (``dcp_save`` / ``dcp_load``) through :class:`bridges.dcp.CkptfmtStorageWriter`
and :class:`bridges.dcp.CkptfmtStorageReader`, keeping every policy of torchtitan's::

    from bridges.torchtitan import CkptfmtCheckpointManager

    config.checkpoint = CkptfmtCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

A checkpoint it writes loads into Hugging Face ``transformers`` with a preset and no names by
hand: ``bridges.torch.load(f"{folder}/step-N", {"model": hf.state_dict(), "optim": osd},
mapping=bridges.presets.hf_llama_from_torchtitan(hf.config))`` (``hf_qwen3_from_torchtitan`` for
Qwen3), exports with ``ckptfmt export --mapping hf_llama_from_torchtitan``, and into JAX through the
HF layout (bridges/MAPPING.md, torchtitan section).

Subpackage ``bridges.torchtitan`` owns the torchtitan integration (``_manager``). May import:
ckptfmt's public faces, ``bridges.dcp`` (tests/test_layering.py). Needs ``pip install
ckptfmt[titan]`` (torchtitan).
"""
from __future__ import annotations

from bridges.torchtitan._manager import CkptfmtCheckpointManager as CkptfmtCheckpointManager
from bridges.torchtitan._manager import step_of as step_of

__all__ = ["CkptfmtCheckpointManager", "step_of"]
