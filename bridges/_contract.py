"""What every bridge shares, so that the bridges answer the same questions the same way
(bridges/README.md, "The bridge contract"): the per-rank-state default on a topology change, the
batched restore that bounds host memory, and the deprecated keyword aliases.

Framework-free: numpy and the core only.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ckptfmt import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import InvalidStateError
from ckptfmt.rankstate import RankStatePolicy, rank_state_source
from ckptfmt.reader import cooperative_reads
from ckptfmt.restoreplan import RestoreSource
from ckptfmt.state import decode_state, encode_state

__all__ = ["RESTORE_BATCH_BYTES", "Batch", "read_batches", "check_topology", "renamed_keyword",
           "UNSET", "effective_policy", "caller_rank_state", "state_profile", "refuse_tier_state", "stage_state",
           "restore_stats"]

#: Host bytes read per batch during restore: bounds the host copies alive at once. Read at each
#: call, so a process may set it (``bridges._contract.RESTORE_BATCH_BYTES = ...``) for every bridge.
RESTORE_BATCH_BYTES = 64 << 20

Request = tuple[str, Box]


def effective_policy(ckpt: RestoreSource, world: int, policy: RankStatePolicy | None, *,
                     caller_state: bool = True) -> RankStatePolicy | None:
    """The per-rank-state policy a restore applies: ``policy`` (validated by the public verb,
    :meth:`RankStatePolicy.of`) as given, except that a restore on another number of processes,
    with no policy, of a checkpoint whose per-rank state holds nothing the caller asked to save
    (``caller_state=False``: only what a bridge recorded itself, such as the torch RNG states)
    drops that state (DROP) instead of raising: per-rank state the caller did not ask for must not
    stop a restore of what it did ask for (bridges/README.md; the narrowing FORMAT.md 13.3 allows)."""
    if policy is None and not caller_state and int(ckpt.saved_world) != world:
        return RankStatePolicy.DROP
    return policy


def caller_rank_state(gstate: Any) -> bool:
    """Whether a checkpoint's per-rank state holds what a caller asked to save: False only when the
    torch profile's record says ``rank_state: false`` (only the RNG states the torch bridge recorded
    itself; FORMAT.md 13.3). A checkpoint without the flag (older, or of another profile) is taken
    to hold the caller's state. Both bridges pass this to :func:`effective_policy`.

    InvalidStateError when the flag is present and not a boolean (FORMAT.md 13.3): a ``0`` or a
    ``"false"`` must not decide which per-rank state a restore drops."""
    refuse_tier_state(gstate)
    record = gstate.get("torch") if isinstance(gstate, dict) else None
    if isinstance(record, dict) and "rank_state" in record and not isinstance(record["rank_state"], bool):
        raise InvalidStateError("the torch profile record of the global state is malformed: "
                                "torch.rank_state must be a boolean", key="torch/rank_state", expected="bool",
                                found=f"{type(record['rank_state']).__name__} {record['rank_state']!r}"[:80])
    return not (isinstance(record, dict) and record.get("rank_state") is False)


def state_profile(gstate: Any) -> str | None:
    """The profile a global state root follows (FORMAT.md 13.1): "jax" (a ``bridge`` member),
    "torch" (a ``torch`` member), "tier" (a local-tier step, 8.5: exactly the members ``global``
    and ``tiers``, the latter a map), or None (no profile). Only the root's members decide: what
    they hold is each bridge's to check."""
    if not isinstance(gstate, dict):
        return None
    if set(gstate) == {"global", "tiers"} and isinstance(gstate["tiers"], dict):
        return "tier"
    return "jax" if "bridge" in gstate else "torch" if "torch" in gstate else None


def refuse_tier_state(gstate: Any) -> None:
    """InvalidStateError when ``gstate`` is a local-tier step's (FORMAT.md 13.1, 8.5): its tensors
    are named ``h<owner>/<n>`` and mean something only through ``tiers.boxes``, so a bridge's plain
    restore of it would find none of the caller's key paths. It is restored through the checkpoint
    manager's tiers, which unwrap ``global``."""
    if state_profile(gstate) == "tier":
        raise InvalidStateError("this is a local-tier step (FORMAT.md 8.5): restore it through the checkpoint "
                                "manager's tiers, not a bridge's restore", key="tiers", expected="a JAX or PyTorch "
                                "profile state (13.1)", found="{global, tiers}")


def stage_state(global_state: Any, per_rank: Any, metadata: Any = None, *, blocking: bool) -> tuple[Any, Any, Any]:
    """The non-tensor state of a save as every bridge stages it, in the caller's thread before the
    save call returns (bridges/README.md, "Saving"): the global and per-rank state are encoded here,
    so a value msgpack cannot hold raises InvalidStateError naming its key path at the call, before
    any collective and before any shard is written. For ``blocking=False`` the three come back as
    snapshots (the state decoded from those bytes, the metadata deep-copied): numpy arrays in
    ``extra`` / ``rank_state`` that the caller mutates after the call do not reach the save."""
    blobs = encode_state(global_state), encode_state(per_rank)
    if blocking:
        return global_state, per_rank, metadata
    return decode_state(blobs[0]), decode_state(blobs[1]), copy.deepcopy(metadata)


