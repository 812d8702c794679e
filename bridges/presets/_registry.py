"""The implementation behind :mod:`bridges.presets` (its face re-exports the public names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from bridges.mapping._mapping import Concat, Mapping, Select, Transform

#: The preset functions are spelled out here as well as in :data:`REGISTRY` because static readers
#: (the API reference's griffe, type checkers) cannot follow an ``__all__`` built at import;
#: tests/test_preset_registry.py fails when the two differ, so the registry stays the one source.
__all__ = ["Preset", "Source", "NNX", "MAXTEXT", "REGISTRY", "MIXTRAL_NNX_NAMES", "QWEN2_MOE_NNX_NAMES", "llama_dims",
           "LLAMA_NNX_NAMES", "MAXTEXT_LLAMA_NAMES", "MAXTEXT_QWEN3_NAMES", "MAXTEXT_GEMMA2_NAMES", "MAXTEXT_MIXTRAL_NAMES",
           "GPT2_NNX_NAMES", "QWEN3_NNX_NAMES", "GEMMA2_NNX_NAMES", "GEMMA3_NNX_NAMES", "NAME_TABLES", "names_markdown",
           "hf_llama_from_nnx", "hf_llama_from_maxtext", "hf_gpt2_from_nnx", "hf_qwen3_from_nnx", "hf_gemma2_from_nnx",
           "hf_mixtral_from_nnx", "hf_qwen2_moe_from_nnx", "hf_gemma3_from_nnx", "hf_qwen3_from_maxtext",
           "hf_gemma2_from_maxtext", "hf_mixtral_from_maxtext", "TORCHTITAN", "TORCHTITAN_LLAMA3_NAMES",
           "TORCHTITAN_QWEN3_NAMES", "hf_llama_from_torchtitan", "hf_qwen3_from_torchtitan",
           "QWEN3_MOE_NNX_NAMES", "hf_qwen3_moe_from_nnx", "GPT_OSS_NNX_NAMES", "hf_gpt_oss_from_nnx",
           "DEEPSEEK_V3_NNX_NAMES", "hf_deepseek_v3_from_nnx", "LLAMA4_NNX_NAMES", "hf_llama4_from_nnx"]

from bridges.presets._base import (ROPE_LAYOUTS, LLAMA_NNX_NAMES, _get, _llama_entries, _mapping, _names, _rope,  # noqa: F401
                            llama_dims)

def hf_llama_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                      optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                      rope: str = "halves", names: dict[str, str] | None = None,
                      ignore: Sequence[str] = ("optimizer/step",),
                      keep: Sequence[str] = ("optim/param_groups",),
                      step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
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
    ``step``: (checkpoint key, dtype) of ``nnx.Optimizer``'s counter, which a torch save writes
    from torch's ``step`` (None: not written). Raises ValueError for an unknown ``rope`` and KeyError/TypeError for a config without the
    sizes; a checkpoint whose tensors do not fit raises MappingError at load, naming the rule.
    """
    dims = llama_dims(config)
    table = _names(LLAMA_NNX_NAMES, names, "hf_llama_from_nnx")
    entries = _llama_entries(dims, table, rope)
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


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
                     keep: Sequence[str] = ("optim/param_groups",),
                     step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX GPT-2 (layers stacked on axis 0) to HF ``GPT2LMHeadModel``.

    HF's ``Conv1D`` stores weights (in, out), as Flax kernels are: no transposes. Its fused
    ``c_attn`` (d, 3d) is the concatenation of the q, k, v kernels along the output axis (and
    ``c_attn.bias`` of their biases); a torch -> JAX save splits it back. ``lm_head.weight`` is
    tied to ``wte``: both read ``wte/embedding``. ``step`` as for :func:`hf_llama_from_nnx`. A
    checkpoint that does not fit raises MappingError at load, naming the rule.
    """
    n = _names(GPT2_NNX_NAMES, names, "hf_gpt2_from_nnx")
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
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


#: The Flax NNX Qwen3 layout :func:`hf_qwen3_from_nnx` expects: :data:`LLAMA_NNX_NAMES` plus the
#: per-head RMSNorms of q and k (applied to each head's q/k before the rotary embedding).
QWEN3_NNX_NAMES: dict[str, str] = dict(LLAMA_NNX_NAMES, **{
    "q_norm": "layers/attn/q_norm/scale",       # (L, head_dim)
    "k_norm": "layers/attn/k_norm/scale",       # (L, head_dim)
})


def hf_qwen3_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                      optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                      rope: str = "halves", names: dict[str, str] | None = None,
                      ignore: Sequence[str] = ("optimizer/step",),
                      keep: Sequence[str] = ("optim/param_groups",),
                      step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Qwen3 decoder (``nnx.scan`` layout) to HF ``Qwen3ForCausalLM``.

    As :func:`hf_llama_from_nnx` (same arguments, ``attention_bias`` read from the config), plus
    ``q_norm`` / ``k_norm`` (L, head_dim) -> ``self_attn.{q,k}_norm.weight`` (head_dim,): an
    RMSNorm scales each element of a head, so with ``rope="interleaved"`` its weights are
    reordered with the q/k rows they scale. Name table: :data:`QWEN3_NNX_NAMES`.
    """
    dims = llama_dims(config)
    table = _names(QWEN3_NNX_NAMES, names, "hf_qwen3_from_nnx")
    sel = Select(0, "i", dims["layers"])
    entries = _llama_entries(dims, table, rope) + [
        (table[f"{n}_norm"], f"model.layers.{{i}}.self_attn.{n}_norm.weight", (sel,) + _rope(rope, 0, dims["head_dim"]))
        for n in ("q", "k")]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


