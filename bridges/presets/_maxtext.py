"""The MaxText presets of :mod:`bridges.presets`: Hugging Face models from MaxText's scanned
parameter trees (Llama/Mistral, Qwen3, Gemma 2, Mixtral). Import them from ``bridges.presets``.

MaxText facts relied on (read from AI-Hypercomputer/maxtext, ``src/MaxText/utils/ckpt_conversion/
strategies/{llama,qwen,gemma,mixtral}.py``, the ``*Mapper`` classes of its HF converter; the
Llama facts are listed in :mod:`bridges.presets`):

* every scanned tensor carries the layer axis at ``param_scan_axis`` (1 in MaxText's HF tests);
  kernels are reshaped and transposed as for Llama (``reshape_kernel``).
* Qwen3 (``QwenMapper``): Llama's names plus ``self_attention/{query,key}_norm/scale``
  (head_dim, layer); no query scaling and no rotary reorder (split halves); MoE tensors
  ``moe_block/{gate/kernel,wi_0,wi_1,wo}`` with experts before the layer axis.
* Gemma 2 (``Gemma2Mapper``): one MaxText layer is a PAIR of HF layers: ``*_local`` names the
  even HF layer, ``*_global`` the odd one (``self_attention_{local,global}/{query,key,value,
  out}/kernel``, ``mlp_{local,global}/wi_0,wi_1,wo``, ``{pre,post}_self_attention_norm_*``,
  ``{pre,post}_ffw_norm_*``); every norm scale is stored plus one (``scale_rmsnorm_layer``); the
  embedding times ``float32(sqrt(hidden_size))`` (``pad_hf_embedding_layer``; the head is tied);
  the query kernel divided by ``sqrt(head_dim)`` (``scale_query_layer``); no rotary reorder.
* Mixtral (``MixtralMapper``): Llama's attention and norms, ``MoeBlock_0/gate/kernel`` (d, layer,
  E) and ``MoeBlock_0/wi_0`` (w1), ``wi_1`` (w3), ``wo`` (w2), shaped (E, layer, ...) (experts
  first, "outer loop as experts"); the query kernel divided by ``sqrt(head_dim)``; no rotary reorder.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from bridges.mapping._mapping import Concat, Mapping, Merge, Reorder, Scale, Select, Shift, Transform, Transpose
from bridges.presets._base import _get, _mapping, _names, _rope, llama_dims
from bridges.presets._moe import EXPERT_LAYOUTS

Entries = list[tuple[Any, str, tuple[Transform, ...]]]

#: MaxText's scanned Llama tree as :func:`hf_llama_from_maxtext` expects it (paths under ``params``;
#: the layer axis of ``decoder/layers/...`` at ``scan_axis``).
MAXTEXT_LLAMA_NAMES: dict[str, str] = {
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
#: MaxText's scanned Qwen3 tree: :data:`MAXTEXT_LLAMA_NAMES` plus the per-head q/k norms (head_dim, layer).
MAXTEXT_QWEN3_NAMES: dict[str, str] = dict(MAXTEXT_LLAMA_NAMES, **{
    "q_norm": "decoder/layers/self_attention/query_norm/scale",
    "k_norm": "decoder/layers/self_attention/key_norm/scale",
})
#: MaxText's scanned Mixtral tree: Llama's attention and norms, the MoE block (experts first).
MAXTEXT_MIXTRAL_NAMES: dict[str, str] = dict({k: v for k, v in MAXTEXT_LLAMA_NAMES.items() if "/mlp/" not in v}, **{
    "router_kernel": "decoder/layers/MoeBlock_0/gate/kernel",   # (d, layer, E)
    "gate_kernel": "decoder/layers/MoeBlock_0/wi_0",            # (E, layer, d, ffn)   w1
    "up_kernel": "decoder/layers/MoeBlock_0/wi_1",              # (E, layer, d, ffn)   w3
    "down_kernel": "decoder/layers/MoeBlock_0/wo",              # (E, layer, ffn, d)   w2
})
_GEMMA2_PARTS = {"q_kernel": "self_attention_{}/query/kernel", "k_kernel": "self_attention_{}/key/kernel",
                 "v_kernel": "self_attention_{}/value/kernel", "o_kernel": "self_attention_{}/out/kernel",
                 "gate_kernel": "mlp_{}/wi_0/kernel", "up_kernel": "mlp_{}/wi_1/kernel", "down_kernel": "mlp_{}/wo/kernel",
                 "attn_norm": "pre_self_attention_norm_{}/scale", "post_attn_norm": "post_self_attention_norm_{}/scale",
                 "mlp_norm": "pre_ffw_norm_{}/scale", "post_mlp_norm": "post_ffw_norm_{}/scale"}
#: MaxText's scanned Gemma 2 tree: each scanned layer holds a local (even HF layer) and a global
#: (odd HF layer) block; norm scales stored plus one, the embedding times sqrt(hidden_size).
MAXTEXT_GEMMA2_NAMES: dict[str, str] = dict(
    {"embed": "token_embedder/embedding", "norm": "decoder/decoder_norm/scale"},
    **{f"{k}_{kind}": f"decoder/layers/{v.format(kind)}" for kind in ("local", "global") for k, v in _GEMMA2_PARTS.items()})


def _scan_axis(axis: int) -> int:
    if axis not in (0, 1):
        raise ValueError(f"scan_axis must be 0 or 1, got {axis}")
    return axis


def _maxtext_entries(dims: dict[str, Any], names: dict[str, str], axis: int, rope: str,
                     scale: Transform | None, mlp: bool = True) -> Entries:
    """MaxText's layer tensors carry the layer axis at ``axis`` (1: after their first axis);
    ``scale``: the query kernel's (None: not pre-scaled); ``mlp``: the dense MLP's entries."""
    h, kv, hd, L = dims["heads"], dims["kv"], dims["head_dim"], dims["layers"]
    sel = Select(axis, "i", L)
    lay = "model.layers.{i}"
    q_scale = (scale,) if scale is not None else ()
    entries = [
        (names["q_kernel"], f"{lay}.self_attn.q_proj.weight",
         (sel,) + _rope(rope, 2, hd) + (Merge(1, (h, hd)), Transpose((1, 0))) + q_scale),
        (names["k_kernel"], f"{lay}.self_attn.k_proj.weight",
         (sel,) + _rope(rope, 2, hd) + (Merge(1, (kv, hd)), Transpose((1, 0)))),
        (names["v_kernel"], f"{lay}.self_attn.v_proj.weight", (sel, Merge(1, (kv, hd)), Transpose((1, 0)))),
        (names["o_kernel"], f"{lay}.self_attn.o_proj.weight", (sel, Merge(0, (h, hd)), Transpose((1, 0)))),
        (names["attn_norm"], f"{lay}.input_layernorm.weight", (sel,)),
        (names["mlp_norm"], f"{lay}.post_attention_layernorm.weight", (sel,)),
        (names["embed"], "model.embed_tokens.weight", ()),
        (names["norm"], "model.norm.weight", ()),
        (names["embed"], "lm_head.weight", ()) if dims["tied"] else
        (names["lm_head"], "lm_head.weight", (Transpose((1, 0)),)),
    ]
    if mlp:
        entries += [(names[f"{n}_kernel"], f"{lay}.mlp.{n}_proj.weight", (sel, Transpose((1, 0))))
                    for n in ("gate", "up", "down")]
    return entries


def _maxtext_mapping(entries: Entries, params: str, model: str, optimizer: tuple[str, str] | None,
                     ignore: Sequence[str], keep: Sequence[str]) -> Mapping:
    moments = params.split("/", 1)[1] if "/" in params else ""
    return _mapping(entries, (params, model), optimizer, moments, ignore, keep)


def hf_llama_from_maxtext(config: Any, *, params: str = "params/params",
                          optimizer: tuple[str, str] | None = ("opt_state/0", "optim/state"),
                          model: str = "model", rope: str = "interleaved", scan_axis: int = 1,
                          allow_inexact_save: bool = False,
                          ignore: Sequence[str] = ("step",), keep: Sequence[str] = ("optim/param_groups",),
                          names: dict[str, str] | None = None) -> Mapping:
    """Mapping from MaxText's scanned Llama/Mistral parameter tree to HF ``LlamaForCausalLM``.

    ``params``: where MaxText's Linen variables sit in the checkpoint (a MaxText ``TrainState``
    saved with ``bridges.jax.save`` renders ``params={"params": tree}`` as ``params/params/...``);
    the Adam moments are then under ``{optimizer[0]}/mu/params/...``. ``scan_axis``: MaxText's
    ``param_scan_axis`` (1 by default). ``rope``: ``"interleaved"`` for models MaxText runs with
    ``LLaMARotaryEmbedding`` (``llama3.1`` rope type; its own HF conversion reorders q/k rows),
    ``"halves"`` for its default ``RotaryEmbedding`` (Llama 2, Mistral). The query kernel is
    multiplied by ``sqrt(head_dim)`` (MaxText pre-scales it); saving torch -> MaxText divides, which
    is exact only for a power-of-two ``sqrt(head_dim)`` (head_dim 4, 16, 64, 256): otherwise the
    save is refused unless ``allow_inexact_save=True`` accepts the rounding. ``names`` overrides
    paths of :data:`MAXTEXT_LLAMA_NAMES` (relative to ``params``).
    Raises ValueError for an unknown ``rope``, ``scan_axis`` or name key; a tree that does not fit raises
    MappingError at load, naming the rule.
    """
    dims = llama_dims(config)
    axis = _scan_axis(scan_axis)
    scale = Scale(math.sqrt(dims["head_dim"]), allow_inexact_inverse=allow_inexact_save)
    table = _names(MAXTEXT_LLAMA_NAMES, names, "hf_llama_from_maxtext")
    dims = dict(dims, qkv_bias=False, o_bias=False, mlp_bias=False)  # MaxText's Llama has no biases
    return _maxtext_mapping(_maxtext_entries(dims, table, axis, rope, scale), params, model, optimizer, ignore, keep)


def hf_qwen3_from_maxtext(config: Any, *, params: str = "params/params",
                          optimizer: tuple[str, str] | None = ("opt_state/0", "optim/state"),
                          model: str = "model", rope: str = "halves", scan_axis: int = 1,
                          ignore: Sequence[str] = ("step",), keep: Sequence[str] = ("optim/param_groups",),
                          names: dict[str, str] | None = None) -> Mapping:
    """Mapping from MaxText's scanned Qwen3 tree to HF ``Qwen3ForCausalLM``: as
    :func:`hf_llama_from_maxtext` but the query kernel is NOT pre-scaled (the q norm would undo it)
    and the rotary layout is split halves by default; plus ``query_norm`` / ``key_norm``
    (head_dim, layer) -> ``self_attn.{q,k}_norm.weight`` (reordered with the rows they scale for
    ``rope="interleaved"``). Name table: :data:`MAXTEXT_QWEN3_NAMES`. ValueError for an unknown
    ``rope``, ``scan_axis`` or name key."""
    axis = _scan_axis(scan_axis)
    dims = dict(llama_dims(config), qkv_bias=False, o_bias=False, mlp_bias=False)
    table = _names(MAXTEXT_QWEN3_NAMES, names, "hf_qwen3_from_maxtext")
    sel = Select(axis, "i", dims["layers"])
    entries = _maxtext_entries(dims, table, axis, rope, None) + [
        (table[f"{n}_norm"], f"model.layers.{{i}}.self_attn.{n}_norm.weight", (sel,) + _rope(rope, 0, dims["head_dim"]))
        for n in ("q", "k")]
    return _maxtext_mapping(entries, params, model, optimizer, ignore, keep)


def _pairs(axis: int, layers: int) -> tuple[Transform, ...]:
    """(local, global) stacked over the P = layers / 2 scanned pairs -> HF layer ``i``: concatenated
    on the layer axis (locals, then globals), reordered so that HF layer 2p is local p and 2p + 1
    global p, then layer ``i`` selected."""
    half = layers // 2
    perm = tuple(j // 2 if j % 2 == 0 else half + j // 2 for j in range(layers))
    return (Concat(axis, (half, half)), Reorder(axis, perm), Select(axis, "i", layers))


def hf_gemma2_from_maxtext(config: Any, *, params: str = "params/params",
                           optimizer: tuple[str, str] | None = ("opt_state/0", "optim/state"),
                           model: str = "model", rope: str = "halves", scan_axis: int = 1,
                           allow_inexact_save: bool = False,
                           ignore: Sequence[str] = ("step",), keep: Sequence[str] = ("optim/param_groups",),
                           names: dict[str, str] | None = None) -> Mapping:
    """Mapping from MaxText's scanned Gemma 2 tree to HF ``Gemma2ForCausalLM``.

    Each of MaxText's ``num_hidden_layers / 2`` scanned layers holds a ``*_local`` block (HF layer
    2p) and a ``*_global`` block (HF layer 2p + 1): every HF layer tensor reads both, joined and
    reordered (one rule, exact inverse). Norm scales: HF's = MaxText's - 1 (``Shift(-1)``);
    embedding (and the tied head): HF's = MaxText's / float32(sqrt(hidden_size)); query kernel:
    times sqrt(head_dim). Saving torch -> MaxText inverts these; the ones that do not come back
    bit for bit (sqrt not a power of two, a norm scale near 0) are refused unless
    ``allow_inexact_save=True``. Name table: :data:`MAXTEXT_GEMMA2_NAMES`. ValueError for an odd
    layer count, an unknown ``rope``, ``scan_axis`` or name key."""
    axis = _scan_axis(scan_axis)
    dims = dict(llama_dims(config), tied=True)
    L, h, kv, hd, d = dims["layers"], dims["heads"], dims["kv"], dims["head_dim"], dims["d"]
    if L % 2:
        raise ValueError(f"hf_gemma2_from_maxtext: MaxText pairs local and global layers, so "
                         f"num_hidden_layers must be even, got {L}")
    table = _names(MAXTEXT_GEMMA2_NAMES, names, "hf_gemma2_from_maxtext")
    both = lambda key: (table[f"{key}_local"], table[f"{key}_global"])  # noqa: E731
    pair, lay = _pairs(axis, L), "model.layers.{i}"
    norm = Shift(-1.0, allow_inexact_inverse=allow_inexact_save)
    q_scale = Scale(math.sqrt(hd), allow_inexact_inverse=allow_inexact_save)
    emb = Scale(float(math.sqrt(d)), divide=True, allow_inexact_inverse=allow_inexact_save)
    entries: Entries = [
        (both("q_kernel"), f"{lay}.self_attn.q_proj.weight",
         pair + _rope(rope, 2, hd) + (Merge(1, (h, hd)), Transpose((1, 0)), q_scale)),
        (both("k_kernel"), f"{lay}.self_attn.k_proj.weight",
         pair + _rope(rope, 2, hd) + (Merge(1, (kv, hd)), Transpose((1, 0)))),
        (both("v_kernel"), f"{lay}.self_attn.v_proj.weight", pair + (Merge(1, (kv, hd)), Transpose((1, 0)))),
        (both("o_kernel"), f"{lay}.self_attn.o_proj.weight", pair + (Merge(0, (h, hd)), Transpose((1, 0)))),
        (table["embed"], "model.embed_tokens.weight", (emb,)), (table["embed"], "lm_head.weight", (emb,)),
        (table["norm"], "model.norm.weight", (norm,))]
    entries += [(both(f"{n}_kernel"), f"{lay}.mlp.{n}_proj.weight", pair + (Transpose((1, 0)),))
                for n in ("gate", "up", "down")]
    entries += [(both(key), f"{lay}.{hf}.weight", pair + (norm,)) for key, hf in (
        ("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
        ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))]
    return _maxtext_mapping(entries, params, model, optimizer, ignore, keep)


def hf_mixtral_from_maxtext(config: Any, *, experts: str = "fused", params: str = "params/params",
                            optimizer: tuple[str, str] | None = ("opt_state/0", "optim/state"),
                            model: str = "model", rope: str = "halves", scan_axis: int = 1,
                            allow_inexact_save: bool = False,
                            ignore: Sequence[str] = ("step",), keep: Sequence[str] = ("optim/param_groups",),
                            names: dict[str, str] | None = None) -> Mapping:
    """Mapping from MaxText's scanned Mixtral tree to HF ``MixtralForCausalLM``: attention and
    norms as :func:`hf_llama_from_maxtext` (pre-scaled query; split-halves rotary by default, as
    MaxText's Mixtral converter reorders nothing); the router ``MoeBlock_0/gate/kernel`` (d,
    layer, E) -> ``gate.weight`` (E, d); experts ``MoeBlock_0/wi_0`` / ``wi_1`` / ``wo`` (E, layer,
    ...) with the layer axis at ``scan_axis`` -> ``experts="fused"`` (the model's
    ``mlp.experts.gate_up_proj`` / ``down_proj``) or ``"per_expert"`` (the files'
    ``block_sparse_moe.experts.{j}.w1/w3/w2.weight``). Name table: :data:`MAXTEXT_MIXTRAL_NAMES`.
    ValueError for an unknown ``experts``, ``rope``, ``scan_axis`` or name key."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    axis = _scan_axis(scan_axis)
    dims = dict(llama_dims(config), qkv_bias=False, o_bias=False, mlp_bias=False)
    L, E, ff = dims["layers"], int(_get(config, "num_local_experts")), dims["ffn"]
    table = _names(MAXTEXT_MIXTRAL_NAMES, names, "hf_mixtral_from_maxtext")
    scale = Scale(math.sqrt(dims["head_dim"]), allow_inexact_inverse=allow_inexact_save)
    entries = _maxtext_entries(dims, table, axis, rope, scale, mlp=False)
    # experts first: with the layer axis at 1, (E, L, ...); at 0, (L, E, ...); one layer -> (E, ...)
    sel, lay = Select(axis, "i", L), "model.layers.{i}"
    gate, up, down = (table[f"{n}_kernel"] for n in ("gate", "up", "down"))
    if experts == "fused":
        entries += [((gate, up), f"{lay}.mlp.experts.gate_up_proj", (sel, Transpose((0, 2, 1)), Concat(1, (ff, ff)))),
                    (down, f"{lay}.mlp.experts.down_proj", (sel, Transpose((0, 2, 1))))]
    else:
        one = (sel, Select(0, "j", E), Transpose((1, 0)))
        entries += [(src, f"{lay}.block_sparse_moe.experts.{{j}}.{w}.weight", one)
                    for src, w in zip((gate, up, down), ("w1", "w3", "w2"))]
    router = f"{lay}.{'block_sparse_moe' if experts == 'per_expert' else 'mlp'}.gate.weight"
    entries.append((table["router_kernel"], router, (sel, Transpose((1, 0)))))
    return _maxtext_mapping(entries, params, model, optimizer, ignore, keep)
