"""Values the checkpoint manager hands out (frozen), and its small helpers. See :mod:`ckptfmt.manager`."""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from ckptfmt.errors import (CheckpointError, error_class, ChecksumMismatchError, InvalidManifestError,
                            InvalidStateError, MissingShardError, SizeMismatchError, StepNotFoundError,
                            UnsupportedVersionError)

__all__ = ["SaveRecord", "SkippedStep", "RestoreResult"]


@dataclass(frozen=True)
class SaveRecord:
    """One save as this process saw it. ``blocked_s``: the caller's time inside ``save()``,
    ``waited_s`` of it spent waiting for the previous save (back-pressure); ``write_s``: from the
    start of the save to its commit (or its last failure); ``bytes``: stored bytes of the
    committed step (all ranks); ``error``: the last attempt's error of a save that did not commit;
    ``attempts``: how many times it was tried (the failure policy's retries)."""

    step: int
    committed: bool
    started_unix: float
    blocked_s: float
    waited_s: float
    write_s: float
    bytes: int
    error: str | None = None
    attempts: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"event": "save", **asdict(self)}


@dataclass(frozen=True)
class SkippedStep:
    """A step that ``restore()`` passed over: its number, the error's class name and message."""

    step: int
    error: str
    message: str


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore()`` restored: the state (as the bridge's restore verb returns it), its step,
    the ``extra`` saved with it, the bridge's restore statistics, and the newer steps skipped."""

    state: Any
    step: int
    skipped: tuple[SkippedStep, ...] = ()
    extra: Any = None
    stats: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Job:
    step: int
    t0: float
    started_unix: float
    blocked_s: float = 0.0
    waited_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    record: SaveRecord | None = None
    error: BaseException | None = None
    attempts: int = 1


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """Metrics as plain JSON numbers. A non-finite value is kept as its name ("nan", "inf"), since
    JSON cannot hold it; such a value never ranks among the best."""
    out: dict[str, Any] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"metric names must be non-empty str, got {k!r}")
        if isinstance(v, bool):
            raise TypeError(f"metric {k!r} must be a number, got a bool")
        try:
            num: int | float = int(v) if isinstance(v, (int, np.integer)) else float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}") from None
        out[k] = num if isinstance(num, int) or math.isfinite(num) else repr(num)
    return out


def _err_json(e: BaseException) -> dict[str, Any]:
    if isinstance(e, CheckpointError):
        return e.to_json()
    return {"error": type(e).__name__, "message": str(e)[:500]}


def _err_from(d: Mapping[str, Any], rank: int) -> CheckpointError:
    """Rank ``rank``'s error as every rank raises it (CheckpointError.from_json, the one inverse)."""
    known = isinstance(d, Mapping) and error_class(str(d.get("error"))) is not None
    return CheckpointError.from_json(d, prefix="" if known else f"rank {rank} failed: ")


#: Errors that mean "this step's bytes are damaged" (fallback moves to an older step). A wrong
#: target (KeyMismatchError, ShapeMismatchError, TopologyChangedError) or a newer format version
#: is the caller's problem, and an older step would not cure it: those always raise.
_DAMAGE = (MissingShardError, SizeMismatchError, ChecksumMismatchError, InvalidManifestError,
           InvalidStateError, StepNotFoundError)


def _is_damage(err: Mapping[str, Any]) -> bool:
    cls = error_class(str(err.get("error")))
    return (isinstance(cls, type) and issubclass(cls, _DAMAGE)
            and not issubclass(cls, UnsupportedVersionError))
