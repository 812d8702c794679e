"""A numpy reference forward of Qwen3, Gemma 2 and 3, Mixtral and Qwen2-MoE decoders in JAX layouts (tests only).

Written from each family's published math over the JAX-layout kernels (as tests/_llama_ref.py is
for Llama), not from the mapping code: comparing it with ``transformers`` after a preset load
checks the preset against the real library. ``p`` holds the NNX-layout arrays of
bridges.presets' name tables, per-layer tensors stacked on axis 0.
"""
from __future__ import annotations

import math

import numpy as np

from _llama_ref import _rms, _rope


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _attention(y: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, *, theta: float,
               rope: str, scale: float, qk_norm: tuple | None = None, eps: float = 0.0,
               softcap: float | None = None, bias: tuple | None = None) -> np.ndarray:
    q, k, v = (np.einsum("bsd,dhk->bshk", y, w) for w in (q, k, v))
    if bias is not None:
        q, k, v = q + bias[0], k + bias[1], v + bias[2]
    if qk_norm is not None:  # Qwen3: an RMSNorm over each head's q and k, before the rotary embedding
        q, k = _rms(q, qk_norm[0], eps), _rms(k, qk_norm[1], eps)
    q, k = _rope(q, theta, rope), _rope(k, theta, rope)
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("bqhk,bshk->bhqs", q, k) * scale
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    s = y.shape[1]
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", p, v), o)


