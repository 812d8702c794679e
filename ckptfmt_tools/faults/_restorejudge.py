"""Faults of kinds ``"coop"`` and ``"tier"``: a restore across processes (FORMAT.md 8.5, 9.1).

Each action builds its own small repositories in the run's folder, runs every rank of a restore
(ranks are threads of this process sharing an in-memory data plane, as tests/test_cooperative.py
does; the data plane is where the fault is injected), and returns a :class:`RestoreAttempt`.
:func:`judge` fills the outcome row:

* **typed**: every rank raised one of ``Fault.expect``; or, where the documented outcome is a
  fallback (``fallback``), every rank returned and the restore path reported one of
  ``Fault.expect`` on the way (the manager's log); a fault that never reached its target fails;
* **exposed**: a rank returned values that differ from the truth of the step it says it restored;
* **prior intact**: the persistent step the restore falls back to verifies and restores bit for bit;
* **gc clean**: ``gc(grace_s=0)`` of every repository involved leaves no private objects, removes
  nothing a committed manifest names, and the prior step still restores.

Context knobs for the broken controls: ``restore_clean`` (the same run with nothing injected:
every rank must return the truth without an error, so the row FAILS on "no error"), and
``restore_weaken`` (``"receiver_trusts"``: rank 0 takes the chunks its peers send without
checking them, so a fault in transit reaches its values).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["RestoreAttempt", "run_ranks", "judge", "LogTap"]

_JOIN_S = 120.0


@dataclass
class RestoreAttempt:
    where: str
    ranks: list[Any]                          # per rank: {key: array}, an exception, or None (hung)
    truth: list[dict[str, np.ndarray]]        # per rank: what it must hold if it returns
    prior: tuple[str, int, dict[str, np.ndarray], Any] | None = None  # (url, step, arrays, state)
    repos: tuple[str, ...] = ()               # gc'd after the restore
    fallback: bool = False                    # returning the truth is the documented outcome
    detected: list[str] = field(default_factory=list)  # error classes the restore path reported
    reached: bool = True                      # the fault reached its target
    notes: list[str] = field(default_factory=list)


def run_ranks(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank in its own thread; each rank's value or exception (None: hung)."""
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - judged per rank
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_JOIN_S)
    return out


class LogTap(logging.Handler):
    """Collects the messages of logger ``ckptfmt.manager`` while open (a restore's own report of
    what it rejected and why)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._log = logging.getLogger("ckptfmt.manager")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "LogTap":
        self._level = self._log.level
        self._log.setLevel(logging.DEBUG)
        self._log.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._log.removeHandler(self)
        self._log.setLevel(self._level)

    def named(self, names: list[str]) -> list[str]:
        return [n for n in names if any(n in line for line in self.lines)]


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _gc_clean(urls: tuple[str, ...], out: Any, run_within: Any, timeout_s: float) -> bool:
    from ckptfmt import Repository
    from ckptfmt_tools.faults._checks import describe_leftovers, inventory

    ok = True
    for url in urls:
        if not Path(url).is_dir():
            continue
        before = inventory(url)
        done, _, exc = run_within(timeout_s, lambda url=url: Repository(url).gc(grace_s=0))
        if not done or exc is not None:
            out.notes.append(f"gc of {Path(url).name} " + ("did not finish" if not done else
                                                           f"raised {type(exc).__name__}: {exc}"))
            out.hung |= not done
            ok = False
            continue
        after = inventory(url)
        lost = sorted((before.committed & before.save_files) - after.save_files)
        left = sorted(after.private())
        if lost:
            out.notes.append(f"gc of {Path(url).name} removed committed objects: {lost[:3]}")
        if left:
            out.notes += [f"gc of {Path(url).name} left {w}" for w in describe_leftovers(after)]
        ok &= not lost and not left
    return ok


def judge(fault: Any, run_dir: Path, ctx: Any, out: Any, run_within: Any) -> None:
    """Run a ``"coop"`` or ``"tier"`` fault and judge it (see the module docstring)."""
    from ckptfmt import Repository
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.faults._checks import prior_intact

    a: RestoreAttempt = fault.action(run_dir, ctx)
    out.where, out.notes = a.where, out.notes + a.notes
    expect = tuple(e.__name__ for e in fault.expect)
    raised, wrong = [], []
    out.hung = any(r is None for r in a.ranks)
    for r, (got, want) in enumerate(zip(a.ranks, a.truth)):
        if isinstance(got, BaseException):
            name = type(got).__name__
            raised.append(name)
            if not out.message:
                out.message = str(got)[:300]
            if not isinstance(got, CheckpointError):
                out.notes.append(f"rank {r} raised {name} (untyped): {str(got)[:200]}")
        elif isinstance(got, dict):
            bad = [k for k in want if not _same(got.get(k), want[k])]
            if bad:
                wrong.append(f"rank {r}: {bad}")
    out.raised = list(dict.fromkeys(raised)) or ["no error"]
    if a.fallback:
        out.raised = [f"{d} (recovered)" for d in a.detected] + (["no error"] if not raised else out.raised)
        out.typed = not raised and not out.hung and (not expect or any(d in expect for d in a.detected))
    else:
        out.typed = (not out.hung and all(isinstance(g, fault.expect) for g in a.ranks)
                     and all(isinstance(g, CheckpointError) for g in a.ranks))
    if not a.reached:
        out.typed = False
        out.notes.append("the fault never reached its target")
    out.exposed = bool(wrong)
    if wrong:
        out.notes.append(f"wrong values returned without an error: {'; '.join(wrong)}")
    if a.prior is not None:
        url, step, arrays, state = a.prior
        ok, why = prior_intact(Repository(url), step, arrays, state)
        out.prior_intact = ok
        if not ok:
            out.notes.append(why)
    else:
        out.prior_intact = True
    out.gc_clean = _gc_clean(a.repos, out, run_within, ctx.check_timeout_s)
    if a.prior is not None and out.gc_clean:
        url, step, arrays, state = a.prior
        ok, why = prior_intact(Repository(url), step, arrays, state)
        if not ok:
            out.gc_clean = False
            out.notes.append(f"after gc: {why}")