#: The Flax NNX Gemma 2 layout :func:`hf_gemma2_from_nnx` expects (``layers/...`` stacked on axis
#: 0). Norm scales are stored as Gemma stores them: the norm multiplies by ``1 + scale``.
GEMMA2_NNX_NAMES: dict[str, str] = {
    "embed": "embed/embedding",                  # (vocab, d); the head is tied to it
    "q_kernel": "layers/attn/q/kernel",          # (L, d, heads, head_dim)
    "k_kernel": "layers/attn/k/kernel",          # (L, d, kv_heads, head_dim)
    "v_kernel": "layers/attn/v/kernel",          # (L, d, kv_heads, head_dim)
    "o_kernel": "layers/attn/o/kernel",          # (L, heads, head_dim, d)
    "gate_kernel": "layers/mlp/gate/kernel",     # (L, d, ffn)   GeGLU: gelu(x @ gate) * (x @ up)
    "up_kernel": "layers/mlp/up/kernel",         # (L, d, ffn)
    "down_kernel": "layers/mlp/down/kernel",     # (L, ffn, d)
    "attn_norm": "layers/pre_attn_norm/scale",   # (L, d)   before attention
    "post_attn_norm": "layers/post_attn_norm/scale",  # (L, d) on the attention output
    "mlp_norm": "layers/pre_mlp_norm/scale",     # (L, d)   before the MLP
    "post_mlp_norm": "layers/post_mlp_norm/scale",  # (L, d) on the MLP output
    "norm": "norm/scale",                        # (d,)
}


