"""The training cadence on a recipe state (``ckptfmt bench --state llama|moe``): the caller's
blocked time per asynchronous save, beside the time to copy the state's bytes to host memory.

The loop (:class:`StateTrainer`) holds the recipe's state as JAX arrays on the bench's (data,
model) mesh (the placements of the rotated harness, :mod:`.jaxstate`) and runs one jitted update
of every leaf per step (floating leaves ``+ 1e-3``, the count ``+ 1``), so each save sees new
values in new buffers. Every system saves through the savers of the 32 MiB cadence
(:mod:`.tailstep`, :mod:`.tailstep_peers`): ckptfmt's ``bridges.jax.CheckpointManager`` (async,
``keep_last=2``), Orbax's async ``CheckpointManager``, DCP's ``async_save`` (of whole host
arrays: :func:`.tailstep_peers.torch_view` gathers each sharded leaf, in the caller).

The interval is long enough that saves do not overlap: ``every`` steps, given, or chosen as
:data:`MARGIN` times a measured save time (the rotated harness's slowest median save, passed in
as ``save_s``; without it, one blocking ckptfmt save timed in the child) over the measured step
time. A row counts the saves that outlasted the interval anyway (``outlasted``).

Per save: the caller's blocked time (the save call's wall time in the step, any wait for the
previous save included), median, p90 and max. Beside it, in the same process, before and after
the loop: the host copy alone (:func:`host_copy`): ``np.array`` of every addressable shard of
replica 0 (the state's bytes, once; the shards enumerated beforehand), median of
:data:`COPY_REPEATS` each, on states the step has just made. ``blocked_over_copy`` is the ratio of
the two medians (issue 48's target: at most 2).

``--profile N`` (the command line only) runs ckptfmt's cadence with cProfile enabled around each
save call in the caller's thread, and prints the top N functions by cumulative time: what the
caller waits for. Its blocked times are inflated by the profiler; they are not a measurement.
``python -m ckptfmt_tools.bench.tailstep_state --help``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .child import ChildFailed, run_child
from .jaxstate import xla_env
from .states import STATES, Recipe, recipe
from .tailstep import Saver, Saves, Trainer, _percentile, cadence

SYSTEMS = ("ckptfmt", "orbax", "dcp")
MARGIN = 2.0  # interval / measured save time
DEFAULT_SAVES = 10
COPY_REPEATS = 5
_TASK = "ckptfmt_tools.bench.tailstep_state:run"


class StateTrainer(Trainer):
    """A recipe's state on ``devices`` JAX CPU devices, and one jitted update of every leaf per step."""

    def __init__(self, r: Recipe, devices: int) -> None:  # not Trainer's: that builds the MLP
        import jax
        import jax.numpy as jnp

        from .jaxstate import make_recipe_state

        def bump(a: Any) -> Any:
            return a + jnp.asarray(1 if jnp.issubdtype(a.dtype, jnp.integer) else 1e-3, a.dtype)

        self._state = make_recipe_state(r, devices)
        shardings = jax.tree.map(lambda a: a.sharding, self._state)
        self._update = jax.jit(lambda tree: jax.tree.map(bump, tree), out_shardings=shardings)
        self.model = {"recipe": r.name, "leaves": len(r.leaves), "devices": devices, "describe": r.describe}
        self.state_bytes = r.nbytes
        self.advance()  # compile

    def state(self) -> dict:
        return self._state

    def advance(self) -> None:
        import jax

        self._state = self._update(self._state)
        jax.block_until_ready(self._state)


