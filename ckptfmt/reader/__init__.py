"""The restore side: plan by global coordinates, read only the needed byte ranges, verify
every block against the manifest, and hand nothing back until everything is verified.

Subpackage ``ckptfmt.reader``. The restore side: a committed step opened for reading, planned by
global coordinates, read by byte range (positionally on local files), verified, and the memory the
outputs are read into (FORMAT.md 9), and the cooperative restore (FORMAT.md 9.1). Its modules:
``_alloc``, ``_positional``, ``_cooperative``. May import: floor, manifest, storage, shard. The
floor: the top-level modules listed in ``ckptfmt/__init__.py`` (tests/test_layering.py holds the
rules and enforces them). Subpackages that may import it:
repository, interop, manager.
"""
from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ckptfmt.reader._alloc import allocate, check_outputs_fit, require_memory
from ckptfmt.reader._cooperative import CoopPlan as CoopPlan
from ckptfmt.reader._cooperative import CoopStats as CoopStats
from ckptfmt.reader._cooperative import Exchange as Exchange
from ckptfmt.reader._cooperative import RoundPlan as RoundPlan
from ckptfmt.reader._cooperative import cooperative_reads as cooperative_reads
from ckptfmt.reader._cooperative import plan_cooperative as plan_cooperative
from ckptfmt.reader._positional import DEFAULT_READ_THREADS as DEFAULT_READ_THREADS
from ckptfmt.reader._positional import PositionalReads, _Batch
from ckptfmt.reader._verifylocal import LocalVerify, ReadBuffers
from ckptfmt._types import Box
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import (ChecksumMismatchError, InvalidStateError, KeyMismatchError, SizeMismatchError,
                            TopologyChangedError)
from ckptfmt.manifest import Manifest, TensorEntry
from ckptfmt.plan import ReadItem, plan_reads
from ckptfmt.state import decode_state
from ckptfmt.storage import Pending, Storage
from ckptfmt.storage._options import DEFAULT_READ_WINDOW as DEFAULT_READ_WINDOW

__all__ = ["Checkpoint", "ReadStats", "DEFAULT_READ_WINDOW", "RANK_STATE_POLICIES", "check_rank_state_policy",
           "Exchange", "CoopPlan", "CoopStats", "RoundPlan", "plan_cooperative", "cooperative_reads"]

#: Largest non-tensor state object a reader accepts (the msgpack decoder's default cap).
MAX_STATE_BYTES = 64 << 20

Progress = Callable[[int, int], None]

#: The per-rank state policies of FORMAT.md 7.4 (None, the default, means "same world only").
RANK_STATE_POLICIES = ("drop", "rank0", "same-rank")


def check_rank_state_policy(policy: str | None) -> None:
    """Raise ValueError, naming the accepted policies, unless ``policy`` is None or one of them.

    An unknown policy is a caller's mistake, not a property of the checkpoint, so it is not a
    CheckpointError (and never a TopologyChangedError).
    """
    if policy is not None and policy not in RANK_STATE_POLICIES:
        raise ValueError(f"unknown rank state policy {policy!r}; expected one of "
                         f"{', '.join(map(repr, RANK_STATE_POLICIES))} or None")


@dataclass
class ReadStats:
    """What a reader did: bytes and requests, and wall seconds per phase (on the local-file path the
    threads' read/verify/assemble times are scaled to each batch's wall time)."""

    bytes_read: int = 0
    requests: int = 0
    objects: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds


