"""Cooperative restore (FORMAT.md 9.1): 2 processes x 4 CPU devices, a (data=2, model=4) mesh,
every parameter sharded over ``model`` and replicated over ``data``, so both processes restore
the same boxes (run by tests/test_jax_bridge.py).

usage: coop_check.py PORT RANK OUT_JSON [REPO]

Saves once, restores cooperatively (the default) and with ``cooperative=False`` (the control),
recording equality and each process's storage bytes; then rank 1 flips one data byte of a shard
it served in the cooperative restore, and both processes restore again, recording the error.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

COLS, ROWS, TENSORS = 256, 256, 4  # 256 KiB per tensor


def _host(t: int) -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + t


def _state(mesh: Mesh) -> dict:
    spec = NamedSharding(mesh, PartitionSpec(None, "model"))
    return {f"w{t}": jax.make_array_from_callback((ROWS, COLS), spec, lambda i, h=_host(t): h[i])
            for t in range(TENSORS)}


def _exact(out: dict) -> bool:
    return all(np.array_equal(np.asarray(jax.device_get(sh.data)), _host(t)[sh.index])
               for t in range(TENSORS) for sh in out[f"w{t}"].addressable_shards)


def _flip_served(repo: str, served: list) -> str:
    from ckptfmt import Repository

    key, row = served[0]  # a stored chunk this process read and sent: (key path, chunk row)
    t = Repository(repo).manifest(1).tensors[key]
    s = int(np.searchsorted(t.chunk_start, row, side="right")) - 1
    at = int(t.chunks.offset[row]) + 8  # inside that chunk's data
    path = os.path.join(repo, t.object_key(s))
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    return key


def main() -> None:
    port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    repo = sys.argv[4] if len(sys.argv) > 4 else os.path.join(os.path.dirname(out), "repo")
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=60)
    import bridges.jax as bj
    from ckptfmt.errors import CheckpointError

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # process p holds data row p
    state = _state(mesh)
    bj.save(repo, state, step=1)
    target = bj.abstract_target(state)
    res: dict = {"rank": rank, "replicated_bytes": TENSORS * ROWS * COLS * 4}
    for name, coop in (("coop", True), ("independent", False), ("default", None)):
        multihost_utils.sync_global_devices(name)
        stats: dict = {}
        got = bj.restore(repo, target, step=1, stats=stats, cooperative=coop)
        res[name] = {"exact": _exact(got), "bytes_read": stats["bytes_read"], "coop": stats["cooperative"]}
    multihost_utils.sync_global_devices("flip")
    if rank == 1:
        res["flipped"] = _flip_served(repo, res["coop"]["coop"]["served"])
    multihost_utils.sync_global_devices("flipped")
    try:
        bj.restore(repo, target, step=1, cooperative=True)
        res["corrupt"] = None
    except CheckpointError as e:
        res["corrupt"] = {"error": type(e).__name__, "key": e.key, "message": str(e)[:300]}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