def host_copy(trainer: StateTrainer, repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """The time to copy the state's bytes to host memory alone: ``np.array`` of every addressable
    shard of replica 0 (each distinct box once), the shard enumeration included; the same copies of
    shards enumerated beforehand (``memcpy``); and ``np.asarray`` of each (``view``: zero-copy where
    numpy can take the buffer, a copy through jax's ``_value`` where it cannot, e.g. bfloat16).
    Each is timed on a state the step has just made (untimed), since jax caches an array's host
    value on the array. Seconds per repetition, and their medians (ms)."""
    import jax
    import numpy as np

    def shards() -> list[Any]:
        return [s.data for a in jax.tree.leaves(trainer.state()) for s in a.addressable_shards if s.replica_id == 0]

    copy, memcpy, view = [], [], []
    nbytes = count = 0
    for _ in range(repeats):
        trainer.advance()
        t0 = time.perf_counter()
        out = [np.array(d) for d in shards()]
        copy.append(time.perf_counter() - t0)
        nbytes, count = sum(o.nbytes for o in out), len(out)
        del out
        trainer.advance()
        ready = shards()
        t0 = time.perf_counter()
        out = [np.array(d) for d in ready]
        memcpy.append(time.perf_counter() - t0)
        del out, ready
        trainer.advance()
        t0 = time.perf_counter()
        out = [np.asarray(d) for d in shards()]
        view.append(time.perf_counter() - t0)
        del out
    return {"copy_s": copy, "memcpy_s": memcpy, "view_s": view, "bytes": nbytes, "shards": count,
            "copy_ms_median": statistics.median(copy) * 1e3, "memcpy_ms_median": statistics.median(memcpy) * 1e3,
            "view_ms_median": statistics.median(view) * 1e3}


class _Profiled:
    """A saver whose save calls run under cProfile (the caller's thread only)."""

    def __init__(self, inner: Saver) -> None:
        self.inner, self.prof = inner, cProfile.Profile()

    def step(self, t: int, state: dict) -> None:
        self.prof.runcall(self.inner.step, t, state)

    def poll(self, t: int) -> None:
        self.inner.poll(t)

    def close(self) -> None:
        self.inner.close()

    def top(self, n: int) -> str:
        buf = io.StringIO()
        st = pstats.Stats(self.prof, stream=buf)
        st.sort_stats("cumulative").print_stats(n)
        st.sort_stats("tottime").print_stats(n)
        return buf.getvalue()


def _saver(system: str, path: str, every: int, saves: Saves) -> Saver:
    if system == "ckptfmt":
        from .tailstep import _Ours

        return _Ours(path, every, saves)
    from .tailstep_peers import _Dcp, _Orbax

    return {"orbax": _Orbax, "dcp": _Dcp}[system](path, every, saves)


def _blocking_save_s(state: Any, path: str) -> float:
    import bridges.jax as bridge

    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    bridge.save(path, state, step=0)
    out = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return out


def choose_every(save_s: float, step_s: float, margin: float = MARGIN) -> int:
    """Steps between saves so that the interval is ``margin`` times the save time (at least 2)."""
    return max(2, math.ceil(margin * save_s / max(step_s, 1e-6)))


def run(params: dict) -> dict:
    """Child task: one system's cadence on a recipe state. ``system``, ``layout`` (a recipe's
    JSON), ``devices``, ``path``; ``every`` or ``save_s`` (else a blocking ckptfmt save is
    timed here); ``saves`` (default :data:`DEFAULT_SAVES`); ``profile`` (top N, ckptfmt only)."""
    from .ours import clear_repository, local_path

    system, path, devices = params["system"], params["path"], params["devices"]
    r = Recipe.from_json(params["layout"])
    clear_repository(path)
    if local_path(path) is not None:
        os.makedirs(local_path(path), exist_ok=True)
    trainer = StateTrainer(r, devices)
    step_s = statistics.median(trainer.timed(None, 0, 20)[0])
    if params.get("every"):
        every, every_from = int(params["every"]), params.get("every_from") or "given"
    else:
        save_s = params.get("save_s")
        every_from = f"{MARGIN:g} x save time {save_s:.2f} s (the rotated harness's slowest median save)" if save_s else ""
        if not save_s:
            save_s = _blocking_save_s(trainer.state(), path.rstrip("/") + "-probe")
            every_from = f"{MARGIN:g} x a blocking ckptfmt save in this process, {save_s:.2f} s"
        every = choose_every(save_s, step_s)
    n_saves = int(params.get("saves") or DEFAULT_SAVES)
    steps = every * n_saves
    copy_before = host_copy(trainer)
    saves = Saves()
    saver: Saver = _saver(system, path, every, saves)
    profiled = _Profiled(saver) if params.get("profile") else None
    out = cadence(trainer, profiled or saver, saves, steps, baseline_steps=min(steps, 100))
    copy_after = host_copy(trainer)
    clear_repository(path)
    blocked = [b for _, _, b, _ in saves.started]
    interval_s = every * out["baseline"]["p50_ms"] / 1e3
    # The ratio's copy: the bytes' copies alone (shards enumerated beforehand), the stricter figure.
    copy_ms = statistics.median(copy_before["memcpy_s"] + copy_after["memcpy_s"]) * 1e3
    row = out | {
        "system": system, "every": every, "every_from": every_from, "interval_s": interval_s,
        "step_ms_probe": step_s * 1e3, "blocked_ms": [b * 1e3 for b in blocked],
        "blocked_ms_p90": _percentile(blocked, 90) * 1e3 if blocked else 0.0,
        "outlasted": sum(1 for d in saves.finished.values() if d > interval_s),
        "host_copy": {"before": copy_before, "after": copy_after}, "copy_ms_median": copy_ms,
        "copy_enumerated_ms_median": statistics.median(copy_before["copy_s"] + copy_after["copy_s"]) * 1e3,
        "asarray_ms_median": statistics.median(copy_before["view_s"] + copy_after["view_s"]) * 1e3,
        "copy_bytes": copy_before["bytes"], "copy_shards": copy_before["shards"],
        "blocked_over_copy": out["blocked_ms_median"] / copy_ms if copy_ms else None, "notes": []}
    if system == "ckptfmt":
        records = saver.mgr.history  # type: ignore[attr-defined]
        row["write_ms_median"] = statistics.median(x.write_s for x in records) * 1e3 if records else 0.0
        row["manager_blocked_ms_median"] = statistics.median(x.blocked_s for x in records) * 1e3 if records else 0.0
    if system == "dcp":
        row["notes"].append("DCP saves whole host arrays (no_dist): the caller gathers each sharded leaf")
    if profiled is not None:
        row["profile"] = profiled.top(int(params["profile"]))
        row["notes"].append("profiled: cProfile ran around every save call, so the blocked times are inflated")
    return row


def compare(systems: tuple[str, ...], layout: dict, *, devices: int = 8, save_s: float | None = None,
            every: int | None = None, saves: int = DEFAULT_SAVES, repetitions: int = 1, storage: str | None = None,
            url: str | None = None, profile: int = 0, log: Callable[[str], None] | None = print,
            timeout_s: float = 3600) -> list[dict]:
    """Each system's cadence on the recipe ``layout`` in a fresh process with ``devices`` CPU
    devices, ``repetitions`` times, the order rotated each repetition. ``storage``: a local
    directory for the checkpoints (default a temporary one); ``url``: ckptfmt's repository
    (default under ``storage``). Rows with ``rep`` and ``place``; a failed child gives a row
    with ``error``."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"cadence systems must be among {SYSTEMS}, got {list(systems)}")
    root = storage or tempfile.mkdtemp(prefix="ckptfmt-cadence-")
    rows = []
    every_from = None
    for rep in range(repetitions):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for place, system in enumerate(order):
            where = url if system == "ckptfmt" and url else os.path.join(root, system)
            params = {"system": system, "layout": layout, "devices": devices, "path": where, "save_s": save_s,
                      "every": every, "every_from": every_from, "saves": saves, "profile": profile if system == "ckptfmt" else 0}
            try:
                row = run_child(_TASK, params, env=xla_env(devices), timeout_s=timeout_s)
            except ChildFailed as e:
                row = {"system": system, "error": _last_error(str(e))}
            rows.append(row | {"rep": rep, "place": place})
            if every is None and "every" in row:  # the same interval for every system of the run
                every, save_s = row["every"], None
                every_from = f"N of {system}'s run: {row['every_from']}"
            if log:
                log(row_line(rows[-1]))
    if storage is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _last_error(text: str) -> str:
    """The exception line of a child's traceback (its last line that names an error), else its first line."""
    found = [x for x in text.splitlines() if "Error" in x or "Exception" in x]
    return (found[-1] if found else text.splitlines()[0] if text else "failed").strip()[:300]


HEADER = ["| system | rep | save every (steps; interval s) | saves (outlasted the interval) | caller blocked per save "
          "ms: median / p90 / max | host copy alone ms (median) | blocked / copy | save duration ms (median, call to "
          "seen committed) | step p50 ms: no saves -> saves |",
          "|---|---|---|---|---|---|---|---|---|"]


def row_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['system']} | {r.get('rep', '-')} | failed: {r['error']} |"
    ratio = r.get("blocked_over_copy")
    return (f"| {r['system']} | {r.get('rep', '-')} | {r['every']} ({r['interval_s']:.2f} s) | "
            f"{r['saves']} ({r['outlasted']}) | {r['blocked_ms_median']:.1f} / {r['blocked_ms_p90']:.1f} / "
            f"{r['blocked_ms_max']:.1f} | {r['copy_ms_median']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{r['duration_ms_median']:.0f} | {r['baseline']['p50_ms']:.1f} -> {r['with_saves']['p50_ms']:.1f} |")


