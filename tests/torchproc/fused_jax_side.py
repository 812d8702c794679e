"""JAX side of tests/test_mapping_fused_inverse.py: one process of a 2-process ``jax.distributed``
job (2 CPU devices each) restores a Hugging Face safetensors directory (per-layer q/k/v and
gate/up) into a JAX layout with fused qkv and gate|up kernels stacked over the layers, through
``fused_mapping().inverse()``; the fused axis is sharded over the 4 devices.

Usage: ``fused_jax_side.py <hf dir> <out.json> <process id> <port>``. Writes whether every
addressable shard equals the numpy expectation, and the bytes this process read.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402


def main() -> None:
    hf_dir, out, pid, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    from ckptfmt_tools.jaxjoin import join

    join(port, 2, pid)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from safetensors.numpy import load_file

    from bridges import jax as bj
    from test_mapping_fused_inverse import DIMS, fused_mapping

    L, d, q, kv, F = (DIMS[k] for k in ("L", "d", "q", "kv", "F"))
    mesh = Mesh(np.array(jax.devices()).reshape(4), ("model",))
    sh = NamedSharding(mesh, P(None, None, "model"))
    target = {"layers": {"attn": {"qkv": {"kernel": jax.ShapeDtypeStruct((L, d, q + 2 * kv), jnp.float32, sharding=sh)}},
                         "mlp": {"wi": {"kernel": jax.ShapeDtypeStruct((L, d, 2 * F), jnp.float32, sharding=sh)}}}}
    stats: dict = {}
    got = bj.restore(hf_dir, target, mapping=fused_mapping().inverse(), stats=stats)
    hf = load_file(str(Path(hf_dir) / "model.safetensors"))
    want = {"qkv": np.stack([np.concatenate([hf[f"model.layers.{i}.self_attn.{n}_proj.weight"].T for n in "qkv"], 1)
                             for i in range(L)]),
            "wi": np.stack([np.concatenate([hf[f"model.layers.{i}.mlp.{n}_proj.weight"].T for n in ("gate", "up")], 1)
                            for i in range(L)])}
    arrays = {"qkv": got["layers"]["attn"]["qkv"]["kernel"], "wi": got["layers"]["mlp"]["wi"]["kernel"]}
    exact = all(np.array_equal(np.asarray(s.data), want[n][s.index]) for n, a in arrays.items()
                for s in a.addressable_shards)
    share = sum(np.asarray(s.data).nbytes for a in arrays.values() for s in a.addressable_shards)
    Path(out).write_text(json.dumps({"exact": exact, "bytes_read": stats["reader"]["bytes_read"], "share": share,
                                     "total": int(sum(v.nbytes for v in want.values()))}))


if __name__ == "__main__":
    main()
