"""The torch manager's local tier (FORMAT.md 8.5): the peer exchange over a gloo group of its own,
and the tier hooks (host copies of the own boxes, the boxes a target needs, a ``Loaded`` built
from verified boxes).

The exchange sends one ``uint8`` tensor (after its length) with ``isend``/``irecv`` on a process
group created for the manager (``dist.new_group(backend="gloo")``, at construction, when every
rank constructs its managers in the same order): the local save's background thread never
shares a group with the training loop's collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from ckptfmt import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.checksum import crc32c
from ckptfmt.errors import CheckpointError, KeyMismatchError, ShapeMismatchError
from ckptfmt.restoreplan import RestorePlan, plan_restore
from ckptfmt.manager import as_bytes_view, check_payload, distinct_boxes

from bridges._contract import stage_state
from bridges._extra import json_keys
from bridges.torch._api import _shards
from bridges.torch._conv import _flatten, _local, _rebuild, _target_boxes, _wrap_like, dtype_name, from_numpy, rng_state
from bridges.torch._load import Loaded, _leaf, _saved_objects

__all__ = ["TorchPeerExchange", "snapshot", "requests", "build", "MappedTier", "mapped_requests", "mapped_build"]


class TorchPeerExchange:
    """:class:`ckptfmt.manager._tiers.PeerExchange` over point-to-point gloo sends."""

    background = True  # a process group of its own

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")

    def _swap(self, out: torch.Tensor, into: torch.Tensor, dst: int, src: int) -> None:
        reqs = [dist.isend(out, dst, group=self.group), dist.irecv(into, src, group=self.group)]
        for r in reqs:
            r.wait()

    def shift(self, name: str, payload: Any, offset: int) -> np.ndarray:
        """The size and crc32c go first; a payload whose crc32c differs from the sender's raises
        ChecksumMismatchError on the receiver (FORMAT.md 8.5). Returns the received bytes as a
        uint8 array (the receive buffer itself, no copy)."""
        dst, src = (self.rank + int(offset)) % self.world, (self.rank - int(offset)) % self.world
        buf = as_bytes_view(payload)
        if not buf.flags.writeable:  # torch wraps writable memory only (a bytes payload)
            buf = buf.copy()
        head = torch.zeros(2, dtype=torch.int64)
        self._swap(torch.tensor([buf.size, crc32c(buf)], dtype=torch.int64), head, dst, src)
        into = torch.empty(int(head[0].item()), dtype=torch.uint8)
        self._swap(torch.from_numpy(buf), into, dst, src)
        return check_payload(into.numpy(), int(head[1].item()), f"{name} from rank {src}")


def snapshot(state: Any, extra: Any, rank_state: Any, mapping: Any = None) -> tuple[list[Any], Any]:
    """This rank's boxes as host copies (each distinct box once; through ``mapping`` in the
    checkpoint's layout, as ``bridges.torch.save`` writes them), and the global state as the
    bridge's save stages it, with this rank's per-rank state under ``rank`` (FORMAT.md 8.5)."""
    shards, objects = _shards(state, copy=True, mapping=mapping)
    global_state = {"torch": {"objects": objects, "rank_state": rank_state is not None},
                    "extra": json_keys(extra, "extra"),
                    "rank": {"torch": {"rng": rng_state()}, "extra": json_keys(rank_state, "rank_state")}}
    global_state, _, _ = stage_state(global_state, None, None, blocking=False)
    return distinct_boxes(shards), global_state


def requests(target: Any) -> list[tuple[str, Box]] | None:
    """The boxes ``target``'s tensors need on this rank, or None when the tiers cannot serve it."""
    if not isinstance(target, Mapping):
        return None
    out: list[tuple[str, Box]] = []
    try:
        for key, v in _flatten(target):
            if isinstance(v, torch.Tensor):
                out.extend((key, b) for b, _ in (_target_boxes(v, key) or []))
    except (ValueError, TypeError):
        return None
    return list(dict.fromkeys(out))


def build(target: Any, values: Mapping[tuple[str, Box], np.ndarray], global_state: Any, step: int) -> tuple[Any, Any]:
    """A :class:`Loaded` like the one ``bridges.torch.load`` returns, from verified boxes (``report``
    None; ``rank_state`` / ``rng`` only when the own tier served the state). A dtype or shape that
    differs raises: the ordinary restore then runs."""
    gstate = global_state if isinstance(global_state, dict) else {}
    objects = _saved_objects(gstate)
    flat: dict[str, Any] = {}
    nbytes = 0
    for key, v in _flatten(target):
        if not isinstance(v, torch.Tensor):
            if key not in objects:
                raise KeyMismatchError("a non-tensor entry is not in the local step's state", key=key,
                                       expected="a saved entry", found="missing")
            flat[key] = objects[key]
            continue
        local = _local(v)
        dtype = numpy_dtype(dtype_name(v.dtype, key))
        parts = _target_boxes(v, key) or []
        arr = np.empty(tuple(local.shape), dtype=dtype)
        for box, where in parts:
            a = values[(key, box)]
            if a.dtype != dtype or tuple(a.shape) != box.shape:
                raise ShapeMismatchError("a local copy differs from the target", key=key, expected=f"{dtype} {box.shape}",
                                         found=f"{a.dtype} {tuple(a.shape)}")
            arr[where if where is not None else ...] = a
            nbytes += int(a.nbytes)
        flat[key] = _wrap_like(v, from_numpy(arr, v.dtype, local.device))
    return _loaded(target, flat, gstate, step, nbytes)


