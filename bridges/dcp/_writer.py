"""``CkptfmtStorageWriter``: ``torch.distributed.checkpoint.save`` / ``async_save`` into one
committed ckptfmt step.

Call order (DCP drives it, every rank unless noted): ``reset`` -> ``set_up_storage_writer`` ->
``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` -> ``write_data`` ->
(coordinator) ``finish``.

* ``write_data`` takes the state dict from DCP's planner, as DCP's ``DefaultSavePlanner`` holds
  it (flattened, with the mapping back to the nested paths), rebuilds the nesting and saves it
  with the torch profile (FORMAT.md 13.3) through :func:`bridges.torch.save`: the same two-phase
  commit as every ckptfmt save (private writes, crc32c per chunk, verified, every rank
  acknowledging, one atomic manifest), balanced writes of replicated data, DTensor boxes by
  global coordinates. It is collective: every rank's ``write_data`` returns once the step is
  committed, or raises the same CheckpointError (nothing committed).
* Non-tensor values (optimizer ``param_groups``, a scheduler's or a data loader's state, what a
  ``Stateful`` returns) are stored as msgpack state, never as ``torch.save`` pickles: DCP's
  ``BYTE_IO`` items are not serialized at all. A value msgpack cannot hold raises
  InvalidStateError naming its key path before anything is written.
* ``finish`` checks that the step is committed; no DCP ``.metadata`` (a pickle) is written.
  The ``WriteResult`` of each item names the tensor or state it went to.

``dcp.load(state_dict, storage_reader=CkptfmtStorageReader(url))`` then restores all of it at
any world size, non-tensor values included; so do :func:`bridges.torch.load` and
``bridges.jax.restore`` (the keys are the torch profile's).

**Process-based async save.** ``dcp.async_save(state, storage_writer=writer,
async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` (with or without an ``async_stager=
DefaultStager(StagingOptions(...))``) pickles the writer into DCP's checkpoint process, which
joins its own gloo process group and runs ``dcp.save`` there; the commit above then happens in
that process, so a training process killed once staging has returned leaves either the committed
step or no step at all (never a listed partial one). What travels is the writer's destination and
options only (``url``, ``step``, ``extra``, ``metadata``, ``options``): no manifest, handle or
storage object. Pickling refuses (InvalidOptionError) an ``extra`` or ``metadata`` that is not
plain JSON, and ``SaveOptions.timings`` (the checkpoint process's timings would never come back).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import ckptfmt
from ckptfmt.errors import CheckpointError, IncompleteSaveError, InvalidOptionError

from bridges.torch._api import save

__all__ = ["CkptfmtStorageWriter"]

#: What a pickled writer carries to DCP's checkpoint process: its destination and options.
_PICKLED = ("url", "step", "extra", "options", "metadata")


def _nested(planner: SavePlanner) -> dict[str, Any]:
    """The state dict the caller passed to ``dcp.save``, rebuilt from the planner's flat one."""
    flat = getattr(planner, "state_dict", None)
    if not isinstance(flat, Mapping):
        raise CheckpointError("the DCP save planner holds no state dict; use DefaultSavePlanner or a subclass",
                              object=type(planner).__name__, expected="planner.state_dict", found="none")
    mappings = getattr(planner, "mappings", None)
    if not getattr(planner, "flatten_state_dict", False) or not mappings:
        return dict(flat)
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = mappings.get(fqn, (fqn,))
        node = out
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
            if not isinstance(node, dict):
                raise CheckpointError("DCP paths overlap: a value and a container share a key path",
                                      key="/".join(str(p) for p in path), expected="distinct paths", found=fqn)
        node[str(path[-1])] = value
    return _lists(out)


