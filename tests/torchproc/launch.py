"""Run a scenario on ``world`` torch ranks (gloo over TCP on localhost) and collect the results.

One zygote process (worker.py) imports torch once and forks the ranks. A rank that fails or a
run past ``timeout`` makes :func:`run_world` raise with every rank's log tail.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckptfmt.coord import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def run_world(scenario: str, world: int, workdir: Path, args: dict[str, Any] | None = None,
              timeout: float = 240.0, check: bool = True) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks; return each rank's result dict (index = rank).

    ``check=False``: a run whose ranks fail (a scenario that kills a rank) returns the results
    of the ranks that wrote one and None for the others; a timeout still raises."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{scenario}-w{world}"
    argfile = workdir / f"{tag}.args.json"
    argfile.write_text(json.dumps(dict(args or {}, workdir=str(workdir), tag=tag)))
    with open(workdir / f"{tag}-zygote.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(HERE / "worker.py"), scenario, str(argfile),
                                 str(world), str(free_port())], env=child_env(), cwd=str(REPO),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    if rc != 0 and (check or rc is None):
        tails = [f"zygote rc={rc} (None: timed out after {timeout}s)",
                 (workdir / f"{tag}-zygote.log").read_text(errors="replace")[-2000:]]
        for r in range(world):
            p = workdir / f"{tag}-rank{r}.log"
            text = p.read_text(errors="replace") if p.exists() else "<no log>"
            tails.append(f"--- rank {r} ---\n{text[-3000:]}")
        raise AssertionError(f"scenario {scenario!r} at world {world} failed:\n" + "\n".join(tails))
    paths = [workdir / f"{tag}-result-{r}.json" for r in range(world)]
    return [json.loads(p.read_text()) if check or p.exists() else None for p in paths]


def run_jax(script: Path, workdir: Path, processes: int = 2, timeout: float = 400.0) -> list[str]:
    """Run ``script PORT RANK WORKDIR`` as ``processes`` JAX processes (each sets its own
    ``XLA_FLAGS`` device count; with more than one, ``jax.distributed`` over localhost at PORT)
    and return their output (index = rank). AssertionError with every log tail when any fails."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(r), str(workdir)], env=child_env(),
                              cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(processes)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return logs
