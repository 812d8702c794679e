"""The training cadence for Orbax and torch DCP, and the side-by-side run of all three systems.

The same JAX loop (:class:`.tailstep.Trainer`), state (32 MiB: params and momentum), steps and
cadence as ckptfmt's run (:func:`.tailstep.run`); only the save differs:

- Orbax: ``orbax.checkpoint.CheckpointManager`` with ``enable_async_checkpointing=True``,
  ``max_to_keep=2`` and the others' cadence (``should_save_fn``: every ``every``-th step; by
  default Orbax also saves the first step), called with ``StandardSave(state)`` every step (its
  cadence decides, as ckptfmt's manager does); finished when ``is_saving_in_progress()`` is False.
- DCP: ``torch.distributed.checkpoint.async_save`` (``no_dist=True``, ``FileSystemWriter`` with
  ``sync_files=True``: durable, like the others) of a torch view (``torch.from_numpy``, no copy)
  of the same state's host buffers, each step due under the cadence; the next save first waits
  for the one in flight (what ckptfmt's and Orbax's managers do); the checkpoint two saves old is
  removed by the save's done callback (off the training thread, like the managers' retention).
  The loop is JAX's for all three, so the training cost is the same program; DCP pays its own
  staging copy (to CPU memory, in the caller) inside the step.

:func:`compare` runs each system in a fresh process, the order rotated per repetition, and
:func:`table` prints the figures side by side. ``python -m ckptfmt_tools.bench.tailstep_peers``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from .child import ChildFailed, run_child
from .jaxstate import xla_env
from .tailstep import Saves, Trainer, cadence

SYSTEMS = ("ckptfmt", "orbax", "dcp")
_TASKS = {"ckptfmt": "ckptfmt_tools.bench.tailstep:run", "orbax": "ckptfmt_tools.bench.tailstep_peers:orbax_run",
          "dcp": "ckptfmt_tools.bench.tailstep_peers:dcp_run"}


class _Orbax:
    def __init__(self, path: str, every: int, saves: Saves) -> None:
        import orbax.checkpoint as ocp

        self.ocp, self.saves = ocp, saves
        self.mgr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=True,
            should_save_fn=lambda step, _last: step % every == 0))  # the same steps as the others

    def step(self, t: int, state: dict) -> None:
        t0 = time.perf_counter()
        if self.mgr.save(t, args=self.ocp.args.StandardSave(state)):
            self.saves.start(t, t0)

    def poll(self, t: int) -> None:
        if self.saves.started and not self.mgr.is_saving_in_progress():
            self.saves.seen_done(self.saves.started[-1][0])

    def close(self) -> None:
        self.mgr.wait_until_finished()
        self.poll(0)
        self.mgr.close()


def torch_view(state: dict) -> dict:
    """DCP's state dict of a JAX state: each leaf's key path to a torch view (no copy) of its host buffer
    (a sharded leaf is gathered into one host array first; bfloat16 is viewed through its bits)."""
    import jax
    import numpy as np
    import torch

    def view(a: Any) -> Any:
        h = np.asarray(a)
        if h.dtype.name == "bfloat16":  # numpy has no bfloat16 of its own: torch takes the bits
            return torch.from_numpy(h.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(h)

    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(k): view(a) for k, a in flat}


class _Dcp:
    def __init__(self, path: str, every: int, saves: Saves) -> None:
        import torch.distributed.checkpoint as dcp  # torch too: imported before the loop, not in a step

        self.dcp = dcp
        self.path, self.every, self.saves = path, every, saves
        self.future: Any = None
        self.kept: list[str] = []

    def step(self, t: int, state: dict) -> None:
        if t % self.every:
            return
        t0 = time.perf_counter()
        waited = 0.0
        if self.future is not None:  # one save in flight, as the managers do
            self.future.result()
            waited = time.perf_counter() - t0
        target = os.path.join(self.path, f"step_{t}")
        with warnings.catch_warnings():  # jax's host buffers are read-only; DCP's stager copies them
            warnings.simplefilter("ignore", UserWarning)
            self.future = self.dcp.async_save(torch_view(state), storage_writer=self.dcp.FileSystemWriter(
                target, sync_files=True), no_dist=True)
        self.saves.start(t, t0, waited)
        self.kept.append(target)
        if len(self.kept) > 2:  # keep_last=2, removed off the training thread once this save is done
            old = self.kept.pop(0)
            self.future.add_done_callback(lambda _f, old=old: shutil.rmtree(old, ignore_errors=True))

    def poll(self, t: int) -> None:
        if self.future is not None and self.future.done():
            self.saves.seen_done(self.saves.started[-1][0])

    def close(self) -> None:
        if self.future is not None:
            self.future.result()
        self.poll(0)


def _peer_run(params: dict, make: Any, system: str, mode: str) -> dict:
    path = params["path"]
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    trainer = Trainer(params)
    saves = Saves()
    out = cadence(trainer, make(path, params["every"], saves), saves, params["steps"])
    shutil.rmtree(path, ignore_errors=True)
    return out | {"system": system, "every": params["every"], "save_mode": mode, "notes": []}


def orbax_run(params: dict) -> dict:
    """Child task: Orbax's async CheckpointManager under the cadence (``steps``, ``every``, ``path``)."""
    return _peer_run(params, _Orbax, "orbax", "async (orbax CheckpointManager, max_to_keep=2)")


