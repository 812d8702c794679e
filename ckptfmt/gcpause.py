"""Python's cyclic garbage collector, paused while a save or a manifest does per-leaf work.

A save of a state with thousands of leaves makes tens of thousands of small, acyclic containers
(plans, items, records, manifest columns) that live until the save ends. Each of them counts
towards the collector's thresholds, so a save triggered full (generation 2) collections, which
walk every tracked object of the process (a JAX job holds millions) and took 50-150 ms each: a
quarter of the CPU time of a small save. None of the save's objects form cycles; they are freed by
reference counting when it ends.

:func:`paused_gc` pauses automatic collection for the block it guards, and is safe to nest and to
enter from several threads at once (a save on a background thread while a manifest is parsed on
another): the collector is paused while at least one block is open, and resumed when the last one
closes, only if it was enabled when the first one opened. Cyclic garbage the process makes
meanwhile is collected at the next collection after that. ``SaveOptions(pause_gc=False)`` keeps a
save from pausing it. The bridges' restores and the core's ``read_boxes`` pause it too
(:func:`pausing_gc`): a restore of thousands of leaves builds as many plans and arrays; a process that calls ``gc.disable()`` itself while a pause is open has it
enabled again when the pause ends.
"""
from __future__ import annotations

import functools
import gc
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, ParamSpec, TypeVar

__all__ = ["paused_gc", "pausing_gc", "HeldPause"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Pauses:
    """The open pauses of this process (the collector is process-wide, so is their count)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.resume = False


_PAUSES = _Pauses()


def _open() -> None:
    with _PAUSES.lock:
        if _PAUSES.open == 0:
            _PAUSES.resume = gc.isenabled()
            gc.disable()
        _PAUSES.open += 1


def _close() -> None:
    with _PAUSES.lock:
        _PAUSES.open -= 1
        if _PAUSES.open == 0 and _PAUSES.resume:
            gc.enable()


@contextmanager
def paused_gc(enabled: bool = True) -> Iterator[None]:
    """Pause automatic cyclic collection inside the block (nothing when ``enabled`` is False)."""
    if not enabled:
        yield
        return
    _open()
    try:
        yield
    finally:
        _close()


class HeldPause:
    """A pause opened by one thread and closed by another: an asynchronous save's, opened in the
    caller's thread before it stages the state and closed by the background thread when the save
    ends, so that what the stage makes (a few objects per shard, most of them JAX's) is freed by
    reference counting when the save ends instead of being promoted to the oldest generation by
    the collections the stage itself would trigger (docs/profile-save.md). :meth:`close` is
    idempotent and safe from any thread; nothing is paused when ``enabled`` is False."""

    __slots__ = ("_lock", "_held")

    def __init__(self, enabled: bool = True) -> None:
        self._lock = threading.Lock()
        self._held = False
        if enabled:
            _open()
            self._held = True

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            _close()


def pausing_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run inside :func:`paused_gc` (a restore entry point: a bridge's restore, a read)."""
    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with paused_gc():
            return fn(*args, **kwargs)
    return run
