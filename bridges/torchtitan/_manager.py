"""``CkptfmtCheckpointManager``: torchtitan's checkpoint manager, committing through ckptfmt."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager

import ckptfmt
from bridges.dcp import CkptfmtStorageReader, CkptfmtStorageWriter, unwrap

__all__ = ["CkptfmtCheckpointManager", "step_of"]

_STEP_DIR = re.compile(r"step-(\d+)$")


def step_of(checkpoint_id: str | os.PathLike) -> int:
    """The step of a torchtitan checkpoint folder (``<folder>/step-N``). ValueError for another name."""
    name = os.path.basename(os.path.normpath(os.fspath(checkpoint_id)))
    m = _STEP_DIR.search(name)
    if m is None:
        raise ValueError(f"{checkpoint_id!r} is not a torchtitan checkpoint folder (expected <folder>/step-N)")
    return int(m.group(1))


def _committed(checkpoint_id: str, step: int) -> bool:
    return step in ckptfmt.Repository(checkpoint_id).steps()


def _raise_unwrapped(e: CheckpointException) -> None:
    err = unwrap(e)  # DCP wraps every rank's error in a BaseException: surface ckptfmt's own
    if err is not None:
        raise err from e


class CkptfmtCheckpointManager(CheckpointManager):
    """torchtitan's :class:`CheckpointManager`, whose training checkpoints are ckptfmt steps.

    Selected by configuration like any torchtitan checkpointer (``Trainer.Config.checkpoint =
    CkptfmtCheckpointManager.Config(enable=True, ...)``; ``Config.build(...)`` constructs it).
    Everything torchtitan decides stays its own: the states (model FQNs at the root, the flattened
    optimizer, the LR schedulers, the data loader, ``train_state``), the interval, the last-step
    model-only export, ``keep_latest_k`` (it removes whole ``step-N`` folders), the threaded
    ``async`` mode and the Hugging Face export (``last_save_in_hf``, DCP's own HF writer). What
    changes is the storage: each ``step-N`` folder is a ckptfmt repository holding step N,
    written by :class:`bridges.dcp.CkptfmtStorageWriter` (crc32c per chunk, an atomic manifest,
    no pickle) and read by :class:`bridges.dcp.CkptfmtStorageReader` (verified, any world size).

    A folder is resumed from when its ckptfmt step is committed (a save that died half-way is
    skipped, as torchtitan skips a folder without DCP's ``.metadata``); DCP and HF folders still
    load through torchtitan's own path, so an ``initial_load_path`` in DCP's format keeps working.
    A ckptfmt refusal on a synchronous save or a load is raised as the ckptfmt error (DCP wraps
    it in a ``BaseException``); nothing is committed then. ``async_with_pinned_mem`` runs DCP's
    process-based async save, which needs a writer that pickles (torchtitan's own mode, passed
    through unchanged).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint policies, unchanged (a subclass declares its own Config so that
        ``build()`` constructs it)."""

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # a Hugging Face export: torchtitan's own safetensors path
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = CkptfmtStorageWriter(checkpoint_id, step=step_of(checkpoint_id),
                                      metadata={"producer": "torchtitan"})
        with torch.no_grad():
            if async_mode == AsyncMode.ASYNC:
                return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
            if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
            try:
                dcp.save(state_dict, storage_writer=writer)
            except CheckpointException as e:
                _raise_unwrapped(e)
                raise
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        try:
            step = step_of(checkpoint_id)
        except ValueError:
            step = None
        if from_hf or not ckptfmt.Repository(checkpoint_id).steps():  # HF or DCP folders: torchtitan's path
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        try:
            dcp.load(state_dict, storage_reader=CkptfmtStorageReader(checkpoint_id, step=step))
        except CheckpointException as e:
            _raise_unwrapped(e)
            raise
        if MODEL in self.states:  # torchtitan flattens the model's FQNs into the loaded dict
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The highest step whose folder holds a committed ckptfmt step (or, as torchtitan's own
        rule has it, DCP's ``.metadata`` or an HF index); -1 if none."""
        folder = folder or self.folder
        best = super()._find_load_step(folder)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                m = _STEP_DIR.search(name)
                if m and int(m.group(1)) > best and _committed(os.path.join(folder, name), int(m.group(1))):
                    best = int(m.group(1))
        return best
