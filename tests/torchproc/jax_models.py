"""Small Flax NNX models laid out as the presets of ``bridges.presets`` expect (tests only).

* :class:`Llama`: a Llama-family decoder, per-layer parameters stacked on axis 0 (built with
  ``nnx.vmap``, run with ``nnx.scan``), attention as ``nnx.LinearGeneral`` kernels (q (d, heads,
  head_dim), k/v (d, kv_heads, head_dim) with grouped-query attention, o (heads, head_dim, d)),
  SwiGLU MLP, RMSNorm scales, split-halves rotary embedding, untied head.
* :class:`GPT2`: GPT-2 with separate q/k/v ``nnx.Linear`` layers, LayerNorms, a tied head.

Both are built from a Hugging Face config object and random-initialised; nothing is downloaded.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def rotary(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin (S, head_dim) in the split-halves layout (HF's rotate_half)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions[:, None].astype(jnp.float32) * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def _causal(scores: jax.Array) -> jax.Array:
    s = scores.shape[-1]
    mask = jnp.tril(jnp.ones((s, s), bool))
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(scores.dtype).min), axis=-1)


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        d, h, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        hd = cfg.head_dim
        self.h, self.kv, self.hd = h, kv, hd
        self.attn_norm = nnx.RMSNorm(d, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.attn = nnx.Module()
        self.attn.q = nnx.LinearGeneral(d, (h, hd), use_bias=False, rngs=rngs)
        self.attn.k = nnx.LinearGeneral(d, (kv, hd), use_bias=False, rngs=rngs)
        self.attn.v = nnx.LinearGeneral(d, (kv, hd), use_bias=False, rngs=rngs)
        self.attn.o = nnx.LinearGeneral((h, hd), d, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.mlp = nnx.Module()
        self.mlp.gate = nnx.Linear(d, cfg.intermediate_size, use_bias=False, rngs=rngs)
        self.mlp.up = nnx.Linear(d, cfg.intermediate_size, use_bias=False, rngs=rngs)
        self.mlp.down = nnx.Linear(cfg.intermediate_size, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        y = self.attn_norm(x)
        q = _rotate(self.attn.q(y), cos, sin)
        k = jnp.repeat(_rotate(self.attn.k(y), cos, sin), self.h // self.kv, axis=2)
        v = jnp.repeat(self.attn.v(y), self.h // self.kv, axis=2)
        p = _causal(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(self.hd)))
        x = x + self.attn.o(jnp.einsum("bhqk,bkhd->bqhd", p, v))
        y = self.mlp_norm(x)
        return x + self.mlp.down(jax.nn.silu(self.mlp.gate(y)) * self.mlp.up(y))


class Llama(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        self.theta = float(cfg.rope_parameters["rope_theta"])
        self.hd = cfg.head_dim
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> LlamaBlock:
            return LlamaBlock(cfg, r)

        self.layers = make(rngs)
        self.norm = nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        cos, sin = rotary(jnp.arange(ids.shape[1]), self.hd, self.theta)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: LlamaBlock, x: jax.Array) -> jax.Array:
            return block(x, cos, sin)

        return self.lm_head(self.norm(run(self.layers, self.embed(ids))))


class GPT2Block(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        d, eps = cfg.n_embd, cfg.layer_norm_epsilon
        self.heads = cfg.n_head
        self.ln_1 = nnx.LayerNorm(d, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.attn = nnx.Module()
        self.attn.q = nnx.Linear(d, d, rngs=rngs)
        self.attn.k = nnx.Linear(d, d, rngs=rngs)
        self.attn.v = nnx.Linear(d, d, rngs=rngs)
        self.attn.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(d, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.mlp = nnx.Module()
        self.mlp.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.mlp.proj = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        y = self.ln_1(x)
        q, k, v = (f(y).reshape(b, s, self.heads, d // self.heads) for f in (self.attn.q, self.attn.k, self.attn.v))
        p = _causal(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads)))
        x = x + self.attn.proj(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d))
        return x + self.mlp.proj(jax.nn.gelu(self.mlp.fc(self.ln_2(x)), approximate=True))  # HF gelu_new


class GPT2(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layer)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> GPT2Block:
            return GPT2Block(cfg, r)

        self.h = make(rngs)
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, use_fast_variance=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))[None]

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: GPT2Block, x: jax.Array) -> jax.Array:
            return block(x)

        return self.wte.attend(self.ln_f(run(self.h, x)))


# Shardings on a (4, 2) ("fsdp", "tensor") mesh. The 4-way axis splits heads and the MLP's inner
# dimension, as torch tensor parallelism over 4 ranks does; the 2-way axis splits d_model.
LLAMA_SPECS = {
    "embed/embedding": P("fsdp", "tensor"),
    "attn/q/kernel": P(None, "tensor", "fsdp", None), "attn/k/kernel": P(None, "tensor", "fsdp", None),
    "attn/v/kernel": P(None, "tensor", "fsdp", None), "attn/o/kernel": P(None, "fsdp", None, "tensor"),
    "mlp/gate/kernel": P(None, "tensor", "fsdp"), "mlp/up/kernel": P(None, "tensor", "fsdp"),
    "mlp/down/kernel": P(None, "fsdp", "tensor"), "lm_head/kernel": P("tensor", "fsdp"),
}
GPT2_SPECS = {
    "wte/embedding": P("fsdp", "tensor"),
    "attn/q/kernel": P(None, "tensor", "fsdp"), "attn/k/kernel": P(None, "tensor", "fsdp"),
    "attn/v/kernel": P(None, "tensor", "fsdp"), "attn/q/bias": P(None, "fsdp"),
    "attn/k/bias": P(None, "fsdp"), "attn/v/bias": P(None, "fsdp"),
    "attn/proj/kernel": P(None, "fsdp", "tensor"), "mlp/fc/kernel": P(None, "tensor", "fsdp"),
    "mlp/fc/bias": P(None, "fsdp"), "mlp/proj/kernel": P(None, "fsdp", "tensor"),
}


def spec_for(specs: dict[str, P], key: str) -> P:
    for suffix, spec in specs.items():
        if key.endswith(suffix):
            return spec
    return P()


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def place(obj: Any, specs: dict[str, P], m: jax.sharding.Mesh) -> None:
    """Lay out every array of an NNX object on ``m`` by key path (in place)."""
    from bridges.jax._tree import flatten_with_keys, nest
    from bridges.flax import nnx_load, nnx_state

    flat = flatten_with_keys(nnx_state(obj))[0]
    nnx_load(obj, nest({k: jax.device_put(v, NamedSharding(m, spec_for(specs, k))) for k, v in flat}))


def train(model: Any, specs: dict[str, P], steps: int, vocab: int, seq: int, seed: int,
          eval_ids: np.ndarray) -> tuple[Any, Any]:
    """``steps`` adamw steps of next-token loss on random ids over the (4, 2) mesh.

    Returns the optimizer and ``logits()``, which gives the logits on ``eval_ids`` of the
    parameters as they are when it is called (by one more call of the same compiled step, whose
    update is thrown away with the model afterwards: call it last). One compile instead of two.
    """
    import optax

    m = mesh()
    place(model, specs, m)
    opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.01), wrt=nnx.Param)
    place(opt, specs, m)

    @nnx.jit
    def step(model: Any, opt: Any, ids: jax.Array, probe: jax.Array) -> jax.Array:
        def loss_fn(mdl: Any) -> jax.Array:
            logits = mdl(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        out = model(probe)  # before the update
        _, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return out

    rng = np.random.default_rng(seed)
    batch = NamedSharding(m, P("fsdp", None))
    probe = jax.device_put(np.asarray(eval_ids, np.int32), NamedSharding(m, P()))
    draw = lambda: jax.device_put(rng.integers(0, vocab, (8, seq + 1)).astype(np.int32), batch)  # noqa: E731
    for _ in range(steps):
        step(model, opt, draw(), probe)
    return opt, lambda: np.asarray(step(model, opt, draw(), probe))
