"""The DeepSeek-V3 preset of :mod:`bridges.presets`: Hugging Face ``DeepseekV3ForCausalLM``
(transformers 5.x, ``modeling_deepseek_v3.py``) from a Flax NNX decoder.

Facts relied on (read from transformers 5.24's ``modeling_deepseek_v3.py``): multi-head latent
attention (MLA): ``q_a_proj`` (q_lora, d) -> ``q_a_layernorm`` -> ``q_b_proj`` (H*(nope+rope),
q_lora); ``kv_a_proj_with_mqa`` (kv_lora+rope, d), whose last ``rope`` rows are the one shared
rotary key; ``kv_a_layernorm`` (kv_lora); ``kv_b_proj`` (H*(nope+v), kv_lora); ``o_proj``
(d, H*v); each head's q row block is [nope | rope], each kv_b block [k_nope | v]. The first
``first_k_dense_replace`` layers have a dense SwiGLU ``mlp``; the others a routed MoE (router
``mlp.gate.weight`` (E, d) and its ``e_score_correction_bias`` (E,) buffer; fused
``experts.gate_up_proj`` (E, 2F, d) = gate then up, ``experts.down_proj`` (E, d, F)) plus
``shared_experts`` (a SwiGLU of ``moe_intermediate_size * n_shared_experts``). The rotary
dimensions are stored as DeepSeek lays them out (interleaved pairs, ``rope_interleave``): copied.
"""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._mapping import Concat, Mapping, Merge, Select, Transform, Transpose
from bridges.presets._base import _get, _mapping, _names

__all__ = ["DEEPSEEK_V3_NNX_NAMES", "hf_deepseek_v3_from_nnx"]

#: The Flax NNX DeepSeek-V3 layout :func:`hf_deepseek_v3_from_nnx` expects. Attention and norms are
#: stacked over all L layers (axis 0); the dense MLPs over the first ``first_k_dense_replace``
#: layers, the MoE blocks over the rest (their own axis 0), experts on axis 1.
DEEPSEEK_V3_NNX_NAMES: dict[str, str] = {
    "embed": "embed/embedding",                        # (vocab, d)
    "wq_a": "layers/attn/wq_a/kernel",                 # (L, d, q_lora)
    "q_norm": "layers/attn/q_norm/scale",              # (L, q_lora)
    "wq_b": "layers/attn/wq_b/kernel",                 # (L, q_lora, heads, nope + rope)
    "wkv_a": "layers/attn/wkv_a/kernel",               # (L, d, kv_lora + rope)
    "kv_norm": "layers/attn/kv_norm/scale",            # (L, kv_lora)
    "wkv_b": "layers/attn/wkv_b/kernel",               # (L, kv_lora, heads, nope + v)
    "out": "layers/attn/out/kernel",                   # (L, heads, v, d)
    "attn_norm": "layers/attn_norm/scale",             # (L, d)
    "mlp_norm": "layers/mlp_norm/scale",               # (L, d)
    "dense_gate": "dense_layers/mlp/gate/kernel",      # (Ld, d, ffn)
    "dense_up": "dense_layers/mlp/up/kernel",          # (Ld, d, ffn)
    "dense_down": "dense_layers/mlp/down/kernel",      # (Ld, ffn, d)
    "router": "moe_layers/moe/router/kernel",          # (Lm, d, E)
    "router_bias": "moe_layers/moe/router/bias",       # (Lm, E)   the top-k choice's correction bias
    "gate": "moe_layers/moe/gate/kernel",              # (Lm, E, d, moe_ffn)
    "up": "moe_layers/moe/up/kernel",                  # (Lm, E, d, moe_ffn)
    "down": "moe_layers/moe/down/kernel",              # (Lm, E, moe_ffn, d)
    "shared_gate": "moe_layers/moe/shared/gate/kernel",  # (Lm, d, moe_ffn * n_shared)
    "shared_up": "moe_layers/moe/shared/up/kernel",      # (Lm, d, moe_ffn * n_shared)
    "shared_down": "moe_layers/moe/shared/down/kernel",  # (Lm, moe_ffn * n_shared, d)
    "norm": "norm/scale",                              # (d,)
    "lm_head": "lm_head/kernel",                       # (d, vocab)
}


