"""The implementation behind :mod:`bridges.dcp` (its face re-exports the public names)."""
from __future__ import annotations

import copy
import os
from typing import Any, Callable

import torch
from torch.futures import Future
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

import ckptfmt
from ckptfmt import Box
from ckptfmt.errors import CheckpointError, KeyMismatchError
from ckptfmt.restoreplan import RestoreSource

from bridges.dcp._writer import CkptfmtStorageWriter
from bridges.torch._conv import _BY_NAME, from_numpy
from bridges.torch._load import _open, _saved_objects

__all__ = ["CkptfmtStorageReader", "CkptfmtStorageWriter", "unwrap"]

#: How deep an object's nested values are offered under their own fqns (DCP's flattening).
_OBJECT_DEPTH = 16


def unwrap(exc: BaseException) -> CheckpointError | None:
    """The ckptfmt error behind ``exc``: ``exc`` itself when it is a CheckpointError; for DCP's
    ``CheckpointException`` (a ``BaseException`` wrapping every failed rank's error) the first
    CheckpointError among its ``failures``, lowest rank first; else the one its ``__cause__``
    chain holds. None when there is none (DCP's own errors, a plain ``ValueError``). Never raises."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:  # breadth first: a rank's own error before what it was raised from
        e = todo.pop(0)
        if id(e) in seen:  # a cause chain that loops
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
        if isinstance(failures, dict):
            for rank in sorted(failures, key=lambda r: (0, r, "") if isinstance(r, int) else (1, 0, str(r))):
                wrapped = failures[rank]
                inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                if isinstance(inner, BaseException):
                    todo.append(inner)
        if isinstance(e.__cause__, BaseException):
            todo.append(e.__cause__)
    return None


def _default_fqn(key: str) -> str:
    return key.replace("/", ".")


class CkptfmtStorageReader(StorageReader):
    """Serve ckptfmt checkpoint ``step`` (default: latest) of repository ``url`` to DCP."""

    def __init__(self, url: str | os.PathLike | None = None, step: int | None = None, *,
                 fqn: Callable[[str], str] = _default_fqn) -> None:
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.step = step
        self.fqn = fqn
        self._ckpt: RestoreSource | None = None  # the bridges' one source protocol
        self._keys: dict[str, str] = {}  # DCP fqn -> checkpoint key
        self._objects: dict[str, Any] = {}  # DCP fqn -> a non-tensor value (torch.objects)
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._ckpt = None
        self._keys = {}
        self._objects = {}

    def _open(self) -> RestoreSource:
        if self._ckpt is None:
            if self.url is None:
                raise ValueError("CkptfmtStorageReader needs a repository url (or checkpoint_id)")
            self._ckpt = _open(self.url, self.step)  # every rank: the same step (ckptfmt.agree_step)
        return self._ckpt

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ckpt = self._open()
        md: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for key in sorted(ckpt.keys()):
            e = ckpt.tensor(key)
            name = self.fqn(key)
            if name in keys:
                raise KeyMismatchError("two checkpoint keys map to one DCP fqn", key=key,
                                       expected="distinct fqns", found=f"{keys[name]!r} and {key!r} -> {name!r}")
            keys[name] = key
            dtype = _BY_NAME.get(e.dtype)
            if dtype is None:  # pragma: no cover - every format dtype has a torch dtype
                raise CheckpointError("dtype has no torch equivalent", key=key, found=e.dtype)
            shape = tuple(int(n) for n in e.shape)
            shard_shape = tuple(e.array.shard_shape)
            offsets = e.shards.offset.reshape(len(e.shards), len(shape))
            chunks = []
            for off in offsets:
                off = tuple(int(o) for o in off)
                size = tuple(min(s, n - o) for s, n, o in zip(shard_shape, shape, off))
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
            if not shape:
                chunks = [ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))]
            md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                             size=torch.Size(shape), chunks=chunks)
        self._keys = keys
        self._objects = {}
        for key, value in _offered_objects(_saved_objects(ckpt.state() or {}), set(ckpt.keys())).items():
            for name, v in _object_fqns(self.fqn(key), value):
                if name in keys or name in self._objects:
                    continue  # a tensor's fqn wins; a nested value never shadows another object
                self._objects[name] = v
                md[name] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md,
                        storage_meta=StorageMeta(checkpoint_id=self.url, load_id=None))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if not self._keys:  # read_metadata ran on another rank only
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self._open()
        requests: list[tuple[str, Box]] = []
        objects = [item for item in plan.items if item.type != LoadItemType.TENSOR]
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                continue
            key = self._keys[item.storage_index.fqn]
            base = tuple(item.storage_index.offset or ())
            off = tuple(int(b) + int(s) for b, s in zip(base, item.storage_offsets))
            requests.append((key, Box(off, tuple(int(n) for n in item.lengths))))
        before = _bytes(ckpt)
        blocks = ckpt.read_boxes(requests) if requests else []  # every byte verified first
        self.bytes_read += _bytes(ckpt) - before
        for item in objects:
            _put_object(planner, item, self._objects)
        for item, block in zip([i for i in plan.items if i.type == LoadItemType.TENSOR], blocks):
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != tuple(block.shape):
                raise CheckpointError("DCP destination does not match the read box",
                                      key=item.storage_index.fqn, expected=tuple(block.shape),
                                      found=tuple(dest.shape))
            dest.copy_(from_numpy(block, dest.dtype))
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()  # reads are synchronous and already verified
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            return ckptfmt.Repository(os.fspath(checkpoint_id)).latest() is not None
        except Exception:
            return False


def _offered_objects(objects: dict[str, Any], tensor_keys: set[str]) -> dict[str, Any]:
    """The objects, plus each key-path prefix under which only objects lie, as the map of them:
    DCP asks for a ``Stateful`` (a data loader) or a map of plain values as one entry."""
    out = dict(objects)
    holds_tensor = {"/".join(k.split("/")[:i]) for k in tensor_keys for i in range(1, k.count("/") + 1)}
    for key in sorted(objects):
        parts = key.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in holds_tensor or prefix in objects:
                continue
            node = out.setdefault(prefix, {})
            if isinstance(node, dict):
                rest = parts[i:]
                for part in rest[:-1]:
                    node = node.setdefault(part, {})
                node[rest[-1]] = objects[key]
    return out


def _object_fqns(name: str, value: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """``(fqn, value)`` for an object and every value nested in it, as DCP names them."""
    out = [(name, value)]
    if depth >= _OBJECT_DEPTH:
        return out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.extend(_object_fqns(f"{name}.{k}", v, depth + 1))
    return out


def _put_object(planner: LoadPlanner, item: ReadItem, objects: dict[str, Any]) -> None:
    """Place a decoded non-tensor value where ``DefaultLoadPlanner.load_bytes`` would (no pickle)."""
    fqn = item.storage_index.fqn
    if fqn not in objects:
        raise KeyMismatchError("DCP asks for a non-tensor entry the checkpoint does not hold", key=fqn,
                               expected="an object of torch.objects", found="none")
    if not isinstance(planner, DefaultLoadPlanner):
        raise KeyMismatchError("non-tensor DCP entries are served to a DefaultLoadPlanner (or a subclass) "
                               "only; load them with bridges.torch.load", key=fqn,
                               expected="DefaultLoadPlanner", found=type(planner).__name__)
    value = copy.deepcopy(objects[fqn])  # two targets never share one decoded value
    dest = item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[dest], value)
    else:
        planner.state_dict[dest] = value


def _bytes(ckpt: RestoreSource) -> int:
    stats = getattr(ckpt, "stats", None)
    if stats is None:
        return 0
    return int(stats.get("bytes_read", 0) if isinstance(stats, dict) else getattr(stats, "bytes_read", 0))
