"""What the checkpoint manager does when a persistent save fails: :class:`SaveFailurePolicy`.

A save that fails is retried from the host copies it already staged (the state the caller handed
over at that step, never a later one), in the background for an asynchronous save, with a doubling
bounded backoff. A save that still fails is recorded (history, metrics file, a warning naming the
step and the error) and training goes on; the manager raises only when the policy says so. See
:mod:`ckptfmt.manager` and docs/failures.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.errors import (CoordinatorLostError, CoordinatorTimeoutError, IncompleteSaveError, StepAlreadyCommittedError,
                            StorageError)

__all__ = ["SaveFailurePolicy", "RETRYABLE"]

#: The errors a retry may cure: the storage failed (a full disk, a read-only mount, an object
#: store's 5xx, an unreachable endpoint), a writer or the commit failed, a peer was late. Anything
#: else (a step another save committed, ranks that disagree on the inventory, state that does not
#: encode) fails the same way again, so it is recorded at once.
RETRYABLE: tuple[type[BaseException], ...] = (StorageError, IncompleteSaveError, CoordinatorTimeoutError,
                                               CoordinatorLostError, OSError)


@dataclass(frozen=True)
class SaveFailurePolicy:
    """How a :class:`~ckptfmt.manager.CheckpointManager` treats a persistent save that fails.

    ``retries``: further attempts of a failed save (0: none), each from the host copies that save
    staged, after ``backoff_s`` doubled at each retry and capped at ``max_backoff_s``. An
    asynchronous save retries in the background; the caller waits for it only at its next
    ``save``/``wait``/``close`` (back-pressure, as for any save in flight). Only errors in
    :data:`RETRYABLE` are retried; ``StepAlreadyCommittedError`` never is.

    A save that still fails is a *failure*: it is recorded in ``history`` (``committed=False``,
    the error, the attempts), in the metrics file, and by a ``logging`` warning on logger
    ``ckptfmt.manager`` naming the step and the error; every failed attempt is logged too. The
    newest committed step stays as it was (a failed save deletes only its own private objects, and
    retention runs only after a commit), and training goes on.

    The manager raises (the last failure's own error, at the next ``save``/``wait``/``close``)
    only when ``max_consecutive_failures`` saves in a row have failed (None: never), or, with
    ``raise_at_close_if_uncommitted``, at ``close()`` when the last save it started did not commit.

    The default retries twice (1 s, then 2 s), raises after 5 failed saves in a row and at
    ``close()`` when the last save did not commit: a transient outage costs nothing, a storage
    that stays broken stops the job within 5 saves, and a job never ends believing its last state
    is saved when it is not. :meth:`fail_fast` is the behaviour before policies existed.

    Bad values raise ValueError when built.
    """

    retries: int = 2
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_consecutive_failures: int | None = 5
    raise_at_close_if_uncommitted: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"SaveFailurePolicy.retries must be an int >= 0, got {self.retries!r}")
        if not (float(self.backoff_s) >= 0 and float(self.max_backoff_s) >= 0):
            raise ValueError(f"SaveFailurePolicy.backoff_s and max_backoff_s must be >= 0, got "
                             f"{self.backoff_s!r}, {self.max_backoff_s!r}")
        n = self.max_consecutive_failures
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"SaveFailurePolicy.max_consecutive_failures must be an int >= 1 or None, got {n!r}")

    @classmethod
    def fail_fast(cls) -> "SaveFailurePolicy":
        """No retry; the first failed save raises at the next ``save``/``wait``/``close``."""
        return cls(retries=0, max_consecutive_failures=1, raise_at_close_if_uncommitted=True)

    def retryable(self, error: BaseException) -> bool:
        """Whether ``error`` is one a retry may cure (see :data:`RETRYABLE`)."""
        return isinstance(error, RETRYABLE) and not isinstance(error, StepAlreadyCommittedError)

    def delay_s(self, attempt: int) -> float | None:
        """Seconds to wait before attempt ``attempt + 1`` after attempt ``attempt`` (1-based)
        failed, or None when no attempt is left."""
        if attempt > self.retries:
            return None
        return min(float(self.max_backoff_s), float(self.backoff_s) * 2.0 ** (attempt - 1))

    def raises_after(self, consecutive_failures: int) -> bool:
        """Whether the manager raises once ``consecutive_failures`` saves in a row have failed."""
        n = self.max_consecutive_failures
        return n is not None and consecutive_failures >= n
