"""The gpt-oss preset of :mod:`bridges.presets`: Hugging Face ``GptOssForCausalLM`` (transformers
5.x layout: ``modeling_gpt_oss.py``) from a Flax NNX decoder with experts stacked ``(L, E, ...)``.

Facts relied on (read from transformers 5.24's ``modeling_gpt_oss.py``): q/k/v/o carry biases;
each layer has per-head attention ``sinks`` (H,); the router is a biased linear (``router.weight``
(E, d), ``router.bias`` (E,)); the experts are fused and stored (in, out), as JAX kernels are:
``experts.gate_up_proj`` (E, d, 2F) with gate and up **interleaved** along the last axis
(``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), ``gate_up_proj_bias`` (E, 2F) likewise,
``down_proj`` (E, F, d), ``down_proj_bias`` (E, d). The published checkpoints store the experts
MXFP4-quantized; this preset maps the model's own (dequantized) state dict."""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._mapping import Concat, Mapping, Reorder, Select, Transpose, halves_to_interleaved
from bridges.presets._base import LLAMA_NNX_NAMES, _get, _llama_entries, _mapping, _names, llama_dims

__all__ = ["GPT_OSS_NNX_NAMES", "hf_gpt_oss_from_nnx"]

#: The Flax NNX gpt-oss layout :func:`hf_gpt_oss_from_nnx` expects (per-layer tensors stacked on
#: axis 0, experts on axis 1).
GPT_OSS_NNX_NAMES: dict[str, str] = dict(
    {k: v for k, v in LLAMA_NNX_NAMES.items() if not (k.startswith(("gate_", "up_", "down_")))}, **{
        "sinks": "layers/attn/sinks",                  # (L, heads)
        "router_kernel": "layers/moe/router/kernel",   # (L, d, E)
        "router_bias": "layers/moe/router/bias",       # (L, E)
        "gate_kernel": "layers/moe/gate/kernel",       # (L, E, d, ffn)
        "gate_bias": "layers/moe/gate/bias",           # (L, E, ffn)
        "up_kernel": "layers/moe/up/kernel",           # (L, E, d, ffn)
        "up_bias": "layers/moe/up/bias",               # (L, E, ffn)
        "down_kernel": "layers/moe/down/kernel",       # (L, E, ffn, d)
        "down_bias": "layers/moe/down/bias",           # (L, E, d)
    })


def hf_gpt_oss_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                        optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                        rope: str = "halves", names: dict[str, str] | None = None,
                        ignore: Sequence[str] = ("optimizer/step",), keep: Sequence[str] = ("optim/param_groups",),
                        step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX gpt-oss decoder to HF ``GptOssForCausalLM``.

    Attention as :func:`hf_llama_from_nnx` with q/k/v/o biases (``attention_bias``), plus
    ``sinks`` (L, H) -> ``self_attn.sinks`` (H,). Router kernel (L, d, E) -> ``mlp.router.weight``
    (E, d), bias copied. Experts: the gate and up kernels (L, E, d, F) concatenated on the last
    axis and interleaved (gate, up, gate, up, ...) into ``mlp.experts.gate_up_proj`` (E, d, 2F),
    their biases likewise into ``gate_up_proj_bias``; ``down_proj`` (E, F, d) and its bias copied
    (HF stores expert weights (in, out): no transpose). A torch save splits them back. Sliding
    windows, the SwiGLU clamp and alpha, and YaRN are config, not weights. Name table:
    :data:`GPT_OSS_NNX_NAMES`. Raises ValueError for an unknown ``rope``; a checkpoint that does
    not fit raises MappingError at load, naming the rule.
    """
    bias = bool(_get(config, "attention_bias", True))
    dims = dict(llama_dims(config), qkv_bias=bias, o_bias=bias, mlp_bias=False)
    table = _names(GPT_OSS_NNX_NAMES, names, "hf_gpt_oss_from_nnx")
    ff = dims["ffn"]
    mlp_free = dict(table, gate_kernel="", up_kernel="", down_kernel="")
    entries = [e for e in _llama_entries(dims, mlp_free, rope) if ".mlp." not in e[1]]
    sel, lay = Select(0, "i", dims["layers"]), "model.layers.{i}"
    inter = halves_to_interleaved(2 * ff)
    entries += [
        (table["sinks"], f"{lay}.self_attn.sinks", (sel,)),
        (table["router_kernel"], f"{lay}.mlp.router.weight", (sel, Transpose((1, 0)))),
        (table["router_bias"], f"{lay}.mlp.router.bias", (sel,)),
        ((table["gate_kernel"], table["up_kernel"]), f"{lay}.mlp.experts.gate_up_proj",
         (sel, Concat(2, (ff, ff)), Reorder(2, inter))),
        ((table["gate_bias"], table["up_bias"]), f"{lay}.mlp.experts.gate_up_proj_bias",
         (sel, Concat(1, (ff, ff)), Reorder(1, inter))),
        (table["down_kernel"], f"{lay}.mlp.experts.down_proj", (sel,)),
        (table["down_bias"], f"{lay}.mlp.experts.down_proj_bias", (sel,)),
    ]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)

