"""One rank of the local-tier scenarios (tests/test_tiers.py): 2 processes x 2 CPU devices.

Saves steps 1..6 through ``bridges.jax.CheckpointManager`` (persistent every 4, local every 2,
keep 2), then restores four times with a fresh manager, rank 0 damaging the tiers between them:
intact (own local tier serves every byte), one own local box corrupted (rejected; the peer
replica serves it), host 1's local tier deleted (its bytes from the peer replica), every local
tier deleted (the persistent tier's newest step). Writes what each restore returned to --out.

usage: tiers_job.py --dir D --port P --rank R --out JSON
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(a.port, 2, a.rank, timeout=60)
    from jax.experimental import multihost_utils

    import bridges.jax as bjax
    from ckptfmt.manager import LocalTier
    from tiers_job_damage import corrupt_own_box

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4), ("d",))
    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def state(step: int) -> dict:
        w = np.arange(64, dtype=np.float32).reshape(16, 4) + 1000 * step
        return {"w": jax.make_array_from_callback(w.shape, rows, lambda i: w[i]),
                "b": jax.make_array_from_callback((3,), rep, lambda i: np.full(3, step, np.int32)[i]), "n": step}

    persistent, local_dir = os.path.join(a.dir, "persistent"), os.path.join(a.dir, "local")
    tier = LocalTier(local_dir, every=2, keep=2)
    with bjax.CheckpointManager(persistent, save_every_steps=4, local=tier) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step), extra={"step": step})
        mgr.wait()
        saves = [s.step for s in mgr.tier_history if s.committed]
    target = {"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=rows),
              "b": jax.ShapeDtypeStruct((3,), np.int32, sharding=rep), "n": 0}
    out: dict = {"local_saves": saves, "restores": {}}
    for scenario in ("intact", "corrupt", "lost-host", "all-lost"):
        if a.rank == 0:
            if scenario == "corrupt":
                out["corrupted"] = corrupt_own_box(local_dir, 0, 6)
            elif scenario == "lost-host":  # host 0's clean copy back, host 1's tier gone
                shutil.rmtree(os.path.join(local_dir, "host-0"))
                os.rename(os.path.join(a.dir, "host-0-clean"), os.path.join(local_dir, "host-0"))
                shutil.rmtree(os.path.join(local_dir, "host-1"))
            elif scenario == "all-lost":
                shutil.rmtree(local_dir)
            else:
                shutil.copytree(os.path.join(local_dir, "host-0"), os.path.join(a.dir, "host-0-clean"))
        multihost_utils.sync_global_devices(f"tiers-{scenario}")
        with bjax.CheckpointManager(persistent, local=tier) as mgr:
            r = mgr.restore(target)
        w = np.asarray(multihost_utils.process_allgather(r.state["w"], tiled=True))
        b = np.asarray(multihost_utils.process_allgather(r.state["b"], tiled=True))
        expect = state(r.step)
        out["restores"][scenario] = {
            "step": r.step, "tiers": r.stats.get("tiers"), "token": r.stats.get("tier_token"), "n": r.state["n"],
            "extra": r.extra, "exact": bool(np.array_equal(w, np.arange(64, dtype=np.float32).reshape(16, 4)
                                                           + 1000 * r.step) and np.array_equal(b, np.full(3, r.step))),
            "n_ok": r.state["n"] == expect["n"]}
        multihost_utils.sync_global_devices(f"tiers-{scenario}-done")
    out["training"] = train_while_exchanging(a.dir, state, rows)
    with open(a.out, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


def train_while_exchanging(work: str, state, rows) -> dict:
    """A local save every step while the caller runs cross-process programs each step (a jitted
    sum over both processes' devices): the peer exchange runs in the background thread meanwhile
    (a ppermute launched there hung such a loop). Returns each local save's record, and the last
    step restored through the tiers."""
    import time

    import jax.numpy as jnp

    import bridges.jax as bjax
    from ckptfmt.manager import LocalTier

    tier = LocalTier(os.path.join(work, "train-local"), every=1, keep=2)
    total = jax.jit(lambda x: jnp.sum(x))
    sums = []
    t0 = time.perf_counter()
    with bjax.CheckpointManager(os.path.join(work, "train-persistent"), save_every_steps=3, local=tier) as mgr:
        for step in range(1, 7):
            st = state(step)
            mgr.save(step, st, extra={"step": step})
            for _ in range(20):  # the training step's own cross-process programs, while the exchange runs
                sums.append(float(total(st["w"])))
        mgr.wait()
        records = [[s.step, s.committed, s.blocked_s, s.exchange_s, s.peer_bytes] for s in mgr.tier_history]
    with bjax.CheckpointManager(os.path.join(work, "train-persistent"), local=tier) as mgr:
        r = mgr.restore({"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=rows),
                         "b": jax.ShapeDtypeStruct((3,), np.int32, sharding=NamedSharding(rows.mesh, P())), "n": 0})
    w = np.asarray(jax.experimental.multihost_utils.process_allgather(r.state["w"], tiled=True))
    return {"records": records, "seconds": time.perf_counter() - t0, "sums_ok": sums[-1] == float(np.sum(
        np.arange(64, dtype=np.float32) + 6000)), "restored": r.step, "tiers": r.stats.get("tiers"),
        "exact": bool(np.array_equal(w, np.arange(64, dtype=np.float32).reshape(16, 4) + 6000))}


if __name__ == "__main__":
    main()
