"""Asynchronous saves: snapshot to host memory, then write, verify and commit in the background.

The caller is blocked only while its shards are copied to host staging memory. One save runs
at a time per process: a new one waits for the one in flight (``wait=True``) or raises
SaveInProgressError. A process that dies while the background write runs leaves no listed step,
because the manifest is published only after every writer acknowledged.

:func:`start_async` is the machinery under :func:`save_async` and under every bridge's
``save(..., blocking=False)``, so all of them return one handle type, :class:`SaveHandle`, and
share the one-save-at-a-time rule. The background work runs on a :class:`BackgroundWorker`, one
thread started on first use and kept while saves keep coming: the caller never waits for a thread
to start (``Thread.start`` returns only once the new thread runs, a scheduler round trip that
took up to 5 ms of the caller's time per save on a loaded 2-core machine).

A save may be given a :data:`RetrySchedule` (the checkpoint manager's failure policy): a failed
attempt is run again from the same staged copies, after the delay the schedule names, until it
commits or the schedule says stop (:func:`run_attempts`). The staged copies are held until then.

A host-memory budget (``SaveOptions.max_staging_bytes``): when this process's sources exceed it,
the call copies only the sources that come last in the writer's order and fit in half the budget
(:func:`copied_at_call`); the others are handed to the writer as sources it reads (copies) from the
caller's live arrays, first, within its window of a quarter of the budget, while the caller waits
(:class:`HandBack`). The caller gets its arrays back once every such source has been copied (or
the save has ended): until then they must not change; after that, as after any asynchronous save,
they may be donated or changed. The caller is thus blocked for about the writes of all but the last
half-budget of its state, and never more than the budget is held in host copies. A source is never
read after the caller got its arrays back: a retry that would need one fails instead.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Iterable

import numpy as np

from ckptfmt._types import LocalShard
from ckptfmt.errors import InvalidStateError, SaveInProgressError
from ckptfmt.gcpause import HeldPause
from ckptfmt.manifest import Manifest
from ckptfmt.repository import Repository
from ckptfmt.session import save

__all__ = ["SaveHandle", "save_async", "start_async", "save_in_flight", "BackgroundWorker", "RetrySchedule",
           "run_attempts", "HandBack", "copied_at_call"]

#: Given a failed attempt's error and its number (1 for the first), the seconds to wait before the
#: next attempt, or None to give up (the error is then raised). It may log; it must not raise.
RetrySchedule = Callable[[BaseException, int], "float | None"]

#: Seconds a :class:`BackgroundWorker` waits for its next job before its thread ends.
WORKER_IDLE_S = 30.0

_lock_holder: list[threading.Lock] = []  # created on first use, not at import
_workers: dict[int, "BackgroundWorker"] = {}  # per process id: a forked child starts its own


def _process_lock() -> threading.Lock:
    if not _lock_holder:
        _lock_holder.append(threading.Lock())
    return _lock_holder[0]


class BackgroundWorker:
    """Runs jobs one after another on one daemon thread, started by the first :meth:`submit` and
    ended after ``idle_s`` without a job (or by :meth:`stop`); a later submit starts a new one.
    A job must not raise (each catches and records its own errors)."""

    def __init__(self, name: str, idle_s: float = WORKER_IDLE_S) -> None:
        self.name, self.idle_s = name, idle_s
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[Callable[[], None] | None] | None" = None
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._jobs is None or self._thread is None or not self._thread.is_alive():  # (or forked)
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs,), name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def stop(self) -> None:
        """End the thread once the jobs already submitted have run."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(None)
            self._jobs = self._thread = None

    def _run(self, jobs: "queue.SimpleQueue[Callable[[], None] | None]") -> None:
        while True:
            try:
                job = jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if not jobs.empty():
                        continue
                    if self._jobs is jobs:
                        self._jobs = self._thread = None
                    return
            if job is None:
                return
            job()
            # Let go of the finished job before waiting for the next: it holds what its save
            # staged (host copies of a whole state), which would otherwise live until the next
            # submit or the idle timeout (tests/test_asyncsave.py, the worker's last job).
            job = None


def _process_worker() -> BackgroundWorker:
    """This process's save worker. Called only while holding the save slot: no race on the dict."""
    worker = _workers.get(os.getpid())
    if worker is None:
        worker = _workers[os.getpid()] = BackgroundWorker("ckptfmt-save")
    return worker