def _loaded(target: Any, flat: dict[str, Any], gstate: dict[str, Any], step: int, nbytes: int) -> tuple[Any, Any]:
    out = Loaded(_rebuild(target, flat))
    rank = gstate.get("rank") if isinstance(gstate.get("rank"), dict) else {}
    out.step, out.report, out.missing_keys, out.unexpected_keys = int(step), None, [], []
    out.extra, out.saved_world = gstate.get("extra"), dist.get_world_size() if dist.is_initialized() else 1
    out.rank_state, out.rng = rank.get("extra"), (rank.get("torch") or {}).get("rng")
    out.bytes_read, out.objects_read, out.batches = nbytes, 0, 1
    return out, out.extra


# ------------------------------------------------------------------ a target through a mapping


class _Held:
    """The local steps' global tensors as a :class:`ckptfmt.restoreplan.RestoreSource` the planner
    reads (names, shapes and dtypes only: the planner never reads data)."""

    step = -1

    def __init__(self, tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        self._t = {k: SimpleNamespace(shape=tuple(s), dtype=d) for k, (s, d) in tensors.items()}

    def keys(self) -> list[str]:
        return list(self._t)

    def tensor(self, key: str) -> Any:
        return self._t[key]


@dataclass(frozen=True)
class MappedTier:
    """What a target read through ``mapping`` needs from the tiers: the core's plan against the
    tensors the local steps hold, and the checkpoint boxes (``requests``) its local boxes read."""

    plan: RestorePlan
    requests: list[tuple[str, Box]]


def mapped_requests(target: Any, mapping: Any, tensors: Mapping[str, tuple[tuple[int, ...], str]] | None
                    ) -> MappedTier | None:
    """Plan ``target`` through ``mapping`` (``bridges.torch.load``'s planner and rules) against the
    held ``tensors``; None when the tiers cannot serve it (the ordinary restore then plans against
    the persistent step and reports any mismatch itself). Non-tensor target entries are planned as
    saved objects and checked in :func:`mapped_build`."""
    if not isinstance(target, Mapping) or not tensors:
        return None
    try:
        flat = list(_flatten(target))
        objects = [k for k, v in flat if not isinstance(v, torch.Tensor)]
        plan = plan_restore(_Held(tensors), [_leaf(k, v) for k, v in flat], mapping, objects=objects)
        targets = dict(flat)
        reqs = [r for tp in plan.tensors for b, _ in (_target_boxes(targets[tp.key], tp.key) or [])
                for r in tp.reads(b)]
    except (CheckpointError, ValueError, TypeError, KeyError):
        return None
    return MappedTier(plan, list(dict.fromkeys(reqs)))


def mapped_build(target: Any, tier: MappedTier, mapping: Any, values: Mapping[tuple[str, Box], np.ndarray],
                 global_state: Any, step: int) -> tuple[Any, Any]:
    """:func:`build` for a target read through a mapping: each local box assembled by the plan's
    transforms from the verified checkpoint boxes. A non-tensor entry the step did not save and the
    mapping does not keep raises KeyMismatchError (the ordinary restore then runs and reports it)."""
    gstate = global_state if isinstance(global_state, dict) else {}
    saved = _saved_objects(gstate)
    targets = dict(_flatten(target))
    flat: dict[str, Any] = {}
    for key in tier.plan.objects:
        if key not in saved and not mapping.is_kept(key):
            raise KeyMismatchError("a non-tensor entry is not in the local step's state", key=key,
                                   expected="a saved entry", found="missing")
        flat[key] = saved[key] if key in saved else targets[key]
    flat.update({k: targets[k] for k in tier.plan.kept})
    nbytes = 0
    for tp in tier.plan.tensors:
        v = targets[tp.key]
        parts = _target_boxes(v, tp.key)
        if parts is None:  # this rank holds no part of the DTensor
            flat[tp.key] = v
            continue
        local = _local(v)
        arr = np.empty(tuple(local.shape), dtype=tp.dtype)
        for box, where in parts:
            blocks = [values[r] for r in tp.reads(box)]
            a = tp.assemble(box, blocks) if blocks else np.empty(box.shape, tp.dtype)
            if tuple(a.shape) != box.shape:
                raise ShapeMismatchError("a local copy differs from the target", key=tp.key, expected=box.shape,
                                         found=tuple(a.shape))
            arr[where if where is not None else ...] = a
            nbytes += sum(int(b.nbytes) for b in blocks)
        flat[tp.key] = _wrap_like(v, from_numpy(arr, v.dtype, local.device))
    return _loaded(target, flat, gstate, step, nbytes)