def lines(rows: list[dict]) -> list[str]:
    """The report's lines: what ran, the table, and the host copy's parts (Markdown)."""
    ok = [r for r in rows if "error" not in r]
    head = ok[0] if ok else {}
    m = head.get("model", {})
    out = [f"Training cadence on the state ({m.get('describe', '-')}, {_mib(head.get('state_bytes'))} MiB on "
           f"{m.get('devices', '-')} devices): a jitted update of every leaf per step, an async save every N steps "
           f"({head.get('every_from') or 'N given'}); blocked = the save call's wall time in the step; host copy = "
           f"np.array of every addressable shard of replica 0, enumerated beforehand ({head.get('copy_shards', '-')} shards, "
           f"{_mib(head.get('copy_bytes'))} MiB), median of {2 * COPY_REPEATS} in the same process:", "",
           *HEADER, *(row_line(r) for r in rows)]
    for r in ok:
        out.append(f"  {r['system']} rep {r['rep']}: host copy {r['copy_ms_median']:.1f} ms (with the shards' "
                   f"enumeration, addressable_shards, {r['copy_enumerated_ms_median']:.1f} ms; np.asarray instead of "
                   f"np.array {r['asarray_ms_median']:.1f} ms); "
                   f"blocked per save (ms) " + ", ".join(f"{b:.0f}" for b in r["blocked_ms"])
                   + (f"; write to commit median {r['write_ms_median']:.0f} ms" if "write_ms_median" in r else ""))
        out += [f"  note: {x}" for x in r.get("notes", [])]
    return out


