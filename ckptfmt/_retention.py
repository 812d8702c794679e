"""Retention policy of the checkpoint manager: which committed steps to delete, and why. Pure: no I/O."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["Retention", "metric_value"]

BEST_MODES = ("min", "max")


def metric_value(value: Any) -> float | None:
    """A recorded metric as a number to rank by; None when absent or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep_last`` steps, every step divisible by ``keep_every``, the best
    ``keep_best`` by ``best_metric`` (``best_mode`` "min" or "max"), and always the newest step.

    With every ``keep_*`` None nothing is ever deleted. A step whose metric is absent or not finite
    never counts among the best; it is kept only by the other rules.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.keep_best is not None and not (isinstance(self.best_metric, str) and self.best_metric):
            raise ValueError("keep_best needs best_metric, the name of the metric passed to save(metrics=...)")
        if self.best_mode not in BEST_MODES:
            raise ValueError(f"best_mode must be one of {BEST_MODES}, got {self.best_mode!r}")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    def best(self, metrics: dict[int, float | None]) -> list[int]:
        """The ``keep_best`` best steps (ties: the newer step wins), best first."""
        ranked = [(v if self.best_mode == "min" else -v, -s) for s, v in metrics.items() if v is not None]
        return [-neg for _, neg in sorted(ranked)[: self.keep_best or 0]]

    def plan(self, steps: Iterable[int], metric_of: Callable[[int], float | None],
             protected: Iterable[int] = ()) -> list[tuple[int, str]]:
        """(step, reason) of every committed step to delete, oldest first.

        ``metric_of`` is asked only when ``keep_best`` is set. ``protected`` steps (being read) and
        the newest step are never returned.
        """
        steps = sorted(set(int(s) for s in steps))
        if not self.active or len(steps) <= 1:
            return []
        keep = {steps[-1]} | set(int(s) for s in protected)
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        metrics: dict[int, float | None] = {}
        if self.keep_best is not None:
            metrics = {s: metric_of(s) for s in steps}
            keep.update(self.best(metrics))
        out = []
        for s in steps:
            if s in keep:
                continue
            why = []
            if self.keep_last is not None:
                why.append(f"older than the newest {self.keep_last} (keep_last)")
            if self.keep_every is not None:
                why.append(f"not a multiple of keep_every={self.keep_every}")
            if self.keep_best is not None:
                v = metrics.get(s)
                shown = "not recorded" if v is None else f"{v:g}"
                why.append(f"{self.best_metric}={shown} not among the best {self.keep_best} ({self.best_mode})")
            if self.keep_last is None and self.keep_best is not None and self.keep_every is None:
                why.append("not the newest step")
            out.append((s, "; ".join(why)))
        return out
