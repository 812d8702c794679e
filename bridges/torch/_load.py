"""The PyTorch bridge's restore verbs (:func:`load`, :func:`load_extra`, :func:`load_rank_state`),
re-exported by :mod:`bridges.torch`.

The plan is the core's (:func:`ckptfmt.restoreplan.plan_restore`, the one planner of every
bridge); this module only turns target values into :class:`TargetLeaf`s and local boxes, and
verified blocks into tensors (bridges/README.md, "The restore semantics").
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping as TMapping

import numpy as np
import torch

from ckptfmt import agree_step
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.gcpause import pausing_gc
from ckptfmt.errors import InvalidStateError
from ckptfmt.interop import open_source
from ckptfmt.rankstate import RankStatePolicy
from ckptfmt.reader import CoopStats
from ckptfmt.repository import Repository
from ckptfmt.restoreplan import RestorePlan, RestoreReport, RestoreSource, TargetLeaf, plan_restore

from bridges._contract import (UNSET, caller_rank_state, check_topology, effective_policy, read_batches, renamed_keyword,
                        restore_stats)
from bridges.torch._conv import (_OBJECTS, _flatten, _local, _rank, _rebuild, _target_boxes, _world, _wrap_like, dtype_name,
                         from_numpy)
from bridges.torch._coord import for_group
from bridges.torch._share import TorchExchange, collectives_pay, replicated_over_ranks
from bridges.mapping._mapping import KeptValuesWarning, Mapping

__all__ = ["load", "load_extra", "load_rank_state", "Loaded"]


def _open(url: str, step: int | None) -> RestoreSource:
    """Open ``step``, or the latest step as rank 0 sees it, agreed by every rank (ckptfmt.agree_step:
    rank 0's listing error reaches every rank at once); or a safetensors source (ckptfmt.interop)."""
    return open_source(url, step, resolve=_step_everyone_opens)


def _step_everyone_opens(repo: Repository, step: int | None) -> int | None:
    if step is None and _world() > 1:
        return agree_step(repo, None, for_group())
    return step


class Loaded(dict):
    """The loaded state dict (same nesting as the target) plus what the load found.

    ``report``: the restore's :class:`ckptfmt.restoreplan.RestoreReport` (loaded, kept, missing,
    unexpected keys, notes, casts; also ``stats["report"]``, as in every bridge).
    ``missing_keys`` / ``unexpected_keys``: the same lists. ``extra``: the global ``extra`` saved
    with the checkpoint. ``rank_state`` / ``rng``: this rank's saved per-rank state (the caller's
    ``rank_state`` and the torch RNG states; at another world size per ``rank_state_policy``).
    ``rank_extra``: the deprecated name of ``rank_state``. ``bytes_read``: tensor bytes this rank
    read (chunk data, checksums and shard indexes); ``objects_read``: how many shard objects it read from;
    ``batches``: how many read batches (of about RESTORE_BATCH_BYTES) the load took;
    ``cooperative``: what a cooperative load shared (FORMAT.md 9.1; :class:`ckptfmt.reader.CoopStats`
    as a dict: ``cooperative``, ``shared_boxes``, ``rounds``, ``bytes_sent``, ``bytes_received``, ``served``).
    """

    step: int
    report: RestoreReport
    missing_keys: list[str]
    unexpected_keys: list[str]
    extra: Any
    rank_state: Any
    rng: Any
    saved_world: int
    bytes_read: int
    objects_read: int
    batches: int
    cooperative: dict[str, Any]

    @property
    def rank_extra(self) -> Any:
        warnings.warn("Loaded.rank_extra is deprecated and will be removed in the next release; use Loaded.rank_state",
                      DeprecationWarning, stacklevel=2)
        return self.rank_state


def _leaf(key: str, v: Any) -> TargetLeaf:
    if isinstance(v, torch.Tensor):
        return TargetLeaf(key, "array", tuple(v.shape), numpy_dtype(dtype_name(v.dtype, key)))
    return TargetLeaf(key, "object")


@pausing_gc
def load(url: str, target: TMapping[str, Any], *, step: int | None = None, rank_state_policy: str | None = None,
         mapping: Mapping | None = None, strict: bool | None = None, rank_policy: Any = UNSET,
         stats: dict[str, Any] | None = None, cooperative: bool | None = None) -> Loaded:
    """Load checkpoint ``step`` (default: the latest) into new tensors shaped like ``target``.

    With ``step=None`` on several ranks, every rank must call ``load``: rank 0 picks the latest
    step and broadcasts it (or the error it hit listing the repository), so all ranks read the
    same one.

    ``target``'s values say what is wanted: global shape, dtype, device, and for DTensors the mesh
    and placements. ``mapping`` renames keys and transforms layouts (see :mod:`bridges.mapping`,
    :mod:`bridges.presets`); without one, keys must be equal. Each rank reads only the source
    boxes its target values need. ``url`` may also name a safetensors file or directory
    (``save_pretrained``'s): it is read in place (``ckptfmt.interop``).

    The restore semantics of every bridge (bridges/README.md; ``ckptfmt.restoreplan``): checkpoint
    keys the target does not name are a partial restore, reported (``strict=True``: an error);
    target keys the checkpoint lacks raise unless ``strict=False``, which keeps the target's value,
    reports it and warns with KeptValuesWarning; a dtype of the same kind (float to float, int to
    int) is cast to the target's and reported (``report.cast``), across kinds it is an error.
    Every mismatch of the load is raised in ONE error (KeyMismatchError, ShapeMismatchError or
    MappingError when it is the only kind, RestoreMismatchError otherwise) with the full lists as
    its attributes, before anything is read; corrupt data raises the core's CheckpointError, and
    nothing is returned before every batch of reads is verified.

    Per-rank state (``rank_state``, ``rng``) saved by another number of ranks: when the save was
    given a ``rank_state``, raises TopologyChangedError, naming the policies, before any tensor is
    read, unless ``rank_state_policy`` is "drop" (None), "rank0" (rank 0's) or "same-rank"; when it
    was not (only the RNG states the bridge recorded), the restore goes on with ``rng`` None unless
    a policy asks for them. Any other ``rank_state_policy`` raises ValueError before anything is
    opened. ``rank_policy`` is its deprecated name (DeprecationWarning).

    ``cooperative`` (FORMAT.md 9.1; bridges/README.md "Cooperative restore"): a box that several
    ranks load is read from storage by one of them, verified, and sent to the others over the
    default process group. None (the default): on when a target DTensor spans every rank with a
    Replicate placement over more than one rank (a DTensor load is collective); True: on for any
    load on several ranks (plain tensors every rank holds, as under DDP; every rank must call
    ``load``); False: every rank reads all it needs itself. A read that fails on any rank raises
    the same typed error on every rank, and no rank returns anything.

    ``stats``, if given, is filled as in every bridge: ``step``, ``report``, ``extra``,
    ``rank_state``, ``batches``, ``bytes_read`` (bytes this rank read from storage), ``cooperative``
    (:class:`ckptfmt.reader.CoopStats` as a dict, also ``Loaded.cooperative``). ``target`` is never
    modified.
    """
    given = renamed_keyword("load", "rank_policy", "rank_state_policy", rank_policy, rank_state_policy)
    policy = RankStatePolicy.of(given)  # the one check: a usage error, raised before anything is opened
    ckpt = _open(url, step)
    gstate = ckpt.state() or {}
    policy = _policy(ckpt, gstate, policy)
    check_topology(ckpt, _world(), policy)
    saved_objects = _saved_objects(gstate)
    flat = list(_flatten(target))
    plan = plan_restore(ckpt, [_leaf(k, v) for k, v in flat], mapping, strict, objects=saved_objects)
    before, objects_before = _stat(ckpt, "bytes_read"), _stat(ckpt, "objects")
    coop = CoopStats()
    exchange = TorchExchange() if _cooperates(cooperative, flat) else None
    values, batches = _read(ckpt, plan, dict(flat), saved_objects, exchange, coop)

    out = Loaded(_rebuild(target, values))
    out.step = ckpt.step
    out.report = plan.report
    out.missing_keys, out.unexpected_keys = list(plan.report.missing), list(plan.report.unexpected)
    out.extra = gstate.get("extra") if isinstance(gstate, dict) else None
    out.saved_world = int(ckpt.saved_world)
    rs = ckpt.rank_state(_rank(), world=_world(), policy=policy) or {}
    out.rank_state = rs.get("extra") if isinstance(rs, dict) else None
    out.rng = ((rs.get("torch") or {}).get("rng")) if isinstance(rs, dict) else None
    out.bytes_read = _stat(ckpt, "bytes_read") - before
    out.objects_read = _stat(ckpt, "objects") - objects_before
    out.batches = batches
    out.cooperative = coop.as_dict()
    if stats is not None:
        stats.update(restore_stats(plan, extra=out.extra, rank_state=out.rank_state, batches=batches,
                                   bytes_read=out.bytes_read), cooperative=out.cooperative)
    message = plan.report.warning()
    if message:
        warnings.warn(message, KeptValuesWarning, stacklevel=2)
    return out


def _cooperates(cooperative: bool | None, flat: list[tuple[str, Any]]) -> bool:
    """Whether this load is cooperative (see :func:`load`): the same answer on every rank."""
    if cooperative is False or _world() == 1:
        return False
    if cooperative:
        return True
    return collectives_pay() and replicated_over_ranks(flat, _world())


def _read(ckpt: RestoreSource, plan: RestorePlan, targets: dict[str, Any], saved: dict[str, Any], exchange: Any = None,
          coop: CoopStats | None = None) -> tuple[dict[str, Any], int]:
    """Every target value: saved objects, kept values, and tensors read in verified batches
    (``exchange``: a cooperative load, FORMAT.md 9.1)."""
    values: dict[str, Any] = {k: saved[src] for k, src in plan.objects.items()}
    values.update({k: targets[k] for k in plan.kept})
    pieces: dict[str, list[tuple[Any, Any, list]]] = {}
    for tp in plan.tensors:
        v = targets[tp.key]
        boxes = _target_boxes(v, tp.key)
        if boxes is None:  # this rank holds no part of the DTensor
            values[tp.key] = v
            continue
        pieces[tp.key] = [(b, where, tp.reads(b)) for b, where in boxes]
        if not any(reads for _, _, reads in pieces[tp.key]):  # an empty local box: nothing to read
            local = _local(v)
            values[tp.key] = _wrap_like(v, torch.empty(tuple(local.shape), dtype=v.dtype, device=local.device))
            del pieces[tp.key]
    order = list(pieces)
    batches = 0
    groups = [[r for _, _, rs in pieces[k] for r in rs] for k in order]
    for batch in read_batches(ckpt, groups, exchange=exchange, coop=coop):
        batches += 1
        for i in batch.groups:
            key = order[i]
            tp, v = plan.by_key[key], targets[key]
            arr = _assemble(tp, pieces[key], batch.blocks, tuple(_local(v).shape))
            reads = [r for _, _, rs in pieces[key] for r in rs]
            if any(r in batch.shared for r in reads) and any(np.shares_memory(arr, batch.blocks[r]) for r in reads):
                arr = arr.copy()  # a block read once for several keys: no two tensors share memory
            values[key] = _wrap_like(v, from_numpy(arr, v.dtype, _local(v).device))
    return values, batches


def _assemble(tp: Any, pieces: list[tuple[Any, Any, list]], blocks: TMapping[Any, np.ndarray],
              local_shape: tuple[int, ...]) -> np.ndarray:
    """The local array of a target value from its pieces' verified blocks."""
    if len(pieces) == 1 and pieces[0][1] is None:
        box, _, reads = pieces[0]
        return tp.assemble(box, [blocks[r] for r in reads])
    out = np.empty(local_shape, dtype=tp.dtype)
    for box, where, reads in pieces:
        if reads:
            out[where] = tp.assemble(box, [blocks[r] for r in reads])
    return out


def load_extra(url: str, step: int | None = None) -> Any:
    """The ``extra`` value saved with step ``step`` (None: the latest, agreed as in :func:`load`);
    None if none was saved. Raises StepNotFoundError, or the core's error for an unreadable state."""
    st = _open(url, step).state() or {}
    return st.get("extra") if isinstance(st, dict) else None


def load_rank_state(url: str, step: int | None = None, *, rank_state_policy: str | None = None) -> Any:
    """This rank's ``rank_state`` (as passed to ``save``) of step ``step``, under the
    topology-change policy of :func:`load`; None when none was saved. The RNG states come with
    :func:`load` (``Loaded.rng``). Raises ValueError for an unknown policy before anything is
    opened, and TopologyChangedError (naming the policies) at another world size without one
    when the save was given a ``rank_state`` (None otherwise: nothing was asked for).
    """
    policy = RankStatePolicy.of(rank_state_policy)  # the one check, before anything is opened
    ckpt = _open(url, step)
    rs = ckpt.rank_state(_rank(), world=_world(), policy=_policy(ckpt, ckpt.state() or {}, policy))
    return rs.get("extra") if isinstance(rs, dict) else None


def _policy(ckpt: RestoreSource, gstate: Any, policy: RankStatePolicy | None) -> RankStatePolicy | None:
    """The per-rank-state policy of a restore (bridges._contract.effective_policy): a checkpoint
    whose ``torch.rank_state`` is false holds only the bridge's RNG states per rank, which another
    world size drops unless ``policy`` asks for them. A checkpoint without the flag (written before
    it existed, or by another profile) is taken to hold the caller's per-rank state."""
    return effective_policy(ckpt, _world(), policy, caller_state=caller_rank_state(gstate))


def _saved_objects(gstate: Any) -> dict[str, Any]:
    """``torch.objects`` of the global state (FORMAT.md 13.3); {} for a checkpoint of no profile."""
    record = gstate.get(_OBJECTS[0]) if isinstance(gstate, dict) else None
    if record is None:
        return {}
    objects = record.get(_OBJECTS[1]) if isinstance(record, dict) else None
    if not isinstance(objects, dict):
        raise InvalidStateError("the torch profile record of the global state is malformed: "
                                "torch.objects must be a map", key="torch/objects", expected="map",
                                found=type(objects).__name__ if isinstance(record, dict) else type(record).__name__)
    return objects


def _stat(ckpt: RestoreSource, name: str) -> int:
    stats = getattr(ckpt, "stats", None)
    if stats is None:
        return 0
    return int(stats.get(name, 0) if isinstance(stats, dict) else getattr(stats, name, 0))