def dcp_run(params: dict) -> dict:
    """Child task: DCP's async_save under the cadence (``steps``, ``every``, ``path``)."""
    return _peer_run(params, _Dcp, "dcp", "async (dcp.async_save, FileSystemWriter sync_files=True, keep 2)")


def compare(systems: tuple[str, ...], *, steps: int = 200, every: int = 10, repetitions: int = 1,
            storage: str | None = None, options: dict | None = None, log: Any = print) -> list[dict]:
    """Each system's cadence run in a fresh process, ``repetitions`` times, the order rotated each
    repetition; ckptfmt's saves take ``options`` (SaveOptions keyword arguments). Rows with
    ``rep`` and ``place``; a failed child gives a row with ``error``."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"tail-step systems must be among {SYSTEMS}, got {list(systems)}")
    root = storage or tempfile.mkdtemp(prefix="ckptfmt-tailstep-")
    rows = []
    for rep in range(repetitions):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for place, system in enumerate(order):
            params = {"steps": steps, "every": every, "path": os.path.join(root, system),
                      "url": os.path.join(root, system), "options": options or {}}
            try:
                row = run_child(_TASKS[system], params, env=xla_env(1))
            except ChildFailed as e:
                row = {"system": system, "error": str(e).splitlines()[0]}
            rows.append(row | {"rep": rep, "place": place})
            if log:
                log(row_line(rows[-1]))
    if storage is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def row_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['system']} | {r.get('rep', '-')} | failed: {r['error']} |"
    b, s = r["baseline"], r["with_saves"]
    return (f"| {r['system']} | {r.get('rep', '-')} | {b['p50_ms']:.2f} -> {s['p50_ms']:.2f} ({r['p50_ratio']:.3f}x) | "
            f"{b['p99_ms']:.2f} -> {s['p99_ms']:.2f} ({r['p99_ratio']:.3f}x) | {r['blocked_ms_median']:.2f} / "
            f"{r['blocked_ms_max']:.2f} | {r['duration_ms_median']:.0f} | {r.get('save_cpu_ms', 0):.0f} | "
            f"{r['committed']}/{r['saves']} |")


HEADER = ["| system | rep | step p50 ms: no saves -> saves (ratio) | step p99 ms: no saves -> saves (ratio) | "
          "blocked per save ms: median / max | save duration ms (median, call to seen committed) | "
          "CPU ms per save | committed |",
          "|---|---|---|---|---|---|---|---|"]


def table(rows: list[dict]) -> str:
    """Every row, then per system the median (and range) of the p50 and p99 ratios."""
    out = list(HEADER) + [row_line(r) for r in rows]
    out += ["", "| system | runs | p50 ratio median (range) | p99 ratio median (range) | blocked ms median | "
            "duration ms median | CPU ms per save median (range) |", "|---|---|---|---|---|---|---|"]
    for system in dict.fromkeys(r["system"] for r in rows):
        ok = [r for r in rows if r["system"] == system and "error" not in r]
        if not ok:
            continue
        p50, p99 = [r["p50_ratio"] for r in ok], [r["p99_ratio"] for r in ok]
        cpu = [r.get("save_cpu_ms", 0.0) for r in ok]
        out.append(f"| {system} | {len(ok)} | {statistics.median(p50):.3f} ({min(p50):.3f}-{max(p50):.3f}) | "
                   f"{statistics.median(p99):.3f} ({min(p99):.3f}-{max(p99):.3f}) | "
                   f"{statistics.median(r['blocked_ms_median'] for r in ok):.2f} | "
                   f"{statistics.median(r['duration_ms_median'] for r in ok):.0f} | "
                   f"{statistics.median(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptfmt_tools.bench.tailstep_peers", description=__doc__.splitlines()[0])
    p.add_argument("--tailstep-systems", "--systems", dest="systems", default=",".join(SYSTEMS),
                   help="comma-separated, among ckptfmt,orbax,dcp (default all three)")
    p.add_argument("--steps", type=int, default=200, help="training steps per loop (default 200)")
    p.add_argument("--every", type=int, default=10, help="save every N steps (default 10)")
    p.add_argument("-r", "--repetitions", type=int, default=1, help="runs of each system (order rotated)")
    p.add_argument("--storage", default=None, help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a SaveOptions field for ckptfmt's saves (JSON value), e.g. max_write_bytes_per_s=2e8")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in a.option)}
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    print("\n".join(HEADER))
    rows = compare(systems, steps=a.steps, every=a.every, repetitions=a.repetitions, storage=a.storage, options=options)
    print()
    print(table(rows).split("\n\n", 1)[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
