"""Balanced writes of replicated data: 2 processes x 4 CPU devices, a (data=2, model=4) mesh, every
parameter sharded over ``model`` and replicated over ``data`` (run by tests/test_jax_bridge.py, and
by hand for figures).

usage: balance_check.py PORT RANK OUT_JSON [MIB_PER_TENSOR [TENSORS [REPO [REPEATS]]]]

Saves the state twice: with ``bridges.jax.save`` (every process offers its replica's data, so the
plan spreads the shards over both processes) and, for comparison, through the core API with only
replica 0's data offered (the assignment before FORMAT.md 1.0.4: process 0 writes everything).
Records the bytes each process wrote (from the manifests) and each save's seconds.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402


def _state(mib: float, tensors: int) -> dict:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # process p holds data row p
    cols = 256
    rows = max(1, int(mib * 2**20) // (4 * cols))
    out = {}
    for t in range(tensors):
        host = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + t
        out[f"layer{t:02d}/w"] = jax.make_array_from_callback(
            (rows, cols), NamedSharding(mesh, PartitionSpec(None, "model")), lambda i, h=host: h[i])
    out["norm"] = jax.make_array_from_callback((cols,), NamedSharding(mesh, PartitionSpec()), lambda i: np.ones(cols, np.float32)[i])
    return out


def _replica0_shards(state: dict) -> list:
    """The core API's shards with only replica 0's data offered (the old assignment)."""
    import numpy as np

    from bridges.jax._tree import index_to_box  # type: ignore[import-not-found]
    from ckptfmt import LocalShard

    shards = []
    for key, arr in state.items():
        for sh in arr.addressable_shards:
            box = index_to_box(sh.index, arr.shape)
            data = (lambda d=sh.data: np.asarray(d)) if sh.replica_id == 0 else None
            shards.append(LocalShard(key, arr.shape, arr.dtype, box, data, replica_id=int(sh.replica_id)))
    return shards


def _per_writer(m) -> list[int]:
    out = [0, 0]
    for t in m.tensors.values():
        for w, n in zip(t.shards.writer, t.shards.nbytes):
            out[int(w)] += int(n)
    return out


def main() -> None:
    port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mib = float(sys.argv[4]) if len(sys.argv) > 4 else 0.25
    tensors = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    repo = sys.argv[6] if len(sys.argv) > 6 else os.path.join(os.path.dirname(out), "repo")
    repeats = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=60)
    import numpy as np

    import bridges.jax as bj
    from bridges.jax._coord import JaxCoordinator
    from ckptfmt import SaveOptions, save

    state = _state(mib, tensors)  # flat key paths; the bridge takes the nested tree
    tree: dict = {}
    for k, v in state.items():
        *parents, leaf = k.split("/")
        d = tree
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    coord = JaxCoordinator(timeout_s=120)
    res: dict = {"rank": rank}
    for step, how in enumerate(["balanced", "replica0"] * repeats, start=1):
        coord.barrier(f"b{step}", 120)
        t0 = time.perf_counter()
        if how == "balanced":
            m = bj.save(repo, tree, step=step, options=SaveOptions(timeout_s=120))
        else:
            m = save(repo, step, _replica0_shards(state), coordinator=coord, options=SaveOptions(timeout_s=120))
        res.setdefault(how, []).append({"seconds": time.perf_counter() - t0, "bytes_per_process": _per_writer(m)})
    host = bj.restore(repo, step=1)  # no target: whole host arrays, nested by key path
    rows = state["layer00/w"].shape[0]
    res["equal"] = all(np.array_equal(host[f"layer{t:02d}"]["w"],
                                      np.arange(rows * 256, dtype=np.float32).reshape(rows, 256) + t)
                       for t in range(tensors)) and np.array_equal(host["norm"], np.ones(256, np.float32))
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
