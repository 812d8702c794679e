"""Durable local file writes, and the process's writer threads.

One way to put bytes in a local file so that they survive a crash: written with ``pwritev``
(looping over short writes), ``fsync``'d, checked by ``fstat`` size, and given their name by a
rename; the directories renamed into are ``fsync``'d before anyone is told (FORMAT.md 14.2). Or,
where Linux offers it (:func:`filesystem_sync_available`), the save's batched form: each object's
data is written back with ``sync_file_range`` (wait, write, wait: on the device, no cache flush),
and one ``syncfs`` of the file system, on a descriptor opened before the first write, then
writes every inode and directory entry and flushes the device once (:func:`syncfs`). The
local-file backend (:meth:`ckptfmt.storage._filestore.LocalFileStorage.write_object`, ``sync``) and the
safetensors exporter (:mod:`ckptfmt.interop._stexport`) both write through these functions.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np

from ckptfmt.storage._kverrors import storage_error
from ckptfmt.storage._localfs import LOCK_SUFFIX, advance
from ckptfmt.errors import StorageError

__all__ = ["SYNC_MODES", "DIRECT_ALIGN", "set_direct", "kept_pool", "writer_pool", "pwritev_all", "put_direct_at", "write_file", "fill",
           "fsync_dir", "fsync_dirs", "fsync_path", "filesystem_sync_available", "sync_range", "syncfs"]

#: Bytes one ``write_file`` gathers before it hands them to ``pwritev`` (chunk copies are made as
#: the buffers are iterated, so this bounds what one writer thread holds of them).
_STAGE_BYTES = 8 << 20
#: Most buffers one pwritev call takes (Linux IOV_MAX).
_IOV_MAX = 1024
#: ``O_DIRECT`` writes: offsets, lengths and the buffer are multiples of this (a page covers the
#: logical block size of every Linux block device), and each writer thread stages this many bytes.
DIRECT_ALIGN = 4096
_DIRECT_BYTES = 4 << 20

#: How a written file is made durable: "fsync" (the file, then its directory), "range" (its data
#: written back by sync_file_range; durable only after a later :func:`syncfs`), "none" (not at all).
SYNC_MODES = ("fsync", "range", "none")
#: sync_file_range flags: SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER.
_RANGE_WAIT_WRITE_WAIT = 1 | 2 | 4

_POOLS: dict[tuple[int, str, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def kept_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The process's threads named ``name`` (``threads`` workers), created on first use (not at
    import) and kept: starting 16 threads took as long as a small save's writes, and a manager's
    retention, which verifies after every save, took that CPU from the training threads. Work
    running at once shares them; callers submit only jobs that never wait on other jobs, so
    sharing cannot deadlock. Keyed by process id, so a forked child never waits on threads that
    exist only in its parent."""
    key = (os.getpid(), name, threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        return pool


def writer_pool(threads: int) -> ThreadPoolExecutor:
    """The process's writer threads for ``threads`` workers (:func:`kept_pool`)."""
    return kept_pool("ckptfmt-write", threads)


def pwritev_all(fd: int, buffers: Sequence[Any], offset: int, *, obj: str, tensor: str | None = None) -> int:
    """Write every buffer at ``offset`` (looping over short writes); the bytes written. Raises
    StorageError naming ``obj`` (and ``tensor``) and the kind of failure (disk full, ...)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    done = 0
    try:
        while views:
            n = os.pwritev(fd, views[:_IOV_MAX], offset + done)
            if n <= 0:
                raise StorageError("write failed", key=tensor, object=obj, found="pwritev wrote no bytes")
            done += n
            advance(views, n)
    except OSError as e:
        raise storage_error("write failed", e, object=obj, key=tensor) from None
    return done


@functools.lru_cache(maxsize=None)
def _libc() -> Any | None:
    """libc's sync_file_range and syncfs (Linux), loaded on first use; None where absent."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        libc.syncfs.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def filesystem_sync_available() -> bool:
    """Whether :func:`sync_range` and :func:`syncfs` can run here (Linux with both calls)."""
    return _libc() is not None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def sync_range(fd: int) -> None:
    """Write the whole file's dirty data to the device and wait (``sync_file_range`` with wait,
    write, wait); its metadata and the device's cache are left to :func:`syncfs`. OSError on failure."""
    _check(_libc().sync_file_range(fd, 0, 0, _RANGE_WAIT_WRITE_WAIT), "sync_file_range")


def syncfs(fd: int) -> None:
    """``syncfs(2)`` the file system of ``fd``: every dirty inode, directory entry and data page on
    it is written and the device's cache flushed. Linux (5.8 and later) reports a write-back error
    of that file system that happened since ``fd`` was opened. OSError on failure."""
    _check(_libc().syncfs(fd), "syncfs")


def fill(fd: int, path: str, buffers: Iterable[Any], *, fsync: bool | str = True, obj: str | None = None,
         tensor: str | None = None, direct: bool = False) -> int:
    """Write ``buffers`` in order from offset 0 into the new file ``fd`` and make it durable as
    ``fsync`` says (True or "fsync": ``fsync``; "range": :func:`sync_range`, durable once a
    :func:`syncfs` follows; False or "none": not at all); the bytes written. ``direct``: ``fd``
    has ``O_DIRECT`` set, and the bytes go through :func:`_put_direct`. On any failure the file
    is closed and removed, and the error raised. ``fd`` is closed either way."""
    mode = {True: "fsync", False: "none"}.get(fsync, fsync)  # type: ignore[call-overload]
    name = obj or path
    try:
        offset = (_put_direct if direct else _put)(fd, buffers, name, tensor)
        if mode == "fsync":
            os.fsync(fd)
        elif mode == "range":
            sync_range(fd)
        st = os.fstat(fd)
    except OSError as e:
        _discard(fd, path)
        raise storage_error("write failed", e, object=name, key=tensor) from None
    except BaseException:
        _discard(fd, path)
        raise
    os.close(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != offset:
        _discard(-1, path)
        raise StorageError("written file has an unexpected size", key=tensor, object=name,
                           expected=offset, found=st.st_size if stat.S_ISREG(st.st_mode) else "not a regular file")
    return offset


def _put(fd: int, buffers: Iterable[Any], name: str, tensor: str | None) -> int:
    """``buffers`` through ``pwritev``, gathered up to ``_STAGE_BYTES`` per call; the bytes written."""
    offset, held, iov = 0, 0, []
    for b in buffers:
        v = memoryview(b).cast("B")
        iov.append(v)
        held += v.nbytes
        if held >= _STAGE_BYTES or len(iov) >= _IOV_MAX:
            offset += pwritev_all(fd, iov, offset, obj=name, tensor=tensor)
            iov, held = [], 0
    return offset + pwritev_all(fd, iov, offset, obj=name, tensor=tensor)


def write_file(path: str, buffers: Iterable[Any], *, fsync: bool | str = True, obj: str | None = None,
               tensor: str | None = None, direct: bool = False) -> int:
    """Write ``buffers`` as the file ``path``: into ``path + ".__lock"`` (created exclusively),
    made durable as ``fsync`` says (:func:`fill`), checked by size, renamed over ``path``; the bytes written. The directory is not
    ``fsync``'d here (:func:`fsync_dirs`, once for many files). ``direct``: write through
    ``O_DIRECT`` where the file system takes it (:func:`set_direct`, :func:`_put_direct`). On failure the lock file is
    removed (gc removes one a killed process leaves) and a StorageError raised."""
    tmp = path + LOCK_SUFFIX
    name = obj or path
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error("write failed", e, object=name, key=tensor) from None
    n = fill(fd, tmp, buffers, fsync=fsync, obj=name, tensor=tensor, direct=direct and set_direct(fd, True))
    try:
        os.rename(tmp, path)
    except OSError as e:
        _discard(-1, tmp)
        raise storage_error("write failed", e, object=name, key=tensor) from None
    return n


def set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the platform or file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
        return True
    except OSError:
        return False


class _Staging(threading.local):
    """One page-aligned staging buffer per writer thread, allocated on its first direct write and
    kept: its pages are touched once per thread, never again per save."""

    buf: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self.buf is None:
            self.buf = np.frombuffer(mmap.mmap(-1, _DIRECT_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                                     dtype=np.uint8)  # private: no shmem pages behind it
        return self.buf


_STAGING = _Staging()


def _put_direct(fd: int, buffers: Iterable[Any], name: str, tensor: str | None) -> int:
    """``buffers`` through ``O_DIRECT`` (already set on ``fd``): copied into this thread's aligned
    staging buffer and written in whole blocks straight to the device, without page-cache pages to
    allocate; the last block is padded to :data:`DIRECT_ALIGN` and the file truncated to its size.
    The bytes written. (``O_DIRECT`` data may sit in the device's cache: the fsync or syncfs that
    follows flushes it, and writes the file's metadata.)"""
    n = put_direct_at(fd, buffers, 0, name=name, tensor=tensor)
    if n % DIRECT_ALIGN:
        os.ftruncate(fd, n)
    return n


#: Buffers up to this size are copied into the staging buffer by a memoryview slice assignment
#: (a plain memcpy, without numpy's per-call cost); larger ones by numpy, which releases the GIL.
_SMALL_COPY = 64 << 10


def put_direct_at(fd: int, buffers: Iterable[Any], base: int, *, name: str, tensor: str | None = None) -> int:
    """``buffers`` through ``O_DIRECT`` (set on ``fd``) from ``base`` (a multiple of
    :data:`DIRECT_ALIGN`), copied into this thread's aligned staging buffer and written in whole
    blocks; the last block is padded with zeros to :data:`DIRECT_ALIGN` (the caller owns those
    bytes: a pack places nothing there). The bytes of ``buffers`` written."""
    stage = _STAGING.get()
    view, size = memoryview(stage), stage.size
    offset, pos = base, 0
    for b in buffers:
        src = memoryview(b).cast("B")
        n = src.nbytes
        if n <= _SMALL_COPY and pos + n < size:  # most buffers of small shards: one slice copy each
            view[pos:pos + n] = src
            pos += n
            continue
        arr = np.frombuffer(src, dtype=np.uint8)  # numpy lets go of the GIL while it copies
        while arr.size:
            k = min(arr.size, size - pos)
            np.copyto(stage[pos:pos + k], arr[:k])
            pos, arr = pos + k, arr[k:]
            if pos == size:
                offset += pwritev_all(fd, [stage], offset, obj=name, tensor=tensor)
                pos = 0
    if pos:
        padded = -(-pos // DIRECT_ALIGN) * DIRECT_ALIGN
        stage[pos:padded] = 0
        pwritev_all(fd, [stage[:padded]], offset, obj=name, tensor=tensor)
        offset += pos
    return offset - base


def _discard(fd: int, tmp: str) -> None:
    if fd >= 0:
        os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass  # gc removes stale lock files


def fsync_path(path: str, *, obj: str | None = None, tensor: str | None = None) -> None:
    """``fsync`` the regular file ``path`` through a new descriptor; StorageError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise storage_error("fsync failed", e, object=obj or path, key=tensor) from None


def fsync_dir(d: str) -> None:
    """``fsync`` the directory ``d``; StorageError naming it."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise storage_error("directory fsync failed", e, object=d) from None


def fsync_dirs(dirs: Iterable[str], threads: int) -> None:
    """``fsync`` every directory of ``dirs``, concurrently on the writer threads (one task per
    thread): the file system commits the pending directory entries of many fsyncs in one journal
    commit, where one fsync after another would wait for a commit each."""
    order = sorted(set(dirs))
    if not order:
        return
    k = max(1, min(len(order), threads))
    pool = writer_pool(threads)
    for fut in [pool.submit(_fsync_dir_list, order[i::k]) for i in range(k)]:
        fut.result()


def _fsync_dir_list(dirs: list[str]) -> None:
    for d in dirs:
        fsync_dir(d)
