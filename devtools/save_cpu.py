"""The CPU a save takes from training, without a training loop around it: ckptfmt against torch DCP.

Under the training cadence (:mod:`.tailstep_peers`) a save's CPU slows the steps it overlaps, but
that figure is the loop's CPU less the baseline's, and it swings from run to run. This tool
measures the save alone: in a fresh process per system, the cadence's state (``tailstep``'s
32 MiB: params and momentum) is saved ``saves`` times, synchronously, one training step before
each save (so that every save writes changed data, as a cadence does; the step is not measured).
Per save it takes the process's CPU time (user and system, every thread) from the save's call to
the end of a pause after it (so that work a save leaves to a background thread is counted too),
the caller thread's CPU during the call, and the call's wall time. Systems:

- ``ckptfmt``: ``bridges.jax.CheckpointManager(async_save=False, keep_last=2)``: the write, the
  commit, and retention (the newest step verified, the step two saves old deleted);
- ``ckptfmt-nokeep``: the same with ``keep_last=None``: no retention;
- ``dcp``: ``torch.distributed.checkpoint.save`` (``no_dist=True``, ``FileSystemWriter`` with
  ``sync_files=True``) of a torch view of the same host buffers, and the directory two saves old
  removed after it (``shutil.rmtree``): DCP's save with the same retention, unverified.

``python -m devtools.save_cpu [--saves N] [-r R]`` (docs/profile-save.md section 12).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from ckptfmt_tools.bench.child import ChildFailed, run_child
from ckptfmt_tools.bench.jaxstate import xla_env
from ckptfmt_tools.bench.tailstep_peers import torch_view

SYSTEMS = ("ckptfmt", "ckptfmt-nokeep", "dcp")


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class _Dcp:
    def __init__(self, root: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.root = dcp, root
        self.kept: list[str] = []

    def save(self, step: int, state: dict) -> None:
        view = torch_view(state)
        target = os.path.join(self.root, f"step_{step}")
        with warnings.catch_warnings():  # jax's host buffers are read-only; DCP only reads them
            warnings.simplefilter("ignore", UserWarning)
            self.dcp.save(view, storage_writer=self.dcp.FileSystemWriter(target, sync_files=True), no_dist=True)
        self.kept.append(target)
        if len(self.kept) > 2:
            shutil.rmtree(self.kept.pop(0))

    def left(self) -> int:
        return len(os.listdir(self.root))

    def close(self) -> None:
        pass


class _Ours:
    def __init__(self, root: str, keep: int | None) -> None:
        import bridges.jax as bridge

        self.mgr = bridge.CheckpointManager(root, async_save=False, keep_last=keep)

    def save(self, step: int, state: dict) -> None:
        self.mgr.save(step, state, force=True)

    def left(self) -> int:
        return len(self.mgr.all_steps())

    def close(self) -> None:
        self.mgr.close()


def measure(params: dict) -> dict:
    """Child task: ``params`` ``system``, ``saves``, ``path``, ``pause_s``; optional model sizes
    (``tailstep.MODEL``). Per-save lists in seconds (``user`` and ``sys``: the process's CPU;
    ``caller``: the calling thread's CPU; ``wall``: the call), and the saves ``left`` at the end."""
    from ckptfmt_tools.bench.tailstep import Trainer

    system, root = params["system"], params["path"]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    trainer = Trainer(params)
    saver: Any = _Dcp(root) if system == "dcp" else _Ours(root, None if system == "ckptfmt-nokeep" else 2)
    rows: dict[str, list[float]] = {"user": [], "sys": [], "caller": [], "wall": []}
    try:
        for k in range(int(params["saves"]) + 1):  # save 0 is a warm-up: its figures are dropped
            trainer.timed(None, k, 1)  # one training step, not measured
            state = trainer.state()
            (u0, s0), c0, w0 = _cpu(), time.thread_time(), time.perf_counter()
            saver.save(k, state)
            wall, caller = time.perf_counter() - w0, time.thread_time() - c0
            time.sleep(float(params["pause_s"]))
            u1, s1 = _cpu()
            if k:
                for name, v in (("user", u1 - u0), ("sys", s1 - s0), ("caller", caller), ("wall", wall)):
                    rows[name].append(v)
        left = saver.left()
    finally:
        saver.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"system": system, "state_bytes": trainer.state_bytes, "left": left} | rows


def compare(systems: tuple[str, ...] = SYSTEMS, *, saves: int = 20, repetitions: int = 1, pause_s: float = 0.1,
            storage: str | None = None, model: dict | None = None, log: Any = print) -> list[dict]:
    """Each system in a fresh process (one JAX CPU device), ``repetitions`` times, the order
    rotated each repetition. Rows as :func:`measure` returns them, with ``rep``; a failed child
    gives a row with ``error``."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"systems must be among {SYSTEMS}, got {list(systems)}")
    root = storage or tempfile.mkdtemp(prefix="ckptfmt-savecpu-")
    rows = []
    try:
        for rep in range(repetitions):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for system in order:
                params = {"system": system, "saves": saves, "pause_s": pause_s,
                          "path": os.path.join(root, system)} | (model or {})
                try:
                    row = run_child("devtools.save_cpu:measure", params, env=xla_env(1))
                except ChildFailed as e:
                    row = {"system": system, "error": str(e).splitlines()[0]}
                rows.append(row | {"rep": rep})
                if log:
                    log(line(rows[-1]))
    finally:
        if storage is None:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def _ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.1f}"


HEADER = ("| system | rep | CPU ms per save (median): total = user + system | caller thread CPU ms | wall ms | "
          "saves left |\n|---|---|---|---|---|---|")


def line(r: dict) -> str:
    """One row of the table: medians over the row's saves."""
    if "error" in r:
        return f"| {r['system']} | {r.get('rep', '-')} | failed: {r['error']} | | | |"
    total = [u + s for u, s in zip(r["user"], r["sys"])]
    return (f"| {r['system']} | {r.get('rep', '-')} | {_ms(total)} = {_ms(r['user'])} + {_ms(r['sys'])} | "
            f"{_ms(r['caller'])} | {_ms(r['wall'])} | {r['left']} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.save_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, among {','.join(SYSTEMS)}")
    p.add_argument("--saves", type=int, default=20, help="measured saves per run (default 20)")
    p.add_argument("-r", "--repetitions", type=int, default=1, help="runs of each system (order rotated)")
    p.add_argument("--pause", type=float, default=0.1, help="seconds after each save, inside its CPU window")
    p.add_argument("--storage", default=None, help="directory for the checkpoints (default: a temporary one)")
    a = p.parse_args(argv)
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    print(HEADER)
    rows = compare(systems, saves=a.saves, repetitions=a.repetitions, pause_s=a.pause, storage=a.storage)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
