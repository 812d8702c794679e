"""A ckptfmt Coordinator over JAX's distributed runtime (the coordination service's key-value store).

Call order and naming follow :mod:`ckptfmt.coord`: every rank makes the same sequence of
collective calls. Call ``n`` of a coordinator stores rank r's value under
``ckptfmt/<instance>/<n>/<r>``, so one name may be used many times. When an allgather or a
barrier completes, every rank has finished all earlier calls, so a rank then deletes its own
earlier keys; the store stays small.

Every wait has a timeout: a deadline raises CoordinatorTimeoutError; any other runtime failure
(the service or a peer gone) raises CoordinatorLostError. Neither ever hangs past ``timeout_s``.

A dead peer is noticed well before the timeout: each process refreshes a liveness key
(``ckptfmt/alive/<rank>``) every second from a daemon thread, started with its first
JaxCoordinator, and a wait polls in one-second slices; a peer whose key has not changed for
``dead_after_s`` (default 20 s) is declared lost (CoordinatorLostError). A peer that has not
started its heartbeat yet is only ever subject to the timeout. Liveness means the peer's
interpreter ran its heartbeat thread: a process that holds the GIL for longer than
``dead_after_s`` (a long pure-Python loop; JAX and numpy calls release it) looks dead, so raise
``dead_after_s``, or pass None, for such workloads.
"""
from __future__ import annotations

import atexit
import itertools
import threading
import time
from typing import Any

import jax
import msgpack
from jax._src import distributed  # the coordination client is not public API in jax 0.10

from ckptfmt.coord import LocalCoordinator, as_bytes
from ckptfmt.errors import (CheckpointError, CoordinatorLostError, CoordinatorTimeoutError,
                            StepMismatchError)

__all__ = ["JaxCoordinator", "default_coordinator"]

_instances = itertools.count()

#: Seconds between a process's liveness-key refreshes, and between a waiter's liveness checks.
HEARTBEAT_S = 1.0
#: A peer whose liveness key has not changed for this long is presumed dead.
DEAD_AFTER_S = 20.0
_beat_lock = threading.Lock()
_beat: dict[str, Any] = {}  # this process's heartbeat: its client and thread (filled on first use)


def _alive_key(rank: int) -> str:
    return f"ckptfmt/alive/{rank}"


def _client_is_current(client: Any) -> bool:
    return distributed.global_state.client is client


def _start_heartbeat(client: Any, rank: int) -> None:
    """Refresh this process's liveness key every HEARTBEAT_S from a daemon thread (once per client).

    A failed refresh is retried: one transient RPC error must not make this rank look dead to its
    peers. The thread ends when ``jax.distributed`` shuts this client down (or replaces it)."""
    with _beat_lock:
        if _beat.get("client") is client and _beat["thread"].is_alive():
            return

        stop = threading.Event()

        def run() -> None:
            n = 0
            try:
                while _client_is_current(client) and not stop.is_set():
                    n += 1
                    try:
                        client.key_value_set(_alive_key(rank), str(n), allow_overwrite=True)
                    except Exception:  # noqa: BLE001 - transient, or the service is gone: retry until shut down
                        pass
                    stop.wait(HEARTBEAT_S)
            finally:
                with _beat_lock:
                    if _beat.get("client") is client:
                        _beat.clear()

        thread = threading.Thread(target=run, name="ckptfmt-jax-heartbeat", daemon=True)
        thread.start()
        _beat.update(client=client, thread=thread)
        # Stopped and joined at interpreter exit, before daemon threads are torn down: a daemon
        # thread inside the client's C++ call when the interpreter finalizes is unwound through
        # pybind11's frames on its way back to the GIL, which aborts the process ("terminate
        # called ... FATAL: exception not rethrown"), after its work is done but with a failing
        # exit status.
        atexit.register(_stop_heartbeat, stop, thread)


