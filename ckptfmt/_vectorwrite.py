"""Step 3 of the save protocol on local files: shard objects written straight from the source arrays.

The general path (:mod:`ckptfmt._shardwriter`) hands each shard block to tensorstore, which copies
it into its zarr3 sharding codec's buffers, computes every inner chunk's crc32c again, and writes
the object. Here, for a store whose objects are local files (:attr:`Storage.vectored_writes`),
each shard object is built as a list of buffers -- every stored inner chunk (a view of the source
array where the chunk is one contiguous region of it, else a zero-padded copy in a staging
buffer), its crc32c, and finally the shard index with its crc32c (FORMAT.md 6.2) -- and handed to
``pwritev``. Each chunk's crc32c is computed once, from the bytes written.

Durability is the general path's: each object is written to ``<key>.__lock``, fsync'd, checked by
``fstat`` size, and renamed into place; then every directory written into is fsync'd, before the
rank acknowledges. What the read-back of the general path proves (the stored trailers equal the
source's crc32c) holds here by construction: the trailers are the crc32c of the very buffers
written. The bytes on disk equal the general path's (``tests/test_vectorwrite.py`` pins this).
"""
from __future__ import annotations

import math
import os
import secrets
import stat
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _localfs, layout
from ._kvstore import kv_errors, storage_error
from ._localfs import LOCK_SUFFIX
from ._types import LocalShard
from .checksum import crc32c
from .errors import IncompleteSaveError, StorageError
from .plan import TensorWritePlan, WriteItem, stored_chunk_counts
from .storage import Storage

if TYPE_CHECKING:
    from ._shardwriter import ReuseHook, ShardRecord
    from .session import SaveOptions

__all__ = ["write_local"]

#: Writer threads (pwritev, fsync and crc32c release the GIL): enough to keep a disk's queue full.
DEFAULT_WRITE_THREADS = 16
#: Most bytes of chunk copies (staging) one writer thread holds before it writes them out.
_STAGE_BYTES = 8 << 20
#: Objects smaller than this are handed to the writer threads in groups (one task per few objects).
_SMALL_OBJECT_BYTES = 1 << 20
#: A batch of reuse decisions holds at most this fraction of ``max_inflight_bytes`` in blocks to write.
REUSE_BATCH_FRACTION = 0.25
#: Most buffers one pwritev call takes (Linux IOV_MAX).
_IOV_MAX = 1024


@dataclass(frozen=True)
class _Job:
    """One shard object to write: its plan and item, the source block, and where it goes."""

    plan: TensorWritePlan
    item: WriteItem
    block: np.ndarray
    path: str   # local file path of the object
    key: str    # object key
    crcs: tuple[int, ...] | None = None  # each stored chunk's crc32c, where the reuse check computed them