def _mib(x: Any) -> str:
    return f"{x / 2**20:,.0f}" if isinstance(x, (int, float)) else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptfmt_tools.bench.tailstep_state",
                                description=__doc__.splitlines()[0])
    p.add_argument("--state", choices=[s for s in STATES if s != "tensors16"], default="llama")
    p.add_argument("--size", default="1GiB", help="--state llama: bytes (default 1GiB)")
    p.add_argument("--layers", type=int, default=32, help="--state llama: layers (default 32: 874 leaves)")
    p.add_argument("--leaves", type=int, default=20_000, help="--state moe: leaves, about")
    p.add_argument("--devices", type=int, default=8, help="JAX CPU devices, a (2, N/2) mesh (default 8)")
    p.add_argument("--systems", default="ckptfmt", help="comma list among ckptfmt,orbax,dcp (default ckptfmt)")
    p.add_argument("--every", type=int, default=None, help="save every N steps (default: from --save-s or a timed save)")
    p.add_argument("--save-s", type=float, default=None, help="a measured save time: N = 2 x this / step time")
    p.add_argument("--saves", type=int, default=DEFAULT_SAVES, help=f"saves per run (default {DEFAULT_SAVES})")
    p.add_argument("-r", "--repetitions", type=int, default=1)
    p.add_argument("--storage", default=None, help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="ckptfmt: cProfile the caller's save calls, print the top N (blocked times inflated)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    a = p.parse_args(argv)
    from .args import parse_size

    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    r = recipe(a.state, size=parse_size(a.size), layers=a.layers, leaves=a.leaves)
    r.check_topologies((a.devices,))
    print("\n".join(HEADER))
    rows = compare(systems, r.to_json(), devices=a.devices, save_s=a.save_s, every=a.every, saves=a.saves,
                   repetitions=a.repetitions, storage=a.storage, profile=a.profile)
    print("\n".join(lines(rows)[len(HEADER) + 2 + len(rows):]))
    for row in rows:
        if row.get("profile"):
            print(f"\ncProfile of {row['system']}'s save calls (caller's thread), rep {row['rep']}:\n{row['profile']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in x for x in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