class SaveHandle:
    """A save running in the background: what :func:`save_async` and every bridge's
    ``save(..., blocking=False)`` return.

    ``result(timeout=None)`` returns the committed manifest or raises the save's error (TimeoutError
    while it still runs); ``done()``; ``exception()``; ``blocked_s`` (how long the caller was
    blocked staging), ``snapshot_bytes`` (host bytes staged), ``finished_unix``.
    """

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


def _snapshot(shards: Iterable[LocalShard], copy: bool, budget: int | None = None,
              hand_back: HandBack | None = None) -> tuple[list[LocalShard], int]:
    """Host copies of the blocks this process may write: per box, the data of its lowest replica
    id here (the only one the plan can pick on this rank); other copies are declared without data.
    Beyond ``budget`` (:func:`copied_at_call`), a block is a source of ``hand_back`` instead."""
    shards = list(shards)
    lowest: dict[tuple, int] = {}
    for s in shards:
        if s.data is not None:
            k = (s.key, s.box)
            lowest[k] = min(lowest.get(k, s.replica_id), s.replica_id)
    written, taken = [], set()
    for i, s in enumerate(shards):
        k = (s.key, s.box)
        if s.data is not None and lowest[k] == s.replica_id and k not in taken:
            taken.add(k)
            written.append(i)
    at_call = copied_at_call([(shards[i].key, shards[i].box.size * np.dtype(shards[i].dtype).itemsize) for i in written],
                             budget if copy and hand_back is not None else None)
    eager = {i for i, e in zip(written, at_call) if e}
    out, nbytes = [], 0
    for i, s in enumerate(shards):
        if i not in eager and i not in written:
            out.append(LocalShard(s.key, s.global_shape, s.dtype, s.box, None, s.replica_id, s.sharding))
            continue
        if i in eager:
            a = s.materialize()
            a = np.array(a, copy=True, order="C") if copy else a
            nbytes += a.nbytes
        else:
            a = hand_back.source(lambda s=s: np.array(s.materialize(), copy=True, order="C"))  # type: ignore[union-attr]
        out.append(LocalShard(s.key, s.global_shape, s.dtype, s.box, a, s.replica_id, s.sharding, source=s.source))
    return out, nbytes


