"""Ready mappings from JAX parameter layouts to Hugging Face ``transformers`` models.

Each preset is a function of a model config (a ``transformers`` config object or a plain dict
with the same field names) that returns a :class:`bridges.mapping.Mapping` from the JAX
checkpoint (source, ``/`` paths) to the torch state dict ``{"model": model.state_dict(),
"optim": optimizer state}`` (target). Load with ``bridges.torch.load(url, target, mapping=m)``;
save torch -> JAX with ``bridges.torch.save(url, state, mapping=m)``; restore a torch checkpoint
into JAX with ``bridges.jax.restore(url, target, mapping=m.inverse())``. The library ships no
model definitions: the presets name the layout a JAX model must have (tables below).

* :func:`hf_llama_from_nnx`: ``LlamaForCausalLM`` (and ``MistralForCausalLM``,
  ``Qwen2ForCausalLM``: sliding windows and the like do not change weights; Qwen2's q/k/v biases
  do) from a Flax NNX decoder whose per-layer parameters are stacked on axis 0 (``nnx.vmap`` to
  build, ``nnx.scan`` to run), attention as ``nnx.LinearGeneral`` kernels.
* :func:`hf_llama_from_maxtext`: the same HF models from MaxText's scanned parameter tree.
* :func:`hf_gpt2_from_nnx`: ``GPT2LMHeadModel`` (Conv1D weights stored (in, out), fused
  ``c_attn``) from a Flax NNX GPT-2 with separate q/k/v.

Adam moments (optax ``mu``/``nu`` -> torch AdamW ``exp_avg``/``exp_avg_sq``) follow their
parameters through the same transforms; optax's one ``count`` feeds every torch ``step``.

MaxText facts relied on (read from AI-Hypercomputer/maxtext):

* ``MaxText/layers/attentions.py``: ``query`` is ``DenseGeneral(features=(num_query_heads,
  head_dim), kernel_axes=("embed", "heads", "kv"))``: kernel (embed, heads, head_dim); ``key`` /
  ``value`` (embed, kv_heads, head_dim); ``out`` ``DenseGeneral(axis=(-2, -1))``: kernel (heads,
  head_dim, embed). ``query_init`` divides the kernel init by ``sqrt(head_dim)`` and
  ``qk_product`` applies no ``1/sqrt(head_dim)``: the query kernel is pre-scaled. The default
  ``RotaryEmbedding`` rotates split halves (``jnp.split(inputs, 2, axis=-1)``);
  ``LLaMARotaryEmbedding`` (``MaxText/layers/embeddings.py``), chosen when ``model_name`` or
  ``rope_type`` starts with ``llama3.1``, rotates interleaved pairs.
* ``MaxText/llama_or_mistral_ckpt.py``: the parameter names (``decoder/layers/self_attention/
  {query,key,value,out}/kernel``, ``decoder/layers/mlp/{wi_0,wi_1,wo}/kernel``,
  ``decoder/layers/{pre,post}_self_attention_layer_norm/scale``, ``decoder/decoder_norm/scale``,
  ``decoder/logits_dense/kernel``, ``token_embedder/embedding``); scanned layers stacked on axis
  1 (query ``(embed, layer, q, head_dim)``, out ``(heads, layer, head_dim, embed)``, mlp ``wi_*``
  ``(embed, layer, mlp)``, ``wo`` ``(mlp, layer, embed)``, norms ``(embed, layer)``); the query
  kernel divided by ``sqrt(head_dim)``; ``permute_to_match_maxtext_rope`` (evens then odds); and
  ``TrainState(params={"params": weights})``, so key paths read ``params/params/decoder/...``.
* ``src/MaxText/utils/ckpt_conversion/strategies/llama.py`` (``LlamaMapper``, Llama 3.1 <-> HF):
  ``scale_query_layer`` multiplies by ``sqrt(head_dim)`` in float32 to HF; ``adjust_rope`` turns
  MaxText's interleaved q/k rows into HF's halves (evens, then odds); ``reshape_kernel``
  transposes and reshapes. MaxText's tests of its HF loader use ``param_scan_axis=1``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .mapping import (STEP_CAST, Concat, Mapping, Merge, Reorder, Rule, Scale, Select, Transform, Transpose,
                      interleaved_to_halves)

__all__ = ["hf_llama_from_nnx", "hf_llama_from_maxtext", "hf_gpt2_from_nnx", "llama_dims"]

ROPE_LAYOUTS = ("halves", "interleaved")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def llama_dims(config: Any) -> dict[str, Any]:
    """The sizes a Llama-family preset needs, from an HF config (object or dict)."""
    d = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    kv = int(_get(config, "num_key_value_heads", heads))
    qwen2 = _get(config, "model_type", "") == "qwen2"
    return dict(
        d=d, heads=heads, kv=kv, head_dim=int(_get(config, "head_dim", d // heads)),
        layers=int(_get(config, "num_hidden_layers")), ffn=int(_get(config, "intermediate_size")),
        vocab=int(_get(config, "vocab_size")), tied=bool(_get(config, "tie_word_embeddings", False)),
        qkv_bias=qwen2 or bool(_get(config, "attention_bias", False)),
        o_bias=(not qwen2) and bool(_get(config, "attention_bias", False)),
        mlp_bias=bool(_get(config, "mlp_bias", False)))


def _rope(rope: str, axis: int, head_dim: int) -> tuple[Transform, ...]:
    if rope not in ROPE_LAYOUTS:
        raise ValueError(f"rope must be one of {ROPE_LAYOUTS}, got {rope!r}")
    # HF Llama rotates split halves (rotate_half); interleaved pairs become halves by a row reorder.
    return (Reorder(axis, interleaved_to_halves(head_dim)),) if rope == "interleaved" else ()


def _mapping(entries: Sequence[tuple[Any, str, tuple[Transform, ...]]], model: tuple[str, str],
             optimizer: tuple[str, str] | None, moments: str, ignore: Sequence[str],
             keep: Sequence[str]) -> Mapping:
    """Rules for the parameters and, with ``optimizer``, their Adam moments and the step count.

    ``entries``: (source path(s) relative to the parameter tree, torch FQN pattern, transforms).
    ``moments``: the path under ``{optimizer}/mu`` that mirrors the parameter tree's root.
    """
    def under(prefix: str, src: Any) -> Any:
        join = (lambda s: f"{prefix}/{s}" if prefix else s)
        return join(src) if isinstance(src, str) else tuple(join(s) for s in src)

    src_m, dst_m = model
    rules = [Rule(under(src_m, s), f"{dst_m}/{t}", transforms=ops) for s, t, ops in entries]
    if optimizer is not None:
        src_o, dst_o = optimizer
        for moment, slot in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            base = "/".join(p for p in (src_o, moment, moments) if p)
            rules += [Rule(under(base, s), f"{dst_o}/{t}/{slot}", transforms=ops) for s, t, ops in entries]
        rules.append(Rule(f"{src_o}/count", f"{dst_o}/{{p}}/step", transforms=(STEP_CAST,)))  # int32 <-> float32
    return Mapping(tuple(rules), ignore=tuple(ignore), keep=tuple(keep), source_sep="/", target_sep=".")


def _llama_entries(dims: dict[str, Any], names: dict[str, str], rope: str) -> list[tuple[Any, str, tuple[Transform, ...]]]:
    """Entries of an NNX Llama decoder: every ``layers/...`` tensor has the layer axis first."""
    h, kv, hd = dims["heads"], dims["kv"], dims["head_dim"]
    sel = Select(0, "i", dims["layers"])
    lay = "model.layers.{i}"
    entries: list[tuple[Any, str, tuple[Transform, ...]]] = []
    for name, n, rotary in (("q", h, True), ("k", kv, True), ("v", kv, False)):
        # (L, d, n, hd) -> (d, n, hd) -> [rows within a head reordered] -> (d, n*hd) -> (n*hd, d)
        entries.append((names[f"{name}_kernel"], f"{lay}.self_attn.{name}_proj.weight",
                        (sel,) + (_rope(rope, 2, hd) if rotary else ()) + (Merge(1, (n, hd)), Transpose((1, 0)))))
        if dims["qkv_bias"]:  # (L, n, hd) -> (n*hd,)
            entries.append((names[f"{name}_bias"], f"{lay}.self_attn.{name}_proj.bias",
                            (sel,) + (_rope(rope, 1, hd) if rotary else ()) + (Merge(0, (n, hd)),)))
    entries.append((names["o_kernel"], f"{lay}.self_attn.o_proj.weight", (sel, Merge(0, (h, hd)), Transpose((1, 0)))))
    if dims["o_bias"]:
        entries.append((names["o_bias"], f"{lay}.self_attn.o_proj.bias", (sel,)))
    for name in ("gate", "up", "down"):
        entries.append((names[f"{name}_kernel"], f"{lay}.mlp.{name}_proj.weight", (sel, Transpose((1, 0)))))
        if dims["mlp_bias"]:
            entries.append((names[f"{name}_bias"], f"{lay}.mlp.{name}_proj.bias", (sel,)))
    entries += [
        (names["attn_norm"], f"{lay}.input_layernorm.weight", (sel,)),
        (names["mlp_norm"], f"{lay}.post_attention_layernorm.weight", (sel,)),
        (names["embed"], "model.embed_tokens.weight", ()),
        (names["norm"], "model.norm.weight", ()),
        (names["embed"], "lm_head.weight", ()) if dims["tied"] else (names["lm_head"], "lm_head.weight", (Transpose((1, 0)),)),
    ]
    return entries


#: The Flax NNX Llama layout :func:`hf_llama_from_nnx` expects (paths under the model's state;
#: every ``layers/...`` tensor has the stacked layer axis first).
LLAMA_NNX_NAMES: dict[str, str] = {
    "embed": "embed/embedding",                 # (vocab, d)
    "q_kernel": "layers/attn/q/kernel",         # (L, d, heads, head_dim)      nnx.LinearGeneral
    "k_kernel": "layers/attn/k/kernel",         # (L, d, kv_heads, head_dim)
    "v_kernel": "layers/attn/v/kernel",         # (L, d, kv_heads, head_dim)
    "o_kernel": "layers/attn/o/kernel",         # (L, heads, head_dim, d)      axis=(-2, -1)
    "q_bias": "layers/attn/q/bias",             # (L, heads, head_dim)         Qwen2 / attention_bias
    "k_bias": "layers/attn/k/bias",
    "v_bias": "layers/attn/v/bias",
    "o_bias": "layers/attn/o/bias",             # (L, d)
    "gate_kernel": "layers/mlp/gate/kernel",    # (L, d, ffn)
    "up_kernel": "layers/mlp/up/kernel",        # (L, d, ffn)
    "down_kernel": "layers/mlp/down/kernel",    # (L, ffn, d)
    "gate_bias": "layers/mlp/gate/bias", "up_bias": "layers/mlp/up/bias", "down_bias": "layers/mlp/down/bias",
    "attn_norm": "layers/attn_norm/scale",      # (L, d)   RMSNorm before attention
    "mlp_norm": "layers/mlp_norm/scale",        # (L, d)   RMSNorm before the MLP
    "norm": "norm/scale",                       # (d,)
    "lm_head": "lm_head/kernel",                # (d, vocab)   untied head
}


def hf_llama_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                      optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                      rope: str = "halves", names: dict[str, str] | None = None,
                      ignore: Sequence[str] = ("optimizer/step",),
                      keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """Mapping from a Flax NNX Llama-family decoder (``nnx.scan`` layout) to HF ``LlamaForCausalLM``.

    ``config``: the HF config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config`` or a dict).
    The NNX layout is :data:`LLAMA_NNX_NAMES` (override paths with ``names``): per-layer tensors
    stacked on axis 0; q/k/v kernels (d, heads, head_dim) become ``{q,k,v}_proj.weight``
    (heads*head_dim, d) by merging (heads, head_dim) in that order and transposing; the o kernel
    (heads, head_dim, d) becomes ``o_proj.weight`` (d, heads*head_dim). ``rope``: how the JAX
    model pairs the rotary dimensions of q and k within a head: ``"halves"`` (HF's own
    ``rotate_half``: no change) or ``"interleaved"`` (pairs (0, 1), (2, 3), ...: rows reordered).
    ``model`` / ``optimizer``: (checkpoint prefix, torch state prefix) of the parameters and of
    optax's ``ScaleByAdamState`` (element 0 of an adamw chain); None for weights only.
    Raises ValueError for an unknown ``rope`` and KeyError/TypeError for a config without the
    sizes; a checkpoint whose tensors do not fit raises MappingError at load, naming the rule.
    """
    dims = llama_dims(config)
    table = dict(LLAMA_NNX_NAMES, **(names or {}))
    entries = _llama_entries(dims, table, rope)
    return _mapping(entries, model, optimizer, "", ignore, keep)


def hf_llama_from_maxtext(config: Any, *, params: str = "params/params",
                          optimizer: tuple[str, str] | None = ("opt_state/0", "optim/state"),
                          model: str = "model", rope: str = "interleaved", scan_axis: int = 1,
                          allow_inexact_save: bool = False,
                          ignore: Sequence[str] = ("step",), keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """Mapping from MaxText's scanned Llama/Mistral parameter tree to HF ``LlamaForCausalLM``.

    ``params``: where MaxText's Linen variables sit in the checkpoint (a MaxText ``TrainState``
    saved with ``bridges.jax.save`` renders ``params={"params": tree}`` as ``params/params/...``);
    the Adam moments are then under ``{optimizer[0]}/mu/params/...``. ``scan_axis``: MaxText's
    ``param_scan_axis`` (1 by default). ``rope``: ``"interleaved"`` for models MaxText runs with
    ``LLaMARotaryEmbedding`` (``llama3.1`` rope type; its own HF conversion reorders q/k rows),
    ``"halves"`` for its default ``RotaryEmbedding`` (Llama 2, Mistral). The query kernel is
    multiplied by ``sqrt(head_dim)`` (MaxText pre-scales it); saving torch -> MaxText divides, which
    is exact only for a power-of-two ``sqrt(head_dim)`` (head_dim 4, 16, 64, 256): otherwise the
    save is refused unless ``allow_inexact_save=True`` accepts the rounding.
    Raises ValueError for an unknown ``rope`` or ``scan_axis``; a tree that does not fit raises
    MappingError at load, naming the rule.
    """
    dims = llama_dims(config)
    if scan_axis not in (0, 1):
        raise ValueError(f"scan_axis must be 0 or 1, got {scan_axis}")
    scale = Scale(math.sqrt(dims["head_dim"]), allow_inexact_inverse=allow_inexact_save)
    table = {
        "embed": "token_embedder/embedding", "norm": "decoder/decoder_norm/scale",
        "lm_head": "decoder/logits_dense/kernel",
        "q_kernel": "decoder/layers/self_attention/query/kernel",
        "k_kernel": "decoder/layers/self_attention/key/kernel",
        "v_kernel": "decoder/layers/self_attention/value/kernel",
        "o_kernel": "decoder/layers/self_attention/out/kernel",
        "gate_kernel": "decoder/layers/mlp/wi_0/kernel", "up_kernel": "decoder/layers/mlp/wi_1/kernel",
        "down_kernel": "decoder/layers/mlp/wo/kernel",
        "attn_norm": "decoder/layers/pre_self_attention_layer_norm/scale",
        "mlp_norm": "decoder/layers/post_self_attention_layer_norm/scale",
    }
    dims = dict(dims, qkv_bias=False, o_bias=False, mlp_bias=False)  # MaxText's Llama has no biases
    entries = _maxtext_entries(dims, table, scan_axis, rope, scale)
    moments = params.split("/", 1)[1] if "/" in params else ""
    return _mapping(entries, (params, model), optimizer, moments, ignore, keep)


def _maxtext_entries(dims: dict[str, Any], names: dict[str, str], axis: int, rope: str,
                     scale: Transform) -> list[tuple[Any, str, tuple[Transform, ...]]]:
    """MaxText's layer tensors carry the layer axis at ``axis`` (1: after their first axis)."""
    h, kv, hd, L = dims["heads"], dims["kv"], dims["head_dim"], dims["layers"]
    sel = Select(axis, "i", L)
    lay = "model.layers.{i}"
    entries = [
        (names["q_kernel"], f"{lay}.self_attn.q_proj.weight",
         (sel,) + _rope(rope, 2, hd) + (Merge(1, (h, hd)), Transpose((1, 0)), scale)),
        (names["k_kernel"], f"{lay}.self_attn.k_proj.weight",
         (sel,) + _rope(rope, 2, hd) + (Merge(1, (kv, hd)), Transpose((1, 0)))),
        (names["v_kernel"], f"{lay}.self_attn.v_proj.weight", (sel, Merge(1, (kv, hd)), Transpose((1, 0)))),
        (names["o_kernel"], f"{lay}.self_attn.o_proj.weight", (sel, Merge(0, (h, hd)), Transpose((1, 0)))),
        (names["gate_kernel"], f"{lay}.mlp.gate_proj.weight", (sel, Transpose((1, 0)))),
        (names["up_kernel"], f"{lay}.mlp.up_proj.weight", (sel, Transpose((1, 0)))),
        (names["down_kernel"], f"{lay}.mlp.down_proj.weight", (sel, Transpose((1, 0)))),
        (names["attn_norm"], f"{lay}.input_layernorm.weight", (sel,)),
        (names["mlp_norm"], f"{lay}.post_attention_layernorm.weight", (sel,)),
        (names["embed"], "model.embed_tokens.weight", ()),
        (names["norm"], "model.norm.weight", ()),
        (names["lm_head"], "lm_head.weight", (Transpose((1, 0)),)),
    ]
    if dims["tied"]:
        entries[-1] = (names["embed"], "lm_head.weight", ())
    return entries