def hf_gemma2_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                       optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                       rope: str = "halves", names: dict[str, str] | None = None,
                       ignore: Sequence[str] = ("optimizer/step",),
                       keep: Sequence[str] = ("optim/param_groups",),
                       step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Gemma 2 decoder (``nnx.scan`` layout) to HF ``Gemma2ForCausalLM``.

    Kernels as in :func:`hf_llama_from_nnx` (the config's ``head_dim``, which need not be
    ``hidden_size / heads``); ``lm_head.weight`` reads ``embed`` (Gemma ties them). Each layer has
    four norms (:data:`GEMMA2_NNX_NAMES`): ``attn_norm`` -> ``input_layernorm``,
    ``post_attn_norm`` -> ``post_attention_layernorm``, ``mlp_norm`` -> ``pre_feedforward_layernorm``,
    ``post_mlp_norm`` -> ``post_feedforward_layernorm``. Norm scales are copied unchanged: HF, like
    Gemma's own JAX code, stores ``scale`` and multiplies by ``1 + scale``; a JAX model that stores
    the multiplier itself does not fit this preset. The embedding scale ``sqrt(hidden_size)``,
    GeGLU, ``query_pre_attn_scalar`` and the soft-capping are config, not weights.
    """
    entries = _gemma_entries(config, _names(GEMMA2_NNX_NAMES, names, "hf_gemma2_from_nnx"), rope)
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


def _gemma_entries(config: Any, table: dict[str, str], rope: str) -> list[tuple[Any, str, tuple[Transform, ...]]]:
    """Gemma 2's entries: Llama's kernels, the tied head, four norms per layer."""
    dims = dict(llama_dims(config), tied=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    lay = "model.layers.{i}"
    entries = [(s, t.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm."), ops)
               for s, t, ops in _llama_entries(dims, table, rope)]
    sel = Select(0, "i", dims["layers"])
    return entries + [(table["post_attn_norm"], f"{lay}.post_attention_layernorm.weight", (sel,)),
                      (table["post_mlp_norm"], f"{lay}.post_feedforward_layernorm.weight", (sel,))]


#: The Flax NNX Gemma 3 layout :func:`hf_gemma3_from_nnx` expects: :data:`GEMMA2_NNX_NAMES` plus the
#: per-head q/k norms (stored as ``scale``, applied as ``1 + scale``, like every Gemma norm).
GEMMA3_NNX_NAMES: dict[str, str] = dict(GEMMA2_NNX_NAMES, **{
    "q_norm": "layers/attn/q_norm/scale",        # (L, head_dim)
    "k_norm": "layers/attn/k_norm/scale",        # (L, head_dim)
})


def hf_gemma3_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                       optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                       rope: str = "halves", names: dict[str, str] | None = None,
                       ignore: Sequence[str] = ("optimizer/step",),
                       keep: Sequence[str] = ("optim/param_groups",),
                       step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Gemma 3 text decoder to HF ``Gemma3ForCausalLM``: as
    :func:`hf_gemma2_from_nnx` plus ``q_norm`` / ``k_norm`` (L, head_dim) ->
    ``self_attn.{q,k}_norm.weight`` (copied: HF's Gemma 3 norms multiply by ``1 + weight``;
    reordered with the q/k rows for ``rope="interleaved"``). The local and global rotary bases
    (``rope_parameters`` per layer type) and the sliding pattern are config, not weights. Name
    table: :data:`GEMMA3_NNX_NAMES`."""
    table = _names(GEMMA3_NNX_NAMES, names, "hf_gemma3_from_nnx")
    dims = llama_dims(config)
    sel = Select(0, "i", dims["layers"])
    entries = _gemma_entries(config, table, rope) + [
        (table[f"{n}_norm"], f"model.layers.{{i}}.self_attn.{n}_norm.weight", (sel,) + _rope(rope, 0, dims["head_dim"]))
        for n in ("q", "k")]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


from bridges.presets._moe import (EXPERT_LAYOUTS, MIXTRAL_NNX_NAMES, QWEN2_MOE_NNX_NAMES, QWEN3_MOE_NNX_NAMES,  # noqa: E402
                           hf_mixtral_from_nnx, hf_qwen2_moe_from_nnx, hf_qwen3_moe_from_nnx)
from bridges.presets._maxtext import (MAXTEXT_GEMMA2_NAMES, MAXTEXT_LLAMA_NAMES, MAXTEXT_MIXTRAL_NAMES,  # noqa: E402
                               MAXTEXT_QWEN3_NAMES, hf_gemma2_from_maxtext, hf_llama_from_maxtext,
                               hf_mixtral_from_maxtext, hf_qwen3_from_maxtext)
from bridges.presets._gpt_oss import GPT_OSS_NNX_NAMES, hf_gpt_oss_from_nnx  # noqa: E402
from bridges.presets._deepseek import DEEPSEEK_V3_NNX_NAMES, hf_deepseek_v3_from_nnx  # noqa: E402
from bridges.presets._llama4 import LLAMA4_NNX_NAMES, hf_llama4_from_nnx  # noqa: E402
from bridges.presets._torchtitan import (TORCHTITAN_LLAMA3_NAMES, TORCHTITAN_QWEN3_NAMES,  # noqa: E402
                                  TORCHTITAN_TRAINING_STATE, hf_llama_from_torchtitan, hf_qwen3_from_torchtitan)


@dataclass(frozen=True)
class Source:
    """What every checkpoint of one training library (JAX's NNX and MaxText, torch's torchtitan) has,
    as the presets read it."""

    name: str
    #: Checkpoint keys of the training state (optimizer, step counter): an export of the weights
    #: leaves them out on purpose (its ``ignore`` globs).
    training_state: tuple[str, ...]
    #: The preset's keyword arguments that put the weights at the checkpoint's root, so that its
    #: rules' sources are the name table's paths as they are (:func:`names_markdown`).
    at_root: tuple[tuple[str, Any], ...]


