"""Step 3 of the save protocol (see :mod:`ckptfmt.session`): write this rank's shards and state
privately, verify them, and describe them in records the leader builds the manifest from.

One write scheduler serves every backend. It cuts each shard's block from the data this rank
holds, asks the reuse hook (an incremental save, FORMAT.md 8.4) in batches whether the shard is
referenced instead, and hands the rest to the process's writer threads, a few small objects per
task, within a sliding window of bytes in flight, paced and jittered as asked. A raw shard is
encoded here (:func:`ckptfmt.shard.encode`) and written whole with
:meth:`ckptfmt.storage.Storage.write_object` (on local files: ``pwritev`` straight from the
source arrays, ``fsync``, rename), then the save's prefix is :meth:`~ckptfmt.storage.Storage.sync`'d.
Each chunk's crc32c is that of the very bytes written, so the verification of FORMAT.md 8.1 phase 4
reduces to the object's length. A zstd shard is encoded by tensorstore's zarr3 codec through the
array, and read back whole and checked (:func:`ckptfmt.shard.verify_encoded`).

Nothing here decides whether the save commits: a failure raises, and the protocol reports it.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ckptfmt import layout
from ckptfmt.shard._codec import decoder_for
from ckptfmt.storage._durable import writer_pool
from ckptfmt.storage._kverrors import kv_errors
from ckptfmt._types import Box, LocalShard
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import IncompleteSaveError, StepMismatchError
from ckptfmt.manifest import StateEntry
from ckptfmt.plan import TensorWritePlan, WriteItem, stored_chunk_counts
from ckptfmt.shard import ShardRecord, chunk_crcs, encode, raw_shard_nbytes, shard_sizes, verify_encoded
from ckptfmt.state import encode_state
from ckptfmt.storage import Storage

__all__ = ["WriteSettings", "PhaseClock", "ShardJob", "write_and_verify", "write_state", "state_to_wire",
           "state_from_wire", "holders", "shard_block"]

#: Objects smaller than this are handed to the writer threads in groups (one task per few objects).
_SMALL_OBJECT_BYTES = 1 << 20
#: A batch of reuse decisions holds at most this fraction of ``max_inflight_bytes`` in blocks to write.
REUSE_BATCH_FRACTION = 0.25


@dataclass(frozen=True)
class WriteSettings:
    """What the scheduler needs of a save's options (the protocol builds it from SaveOptions)."""

    max_inflight_bytes: int = 128 << 20
    max_write_bytes_per_s: float | None = None
    jitter_s: float = 0.0
    codec: str = "raw"
    codec_level: int = 3
    packed: bool = False          # raw shards into pack objects (FORMAT.md 5.15)
    pack_bytes: int = 1 << 30


class PhaseClock:
    """Adds the seconds of each save phase into ``timings`` (when given); never changes the save."""

    def __init__(self, timings: dict[str, float] | None = None) -> None:
        self.timings = timings

    def add(self, phase: str, since: float) -> float:
        """Add ``now - since`` to ``timings[phase]``; returns now."""
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + now - since
        return now


def state_to_wire(e: StateEntry) -> list[Any]:
    return [e.name, e.key, e.nbytes, e.crc32c, e.scope, e.rank]


def state_from_wire(v: Any) -> StateEntry:
    return StateEntry(*v)


@dataclass(frozen=True)
class ShardJob:
    """One shard object to write: its plan and item, the source block, its object key, and each
    stored chunk's crc32c where the reuse check already computed them."""

    plan: TensorWritePlan
    item: WriteItem
    block: np.ndarray
    key: str
    crcs: tuple[int, ...] | None = None
    start: int = -1               # packed: the shard's offset in the pack object ``key``
    pack: int = -1                # packed: the pack's number


def _holder_order(s: LocalShard) -> tuple[bool, int]:
    return s.data is None, s.replica_id  # data-bearing, lowest replica id first


def _find_holder(shards: list[LocalShard], box: Box) -> LocalShard:
    for s in sorted(shards, key=_holder_order):
        if all(so <= bo and bo + bn <= so + sn for so, sn, bo, bn in zip(s.box.offset, s.box.shape, box.offset, box.shape)):
            return s
    raise StepMismatchError("this rank was assigned a shard it does not hold", key=shards[0].key if shards else None,
                            found=str(box))


