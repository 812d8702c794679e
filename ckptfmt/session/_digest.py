"""The digest of a shard's source block that the identity proof of an incremental save checks
(FORMAT.md 8.4): SHA-256 of each 8 MiB piece of the block's C-ordered bytes, hashed on a few
threads (hashlib releases the GIL), then SHA-256 of the pieces' digests in order. It lives only in
this process's memory (:class:`ckptfmt.session._reuse.ReuseMemory`) and is never stored.
"""
from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ckptfmt.storage._durable import kept_pool

__all__ = ["PendingDigest", "start_digest", "DigestWindow"]

PIECE_BYTES = 8 << 20
_INLINE_BYTES = 64 << 10  # a smaller block is hashed at once, in the caller's thread
#: Blocks whose digests are still being taken hold at most about this many bytes (the digest
#: threads view the blocks, so a save would otherwise keep every lazily copied block alive).
WINDOW_BYTES = 256 << 20
_MAX_THREADS = 8

def _pool() -> ThreadPoolExecutor:
    """The process's digest threads (:func:`ckptfmt.storage._durable.kept_pool`)."""
    return kept_pool("ckptfmt-digest", max(1, min(_MAX_THREADS, os.cpu_count() or 1)))


def _piece(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


class PendingDigest:
    """A block's digest being taken: ``result()`` waits for it (and then lets go of the block)."""

    def __init__(self, pieces: list[Future[bytes]] | None, nbytes: int, digest: bytes = b"") -> None:
        self._pieces: list[Future[bytes]] | None = pieces
        self._digest = digest
        self.nbytes = nbytes

    def result(self) -> bytes:
        if self._pieces is not None:
            self._digest = hashlib.sha256(b"".join(f.result() for f in self._pieces)).digest()
            self._pieces = None
        return self._digest


def start_digest(block: np.ndarray) -> PendingDigest:
    """Start taking the digest of ``block`` (its C-ordered bytes); the block must not change until
    ``result()`` has returned (a shard being written does not: the writer views it too)."""
    data = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
    n = data.nbytes
    if n <= _INLINE_BYTES:  # one piece, hashed here: no Future per small shard
        return PendingDigest(None, n, hashlib.sha256(_piece(data)).digest())
    pool = _pool()
    return PendingDigest([pool.submit(_piece, data[i:i + PIECE_BYTES]) for i in range(0, n, PIECE_BYTES)], n)


class DigestWindow:
    """The digests one save started and has not waited for, oldest first, bounded by WINDOW_BYTES."""

    def __init__(self) -> None:
        self._open: deque[PendingDigest] = deque()
        self._held = 0

    def add(self, pending: PendingDigest) -> PendingDigest:
        self._open.append(pending)
        self._held += pending.nbytes
        while self._held > WINDOW_BYTES and self._open:
            oldest = self._open.popleft()
            oldest.result()
            self._held -= oldest.nbytes
        return pending
