"""One process of the JAX elastic local-tier test (tests/test_tiers_elastic.py).

``save``: 2 processes x 2 CPU devices save steps 1..4 through ``bridges.jax.CheckpointManager``
(persistent every 4, local every 2, peer replicas): ``w`` (12 x 4) split by rows over 4 devices
(3 rows each), ``b`` replicated. ``restore``: 3 processes x 1 device (more processes than the save's
hosts, another mesh: 4 rows each, so every process needs rows of two hosts' boxes and the third
process holds no tier of its own) restore through the tiers. Writes what the restore returned.

usage: elastic_job.py save|restore --dir D --port P --rank R --world W --out JSON
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    for name in ("--dir", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    a = ap.parse_args()
    devices = 2 if a.mode == "save" else 1
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(a.port, a.world, a.rank, timeout=60)
    import bridges.jax as bjax
    from ckptfmt.manager import LocalTier

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1), ("d",))
    rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

    def host(step: int) -> dict:
        return {"w": np.arange(48, dtype=np.float32).reshape(12, 4) + 1000 * step, "b": np.full(3, step, np.int32)}

    def state(step: int) -> dict:
        h = host(step)
        return {"w": jax.make_array_from_callback((12, 4), rows, lambda i: h["w"][i]),
                "b": jax.make_array_from_callback((3,), rep, lambda i: h["b"][i]), "n": step}

    persistent, local_dir = os.path.join(a.dir, "persistent"), os.path.join(a.dir, "local")
    tier = LocalTier(local_dir, every=2, keep=2)
    out: dict = {}
    if a.mode == "save":
        with bjax.CheckpointManager(persistent, save_every_steps=4, local=tier) as mgr:
            for step in range(1, 5):
                mgr.save(step, state(step), extra={"step": step})
            mgr.wait()
            out["local_saves"] = [s.step for s in mgr.tier_history if s.committed]
    else:
        target = {"w": jax.ShapeDtypeStruct((12, 4), np.float32, sharding=rows),
                  "b": jax.ShapeDtypeStruct((3,), np.int32, sharding=rep), "n": 0}
        with bjax.CheckpointManager(persistent, local=tier) as mgr:
            r = mgr.restore(target)
        want = host(r.step)
        exact = all(np.array_equal(np.asarray(s.data), want["w"][s.index]) for s in r.state["w"].addressable_shards)
        exact = exact and np.array_equal(np.asarray(r.state["b"].addressable_shards[0].data), want["b"])
        out = {"step": r.step, "tiers": r.stats.get("tiers"), "elastic": r.stats.get("elastic"),
               "token": r.stats.get("tier_token"), "extra": r.extra, "n": r.state["n"], "exact": bool(exact)}
    with open(a.out, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