def holders(mine: list[tuple[TensorWritePlan, WriteItem]], local: dict[str, list[LocalShard]]) -> list[LocalShard]:
    """The local shard each item is cut from (data-bearing, lowest replica id first), looked up
    once per item; an item whose box is exactly a held box (the usual case) needs no search."""
    exact: dict[str, dict[Box, LocalShard]] = {}
    out = []
    for p, it in mine:
        by_box = exact.get(p.key)
        if by_box is None:
            by_box = exact[p.key] = {}
            for s in sorted(local[p.key], key=_holder_order):
                by_box.setdefault(s.box, s)
        h = by_box.get(it.box)
        out.append(h if h is not None and h.data is not None else _find_holder(local[p.key], it.box))
    return out


#: The per-shard hook of an incremental save (:class:`ckptfmt.session._reuse.ReusePlanner`): called before
#: a shard is written with (plan, item, holder, materialize), where ``materialize()`` returns the
#: shard's source block (the very block then written) and its chunk crc32c (computed once, shared
#: with the write); ``materialize(False)`` may leave the crc32c out (None). It returns a
#: reference record (the shard is then not written) or None.
Materialize = Callable[..., tuple[np.ndarray, "list[int] | None"]]
ReuseHook = Callable[[TensorWritePlan, WriteItem, LocalShard, Materialize], "ShardRecord | None"]


