"""Retention: which committed steps to delete, and why (FORMAT.md 10.4, 14.7). Pure: no I/O.

One planner serves both ``Repository.gc(keep_last=, keep_every=)`` and the checkpoint manager
(which adds ``keep_best``). Whatever the rules, it counts only **restorable** steps (the caller
says which are not, and why) and never deletes the newest restorable step, the newest step, nor a
protected one; when fewer steps are restorable than ``keep_last`` asks for, or none is, it
deletes nothing. A step is deleted only while a newer kept step has been **verified** byte for
byte (the caller's ``unverified``; FORMAT.md 10.4): the newest restorable step the rules count
first must verify, or it is not counted, so the newest verified step always survives. It is
asked only when the plan deletes something. When the plan would leave no step older than that
step, and its verification rests on a record rather than a read made by this decision, the
caller's ``reread`` reads it again first: a record cannot see bytes that decayed under an
unchanged stamp, and after this deletion there would be no older step to fall back to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["Retention", "RetentionPlan", "Deletion", "metric_value"]

BEST_MODES = ("min", "max")


def metric_value(value: Any) -> float | None:
    """A recorded metric as a number to rank by; None when absent or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class Deletion:
    """A committed step the policy deletes, and why."""

    step: int
    reason: str


@dataclass(frozen=True)
class RetentionPlan:
    """The steps to delete, oldest first, and notes on what the planner could not count."""

    delete: tuple[Deletion, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def steps(self) -> list[int]:
        return [d.step for d in self.delete]


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep_last`` restorable steps (and every step newer than the oldest of
    them), every step divisible by ``keep_every``, the best ``keep_best`` restorable steps by
    ``best_metric`` (``best_mode`` "min" or "max"), and always the newest step and the newest
    restorable step.

    With every ``keep_*`` None nothing is ever deleted. A step whose metric is absent or not finite
    never counts among the best; it is kept only by the other rules. Bad arguments raise ValueError.
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

    def plan(self, steps: Iterable[int], metric_of: Callable[[int], float | None] | None = None,
             protected: Iterable[int] = (), *, unrestorable: Callable[[int], str | None] | None = None,
             unverified: Callable[[int], str | None] | None = None,
             reread: Callable[[int], str | None] | None = None) -> RetentionPlan:
        """The committed steps to delete, oldest first.

        ``unrestorable(step)`` says why a step cannot be restored (None: it can); it is asked
        lazily, newest first, only for the steps the rules need to count, and at most once per
        step. ``unverified(step)`` says why a step is not verified byte for byte (None: it is);
        only when the plan deletes something, it is asked for the newest step the rules count,
        and a step that fails is counted as not restorable (then the next one is asked).
        ``reread(step)`` says why a step fails a fresh read that ignores any verification record
        (None: it passes, or this decision already read it in full); it is asked for that same
        step only when the plan would keep no step older than it, and a step that fails it is
        counted as not restorable too (FORMAT.md 10.4). Every deleted step is older than a kept
        step that passed them. ``metric_of`` is asked only when
        ``keep_best`` is set. ``protected`` steps (being read), the newest step and every step
        from the newest restorable one on are never returned.
        """
        steps = sorted(set(int(s) for s in steps))
        if not self.active or not steps:
            return RetentionPlan()
        notes: list[str] = []
        judged: dict[int, str | None] = {}
        while True:  # each round verifies one more step, or ends
            plan, licence = self._plan_once(steps, metric_of, protected, unrestorable, judged, notes)
            if not plan.delete or unverified is None or licence is None:
                return plan
            why = unverified(licence)
            if why is None and reread is not None and not any(s < licence for s in steps if s not in plan.steps):
                # The deletion would leave no older step: the record alone may not license it.
                why = reread(licence)
                if why is not None:
                    why = f"its verification record matches, but a fresh read fails: {why}"
            if why is None:
                return plan
            judged[licence] = f"fails verification: {why}"
            notes.append(f"step {licence} is not restorable ({judged[licence]}); retention does not count it")

    def _plan_once(self, steps: list[int], metric_of: Callable[[int], float | None] | None, protected: Iterable[int],
                   unrestorable: Callable[[int], str | None] | None, judged: dict[int, str | None],
                   notes: list[str]) -> tuple[RetentionPlan, int | None]:
        """One plan, and the kept step that must verify for it to stand (the newest one counted)."""

        def why_not(s: int) -> str | None:
            if s not in judged:
                judged[s] = unrestorable(s) if unrestorable is not None else None
                if judged[s] is not None:
                    notes.append(f"step {s} is not restorable ({judged[s]}); retention does not count it")
            return judged[s]

        keep = {steps[-1]} | set(int(s) for s in protected)
        if self.keep_last is not None:  # the newest keep_last restorable steps, counted newest first
            restorable: list[int] = []
            for s in reversed(steps):
                if why_not(s) is None:
                    restorable.append(s)
                    if len(restorable) == self.keep_last:
                        break
            if len(restorable) < self.keep_last:
                if len(steps) > self.keep_last:
                    notes.append(f"only {len(restorable)} restorable step(s), fewer than --keep-last "
                                 f"{self.keep_last}: retention removed nothing")
                return RetentionPlan((), tuple(notes)), None
            keep.update(s for s in steps if s >= restorable[-1])
            licence = restorable[0]
        else:
            licence = next((s for s in reversed(steps) if why_not(s) is None), None)
            if licence is None:
                notes.append("no step is restorable: retention removed nothing")
                return RetentionPlan((), tuple(notes)), None
            keep.update(s for s in steps if s >= licence)  # nothing newer than the step that must verify
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        metrics: dict[int, float | None] = {}
        if self.keep_best is not None:
            metrics = {s: (metric_of(s) if metric_of is not None else None) for s in steps}
            keep.update(self._best(metrics, why_not))
        out = [Deletion(s, self._reason(s, metrics, judged.get(s))) for s in steps if s not in keep]
        return RetentionPlan(tuple(out), tuple(notes)), licence

    def best(self, metrics: dict[int, float | None]) -> list[int]:
        """The ``keep_best`` best steps (ties: the newer step wins), best first."""
        return self._best(metrics, lambda s: None)

    def _best(self, metrics: dict[int, float | None], why_not: Callable[[int], str | None]) -> list[int]:
        ranked = sorted((v if self.best_mode == "min" else -v, -s) for s, v in metrics.items() if v is not None)
        out: list[int] = []
        for _, neg in ranked:
            if len(out) == (self.keep_best or 0):
                break
            if why_not(-neg) is None:
                out.append(-neg)
        return out

    def _reason(self, s: int, metrics: dict[int, float | None], not_restorable: str | None) -> str:
        why = []
        if self.keep_last is not None:
            why.append(f"older than the newest {self.keep_last} restorable (keep_last)")
        if self.keep_every is not None:
            why.append(f"not a multiple of keep_every={self.keep_every}")
        if self.keep_best is not None:
            v = metrics.get(s)
            shown = "not recorded" if v is None else f"{v:g}"
            why.append(f"{self.best_metric}={shown} not among the best {self.keep_best} ({self.best_mode})")
        if self.keep_last is None and self.keep_best is not None and self.keep_every is None:
            why.append("not the newest step")
        if not_restorable is not None:
            why.append(f"not restorable ({not_restorable})")
        return "; ".join(why)
