"""A save whose leader is frozen (SIGSTOP) at its commit while gc runs, then resumed (SIGCONT).

This is the race of FORMAT.md 8.3: a leader paused between deciding to commit and creating its
manifest, and a gc that judges its lease stale meanwhile. With the commit fence exactly one of
them wins: either gc collects the save and the resumed leader fails closed, or the leader's
lease already says ``committing`` and gc keeps the save, which then commits intact.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FenceRun", "frozen_commit", "describe"]


@dataclass
class FenceRun:
    """What happened: the writer's results, gc's report (None when gc did not run), and whether
    the writer really stopped."""

    results: list[dict[str, Any]]
    report: Any = None
    froze: bool = False
    hung: bool = False
    returncodes: list[int | None] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


def _wait_frozen(proc: Any, timeout_s: float, lines: list[str]) -> bool:
    """Read the writer's stdout (into ``lines``) until it says it froze, then wait for the stop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                return False  # exited without freezing
            lines.append(line)
            if '"event": "frozen"' in line:
                break
    else:
        return False
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return True
        time.sleep(0.01)
    return False


def frozen_commit(url: str, step: int, seed: int, *, freeze: str = "before_fence", gc_grace_s: float | None = 1.0,
                  weaken: str | None = None, timeout_s: float = 30.0,
                  repo_options: dict[str, Any] | None = None) -> FenceRun:
    """Save ``step`` in one writer process that stops itself at ``freeze`` (see
    :mod:`ckptfmt_tools.faults._writer`); while it is stopped, wait past ``gc_grace_s`` and run
    ``gc(grace_s=gc_grace_s)`` (no gc when None); then resume it and collect its result."""
    from ckptfmt import Repository
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    run = start_writers(url, [step], 1, seed, freeze=freeze, heartbeat_s=0.2, weaken=weaken, timeout_s=timeout_s)
    proc = run.procs[0]
    out = FenceRun([])
    early: list[str] = []
    try:
        out.froze = _wait_frozen(proc, timeout_s, early)
        if out.froze and gc_grace_s is not None:
            time.sleep(gc_grace_s + 0.3)  # the frozen lease goes stale: the heartbeat is stopped too
            out.report = Repository(url, options=repo_options).gc(grace_s=gc_grace_s)
    finally:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    wait_writers(run, timeout_s + 10)
    for line in early:  # what the writer printed before we handed its pipe to wait_writers
        if line.strip().startswith("{"):
            run.results.insert(0, json.loads(line))
    out.results = [r for r in run.results if "event" not in r]
    out.hung, out.returncodes, out.stderr = run.hung, run.returncodes, run.stderr
    return out


def describe(run: FenceRun) -> str:
    """One line for assertion messages."""
    return json.dumps({"froze": run.froze, "results": run.results, "hung": run.hung,
                       "report": run.report.to_json() if run.report is not None else None,
                       "stderr": [e[-400:] for e in run.stderr]}, default=str)
