"""Agree on the step to restore: every rank opens the same one, and a failure reaches every rank.

Call order (the coordinator contract of :mod:`ckptfmt.coord`): with ``step=None`` on several
ranks, every rank calls :func:`agree_step` at the same point; rank 0 lists the repository and
broadcasts either the latest committed step or the error it hit, so the other ranks never wait
for a timeout because rank 0 failed. With a step given, or on one rank, nothing is exchanged.
"""
from __future__ import annotations

import json
from typing import Protocol

from .coord import Coordinator
from .errors import CheckpointError, StepNotFoundError

__all__ = ["agree_step", "StepListing"]

_NAME = "restore/agree-step"


class StepListing(Protocol):
    """What :func:`agree_step` asks of a repository (:class:`ckptfmt.Repository` is one; the floor
    cannot name it): its newest committed step, or None when there is none."""

    def latest(self) -> int | None: ...


def agree_step(repository: StepListing, step: int | None, coordinator: Coordinator, *,
               timeout_s: float | None = None) -> int:
    """The step every rank restores: ``step`` if given, else the latest committed step as rank 0
    lists it in ``repository`` (a :class:`ckptfmt.Repository`).

    Fails on every rank at once, never by a timeout on the ranks that did nothing wrong: when
    rank 0's listing raises, rank 0 raises its own error and every other rank raises the same
    error class with the same key/object/expected/found, its message prefixed ``rank 0:`` (an
    untyped error of rank 0 reaches the others as a CheckpointError naming its class). A
    repository with no committed step raises StepNotFoundError on every rank. The coordinator's
    own errors (CoordinatorTimeoutError, CoordinatorLostError) propagate as they are.
    """
    if step is not None:
        return int(step)
    if coordinator.world == 1:
        return _latest(repository)
    failure: BaseException | None = None
    payload = None
    if coordinator.rank == 0:
        try:
            payload = {"step": _latest(repository)}
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, typed or not
            failure = e
            payload = {"error": e.to_json() if isinstance(e, CheckpointError)
                       else {"error": type(e).__name__, "message": str(e)[:500], "untyped": True}}
        data: bytes | None = json.dumps(payload).encode()
    else:
        data = None
    got = json.loads(coordinator.broadcast(_NAME, data, 0, timeout_s))
    if failure is not None:
        raise failure
    if "error" in got:
        raise CheckpointError.from_json(got["error"], prefix="rank 0: ")
    return int(got["step"])


def _latest(repository: StepListing) -> int:
    latest = repository.latest()
    if latest is None:
        raise StepNotFoundError("repository has no committed step", object=getattr(repository, "url", None),
                                expected=">= 1 step", found=0)
    return int(latest)
