"""Orbax -> ckptfmt, one process with 8 CPU devices (run by tests/test_interop.py).

usage: jax_orbax.py WORKDIR  -> WORKDIR/orbax.json

A pytree laid out on a (4, 2) mesh of the 8 devices (float32 Llama-shaped tensors, a bfloat16
and an int32 array, a scalar array and a Python int) is saved by Orbax's ``StandardCheckpointer``
with OCDBT on and off; each is imported (``bridges.interop.import_orbax``) and restored with
``bridges.jax.restore`` onto 4 devices (a (2, 2) mesh of the first four): every leaf compared bit
for bit. Faults: a truncated Orbax array file (each layout) -> import raises a typed
CheckpointError and commits no step; the controls are the intact imports above.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys  # noqa: E402
from bridges.interop import import_orbax  # noqa: E402
from ckptfmt import Repository  # noqa: E402
from ckptfmt.errors import CheckpointError  # noqa: E402

SPECS = {"embed": P("a", "b"), "q": P(None, "b", "a", None), "down": P(None, "a", "b"), "norm": P(),
         "bf": P(None, "b"), "ids": P("a"), "count": P()}


def host_tree() -> dict:
    rng = np.random.default_rng(11)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {"params": {"embed": r(256, 64), "layers": {"q": r(2, 64, 8, 8), "down": r(2, 128, 64), "norm": r(2, 64)}},
            "bf": r(8, 16).astype(ml_dtypes.bfloat16), "ids": np.arange(40, dtype=np.int32),
            "count": np.array(3, np.int32)}


def main() -> None:
    work = sys.argv[1]
    t0 = time.perf_counter()
    host = host_tree()
    m8 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    m4 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    spec = lambda k: SPECS[k.split("/")[-1]]  # noqa: E731
    tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(host), [
        jax.device_put(v, NamedSharding(m8, spec(k))) for k, v in flatten_with_keys(host)[0]])
    tree["steps_done"] = 7  # a Python scalar leaf
    target = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(host), [
        jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m4, spec(k))) for k, v in flatten_with_keys(host)[0]])
    target["steps_done"] = 0
    out: dict = {}
    for ocdbt in (True, False):
        name = "ocdbt" if ocdbt else "zarr"
        src = os.path.join(work, f"orbax_{name}")
        ck = ocp.StandardCheckpointer(use_ocdbt=ocdbt)
        ck.save(src, tree)
        ck.wait_until_finished()
        url = os.path.join(work, f"from_{name}")
        rep = import_orbax(src, url)
        got = bj.restore(url, target)
        flat_got = dict(flatten_with_keys(got)[0])
        same = {k: bool(np.asarray(flat_got[k]).dtype == v.dtype and np.asarray(flat_got[k]).tobytes() == v.tobytes())
                for k, v in flatten_with_keys(host)[0]}
        devices = {k: sorted(d.id for d in flat_got[k].sharding.device_set) for k in same}
        # Fault: a truncated array file (OCDBT: its data file; otherwise one chunk of "params/embed").
        bad = src + "_truncated"
        shutil.copytree(src, bad)
        files = glob.glob(os.path.join(bad, "d", "*")) if ocdbt else glob.glob(os.path.join(bad, "params.embed", "*.*"))
        victim = max(files, key=os.path.getsize)
        os.truncate(victim, os.path.getsize(victim) // 2)
        bad_url = os.path.join(work, f"from_{name}_truncated")
        try:
            import_orbax(bad, bad_url)
            fault = "no error"
        except CheckpointError as e:
            fault = type(e).__name__
            print(f"{name} truncated: {e}"[:400], file=sys.stderr)
        out[name] = {"same": same, "devices": devices, "steps_done": got["steps_done"], "tensors": rep.tensors,
                     "provenance": rep.provenance, "fault": fault, "fault_committed": Repository(bad_url).steps()
                     if os.path.isdir(bad_url) else []}
    out["seconds"] = time.perf_counter() - t0
    with open(os.path.join(work, "orbax.json"), "w") as fh:
        json.dump(out, fh, default=str)


if __name__ == "__main__":
    main()
