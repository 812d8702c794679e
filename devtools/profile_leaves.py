"""Per-leaf costs of a save, a restore, a manifest parse and a safetensors import, as one Markdown table.

usage: python -m devtools.profile_leaves [--llama-size 8MiB] [--moe-leaves 2000] [--import-tensors 10000]
           [--saves 3] [--restores 3] [--devices 8] [--states llama,moe] [--dir DIR]

Each state (``ckptfmt_tools.bench.states``: the 874-leaf Llama-style state at ``--llama-size``, the
per-expert MoE state of about ``--moe-leaves`` leaves) runs in a fresh process on ``--devices`` JAX
CPU devices, the (data = 2, model = N/2) mesh of the bench. That process:

1. saves the state ``--saves`` times into one repository (steps 1, 2, ...; the state changes
   before each save, by a jitted update of every leaf, as in training), each through
   ``bridges.jax.save(..., blocking=False)``: ``stage`` is the call (the caller's thread), the
   other phases are the save's own (``SaveOptions.timings``: plan, write, fsync, verify, state,
   ack, commit; commit holds the manifest's build, its serialisation, its check and its create),
   ``total`` from the call to the commit; the median over the saves after the first (the first
   is reported on its own line: a job's first save pays one-time costs);
2. restores the last step ``--restores`` times onto the same mesh through ``bridges.jax.restore``
   (page cache warm: leaves, not bytes, are measured): open, plan, the reader's read and verify,
   building the arrays, total; the median;
3. parses the last step's manifest (``ckptfmt.parse_manifest`` of its bytes) and serialises it
   again (``Manifest.to_bytes``), median of 5 each.

The import runs in a fresh process without JAX: a safetensors file of ``--import-tensors`` empty
float32 tensors (shape (0,)), imported with ``ckptfmt.interop.import_safetensors``; its wall time
and the process's peak RSS rise (``ru_maxrss`` over the RSS before the call).

Prints one Markdown table, microseconds per leaf (per tensor for the import) and milliseconds in
all, plus the import's bytes of peak RSS per tensor. docs/profile-save.md keeps the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time
from typing import Any

SAVE_PHASES = ("stage", "plan", "write", "fsync", "verify", "state", "ack", "commit", "total")
RESTORE_PHASES = ("open", "plan", "read", "verify", "build", "total")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _median(rows: list[dict[str, float]], key: str) -> float | None:
    xs = [r[key] for r in rows if key in r]
    return statistics.median(xs) if xs else None


def state_child(params: dict) -> dict:
    """Child task: save, restore and parse one recipe state (see the module docstring)."""
    import jax

    import bridges.jax as bj
    from ckptfmt import Repository, SaveOptions, parse_manifest
    from ckptfmt.layout import manifest_key
    from ckptfmt_tools.bench.jaxstate import state_target
    from ckptfmt_tools.bench.states import Recipe
    from ckptfmt_tools.bench.tailstep_state import StateTrainer

    r, devices, url = Recipe.from_json(params["layout"]), params["devices"], params["url"]
    shutil.rmtree(url, ignore_errors=True)
    trainer = StateTrainer(r, devices)
    repo = Repository(url)
    saves: list[dict[str, float]] = []
    for k in range(1, params["saves"] + 1):
        trainer.advance()
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        handle = bj.save(repo, trainer.state(), step=k, blocking=False, options=SaveOptions(timings=timings))
        t1 = time.perf_counter()
        handle.result()
        t2 = time.perf_counter()
        saves.append({"stage": t1 - t0, **timings, "total": t2 - t0})
    target = state_target(r, devices)
    restores: list[dict[str, float]] = []
    for _ in range(params["restores"]):
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        out = bj.restore(url, target, step=params["saves"], stats=stats)
        jax.block_until_ready(jax.tree.leaves(out))
        total = time.perf_counter() - t0
        del out
        rd = (stats.get("reader") or {}).get("timings") or {}
        restores.append({"open": stats["open_s"], "plan": stats["plan_s"], "read": rd.get("read", 0.0),
                         "verify": rd.get("verify", 0.0), "build": stats["build_s"], "total": total,
                         "read_phase": stats["read_s"]})
    with open(os.path.join(url, manifest_key(params["saves"])), "rb") as f:
        data = f.read()
    parse, dump = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        m = parse_manifest(bytes(data))
        parse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.to_bytes()
        dump.append(time.perf_counter() - t0)
    objects = sum(len(files) for _, _, files in os.walk(url))
    shutil.rmtree(url, ignore_errors=True)
    return {"leaves": len(r.leaves), "bytes": r.nbytes, "describe": r.describe, "saves": saves, "restores": restores,
            "manifest_bytes": len(data), "parse_s": statistics.median(parse), "serialise_s": statistics.median(dump),
            "files_in_repository": objects}


def empty_safetensors(path: str, n: int) -> None:
    """A safetensors file of ``n`` empty float32 tensors ``t0`` ... (shape (0,), no data)."""
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)


def import_child(params: dict) -> dict:
    """Child task: import ``n`` empty safetensors tensors; wall time and peak RSS rise."""
    from ckptfmt.interop import import_safetensors

    root = params["dir"]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    src = os.path.join(root, "empty.safetensors")
    empty_safetensors(src, params["n"])
    rss0 = _rss()
    t0 = time.perf_counter()
    report = import_safetensors(src, os.path.join(root, "repo"), max_tensors=max(params["n"], 1))
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    shutil.rmtree(root, ignore_errors=True)
    return {"n": params["n"], "tensors": report.tensors, "wall_s": wall, "rss_before": rss0,
            "peak_rise": max(0, peak - rss0)}


def _cell(seconds: float | None, n: int) -> str:
    if seconds is None:
        return "- | -"
    return f"{seconds / n * 1e6:,.1f} | {seconds * 1e3:,.1f}"


def table(results: dict[str, dict], imported: dict | None) -> str:
    """The Markdown table of every state's phases: microseconds per leaf and milliseconds in all."""
    names = list(results)
    if not names:
        return table_import(imported)
    head = "| phase | " + " | ".join(f"{k}: µs/leaf | {k}: ms" for k in names) + " |"
    out = [head, "|---|" + "---|---|" * len(names)]

    def row(label: str, get: Any) -> None:
        out.append(f"| {label} | " + " | ".join(_cell(get(results[k]), results[k]["leaves"]) for k in names) + " |")

    for p in SAVE_PHASES:
        row(f"save: {p}" + (" (caller)" if p == "stage" else " (build, check, create the manifest)" if p == "commit" else ""),
            lambda x, p=p: _median(x["saves"][1:] or x["saves"], p))
    row("save: total of the first save", lambda x: x["saves"][0]["total"])
    for p in RESTORE_PHASES:
        row(f"restore: {p}", lambda x, p=p: _median(x["restores"], p))
    row("manifest: parse", lambda x: x["parse_s"])
    row("manifest: serialise", lambda x: x["serialise_s"])
    lines = ["", " ".join(f"{k}: {v['describe']}, {v['bytes'] / 2**20:,.1f} MiB, {v['leaves']:,} leaves, manifest "
                          f"{v['manifest_bytes'] / 1e6:,.2f} MB, {v['files_in_repository']:,} files in the repository "
                          f"after {len(v['saves'])} saves." for k, v in results.items())]
    return "\n".join(out + lines + ["", table_import(imported)] if imported else out + lines)