def _holds_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, dict):
        return any(_holds_tensor(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds_tensor(v) for v in tree)
    return False


def _lists(tree: Any) -> Any:
    """DCP flattens a list of dicts into indexed paths (``param_groups.0.lr``): a map whose keys
    are exactly 0..n-1 and that holds no tensor becomes a list again, so that ``param_groups`` is
    one object, as :func:`bridges.torch.save` stores it. A map holding tensors (an optimizer's
    ``state`` keyed by parameter index) stays a map with decimal-string keys (FORMAT.md 13.3)."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: _lists(v) for k, v in tree.items()}
    if tree and all(k.isdigit() for k in tree) and sorted(int(k) for k in tree) == list(range(len(tree))):
        if not _holds_tensor(tree):
            return [tree[str(i)] for i in range(len(tree))]
    return tree


class CkptfmtStorageWriter(StorageWriter):
    """Write DCP's state dict as ckptfmt step ``step`` of repository ``url`` (created if absent).

    ``extra`` (JSON-able) goes to the global state as with :func:`bridges.torch.save`;
    ``options`` is a :class:`ckptfmt.SaveOptions`. The RNG states are not recorded (DCP saves
    what the state dict holds); a restore on any world size needs no policy.
    """

    def __init__(self, url: str | os.PathLike | None = None, step: int | None = None, *, extra: Any = None,
                 options: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.step = step
        self.extra, self.options, self.metadata = extra, options, dict(metadata or {})
        self.manifest: ckptfmt.Manifest | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The writer's destination and options, for DCP's checkpoint process (``PROCESS`` async
        save). Raises InvalidOptionError for a value that is not plain data (nothing is pickled)."""
        for name in ("extra", "metadata"):
            try:
                json.dumps(getattr(self, name), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise InvalidOptionError("a CkptfmtStorageWriter crossing to DCP's checkpoint process carries plain "
                                         "JSON only; pass JSON-able values", key=name, object=self.url,
                                         expected="JSON-able", found=str(exc)) from None
        if self.options is not None:
            if not isinstance(self.options, ckptfmt.SaveOptions):
                raise InvalidOptionError("CkptfmtStorageWriter options must be a ckptfmt.SaveOptions", key="options",
                                         object=self.url, expected="SaveOptions", found=type(self.options).__name__)
            if self.options.timings is not None:
                raise InvalidOptionError("SaveOptions.timings cannot cross to DCP's checkpoint process: the timings "
                                         "that process adds would never come back; drop timings for a PROCESS "
                                         "async_save", key="options.timings", object=self.url,
                                         expected=None, found="a dict")
        return {name: getattr(self, name) for name in _PICKLED}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != set(_PICKLED):
            raise InvalidOptionError("not a pickled CkptfmtStorageWriter", object="CkptfmtStorageWriter",
                                     expected=sorted(_PICKLED), found=sorted(state) if isinstance(state, Mapping)
                                     else type(state).__name__)
        self.__init__(state["url"], state["step"], extra=state["extra"],  # type: ignore[misc]
                      options=state["options"], metadata=state["metadata"])

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.url is None:
            raise ValueError("CkptfmtStorageWriter needs a repository url (or checkpoint_id)")
        if self.step is None or int(self.step) < 0:
            raise ValueError(f"CkptfmtStorageWriter needs step=N >= 0, got {self.step!r}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans  # ckptfmt plans the shards itself, from every rank's global boxes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        state = _nested(planner)
        self.manifest = save(self.url, state, step=int(self.step), extra=self.extra, save_rng=False,  # type: ignore[arg-type]
                             metadata=self.metadata, options=self.options)
        results = [WriteResult(index=item.index, size_in_bytes=0,
                               storage_data={"step": int(self.step), "fqn": item.index.fqn}) for item in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        steps = ckptfmt.Repository(self.url).steps()  # type: ignore[arg-type]
        if int(self.step) not in steps:  # type: ignore[arg-type]
            raise IncompleteSaveError("DCP finished but the ckptfmt step is not committed",
                                      object=self.url, expected=f"step {self.step} listed", found=steps[-3:])

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

