"""Start writer processes (:mod:`ckptfmt_tools.faults._writer`) and collect what they report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WriterRun", "start_writers", "wait_writers"]

_PKG_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class WriterRun:
    procs: list[subprocess.Popen]
    results: list[dict[str, Any]] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)
    hung: bool = False
    stderr: list[str] = field(default_factory=list)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_writers(url: str, steps: list[int], world: int, seed: int, *, ranks: list[int] | None = None,
                  kill: str | None = None, kill_rank: int = 0, go_file: str | None = None,
                  timeout_s: float = 30.0, fsize_limit: int | None = None,
                  weaken: str | None = None, announce: bool = False,
                  publish_first: bool = False, rendezvous: str | None = None, freeze: str | None = None,
                  heartbeat_s: float | None = None, incremental: bool = False) -> WriterRun:
    """Start one process per rank (``ranks`` defaults to all of them) saving ``steps``."""
    address = ""
    if world > 1:
        from ckptfmt.coord import free_port

        address = f"127.0.0.1:{free_port()}"
    procs = []
    for rank in (range(world) if ranks is None else ranks):
        task = {"url": url, "steps": steps, "rank": rank, "world": world, "seed": seed, "address": address,
                "kill": kill, "kill_rank": kill_rank, "go_file": go_file, "timeout_s": timeout_s,
                "fsize_limit": fsize_limit, "weaken": weaken, "announce": announce,
                "publish_first": publish_first, "rendezvous": rendezvous, "freeze": freeze,
                "heartbeat_s": heartbeat_s, "incremental": incremental}
        procs.append(subprocess.Popen([sys.executable, "-m", "ckptfmt_tools.faults._writer", json.dumps(task)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True))
    return WriterRun(procs)


def wait_writers(run: WriterRun, timeout_s: float) -> WriterRun:
    """Wait for every writer; past ``timeout_s`` kill the rest and mark the run as hung."""
    deadline = time.monotonic() + timeout_s
    for p in run.procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.hung = True
            p.kill()
            out, err = p.communicate()
        run.returncodes.append(p.returncode)
        run.stderr.append(err[-2000:] if err else "")
        for line in (out or "").splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    run.results.append(json.loads(line))
                except ValueError:
                    pass
    return run
