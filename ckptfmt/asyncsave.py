"""Asynchronous saves: snapshot to host memory, then write, verify and commit in the background.

The caller is blocked only while its shards are copied to host staging memory. One save runs
at a time per process: a new one waits for the one in flight (``wait=True``) or raises
SaveInProgressError. A process that dies while the background write runs leaves no listed step,
because the manifest is published only after every writer acknowledged.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable

import numpy as np

from ._types import LocalShard
from .errors import SaveInProgressError
from .manifest import Manifest
from .session import save

__all__ = ["SaveHandle", "save_async"]

_lock_holder: list[threading.Lock] = []  # created on first use, not at import


def _process_lock() -> threading.Lock:
    if not _lock_holder:
        _lock_holder.append(threading.Lock())
    return _lock_holder[0]


class SaveHandle:
    """A save running in the background. ``result()`` returns the committed manifest or raises."""

    def __init__(self, blocked_s: float, snapshot_bytes: int) -> None:
        self.blocked_s = blocked_s
        self.snapshot_bytes = snapshot_bytes
        self._done = threading.Event()
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None
        self.finished_unix: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait for the commit. Raises the save's CheckpointError, or TimeoutError if still running."""
        if not self._done.wait(timeout):
            raise TimeoutError("save still in progress")
        if self._error is not None:
            raise self._error
        assert self._manifest is not None
        return self._manifest

    def exception(self) -> BaseException | None:
        self._done.wait()
        return self._error


def _snapshot(shards: Iterable[LocalShard], copy: bool) -> tuple[list[LocalShard], int]:
    out, nbytes = [], 0
    for s in shards:
        if s.replica_id != 0:
            out.append(LocalShard(s.key, s.global_shape, s.dtype, s.box, None, s.replica_id, s.sharding))
            continue
        a = s.materialize()
        a = np.array(a, copy=True, order="C") if copy else a
        nbytes += a.nbytes
        out.append(LocalShard(s.key, s.global_shape, s.dtype, s.box, a, 0, s.sharding))
    return out, nbytes


def save_async(repo: Any, step: int, shards: Iterable[LocalShard], *, wait: bool = True, copy: bool = True,
               **kwargs: Any) -> SaveHandle:
    """Snapshot ``shards`` to host memory and return; write, verify and commit in a background thread.

    ``copy=False`` keeps references instead of copies: only for data that nothing will mutate
    (e.g. immutable framework buffers). Other keyword arguments are those of :func:`ckptfmt.save`.
    Staging memory is the bytes of this rank's main-replica shards (``handle.snapshot_bytes``).
    """
    t0 = time.perf_counter()
    lock = _process_lock()
    if not lock.acquire(blocking=wait):
        raise SaveInProgressError("an earlier asynchronous save is still in flight", expected="no save in flight",
                                  found=f"save of another step running; requested step {step}")
    try:
        staged, nbytes = _snapshot(shards, copy)
    except BaseException:
        lock.release()
        raise
    handle = SaveHandle(time.perf_counter() - t0, nbytes)

    def run() -> None:
        try:
            handle._manifest = save(repo, step, staged, **kwargs)
        except BaseException as e:  # delivered through handle.result()
            handle._error = e
        finally:
            staged.clear()
            handle.finished_unix = time.time()
            lock.release()
            handle._done.set()

    threading.Thread(target=run, name=f"ckptfmt-save-{step}", daemon=True).start()
    return handle
