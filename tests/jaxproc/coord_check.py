"""Two-process check of bridges.jax._coord.JaxCoordinator (run by tests/test_jax_bridge.py).

usage: coord_check.py PORT RANK OUT_JSON
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402


class _Slow:
    """A client proxy whose reads lag behind, as on a loaded machine."""

    def __init__(self, inner):
        self._inner = inner

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        time.sleep(1.0)
        return self._inner.blocking_key_value_get_bytes(key, timeout_ms)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _save_across_processes(repo: str, rank: int) -> dict:
    """Arrays held by one process only (its single device) and split over both processes."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    import bridges.jax as bj
    from ckptfmt import SaveOptions

    mesh = Mesh(np.array(jax.devices()), ("x",))
    host = np.arange(24.0, dtype=np.float32).reshape(8, 3)
    split = jax.make_array_from_callback((8, 3), NamedSharding(mesh, PartitionSpec("x")), lambda i: host[i])
    dev0 = SingleDeviceSharding(jax.devices()[0])  # addressable on rank 0 only
    only0 = jax.make_array_from_callback((5,), dev0, lambda i: np.arange(5, dtype=np.int32)[i], dtype=np.int32)
    scalar0 = jax.make_array_from_callback((), dev0, lambda i: np.float32(7.0), dtype=np.float32)
    m = bj.save(repo, {"split": split, "only0": only0, "scalar0": scalar0, "np": np.ones(3)}, step=1,
                options=SaveOptions(timeout_s=60))
    host_back = bj.restore(repo)
    return {"writers": {k: [int(w) for w in t.shards.writer] for k, t in m.tensors.items()},
            "equal": bool(np.array_equal(host_back["split"], host) and host_back["only0"].tolist() == [0, 1, 2, 3, 4]
                          and float(host_back["scalar0"]) == 7.0)}


def _rank0_listing_fails(work: str, rank: int) -> dict:
    """restore(step=None) where rank 0's listing fails (its path is a regular file): both ranks
    raise rank 0's StorageError at once (ckptfmt.agree_step), neither waits for a timeout."""
    import bridges.jax as bj
    from ckptfmt.errors import CheckpointError

    bad = os.path.join(work, "not-a-repository")
    if rank == 0:
        with open(bad, "w") as f:
            f.write("a regular file where rank 0 looks for the repository")
    t0 = time.monotonic()
    try:
        bj.restore(bad if rank == 0 else os.path.join(work, "repo"))
        return {"error": None}
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)[:300], "seconds": round(time.monotonic() - t0, 2)}


def main() -> None:
    port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=60)
    from bridges.jax._coord import JaxCoordinator, default_coordinator
    from ckptfmt.errors import CoordinatorTimeoutError, StepMismatchError

    res: dict = {"default": type(default_coordinator()).__name__}
    c = JaxCoordinator(timeout_s=30)
    res["rank_world"] = [c.rank, c.world]
    for i in range(3):  # one name reused several times
        res[f"allgather{i}"] = [p.decode() for p in c.allgather("ag", f"r{rank}i{i}".encode())]
    res["bcast"] = c.broadcast("b", b"from1" if rank == 1 else None, root=1).decode()
    c.barrier("bar")
    # Rank 1 calls a different collective: rank 0 sees a mismatch, never a hang.
    c2 = JaxCoordinator(timeout_s=30)
    t = time.monotonic()
    try:
        if rank == 0:
            c2.broadcast("x", b"zero", root=0)
        else:
            c2.broadcast("not-x", None, root=0)
        res["mismatch"] = "no error"
    except StepMismatchError as e:
        res["mismatch"] = type(e).__name__
    except Exception as e:  # noqa: BLE001
        res["mismatch"] = f"{type(e).__name__}: {e}"
    # Only rank 0 waits: a bounded timeout, never a hang.
    c3 = JaxCoordinator(timeout_s=30)
    c3.barrier("sync")
    if rank == 0:
        t = time.monotonic()
        try:
            c3.allgather("lonely", b"x", timeout_s=1.5)
            res["timeout"] = "no error"
        except CoordinatorTimeoutError as e:
            res["timeout"] = type(e).__name__
        res["timeout_s"] = round(time.monotonic() - t, 2)
    # A slow reader (rank 0) must still find the keys of a call its peer has already left:
    # rank 1 returns from the allgather and at once roots a broadcast (which proves nothing
    # about rank 0's progress), so it must not delete its allgather key yet.
    c5 = JaxCoordinator(timeout_s=10)
    if rank == 0:
        c5._client = _Slow(c5._client)
    res["slow_reader"] = [p.decode() for p in c5.allgather("ag", f"s{rank}".encode())]
    res["slow_bcast"] = [c5.broadcast("b", b"x" if rank == 1 else None, root=1).decode() for _ in range(2)]
    c4 = JaxCoordinator(timeout_s=30)
    c4.barrier("end", timeout_s=30)
    res["save"] = _save_across_processes(os.path.join(os.path.dirname(out), "repo"), rank)
    res["listing"] = _rank0_listing_fails(os.path.dirname(out), rank)
    with open(out, "w") as f:
        json.dump(res, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
