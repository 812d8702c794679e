"""The restore side: plan by global coordinates, read only the needed byte ranges, verify
every block against the manifest, and hand nothing back until everything is verified.

Subpackage ``ckptfmt.reader``. The restore side: a committed step opened for reading, planned by
global coordinates, read by byte range (positionally on local files), verified, and the memory the
outputs are read into (FORMAT.md 9), and the cooperative restore (FORMAT.md 9.1). Its modules:
``_alloc``, ``_positional``, ``_verifylocal``, ``_cooperative``. May import: floor, manifest,
storage, shard. The floor: the top-level modules listed in ``ckptfmt/__init__.py``
(tests/test_layering.py holds the rules and enforces them). Subpackages that may import it:
repository, interop, manager.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ckptfmt.restoreplan import closest_key
from ckptfmt.gcpause import pausing_gc
from ckptfmt.reader._alloc import allocate_many, check_outputs_fit, require_memory
from ckptfmt.reader._cooperative import CoopPlan as CoopPlan
from ckptfmt.reader._cooperative import CoopStats as CoopStats
from ckptfmt.reader._cooperative import Exchange as Exchange
from ckptfmt.reader._cooperative import RoundPlan as RoundPlan
from ckptfmt.reader._cooperative import cooperative_reads as cooperative_reads
from ckptfmt.reader._cooperative import plan_cooperative as plan_cooperative
from ckptfmt.reader._positional import DEFAULT_READ_THREADS as DEFAULT_READ_THREADS
from ckptfmt.reader._positional import ChunkStarts, LocalReader
from ckptfmt.reader._verifylocal import LocalVerifier, ReadBuffers
from ckptfmt._types import Box
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import ChecksumMismatchError, InvalidStateError, KeyMismatchError, SizeMismatchError
from ckptfmt.manifest import Manifest, TensorEntry
from ckptfmt.plan import ReadItem, plan_reads
from ckptfmt.rankstate import RANK_STATE_POLICIES as RANK_STATE_POLICIES
from ckptfmt.rankstate import RankStatePolicy, rank_state_source
from ckptfmt.shard._blockcheck import BlockChecks as BlockChecks
from ckptfmt.shard import shard_bytes
from ckptfmt.state import decode_state
from ckptfmt.storage import Pending, Storage
from ckptfmt.storage._options import DEFAULT_READ_WINDOW as DEFAULT_READ_WINDOW

__all__ = ["Checkpoint", "BlockChecks", "ReadStats", "ChunkRef", "SuppliedChunk", "check_state_bytes", "DEFAULT_READ_WINDOW",
           "RANK_STATE_POLICIES", "Exchange", "CoopPlan", "CoopStats", "RoundPlan", "plan_cooperative", "cooperative_reads"]

#: Largest non-tensor state object a reader accepts (the msgpack decoder's default cap).
MAX_STATE_BYTES = 64 << 20

Progress = Callable[[int, int], None]
#: A stored chunk of a tensor: (key path, row of its chunk table).
ChunkRef = tuple[str, int]
#: A chunk another process delivered: its stored bytes (data and trailer) and who sent them.
SuppliedChunk = tuple[Any, str]

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


class Checkpoint:
    """One committed step, opened for reading. Create it with :meth:`Repository.open`.

    ``checks``: the checks of the bytes read against the manifest that every read path calls
    (default: a new :class:`~ckptfmt.reader.BlockChecks`); a test passes a weakened one to build a
    broken control. ``manifest_bytes``: the stored bytes ``manifest`` was validated from, when the
    opener has them (:meth:`Repository.open` does; what a local tier's holder sends its peer).

    On local files (``storage.positional_reads``) reads go through a
    :class:`~ckptfmt.reader._positional.LocalReader` and ``verify`` through a
    :class:`~ckptfmt.reader._verifylocal.LocalVerifier`, both created here with this checkpoint's
    storage, manifest, ``stats``, ``checks`` and caches (so ``stats`` and ``checks`` are the ones
    given at open; ``max_inflight_bytes`` is read at each call)."""

    def __init__(self, storage: Storage, manifest: Manifest, *, max_inflight_bytes: int = DEFAULT_READ_WINDOW,
                 stats: ReadStats | None = None, checks: BlockChecks | None = None,
                 manifest_bytes: bytes | None = None) -> None:
        self.storage = storage
        self.manifest = manifest
        self.manifest_bytes = manifest_bytes
        self.checks = checks if checks is not None else BlockChecks()
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = stats or ReadStats()
        self._chunk_starts = ChunkStarts()
        # Directories found to be no symbolic link while this step is open (FORMAT.md 9 step 4).
        self._plain_dirs: set[str] = set()
        self._local = LocalReader(storage, manifest, self.stats, self.checks, self._plain_dirs, self._chunk_starts)
        self._local_verify = LocalVerifier(storage, manifest, self.stats, self.checks, self._plain_dirs,
                                           self._chunk_starts)

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
            close = closest_key(key, self.manifest.tensors)
            hint = f"did you mean {close!r}?" if close else "the step's keys: ckptfmt inspect, or Checkpoint.keys()"
            raise KeyMismatchError(f"tensor is not in the checkpoint; {hint}", key=key, object=f"step {self.step}",
                                   expected=close or "a saved key", found="missing") from None

    # ------------------------------------------------------------------ tensors
    def read(self, key: str, box: Box | None = None) -> np.ndarray:
        """Read one box (default: the whole tensor), verified. Raises a CheckpointError on any fault."""
        t = self.tensor(key)
        return self.read_boxes([(key, box if box is not None else Box.full(t.shape))])[0]

    @pausing_gc
    def read_boxes(self, requests: Sequence[tuple[str, Box]], *,
                   supplied: Mapping[ChunkRef, SuppliedChunk] | None = None,
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Read many boxes of many tensors at once.

        Reads only the inner chunks each box touches, verifies each against the manifest's crc32c
        (and each touched object's size and index checksum), and returns fresh arrays only after
        every byte has been verified. On any fault it raises and returns nothing.

        ``supplied``: stored chunks another process delivered (FORMAT.md 9.1, "the receiver
        verifies"): ``(key path, chunk row) -> (stored bytes, who sent them)``. A chunk the
        requests touch is taken from there instead of storage, after the same checks as a chunk
        read from storage (its length and its crc32c, recomputed and in its trailer, against this
        process's manifest); one that fails raises SizeMismatchError or ChecksumMismatchError
        naming the sender, and nothing is returned.

        ``out``: one array per request to read into (a view of a larger array included), of the
        request's shape and the tensor's dtype, instead of fresh ones; the same arrays are returned.
        On a fault they may hold part of the bytes read (the caller must not use them then).
        """
        t0 = time.perf_counter()
        outs, work = self._plan(requests, out)
        got = self._read_planned(outs, work, supplied, t0)
        if out is None:
            return got
        for dst, a in zip(out, got):
            if a is not dst:  # a mapped read hands back its mapping: its bytes go where the caller asked
                dst[...] = a
        return list(out)

    def _read_planned(self, outs: list[np.ndarray | None], work: dict[tuple[str, int], list[ReadItem]],
                      supplied: Mapping[ChunkRef, SuppliedChunk] | None, t0: float) -> list[np.ndarray]:
        if supplied:
            work = self._take_supplied(work, outs, supplied)
            if not work:  # every chunk came from another process (and passed every check here)
                self.stats.add_time("total", time.perf_counter() - t0)
                return outs  # type: ignore[return-value]
        if self.storage.positional_reads:
            self._local.read(work, outs)
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
        yield from self._local.read_batches(batches, self._plan, self.max_inflight_bytes)

    # ------------------------------------------------------------------ stored chunks (cooperative restore)
    def chunk_refs(self, requests: Sequence[tuple[str, Box]]) -> list[ChunkRef]:
        """The stored chunks (key path, chunk row) that reading ``requests`` touches, each once, in
        plan order. Pure: every process computes the same refs from the same manifest."""
        out: dict[ChunkRef, None] = {}
        by_key: dict[str, list[Box]] = {}
        for key, box in requests:
            by_key.setdefault(key, []).append(box)
        for key, boxes in by_key.items():
            t = self.tensor(key)
            for item in plan_reads(t.geometry, t.shards.offset, self._chunk_starts.of(t), boxes):
                out.setdefault((key, int(item.chunk)), None)
        return list(out)

    def chunk_nbytes(self, ref: ChunkRef) -> int:
        """The stored length of chunk ``ref`` (data and its crc32c trailer), from the manifest."""
        return int(self.tensor(ref[0]).chunks.nbytes[ref[1]])

    def read_chunks(self, refs: Sequence[ChunkRef], *, into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """The stored bytes (data and trailer, as a uint8 array) of each chunk ``refs`` names, read
        from storage and checked as :meth:`read_boxes` checks them (FORMAT.md 9 steps 4-6: the
        object's presence, size and links, its index's crc32c and entries, the chunk's crc32c).
        What a cooperative restore sends to the processes that need a chunk; each of them checks
        the bytes again against its own manifest (``read_boxes(supplied=...)``). Raises the first
        fault; returns nothing then. ``into``: one uint8 array per ref, of its stored length
        (:meth:`chunk_nbytes`), to read into instead of fresh ones (straight from the file where
        the storage reads positionally); partly written on a fault."""
        dst: dict[ChunkRef, np.ndarray] = {}
        if into is not None:
            if len(into) != len(refs):
                raise InvalidStateError("the buffers given to read chunks into do not match the refs",
                                        object=f"step {self.step}", expected=f"{len(refs)} buffers", found=len(into))
            for (key, c), b in zip(refs, into):
                want = self.chunk_nbytes((key, int(c)))
                if b.dtype != np.uint8 or b.ndim != 1 or b.size != want:
                    raise InvalidStateError("a buffer given to read a chunk into differs from its length", key=key,
                                            object=f"chunk {c}", expected=f"uint8 ({want},)",
                                            found=f"{b.dtype} {tuple(b.shape)}")
                dst.setdefault((key, int(c)), b)
        by_shard: dict[tuple[str, int], list[int]] = {}
        for key, c in refs:
            t = self.tensor(key)
            if not 0 <= int(c) < len(t.chunks.crc32c):
                raise KeyMismatchError("chunk row is not in the tensor's chunk table", key=key,
                                       object=f"step {self.step}", expected=f"0 <= row < {len(t.chunks.crc32c)}", found=c)
            by_shard.setdefault((key, self._shard_of(t, int(c))), []).append(int(c))
        got: dict[ChunkRef, np.ndarray] = {}
        for (key, s), chunks in by_shard.items():
            t = self.manifest.tensors[key]
            obj, sb = t.object_key(s), shard_bytes(t, s)
            self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
            probe = self.storage.size_check(obj, t.object_nbytes(s), tensor=key)
            need = sorted(set(chunks))
            ilo, ihi = sb.index
            require_memory(int(t.chunks.nbytes[need].sum()) + (ihi - ilo), key, obj, "the chunks to share")
            index = self.storage.read_range(obj, ilo, ihi, tensor=key)
            direct = bool(dst) and self.storage.positional_reads
            reads: list[tuple[int, Pending | None]] = [] if direct else [
                (c, self.storage.read_range(obj, *sb.chunk(c), tensor=key)) for c in need]
            if direct:  # straight into the caller's buffers, no intermediate copy
                with self.storage.open_positional(obj, tensor=key) as f:
                    for c in need:
                        f.read_into([dst[(key, c)]], sb.chunk(c)[0])
                        reads.append((c, None))
            probe.result()
            mv = memoryview(index.result())
            if len(mv) != ihi - ilo:
                raise SizeMismatchError("shard index read differs from its recorded length", key=key, object=obj,
                                        expected=ihi - ilo, found=len(mv))
            self.checks.index(t, s, obj, mv)
            self.stats.bytes_read += len(mv)
            self.stats.requests += 1 + len(reads) + probe.requests
            for c, fut in reads:
                data = dst[(key, c)] if fut is None else np.frombuffer(fut.result(), dtype=np.uint8)
                if fut is not None and (key, c) in dst:
                    dst[(key, c)][...] = data
                    data = dst[(key, c)]
                self.checks.chunk(t, c, obj, memoryview(data))
                self.stats.bytes_read += int(data.size)
                got[(key, c)] = data
        return [got[(k, int(c))] for k, c in refs]

    def _shard_of(self, t: TensorEntry, c: int) -> int:
        """The shard row that holds chunk row ``c`` of ``t``."""
        return int(np.searchsorted(self._chunk_starts.of(t), c, side="right")) - 1

    def _take_supplied(self, work: dict[tuple[str, int], list[ReadItem]], outs: list[np.ndarray | None],
                       supplied: Mapping[ChunkRef, SuppliedChunk]) -> dict[tuple[str, int], list[ReadItem]]:
        """Fill ``outs`` from the supplied chunks the plan touches, each checked against this
        process's manifest first (the receiver verifies, FORMAT.md 9.1); returns the work left
        for storage."""
        left: dict[tuple[str, int], list[ReadItem]] = {}
        mine: dict[ChunkRef, list[ReadItem]] = {}
        for (key, s), items in work.items():
            for it in items:
                if (key, it.chunk) in supplied:
                    mine.setdefault((key, it.chunk), []).append(it)
                else:
                    left.setdefault((key, s), []).append(it)
        tv = time.perf_counter()
        decoded: dict[ChunkRef, np.ndarray] = {}
        for (key, c) in mine:
            t = self.manifest.tensors[key]
            data, sender = supplied[(key, c)]
            what = f"chunk {c} of {t.object_key(self._shard_of(t, c))}, sent by {sender}"
            mv = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            self.checks.chunk(t, c, what, mv)
            decoded[(key, c)] = self.checks.decode(t, c, what, mv)
        self.stats.add_time("verify", time.perf_counter() - tv)
        for ref, items in mine.items():
            for it in items:
                outs[it.request][it.dst or ...] = decoded[ref][it.src or ...]  # type: ignore[index]
        return left

    def _plan(self, requests: Sequence[tuple[str, Box]], out: Sequence[np.ndarray] | None = None
              ) -> tuple[list[np.ndarray | None], dict[tuple[str, int], list[ReadItem]]]:
        """Allocate fresh outputs (or take ``out``'s, checked against the requests) and group the
        read items by (tensor, shard). Pure except allocation."""
        t0 = time.perf_counter()
        by_key: dict[str, list[int]] = {}
        for i, (key, box) in enumerate(requests):
            by_key.setdefault(key, []).append(i)
        work: dict[tuple[str, int], list[ReadItem]] = {}
        if out is None:
            check_outputs_fit([(k, math.prod(b.shape) * numpy_dtype(self.tensor(k).dtype).itemsize)
                               for k, b in requests], f"step {self.step}")
            outs: list[np.ndarray | None] = list(allocate_many([(k, b, numpy_dtype(self.tensor(k).dtype))
                                                                for k, b in requests]))
        else:
            outs = list(out)
            if len(outs) != len(requests):
                raise InvalidStateError("the outputs given to read into do not match the requests", object=f"step {self.step}",
                                        expected=f"{len(requests)} arrays", found=f"{len(outs)} arrays")
            for (k, b), a in zip(requests, outs):
                dt = numpy_dtype(self.tensor(k).dtype)
                if tuple(a.shape) != b.shape or a.dtype != dt:
                    raise InvalidStateError("an output given to read into differs from its request", key=k,
                                            object=f"step {self.step}", expected=f"{dt} {b.shape}",
                                            found=f"{a.dtype} {tuple(a.shape)}")
        for key, idxs in by_key.items():
            t = self.tensor(key)
            boxes = [requests[i][1] for i in idxs]
            for item in plan_reads(t.geometry, t.shards.offset, self._chunk_starts.of(t), boxes):
                work.setdefault((key, item.shard), []).append(
                    ReadItem(idxs[item.request], item.shard, item.chunk, item.src, item.dst))
        self.stats.add_time("plan", time.perf_counter() - t0)
        return outs, work

    def _issue(self, key: str, s: int, items: list[ReadItem]) -> "_ShardRead":
        """Start the reads one shard needs: the whole object, or its index plus the needed chunks."""
        t = self.manifest.tensors[key]
        obj, sb = t.object_key(s), shard_bytes(t, s)
        starts = self._chunk_starts.of(t)
        chunks = sorted({it.chunk for it in items})
        nbytes = sb.nbytes
        self.stats.objects += 1
        self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
        # Every range ends at or before nbytes; the size is checked apart (stat, or one byte at nbytes).
        probe = self.storage.size_check(obj, t.object_nbytes(s), tensor=key)
        self.stats.requests += probe.requests
        if len(chunks) == int(starts[s + 1] - starts[s]):
            require_memory(nbytes, key, obj, "the whole shard")
            self.stats.requests += 1
            return _ShardRead(key, s, items, obj, True, [self.storage.read_range(obj, *sb.whole, tensor=key)], probe, nbytes)
        ilo, ihi = sb.index
        held = int(t.chunks.nbytes[chunks].sum()) + (ihi - ilo)
        require_memory(held, key, obj, "the shard's needed chunks")
        futs = [self.storage.read_range(obj, ilo, ihi, tensor=key)]
        for c in chunks:
            futs.append(self.storage.read_range(obj, *sb.chunk(c), tensor=key))
        self.stats.requests += len(futs)
        return _ShardRead(key, s, items, obj, False, futs, probe, held)

    def _finish(self, issued: "_ShardRead", outs: list[np.ndarray | None]) -> None:
        """Wait for one shard's reads, verify every byte against the manifest, copy into the outputs."""
        key, s, items, obj = issued.key, issued.shard, issued.items, issued.obj
        t = self.manifest.tensors[key]
        tw = time.perf_counter()
        issued.probe.result()
        raw = [f.result() for f in issued.reads]
        self.stats.add_time("read", time.perf_counter() - tw)
        self.stats.bytes_read += sum(len(r) for r in raw)
        tv = time.perf_counter()
        chunks = sorted({it.chunk for it in items})
        chunk_bytes: dict[int, memoryview] = {}
        if issued.whole:
            chunk_bytes = self.checks.whole(t, s, obj, raw[0], chunks)
        else:
            index = memoryview(raw[0])
            ilo, ihi = shard_bytes(t, s).index
            if len(index) != ihi - ilo:
                raise SizeMismatchError("shard index read differs from its recorded length", key=key, object=obj,
                                        expected=ihi - ilo, found=len(index))
            self.checks.index(t, s, obj, index)
            for c, r in zip(chunks, raw[1:]):
                chunk_bytes[c] = memoryview(r)
                self.checks.chunk(t, c, obj, chunk_bytes[c])
        self.stats.add_time("verify", time.perf_counter() - tv)
        ta = time.perf_counter()
        decoded = {c: self.checks.decode(t, c, obj, mv) for c, mv in chunk_bytes.items()}
        for it in items:
            outs[it.request][it.dst or ...] = decoded[it.chunk][it.src or ...]  # type: ignore[index]
        self.stats.add_time("assemble", time.perf_counter() - ta)

    # ------------------------------------------------------------------ non-tensor state
    def _state_object(self, name: str) -> Any:
        data = self.state_bytes(name)
        return None if data is None else decode_state(data)

    def state_bytes(self, name: str = "global") -> bytes | None:
        """The stored bytes of state object ``name`` (``"global"`` or ``"rank/<r>"``), checked
        against the manifest (size and crc32c), not decoded; None when the step has none. What a
        holder sends a peer, which checks them again (:func:`check_state_bytes`)."""
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
        check_state_bytes(self.manifest, name, data)
        self.stats.bytes_read += len(data)
        return data

    def state(self) -> Any:
        """The global non-tensor state (decoded msgpack, verified), or None if none was saved."""
        return self._state_object("global")

    def rank_state(self, rank: int, *, world: int | None = None, policy: str | None = None) -> Any:
        """Per-rank state saved by ``rank``, or None when that rank saved none.

        Decided by :func:`ckptfmt.rankstate.rank_state_source` (FORMAT.md 7.4), as in every bridge:
        a checkpoint that holds no per-rank state (no ``rank/<r>`` entry) returns None for any
        ``world`` and policy. One that holds some, restored on a different number of ranks
        (``world`` != saved writers), raises TopologyChangedError unless ``policy`` is given:
        "drop" returns None, "rank0" returns rank 0's state for every rank, "same-rank" returns
        rank ``rank``'s state when it exists. A policy not in :data:`RANK_STATE_POLICIES` is a
        usage error: ValueError, before any read.
        """
        checked = RankStatePolicy.of(policy)  # the public entry: the one check, before any read
        source = rank_state_source(self.manifest.state, step=self.step, saved_world=self.saved_world, rank=rank,
                                   world=world, policy=checked)
        return None if source is None else self._state_object(f"rank/{source}")

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
            self._local_verify.verify(keys, report, buffers, self.max_inflight_bytes, self._verify_in_parts)
            keys = []
        for key in keys:
            t = self.manifest.tensors[key]
            starts = self._chunk_starts.of(t)
            reads: list[_WholeRead] = []
            held = 0
            for s in range(len(t.shards)):
                obj, n, sb = t.object_key(s), int(t.shards.nbytes[s]), shard_bytes(t, s)
                if n > self.max_inflight_bytes:  # a shard larger than the window: its index, then its chunks
                    report(self._verify_in_parts(t, s))
                    continue
                if reads and held + n > self.max_inflight_bytes:
                    report(self._verify_whole(t, reads, starts))
                    reads, held = [], 0
                # Each object read up to its recorded size, its length checked apart.
                self.storage.check_no_links(obj, self._plain_dirs, tensor=key)
                reads.append(_WholeRead(s, obj, n, self.storage.size_check(obj, t.object_nbytes(s), tensor=key),
                                        self.storage.read_range(obj, *sb.whole, tensor=key)))
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
            checked = self.checks.whole(t, r.shard, r.obj, buf, range(int(starts[r.shard]), int(starts[r.shard + 1])))
            if t.array.codec != "raw":  # an encoded chunk must also decode (FORMAT.md 6.3)
                for c, mv in checked.items():
                    self.checks.decode(t, c, r.obj, mv)
            self.stats.bytes_read += len(buf)
        return sum(r.nbytes for r in reads)

    def _verify_in_parts(self, t: TensorEntry, s: int) -> int:
        """Verify one shard larger than the read window: its index, then its chunks, a window at a
        time, so that verify never holds more than the window (or one chunk) of it."""
        obj, n, sb = t.object_key(s), int(t.shards.nbytes[s]), shard_bytes(t, s)
        c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
        biggest = int(t.chunks.nbytes[c0:c1].max()) if c1 > c0 else 0
        ilo, ihi = sb.index
        require_memory(max(biggest, ihi - ilo), t.key, obj, "one chunk or index")
        self.storage.check_no_links(obj, self._plain_dirs, tensor=t.key)
        probe = self.storage.size_check(obj, t.object_nbytes(s), tensor=t.key)
        index = self.storage.read_range(obj, ilo, ihi, tensor=t.key)
        probe.result()
        self.checks.index(t, s, obj, memoryview(index.result()))
        per = max(1, self.max_inflight_bytes // max(biggest, 1))
        for lo in range(c0, c1, per):
            reads = [(c, self.storage.read_range(obj, *sb.chunk(c), tensor=t.key)) for c in range(lo, min(c1, lo + per))]
            for c, f in reads:
                mv = memoryview(f.result())
                self.checks.chunk(t, c, obj, mv)
                if t.array.codec != "raw":
                    self.checks.decode(t, c, obj, mv)
        self.stats.bytes_read += (ihi - ilo) + int(t.chunks.nbytes[c0:c1].sum())
        return n


def check_state_bytes(manifest: Manifest, name: str, data: Any, sender: str = "") -> None:
    """State object ``name``'s bytes against ``manifest``: its size, then its crc32c
    (SizeMismatchError / ChecksumMismatchError naming the object and ``sender`` when another
    process sent them)."""
    e = manifest.state[name]
    what = e.key + (f", sent by {sender}" if sender else "")
    if len(data) != e.nbytes:
        raise SizeMismatchError("state object size differs from the manifest", key=name, object=what,
                                expected=e.nbytes, found=len(data))
    got = crc32c(data)
    if got != e.crc32c:
        raise ChecksumMismatchError("state object checksum differs from the manifest", key=name, object=what,
                                    expected=e.crc32c, found=got)


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
