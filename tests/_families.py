"""Tiny configs and random NNX-layout parameters of Qwen3, Gemma 2, Mixtral and Qwen2-MoE (tests only).

Plain dicts (the JAX side reads them without transformers): ``SIZES`` and the ``*_KW`` extras are
the fields of each family's Hugging Face config; :func:`family_params` draws the arrays of the
preset's name table (bridges.presets), per-layer tensors stacked on axis 0, experts on axis 1.
"""
from __future__ import annotations

import numpy as np

ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, rope_parameters=ROPE)
GEMMA2 = dict(SIZES, query_pre_attn_scalar=24, sliding_window=32, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
E = 4  # experts
SHARED_FF = 48
MIXTRAL_KW = dict(num_local_experts=E, num_experts_per_tok=2, tie_word_embeddings=False)
QWEN2_MOE_KW = dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=SHARED_FF, tie_word_embeddings=False)
GEMMA2_KW = {k: v for k, v in GEMMA2.items() if k not in SIZES}
#: Wider sizes, where the shard objects' fixed index bytes would otherwise count for several
#: per cent of a rank's share (the tensor-parallel loads).
WIDE = dict(SIZES, hidden_size=64, intermediate_size=128, vocab_size=256)


def configs(sizes: dict = SIZES) -> dict[str, dict]:
    """Each family's config fields at ``sizes``."""
    return {"qwen3": dict(sizes, tie_word_embeddings=False), "gemma2": dict(sizes, **GEMMA2_KW),
            "mixtral": dict(sizes, **MIXTRAL_KW), "qwen2_moe": dict(sizes, **QWEN2_MOE_KW)}


CONFIGS = configs()


def nnx_params(rng: np.random.Generator, extra: dict[str, tuple[int, ...]], norms: tuple[str, ...],
               head: bool, sizes: dict = SIZES) -> dict[str, np.ndarray]:
    """A Llama-like decoder's arrays plus ``extra`` (key -> shape, drawn around 1) and the per-layer
    ``norms``; ``head``: an untied ``lm_head/kernel``."""
    d, h, kv, hd = (sizes[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    L, f, v = sizes["num_hidden_layers"], sizes["intermediate_size"], sizes["vocab_size"]
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    p = {"embed/embedding": r(v, d), "layers/attn/q/kernel": r(L, d, h, hd), "layers/attn/k/kernel": r(L, d, kv, hd),
         "layers/attn/v/kernel": r(L, d, kv, hd), "layers/attn/o/kernel": r(L, h, hd, d),
         "layers/mlp/gate/kernel": r(L, d, f), "layers/mlp/up/kernel": r(L, d, f), "layers/mlp/down/kernel": r(L, f, d),
         "norm/scale": 1 + r(d)}
    p.update({f"layers/{n}/scale": 1 + r(L, d) for n in norms})
    p.update({k: 1 + r(*s) for k, s in extra.items()})
    if head:
        p["lm_head/kernel"] = r(d, v)
    return p


def moe_params(rng: np.random.Generator, ff: int, shared: bool, sizes: dict = SIZES) -> dict[str, np.ndarray]:
    """Attention and norms of :func:`nnx_params`, experts stacked (L, E, ...) of width ``ff``;
    ``shared``: Qwen2-MoE's shared expert, its gate and the q/k/v biases."""
    d, L = sizes["hidden_size"], sizes["num_hidden_layers"]
    h, kv, hd = sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["head_dim"]
    p = {k: v for k, v in nnx_params(rng, {}, ("attn_norm", "mlp_norm"), head=True, sizes=sizes).items()
         if "/mlp/" not in k}
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    p.update({"layers/moe/router/kernel": r(L, d, E), "layers/moe/gate/kernel": r(L, E, d, ff),
              "layers/moe/up/kernel": r(L, E, d, ff), "layers/moe/down/kernel": r(L, E, ff, d)})
    if shared:
        p.update({"layers/moe/shared/gate/kernel": r(L, d, SHARED_FF), "layers/moe/shared/up/kernel": r(L, d, SHARED_FF),
                  "layers/moe/shared/down/kernel": r(L, SHARED_FF, d), "layers/moe/shared_gate/kernel": r(L, d, 1),
                  "layers/attn/q/bias": r(L, h, hd), "layers/attn/k/bias": r(L, kv, hd), "layers/attn/v/bias": r(L, kv, hd)})
    return p


def family_params(family: str, seed: int, sizes: dict = SIZES) -> dict[str, np.ndarray]:
    """Random arrays in the NNX layout of ``hf_{family}_from_nnx`` (Gemma 2's norms stored as
    ``scale``, applied as ``1 + scale``)."""
    rng = np.random.default_rng(seed)
    L, hd = sizes["num_hidden_layers"], sizes["head_dim"]
    if family == "qwen3":
        return nnx_params(rng, {"layers/attn/q_norm/scale": (L, hd), "layers/attn/k_norm/scale": (L, hd)},
                          ("attn_norm", "mlp_norm"), head=True, sizes=sizes)
    if family == "gemma2":
        p = nnx_params(rng, {}, ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm"), head=False,
                       sizes=sizes)
        return {k: (v - 1 if k.endswith("scale") else v) for k, v in p.items()}
    if family == "mixtral":
        return moe_params(rng, sizes["intermediate_size"], shared=False, sizes=sizes)
    return moe_params(rng, QWEN2_MOE_KW["moe_intermediate_size"], shared=True, sizes=sizes)
