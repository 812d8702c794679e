"""The JAX half of the per-expert Mixtral restore (run by tests/test_interop_moe.py): 2 processes
x 4 CPU devices, one ("expert",) mesh of 8 devices over both.

usage: jax_moe.py PORT RANK WORKDIR

``WORKDIR/hf`` (``MixtralForCausalLM.save_pretrained``: one tensor per expert,
``model.layers.{i}.block_sparse_moe.experts.{j}.w{1,2,3}.weight``) is restored straight onto
stacked ``(L, E, d, ff)`` / ``(L, E, ff, d)`` arrays split over the expert axis, through the
inverse of two Selects (layer ``i``, expert ``j``): one rule per weight, no torch process. The
broken control reads the experts in the reverse order. Per process (``moe-<rank>.json``): bytes
read, its share (the distinct boxes its devices hold), the files' header bytes; rank 0 writes the
gathered arrays (``moe.npz``, ``moe_reversed.npz``).
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys, index_to_box  # noqa: E402
from bridges.mapping import Mapping, Reorder, Rule, Select, Transpose  # noqa: E402
from ckptfmt.interop import open_source  # noqa: E402


def moe_mapping(L: int, E: int, reverse_experts: bool = False) -> Mapping:
    """JAX ``moe/w{1,2,3}`` stacked (L, E, ...) <-> the published per-expert keys; ``.inverse()``
    restores the files onto the JAX layout. The user code of the restore: these lines."""
    wrong = (Reorder(1, tuple(reversed(range(E)))),) if reverse_experts else ()
    return Mapping(tuple(
        Rule(f"moe/{w}", f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight",
             transforms=wrong + (Select(0, "i", L), Select(0, "j", E), Transpose((1, 0))))
        for w in ("w1", "w2", "w3")), source_sep="/", target_sep=".")


def main() -> None:
    port, rank, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=120)
    cfg = json.load(open(os.path.join(work, "hf", "config.json")))
    L, E, d, ff = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    m = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = NamedSharding(m, P(None, "expert"))
    target = {"moe": {"w1": jax.ShapeDtypeStruct((L, E, d, ff), np.float32, sharding=sh),
                      "w2": jax.ShapeDtypeStruct((L, E, ff, d), np.float32, sharding=sh),
                      "w3": jax.ShapeDtypeStruct((L, E, d, ff), np.float32, sharding=sh)}}
    out: dict = {}
    for name, reverse in (("moe", False), ("moe_reversed", True)):
        stats: dict = {}
        restored = bj.restore(os.path.join(work, "hf"), target, mapping=moe_mapping(L, E, reverse).inverse(),
                              stats=stats)
        share = 0
        for _, leaf in flatten_with_keys(restored)[0]:
            boxes = {index_to_box(s.index, leaf.shape) for s in leaf.addressable_shards}
            share += sum(b.size for b in boxes) * leaf.dtype.itemsize
        full = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                for k, v in flatten_with_keys(restored)[0]}
        if rank == 0:
            np.savez(os.path.join(work, f"{name}.npz"), **{k.replace("/", "."): v for k, v in full.items()})
        out[name] = {"bytes_read": stats["reader"]["bytes_read"], "share": share,
                     "unexpected": len(stats["report"].unexpected)}
    out["headers"] = open_source(os.path.join(work, "hf")).header_bytes
    out["total"] = sum(int(np.prod(s.shape)) * 4 for s in jax.tree_util.tree_leaves(target))
    with open(os.path.join(work, f"moe-{rank}.json"), "w") as fh:
        json.dump(out, fh)
    multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main()
