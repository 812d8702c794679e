"""Cooperative restore (FORMAT.md 9.1) against independent reads: figures, not a test.

usage: python -m devtools.coop_restore [--mib 1024] [--k 2,4] [--devices 8] [--repeats 2]
       [--stores file,s3] [--dir /tmp]

For each ``k`` (processes) and store, ``k`` JAX processes (``jax.distributed``, devices/k CPU
devices each) hold a ``(data=k, model=devices/k)`` mesh; every tensor is sharded over ``model`` and
replicated over ``data``, so every process restores every byte of the state. One save, then
restores with ``cooperative=None`` (on: each box read by one process and shared) and
``cooperative=False`` (each process reads everything), in alternating order, each after the page
cache is dropped (as root; file store only). Prints, per restore, each process's bytes read
from storage against 1/k of the replicated bytes, and the restore's seconds (the slowest
process, between two barriers). S3 runs against a local ``moto_server`` (``moto[server]``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckptfmt_tools.bench.child import drop_page_cache
from ckptfmt_tools.bench.tiers import _Moto

TENSORS = 16


def worker(rank: int, port: int, params: dict, out: str) -> None:
    """One process of one run: save once, then the restores of ``params["modes"]``."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    k = int(params["k"])
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, k, rank, timeout=120)
    import bridges.jax as bj

    mesh = Mesh(np.array(jax.devices()).reshape(k, -1), ("data", "model"))
    cols = 4096
    rows = int(params["mib"]) * 2**20 // (TENSORS * cols * 4)
    spec = NamedSharding(mesh, PartitionSpec(None, "model"))
    state = {f"layer{t:02d}": jax.make_array_from_callback(
        (rows, cols), spec, lambda i, t=t: np.full((rows, cols), t, np.float32)[i]) for t in range(TENSORS)}
    url = params["url"]
    multihost_utils.sync_global_devices("save")
    t0 = time.perf_counter()
    bj.save(url, state, step=1)
    res: dict[str, Any] = {"rank": rank, "save_s": time.perf_counter() - t0, "runs": [],
                           "replicated_bytes": TENSORS * rows * cols * 4}
    target = bj.abstract_target(state)
    del state
    for i, mode in enumerate(params["modes"]):
        multihost_utils.sync_global_devices(f"drop{i}")
        dropped = drop_page_cache() if rank == 0 and params["drop"] else False
        multihost_utils.sync_global_devices(f"go{i}")
        stats: dict = {}
        t0 = time.perf_counter()
        got = bj.restore(url, target, step=1, stats=stats, cooperative=None if mode == "coop" else False)
        jax.block_until_ready(got)
        mine = time.perf_counter() - t0
        multihost_utils.sync_global_devices(f"done{i}")
        wall = time.perf_counter() - t0
        ok = all(float(np.asarray(got[f"layer{t:02d}"].addressable_shards[0].data)[0, 0]) == t for t in range(TENSORS))
        res["runs"].append({"mode": mode, "seconds": mine, "wall_s": wall, "bytes_read": stats["bytes_read"],
                            "dropped": dropped, "exact": ok, "shared": stats["cooperative"]["bytes_received"]})
        del got
    with open(out, "w") as f:
        json.dump(res, f)


def run(k: int, devices: int, store: str, mib: int, repeats: int, workdir: Path, env: dict) -> list[dict]:
    """One save and ``2 * repeats`` restores on ``k`` processes; each process's result."""
    from ckptfmt.coord import free_port

    url = str(workdir / f"repo-k{k}") if store == "file" else f"s3://coop/repo-k{k}-{int(time.time())}"
    modes = [m for r in range(repeats) for m in (("coop", "independent") if r % 2 == 0 else ("independent", "coop"))]
    params = {"k": k, "mib": mib, "url": url, "modes": modes, "drop": store == "file"}
    (workdir / "params.json").write_text(json.dumps(params))
    outs = [workdir / f"k{k}-{store}-{r}.json" for r in range(k)]
    env = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // k}", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "devtools.coop_restore", "--worker", str(r), str(port),
                               str(workdir / "params.json"), str(outs[r])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(k)]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a process failed:\n" + "\n".join(x[-3000:] for x in logs))
    if store == "file":
        shutil.rmtree(url, ignore_errors=True)
    return [json.loads(o.read_text()) for o in outs]


def report(k: int, store: str, ranks: list[dict]) -> None:
    share = ranks[0]["replicated_bytes"] / k
    print(f"\n== k={k} processes, store={store}, state {ranks[0]['replicated_bytes'] / 2**30:.2f} GiB replicated "
          f"over k; save {max(r['save_s'] for r in ranks):.2f} s")
    print(f"{'restore':<12} {'seconds':>8}  {'exact':>5}  {'cache':>7}  bytes read per process / (1/k of replicated)")
    for i, run0 in enumerate(ranks[0]["runs"]):
        runs = [r["runs"][i] for r in ranks]
        ratios = " ".join(f"{x['bytes_read'] / share:.3f}" for x in runs)
        print(f"{run0['mode']:<12} {max(x['wall_s'] for x in runs):>8.2f}  {str(all(x['exact'] for x in runs)):>5}  "
              f"{'dropped' if run0['dropped'] else 'warm':>7}  {ratios}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker(int(argv[1]), int(argv[2]), json.loads(Path(argv[3]).read_text()), argv[4])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    moto = _Moto() if "s3" in a.stores.split(",") else None
    try:
        with tempfile.TemporaryDirectory(prefix="ckptfmt-coop-", dir=a.dir) as tmp:
            for store in a.stores.split(","):
                for k in (int(x) for x in a.k.split(",")):
                    ranks = run(k, a.devices, store, a.mib, a.repeats, Path(tmp), env | (moto.env if moto and store == "s3" else {}))
                    report(k, store, ranks)
    finally:
        if moto is not None:
            moto.close()


if __name__ == "__main__":
    main()
