"""A numpy reference forward of a Llama-family decoder in JAX layouts (tests only).

Written from the layouts' own math (einsums over the kernels as a JAX model applies them), not
from the mapping code, so that comparing it with ``transformers`` after a preset load checks the
preset against the real library. ``layer(name, i)`` returns layer ``i``'s tensor in the JAX
layout: q kernel (d, heads, head_dim), k/v (d, kv_heads, head_dim), o (heads, head_dim, d),
q/k/v biases (heads, head_dim) or None, gate/up (d, ffn), down (ffn, d), norms (d,).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def _rope(x: np.ndarray, theta: float, layout: str) -> np.ndarray:
    """Rotate (b, s, h, hd): split halves (HF's rotate_half) or interleaved pairs (0,1), (2,3), ..."""
    s, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(s)[:, None] * inv[None, :]                      # (s, hd/2)
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    if layout == "halves":
        a, b = x[..., :hd // 2], x[..., hd // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if layout == "halves":
        return np.concatenate([ra, rb], -1)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def llama_forward(ids: np.ndarray, *, layers: int, layer: Callable[[str, int], Any], embed: np.ndarray,
                  norm: np.ndarray, head: np.ndarray, eps: float, theta: float, rope: str = "halves",
                  query_prescaled: bool = False) -> np.ndarray:
    """Logits (b, s, vocab) in float64. ``head`` is (d, vocab); ``query_prescaled``: the q kernel
    already holds the 1/sqrt(head_dim) factor (MaxText), so attention applies none."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    x = f(embed)[ids]
    for i in range(layers):
        g = lambda name: f(layer(name, i))  # noqa: E731
        y = _rms(x, g("attn_norm"), eps)
        q = np.einsum("bsd,dhk->bshk", y, g("q"))
        k = np.einsum("bsd,dhk->bshk", y, g("k"))
        v = np.einsum("bsd,dhk->bshk", y, g("v"))
        for t, b in ((q, "q_bias"), (k, "k_bias"), (v, "v_bias")):
            if layer(b, i) is not None:
                t += g(b)
        q, k = _rope(q, theta, rope), _rope(k, theta, rope)
        rep = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        scores = np.einsum("bqhk,bshk->bhqs", q, k)
        if not query_prescaled:
            scores = scores / np.sqrt(q.shape[-1])
        s = ids.shape[1]
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        x = x + np.einsum("bqhk,hkd->bqd", np.einsum("bhqs,bshk->bqhk", p, v), g("o"))
        y = _rms(x, g("mlp_norm"), eps)
        gate = y @ g("gate")
        x = x + (gate / (1 + np.exp(-gate)) * (y @ g("up"))) @ g("down")
    return _rms(x, f(norm), eps) @ f(head)
