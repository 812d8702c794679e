"""A save's host memory against its budget (``SaveOptions.max_staging_bytes``), and the caller's time.

In a fresh process per run, a state of ``--size`` bytes (``--tensors`` float32 tensors) is made and
a small save is done first (imports, writer threads, caches: not the save's own memory). Then the
process's peak RSS is reset (``/proc/self/clear_refs``, 5) and one asynchronous save of the state
is made through a checkpoint manager, with no budget and with ``size / --fraction``; the state is
changed in place right after ``save()`` returns, as a training step would (numpy, torch; a JAX
array cannot change, and a new state would be memory the save did not take). Per run: the peak RSS rise over
the RSS before the save (``VmHWM`` less ``VmRSS``), the caller's blocked time (the manager's
``blocked_s``), the time to the commit, and whether the committed step holds the state as it was
at the call. ``--framework``: ``numpy`` (the core manager), ``jax`` (``bridges.jax``, one CPU
device: there a host copy of a device array is a view of its buffer, so a save stages nothing, with
or without a budget) or ``torch`` (``bridges.torch``).

``python -m ckptfmt_tools.bench.staging [--size 512MiB] [--fraction 8] [--framework numpy] [-r 3]``
prints one line per run and a JSON summary (Linux only: it reads /proc).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["measure", "main"]

#: The target of issue 50: the rise stays within the budget plus this.
MARGIN_BYTES = 64 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _state(framework: str, size: int, tensors: int, value: float) -> dict[str, Any]:
    import numpy as np

    rows = max(1, size // tensors // (4 * 1024))
    if framework == "jax":  # made on the device, as a training step makes them
        import jax
        import jax.numpy as jnp
        return jax.block_until_ready({f"t{i:03d}": jnp.full((rows, 1024), value + i, jnp.float32)
                                      for i in range(tensors)})
    arrays = {f"t{i:03d}": np.full((rows, 1024), value + i, np.float32) for i in range(tensors)}
    if framework == "torch":
        import torch
        return {k: torch.from_numpy(a) for k, a in arrays.items()}
    return arrays


def _manager(framework: str, url: str, budget: int | None) -> Any:
    from ckptfmt import SaveOptions

    if framework == "jax":
        from bridges.jax import CheckpointManager
    elif framework == "torch":
        from bridges.torch import CheckpointManager
    else:
        from ckptfmt.manager import CheckpointManager
    return CheckpointManager(url, options=SaveOptions(max_staging_bytes=budget))


def _first_value(framework: str, url: str, step: int, key: str) -> float:
    import numpy as np

    from ckptfmt import Box, Repository

    ckpt = Repository(url).open(step)
    shape = tuple(ckpt.tensor(key).shape)
    return float(np.asarray(ckpt.read(key, Box((0,) * len(shape), (1,) * len(shape)))).ravel()[0])


def child(framework: str, size: int, tensors: int, budget: int | None, url: str) -> dict[str, Any]:
    """One measured save in this process (see the module docstring)."""
    warm = _manager(framework, url + "-warm", budget)
    warm.save(1, _state(framework, 1 << 20, 4, 0.0), force=True)
    warm.close()
    state = _state(framework, size, tensors, 1.0)
    nbytes = sum(int(getattr(a, "nbytes", 0)) for a in state.values())
    m = _manager(framework, url, budget)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _status("VmRSS")
    t0 = time.perf_counter()
    m.save(1, state, force=True)
    returned = time.perf_counter() - t0
    if framework == "torch":
        for a in state.values():
            a.add_(1000.0)  # the training step changes the arrays in place
    elif framework == "numpy":
        for a in state.values():
            a += 1000.0
    rec = m.wait()
    total = time.perf_counter() - t0
    peak = _status("VmHWM")
    m.close()
    intact = _first_value(framework, url, 1, "t000") == 1.0 and _first_value(framework, url, 1, f"t{tensors - 1:03d}") \
        == 1.0 + tensors - 1
    return {"framework": framework, "state_bytes": nbytes, "budget": budget, "rss_rise": peak - before,
            "blocked_s": rec.blocked_s, "returned_s": returned, "commit_s": total, "intact": intact,
            "committed": rec.committed}


def measure(framework: str, size: int, tensors: int, budget: int | None, workdir: str, tag: str = "") -> dict[str, Any]:
    """One run in a fresh process; its figures."""
    url = os.path.join(workdir, f"repo-{framework}-{budget}-{tag}")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "ckptfmt_tools.bench.staging", "--child", "--framework", framework, "--size",
           str(size), "--tensors", str(tensors), "--budget", str(budget or 0), "--url", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"staging child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from .args import parse_size

    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.bench.staging", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=512 << 20, help="state bytes (default 512MiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64)")
    ap.add_argument("--fraction", type=int, default=8, help="the budget is size / fraction (default 8)")
    ap.add_argument("--framework", choices=("numpy", "jax", "torch"), default="numpy")
    ap.add_argument("--repetitions", "-r", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the repositories go (default: a temporary directory)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.framework, args.size, args.tensors, args.budget or None, args.url)))
        return 0
    budget = args.size // args.fraction
    rows: dict[str, list[dict[str, Any]]] = {"none": [], "budget": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for r in range(args.repetitions):
            for name, b in (("none", None), ("budget", budget)):  # paired: both in each repetition
                got = measure(args.framework, args.size, args.tensors, b, d, f"{r}")
                rows[name].append(got)
                print(f"rep {r} {name:6s} budget={b or 0:>11d} rss_rise={got['rss_rise'] / 2**20:8.1f} MiB "
                      f"blocked={got['blocked_s'] * 1e3:8.1f} ms commit={got['commit_s'] * 1e3:8.1f} ms "
                      f"intact={got['intact']}", flush=True)
    summary = {name: {"rss_rise_mib_max": max(x["rss_rise"] for x in v) / 2**20,
                      "blocked_ms_median": statistics.median(x["blocked_s"] for x in v) * 1e3,
                      "commit_ms_median": statistics.median(x["commit_s"] for x in v) * 1e3,
                      "intact": all(x["intact"] and x["committed"] for x in v)} for name, v in rows.items()}
    summary["state_mib"] = args.size / 2**20
    summary["budget_mib"] = budget / 2**20
    summary["bound_mib"] = (budget + MARGIN_BYTES) / 2**20
    summary["within_bound"] = max(x["rss_rise"] for x in rows["budget"]) <= budget + MARGIN_BYTES
    print(json.dumps(summary, indent=1))
    return 0 if summary["within_bound"] and all(v["intact"] for k, v in summary.items() if k in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
