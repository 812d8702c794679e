"""The local tier against the persistent tier (issue 29's targets; docs/tiers.md): prints figures.

``python -m ckptfmt_tools.bench.tiers [--mib 1024] [--saves 5] [--store file|s3] [--local /dev/shm/...]``
starts 2 processes x 4 JAX CPU devices (``jax.distributed``) holding a row-sharded state of
``--mib`` MiB (16 float32 tensors) and, through ``bridges.jax.CheckpointManager``:

1. times the caller's block (the wall time of ``save``) of ``--saves`` async persistent saves
   and as many async local-tier saves (own boxes plus the peer replica), alternating (each kind
   in its own manager, the order flipping every round; each kind's median, and the paired
   differences by round), then of as many calls that save both (every run is in the JSON);
2. restores the newest step from the local tier (``restore()`` with ``local=``: every byte from
   the own tier), then, after dropping the page cache (root only; said in the output), from the
   persistent tier alone (a manager without ``local``), then once more warm.

``--store s3``: the persistent tier is a bucket of a local ``moto_server`` (started for the run).
Each figure is the slower process's, between barriers. Not a test: timing on a shared machine
is noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .child import drop_page_cache

PROCESSES, DEVICES, TENSORS = 2, 4, 16


def _state(jax: Any, sharding: Any, mib: int, step: int) -> dict[str, Any]:
    import numpy as np

    rows = max(8, (mib << 20) // TENSORS // 4 // 1024 // 8 * 8)
    out = {}
    for t in range(TENSORS):
        def block(index: Any, t: int = t) -> Any:
            r = index[0]
            n = (r.stop or rows) - (r.start or 0)
            return np.full((n, 1024), float(step * 100 + t), dtype=np.float32)
        out[f"t{t:02d}"] = jax.make_array_from_callback((rows, 1024), sharding, block)
    return out


def _timed(sync: Any, name: str, fn: Any) -> tuple[float, Any]:
    sync(f"{name}-start")
    t0 = time.perf_counter()
    value = fn()
    sync(f"{name}-end")
    return time.perf_counter() - t0, value


def child(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(args.port, PROCESSES, args.rank, timeout=120)
    import bridges.jax as bjax
    from ckptfmt.manager import LocalTier

    sync = multihost_utils.sync_global_devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    rows = NamedSharding(mesh, P("d"))
    tier = LocalTier(args.local, every=1, keep=1, mapped=args.mapped)
    out: dict[str, Any] = {}
    # The persistent and the local saves alternate, each kind in its own manager (both open; the
    # first save of each starts its background thread), the order flipping every round, so that
    # drift of the machine biases neither kind: the caller's blocked seconds of every save, paired
    # by round, and each kind's median.
    blocked: dict[str, list[float]] = {"persistent": [], "local": [], "both": []}
    recorded: dict[str, list[float]] = {"persistent": [], "local": []}  # SaveRecord / TierSave blocked_s
    with bjax.CheckpointManager(args.persistent, save_every_steps=1, keep_last=1) as pmgr, \
            bjax.CheckpointManager(args.persistent, local=tier) as lmgr:
        for i in range(args.saves):
            for kind in (("persistent", "local") if i % 2 == 0 else ("local", "persistent")):
                # the save's block, not the state's creation
                st = jax.block_until_ready(_state(jax, rows, args.mib, 1 if kind == "persistent" else 2))
                # The caller's wall time of the call (the managers' own records leave out handing
                # the job to the background thread); "both" below is timed the same way.
                t0 = time.perf_counter()
                if kind == "persistent":
                    pmgr.save(1 + i, st)
                    blocked["persistent"].append(time.perf_counter() - t0)
                    prec = pmgr.wait()
                    recorded["persistent"].append(prec.blocked_s)
                else:
                    lmgr.save(100 + i, st)
                    blocked["local"].append(time.perf_counter() - t0)
                    lmgr.wait()
                    rec = lmgr.tier_history[-1]
                    recorded["local"].append(rec.blocked_s)
        out["persistent_commit_s"] = prec.write_s
        out["local_commit_s"] = rec.write_s
        out["local_exchange_s"] = rec.exchange_s
        out["local_own_bytes"], out["local_peer_bytes"], out["local_committed"] = rec.own_bytes, rec.peer_bytes, rec.committed
    with bjax.CheckpointManager(args.persistent, save_every_steps=1, local=tier, keep_last=1) as mgr:
        for i in range(args.saves):
            st = jax.block_until_ready(_state(jax, rows, args.mib, 3))
            t0 = time.perf_counter()
            mgr.save(200 + i, st)
            blocked["both"].append(time.perf_counter() - t0)
            mgr.wait()
    last = 200 + args.saves - 1
    for kind, runs in blocked.items():
        out[f"{kind}_save_blocked_s"] = float(statistics.median_high(runs))
        out[f"{kind}_save_blocked_runs"] = runs
    out["recorded_blocked_runs"] = recorded
    del st
    target = {f"t{t:02d}": jax.ShapeDtypeStruct(_state_shape(args.mib), np.float32, sharding=rows) for t in range(TENSORS)}

    def restore(local: bool) -> Any:
        with bjax.CheckpointManager(args.persistent, local=tier if local else None) as m:
            r = m.restore(target)
        jax.block_until_ready(r.state)
        return r

    out["restore_local_s"], r = _timed(sync, "rl", lambda: restore(True))
    out["restore_local_inner_s"] = r.stats.get("restore_s")
    out["restore_local_tiers"], out["restore_local_step"] = r.stats.get("tiers"), r.step
    out["restore_local_exact"] = bool(float(np.asarray(r.state["t05"].addressable_shards[0].data)[0, 0]) == 305.0
                                      and r.step == last)
    del r
    sync("drop")
    out["cache_dropped"] = drop_page_cache() if args.rank == 0 else None
    sync("dropped")
    out["restore_persistent_cold_s"], r = _timed(sync, "rp", lambda: restore(False))
    out["restore_persistent_step"] = r.step
    del r
    out["restore_persistent_warm_s"], r = _timed(sync, "rw", lambda: restore(False))
    del r
    with open(args.out, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


def _state_shape(mib: int) -> tuple[int, int]:
    return (max(8, (mib << 20) // TENSORS // 4 // 1024 // 8 * 8), 1024)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.bench.tiers")
    ap.add_argument("--mib", type=int, default=1024, help="state size in MiB (all processes)")
    ap.add_argument("--local", default="", help="local tier directory (default: a fresh one under /dev/shm)")
    ap.add_argument("--persistent", default="", help="persistent repository (default: a fresh directory on disk)")
    ap.add_argument("--store", choices=("file", "s3"), default="file",
                    help="the persistent tier: a directory on disk, or a bucket of a local moto S3 server")
    ap.add_argument("--saves", type=int, default=5, help="saves of each kind (the blocked figure is their median)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--mapped", action="store_true",
                    help="restore the local tier by mapping (LocalTier(mapped=True), opt-in) instead of copying")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank >= 0:
        child(args)
        return 0
    from ckptfmt.coord import free_port

    work = tempfile.mkdtemp(prefix="ckptfmt-bench-tiers-", dir=os.getcwd())
    shm = tempfile.mkdtemp(prefix="ckptfmt-bench-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    local, persistent = args.local or os.path.join(shm, "local"), args.persistent or os.path.join(work, "persistent")
    port = free_port()
    moto, env = None, dict(os.environ)
    if args.store == "s3":
        moto = _Moto()
        env.update(moto.env)
        persistent = args.persistent or f"s3://coop/tiers-{int(time.time())}"
    try:
        outs = [os.path.join(work, f"out{r}.json") for r in range(PROCESSES)]
        procs = [subprocess.Popen([sys.executable, "-m", "ckptfmt_tools.bench.tiers", "--mib", str(args.mib), "--local",
                                   local, "--persistent", persistent, "--saves", str(args.saves), "--rank", str(r), "--port", str(port),
                                   "--out", outs[r]] + (["--mapped"] if args.mapped else []), env=env, stdout=sys.stderr)
                 for r in range(PROCESSES)]
        rcs = [p.wait(timeout=1800) for p in procs]
        if any(rcs):
            print(f"bench failed: exit codes {rcs}", file=sys.stderr)
            return 1
        res = [json.load(open(o)) for o in outs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if moto is not None:
            moto.close()
    figures = dict(_figures(args.mib, res), store=args.store, mapped=args.mapped)
    print(json.dumps(figures, indent=1) if args.json else _table(figures))
    return 0


def _paired(runs: dict[str, list[float]]) -> dict[str, Any]:
    """The persistent and local saves of each round (they alternate): local less persistent."""
    diffs = [lo - pe for pe, lo in zip(runs["persistent"], runs["local"])]
    return {"rounds": len(diffs), "local_not_more": sum(d <= 0 for d in diffs),
            "median_diff_s": statistics.median(diffs) if diffs else None}


def _figures(mib: int, res: list[dict[str, Any]]) -> dict[str, Any]:
    slow = {k: max(r[k] for r in res) for k in res[0] if k.endswith("_s")}
    runs = {k: [max(v) for v in zip(*(r[f"{k}_save_blocked_runs"] for r in res))] for k in ("persistent", "local", "both")}
    return {"blocked_paired": _paired(runs), "state_mib": mib, "processes": PROCESSES, "devices_per_process": DEVICES, **slow,
            "local_vs_cold_persistent": slow["restore_persistent_cold_s"] / slow["restore_local_s"],
            "local_vs_warm_persistent": slow["restore_persistent_warm_s"] / slow["restore_local_s"],
            "cache_dropped": res[0]["cache_dropped"], "restore_local_tiers": [r["restore_local_tiers"] for r in res],
            "restore_local_exact": all(r["restore_local_exact"] for r in res),
            "local_bytes_per_process": [[r["local_own_bytes"], r["local_peer_bytes"]] for r in res],
            "blocked_runs_s": runs}


def _table(f: dict[str, Any]) -> str:
    lines = [f"local tier vs persistent tier ({f['store']}): {f['state_mib']} MiB, {f['processes']} processes x "
             f"{f['devices_per_process']} JAX CPU devices (slower process; blocked: median of each kind's saves)"]
    for k in ("persistent_save_blocked_s", "local_save_blocked_s", "both_save_blocked_s", "persistent_commit_s",
              "local_commit_s", "local_exchange_s", "restore_local_s", "restore_persistent_cold_s", "restore_persistent_warm_s"):
        lines.append(f"  {k:<28} {f[k]:8.3f} s")
    lines.append(f"  restore: local {f['local_vs_cold_persistent']:.2f}x faster than the cold persistent restore "
                 f"(page cache dropped: {f['cache_dropped']}), {f['local_vs_warm_persistent']:.2f}x than warm")
    lines.append("  blocked per save (ms, slower process): " + "; ".join(
        f"{k} {', '.join(f'{x * 1e3:.1f}' for x in v)}" for k, v in f["blocked_runs_s"].items()))
    pb = f["blocked_paired"]
    if pb["rounds"]:
        lines.append(f"  blocked, paired by round (the two kinds alternate): local no more than persistent in "
                     f"{pb['local_not_more']} of {pb['rounds']}, median local less persistent {pb['median_diff_s'] * 1e3:+.1f} ms")
    lines.append(f"  bytes served by tier, per process: {f['restore_local_tiers']}; exact: {f['restore_local_exact']}")
    lines.append(f"  local save bytes [own, replica] per process: {f['local_bytes_per_process']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())


class _Moto:
    """A local ``moto_server`` and a bucket ``coop`` for a run against S3 (``--store s3``; the
    cooperative-restore harness in devtools/ uses it too)."""

    def __init__(self) -> None:
        from ckptfmt.coord import free_port

        binary = Path(sys.executable).parent / "moto_server"
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(binary if binary.exists() else shutil.which("moto_server")), "-H",
                                      "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="coop")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