class HandBack:
    """The sources of an asynchronous save beyond its host-memory budget, read by the writer from the
    caller's live arrays while the caller waits in :func:`start_async`; the caller is released once
    each has been read once (or :meth:`seal` is called when the save ends). A source read after
    that raises InvalidStateError: it would read arrays the caller may have changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unread: set[int] = set()
        self._made = 0
        self._sealed = False
        self.released = threading.Event()

    def source(self, read: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
        """A lazy source the writer calls: ``read()`` must return a copy the caller cannot change."""
        with self._lock:
            n = self._made
            self._made += 1
            self._unread.add(n)

        def copy() -> np.ndarray:
            with self._lock:
                if self._sealed:
                    raise InvalidStateError("a source of this save was handed back to the caller before this read "
                                            "(its copy was let go to stay within max_staging_bytes)",
                                            expected="a source not yet handed back", found="handed back")
            data = read()
            with self._lock:
                self._unread.discard(n)
                if not self._unread:
                    self._sealed = True
                    self.released.set()
            return data

        return copy

    def seal(self) -> None:
        """Release the caller; no source is read any more."""
        with self._lock:
            self._sealed = True
            self.released.set()

    def pending(self) -> bool:
        with self._lock:
            return bool(self._unread) and not self._sealed


def copied_at_call(sources: list[tuple[str, int]], budget: int | None) -> list[bool]:
    """For each source (tensor key, host bytes) of an asynchronous save, whether the call copies it:
    all when their bytes fit in ``budget`` (or there is none); else the ones the writer reaches last
    (it writes tensors in key order) that fit in half of it. The others are read while the caller
    waits (:class:`HandBack`)."""
    if budget is None or sum(n for _, n in sources) <= budget:
        return [True] * len(sources)
    out = [False] * len(sources)
    room = budget // 2
    for i in sorted(range(len(sources)), key=lambda i: sources[i][0], reverse=True):
        if sources[i][1] > room:
            break
        room -= sources[i][1]
        out[i] = True
    return out


def run_attempts(run: Callable[[], Manifest], retry: RetrySchedule | None) -> Manifest:
    """``run()``, run again after each failure for as long as ``retry`` gives a delay; returns the
    committed manifest or raises the last attempt's error. Only ``Exception``s are retried.
    ``run`` must be safe to call again: each call is a whole save of the same staged data (a
    failed save leaves nothing listed, so the next attempt starts clean)."""
    attempt = 1
    while True:
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - the schedule decides; the last error is raised
            delay = None if retry is None else retry(e, attempt)
            if delay is None:
                raise
        if delay > 0:
            time.sleep(delay)
        attempt += 1


def save_in_flight() -> bool:
    """True while an asynchronous save of this process has not finished."""
    return _process_lock().locked()


def start_async(stage: Callable[[], tuple[Callable[[], Manifest], int]], *, step: int, wait: bool = True,
                retry: RetrySchedule | None = None, hand_back: HandBack | None = None,
                pause_gc: bool = True) -> SaveHandle:
    """Run a save in a background thread and return its :class:`SaveHandle`.

    Takes this process's save slot (one asynchronous save at a time: with ``wait`` it waits for
    the one in flight, else it raises SaveInProgressError), then calls ``stage()`` in the caller's
    thread: it copies what the save needs to host memory and returns the save to run (a callable
    returning the committed Manifest) and the bytes it staged (``handle.snapshot_bytes``). The
    caller is blocked for ``handle.blocked_s``. An error of ``stage`` releases the slot and is
    raised here; the save's own error is raised by ``handle.result()``. With ``retry``, a failed
    save is run again in the background (:func:`run_attempts`), holding the slot and its staged data.
    With ``hand_back`` (the sources ``stage`` left to the writer, beyond the host-memory budget),
    this returns only once each has been read, or the save has ended; ``blocked_s`` includes that.
    With ``pause_gc`` (``SaveOptions.pause_gc``), Python's cyclic collector is paused from before
    ``stage()`` until the save ends (:class:`ckptfmt.gcpause.HeldPause`).
    """
    t0 = time.perf_counter()
    lock = _process_lock()
    if not lock.acquire(blocking=wait):
        raise SaveInProgressError("an earlier asynchronous save is still in flight", expected="no save in flight",
                                  found=f"save of another step running; requested step {step}")
    pause = HeldPause(pause_gc)

    def release() -> None:  # the collector's pause and the save slot, given back together
        pause.close()
        lock.release()

    try:
        run, nbytes = stage()
    except BaseException:
        release()
        raise
    handle = SaveHandle(time.perf_counter() - t0, nbytes)

    def background() -> None:
        nonlocal run
        try:
            handle._manifest = run_attempts(run, retry)
        except BaseException as e:  # delivered through handle.result()
            handle._error = e
        finally:
            if hand_back is not None:
                hand_back.seal()
            handle.finished_unix = time.time()
            run = None  # what the save staged is freed here, while the collector is still paused
            release()
            handle._done.set()

    try:
        _process_worker().submit(background)
    except BaseException:
        release()
        raise
    if hand_back is not None and hand_back.pending():
        hand_back.released.wait()
        handle.blocked_s = time.perf_counter() - t0
    return handle


def save_async(repo: Repository | str | os.PathLike[str], step: int, shards: Iterable[LocalShard], *, wait: bool = True, copy: bool = True,
               retry: RetrySchedule | None = None, **kwargs: Any) -> SaveHandle:
    """Snapshot ``shards`` to host memory and return; write, verify and commit in a background thread.

    ``copy=False`` keeps references instead of copies: only for data that nothing will mutate
    (e.g. immutable framework buffers). Other keyword arguments are those of :func:`ckptfmt.save`.
    Staging memory is the bytes of this rank's main-replica shards (``handle.snapshot_bytes``).
    ``retry``: see :func:`start_async`.
    """
    options = kwargs.get("options")
    budget = options.max_staging_bytes if options is not None else None
    hand_back = HandBack() if budget is not None else None

    def stage() -> tuple[Callable[[], Manifest], int]:
        staged, nbytes = _snapshot(shards, copy, budget, hand_back)

        def run() -> Manifest:
            try:
                return run_attempts(lambda: save(repo, step, staged, **kwargs), retry)
            finally:
                staged.clear()

        return run, nbytes

    return start_async(stage, step=step, wait=wait, hand_back=hand_back,
                       pause_gc=options.pause_gc if options is not None else True)