def _stop_heartbeat(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join(timeout=10.0)


def _is_timeout(exc: Exception) -> bool:
    text = str(exc)
    return "DEADLINE_EXCEEDED" in text or "deadline" in text.lower() or "timed out" in text.lower()


class _PeerWatch:
    """How long a peer's liveness key has stayed unchanged, as seen by this waiter."""

    def __init__(self, client: Any, peer: int) -> None:
        self.client, self.key = client, _alive_key(peer)
        self.value: str | None = None
        self.since = time.monotonic()

    def silent_for(self) -> float | None:
        """Seconds since the key last changed; None while the peer has no key (not started)."""
        try:
            value = self.client.key_value_try_get(self.key)
        except Exception:  # noqa: BLE001 - NOT_FOUND: no heartbeat yet
            return None
        now = time.monotonic()
        if value != self.value:
            self.value, self.since = value, now
        return now - self.since


def _client() -> Any:
    client = distributed.global_state.client
    if client is None:
        raise CoordinatorLostError("jax.distributed is not initialized; call jax.distributed.initialize() "
                                   "first, or use LocalCoordinator for a single process")
    return client


def _ms(timeout_s: float) -> int:
    return max(1, int(timeout_s * 1000))


class JaxCoordinator:
    """Barrier, all-gather and broadcast of bytes over ``jax.distributed``'s key-value store.

    Follows the call-order contract of :mod:`ckptfmt.coord`: each value is stored as
    msgpack ``[kind, name, root, payload]``, so a rank that called a different operation is
    detected (StepMismatchError) instead of waiting forever. After any error the coordinator
    is unusable (CoordinatorLostError); create a new one.

    ``prefix`` separates coordinators that are alive at the same time; ranks must create
    them in the same order, or pass the same prefix. ``dead_after_s``: a peer silent this long
    is declared lost (None: only the timeout applies).
    """

    def __init__(self, *, timeout_s: float = 300.0, prefix: str | None = None,
                 dead_after_s: float | None = DEAD_AFTER_S) -> None:
        self._client = _client()
        self.rank = int(jax.process_index())
        self.world = int(jax.process_count())
        self.timeout_s = float(timeout_s)
        self.dead_after_s = None if dead_after_s is None else float(dead_after_s)
        if self.world > 1:
            _start_heartbeat(self._client, self.rank)
        self._prefix = f"ckptfmt/{next(_instances) if prefix is None else prefix}"
        self._seq = 0
        self._mine: list[str] = []  # this rank's keys of the previous call
        self._broken: CheckpointError | None = None
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    def _begin(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise TypeError(f"operation name must be a non-empty str, got {name!r}")
        if self._broken is not None:
            raise CoordinatorLostError(f"coordinator unusable after an earlier error: {self._broken}")
        base = f"{self._prefix}/{self._seq}"
        self._seq += 1
        return base

    def _end(self, new_keys: list[str], *, synced: bool) -> None:
        """Record this call's keys; after a call that every rank has entered, drop older ones.

        Completing an allgather or a barrier proves every rank has finished all earlier calls,
        so no one reads this rank's earlier keys any more. A broadcast proves nothing of the
        kind (the root returns at once), so its keys wait for the next synchronising call.
        """
        if synced:
            for k in self._mine:
                try:
                    self._client.key_value_delete(k)
                except Exception:  # noqa: BLE001 - cleanup is best effort
                    pass
            self._mine = []
        self._mine.extend(new_keys)

    def _fail(self, exc: CheckpointError) -> CheckpointError:
        self._broken = exc
        return exc

    def _wrap(self, exc: Exception, what: str, timeout_s: float) -> CheckpointError:
        text = str(exc)
        first = text.splitlines()[0] if text else type(exc).__name__
        if _is_timeout(exc):
            return self._fail(CoordinatorTimeoutError(
                f"{what} timed out after {timeout_s:g} s on rank {self.rank} of {self.world}: {first}",
                expected=f"all {self.world} ranks", found="timeout"))
        return self._fail(CoordinatorLostError(f"{what} failed on rank {self.rank} of {self.world}: {first}"))

    def _put(self, key: str, header: list[Any], payload: bytes, what: str) -> None:
        value = msgpack.packb(header + [bytes(payload)], use_bin_type=True)
        try:
            self._client.key_value_set_bytes(key, value)
        except Exception as exc:  # noqa: BLE001 - jaxlib raises its own runtime error type
            raise self._fail(CoordinatorLostError(f"{what}: writing {key!r} failed on rank {self.rank}: {exc}")) from exc

    def _take(self, key: str, header: list[Any], timeout_s: float, what: str, peer: int) -> bytes:
        """Wait for ``peer``'s value under ``key``: in HEARTBEAT_S slices, checking between them
        that the peer is still alive."""
        deadline = time.monotonic() + timeout_s
        watch = _PeerWatch(self._client, peer) if self.dead_after_s is not None else None
        while True:
            left = deadline - time.monotonic()
            slice_s = min(HEARTBEAT_S, max(left, 0.001))
            started = time.monotonic()
            try:
                raw = bytes(self._client.blocking_key_value_get_bytes(key, _ms(slice_s)))
                break
            except Exception as exc:  # noqa: BLE001
                if not _is_timeout(exc) or time.monotonic() >= deadline:
                    raise self._wrap(exc, what, timeout_s) from exc
            time.sleep(max(0.0, slice_s - (time.monotonic() - started)))  # a get that gave up early: no spinning
            silent = watch.silent_for() if watch is not None else None
            if silent is not None and silent > self.dead_after_s:  # type: ignore[operator]
                raise self._fail(CoordinatorLostError(
                    f"{what}: rank {peer} is gone (its liveness key unchanged for {silent:.0f} s) on rank "
                    f"{self.rank} of {self.world}", expected=f"a heartbeat every {HEARTBEAT_S:g} s", found="none"))
        try:
            got = msgpack.unpackb(raw, raw=False, use_list=True)
            ok = isinstance(got, list) and len(got) == len(header) + 1 and isinstance(got[-1], bytes)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            raise self._fail(CoordinatorLostError(f"{what}: malformed value under {key!r}"))
        if got[:-1] != header:
            raise self._fail(StepMismatchError(f"{what}: ranks called different collectives",
                                               expected=header, found=got[:-1]))
        return got[-1]

    # -- Coordinator protocol ---------------------------------------------------------------
    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        """Return once every rank has called ``barrier(name)``; a different call on any rank raises
        StepMismatchError."""
        self._gather("barrier", name, b"", timeout_s)

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Every rank's payload, index = rank."""
        return self._gather("allgather", name, as_bytes(payload), timeout_s)

    def _gather(self, kind: str, name: str, payload: bytes, timeout_s: float | None) -> list[bytes]:
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            base = self._begin(name)
            header = [kind, name, 0]
            mine = f"{base}/{self.rank}"
            if self.world > 1:
                self._put(mine, header, payload, f"{kind} {name!r}")
            deadline = time.monotonic() + timeout_s
            out = []
            for r in range(self.world):
                if r == self.rank:
                    out.append(payload)
                    continue
                left = max(deadline - time.monotonic(), 0.001)
                out.append(self._take(f"{base}/{r}", header, left, f"{kind} {name!r} (waiting for rank {r})", r))
            self._end([mine] if self.world > 1 else [], synced=True)
            return out

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        """``root``'s payload on every rank (ignored on the others)."""
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            base = self._begin(name)
            header = ["broadcast", name, int(root)]
            key = f"{base}/{root}"
            if self.rank == root:
                if payload is None:
                    raise TypeError("broadcast: the root rank must pass a payload")
                payload = as_bytes(payload)
                self._put(key, header, payload, f"broadcast {name!r}")
                self._end([key], synced=False)
                return payload
            return self._take(key, header, timeout_s, f"broadcast {name!r} (waiting for rank {root})", int(root))

    def close(self) -> None:
        """Forget this rank's remaining keys (those of the last call; a peer may still be reading
        them, so they stay: one small key per rank per closed coordinator, gone with the job)."""
        self._mine = []




def default_coordinator() -> Any:
    """JaxCoordinator when ``jax.process_count() > 1``, else ckptfmt's LocalCoordinator."""
    if jax.process_count() > 1:
        return JaxCoordinator()
    return LocalCoordinator()
