"""What every Hugging Face preset of :mod:`bridges.presets` is built from: the config reader, the
rotary layouts, the name tables' overrides (``names=``), the Llama-family entries and the one
function that turns entries into a :class:`~bridges.mapping.Mapping`."""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._chain import InvalidRuleError
from bridges.mapping._mapping import Mapping, Merge, MomentLayout, with_moments, Reorder, Rule, Select, Transform, Transpose, interleaved_to_halves, optimizer_step_rules


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


def _names(defaults: dict[str, str], names: dict[str, str] | None, preset: str) -> dict[str, str]:
    """The preset's name table with the user's ``names``; InvalidRuleError (a CheckpointError and a
    ValueError) for a name key it lacks or a name that is not a path string."""
    unknown = sorted(set(names or {}) - set(defaults))
    if unknown:
        raise InvalidRuleError(f"{preset}: unknown name key(s) {unknown}", key=unknown[0], object=preset,
                               expected=sorted(defaults), found=unknown)
    bad = [k for k, v in (names or {}).items() if not isinstance(v, str) or not v]
    if bad:
        raise InvalidRuleError(f"{preset}: a name must be a non-empty path string", key=bad[0], object=preset,
                               expected="a non-empty path string", found=repr((names or {})[bad[0]])[:80])
    return dict(defaults, **(names or {}))


def _rope(rope: str, axis: int, head_dim: int) -> tuple[Transform, ...]:
    if rope not in ROPE_LAYOUTS:
        raise ValueError(f"rope must be one of {ROPE_LAYOUTS}, got {rope!r}")
    # HF Llama rotates split halves (rotate_half); interleaved pairs become halves by a row reorder.
    return (Reorder(axis, interleaved_to_halves(head_dim)),) if rope == "interleaved" else ()


def _mapping(entries: Sequence[tuple[Any, str, tuple[Transform, ...]]], model: tuple[str, str],
             optimizer: tuple[str, str] | None, moments: str, ignore: Sequence[str],
             keep: Sequence[str], step: tuple[str, str] | None = None) -> Mapping:
    """Rules for the parameters and, with ``optimizer``, their Adam moments and the step count.

    ``entries``: (source path(s) relative to the parameter tree, torch FQN pattern, transforms).
    ``moments``: the path under ``{optimizer}/mu`` that mirrors the parameter tree's root.
    ``step``: (checkpoint key, dtype) of the framework's own update counter, or None.
    """
    def under(prefix: str, src: Any) -> Any:
        join = (lambda s: f"{prefix}/{s}" if prefix else s)
        return join(src) if isinstance(src, str) else tuple(join(s) for s in src)

    src_m, dst_m = model
    rules = [Rule(under(src_m, s), f"{dst_m}/{t}", transforms=ops) for s, t, ops in entries]
    if optimizer is not None:
        src_o, dst_o = optimizer
        source = MomentLayout(src_m, "/".join(p for p in (src_o, "{slot}", moments, "{path}") if p), ("mu", "nu"))
        target = MomentLayout(dst_m, f"{dst_o}/{{path}}/{{slot}}", ("exp_avg", "exp_avg_sq"))
        triples = [with_moments(r, source, target) for r in rules]
        rules += [t[1] for t in triples] + [t[2] for t in triples]
        rules += optimizer_step_rules(src_o, dst_o, step)
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