class _RankWrites:
    """The state of one rank's shard writes: what it owns, the blocks cut so far, the records."""

    def __init__(self, storage: Storage, plans: list[TensorWritePlan], local: dict[str, list[LocalShard]],
                 save_id: str, rank: int, settings: WriteSettings, reuse: ReuseHook | None) -> None:
        self.storage, self.plans, self.save_id, self.settings, self.reuse = storage, plans, save_id, settings, reuse
        self.rank = rank
        self.mine = [(p, it) for p in plans for it in p.items_for(rank)]
        self.found = holders(self.mine, local)
        # A block made by a callable (lazy data: device-to-host copies, an import's source reads)
        # is let go after its last write is submitted, and counted as in flight until that write
        # is done (the writes view it): a save holds about one such block plus the window.
        self.lazy_last = {id(h): n for n, h in enumerate(self.found) if callable(h.data)}
        self.cache: dict[int, np.ndarray] = {}
        self.dt_cache: dict[str, np.dtype] = {}
        self.records: list[Any] = [None] * len(self.mine)
        self.referenced: list[ShardRecord] = []
        self.handles: dict[int, Any] = {}
        self.encoded: dict[int, tuple[int, ...]] = {}  # zstd: item -> its source chunks' crc32c
        self.threads = max(1, min(len(self.mine), storage.options.write_threads))
        # Packed (FORMAT.md 5.15): shards placed in this rank's packs in item order as their jobs
        # are made (on the scheduling thread); each pack opened when its first shard is placed.
        self.packs: list[Any] = []      # PackWriter per pack number
        self.pack_fill: list[int] = []  # bytes placed in each pack
        # A pack is finished as soon as no shard will be placed in it and its writes are done, so
        # that a pack gathered in memory (an object store's, :class:`ckptfmt.storage.PackWriter`)
        # is let go at once; such packs are at most the write window long.
        self.pack_pending: list[int] = []   # placed shards not yet written, per pack
        self.pack_size: dict[int, int] = {}  # finished packs' lengths
        self.pack_lock = threading.Lock()
        self.pack_limit = settings.pack_bytes if storage.packs_in_place else min(settings.pack_bytes, settings.max_inflight_bytes)
        self.stopped = threading.Event()  # set once this save ends: its queued objects are not written

    def decide(self, n: int) -> list[Any] | None:
        """The reuse decision for item ``n``: None when the hook referenced it (its record is kept),
        else what the check made of it, to write: [] (nothing yet), [block], or [block, chunk
        crc32c] (a shard it did not prove is written with these, not computed twice)."""
        made: list[Any] = []
        if self.reuse is None:
            return made
        (p, it), holder = self.mine[n], self.found[n]

        def with_crcs(crcs: bool = True) -> tuple[np.ndarray, list[int] | None]:
            if not made:
                made.append(shard_block(holder, p, it, self.cache, self.dt_cache))
            if crcs and len(made) < 2:
                made.append(chunk_crcs(made[0], p.geometry.chunk_shape))
            return made[0], made[1] if len(made) > 1 else None

        ref = self.reuse(p, it, holder, with_crcs)
        if ref is None:
            return made
        self.referenced.append(ref)
        if self.lazy_last.get(id(holder)) == n:
            self.cache.pop(id(holder), None)
        return None

    def job(self, n: int, made: list[Any]) -> tuple[ShardJob, int]:
        """Item ``n``'s job, and the bytes it holds while in flight."""
        (p, it), holder = self.mine[n], self.found[n]
        block = made[0] if made else shard_block(holder, p, it, self.cache, self.dt_cache)
        held = block.nbytes + (self.cache.pop(id(holder)).nbytes if self.lazy_last.get(id(holder)) == n else 0)
        crcs = tuple(made[1]) if len(made) > 1 else None
        if self.settings.packed:
            pack, start = self._place(raw_shard_nbytes(p.geometry, math.prod(stored_chunk_counts(p.geometry, it.box.offset))))
            return ShardJob(p, it, block, self.packs[pack].key, crcs, start, pack), held
        key = layout.shard_key(layout.array_path(self.save_id, p.index), it.cell)
        return ShardJob(p, it, block, key, crcs), held

    def _place(self, nbytes: int) -> tuple[int, int]:
        """(pack number, start) of the next shard of ``nbytes``: after the last one placed, or
        at the start of a new pack when it would take the current one past ``pack_bytes``."""
        if not self.packs or (self.pack_fill[-1] and self.pack_fill[-1] + nbytes > self.pack_limit):
            if self.packs:  # no more shards go into it: its placement's hold is released
                self._written(len(self.packs) - 1)
            self.packs.append(self.storage.open_pack(layout.pack_key(self.save_id, self.rank, len(self.packs))))
            self.pack_fill.append(0)
            self.pack_pending.append(1)  # the placement itself: released once the pack is left
        start = self.pack_fill[-1]
        self.pack_fill[-1] += nbytes
        with self.pack_lock:
            self.pack_pending[-1] += 1
        return len(self.packs) - 1, start

    def align_next(self) -> None:
        """The next shard placed starts a run of its own (a writer task's group): at a multiple of
        its pack's ``align`` (a new pack starts at 0), so that the run, padded to whole blocks, can
        go through O_DIRECT without touching another run's block (FORMAT.md 5.15 lets a writer
        leave such gaps); the last run's padding is then part of the pack's length."""
        if self.packs and self.packs[-1].align:
            align = self.packs[-1].align
            self.pack_fill[-1] = -(-self.pack_fill[-1] // align) * align

    def _written(self, i: int) -> None:
        """One write into pack ``i`` is done (or its placement closed); the last one finishes it."""
        with self.pack_lock:
            self.pack_pending[i] -= 1
            last = self.pack_pending[i] == 0
        if last:  # (after a failure the save's prefix is removed: a finished pack goes with it)
            self.pack_size[i] = self.packs[i].finish(self.pack_fill[i])

    def finish_packs(self) -> dict[str, int]:
        """Close the last pack (every write is done by now); each pack's key -> its length."""
        if self.packs and len(self.pack_size) < len(self.packs):
            self._written(len(self.packs) - 1)  # release the last pack's placement hold
        missing = [self.packs[i].key for i in range(len(self.packs)) if i not in self.pack_size]
        if missing:
            raise IncompleteSaveError("a pack object was not finished", object=missing[0], expected="finished",
                                      found="unfinished")
        return {pk.key: self.pack_size[i] for i, pk in enumerate(self.packs)}

    def abort_packs(self) -> None:
        for i, pk in enumerate(self.packs):
            if i not in self.pack_size:
                pk.abort()

    def run(self, group: list[tuple[ShardJob, int]]) -> None:
        """Write a group of shard objects one after another (in a writer thread), unless stopped;
        a group that is one aligned run of one pack goes in one direct write (:meth:`_run_direct`)."""
        if self.stopped.is_set():
            return
        first = group[0][0]
        if first.pack >= 0 and self.packs[first.pack].align and first.start % self.packs[first.pack].align == 0 and all(
                j.pack == first.pack for j, _ in group):
            self._run_direct(group)
            return
        for job, n in group:
            if self.stopped.is_set():
                return
            self.records[n] = self.write_one(job, n)

    def _run_direct(self, group: list[tuple[ShardJob, int]]) -> None:
        """One write of a group's shards, back to back from the first one's start (they were
        placed so, in one pack) through O_DIRECT; each shard's record as :meth:`write_one` gives."""
        encs, bufs, pos = [], [], group[0][0].start
        for job, n in group:
            p, it = job.plan, job.item
            if job.start != pos:  # not one run after all: shard by shard
                for j, k in group:
                    self.records[k] = self.write_one(j, k)
                return
            enc = encode(p.index, it.cell, job.block, p.geometry, it.box.offset, job.crcs)
            bufs.extend(enc.buffers())
            encs.append(enc)
            pos += enc.nbytes
        first = group[0][0]
        written = self.packs[first.pack].write_at(first.start, bufs, tensor=first.plan.key, direct=True)
        if written != pos - first.start:
            raise IncompleteSaveError("written pack run has an unexpected size", key=first.plan.key, object=first.key,
                                      expected=pos - first.start, found=written)
        for (job, n), enc in zip(group, encs):
            self.records[n] = dataclasses.replace(enc.record(), where=(job.key, job.start, -1))
            self._written(job.pack)

    def write_one(self, job: ShardJob, n: int) -> ShardRecord | None:
        """Write one shard object; its record (raw), or None (zstd: recorded once read back, and
        ``encoded[n]`` holds its source chunks' crc32c)."""
        p, it = job.plan, job.item
        if self.settings.codec != "raw":
            self.encoded[n] = job.crcs or tuple(chunk_crcs(job.block, p.geometry.chunk_shape))
            with kv_errors("write failed", key=p.key, object=job.key):
                self.handles[p.index][it.box.slices()].write(job.block, can_reference_source_data_indefinitely=True).result()
            return None
        enc = encode(p.index, it.cell, job.block, p.geometry, it.box.offset, job.crcs)
        if job.pack >= 0:  # its bytes at its start in the pack; the pack's length is checked once, finished
            rec = enc.verified(self.packs[job.pack].write_at(job.start, enc.buffers(), tensor=p.key), key=p.key, obj=job.key)
            self._written(job.pack)
            return dataclasses.replace(rec, where=(job.key, job.start, -1))
        return enc.verified(self.storage.write_object(job.key, enc.buffers(), tensor=p.key), key=p.key, obj=job.key)


def write_and_verify(storage: Storage, plans: list[TensorWritePlan], local: dict[str, list[LocalShard]],
                     save_id: str, rank: int, settings: WriteSettings, clock: PhaseClock,
                     reuse: ReuseHook | None = None) -> list[ShardRecord]:
    """Write this rank's shards (rank 0 also every array's zarr.json), make them durable, and
    verify them; shards the ``reuse`` hook references are not written, and come back as its
    records. Raises StepMismatchError for source data that does not match its declaration,
    StorageError when a write fails, IncompleteSaveError when a shard does not read back as written."""
    t = time.perf_counter()
    w = _RankWrites(storage, plans, local, save_id, rank, settings, reuse)
    raw = settings.codec == "raw"
    opened = {} if raw else {  # tensorstore encodes: the arrays must be open before the writes
        p.index: storage.open_array(layout.array_path(save_id, p.index), _metadata(p, settings), create=(rank == 0))
        for p in plans if rank == 0 or p.items_for(rank)}
    w.handles = {idx: _opened(fut, plans[idx], save_id) for idx, fut in opened.items()}
    # Rank 0 writes a raw array's zarr.json as one more object of the save (FORMAT.md 14.2, 1.2.6);
    # a packed save has none (FORMAT.md 6.1, 5.15).
    metadata = [writer_pool(w.threads).submit(_write_metadata, storage, plans[i:i + _METADATA_PER_TASK], save_id, settings)
                for i in range(0, len(plans), _METADATA_PER_TASK)] if raw and rank == 0 and not settings.packed else []
    if settings.jitter_s > 0 and w.mine:
        time.sleep(secrets.SystemRandom().uniform(0, settings.jitter_s))
    t = clock.add("plan", t)
    try:
        _schedule(w)
        size_of = w.finish_packs()
    except BaseException:
        w.abort_packs()
        raise
    finally:
        wait(metadata)
    for fut in metadata:
        fut.result()  # its StorageError names the tensor and the object
    for i, r in enumerate(w.records):
        if r is not None and r.where is not None and r.where[2] < 0:
            w.records[i] = dataclasses.replace(r, where=(r.where[0], r.where[1], size_of[r.where[0]]))
    t = clock.add("write", t)
    storage.sync(layout.save_prefix(save_id))
    t = clock.add("fsync", t)
    try:
        if settings.codec == "raw":
            return [r for r in w.records if r is not None] + w.referenced
        return _verify_encoded(storage, w) + w.referenced
    finally:
        clock.add("verify", t)


#: zarr.json objects one writer task writes.
_METADATA_PER_TASK = 32


def _metadata(p: TensorWritePlan, settings: WriteSettings) -> dict[str, Any]:
    g = p.geometry
    return layout.zarr_array_metadata(g.shape, p.dtype, g.shard_shape, g.chunk_shape, settings.codec, settings.codec_level)


def _write_metadata(storage: Storage, plans: list[TensorWritePlan], save_id: str, settings: WriteSettings) -> None:
    """Write the zarr.json of each of ``plans``' raw arrays: tensorstore's bytes (FORMAT.md 14.2)."""
    from ckptfmt.storage._kvstore import zarr_json  # tensorstore: imported once a save runs

    for p in plans:
        path = layout.array_path(save_id, p.index)
        with kv_errors("cannot create the tensor array", key=p.key, object=path):
            data = zarr_json(_metadata(p, settings))
        storage.write_object(f"{path}/zarr.json", [data], tensor=p.key)


def _opened(fut: Any, p: TensorWritePlan, save_id: str) -> Any:
    with kv_errors("cannot create the tensor array", key=p.key, object=layout.array_path(save_id, p.index)):
        return fut.result()


def _schedule(w: _RankWrites) -> None:
    """Every owned item: reuse decisions in batches, then its writes on the writer threads in a
    sliding window of ``max_inflight_bytes``, paced to ``max_write_bytes_per_s``. The first failure
    raises; what has not started then never runs, and the rest ends before this returns."""
    s, mine = w.settings, w.mine
    pool = writer_pool(w.threads)
    window: deque[tuple[Any, int]] = deque()  # writes in flight, oldest first, with the bytes they hold
    inflight, pace_start, paced, n = 0, time.monotonic(), 0, 0
    try:
        while n < len(mine):
            # Decide a batch first, then submit its writes: the reuse checks (crc32c, device-to-host
            # copies) release the GIL, and each wait to take it back behind busy writer threads
            # costs up to a switch interval, which made the checks of a small save 5x slower.
            batch: list[tuple[int, list[Any]]] = []
            kept = 0
            while n < len(mine) and (not batch or kept < s.max_inflight_bytes * REUSE_BATCH_FRACTION):
                made = w.decide(n)
                if made is not None:
                    batch.append((n, made))
                    kept += mine[n][1].box.size * mine[n][0].geometry.itemsize
                n += 1
            # Small objects go to the writer threads a few at a time (at most one task per thread
            # for the batch): a future per object was a quarter of what a small save allocated.
            per_task = max(1, -(-len(batch) // w.threads))
            group: list[tuple[ShardJob, int]] = []
            group_held = 0
            for m, made in batch:
                if not group:
                    w.align_next()  # each group a run of its own in its pack (direct writes)
                one, held = w.job(m, made)
                group.append((one, m))
                group_held += held
                if s.max_write_bytes_per_s:
                    paced += one.block.nbytes
                    ahead = paced / s.max_write_bytes_per_s - (time.monotonic() - pace_start)
                    if ahead > 0:
                        time.sleep(ahead)
                if len(group) < per_task and group_held < _SMALL_OBJECT_BYTES and m != batch[-1][0]:
                    continue
                window.append((pool.submit(w.run, group), group_held))
                inflight += group_held
                group, group_held = [], 0
                w.align_next()  # nothing of the next group shares the last block of this one
                while inflight > s.max_inflight_bytes and window:  # a sliding window, not a barrier
                    fut, nbytes = window.popleft()
                    fut.result()
                    inflight -= nbytes
        for fut, _ in window:
            fut.result()  # the first failure raises; the finally below waits for the rest
    finally:
        w.stopped.set()  # after a failure: what has not started never runs, the rest ends here
        for fut, _ in window:
            fut.cancel()
        wait([f for f, _ in window])
        w.cache.clear()


def _verify_encoded(storage: Storage, w: _RankWrites) -> list[ShardRecord]:
    """Phase 4 for encoded chunks (codec zstd, FORMAT.md 6.3): they differ in size and their crc32c
    covers the encoded bytes, so each written object is read back whole and checked by
    :func:`ckptfmt.shard.verify_encoded`, every chunk decoded, against the source's crc32c."""
    decoders: dict[tuple[str, tuple[int, ...]], Any] = {}
    out = []
    for n, crcs in sorted(w.encoded.items()):
        p, it = w.mine[n]
        g = p.geometry
        key = layout.shard_key(layout.array_path(w.save_id, p.index), it.cell)
        dec = decoder_for(decoders, p.dtype, g.chunk_shape)
        out.append(verify_encoded(p.index, it.cell, p.key, key, g, it.box.offset, storage.read(key), crcs,
                                  shard_sizes(g).stored_chunk("zstd")[1],
                                  lambda data, key=key, p=p, dec=dec: dec.decode(data, key=p.key, obj=key)))
    return out


def shard_block(holder: LocalShard, p: TensorWritePlan, it: WriteItem, cache: dict[int, np.ndarray],
                dt_cache: dict[str, np.dtype]) -> np.ndarray:
    """The C-ordered block of ``it`` cut from its holder's data (materialized once into ``cache``);
    bool stored as 0x00/0x01 only. Raises StepMismatchError for data unlike its declaration."""
    src = cache.get(id(holder))
    if src is None:
        src = cache[id(holder)] = _source(holder, p.key)
    dt = dt_cache.setdefault(p.dtype, numpy_dtype(p.dtype))
    sl = it.box.slices(holder.box.offset)
    block = np.asarray(src[sl] if sl else src[...], dtype=dt, order="C")
    if dt.kind == "b":  # the format stores bool as 0x00/0x01 only; a reinterpreted byte may hold more
        block = np.not_equal(block.view(np.uint8), 0)
    return block


def _source(holder: LocalShard, key: str) -> np.ndarray:
    src = holder.materialize()
    if src.shape != holder.box.shape:
        raise StepMismatchError("shard data shape differs from its box", key=key, expected=holder.box.shape, found=src.shape)
    if src.dtype != holder.dtype:  # never cast silently: the manifest would lie about the bytes
        raise StepMismatchError("shard data dtype differs from the declared dtype", key=key,
                                expected=str(holder.dtype), found=str(src.dtype))
    return src


def write_state(storage: Storage, save_id: str, rank: int, state: Any, rank_state: Any) -> list[StateEntry]:
    """Write the global state (rank 0) and this rank's own state, then read each back."""
    items: list[tuple[int | None, bytes]] = []
    if rank == 0 and state is not None:
        items.append((None, encode_state(state)))
    if rank_state is not None:
        items.append((rank, encode_state(rank_state)))
    storage.write_many((layout.state_key(save_id, r), b) for r, b in items)
    out = []
    for r, data in items:
        key = layout.state_key(save_id, r)
        if storage.read(key) != data:
            raise IncompleteSaveError("written state object does not read back identically", object=key)
        out.append(StateEntry(layout.state_name(r), key, len(data), crc32c(data), "global" if r is None else "rank", r))
    return out
