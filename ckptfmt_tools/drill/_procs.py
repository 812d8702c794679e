"""Process plumbing for the drill: launching framework processes, watching them, tearing them down.

Nothing here imports jax or torch; every framework runs in a child process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ckptfmt.coord import free_port as free_port

__all__ = ["Proc", "launch", "free_port", "wait_all", "kill_all", "read_json", "reap_forked", "REPO_ROOT"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reap_forked(pids: dict[int, int], grace_s: float) -> bool:
    """Wait for every forked child in ``pids`` (pid -> rank). When one fails, give the others
    ``grace_s`` to report their own error, then SIGKILL them. True if any child failed."""
    failed = False
    while pids:
        pid, status = os.waitpid(-1, 0)
        pids.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            time.sleep(grace_s)
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return failed


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    t_launch: float
    stdout: str
    stderr: str
    exit_seen: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.exit_seen is None:
            self.exit_seen = time.time()
        return rc

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.stderr, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


def launch(name: str, argv: list[str], *, env: dict[str, str], logdir: str) -> Proc:
    """Start ``python argv...`` with its output in ``logdir/name.{out,err}``."""
    full_env = dict(os.environ)
    full_env.update(env)
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    out, err = os.path.join(logdir, f"{name}.out"), os.path.join(logdir, f"{name}.err")
    t = time.time()
    with open(out, "wb") as fo, open(err, "wb") as fe:
        p = subprocess.Popen([sys.executable, *argv], env=full_env, cwd=REPO_ROOT, stdout=fo, stderr=fe,
                             start_new_session=True)
    return Proc(name, p, t, out, err)


def kill_all(procs: list[Proc]) -> None:
    """SIGKILL every process (and its session) that is still running, then reap it."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    p.popen.kill()
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        p.poll()


def wait_all(procs: list[Proc], timeout_s: float, *, result_path: str | None = None,
             exit_grace_s: float = 15.0) -> list[str]:
    """Wait for every process; returns error descriptions (empty when all exited 0).

    On the first failure or at the deadline, the rest are killed: a job whose rank died is over.
    Once ``result_path`` exists the job's work is done: processes still running ``exit_grace_s``
    later (a framework's shutdown that does not return) are killed, and a non-zero exit after
    the result is recorded in ``Proc.extra["after_result"]`` instead of failing the job.
    """
    deadline = time.monotonic() + timeout_s
    t_result: float | None = None
    while True:
        if t_result is None and result_path and os.path.exists(result_path):
            t_result = time.monotonic()
        running = [p for p in procs if p.poll() is None]
        failed = [p for p in procs if p.popen.returncode not in (None, 0)]
        if failed and t_result is None:
            errors = [f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}" for p in failed]
            kill_all(procs)
            return errors
        if not running:
            for p in failed:
                p.extra["after_result"] = f"exited {p.popen.returncode} after writing the result"
            return []
        if t_result is not None and time.monotonic() - t_result > exit_grace_s:
            for p in running:
                p.extra["after_result"] = f"still running {exit_grace_s:.0f} s after the result; killed"
            kill_all(procs)
            return []
        if time.monotonic() > deadline:
            kill_all(procs)
            return [f"{p.name} did not finish within {timeout_s:.0f} s:\n{p.tail()}" for p in running]
        time.sleep(0.02)


def read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
