"""Save one JAX-profile checkpoint for tests/test_bridge_profiles.py, on 4 CPU devices.

usage: profile_save.py REPO OUT_JSON

Writes step 1 of REPO with bridges.jax.save, then records in OUT_JSON what bridges.jax.restore
gives back without a target: every leaf by its nested path, as ("key", impl, key data),
("array", dtype, shape, values) or ("value", type name, value).
"""
from __future__ import annotations

import collections
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import bridges.jax as bj  # noqa: E402

Adam = collections.namedtuple("Adam", "count mu")


def state() -> dict:
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "model"))
    w = jax.device_put(jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4), NamedSharding(mesh, P("data", "model")))
    return {
        "params": {"w": w, "b": jnp.arange(4, dtype=jnp.bfloat16)},
        "rng": jax.random.split(jax.random.key(42), 3),            # typed keys, shape (3,)
        "raw": jax.random.PRNGKey(7),                              # a raw uint32 key: an ordinary tensor
        "pair": (jnp.arange(3, dtype=jnp.int32), "tag"),            # a tuple: one tensor, one leaf
        "opt": [Adam(count=jnp.int32(5), mu={"w": jnp.ones(2)}), Adam(count=3, mu={})],
        "ints": {3: jnp.float32(0.5)},
        "step": 7, "lr": 0.25, "name": "run", "half": np.float16(1.5), "big": 2 ** 70, "blob": b"\x00\x01",
    }


def _describe(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ["key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)).tolist()]
    if isinstance(x, (np.ndarray, jax.Array)):
        a = np.asarray(x)
        return ["array", a.dtype.name, list(a.shape), a.astype(np.float64).tolist()]
    if isinstance(x, np.generic):
        return ["value", type(x).__name__, x.item()]
    return ["value", type(x).__name__, x.hex() if isinstance(x, bytes) else x]


def _walk(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            assert isinstance(k, str), k  # a target-less restore keys every level by str
            out.update(_walk(v, prefix + (k,)))
        return out
    return {"/".join(prefix): _describe(tree)}


def main() -> None:
    repo, out = sys.argv[1], sys.argv[2]
    bj.save(repo, state(), step=1, extra={"epoch": (1, 2)}, rank_state={"cursor": 11})
    got = bj.restore(repo)
    with open(out, "w") as f:
        json.dump({"restored": _walk(got)}, f)


if __name__ == "__main__":
    main()
