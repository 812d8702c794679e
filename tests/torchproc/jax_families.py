"""JAX forwards of Qwen3, Gemma 2, Mixtral and Qwen2-MoE over their NNX-layout arrays (tests only).

The small model definitions of the families' JAX side, written as functions of the flat
``{"layers/attn/q/kernel": array, ...}`` dict of :mod:`bridges.presets`' name tables (per-layer
tensors stacked on axis 0, experts on axis 1), in float32 with jax.numpy, so that they run
jitted on arrays sharded over a mesh. Split-halves rotary embedding, as the presets' default.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _rope(x: jax.Array, theta: float) -> jax.Array:
    s, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    a, b = x[..., :hd // 2], x[..., hd // 2:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _attention(y: jax.Array, g: Any, *, theta: float, scale: float, eps: float = 0.0, qk_norm: bool = False,
               bias: bool = False, softcap: float | None = None) -> jax.Array:
    q, k, v = (jnp.einsum("bsd,dhk->bshk", y, g(f"attn/{n}/kernel")) for n in "qkv")
    if bias:
        q, k, v = q + g("attn/q/bias"), k + g("attn/k/bias"), v + g("attn/v/bias")
    if qk_norm:
        q, k = _rms(q, g("attn/q_norm/scale"), eps), _rms(k, g("attn/k_norm/scale"), eps)
    q, k = _rope(q, theta), _rope(k, theta)
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    s = y.shape[1]
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf), axis=-1)
    return jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", p, v), g("attn/o/kernel"))


def _glu(y: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: Any = jax.nn.silu) -> jax.Array:
    return (act(y @ gate) * (y @ up)) @ down


def _layers(p: Params) -> int:
    return p["layers/attn/q/kernel"].shape[0]


def qwen3(p: Params, ids: jax.Array, cfg: dict[str, Any]) -> jax.Array:
    """Logits of QWEN3_NNX_NAMES: per-head q/k RMSNorms before the rotary embedding, untied head."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    x = p["embed/embedding"][ids]
    for i in range(_layers(p)):
        g = lambda n: p[f"layers/{n}"][i]  # noqa: E731
        x = x + _attention(_rms(x, g("attn_norm/scale"), eps), g, theta=theta, scale=cfg["head_dim"] ** -0.5,
                           eps=eps, qk_norm=True)
        y = _rms(x, g("mlp_norm/scale"), eps)
        x = x + _glu(y, g("mlp/gate/kernel"), g("mlp/up/kernel"), g("mlp/down/kernel"))
    return _rms(x, p["norm/scale"], eps) @ p["lm_head/kernel"]


def gemma2(p: Params, ids: jax.Array, cfg: dict[str, Any]) -> jax.Array:
    """Logits of GEMMA2_NNX_NAMES: embeddings times sqrt(d), norms times (1 + scale) before and
    after attention and MLP, GeGLU (tanh GELU), scores scaled by query_pre_attn_scalar**-0.5 and
    soft-capped, the tied head, final logits soft-capped."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    emb = p["embed/embedding"]
    x = emb[ids] * jnp.float32(math.sqrt(emb.shape[1]))
    for i in range(_layers(p)):
        g = lambda n: p[f"layers/{n}"][i]  # noqa: E731
        norm = lambda t, n: _rms(t, 1 + g(f"{n}/scale"), eps)  # noqa: E731
        a = _attention(norm(x, "pre_attn_norm"), g, theta=theta, scale=cfg["query_pre_attn_scalar"] ** -0.5,
                       softcap=cfg["attn_logit_softcapping"])
        x = x + norm(a, "post_attn_norm")
        m = _glu(norm(x, "pre_mlp_norm"), g("mlp/gate/kernel"), g("mlp/up/kernel"), g("mlp/down/kernel"),
                 act=lambda t: jax.nn.gelu(t, approximate=True))
        x = x + norm(m, "post_mlp_norm")
    cap = cfg["final_logit_softcapping"]
    return jnp.tanh((_rms(x, 1 + p["norm/scale"], eps) @ emb.T) / cap) * cap


def moe(p: Params, ids: jax.Array, cfg: dict[str, Any]) -> jax.Array:
    """Logits of MIXTRAL_NNX_NAMES (with ``layers/moe/shared/...`` present: QWEN2_MOE_NNX_NAMES,
    q/k/v biases and a sigmoid-gated shared expert). Each token keeps the top
    ``num_experts_per_tok`` of its router softmax (renormalized for Mixtral, as
    ``norm_topk_prob`` says for Qwen2-MoE) and sums those experts' SiLU-GLU outputs so weighted."""
    eps, theta, top_k = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"], cfg["num_experts_per_tok"]
    shared = "layers/moe/shared/gate/kernel" in p
    renormalize = cfg.get("norm_topk_prob", False) if shared else True
    x = p["embed/embedding"][ids]
    for i in range(_layers(p)):
        g = lambda n: p[f"layers/{n}"][i]  # noqa: E731
        x = x + _attention(_rms(x, g("attn_norm/scale"), eps), g, theta=theta, scale=cfg["head_dim"] ** -0.5,
                           bias=shared)
        y = _rms(x, g("mlp_norm/scale"), eps)
        prob = jax.nn.softmax(y @ g("moe/router/kernel"), axis=-1)                 # (b, s, E)
        w, top = jax.lax.top_k(prob, top_k)
        if renormalize:
            w = w / w.sum(-1, keepdims=True)
        weight = (w[..., None] * jax.nn.one_hot(top, prob.shape[-1])).sum(-2)       # (b, s, E), 0 if not chosen
        outs = jax.vmap(lambda ga, u, dn: _glu(y, ga, u, dn))(g("moe/gate/kernel"), g("moe/up/kernel"),
                                                               g("moe/down/kernel"))  # (E, b, s, d)
        out = jnp.einsum("bse,ebsd->bsd", weight, outs)
        if shared:
            out = out + jax.nn.sigmoid(y @ g("moe/shared_gate/kernel")) * _glu(
                y, g("moe/shared/gate/kernel"), g("moe/shared/up/kernel"), g("moe/shared/down/kernel"))
        x = x + out
    return _rms(x, p["norm/scale"], eps) @ p["lm_head/kernel"]


FORWARDS = {"qwen3": qwen3, "gemma2": gemma2, "mixtral": moe, "qwen2_moe": moe}