def table_import(imported: dict | None) -> str:
    """The import's line: wall time and peak RSS rise, in all and per tensor."""
    if not imported:
        return ""
    n = imported["n"]
    return "\n".join(["| import (empty safetensors tensors) | tensors | µs/tensor | s | peak RSS rise MB | KB/tensor |",
                      "|---|---|---|---|---|---|",
                      f"| `import_safetensors` | {n:,} | {imported['wall_s'] / n * 1e6:,.1f} | {imported['wall_s']:,.2f} | "
                      f"{imported['peak_rise'] / 1e6:,.1f} | {imported['peak_rise'] / n / 1e3:,.2f} |"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.profile_leaves", description=__doc__.splitlines()[0])
    p.add_argument("--llama-size", default="8MiB", help="the Llama-style state's bytes (874 leaves; default 8MiB)")
    p.add_argument("--moe-leaves", type=int, default=2000, help="the MoE state's leaves, about (default 2000)")
    p.add_argument("--import-tensors", type=int, default=10_000, help="empty tensors to import (default 10000; 0: none)")
    p.add_argument("--states", default="llama,moe", help="comma list among llama,moe, or none (the import only)")
    p.add_argument("--saves", type=int, default=3, help="saves per state (default 3; the first reported apart)")
    p.add_argument("--restores", type=int, default=3, help="restores per state (default 3)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the raw figures to this file")
    a = p.parse_args(argv)
    from ckptfmt_tools.bench.args import parse_size
    from ckptfmt_tools.bench.child import run_child
    from ckptfmt_tools.bench.jaxstate import xla_env
    from ckptfmt_tools.bench.states import llama, moe

    root = a.dir or tempfile.mkdtemp(prefix="ckptfmt-leaves-")
    recipes = {"llama": lambda: llama(parse_size(a.llama_size)), "moe": lambda: moe(a.moe_leaves)}
    results: dict[str, dict] = {}
    for name in [s.strip() for s in a.states.split(",") if s.strip() and s.strip() != "none"]:
        r = recipes[name]()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {r.describe}", file=sys.stderr, flush=True)
        results[f"{name} ({len(r.leaves):,} leaves)"] = run_child(
            "devtools.profile_leaves:state_child", {"layout": r.to_json(), "devices": a.devices, "saves": a.saves,
                                                    "restores": a.restores, "url": os.path.join(root, name)},
            env=xla_env(a.devices), timeout_s=7200)
    imported = None
    if a.import_tensors:
        print(f"[{time.strftime('%H:%M:%S')}] import of {a.import_tensors:,} empty tensors", file=sys.stderr, flush=True)
        imported = run_child("devtools.profile_leaves:import_child", {"n": a.import_tensors, "dir": os.path.join(root, "import")},
                             timeout_s=7200)
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(table(results, imported))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"states": results, "import": imported}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