def write_local(storage: Storage, plans: list[TensorWritePlan], local: dict[str, list[LocalShard]],
                save_id: str, rank: int, opts: "SaveOptions", reuse: "ReuseHook | None" = None) -> list["ShardRecord"]:
    """Write this rank's shards as local files (rank 0 also every array's zarr.json, through
    tensorstore); shards the ``reuse`` hook references (an incremental save, FORMAT.md 8.4) are not
    written, and come back as its records. Raises like :func:`ckptfmt._shardwriter.write_and_verify`: StepMismatchError for
    source data that does not match its declaration, StorageError when a write fails,
    IncompleteSaveError when an object's size on disk is not what was written."""
    from ._shardwriter import holders, shard_block
    from .session import add_time
    t = time.perf_counter()
    mine = [(p, it) for p in plans for it in p.items_for(rank)]
    # zarr.json of every array (rank 0): tensorstore writes it, while the shards are written.
    opened = [(p, storage.open_array(layout.array_path(save_id, p.index), layout.zarr_array_metadata(
        p.geometry.shape, p.dtype, p.geometry.shard_shape, p.geometry.chunk_shape), create=True))
        for p in (plans if rank == 0 else ())]
    if opts.jitter_s > 0 and mine:
        time.sleep(secrets.SystemRandom().uniform(0, opts.jitter_s))
    do_fsync = bool(storage.options.get("fsync", True))
    threads = max(1, min(len(mine), int(storage.options.get("write_threads", DEFAULT_WRITE_THREADS))))
    records: list[Any] = [None] * len(mine)
    referenced: list[Any] = []
    dirs: set[str] = set()
    window: deque[tuple[Any, int]] = deque()  # writes in flight, oldest first, with the bytes they hold
    cache: dict[int, np.ndarray] = {}
    dt_cache: dict[str, np.dtype] = {}
    # A block made by a callable (lazy data) is let go after its last write is submitted, and
    # counted as in flight until that write is done (the writes view it), as on the general path.
    found = holders(mine, local)
    lazy_last = {id(h): n for n, h in enumerate(found) if callable(h.data)}
    inflight, pace_start, paced = 0, time.monotonic(), 0
    t = add_time(opts, "plan", t)
    pool = writer_pool(threads)
    stopped = threading.Event()  # set once this save ends (done or failed): its queued objects are not written
    try:
        n = 0
        while n < len(mine):
            # Decide a batch first, then submit its writes: the reuse checks (crc32c, device-to-host
            # copies) release the GIL, and each wait to take it back behind busy writer threads
            # costs up to a switch interval, which made the checks of a small save 5x slower. A
            # batch holds at most REUSE_BATCH_FRACTION of the write window in blocks to write.
            batch: list[tuple[int, list[Any]]] = []
            kept = 0
            while n < len(mine) and (not batch or kept < opts.max_inflight_bytes * REUSE_BATCH_FRACTION):
                made = _decide(mine[n], found[n], n, reuse, referenced, cache, dt_cache, lazy_last)
                if made is not None:
                    batch.append((n, made))
                    kept += mine[n][1].box.size * mine[n][0].geometry.itemsize
                n += 1
            # Small objects go to the writer threads a few at a time (at most one task per thread
            # for the batch): a later save of an incremental run writes many objects of a few
            # hundred KiB, and a future per object was a quarter of the objects the save allocated.
            per_task = max(1, -(-len(batch) // threads))
            group: list[tuple[_Job, int]] = []
            group_held = 0
            for m, made in batch:
                p, it = mine[m]
                holder = found[m]
                block = made[0] if made else shard_block(holder, p, it, cache, dt_cache)
                key = layout.shard_key(layout.array_path(save_id, p.index), it.cell)
                path = storage.local_file(key)
                dirs.add(os.path.dirname(path))
                held = block.nbytes + (cache.pop(id(holder)).nbytes if lazy_last.get(id(holder)) == m else 0)
                group.append((_Job(p, it, block, path, key, tuple(made[1]) if len(made) > 1 else None), m))
                group_held += held
                if opts.max_write_bytes_per_s:
                    paced += block.nbytes
                    ahead = paced / opts.max_write_bytes_per_s - (time.monotonic() - pace_start)
                    if ahead > 0:
                        time.sleep(ahead)
                if len(group) < per_task and group_held < _SMALL_OBJECT_BYTES and m != batch[-1][0]:
                    continue
                window.append((pool.submit(_write_objects, group, do_fsync, records, stopped), group_held))
                inflight += group_held
                group, group_held = [], 0
                while inflight > opts.max_inflight_bytes and window:  # a sliding window, not a barrier
                    fut, nbytes = window.popleft()
                    fut.result()
                    inflight -= nbytes
        for fut, _ in window:
            fut.result()  # the first failure raises; the finally below waits for the rest
        for p, fut in opened:
            with kv_errors("cannot create the tensor array", key=p.key, object=layout.array_path(save_id, p.index)):
                fut.result()
        t = add_time(opts, "write", t)
        if do_fsync:  # the same threads: a small save spends as long starting threads as writing
            _fsync_dirs(storage, dirs, save_id, pool, threads)
        add_time(opts, "fsync", t)
    finally:
        stopped.set()  # after a failure: what has not started never runs, the rest ends here
        for fut, _ in window:
            fut.cancel()
        wait([f for f, _ in window])
        cache.clear()
    return [r for r in records if r is not None] + referenced


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def writer_pool(threads: int) -> ThreadPoolExecutor:
    """The process's writer threads for ``threads`` workers, created on first use (not at import)
    and kept: starting 16 threads took as long as a small save's writes. Saves running at once
    share them; jobs never wait on other jobs, so sharing cannot deadlock. Keyed by process id, so
    a forked child never waits on threads that exist only in its parent."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptfmt-write")
        return pool


def _decide(entry: tuple[TensorWritePlan, WriteItem], holder: LocalShard, n: int, reuse: "ReuseHook | None",
            referenced: list[Any], cache: dict[int, np.ndarray], dt_cache: dict[str, np.dtype],
            lazy_last: dict[int, int]) -> list[Any] | None:
    """The reuse decision for item ``n``: None when the hook referenced it (its record is appended
    to ``referenced``), else what the check made of it, to write: [] (nothing yet), [block], or
    [block, chunk crc32c] (a shard it did not prove is written with these, not computed twice)."""
    from ._shardwriter import _chunk_crcs, shard_block
    made: list[Any] = []
    if reuse is None:
        return made
    p, it = entry

    def with_crcs(crcs: bool = True) -> tuple[np.ndarray, list[int] | None]:
        if not made:
            made.append(shard_block(holder, p, it, cache, dt_cache))
        if crcs and len(made) < 2:
            made.append(_chunk_crcs(made[0], p.geometry.chunk_shape))
        return made[0], made[1] if len(made) > 1 else None

    ref = reuse(p, it, holder, with_crcs)
    if ref is None:
        return made
    referenced.append(ref)
    if lazy_last.get(id(holder)) == n:
        cache.pop(id(holder), None)
    return None


def _chunk_buffers(block: np.ndarray, chunk_shape: tuple[int, ...], counts: tuple[int, ...],
                   dt: np.dtype) -> Any:
    """Each stored inner chunk of ``block`` in C order: a uint8 view of the source where the chunk
    is one contiguous region of it, else None and the chunk itself (to be copied and padded)."""
    full = tuple(chunk_shape)
    for idx in product(*(range(k) for k in counts)):
        sl = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk_shape))
        part = block[sl] if sl else block
        if part.shape == full and part.flags.c_contiguous:
            yield part.reshape(-1).view(np.uint8), None
        else:
            yield None, part


def _write_objects(group: list[tuple[_Job, int]], do_fsync: bool, records: list[Any], stop: threading.Event) -> None:
    """Write a group of shard objects one after another (in a writer thread), unless the save stopped."""
    for job, n in group:
        if stop.is_set():
            return
        _write_object(job, do_fsync, records, n)


def _write_object(job: _Job, do_fsync: bool, records: list[Any], n: int) -> None:
    """Write one shard object (in a writer thread) and put its record at ``records[n]``."""
    from ._shardwriter import ShardRecord
    p, it, g = job.plan, job.item, job.plan.geometry
    dt = job.block.dtype
    counts = stored_chunk_counts(g, it.box.offset)
    nchunks = math.prod(counts)
    cn = g.chunk_nbytes
    data_bytes = cn - layout.CRC_BYTES
    # The index: every inner chunk NOT_STORED except the stored ones, back to back from 0 in C order.
    index = np.full((math.prod(g.inner), 2), layout.NOT_STORED, layout.INDEX_ENTRY)
    if nchunks:
        cells = np.indices(counts).reshape(len(counts), -1) if counts else np.zeros((0, 1), np.int64)
        flat = np.ravel_multi_index(tuple(cells), g.inner) if counts else np.zeros(1, np.int64)
        index[flat, 0] = np.arange(nchunks, dtype=np.uint64) * np.uint64(cn)
        index[flat, 1] = cn
    body = index.tobytes()
    index_crc = crc32c(body)
    trailers = bytearray(layout.CRC_BYTES * nchunks)
    tails = memoryview(trailers)
    crcs: list[int] = []
    stage = None
    used = 0
    iov: list[Any] = []
    offset = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    tmp = job.path + LOCK_SUFFIX
    try:
        os.makedirs(os.path.dirname(job.path), exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    except OSError as e:
        raise storage_error("write failed", e, object=job.key, key=p.key) from None
    try:
        for i, (view, part) in enumerate(_chunk_buffers(job.block, g.chunk_shape, counts, dt)):
            if view is None:
                if stage is None:
                    stage = np.empty(max(_STAGE_BYTES, data_bytes), np.uint8)
                if used + data_bytes > len(stage):  # the staging buffer is full: write out what it holds
                    offset += _pwritev_all(fd, iov, offset, job.key, p.key)
                    iov, used = [], 0
                view = stage[used:used + data_bytes]
                used += data_bytes
                padded = view.view(dt).reshape(g.chunk_shape)
                if part.shape != tuple(g.chunk_shape):
                    padded[...] = 0
                padded[tuple(slice(0, k) for k in part.shape)] = part
            c = job.crcs[i] if job.crcs is not None else crc32c(view)
            crcs.append(c)
            tail = tails[layout.CRC_BYTES * i:layout.CRC_BYTES * (i + 1)]
            tail[:] = c.to_bytes(layout.CRC_BYTES, "little")
            iov += (view, tail)
            if len(iov) >= _IOV_MAX - 2:
                offset += _pwritev_all(fd, iov, offset, job.key, p.key)
                iov, used = [], 0
        iov += (body, index_crc.to_bytes(layout.CRC_BYTES, "little"))
        offset += _pwritev_all(fd, iov, offset, job.key, p.key)
        if do_fsync:
            os.fsync(fd)
        st = os.fstat(fd)
    except OSError as e:
        _discard(fd, tmp)
        raise storage_error("write failed", e, object=job.key, key=p.key) from None
    except BaseException:
        _discard(fd, tmp)
        raise
    os.close(fd)
    total = nchunks * cn + g.index_nbytes
    if not stat.S_ISREG(st.st_mode) or st.st_size != total or offset != total:
        _discard(-1, tmp)
        raise IncompleteSaveError("written shard has an unexpected size", key=p.key, object=job.key,
                                  expected=total, found=st.st_size)
    try:
        os.rename(tmp, job.path)
    except OSError as e:
        _discard(-1, tmp)
        raise storage_error("write failed", e, object=job.key, key=p.key) from None
    records[n] = ShardRecord(p.index, it.cell, total, index_crc, tuple(range(0, nchunks * cn, cn)), tuple(crcs))


def _pwritev_all(fd: int, buffers: list[Any], offset: int, key: str, tensor: str) -> int:
    """Write every buffer at ``offset`` (looping over short writes); the bytes written."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    done = 0
    while views:
        n = os.pwritev(fd, views, offset + done)
        if n <= 0:
            raise StorageError("write failed", key=tensor, object=key, found="pwritev wrote no bytes")
        done += n
        _localfs.advance(views, n)
    return done


def _discard(fd: int, tmp: str) -> None:
    if fd >= 0:
        os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass  # gc removes stale lock files


def _fsync_dirs(storage: Storage, dirs: set[str], save_id: str, pool: ThreadPoolExecutor, threads: int) -> None:
    """fsync every directory an object was renamed into, and each directory above it up to the
    save's own (created on the way), so that the objects' names are durable before the ack."""
    top = os.path.dirname(storage.local_file(layout.save_prefix(save_id)).rstrip("/"))
    todo: set[str] = set()
    for d in dirs:
        while d.startswith(top) and d != top and d not in todo:
            todo.add(d)
            d = os.path.dirname(d)
    # Concurrently, one task per writer thread: the file system commits the pending directory
    # entries of many fsyncs in one journal commit, where one fsync after another would wait for a
    # commit each.
    order = sorted(todo)
    k = max(1, min(len(order), threads))
    for fut in [pool.submit(_fsync_dir_list, order[i::k]) for i in range(k)]:
        fut.result()


def _fsync_dir_list(dirs: list[str]) -> None:
    for d in dirs:
        _fsync_dir(d)


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise storage_error("directory fsync failed", e, object=d) from None