def qwen3_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float,
                  rope: str = "halves") -> np.ndarray:
    """Logits (b, s, vocab) in float64 of the QWEN3_NNX_NAMES layout (untied ``lm_head/kernel``)."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = f["embed/embedding"][ids]
    hd = f["layers/attn/q/kernel"].shape[-1]
    for i in range(f["layers/attn/q/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        y = _rms(x, g("attn_norm/scale"), eps)
        x = x + _attention(y, g("attn/q/kernel"), g("attn/k/kernel"), g("attn/v/kernel"), g("attn/o/kernel"),
                           theta=theta, rope=rope, scale=hd ** -0.5, eps=eps,
                           qk_norm=(g("attn/q_norm/scale"), g("attn/k_norm/scale")))
        y = _rms(x, g("mlp_norm/scale"), eps)
        gate = y @ g("mlp/gate/kernel")
        x = x + (gate / (1 + np.exp(-gate)) * (y @ g("mlp/up/kernel"))) @ g("mlp/down/kernel")
    return _rms(x, f["norm/scale"], eps) @ f["lm_head/kernel"]


def gemma2_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float, query_scalar: float,
                   attn_softcap: float | None, final_softcap: float | None, plus_one: bool = True,
                   thetas: tuple[float, ...] | None = None) -> np.ndarray:
    """Logits of the GEMMA2_NNX_NAMES layout: embeddings times sqrt(d), norms times (1 + scale)
    (``plus_one=False``: times scale, the broken control), GeGLU (tanh GELU), scores scaled by
    query_scalar**-0.5 and soft-capped, the tied head, final logits soft-capped (None: no cap).
    Gemma 3 (GEMMA3_NNX_NAMES): with ``layers/attn/q_norm/scale`` present, per-head q/k norms
    (1 + scale) before the rotary embedding; ``thetas``: each layer's rotary base (local and
    global layers differ)."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    off = 1.0 if plus_one else 0.0
    emb = f["embed/embedding"]
    x = emb[ids] * np.float64(np.float32(math.sqrt(emb.shape[1])))  # HF rounds the normalizer to float32
    qk = "layers/attn/q_norm/scale" in f
    for i in range(f["layers/attn/q/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        norm = lambda t, n: _rms(t, off + g(f"{n}/scale"), eps)  # noqa: E731
        a = _attention(norm(x, "pre_attn_norm"), g("attn/q/kernel"), g("attn/k/kernel"), g("attn/v/kernel"),
                       g("attn/o/kernel"), theta=thetas[i] if thetas else theta, rope="halves",
                       scale=query_scalar ** -0.5, softcap=attn_softcap, eps=eps,
                       qk_norm=(off + g("attn/q_norm/scale"), off + g("attn/k_norm/scale")) if qk else None)
        x = x + norm(a, "post_attn_norm")
        y = norm(x, "pre_mlp_norm")
        m = (_gelu_tanh(y @ g("mlp/gate/kernel")) * (y @ g("mlp/up/kernel"))) @ g("mlp/down/kernel")
        x = x + norm(m, "post_mlp_norm")
    out = _rms(x, off + f["norm/scale"], eps) @ emb.T
    return out if final_softcap is None else np.tanh(out / final_softcap) * final_softcap


def _silu_mlp(y: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = y @ gate
    return (g / (1 + np.exp(-g)) * (y @ up)) @ down


def moe_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float, top_k: int,
                renormalize: bool, shared: bool = False, qk_norm: bool = False) -> np.ndarray:
    """Logits of the MIXTRAL_NNX_NAMES layout (``shared``: QWEN2_MOE_NNX_NAMES, with q/k/v biases
    and a sigmoid-gated shared expert; ``qk_norm``: Qwen3-MoE's per-head q/k norms). Each token takes the softmax of its router logits, keeps
    the ``top_k`` largest (renormalized to sum 1 for Mixtral) and sums those experts' SiLU-GLU
    outputs so weighted; experts are stacked (L, E, ...)."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = f["embed/embedding"][ids]
    hd = f["layers/attn/q/kernel"].shape[-1]
    for i in range(f["layers/attn/q/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        bias = tuple(g(f"attn/{n}/bias") for n in "qkv") if shared else None
        y = _rms(x, g("attn_norm/scale"), eps)
        norms = (g("attn/q_norm/scale"), g("attn/k_norm/scale")) if qk_norm else None
        x = x + _attention(y, g("attn/q/kernel"), g("attn/k/kernel"), g("attn/v/kernel"), g("attn/o/kernel"),
                           theta=theta, rope="halves", scale=hd ** -0.5, bias=bias, qk_norm=norms, eps=eps)
        y = _rms(x, g("mlp_norm/scale"), eps)
        logit = y @ g("moe/router/kernel")                                       # (b, s, E)
        prob = np.exp(logit - logit.max(-1, keepdims=True))
        prob = prob / prob.sum(-1, keepdims=True)
        top = np.argsort(-prob, axis=-1)[..., :top_k]
        w = np.take_along_axis(prob, top, -1)
        if renormalize:
            w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for e in range(prob.shape[-1]):
            weight = (w * (top == e)).sum(-1, keepdims=True)                     # 0 where e is not chosen
            out += weight * _silu_mlp(y, g("moe/gate/kernel")[e], g("moe/up/kernel")[e], g("moe/down/kernel")[e])
        if shared:
            gate = 1 / (1 + np.exp(-(y @ g("moe/shared_gate/kernel"))))
            out += gate * _silu_mlp(y, g("moe/shared/gate/kernel"), g("moe/shared/up/kernel"),
                                    g("moe/shared/down/kernel"))
        x = x + out
    return _rms(x, f["norm/scale"], eps) @ f["lm_head/kernel"]


def gpt_oss_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float, top_k: int,
                    limit: float, alpha: float, window: int) -> np.ndarray:
    """Logits of the GPT_OSS_NNX_NAMES layout (transformers' ``modeling_gpt_oss``): q/k/v/o biases,
    halves rotary, each head's sink logit joining the softmax and then dropped, even layers
    attending a sliding ``window``; the router's top-k logits softmaxed; each expert
    ``(clip(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, biases on both
    projections."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = f["embed/embedding"][ids]
    hd = f["layers/attn/q/kernel"].shape[-1]
    s = ids.shape[1]
    for i in range(f["layers/attn/q/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        y = _rms(x, g("attn_norm/scale"), eps)
        q, k, v = (np.einsum("bsd,dhk->bshk", y, g(f"attn/{n}/kernel")) + g(f"attn/{n}/bias") for n in "qkv")
        q, k = _rope(q, theta, "halves"), _rope(k, theta, "halves")
        rep = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        scores = np.einsum("bqhk,bshk->bhqs", q, k) * hd ** -0.5
        pos = np.arange(s)
        visible = pos[None, :] <= pos[:, None]
        if i % 2 == 0:  # layer_types: sliding, full, sliding, ...
            visible &= pos[:, None] - pos[None, :] < window
        scores = np.where(visible, scores, -np.inf)
        sink = np.broadcast_to(g("attn/sinks")[None, :, None, None], scores.shape[:3] + (1,))
        joint = np.concatenate([scores, sink], -1)
        prob = np.exp(joint - joint.max(-1, keepdims=True))
        prob = (prob / prob.sum(-1, keepdims=True))[..., :-1]
        attn = np.einsum("bhqs,bshk->bqhk", prob, v)
        x = x + np.einsum("bqhk,hkd->bqd", attn, g("attn/o/kernel")) + g("attn/o/bias")
        y = _rms(x, g("mlp_norm/scale"), eps)
        logit = y @ g("moe/router/kernel") + g("moe/router/bias")
        top = np.argsort(-logit, axis=-1, kind="stable")[..., :top_k]
        tv = np.take_along_axis(logit, top, -1)
        w = np.exp(tv - tv.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for e in range(logit.shape[-1]):
            weight = (w * (top == e)).sum(-1, keepdims=True)
            gate = np.minimum(y @ g("moe/gate/kernel")[e] + g("moe/gate/bias")[e], limit)
            up = np.clip(y @ g("moe/up/kernel")[e] + g("moe/up/bias")[e], -limit, limit)
            h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out += weight * (h @ g("moe/down/kernel")[e] + g("moe/down/bias")[e])
        x = x + out
    return _rms(x, f["norm/scale"], eps) @ f["lm_head/kernel"]


def deepseek_v3_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float, nope: int,
                        rope: int, kv_lora: int, dense: int, top_k: int, scaling_factor: float) -> np.ndarray:
    """Logits of the DEEPSEEK_V3_NNX_NAMES layout (transformers' ``modeling_deepseek_v3``): MLA with
    low-rank q and kv, RMSNorms on both latents, one rotary key shared by the heads, the rotary part
    in interleaved pairs; ``dense`` SwiGLU layers first, then MoE layers: sigmoid scores, the top-k
    chosen by score + correction bias (one group), weighted by the scores renormalized and scaled,
    plus the shared expert."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = f["embed/embedding"][ids]
    b, s = ids.shape
    for i in range(f["layers/attn/wq_a/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        y = _rms(x, g("attn_norm/scale"), eps)
        q = np.einsum("bsr,rhk->bshk", _rms(y @ g("attn/wq_a/kernel"), g("attn/q_norm/scale"), eps), g("attn/wq_b/kernel"))
        ckv = y @ g("attn/wkv_a/kernel")
        kv = np.einsum("bsr,rhk->bshk", _rms(ckv[..., :kv_lora], g("attn/kv_norm/scale"), eps), g("attn/wkv_b/kernel"))
        k_rot = _rope(ckv[..., None, kv_lora:], theta, "interleaved")             # (b, s, 1, rope)
        q = np.concatenate([q[..., :nope], _rope(q[..., nope:], theta, "interleaved")], -1)
        k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot, kv.shape[:3] + (rope,))], -1)
        v = kv[..., nope:]
        scores = np.einsum("bqhk,bshk->bhqs", q, k) * (nope + rope) ** -0.5
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        prob = prob / prob.sum(-1, keepdims=True)
        x = x + np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", prob, v), g("attn/out/kernel"))
        y = _rms(x, g("mlp_norm/scale"), eps)
        if i < dense:
            m = lambda n: f[f"dense_layers/mlp/{n}/kernel"][i]  # noqa: E731
            x = x + _silu_mlp(y, m("gate"), m("up"), m("down"))
            continue
        m = lambda n: f[f"moe_layers/moe/{n}"][i - dense]  # noqa: E731
        score = 1 / (1 + np.exp(-(y @ m("router/kernel"))))                       # (b, s, E)
        top = np.argsort(-(score + m("router/bias")), axis=-1, kind="stable")[..., :top_k]
        w = np.take_along_axis(score, top, -1)
        w = w / (w.sum(-1, keepdims=True) + 1e-20) * scaling_factor
        out = _silu_mlp(y, m("shared/gate/kernel"), m("shared/up/kernel"), m("shared/down/kernel"))
        for e in range(score.shape[-1]):
            weight = (w * (top == e)).sum(-1, keepdims=True)
            out = out + weight * _silu_mlp(y, m("gate/kernel")[e], m("up/kernel")[e], m("down/kernel")[e])
        x = x + out
    return _rms(x, f["norm/scale"], eps) @ f["lm_head/kernel"]


def llama4_forward(ids: np.ndarray, p: dict[str, np.ndarray], *, eps: float, theta: float, moe_layers: list[int],
                   top_k: int) -> np.ndarray:
    """Logits of the LLAMA4_NNX_NAMES layout (transformers' ``modeling_llama4``, every layer with
    rope and a chunk longer than the sequence): interleaved rotary, q and k L2-normed without
    weights after it, dense SwiGLU layers, and MoE layers where each chosen expert's input is
    scaled by the sigmoid of its router logit (top-k), plus the shared expert."""
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = f["embed/embedding"][ids]
    hd = f["layers/attn/q/kernel"].shape[-1]
    s = ids.shape[1]
    dense = [i for i in range(f["layers/attn/q/kernel"].shape[0]) if i not in moe_layers]
    l2 = lambda t: t / np.sqrt((t * t).mean(-1, keepdims=True) + eps)  # noqa: E731
    for i in range(f["layers/attn/q/kernel"].shape[0]):
        g = lambda n: f[f"layers/{n}"][i]  # noqa: E731
        y = _rms(x, g("attn_norm/scale"), eps)
        q, k, v = (np.einsum("bsd,dhk->bshk", y, g(f"attn/{n}/kernel")) for n in "qkv")
        q, k = l2(_rope(q, theta, "interleaved")), l2(_rope(k, theta, "interleaved"))
        rep = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        scores = np.einsum("bqhk,bshk->bhqs", q, k) * hd ** -0.5
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        prob = prob / prob.sum(-1, keepdims=True)
        x = x + np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", prob, v), g("attn/o/kernel"))
        y = _rms(x, g("mlp_norm/scale"), eps)
        if i in dense:
            m = lambda n: f[f"dense_layers/mlp/{n}/kernel"][dense.index(i)]  # noqa: E731
            x = x + _silu_mlp(y, m("gate"), m("up"), m("down"))
            continue
        m = lambda n: f[f"moe_layers/moe/{n}"][moe_layers.index(i)]  # noqa: E731
        logit = y @ m("router/kernel")
        top = np.argsort(-logit, axis=-1, kind="stable")[..., :top_k]
        out = _silu_mlp(y, m("shared/gate/kernel"), m("shared/up/kernel"), m("shared/down/kernel"))
        for e in range(logit.shape[-1]):
            chosen = (top == e).any(-1, keepdims=True)
            score = np.where(chosen, 1 / (1 + np.exp(-logit[..., e:e + 1])), 0.0)
            out = out + _silu_mlp(y * score, m("gate/kernel")[e], m("up/kernel")[e], m("down/kernel")[e])
        x = x + out
    return _rms(x, f["norm/scale"], eps) @ f["lm_head/kernel"]