#: The Flax NNX GPT-2 layout :func:`hf_gpt2_from_nnx` expects (``h/...`` stacked on axis 0).
GPT2_NNX_NAMES: dict[str, str] = {
    "wte": "wte/embedding",              # (vocab, d); the head is tied to it, as in HF
    "wpe": "wpe/embedding",              # (positions, d)
    "ln_1": "h/ln_1",                    # scale, bias (L, d)
    "q": "h/attn/q", "k": "h/attn/k", "v": "h/attn/v",  # nnx.Linear: kernel (L, d, d), bias (L, d)
    "attn_proj": "h/attn/proj",          # kernel (L, d, d), bias (L, d)
    "ln_2": "h/ln_2",
    "fc": "h/mlp/fc",                    # kernel (L, d, 4d), bias (L, 4d)
    "mlp_proj": "h/mlp/proj",            # kernel (L, 4d, d), bias (L, d)
    "ln_f": "ln_f",                      # scale, bias (d,)
}


def hf_gpt2_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                     optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                     names: dict[str, str] | None = None, ignore: Sequence[str] = ("optimizer/step",),
                     keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """Mapping from a Flax NNX GPT-2 (layers stacked on axis 0) to HF ``GPT2LMHeadModel``.

    HF's ``Conv1D`` stores weights (in, out), as Flax kernels are: no transposes. Its fused
    ``c_attn`` (d, 3d) is the concatenation of the q, k, v kernels along the output axis (and
    ``c_attn.bias`` of their biases); a torch -> JAX save splits it back. ``lm_head.weight`` is
    tied to ``wte``: both read ``wte/embedding``. A checkpoint that does not fit raises
    MappingError at load, naming the rule.
    """
    n = dict(GPT2_NNX_NAMES, **(names or {}))
    L, d = int(_get(config, "n_layer")), int(_get(config, "n_embd"))
    sel = Select(0, "i", L)
    h = "transformer.h.{i}"
    entries: list[tuple[Any, str, tuple[Transform, ...]]] = [
        (n["wte"], "transformer.wte.weight", ()), (n["wte"], "lm_head.weight", ()),
        (n["wpe"], "transformer.wpe.weight", ()),
        ((f"{n['q']}/kernel", f"{n['k']}/kernel", f"{n['v']}/kernel"), f"{h}.attn.c_attn.weight",
         (sel, Concat(1, (d, d, d)))),
        ((f"{n['q']}/bias", f"{n['k']}/bias", f"{n['v']}/bias"), f"{h}.attn.c_attn.bias",
         (sel, Concat(0, (d, d, d)))),
        (f"{n['ln_f']}/scale", "transformer.ln_f.weight", ()), (f"{n['ln_f']}/bias", "transformer.ln_f.bias", ()),
    ]
    for src, dst in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
        entries += [(f"{n[src]}/scale", f"{h}.{dst}.weight", (sel,)), (f"{n[src]}/bias", f"{h}.{dst}.bias", (sel,))]
    for src, dst in (("attn_proj", "attn.c_proj"), ("fc", "mlp.c_fc"), ("mlp_proj", "mlp.c_proj")):
        entries += [(f"{n[src]}/kernel", f"{h}.{dst}.weight", (sel,)), (f"{n[src]}/bias", f"{h}.{dst}.bias", (sel,))]
    return _mapping(entries, model, optimizer, "", ignore, keep)
