"""What the checkpoint manager reads back from committed steps: the metrics a step recorded
(FORMAT.md 14.7), the best step by one metric, the steps a restore tries, and the retention it
applies after a commit. See
:mod:`ckptfmt.manager`."""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import msgpack

from ckptfmt.manager._values import _err_from
from ckptfmt.repository._retention import BEST_MODES, metric_value
from ckptfmt.errors import CheckpointError, StepNotFoundError
from ckptfmt.manifest import Manifest

__all__ = ["METADATA_KEY", "recorded_metrics", "best_of", "best_step", "candidate_steps", "forget_deleted", "apply_retention"]

_log = logging.getLogger("ckptfmt.manager")

#: The manager's entry in a manifest's ``metadata``: ``{"metrics": {name: value}}`` (spec 14.7).
METADATA_KEY = "ckptfmt.manager"
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def recorded_metrics(manifest: Manifest) -> dict[str, float | int]:
    """The metrics the manager recorded with a step, as numbers ("nan", "inf", "-inf" back as
    floats); {} when the step recorded none. Anything else under the key is ignored (metadata is
    informative), so this never raises."""
    meta = manifest.metadata.get(METADATA_KEY)
    metrics = meta.get("metrics") if isinstance(meta, Mapping) else None
    out: dict[str, float | int] = {}
    for name, value in (metrics.items() if isinstance(metrics, Mapping) else ()):
        if isinstance(value, str) and value in _NON_FINITE:
            out[str(name)] = _NON_FINITE[value]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(name)] = value
    return out


def best_of(values: Mapping[int, Any], mode: str) -> int | None:
    """The step whose value is best ("min" or "max"; a tie goes to the newer step), counting only
    finite numbers; None when no step has one."""
    ranked = sorted((v if mode == "min" else -v, -s) for s, v in
                    ((s, metric_value(v)) for s, v in values.items()) if v is not None)
    return -ranked[0][1] if ranked else None


def forget_deleted(cache: dict[int, Any], steps: list[int]) -> None:
    """Drop the cached metrics of steps no longer committed (a step number may be saved again)."""
    for s in [s for s in cache if s not in set(steps)]:
        del cache[s]


def best_step(mgr: Any, metric: str | None, mode: str) -> int | None:
    """:meth:`CheckpointManager.best_step`: read each committed step's metrics (through the
    manager's cache); a step whose manifest does not read is skipped."""
    if not metric:
        raise ValueError("best_step needs a metric name: pass metric= or construct the manager with best_metric=")
    if mode not in BEST_MODES:
        raise ValueError(f"mode must be one of {BEST_MODES}, got {mode!r}")
    steps = mgr.repository.steps()
    forget_deleted(mgr._metrics_cache, steps)
    values: dict[int, Any] = {}
    for s in steps:
        try:
            values[s] = mgr.metrics(s).get(metric)
        except CheckpointError:
            continue
    return best_of(values, mode)


def candidate_steps(mgr: Any, step: int | None, best: bool) -> list[int]:
    """Steps ``mgr.restore`` tries, newest first: rank 0 lists them (the best step only with
    ``best``) and every rank gets its answer, or its error."""
    payload: dict[str, Any] = {}
    if mgr.rank == 0:
        try:
            steps = mgr.repository.steps()
            if best:
                chosen = mgr.best_step()
                if chosen is None:
                    raise StepNotFoundError(f"no committed step recorded a finite {mgr.retention.best_metric!r}",
                                            key=mgr.retention.best_metric, object=mgr.url,
                                            expected="a step saved with metrics={best_metric: number}",
                                            found=f"{len(steps)} committed steps without it")
                payload = {"steps": [chosen]}
            elif step is not None:
                if step not in steps:
                    raise StepNotFoundError(f"step {step} is not committed", object=mgr.url,
                                            expected=f"one of {steps[-5:]}{' ...' if len(steps) > 5 else ''}",
                                            found="no manifest")
                payload = {"steps": [step]}
            elif not steps:
                raise StepNotFoundError("the repository has no committed step", object=mgr.url,
                                        expected=">= 1 step", found=0)
            else:
                payload = {"steps": steps[::-1]}
        except CheckpointError as e:
            if mgr.world == 1:
                raise
            payload = {"error": e.to_json()}
    if mgr.world > 1:
        raw = mgr._coord.broadcast("manager/restore/steps", msgpack.packb(payload) if mgr.rank == 0 else None)
        payload = msgpack.unpackb(raw, raw=False)
    if "error" in payload:
        raise _err_from(payload["error"], 0)
    return [int(s) for s in payload["steps"]]


def apply_retention(mgr: Any, gc_interval_s: float) -> None:
    """:meth:`CheckpointManager._retain`: apply retention (rank 0, after a commit), with a gc pass at most
    every ``gc_interval_s``. Failures are logged; they never fail the save."""
    if not mgr.retention.active:
        return
    try:
        steps = mgr.repository.steps()
        with mgr._lock:
            protected = {s for s, n in mgr._reading.items() if n > 0}
        forget_deleted(mgr._metrics_cache, steps)
        # Nothing about restorability is cached here: sizes are probed for each decision, and
        # the step that licenses a deletion is verified byte for byte (or by its record,
        # which any write to its objects invalidates; FORMAT.md 10.4, 14.7).
        plan = mgr.retention.plan(steps, mgr._metric, protected, unrestorable=mgr._unrestorable,
                                   unverified=mgr._unverified)
        for note in plan.notes:
            _log.warning("retention: %s", note)
        for d in plan.delete:
            try:
                mgr.repository.delete(d.step)
            except CheckpointError as e:
                _log.warning("retention: could not delete step %d: %s", d.step, e)
                continue
            mgr._metrics_cache.pop(d.step, None)
            _log.info("retention: deleted step %d: %s", d.step, d.reason)
            mgr._emit({"event": "delete", "step": d.step, "reason": d.reason, "unix": time.time()})
        if mgr._last_gc is None or time.monotonic() - mgr._last_gc >= gc_interval_s:
            mgr._last_gc = time.monotonic()
            report = mgr.repository.gc()
            if report.removed_saves:
                _log.info("gc: removed abandoned saves %s", report.removed_saves)
    except Exception as e:  # noqa: BLE001 - retention must not break training
        _log.warning("retention failed: %s: %s", type(e).__name__, e)