def hf_deepseek_v3_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                            optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                            names: dict[str, str] | None = None, ignore: Sequence[str] = ("optimizer/step",),
                            keep: Sequence[str] = ("optim/param_groups",),
                            step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX DeepSeek-V3 decoder to HF ``DeepseekV3ForCausalLM``.

    MLA kernels (:data:`DEEPSEEK_V3_NNX_NAMES`) become the HF projections by merging (heads,
    head_dim) and transposing; the dense layers' MLPs (layers ``0 .. first_k_dense_replace-1``)
    and the MoE layers' routers, correction biases, experts (fused as in
    :func:`hf_mixtral_from_nnx`) and shared experts read their own stacks at the layer's index in
    that stack. A config with ``q_lora_rank`` None (a plain ``q_proj``) is refused (ValueError), as
    is one without the MLA sizes; attention biases (``attention_bias=True``) have no names, so a
    load reports them missing. ``inverse()`` is not available for
    the MLP rules (a fixed stack index per layer has no key family to stack); loads and torch
    saves are. A checkpoint that does not fit raises MappingError at load, naming the rule.
    """
    if _get(config, "q_lora_rank") is None:
        raise ValueError("hf_deepseek_v3_from_nnx: needs q_lora_rank (the q_a/q_b projections; a plain q_proj has no names)")
    t = _names(DEEPSEEK_V3_NNX_NAMES, names, "hf_deepseek_v3_from_nnx")
    L, k = int(_get(config, "num_hidden_layers")), int(_get(config, "first_k_dense_replace", 0))
    H = int(_get(config, "num_attention_heads"))
    qk = int(_get(config, "qk_nope_head_dim")) + int(_get(config, "qk_rope_head_dim"))
    kvh = int(_get(config, "qk_nope_head_dim")) + int(_get(config, "v_head_dim"))
    v = int(_get(config, "v_head_dim"))
    ff = int(_get(config, "moe_intermediate_size"))
    if not 0 <= k <= L:
        raise ValueError(f"hf_deepseek_v3_from_nnx: first_k_dense_replace={k} is not within 0..{L}")
    sel, lay, T = Select(0, "i", L), "model.layers.{i}", Transpose((1, 0))
    entries: list[tuple[Any, str, tuple[Transform, ...]]] = [
        (t["embed"], "model.embed_tokens.weight", ()), (t["norm"], "model.norm.weight", ()),
        (t["lm_head"], "lm_head.weight", (T,)),
        (t["wq_a"], f"{lay}.self_attn.q_a_proj.weight", (sel, T)),
        (t["q_norm"], f"{lay}.self_attn.q_a_layernorm.weight", (sel,)),
        (t["wq_b"], f"{lay}.self_attn.q_b_proj.weight", (sel, Merge(1, (H, qk)), T)),
        (t["wkv_a"], f"{lay}.self_attn.kv_a_proj_with_mqa.weight", (sel, T)),
        (t["kv_norm"], f"{lay}.self_attn.kv_a_layernorm.weight", (sel,)),
        (t["wkv_b"], f"{lay}.self_attn.kv_b_proj.weight", (sel, Merge(1, (H, kvh)), T)),
        (t["out"], f"{lay}.self_attn.o_proj.weight", (sel, Merge(0, (H, v)), T)),
        (t["attn_norm"], f"{lay}.input_layernorm.weight", (sel,)),
        (t["mlp_norm"], f"{lay}.post_attention_layernorm.weight", (sel,)),
    ]
    for i in range(L):  # the MLP stacks are indexed from their own first layer
        mlp = f"model.layers.{i}.mlp"
        if i < k:
            d = Select(0, i, k)
            entries += [(t["dense_gate"], f"{mlp}.gate_proj.weight", (d, T)), (t["dense_up"], f"{mlp}.up_proj.weight", (d, T)),
                        (t["dense_down"], f"{mlp}.down_proj.weight", (d, T))]
            continue
        m = Select(0, i - k, L - k)
        entries += [
            (t["router"], f"{mlp}.gate.weight", (m, T)),
            (t["router_bias"], f"{mlp}.gate.e_score_correction_bias", (m,)),
            ((t["gate"], t["up"]), f"{mlp}.experts.gate_up_proj", (m, Transpose((0, 2, 1)), Concat(1, (ff, ff)))),
            (t["down"], f"{mlp}.experts.down_proj", (m, Transpose((0, 2, 1)))),
            (t["shared_gate"], f"{mlp}.shared_experts.gate_proj.weight", (m, T)),
            (t["shared_up"], f"{mlp}.shared_experts.up_proj.weight", (m, T)),
            (t["shared_down"], f"{mlp}.shared_experts.down_proj.weight", (m, T)),
        ]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)