def restore_stats(plan: Any, *, extra: Any, rank_state: Any, batches: int, bytes_read: int) -> dict[str, Any]:
    """What every bridge's restore puts in ``stats`` (the same names and shapes): ``step``, the
    :class:`ckptfmt.restoreplan.RestoreReport` as ``report``, the global ``extra`` saved with the
    step, this process's ``rank_state`` (under the restore's policy), ``batches`` and ``bytes_read``."""
    return {"step": int(plan.step), "report": plan.report, "extra": extra, "rank_state": rank_state,
            "batches": int(batches), "bytes_read": int(bytes_read)}


def check_topology(ckpt: RestoreSource, world: int, policy: RankStatePolicy | None) -> None:
    """The contract's default for per-rank state: raise when it has no owner. The core decides
    (:func:`ckptfmt.rankstate.rank_state_source`, FORMAT.md 7.4), so a bridge raises the core's
    TopologyChangedError, with its message, when ``ckpt`` holds per-rank state saved by a different
    number of processes than ``world`` and ``policy`` is None. Otherwise returns and reads nothing.
    """
    rank_state_source(getattr(ckpt.manifest, "state", {}) or {}, step=ckpt.step, saved_world=int(ckpt.saved_world),
                      rank=0, world=world, policy=policy)


@dataclass(frozen=True)
class Batch:
    """One batch of a batched restore, every byte verified.

    ``groups``: the indices (into the caller's groups) this batch completes. ``blocks``: the array
    of each request of those groups. ``shared``: requests that several groups of this batch asked
    for; they are read once, so a caller that hands arrays out without copying must copy these.
    """

    groups: tuple[int, ...]
    blocks: dict[Request, np.ndarray]
    shared: frozenset[Request]


def read_batches(ckpt: RestoreSource, groups: Sequence[Sequence[Request] | None], *,
                 batch_bytes: int | None = None, exchange: Any = None, coop: Any = None) -> Iterator[Batch]:
    """Read every group's requests (one group per restored value) in batches of about
    ``batch_bytes`` host bytes (default: RESTORE_BATCH_BYTES), yielding each :class:`Batch` once
    its bytes are verified.

    A group is never split; one larger than ``batch_bytes`` is a batch of its own. Empty and None
    groups are skipped (the caller builds those values itself). The next batch is being read
    while the caller builds one (``Checkpoint.iter_read_boxes``), so at most about two batches of
    host copies exist at a time.

    Fails closed: a fault in any batch raises from the iterator (a CheckpointError of the core
    reader), so a caller must not return anything it built before the iterator is exhausted.
    Closing the iterator early stops the reader's threads.

    ``exchange`` (a :class:`ckptfmt.reader.Exchange`): a cooperative restore (FORMAT.md 9.1); every
    process of it calls this at the same point and drains the iterator; a box several processes
    need is read from storage by one of them and shared once verified (``coop``, a
    :class:`ckptfmt.reader.CoopStats`, counts what moved); a failed read on any process raises on
    every process.
    """
    limit = RESTORE_BATCH_BYTES if batch_bytes is None else int(batch_bytes)
    batches: list[list[int]] = []
    size = 0
    for i, reqs in enumerate(groups):
        if not reqs:
            continue
        nb = sum(b.size * numpy_dtype(ckpt.tensor(k).dtype).itemsize for k, b in reqs)
        if not batches or (batches[-1] and size + nb > limit):
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += nb
    per_batch: list[list[Request]] = []
    shared: list[frozenset[Request]] = []
    for batch in batches:
        seen: set[Request] = set()
        twice: set[Request] = set()
        for i in batch:
            for r in dict.fromkeys(groups[i]):  # type: ignore[union-attr]
                (twice if r in seen else seen).add(r)
        per_batch.append(list(dict.fromkeys(r for i in batch for r in groups[i])))  # type: ignore[union-attr]
        shared.append(frozenset(twice))
    if exchange is None:
        reader = ckpt.iter_read_boxes(per_batch)
    else:
        reader = cooperative_reads(ckpt, per_batch, exchange, stats=coop)
    try:
        for batch, reqs, twice in zip(batches, per_batch, shared):
            arrays = next(reader)  # every byte of this batch is verified before it is yielded
            yield Batch(tuple(batch), dict(zip(reqs, arrays)), twice)
            del arrays
        if exchange is not None:
            next(reader, None)  # drains: the rounds of peers with more batches run here
    finally:
        reader.close()  # stops the reader's threads on every path


def renamed_keyword(func: str, old: str, new: str, old_value: Any, new_value: Any, default: Any = None) -> Any:
    """The value of keyword ``new`` when the caller may still pass its deprecated name ``old``.

    Warns DeprecationWarning when ``old`` was given; TypeError when both were.
    """
    if old_value is UNSET:
        return new_value
    if new_value is not default:
        raise TypeError(f"{func}() got both {new}= and its deprecated name {old}=; pass {new}= only")
    warnings.warn(f"{func}(): {old}= is deprecated and will be removed in the next release; pass {new}=",
                  DeprecationWarning, stacklevel=3)
    return old_value


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


#: The default of a deprecated keyword: tells "not passed" from any value the caller may pass.
UNSET: Any = _Unset()