#: Flax NNX: ``{"model": nnx.state(model), "optimizer": nnx.state(nnx.Optimizer(...))}``.
NNX = Source("nnx", ("optimizer/*",), (("model", ("", "model")),))
#: MaxText's ``TrainState``: ``params/params/...``, ``opt_state/...``, ``step``.
MAXTEXT = Source("maxtext", ("opt_state/*", "step"), (("params", ""),))
#: torchtitan's ``CheckpointManager`` (torch): the model's FQNs at the root, beside ``optimizer``,
#: ``lr_scheduler``, ``dataloader`` and ``train_state``.
TORCHTITAN = Source("torchtitan", TORCHTITAN_TRAINING_STATE, ())


@dataclass(frozen=True)
class Preset:
    """One Hugging Face preset, defined once. Every list of presets is derived from
    :data:`REGISTRY`: this module's exports, :data:`NAME_TABLES`, ``bridges.interop.PRESETS``
    (what ``preset_mapping``, ``export`` and ``ckptfmt export --mapping`` accept) and the
    training state an export leaves out."""

    build: Callable[..., Mapping]  # the preset function; its name is the preset's
    names: dict[str, str]          # its name table (``names=`` overrides its keys)
    source: Source

    @property
    def name(self) -> str:
        return self.build.__name__


#: Every preset, by name.
REGISTRY: dict[str, Preset] = {p.name: p for p in (
    Preset(hf_llama_from_nnx, LLAMA_NNX_NAMES, NNX),
    Preset(hf_llama_from_maxtext, MAXTEXT_LLAMA_NAMES, MAXTEXT),
    Preset(hf_gpt2_from_nnx, GPT2_NNX_NAMES, NNX),
    Preset(hf_qwen3_from_nnx, QWEN3_NNX_NAMES, NNX),
    Preset(hf_gemma2_from_nnx, GEMMA2_NNX_NAMES, NNX),
    Preset(hf_mixtral_from_nnx, MIXTRAL_NNX_NAMES, NNX),
    Preset(hf_qwen2_moe_from_nnx, QWEN2_MOE_NNX_NAMES, NNX),
    Preset(hf_gemma3_from_nnx, GEMMA3_NNX_NAMES, NNX),
    Preset(hf_qwen3_from_maxtext, MAXTEXT_QWEN3_NAMES, MAXTEXT),
    Preset(hf_gemma2_from_maxtext, MAXTEXT_GEMMA2_NAMES, MAXTEXT),
    Preset(hf_mixtral_from_maxtext, MAXTEXT_MIXTRAL_NAMES, MAXTEXT),
    Preset(hf_qwen3_moe_from_nnx, QWEN3_MOE_NNX_NAMES, NNX),
    Preset(hf_gpt_oss_from_nnx, GPT_OSS_NNX_NAMES, NNX),
    Preset(hf_deepseek_v3_from_nnx, DEEPSEEK_V3_NNX_NAMES, NNX),
    Preset(hf_llama4_from_nnx, LLAMA4_NNX_NAMES, NNX),
    Preset(hf_llama_from_torchtitan, TORCHTITAN_LLAMA3_NAMES, TORCHTITAN),
    Preset(hf_qwen3_from_torchtitan, TORCHTITAN_QWEN3_NAMES, TORCHTITAN))}
NAME_TABLES: dict[str, dict[str, str]] = {name: p.names for name, p in REGISTRY.items()}
#: Configs that between them turn on every option a preset reads (for naming its tensors).
_SIZES = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
          "num_hidden_layers": 2, "intermediate_size": 32, "vocab_size": 64, "n_layer": 1, "n_embd": 16,
          "num_local_experts": 2, "num_experts": 2, "moe_intermediate_size": 8,
          "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
          "first_k_dense_replace": 1, "interleave_moe_layer_step": 2, "intermediate_size_mlp": 48}
_TABLE_CONFIGS = (dict(_SIZES, model_type="qwen2", mlp_bias=True), dict(_SIZES, attention_bias=True))


def names_markdown(preset: str) -> str:
    """The name table of ``preset`` as bridges/MAPPING.md prints it: each name key, its default
    path, and the Hugging Face tensors that read it (all options on: biases, untied head).
    KeyError for an unknown preset."""
    p = REGISTRY[preset]
    kw = dict(p.source.at_root, optimizer=None)
    rules = [r for cfg in _TABLE_CONFIGS for r in p.build(cfg, **kw).rules]
    rows = ["| name key | default path | Hugging Face tensor(s) |", "|---|---|---|"]
    for key, path in p.names.items():
        hits = sorted({r.target.split("/", 1)[1] for r in rules for src in r.sources
                       if src == path or src.startswith(path + "/")})
        rows.append(f"| `{key}` | `{path}` | {', '.join(f'`{h}`' for h in hits) or '—'} |")
    return "\n".join(rows)