class Checkpoint(PositionalReads, LocalVerify):
    """One committed step, opened for reading. Create it with :meth:`Repository.open`."""

    def __init__(self, storage: Storage, manifest: Manifest, *, max_inflight_bytes: int = DEFAULT_READ_WINDOW,
                 stats: ReadStats | None = None) -> None:
        self.storage = storage
        self.manifest = manifest
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = stats or ReadStats()
        self._chunk_start: dict[str, np.ndarray] = {}
        # Directories found to be no symbolic link while this step is open (FORMAT.md 9 step 4).
        self._plain_dirs: set[str] = set()

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def saved_world(self) -> int:
        return self.manifest.writers

    def keys(self) -> list[str]:
        return sorted(self.manifest.tensors)

    def tensor(self, key: str) -> TensorEntry:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise KeyMismatchError("tensor is not in the checkpoint", key=key, object=f"step {self.step}",
                                   expected="a saved key", found="missing") from None

    # ------------------------------------------------------------------ tensors
    def read(self, key: str, box: Box | None = None) -> np.ndarray:
        """Read one box (default: the whole tensor), verified. Raises a CheckpointError on any fault."""
        t = self.tensor(key)
        return self.read_boxes([(key, box if box is not None else Box.full(t.shape))])[0]

    def read_boxes(self, requests: Sequence[tuple[str, Box]]) -> list[np.ndarray]:
        """Read many boxes of many tensors at once.

        Reads only the inner chunks each box touches, verifies each against the manifest's crc32c
        (and each touched object's size and index checksum), and returns fresh arrays only after
        every byte has been verified. On any fault it raises and returns nothing.
        """
        t0 = time.perf_counter()
        outs, work = self._plan(requests)
        if self.storage.positional_reads:
            self._read_local(work, outs)
            self.stats.add_time("total", time.perf_counter() - t0)
            return outs  # type: ignore[return-value]
        # A sliding window: keep up to max_inflight_bytes of reads issued while earlier ones are
        # verified and copied, so I/O overlaps with checksum and assembly work.
        queue: deque[_ShardRead] = deque()
        inflight = 0
        for (key, s), items in work.items():
            issued = self._issue(key, s, items)
            queue.append(issued)
            inflight += issued.held
            while inflight > self.max_inflight_bytes and queue:
                done = queue.popleft()
                inflight -= done.held
                self._finish(done, outs)
        while queue:
            self._finish(queue.popleft(), outs)
        self.stats.add_time("total", time.perf_counter() - t0)
        return outs  # type: ignore[return-value]  # every entry was allocated above

    def iter_read_boxes(self, batches: Sequence[Sequence[tuple[str, Box]]]) -> Iterator[list[np.ndarray]]:
        """Read batches of boxes, yielding each batch's arrays in order once every byte of that batch
        is verified. Later batches are already being read while the caller consumes one: up to
        ``max_inflight_bytes`` of them (at least the next one), so a restore bounds the host
        memory it holds at once without losing I/O parallelism. A fault raises from the iterator;
        the caller must not publish anything it built until the iterator is exhausted.
        """
        if not self.storage.positional_reads:
            for batch in batches:
                yield self.read_boxes(batch)
            return
        pool = ThreadPoolExecutor(max_workers=self._threads(), thread_name_prefix="ckptfmt-read")
        try:
            pending: deque[_Batch] = deque()
            inflight = 0
            for batch in batches:
                outs, work = self._plan(batch)
                nbytes = sum(int(o.nbytes) for o in outs if o is not None)
                # Keep the window: hand out the oldest batch before issuing past it.
                while len(pending) >= 2 and inflight + nbytes > self.max_inflight_bytes:
                    done = pending.popleft()
                    inflight -= done.nbytes
                    yield self._collect(done)
                started = time.perf_counter()
                futures = [pool.submit(self._read_local_shard, k, s, items, outs) for (k, s), items in work.items()]
                pending.append(_Batch(outs, futures, started, nbytes))
                inflight += nbytes
            while pending:
                yield self._collect(pending.popleft())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _plan(self, requests: Sequence[tuple[str, Box]]) -> tuple[list[np.ndarray | None], dict[tuple[str, int], list[ReadItem]]]:
        """Allocate fresh outputs and group the read items by (tensor, shard). Pure except allocation."""
        t0 = time.perf_counter()
        by_key: dict[str, list[int]] = {}
        for i, (key, box) in enumerate(requests):
            by_key.setdefault(key, []).append(i)
        outs: list[np.ndarray | None] = [None] * len(requests)
        work: dict[tuple[str, int], list[ReadItem]] = {}
        check_outputs_fit([(k, math.prod(b.shape) * numpy_dtype(self.tensor(k).dtype).itemsize) for k, b in requests],
                          f"step {self.step}")
        for key, idxs in by_key.items():
            t = self.tensor(key)
            dt = numpy_dtype(t.dtype)
            boxes = [requests[i][1] for i in idxs]
            for i, b in zip(idxs, boxes):
                outs[i] = allocate(key, b, dt)
            for item in plan_reads(t.geometry, t.shards.offset, self._starts(t), boxes):
                work.setdefault((key, item.shard), []).append(
                    ReadItem(idxs[item.request], item.shard, item.chunk, item.src, item.dst))
        self.stats.add_time("plan", time.perf_counter() - t0)
        return outs, work

    def _starts(self, t: TensorEntry) -> np.ndarray:
        cs = self._chunk_start.get(t.key)
        if cs is None:
            cs = self._chunk_start[t.key] = t.chunk_start
        return cs

    def _issue(self, key: str, s: int, items: list[ReadItem]) -> "_ShardRead":
        """Start the reads one shard needs: the whole object, or its index plus the needed chunks."""
        t = self.manifest.tensors[key]
        g = t.geometry
        obj = t.object_key(s)
        starts = self._starts(t)
        chunks = sorted({it.chunk for it in items})
        nbytes = int(t.shards.nbytes[s])
        self.stats.objects += 1
        self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
        # Every range ends at or before nbytes; the size is checked apart (stat, or one byte at nbytes).
        probe = self.storage.size_check(obj, nbytes, tensor=key)
        self.stats.requests += probe.requests
        if len(chunks) == int(starts[s + 1] - starts[s]):
            require_memory(nbytes, key, obj, "the whole shard")
            self.stats.requests += 1
            return _ShardRead(key, s, items, obj, True, [self.storage.read_range(obj, 0, nbytes, tensor=key)], probe, nbytes)
        held = int(t.chunks.nbytes[chunks].sum()) + g.index_nbytes
        require_memory(held, key, obj, "the shard's needed chunks")
        futs = [self.storage.read_range(obj, nbytes - g.index_nbytes, nbytes, tensor=key)]
        for c in chunks:
            o, n = int(t.chunks.offset[c]), int(t.chunks.nbytes[c])
            futs.append(self.storage.read_range(obj, o, o + n, tensor=key))
        self.stats.requests += len(futs)
        return _ShardRead(key, s, items, obj, False, futs, probe, held)

    def _finish(self, issued: "_ShardRead", outs: list[np.ndarray | None]) -> None:
        """Wait for one shard's reads, verify every byte against the manifest, copy into the outputs."""
        key, s, items, obj = issued.key, issued.shard, issued.items, issued.obj
        t = self.manifest.tensors[key]
        g = t.geometry
        tw = time.perf_counter()
        issued.probe.result()
        raw = [f.result() for f in issued.reads]
        self.stats.add_time("read", time.perf_counter() - tw)
        self.stats.bytes_read += sum(len(r) for r in raw)
        tv = time.perf_counter()
        chunks = sorted({it.chunk for it in items})
        chunk_bytes: dict[int, memoryview] = {}
        if issued.whole:
            chunk_bytes = self._check_whole(t, s, obj, raw[0], chunks)
        else:
            index = memoryview(raw[0])
            if len(index) != g.index_nbytes:
                raise SizeMismatchError("shard index read differs from its recorded length", key=key, object=obj,
                                        expected=g.index_nbytes, found=len(index))
            self._check_index(t, s, obj, index)
            for c, r in zip(chunks, raw[1:]):
                chunk_bytes[c] = memoryview(r)
                self._check_chunk(t, c, obj, chunk_bytes[c])
        self.stats.add_time("verify", time.perf_counter() - tv)
        ta = time.perf_counter()
        decoded = {c: self._decode(t, c, obj, mv) for c, mv in chunk_bytes.items()}
        for it in items:
            outs[it.request][it.dst or ...] = decoded[it.chunk][it.src or ...]  # type: ignore[index]
        self.stats.add_time("assemble", time.perf_counter() - ta)

    # ------------------------------------------------------------------ non-tensor state
    def _state_object(self, name: str) -> Any:
        e = self.manifest.state.get(name)
        if e is None:
            return None
        if e.nbytes > MAX_STATE_BYTES:  # refuse before reading anything
            raise InvalidStateError("state object is larger than the state cap", key=name, object=e.key,
                                    expected=f"<= {MAX_STATE_BYTES} bytes", found=e.nbytes)
        self.storage.check_no_links(e.key, self._plain_dirs, tensor=name)
        probe = self.storage.size_check(e.key, e.nbytes, tensor=name)
        fut = self.storage.read_range(e.key, 0, e.nbytes, tensor=name)
        probe.result()
        data = fut.result()
        if len(data) != e.nbytes:
            raise SizeMismatchError("state object size differs from the manifest", key=name, object=e.key,
                                    expected=e.nbytes, found=len(data))
        if crc32c(data) != e.crc32c:
            raise ChecksumMismatchError("state object checksum differs from the manifest", key=name, object=e.key,
                                        expected=e.crc32c, found=crc32c(data))
        self.stats.bytes_read += len(data)
        return decode_state(data)

    def state(self) -> Any:
        """The global non-tensor state (decoded msgpack, verified), or None if none was saved."""
        return self._state_object("global")

    def rank_state(self, rank: int, *, world: int | None = None, policy: str | None = None) -> Any:
        """Per-rank state saved by ``rank``.

        When restoring on a different number of ranks (``world`` != saved writers) this raises
        TopologyChangedError unless ``policy`` is given: "drop" returns None, "rank0" returns
        rank 0's state for every rank, "same-rank" returns rank ``rank``'s state when it exists.
        A policy not in :data:`RANK_STATE_POLICIES` is a usage error: ValueError, before any read.
        """
        check_rank_state_policy(policy)
        if world is not None and world != self.saved_world:
            if policy is None:
                raise TopologyChangedError("per-rank state saved on a different topology needs a policy",
                                           object=f"step {self.step}", expected=f"world {self.saved_world}",
                                           found=f"world {world}")
            if policy == "drop":
                return None
            if policy == "rank0":
                rank = 0
        return self._state_object(f"rank/{rank}")

    # ------------------------------------------------------------------ verify
    def verify(self, progress: Progress | None = None, *, buffers: ReadBuffers | None = None) -> int:
        """Read every object fully and check it against the manifest. Returns bytes verified.

        ``buffers``: read buffers to reuse (local files; a :class:`~ckptfmt.Repository` keeps one
        set across its verifications), else new ones for this call.

        Raises the first MissingShardError / SizeMismatchError / ChecksumMismatchError found.
        """
        total = self.manifest.nbytes
        done = 0

        def report(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if progress:
                progress(done, total)

        keys = self.keys()
        if self.storage.positional_reads:  # local files: ckptfmt.reader._verifylocal
            self._verify_positional(keys, report, buffers)
            keys = []
        for key in keys:
            t = self.manifest.tensors[key]
            starts = self._starts(t)
            reads: list[_WholeRead] = []
            held = 0
            for s in range(len(t.shards)):
                obj, n = t.object_key(s), int(t.shards.nbytes[s])
                if n > self.max_inflight_bytes:  # a shard larger than the window: its index, then its chunks
                    report(self._verify_in_parts(t, s))
                    continue
                if reads and held + n > self.max_inflight_bytes:
                    report(self._verify_whole(t, reads, starts))
                    reads, held = [], 0
                # Each object read up to its recorded size, its length checked apart.
                self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
                reads.append(_WholeRead(s, obj, n, self.storage.size_check(obj, n, tensor=key),
                                        self.storage.read_range(obj, 0, n, tensor=key)))
                held += n
            report(self._verify_whole(t, reads, starts))
        for name, e in sorted(self.manifest.state.items()):
            self._state_object(name)
            done += e.nbytes
            if progress:
                progress(done, total)
        return done

    def _verify_whole(self, t: TensorEntry, reads: list["_WholeRead"], starts: np.ndarray) -> int:
        for r in reads:
            r.probe.result()
            buf = r.data.result()
            checked = self._check_whole(t, r.shard, r.obj, buf, range(int(starts[r.shard]), int(starts[r.shard + 1])))
            if t.array.codec != "raw":  # an encoded chunk must also decode (FORMAT.md 6.3)
                for c, mv in checked.items():
                    self._decode(t, c, r.obj, mv)
            self.stats.bytes_read += len(buf)
        return sum(r.nbytes for r in reads)

    def _verify_in_parts(self, t: TensorEntry, s: int) -> int:
        """Verify one shard larger than the read window: its index, then its chunks, a window at a
        time, so that verify never holds more than the window (or one chunk) of it."""
        g, obj, n = t.geometry, t.object_key(s), int(t.shards.nbytes[s])
        c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
        biggest = int(t.chunks.nbytes[c0:c1].max()) if c1 > c0 else 0
        require_memory(max(biggest, g.index_nbytes), t.key, obj, "one chunk or index")
        self.storage.check_no_links(obj, self._plain_dirs, tensor=t.key)
        probe = self.storage.size_check(obj, n, tensor=t.key)
        index = self.storage.read_range(obj, n - g.index_nbytes, n, tensor=t.key)
        probe.result()
        self._check_index(t, s, obj, memoryview(index.result()))
        per = max(1, self.max_inflight_bytes // max(biggest, 1))
        for lo in range(c0, c1, per):
            futs = [(c, int(t.chunks.offset[c]), int(t.chunks.nbytes[c])) for c in range(lo, min(c1, lo + per))]
            reads = [(c, self.storage.read_range(obj, o, o + nb, tensor=t.key)) for c, o, nb in futs]
            for c, f in reads:
                mv = memoryview(f.result())
                self._check_chunk(t, c, obj, mv)
                if t.array.codec != "raw":
                    self._decode(t, c, obj, mv)
        self.stats.bytes_read += g.index_nbytes + int(t.chunks.nbytes[c0:c1].sum())
        return n


@dataclass(frozen=True)
class _ShardRead:
    """The reads issued for one shard on the kvstore path (``held``: bytes they hold once done)."""

    key: str
    shard: int
    items: list[ReadItem]
    obj: str
    whole: bool                  # one read of the whole object, else the index then each chunk
    reads: list[Pending[bytes]]
    probe: Pending[None]
    held: int


@dataclass(frozen=True)
class _WholeRead:
    """verify: one whole object being read, and its size check."""

    shard: int
    obj: str
    nbytes: int
    probe: Pending[None]
    data: Pending[bytes]
