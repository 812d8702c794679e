"""The positional read path of a :class:`ckptfmt.reader.Checkpoint` on local files (FORMAT.md 14.4):
:class:`LocalReader`, an object the checkpoint creates and holds.

Shards are read by a thread pool with ``preadv`` (through the storage's ``open_positional``)
straight into the outputs where a chunk maps onto a contiguous region of one, else into a small
scratch buffer; a shard whose every chunk is needed whole takes one vectored read. Every index and
chunk is checked against the manifest (the reader's ``checks``, a
:class:`ckptfmt.reader.BlockChecks`) before the caller may use any output.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ckptfmt.reader._alloc import require_memory
from ckptfmt.shard._blockcheck import BlockChecks
from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import SizeMismatchError
from ckptfmt.shard import TRAILER_BYTES, ShardBytes, back_to_back, shard_bytes
from ckptfmt.manifest import Manifest, TensorEntry
from ckptfmt.plan import ReadItem
from ckptfmt.storage import PositionalFile, Storage
from ckptfmt.storage._options import DEFAULT_READ_THREADS as DEFAULT_READ_THREADS

if TYPE_CHECKING:  # the package's face imports this module
    from ckptfmt.reader import ReadStats

__all__ = ["ChunkStarts", "LocalReader", "ThreadFiles", "DEFAULT_READ_THREADS", "UNCACHED_READ_BYTES"]

#: A read whose outputs hold at least this many bytes asks the store to keep what it reads
#: through the page cache out of it (:meth:`ckptfmt.storage.PositionalFile.prefer_uncached`):
#: large restores gain, small ones lose a little (the figures: docs/performance.md).
UNCACHED_READ_BYTES = 2 << 30
#: Most buffers one preadv call takes (Linux IOV_MAX).
_IOV_MAX = 1024
#: Pool tasks per reader thread: enough that threads finish together, few enough that handing
#: them out costs nothing beside the reads.
_GROUPS_PER_THREAD = 8
#: Small whole shards lying back to back in one object are read in runs of at most this many
#: bytes (one positional read each, then checked shard by shard in memory).
_RUN_BYTES = 1 << 20

#: One batch of requests: (key path, box) each.
_Requests = Sequence[tuple[str, Box]]
#: A planned batch: its fresh outputs, and its read items by (key path, shard row).
_Planned = tuple[list["np.ndarray | None"], dict[tuple[str, int], list[ReadItem]]]


class ChunkStarts:
    """Each tensor's first chunk row per shard (``TensorEntry.chunk_start``, one more entry than
    shards), computed once per tensor while a step is open: the read paths ask for it per shard."""

    def __init__(self) -> None:
        self._by_key: dict[str, np.ndarray] = {}

    def of(self, t: TensorEntry) -> np.ndarray:
        cs = self._by_key.get(t.key)
        if cs is None:
            cs = self._by_key[t.key] = t.chunk_start
        return cs


class LocalReader:
    """The positional read path of one opened step, held by its :class:`ckptfmt.reader.Checkpoint`:
    reads shards of ``manifest`` from ``storage`` (which offers positional reads) into the outputs,
    checks every index and chunk with ``checks``, and counts what it did in ``stats``.

    ``plain_dirs``: the checkpoint's set of directories found to be no symbolic link (shared, and
    grown, while the step is open). ``starts``: the checkpoint's :class:`ChunkStarts`."""

    def __init__(self, storage: Storage, manifest: Manifest, stats: ReadStats, checks: BlockChecks,
                 plain_dirs: set[str], starts: ChunkStarts) -> None:
        self.storage = storage
        self.manifest = manifest
        self.stats = stats
        self.checks = checks
        self._plain_dirs = plain_dirs
        self._starts = starts.of

    def threads(self) -> int:
        """Reader threads (the repository option ``read_threads``, at least one)."""
        return max(1, self.storage.options.read_threads)

    def _collect(self, batch: "_Batch") -> list[np.ndarray]:
        sums: dict[str, float] = {}
        for f in batch.futures:
            done: _ShardStats = f.result()  # raises the first fault
            self.stats.bytes_read += done.nbytes
            self.stats.requests += done.requests
            self.stats.objects += done.shards
            for phase, seconds in done.phases.items():
                sums[phase] = sums.get(phase, 0.0) + seconds
        # Threads overlap: share this batch's wall time out in proportion to the per-thread sums.
        wall, total = time.perf_counter() - batch.started, sum(sums.values())
        for phase, seconds in sums.items():
            self.stats.add_time(phase, seconds * min(1.0, wall / total) if total else 0.0)
        return batch.outs  # type: ignore[return-value]

    def read(self, work: dict[tuple[str, int], list[ReadItem]], outs: list[np.ndarray | None]) -> None:
        """Local files: positional reads straight into the outputs where a chunk maps onto a
        contiguous region, else into a small scratch buffer; every chunk is checked against the
        manifest's crc32c and every object's size against the manifest. Shards run in a thread
        pool (preadv, crc32c and numpy copies release the GIL). The first fault cancels the rest."""
        jobs = list(work.items())
        if not jobs:
            return
        threads = min(len(jobs), self.threads())
        uncached = sum(o.nbytes for o in outs if o is not None) >= UNCACHED_READ_BYTES
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptfmt-read")
        files = ThreadFiles(self.storage)
        try:
            started = time.perf_counter()
            self._collect(_Batch(outs, [pool.submit(self._read_local_group, group, outs, uncached, files)
                                        for group in self._groups(jobs, threads)], started, 0))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            files.close()

    def read_batches(self, batches: Iterable[_Requests], plan: Callable[[_Requests], _Planned],
                     max_inflight_bytes: int) -> Iterator[list[np.ndarray]]:
        """Each batch's outputs in order, every byte of it checked; ``plan`` allocates a batch's
        outputs and groups its read items by shard. Later batches are read while the caller
        consumes one, up to ``max_inflight_bytes`` of them (at least the next one)."""
        pool = ThreadPoolExecutor(max_workers=self.threads(), thread_name_prefix="ckptfmt-read")
        files = ThreadFiles(self.storage)
        try:
            pending: deque[_Batch] = deque()
            inflight = 0
            for batch in batches:
                outs, work = plan(batch)
                nbytes = sum(int(o.nbytes) for o in outs if o is not None)
                # Keep the window: hand out the oldest batch before issuing past it.
                while len(pending) >= 2 and inflight + nbytes > max_inflight_bytes:
                    done = pending.popleft()
                    inflight -= done.nbytes
                    yield self._collect(done)
                started = time.perf_counter()
                futures = [pool.submit(self._read_local_group, group, outs, False, files)
                           for group in self._groups(list(work.items()), self.threads())]
                pending.append(_Batch(outs, futures, started, nbytes))
                inflight += nbytes
            while pending:
                yield self._collect(pending.popleft())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            files.close()

    def _groups(self, jobs: list[tuple[tuple[str, int], list[ReadItem]]], threads: int
                ) -> list[list[tuple[tuple[str, int], list[ReadItem]]]]:
        """The shards in file order (object, then offset), cut into about ``_GROUPS_PER_THREAD``
        groups per thread of similar size: one pool task per group, not per shard, because a
        state of tens of thousands of small shards spent more time handing tasks to the pool
        than reading them."""
        tensors = self.manifest.tensors

        def where(job: tuple[tuple[str, int], list[ReadItem]]) -> tuple[str, int]:
            (key, s), _ = job
            t = tensors[key]
            return t.object_key(s), t.shard_start(s)

        def size(job: tuple[tuple[str, int], list[ReadItem]]) -> int:
            (key, s), _ = job
            return int(tensors[key].shards.nbytes[s])

        if len(jobs) <= threads:
            return [[job] for job in jobs]
        ordered = sorted(jobs, key=where)
        sizes = [size(job) for job in ordered]
        target = max(1, sum(sizes) // (threads * _GROUPS_PER_THREAD))
        most = max(1, len(ordered) // (threads * _GROUPS_PER_THREAD))
        groups: list[list[tuple[tuple[str, int], list[ReadItem]]]] = [[]]
        fill = 0
        for job, n in zip(ordered, sizes):
            if groups[-1] and (fill + n > target or len(groups[-1]) >= most):
                groups.append([])
                fill = 0
            groups[-1].append(job)
            fill += n
        return groups

    def _read_local_group(self, group: list[tuple[tuple[str, int], list[ReadItem]]], outs: list[np.ndarray | None],
                          uncached: bool, files: "ThreadFiles") -> "_ShardStats":
        """The shards of one group, in order; their counts summed. Small whole shards that lie back
        to back in one object go as runs (:meth:`_read_run`), the others one by one. The first
        fault raises."""
        nbytes = requests = 0
        phases: dict[str, float] = {}

        def add(done: _ShardStats) -> None:
            nonlocal nbytes, requests
            nbytes += done.nbytes
            requests += done.requests
            for phase, seconds in done.phases.items():
                phases[phase] = phases.get(phase, 0.0) + seconds

        run: list[_Whole] = []
        runs = not uncached and not self.storage.options.mapped_reads  # (mapped reads map each shard)
        for (key, s), items in group:
            whole = self._small_whole(key, s, items, outs) if runs else None
            if whole is not None and run and (whole.obj != run[-1].obj or whole.lo != run[-1].hi
                                              or whole.hi - run[0].lo > _RUN_BYTES):
                add(self._read_run(run, files))
                run = []
            if whole is not None:
                run.append(whole)
                continue
            if run:
                add(self._read_run(run, files))
                run = []
            add(self._read_local_shard(key, s, items, outs, uncached, files))
        if run:
            add(self._read_run(run, files))
        return _ShardStats(nbytes, requests, phases, len(group))

    def _small_whole(self, key: str, s: int, items: list[ReadItem], outs: list[np.ndarray | None]) -> "_Whole | None":
        """Shard ``s`` of ``key`` as a :class:`_Whole` when it is small, raw, stored back to back,
        and every stored chunk of it is needed whole by exactly one output region; else None (it
        is read by :meth:`_read_local_shard`)."""
        t = self.manifest.tensors[key]
        if t.array.codec != "raw":
            return None
        want = int(t.shards.nbytes[s])
        if want > _RUN_BYTES:
            return None
        starts = self._starts(t)
        c0, c1 = int(starts[s]), int(starts[s + 1])
        if len(items) != c1 - c0:
            return None
        g = t.geometry
        full = tuple(slice(0, c) for c in g.chunk_shape)
        shape = tuple(g.chunk_shape)
        dests: list[np.ndarray] = [None] * (c1 - c0)  # type: ignore[list-item]
        for it in items:
            if (it.src or ()) != full or not c0 <= it.chunk < c1 or dests[it.chunk - c0] is not None:
                return None
            view = outs[it.request][it.dst or ...]  # type: ignore[index]
            if view.shape != shape:
                return None
            dests[it.chunk - c0] = view
        if not back_to_back(t, c0, c1, want):
            return None
        lo = t.shard_start(s)
        return _Whole(t, s, t.object_key(s), lo, lo + want, c0, dests)

    def _read_run(self, run: list["_Whole"], files: "ThreadFiles") -> "_ShardStats":
        """Shards that lie back to back in one object, read with one positional read into a
        scratch buffer; then each shard's index and each chunk checked against the manifest
        (as :meth:`_read_whole_direct` checks them) before its chunks are copied into the outputs."""
        tr = time.perf_counter()
        first = run[0]
        t0, obj = first.t, first.obj
        self.storage.check_no_links(obj, self._plain_dirs, tensor=t0.key)
        buf = np.empty(run[-1].hi - first.lo, np.uint8)
        with files.open(obj, t0.key) as f:
            if f.size != t0.object_nbytes(first.s):
                raise SizeMismatchError("shard object size differs from the manifest", key=t0.key, object=obj,
                                        expected=t0.object_nbytes(first.s), found=f.size)
            f.read_into([buf], first.lo)
        tv = time.perf_counter()
        mv = memoryview(buf)
        for w in run:
            t, base = w.t, w.lo - first.lo
            sb = shard_bytes(t, w.s)
            ilo, ihi = sb.index
            self.checks.index(t, w.s, obj, mv[base + ilo - sb.start:base + ihi - sb.start])
            for i, dest in enumerate(w.dests):
                off, mid, end = sb.chunk_bounds(w.c0 + i)
                a, b, e = base + off - sb.start, base + mid - sb.start, base + end - sb.start
                self.checks.chunk(t, w.c0 + i, obj, buf[a:b], mv[b:e])
                dest[...] = buf[a:b].view(dest.dtype).reshape(dest.shape)
        phases = {"read": tv - tr, "verify": time.perf_counter() - tv, "assemble": 0.0}
        return _ShardStats(len(buf), 1, phases, 0)

    def _read_local_shard(self, key: str, s: int, items: list[ReadItem], outs: list[np.ndarray | None],
                          uncached: bool = False, files: "ThreadFiles | None" = None) -> "_ShardStats":
        t = self.manifest.tensors[key]
        g = t.geometry
        obj = t.object_key(s)
        full = tuple(slice(0, c) for c in g.chunk_shape)
        by_chunk: dict[int, list[ReadItem]] = {}
        for it in items:
            by_chunk.setdefault(it.chunk, []).append(it)
        # Chunks that map onto one C-contiguous region of one output are read straight into it.
        direct: dict[int, np.ndarray] = {}
        for c, its in by_chunk.items():
            if len(its) == 1 and (its[0].src or ()) == full:
                view = outs[its[0].request][its[0].dst or ...]  # type: ignore[index]
                if view.flags.c_contiguous and view.shape == tuple(g.chunk_shape) and view.size:
                    direct[c] = view.reshape(-1).view(np.uint8)
        phases = {"read": 0.0, "verify": 0.0, "assemble": 0.0}
        if t.array.codec != "raw":  # encoded chunks never land in an output before they are decoded
            direct = {}
        tr = time.perf_counter()
        self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
        with (files.open(obj, key) if files is not None else self.storage.open_positional(obj, tensor=key)) as f:
            if uncached:
                f.prefer_uncached()
            want = int(t.shards.nbytes[s])
            if f.size != t.object_nbytes(s):
                raise SizeMismatchError("shard object size differs from the manifest", key=key, object=obj,
                                        expected=t.object_nbytes(s), found=f.size)
            starts = self._starts(t)
            c0, c1 = int(starts[s]), int(starts[s + 1])
            sb = shard_bytes(t, s)
            if c1 - c0 == 1 and c0 in direct and self.storage.options.mapped_reads:
                req = by_chunk[c0][0].request
                if tuple(outs[req].shape) == tuple(g.chunk_shape):  # type: ignore[union-attr]
                    mapped = self._read_mapped(t, s, obj, f, sb, c0, phases, tr)
                    if mapped is not None:
                        outs[req] = mapped
                        return _ShardStats(want, 1, phases)
            if direct and len(direct) == c1 - c0 and 2 * (c1 - c0) + 1 <= _IOV_MAX and back_to_back(t, c0, c1, want):
                return self._read_whole_direct(t, s, obj, f, sb, c0, c1, direct, phases, tr)
            lo, hi = sb.index
            index = bytearray(hi - lo)
            f.read_into([index], lo)
            phases["read"] += time.perf_counter() - tr
            tv = time.perf_counter()
            self.checks.index(t, s, obj, memoryview(index))
            phases["verify"] += time.perf_counter() - tv
            nbytes, requests = len(index), 1
            trailer = bytearray(TRAILER_BYTES)
            scratch: np.ndarray | None = None
            dt = numpy_dtype(t.dtype)
            for c, its in by_chunk.items():
                off, mid, end = sb.chunk_bounds(c)  # data [off, mid), then its trailer
                data = direct.get(c)
                if data is None:
                    if scratch is None or scratch.size < mid - off:  # encoded chunks differ in size
                        require_memory(mid - off, key, obj, "one chunk")
                        scratch = np.empty(mid - off, np.uint8)
                    data = scratch[:mid - off]
                tr = time.perf_counter()
                f.read_into([data, trailer], off)
                tv = time.perf_counter()
                phases["read"] += tv - tr
                nbytes += end - off
                requests += 1
                self.checks.chunk(t, c, obj, data, trailer)
                ta = time.perf_counter()
                phases["verify"] += ta - tv
                if c not in direct:
                    chunk = (data.view(dt).reshape(g.chunk_shape) if t.array.codec == "raw"
                             else self.checks.decode(t, c, obj, memoryview(bytes(data) + bytes(trailer))))
                    for it in its:
                        outs[it.request][it.dst or ...] = chunk[it.src or ...]  # type: ignore[index]
                    phases["assemble"] += time.perf_counter() - ta
        return _ShardStats(nbytes, requests, phases)

    def _read_mapped(self, t: TensorEntry, s: int, obj: str, f: PositionalFile, sb: ShardBytes, c: int,
                     phases: dict[str, float], tr: float) -> np.ndarray | None:
        """The one chunk of shard ``s``, as a copy-on-write mapping of the object (repository option
        ``mapped_reads``, FORMAT.md 14.8), once its index and its crc32c are checked against the
        manifest; None where the object cannot be mapped (the caller then reads it)."""
        mm = f.map()
        if mm is None:
            return None
        g = t.geometry
        (ilo, ihi), (off, mid, end) = sb.index, sb.chunk_bounds(c)
        view = memoryview(mm)
        tv = time.perf_counter()
        phases["read"] += tv - tr
        self.checks.index(t, s, obj, view[ilo:ihi])
        data = np.frombuffer(mm, np.uint8, count=mid - off, offset=off)
        self.checks.chunk(t, c, obj, data, view[mid:end])
        phases["verify"] += time.perf_counter() - tv
        return data.view(numpy_dtype(t.dtype)).reshape(g.chunk_shape)

    def _read_whole_direct(self, t: TensorEntry, s: int, obj: str, f: PositionalFile, sb: ShardBytes, c0: int,
                           c1: int, direct: dict[int, np.ndarray], phases: dict[str, float], tr: float) -> "_ShardStats":
        """One positional vectored read of the whole object: every chunk's data lands in its
        output, its trailer and the index in small buffers; then the index and every chunk are
        checked against the manifest before the caller may use any output."""
        n = c1 - c0
        tails = np.empty((n, TRAILER_BYTES), np.uint8)  # row i: chunk c0 + i's trailer
        lo, hi = sb.index
        index = bytearray(hi - lo)
        iov: list[Any] = []
        for i in range(n):
            iov += (direct[c0 + i], tails[i])
        iov.append(index)
        f.read_into(iov, sb.start)  # the caller checked back_to_back: data, trailer, ..., index
        tv = time.perf_counter()
        phases["read"] += tv - tr
        self.checks.index(t, s, obj, memoryview(index))
        for i in range(n):
            self.checks.chunk(t, c0 + i, obj, direct[c0 + i], tails[i])
        phases["verify"] += time.perf_counter() - tv
        return _ShardStats(int(t.shards.nbytes[s]), 1, phases)


@dataclass(frozen=True)
class _Whole:
    """A small shard read whole in a run: its bytes [lo, hi) of ``obj``, and each stored chunk's
    output region (a view of chunk shape), chunk rows from ``c0``."""

    t: TensorEntry
    s: int
    obj: str
    lo: int
    hi: int
    c0: int
    dests: list[np.ndarray]


@dataclass(frozen=True)
class _ShardStats:
    """What reading one shard on the positional path did."""

    nbytes: int
    requests: int
    phases: dict[str, float]
    shards: int = 1


@dataclass(frozen=True)
class _Batch:
    """A batch of shards read by the thread pool: its outputs, one future per shard."""

    outs: list[np.ndarray | None]
    futures: list[Any]
    started: float
    nbytes: int


class ThreadFiles:
    """Each reader thread's open objects, kept open for one read: a pack object (FORMAT.md 5.15)
    holds many shards, and opening it once per shard cost a system call pair each. Per thread,
    because a descriptor's O_DIRECT flag is switched around its aligned reads."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.files: dict[tuple[int, str], PositionalFile] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def open(self, obj: str, key: str) -> Iterator[PositionalFile]:
        k = (threading.get_ident(), obj)
        f = self.files.get(k)
        if f is None:
            f = self.storage.open_positional(obj, tensor=key)
            with self.lock:
                self.files[k] = f
        yield f

    def close(self) -> None:
        with self.lock:
            files, self.files = list(self.files.values()), {}
        for f in files:
            f.close()
