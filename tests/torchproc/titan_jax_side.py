"""JAX side of tests/test_torchtitan.py: restore a torchtitan checkpoint into the Flax NNX Llama
layout (bridges.presets.LLAMA_NNX_NAMES, AdamW moments and count included) on a (2, 2) mesh of 4
CPU devices, with ``compose(hf_llama_from_torchtitan(cfg), hf_llama_from_nnx(cfg).inverse())``:
no name written by hand, no torch process, each device reading its own boxes.

Usage: ``titan_jax_side.py <step url> <out.npz> <config.json> [broken]``; writes the logits of the
restored arrays (the numpy reference forward, tests/_llama_ref.py), the count, and the mu of the
head. ``broken``: the Qwen3 preset instead (no q/k permutation), the control.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from _llama_ref import llama_forward  # noqa: E402
from bridges import jax as bj  # noqa: E402
from bridges.mapping import compose  # noqa: E402
from bridges.presets import hf_llama_from_nnx, hf_llama_from_torchtitan, hf_qwen3_from_torchtitan  # noqa: E402


def main() -> None:
    url, out, cfg = sys.argv[1], sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
    broken = len(sys.argv) > 4
    L, d, H, KV = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, F, V = d // H, cfg["intermediate_size"], cfg["vocab_size"]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sh = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    f32 = jnp.float32
    params = {
        "embed": {"embedding": jax.ShapeDtypeStruct((V, d), f32, sharding=sh("model", "data"))},
        "layers": {
            "attn": {n: {"kernel": jax.ShapeDtypeStruct((L, d, h, hd), f32, sharding=sh(None, "data", "model"))}
                     for n, h in (("q", H), ("k", KV), ("v", KV))}
            | {"o": {"kernel": jax.ShapeDtypeStruct((L, H, hd, d), f32, sharding=sh(None, "model", None, "data"))}},
            "mlp": {n: {"kernel": jax.ShapeDtypeStruct(s, f32, sharding=sh(None, "data", "model") if n != "down"
                                                       else sh(None, "model", "data"))}
                    for n, s in (("gate", (L, d, F)), ("up", (L, d, F)), ("down", (L, F, d)))},
            "attn_norm": {"scale": jax.ShapeDtypeStruct((L, d), f32, sharding=sh())},
            "mlp_norm": {"scale": jax.ShapeDtypeStruct((L, d), f32, sharding=sh())},
        },
        "norm": {"scale": jax.ShapeDtypeStruct((d,), f32, sharding=sh())},
        "lm_head": {"kernel": jax.ShapeDtypeStruct((d, V), f32, sharding=sh("data", "model"))},
    }
    target = {"model": params, "optimizer": {"opt_state": {"0": {"mu": params, "nu": params,
                                                                 "count": jax.ShapeDtypeStruct((), jnp.int32)}},
                                             "step": jax.ShapeDtypeStruct((), jnp.uint32)}}
    tt = (hf_qwen3_from_torchtitan if broken else hf_llama_from_torchtitan)(cfg)
    got = bj.restore(url, target, mapping=compose(tt, hf_llama_from_nnx(cfg).inverse()))
    m = jax.tree_util.tree_map(np.asarray, got["model"])
    layer = lambda name, i: {"q": m["layers"]["attn"]["q"]["kernel"], "k": m["layers"]["attn"]["k"]["kernel"],  # noqa: E731
                             "v": m["layers"]["attn"]["v"]["kernel"], "o": m["layers"]["attn"]["o"]["kernel"],
                             "gate": m["layers"]["mlp"]["gate"]["kernel"], "up": m["layers"]["mlp"]["up"]["kernel"],
                             "down": m["layers"]["mlp"]["down"]["kernel"], "attn_norm": m["layers"]["attn_norm"]["scale"],
                             "mlp_norm": m["layers"]["mlp_norm"]["scale"]}.get(name, None)
    layer_i = lambda name, i: None if layer(name, i) is None else layer(name, i)[i]  # noqa: E731
    ids = np.array(cfg["eval_ids"])
    logits = llama_forward(ids, layers=L, layer=layer_i, embed=m["embed"]["embedding"], norm=m["norm"]["scale"],
                           head=m["lm_head"]["kernel"], eps=cfg["rms_norm_eps"], theta=cfg["rope_theta"])
    q_sharding = got["model"]["layers"]["attn"]["q"]["kernel"].sharding
    np.savez(out, logits=logits, count=np.asarray(got["optimizer"]["opt_state"]["0"]["count"]),
             step=np.asarray(got["optimizer"]["step"]),
             mu_head=np.asarray(got["optimizer"]["opt_state"]["0"]["mu"]["lm_head"]["kernel"]),
             q_spec=np.array(str(q_sharding.spec)))


if __name__ == "__main__":
    main()
