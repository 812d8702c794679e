"""``Checkpoint.verify`` on local files (FORMAT.md 9, 14.4): every shard object read whole with
positional reads (``O_DIRECT`` where it takes them), several at a time, and checked exactly as
the kvstore path checks it: no link on its path, its size, its index, every chunk's crc32c (and,
for an encoded chunk, that it decodes). The first fault in the manifest's order is raised.

The kvstore path read one tensor's shards at a time through tensorstore, which copies each
object into a new ``bytes``; a manager's retention verifies the newest step before it deletes
an older one after every save, so that cost was on every save's clock (FORMAT.md 14.7). For the
same reason the read buffers can outlive one verification (:class:`ReadBuffers`, kept by a
:class:`ckptfmt.Repository`): a fresh buffer costs a page fault and a zeroed page per 4 KiB read
into it, and giving it back costs an unmapping; together about a third of a 32 MiB verify's CPU.
"""
from __future__ import annotations

import mmap
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckptfmt.errors import SizeMismatchError
from ckptfmt.manifest import Manifest, TensorEntry
from ckptfmt.reader._alloc import require_memory
from ckptfmt.reader._positional import ChunkStarts
from ckptfmt.shard import shard_bytes
from ckptfmt.shard._blockcheck import BlockChecks
from ckptfmt.storage import Storage
from ckptfmt.storage._durable import kept_pool

if TYPE_CHECKING:  # the package's face imports this module
    from ckptfmt.reader import ReadStats

__all__ = ["LocalVerifier", "ReadBuffers", "VERIFY_THREADS"]

#: Objects verified at once (each held whole while it is checked).
VERIFY_THREADS = 16


def verify_pool() -> ThreadPoolExecutor:
    """The process's verify threads (:func:`ckptfmt.storage._durable.kept_pool`)."""
    return kept_pool("ckptfmt-verify", VERIFY_THREADS)


class ReadBuffers:
    """Page-aligned read buffers (private anonymous mappings, so that reads can go through
    ``O_DIRECT``) kept between verifications, at most ``keep_bytes`` of them; thread safe.

    A buffer is taken whole by one reader and given back when its object is checked; a buffer
    larger than what may be kept is unmapped when it is given back."""

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = int(keep_bytes)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._kept = 0

    def take(self, n: int) -> np.ndarray:
        """A uint8 buffer of at least ``n`` bytes: the smallest kept one that fits, else a new one."""
        with self._lock:
            fits = [(b.size, i) for i, b in enumerate(self._free) if b.size >= n]
            if fits:
                buf = self._free.pop(min(fits)[1])  # by position: arrays compare elementwise
                self._kept -= buf.size
                return buf
        return np.frombuffer(mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for a later read if the kept buffers stay within ``keep_bytes``."""
        with self._lock:
            if self._kept + buf.size <= self.keep_bytes:
                self._free.append(buf)
                self._kept += buf.size

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept


class LocalVerifier:
    """``Checkpoint.verify`` on local files, held by its :class:`ckptfmt.reader.Checkpoint`: every
    shard object of ``manifest`` read whole from ``storage`` and checked with ``checks``; bytes
    read counted in ``stats``.

    ``plain_dirs``: the checkpoint's set of directories found to be no symbolic link. ``starts``:
    the checkpoint's :class:`~ckptfmt.reader._positional.ChunkStarts`."""

    def __init__(self, storage: Storage, manifest: Manifest, stats: ReadStats, checks: BlockChecks,
                 plain_dirs: set[str], starts: ChunkStarts) -> None:
        self.storage = storage
        self.manifest = manifest
        self.stats = stats
        self.checks = checks
        self._plain_dirs = plain_dirs
        self._starts = starts.of

    def verify(self, keys: list[str], report: Callable[[int], None], buffers: ReadBuffers | None,
               max_inflight_bytes: int, in_parts: Callable[[TensorEntry, int], int]) -> None:
        """Verify every shard object of ``keys``, at most :data:`VERIFY_THREADS` at once and at most
        ``max_inflight_bytes`` of them held; an object larger than that goes to ``in_parts``
        (which verifies it a window at a time and returns its bytes). The objects are read into
        ``buffers`` (a new set, dropped afterwards, when None)."""
        jobs = [(self.manifest.tensors[k], s) for k in keys for s in range(len(self.manifest.tensors[k].shards))]
        if buffers is None:  # the threads keep at most one window between them
            buffers = ReadBuffers(max_inflight_bytes)
        pool = verify_pool()
        pending: deque[Any] = deque()
        try:
            held = 0
            for t, s in jobs:
                n = int(t.shards.nbytes[s])
                if n > max_inflight_bytes:  # in order: what is pending first, then this in parts
                    while pending:
                        held -= self._verified(pending.popleft(), report)
                    report(in_parts(t, s))
                    continue
                while pending and (held + n > max_inflight_bytes or len(pending) >= 2 * VERIFY_THREADS):
                    held -= self._verified(pending.popleft(), report)
                pending.append(pool.submit(self._verify_object, t, s, buffers))
                held += n
            while pending:
                held -= self._verified(pending.popleft(), report)
        finally:  # on an error: nothing of this verification still runs once it is raised
            for f in pending:
                f.cancel()
            wait(pending)

    def _verified(self, fut: Any, report: Callable[[int], None]) -> int:
        n = int(fut.result())  # raises this object's fault
        self.stats.bytes_read += n
        report(n)
        return n

    def _verify_object(self, t: TensorEntry, s: int, buffers: ReadBuffers) -> int:
        obj, n = t.object_key(s), int(t.shards.nbytes[s])
        self.storage.check_no_links(obj, self._plain_dirs, tensor=t.key)
        require_memory(n, t.key, obj, "one shard object")
        with self.storage.open_positional(obj, tensor=t.key) as f:
            if f.size != t.object_nbytes(s):
                raise SizeMismatchError("shard object size differs from the manifest", key=t.key, object=obj,
                                        expected=t.object_nbytes(s), found=f.size)
            have = buffers.take(n)
            try:
                buf = have[:n]
                f.read_into([buf], shard_bytes(t, s).start)
                starts = self._starts(t)
                checked = self.checks.whole(t, s, obj, memoryview(buf), range(int(starts[s]), int(starts[s + 1])))
                if t.array.codec != "raw":  # an encoded chunk must also decode (FORMAT.md 6.3)
                    for c, mv in checked.items():
                        self.checks.decode(t, c, obj, mv)
            finally:  # every view of it is done with: the checks copy nothing out of it
                buffers.give(have)
        return n
