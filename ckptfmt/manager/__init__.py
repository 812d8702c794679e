"""A checkpoint manager for training loops: cadence, one save in flight, retention, preemption, resume.

Framework-free. :class:`CheckpointManager` itself saves and restores flat dicts of numpy arrays in
one process; ``bridges.jax.CheckpointManager`` and ``bridges.torch.CheckpointManager`` subclass it
and override only the *bridge hooks* (the save and restore verbs, the process group, the
preemption agreement, and ``_new_tier_hooks``: the :class:`TierHooks` the local tier, held as
``tiers``, is given), so both frameworks get the same behaviour and the same words.

Call order (every process of a job runs the same loop; the collectives rely on it):

1. construct the managers in the same order on every process;
2. ``latest_step()`` / ``restore(target)``: every process calls ``restore``; rank 0 lists the
   committed steps and every rank restores the same one; when a rank fails, all agree on it;
3. each step: ``save(step, state, ...)`` on every process (it saves when the cadence says so,
   or with ``force=True``), and ``reached_preemption(step)`` on every process;
4. ``close()`` (or leave the ``with`` block): waits, bounded, for the save in flight.

Guarantees: at most one save is in flight per manager; the next save first waits for the previous
commit (back-pressure, reported as ``waited_s``). A save that fails is retried, recorded and
survived as its :class:`SaveFailurePolicy` says (module ``_failures``; docs/failures.md): it never
deletes or hides the newest committed step. A save becomes visible only by its atomic commit,
so a process that dies, is killed, or gives up waiting never leaves a half-written step listed.
Retention runs on rank 0 after a commit, through :meth:`Repository.delete` and
:meth:`Repository.gc`, with the same planner as ``Repository.gc`` (:mod:`ckptfmt.repository._retention`): it
counts only restorable steps, never deletes the newest restorable step, the newest committed step
nor a step this process is reading, and logs every deletion with its reason (logger
``ckptfmt.manager``).

Subpackage ``ckptfmt.manager``. The checkpoint manager for training loops: cadence, one save in
flight, retention, preemption, resume, the local tier (FORMAT.md 8.5), and the values it hands out.
Its modules: ``_failures``, ``_query``, ``_values``, ``_tiers``, ``_tierplan`` (the elastic planner, pure), ``_tierrestore``, ``_tierelastic``, ``_tieranswer`` (the holder's answers at an elastic restore), ``_tierservice``. May import: floor, manifest, reader, repository, session. The floor: the top-level
modules listed in ``ckptfmt/__init__.py`` (tests/test_layering.py holds the rules and enforces
them). No other subpackage may import it.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from ckptfmt.manager._failures import SaveFailurePolicy
from ckptfmt.manager._tierservice import LocalTiers, TierHooks
from ckptfmt.manager._tiers import LocalTier, PeerExchange, TierSave, distinct_boxes
from ckptfmt.manager._payload import as_bytes_view, check_payload
from ckptfmt.manager._query import METADATA_KEY, apply_retention, best_step, candidate_steps, forget_deleted, recorded_metrics
from ckptfmt.manager._values import (RestoreResult, SaveRecord, SkippedStep, _check_step, _clean_metrics, _err_from,
                                     _err_json, _is_damage, _Job)
from ckptfmt.repository._gc import unrestorable
from ckptfmt.repository._verified import unverified
from ckptfmt.repository._retention import Retention, metric_value
from ckptfmt._types import Box, LocalShard
from ckptfmt.coord import Coordinator, LocalCoordinator
from ckptfmt.errors import (CheckpointError, IncompleteSaveError, InvalidStateError, KeyMismatchError,
                            SaveInProgressError)
from ckptfmt.manifest import Manifest
from ckptfmt.session._saveopts import SaveOptions
from ckptfmt.session.asyncsave import BackgroundWorker, RetrySchedule, run_attempts, save_async
from ckptfmt.rankstate import RankStatePolicy
from ckptfmt.repository import Repository
from ckptfmt.session import save

__all__ = ["CheckpointManager", "SaveRecord", "SkippedStep", "RestoreResult", "Retention", "METADATA_KEY", "LocalTier",
           "TierSave", "SaveFailurePolicy",
           # the local tier's data plane, for the bridges' peer exchanges (FORMAT.md 8.5)
           "PeerExchange", "TierHooks", "as_bytes_view", "check_payload", "distinct_boxes"]

_log = logging.getLogger("ckptfmt.manager")

#: Seconds between two gc passes of the retention thread (gc's own grace period is 600 s, so
#: running it more often finds nothing new to collect).
GC_INTERVAL_S = 600.0


def _is_save_failure(e: BaseException) -> bool:
    """A failure of the storage or the save protocol (the policy's), not of the caller's state."""
    return isinstance(e, (CheckpointError, OSError)) and not isinstance(e, (InvalidStateError, SaveInProgressError))


def _raiser(e: BaseException) -> Callable[[], Manifest]:
    def finish() -> Manifest:
        raise e

    return finish


class CheckpointManager:
    """Saves on a cadence, keeps what the retention policy says, and resumes from the newest good step.

    ``url``: the repository (a URL, or a :class:`Repository` opened with its storage options).
    ``save_every_steps`` / ``save_every_seconds``: the cadence
    :meth:`should_save` follows (either, both, or neither: then only ``force=True`` saves).
    ``keep_last`` / ``keep_every`` / ``keep_best`` (with ``best_metric``, ``best_mode`` "min" or
    "max"): retention (see :class:`Retention`; all None keeps every step). ``async_save``: the
    caller is blocked only while the state is copied to host memory (within ``options``'
    ``max_staging_bytes``, if set: docs/failures.md). ``fallback``: ``restore()``
    without a step falls back to the newest step that restores when newer ones are damaged.
    ``metrics_file``: a JSON-lines file that rank 0 appends one record per save, deletion and
    restore to. ``close_timeout_s``: the longest ``close()`` waits for the save in flight.
    ``options``: the :class:`SaveOptions` every save passes to the core (timeouts, pacing).
    ``local``: a :class:`LocalTier` with its own cadence, restored from first (FORMAT.md 8.5).
    ``failure_policy``: what a failed persistent save does (:class:`SaveFailurePolicy`; None: its
    default, which retries, records the failure and keeps training, and raises after 5 failed
    saves in a row or at ``close()`` when the last save did not commit).

    Usable as a context manager (``close()`` on exit). Bad arguments raise ValueError.
    """

    def __init__(self, url: str | Repository, *, save_every_steps: int | None = None, save_every_seconds: float | None = None,
                 keep_last: int | None = None, keep_every: int | None = None, keep_best: int | None = None,
                 best_metric: str | None = None, best_mode: str = "min", async_save: bool = True,
                 fallback: bool = True, metrics_file: str | None = None, close_timeout_s: float = 300.0,
                 options: SaveOptions | None = None, local: LocalTier | None = None,
                 failure_policy: SaveFailurePolicy | None = None) -> None:
        if save_every_steps is not None and (isinstance(save_every_steps, bool) or not isinstance(save_every_steps, int)
                                             or save_every_steps < 1):
            raise ValueError(f"save_every_steps must be a positive int or None, got {save_every_steps!r}")
        if save_every_seconds is not None and not (float(save_every_seconds) > 0):
            raise ValueError(f"save_every_seconds must be > 0 or None, got {save_every_seconds!r}")
        if failure_policy is not None and not isinstance(failure_policy, SaveFailurePolicy):
            raise ValueError(f"failure_policy must be a SaveFailurePolicy or None, got {type(failure_policy).__name__}")
        self.failure_policy = failure_policy if failure_policy is not None else SaveFailurePolicy()
        self.url = url.url if isinstance(url, Repository) else str(url)
        self.save_every_steps = save_every_steps
        self.save_every_seconds = None if save_every_seconds is None else float(save_every_seconds)
        self.retention = Retention(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.async_save = bool(async_save)
        self.fallback = bool(fallback)
        self.metrics_file = metrics_file
        self.close_timeout_s = float(close_timeout_s)
        self.options = options
        self.repository = url if isinstance(url, Repository) else Repository(self.url)
        self.rank, self.world = self._process()
        self._coord: Coordinator = self._new_coordinator()
        self._job: _Job | None = None
        self._last_started: int | None = None
        self._last_save_time = time.monotonic()
        self._due_calls = 0
        self._history: list[SaveRecord] = []
        self._consecutive_failures = 0  # failed saves since the last commit
        self._uncommitted: tuple[int, BaseException] | None = None  # the last save, when it failed
        self._reading: dict[int, int] = {}
        self._lock = threading.Lock()
        self._metrics_cache: dict[int, dict[str, Any]] = {}
        self._seen: tuple[int, dict[str, Any]] | None = None  # the last step given metrics, and them
        self._last_gc: float | None = None
        self._metrics_out: Any = None
        self._preempted_at: int | None = None
        self._sigterm = threading.Event()
        self._prev_handler: Any = None
        self._installed = self._closed = False
        self._worker = BackgroundWorker("ckptfmt-manager")  # finishes async saves; no thread until the first
        self.local = local
        #: The local tier (FORMAT.md 8.5), None without ``local``.
        self.tiers = None if local is None else LocalTiers(
            local, rank=self.rank, world=self.world, url=self.url, repository=self.repository, coord=self._coord,
            options=self.options, hooks=self._new_tier_hooks(), emit=self._emit)
        if self._own_sigterm() and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    # ------------------------------------------------------------------ bridge hooks
    def _process(self) -> tuple[int, int]:
        """(rank, world) of this process. Bridge hook."""
        return 0, 1

    def _new_tier_hooks(self) -> TierHooks:
        """The framework's part of the local tier (called once, with ``local``). Bridge hook; the
        core's serve flat dicts of numpy arrays in one process."""
        return TierHooks()

    def _new_coordinator(self) -> Coordinator:
        """The manager's own collectives (never shared with a save in flight). Bridge hook."""
        return LocalCoordinator()

    def _save_verb(self, step: int, state: Any, *, extra: Any, metadata: Mapping[str, Any], rank_state: Any,
                   blocking: bool, retry: RetrySchedule | None = None) -> Callable[[], Manifest]:
        """Start saving ``state`` as ``step``; return a function that waits for the committed manifest.

        Returns once the state is snapshotted (``blocking=False``) or committed. A failed save is
        run again from its staged data as ``retry`` says (``ckptfmt.asyncsave.run_attempts``; in
        the background for ``blocking=False``). Bridge hook; this one saves a flat dict of numpy
        arrays."""
        if not isinstance(state, Mapping):
            raise TypeError("the core manager saves a flat dict of numpy arrays; use a bridge's manager for others")
        shards = [LocalShard(str(k), np.shape(a), np.asarray(a).dtype, Box.full(np.shape(a)), np.asarray(a))
                  for k, a in state.items()]
        kw = dict(state={"extra": extra}, rank_state=rank_state, metadata=metadata, options=self.options)
        if blocking:
            manifest = run_attempts(lambda: save(self.repository, step, shards, **kw), retry)
            return lambda: manifest
        handle = save_async(self.repository, step, shards, retry=retry, **kw)
        return handle.result

    def _restore_verb(self, target: Any, step: int, rank_state_policy: RankStatePolicy | None = None
                      ) -> tuple[Any, Any, Mapping[str, Any]]:
        """Restore ``step`` into ``target``; return (state, extra, stats). Raises the reader's
        CheckpointError when any byte it reads fails verification. Bridge hook; a bridge applies
        ``rank_state_policy`` (validated by :meth:`restore`) as its restore verb does (the core
        manager returns no per-rank state)."""
        ckpt = self.repository.open(step)
        keys = sorted(ckpt.keys()) if target is None else list(target)
        missing = [k for k in keys if k not in set(ckpt.keys())]
        if missing:
            raise KeyMismatchError("the restore target has keys the checkpoint does not hold", key=missing[0],
                                   expected="keys of the checkpoint", found=missing)
        arrays = ckpt.read_boxes([(k, Box.full(tuple(ckpt.tensor(k).shape))) for k in keys])
        st = ckpt.state()
        return dict(zip(keys, arrays)), st.get("extra") if isinstance(st, dict) else None, {}

    def _own_sigterm(self) -> bool:
        """Whether the manager installs its SIGTERM handler (False where the framework has one). Bridge hook."""
        return True

    def _agree_preemption(self, step: int, local: bool) -> bool:
        """True on every process at the same step once any process saw SIGTERM. Bridge hook."""
        if self.world == 1:
            return local
        got = self._coord.allgather(f"manager/preempt/{step}", b"1" if local else b"0")
        return any(g == b"1" for g in got)

    # ------------------------------------------------------------------ cadence and saving
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due under the cadence (and not the step saved last).

        With ``save_every_seconds`` on several processes, rank 0's clock decides and every process
        must call this (or ``save``) at the same steps; a process that does not arrive makes the
        others raise the coordinator's CoordinatorTimeoutError. A bad step raises ValueError."""
        step = _check_step(step)
        if step == self._last_started:
            return False
        if self.save_every_steps is not None and step % self.save_every_steps == 0:
            return True
        if self.save_every_seconds is None:
            return False
        due = time.monotonic() - self._last_save_time >= self.save_every_seconds
        if self.world > 1:
            mine = (b"1" if due else b"0") if self.rank == 0 else None
            due = self._coord.broadcast(f"manager/due/{step}", mine) == b"1"
            self._due_calls += 1
            if self._due_calls % 64 == 0:  # a barrier lets a coordinator drop its old broadcast keys
                self._coord.barrier("manager/due/release")
        return due

    def save(self, step: int, state: Any, *, extra: Any = None, metrics: Mapping[str, Any] | None = None,
             force: bool = False, rank_state: Any = None) -> bool:
        """Save ``state`` as ``step`` when the cadence says so (or ``force``); True when a save started.

        ``metrics`` (name -> number) go into the manifest's metadata; ``best_metric`` is read from
        there. A save without ``metrics`` at the step whose earlier ``save`` call (skipped by the
        cadence) was given some records those (the preemption save ``save(step, state, force=True)``). ``rank_state``: this process's per-rank state, passed to the bridge's save verb.
        First waits for the save in flight (back-pressure, its retries included) and raises its
        error if it failed and ``failure_policy`` says to raise. A step already started by this
        manager is not saved twice (False). A failed save is retried and recorded as
        ``failure_policy`` says (with ``async_save`` in the background); a state the bridge cannot
        save (a bad leaf, state that does not encode) raises here at once. Nothing is ever
        half-visible.
        """
        self._check_open()
        step = _check_step(step)
        clean = _clean_metrics(metrics)
        if metrics is not None:
            self._seen = (step, clean)
        elif self._seen is not None and self._seen[0] == step:
            clean = dict(self._seen[1])
        local = self.tiers is not None and self.tiers.save(step, state, extra, rank_state, force)
        if not force and not self.should_save(step):
            return local
        if step == self._last_started:
            _log.debug("step %d: already saved by this manager; not saved again", step)
            return False
        t0 = time.perf_counter()
        waited = 0.0
        if self._job is not None:  # back-pressure: one save in flight
            self._join(None)
            waited = time.perf_counter() - t0
        job = _Job(step, time.perf_counter(), time.time())
        try:
            finish = self._save_verb(step, state, extra=extra,
                                     metadata={METADATA_KEY: {"metrics": clean},
                                               **({} if self.tiers is None else self.tiers.metadata(step))},
                                     rank_state=rank_state, blocking=not self.async_save, retry=self._retry(job))
        except Exception as e:  # noqa: BLE001 - a blocking save's storage failure goes to the policy
            if self.async_save or not _is_save_failure(e):
                raise  # the caller's state or arguments: raised at once, as an async save's staging does
            finish = _raiser(e)
        self._last_started, self._last_save_time = step, time.monotonic()
        job.blocked_s, job.waited_s = time.perf_counter() - t0, waited
        self._job = job
        if self.async_save:
            self._worker.submit(lambda: self._finish(job, finish))
        else:
            self._finish(job, finish)
            self._join(None)
        return True

    def _retry(self, job: _Job) -> RetrySchedule:
        """The retry schedule of ``job``'s save: the policy's backoff for an error a retry may
        cure; each failed attempt is logged and recorded in the metrics file."""
        policy = self.failure_policy

        def schedule(error: BaseException, attempt: int) -> float | None:
            delay = policy.delay_s(attempt) if policy.retryable(error) else None
            job.attempts = attempt if delay is None else attempt + 1
            if delay is not None:
                _log.warning("step %d: save attempt %d failed (%s: %s); retrying in %.3g s from the same staged state",
                             job.step, attempt, type(error).__name__, error, delay)
                self._emit({"event": "save_retry", "step": job.step, "attempt": attempt,
                            "error": f"{type(error).__name__}: {error}", "retry_in_s": delay, "unix": time.time()})
            return delay

        return schedule

    def _finish(self, job: _Job, finish: Callable[[], Manifest]) -> None:
        try:
            manifest = finish()
            job.record = SaveRecord(job.step, True, job.started_unix, job.blocked_s, job.waited_s,
                                    time.perf_counter() - job.t0, int(manifest.nbytes), attempts=job.attempts)
            self._consecutive_failures, self._uncommitted = 0, None
            _log.info("step %d committed: caller blocked %.1f ms (waited %.1f ms for the previous save), "
                      "write %.1f ms, %d bytes", job.step, job.blocked_s * 1e3, job.waited_s * 1e3,
                      job.record.write_s * 1e3, job.record.bytes)
            self._history.append(job.record)  # once committed, before retention; the next save waits for both
            self._emit(job.record.to_json())
            if self.rank == 0:
                self._retain()
        except BaseException as e:  # delivered by the next save/wait/close when the policy says so
            if job.record is not None:  # after the commit (the metrics file): not a failed save
                job.error = e
                return
            self._consecutive_failures += 1
            self._uncommitted = (job.step, e)
            job.record = SaveRecord(job.step, False, job.started_unix, job.blocked_s, job.waited_s,
                                    time.perf_counter() - job.t0, 0, f"{type(e).__name__}: {e}", attempts=job.attempts)
            raising = not isinstance(e, Exception) or self.failure_policy.raises_after(self._consecutive_failures)
            _log.warning("step %d was not committed after %d attempt(s): %s: %s; %d save(s) in a row failed; "
                         "the newest committed step is unchanged; %s", job.step, job.attempts, type(e).__name__, e,
                         self._consecutive_failures,
                         "raising, as the failure policy says" if raising else "training goes on")
            self._history.append(job.record)
            self._emit(job.record.to_json())
            if raising:
                job.error = e
        finally:
            job.done.set()

    def _join(self, timeout: float | None) -> SaveRecord | None:
        job = self._job
        if job is None:
            return None
        if not job.done.wait(timeout):
            raise IncompleteSaveError(
                f"the save of step {job.step} did not commit within {timeout:g} s; it is not visible (the commit "
                "is atomic) and may still commit while this process lives", object=self.url,
                expected=f"commit within {timeout:g} s", found="still running")
        self._job = None
        if job.error is not None:
            self._uncommitted = None  # delivered now: close() does not raise it again
            raise job.error
        return job.record

    def wait(self, timeout: float | None = None) -> SaveRecord | None:
        """Wait for the save in flight (its retries included); return its record (None if there was
        none; ``committed=False`` for a failed save the policy survives). Raises the save's error
        when ``failure_policy`` says to, or IncompleteSaveError when ``timeout`` passes first (the
        save stays in flight). The
        local tier's save in flight is waited for too (its failure is logged, in ``tier_history``)."""
        record = self._join(timeout)
        if self.tiers is not None:
            self.tiers.wait(timeout)
        return record

    @property
    def history(self) -> tuple[SaveRecord, ...]:
        """Every finished save of this manager, oldest first."""
        return tuple(self._history)

    @property
    def tier_history(self) -> tuple[TierSave, ...]:
        """Every finished local save of this process, oldest first."""
        return () if self.tiers is None else self.tiers.history

    def close(self) -> None:
        """Wait at most ``close_timeout_s`` for the save in flight, then release the SIGTERM handler
        and the metrics file. Raises the save's error when ``failure_policy`` says to (at the latest
        here, with ``raise_at_close_if_uncommitted``, when the last save did not commit), or
        IncompleteSaveError on the timeout (the step is then not visible: a commit is atomic).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._join(self.close_timeout_s)
            if self.tiers is not None:
                self.tiers.wait(self.close_timeout_s)
                self.tiers.close()
        finally:
            self._worker.stop()
            # Put back what was there (None: a handler Python cannot name; ours then stays, harmless).
            if self._installed and self._prev_handler is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_handler)
            with self._lock:
                if self._metrics_out is not None:
                    self._metrics_out.close()
                    self._metrics_out = None
            if self.world > 1:  # no rank leaves (rank 0 may host the store) before every rank ended its last save
                try:
                    self._coord.barrier("manager/close", min(self.close_timeout_s, 30.0))
                except CheckpointError as e:  # a peer is gone: nothing left to wait for
                    _log.warning("close: ranks did not meet at the end: %s", e)
            close = getattr(self._coord, "close", None)
            if close is not None:
                close()
        if self._uncommitted is not None and self.failure_policy.raise_at_close_if_uncommitted:
            step, error = self._uncommitted
            _log.error("close: the last save (step %d) did not commit (%s: %s); the newest committed step is the "
                       "last one restorable", step, type(error).__name__, error)
            raise error

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # never mask the loop's own exception
            self.close()
        except Exception as e:  # noqa: BLE001
            _log.error("closing the manager after %s: %s: %s", exc_type.__name__, type(e).__name__, e)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the checkpoint manager is closed")

    # ------------------------------------------------------------------ preemption
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop saves at a step every process agrees on. A second SIGTERM is
        # no different; the scheduler's SIGKILL ends the job, and a commit is atomic.
        self._sigterm.set()
        if callable(self._prev_handler):
            self._prev_handler(signum, frame)

    def reached_preemption(self, step: int) -> bool:
        """True on every process at the same step once any process has received SIGTERM (and at every
        later step). Every process must call it at every step. The loop then saves with
        ``force=True`` and exits; a SIGKILL that follows never leaves a partial step visible. A
        process group that fails raises its own error (torch, JAX) or the coordinator's."""
        if self._preempted_at is not None:
            return True
        if self._agree_preemption(_check_step(step), self._sigterm.is_set()):
            self._preempted_at = int(step)
            _log.warning("preemption: every process stops at step %d (SIGTERM received)", step)
            self._emit({"event": "preemption", "step": int(step), "unix": time.time()})
            return True
        return False

    # ------------------------------------------------------------------ retention
    def _metric(self, step: int) -> float | None:
        try:
            return metric_value(self.metrics(step).get(self.retention.best_metric))  # type: ignore[arg-type]
        except CheckpointError:
            return None  # unreadable: never among the best

    def _unrestorable(self, step: int) -> str | None: return unrestorable(self.repository, step)  # noqa: E704 (hooks)
    def _unverified(self, step: int) -> str | None: return unverified(self.repository, step)  # noqa: E704

    def _retain(self) -> None:
        """Apply retention (rank 0, after a commit). Failures are logged; they never fail the save."""
        apply_retention(self, GC_INTERVAL_S)

    # ------------------------------------------------------------------ resume
    def latest_step(self) -> int | None:
        """The newest committed step as this process lists it now, or None. Not a collective; a
        storage failure raises StorageError."""
        return self.repository.latest()

    def all_steps(self) -> list[int]:
        """Every committed step, oldest first, as this process lists it now. Not a collective; a
        storage failure raises StorageError."""
        return self.repository.steps()

    def metrics(self, step: int) -> dict[str, float | int]:
        """The metrics saved with ``step`` (FORMAT.md 14.7; non-finite values as floats), {} when it
        recorded none. StepNotFoundError when ``step`` is not committed, InvalidManifestError when
        its manifest does not validate."""
        step = _check_step(step)
        if step not in self._metrics_cache:
            self._metrics_cache[step] = recorded_metrics(self.repository.manifest(step))
        return dict(self._metrics_cache[step])

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The committed step with the best finite ``metric`` (default: ``best_metric``) by ``mode``
        (default: ``best_mode``; a tie goes to the newer step), or None when no step recorded it. A
        step whose manifest does not read is skipped. ValueError without a metric name or with a bad mode."""
        return best_step(self, metric or self.retention.best_metric, mode or self.retention.best_mode)

    def _attempt(self, target: Any, step: int, policy: RankStatePolicy | None = None
                 ) -> tuple[Any, BaseException | None, list[tuple[int, dict[str, Any]]]]:
        """Restore ``step`` here and agree with every rank: (value, this rank's error, every rank's
        error as (rank, error JSON), the same list on every rank). A non-CheckpointError raises here
        once the others know of it."""
        with self._lock:
            self._reading[step] = self._reading.get(step, 0) + 1
        value: Any = None
        local: BaseException | None = None
        try:
            value = self._restore_verb(target, step, policy)
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised
            local = e
        finally:
            with self._lock:
                self._reading[step] -= 1
        if self.world == 1:
            errs = [] if local is None else [(0, _err_json(local))]
        else:
            mine = msgpack.packb({"ok": True} if local is None else {"error": _err_json(local)})
            got = [msgpack.unpackb(b, raw=False) for b in self._coord.allgather(f"manager/restore/{step}", mine)]
            errs = [(r, g["error"]) for r, g in enumerate(got) if "error" in g]
        if local is not None and not isinstance(local, CheckpointError):
            raise local
        return value, local, errs

    def restore(self, target: Any = None, *, step: int | None = None, best: bool = False,
                rank_state_policy: str | None = None) -> RestoreResult:
        """Restore ``step`` (None: the newest committed step) into ``target``; every process calls it.

        Waits for the save in flight first (and raises its error). With ``step=None`` and
        ``fallback``, a step that fails verification (a damaged or missing object, a bad manifest
        or state) on any process is skipped for the next older one; each skip is logged and listed
        in the result's ``skipped``. Raises StepNotFoundError for a requested step that is not
        committed (never starts fresh), the step's own typed error with ``fallback=False`` or an
        explicit ``step``, and the bridge's error for a target that does not match (no fallback: an
        older step would not match either). Every process returns the same step, or raises.
        ``best=True`` restores :meth:`best_step` (rank 0 decides; no fallback; StepNotFoundError when
        no step recorded ``best_metric``); with ``step`` too it raises ValueError.

        With ``local``, ``restore()`` without ``step`` / ``best`` first tries the tiers (FORMAT.md 8.5):
        the newest step some tier holds for every box, each box from the first tier whose copy
        verifies; ``stats["tiers"]`` gives the bytes each tier served. Any failure there falls back
        to the restore described above, on every process.

        ``rank_state_policy`` goes to the bridge's restore verb (bridges/README.md): per-rank state
        saved by another number of processes raises TopologyChangedError (naming the policies)
        unless it is "drop", "rank0" or "same-rank"; any other value raises ValueError at once.
        """
        policy = RankStatePolicy.of(rank_state_policy)  # the one check, before anything is read
        self._check_open()
        if step is not None:
            step = _check_step(step)
        if best and (step is not None or not self.retention.best_metric):
            raise ValueError("restore(best=True) takes no step, and needs the manager's best_metric")
        self.wait()
        tiered = self.tiers.restore(target) if step is None and not best and self.tiers is not None else None
        if tiered is not None:
            return tiered
        skipped: list[SkippedStep] = []
        errors: list[CheckpointError] = []
        for s in candidate_steps(self, step, best):
            value, local, errs = self._attempt(target, s, policy)
            if not errs:
                state, extra, stats = value
                if skipped:
                    _log.warning("restored step %d after skipping %s", s, [k.step for k in skipped])
                self._emit({"event": "restore", "step": s, "skipped": [asdict(k) for k in skipped], "unix": time.time()})
                # With a local tier, stats["tiers"] says the persistent tier served it.
                stats = dict(stats or {}) if self.tiers is None else self.tiers.served(stats)
                return RestoreResult(state, s, tuple(skipped), extra, stats)
            err = local if local is not None else _err_from(errs[0][1], errs[0][0])
            # Decided on the gathered errors, which every rank holds: all ranks fall back, or none.
            if step is not None or best or not self.fallback or not all(_is_damage(e) for _, e in errs):
                raise err
            agreed = _err_from(errs[0][1], errs[0][0])  # the same on every rank
            skipped.append(SkippedStep(s, type(agreed).__name__, str(agreed)))
            errors.append(err)
            _log.warning("restore: skipped step %d, it fails verification (%s: %s); falling back to an older step",
                         s, type(err).__name__, err)
        first = errors[0]
        raise type(first)(f"no committed step restores; skipped {[k.step for k in skipped]} (newest: {first.message})",
                          key=first.key, object=first.object, expected=first.expected, found=first.found)

    # ------------------------------------------------------------------ metrics file
    def _emit(self, record: dict[str, Any]) -> None:
        if self.metrics_file is None or self.rank != 0:
            return
        with self._lock:
            if self._metrics_out is None:
                if self._closed:  # a save that outlived close(): its record goes to the log only
                    return
                self._metrics_out = open(self.metrics_file, "a", buffering=1)
            self._metrics_out.write(json.dumps(record, default=str) + "\n")
