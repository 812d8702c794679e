"""The Llama 4 (text) preset of :mod:`bridges.presets`: Hugging Face ``Llama4ForCausalLM``
(transformers 5.x, ``modeling_llama4.py``) from a Flax NNX decoder.

Facts relied on (read from transformers 5.24's ``modeling_llama4.py``): the Llama attention
projections (no biases) rotated as **interleaved** pairs (``apply_rotary_emb`` views q and k as
complex pairs, as Meta's code does) and L2-normed without weights (``qk_norm``); dense layers
(``feed_forward.{gate,up,down}_proj``, ``intermediate_size_mlp`` wide) and MoE layers
(``config.moe_layers``, every ``interleave_moe_layer_step``-th) alternate; an MoE layer has a
router ``feed_forward.router.weight`` (E, d), experts stored (in, out):
``experts.gate_up_proj`` (E, d, 2F) = gate then up along the last axis (``chunk(2)``),
``experts.down_proj`` (E, F, d), and a ``shared_expert`` SwiGLU of ``intermediate_size``. The
router's sigmoid scores scale each expert's **input**; no-rope layers, temperature tuning and
chunked attention are config, not weights.
"""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._mapping import Concat, Mapping, Select, Transform, Transpose
from bridges.presets._base import LLAMA_NNX_NAMES, _get, _llama_entries, _mapping, _names, llama_dims

__all__ = ["LLAMA4_NNX_NAMES", "hf_llama4_from_nnx"]

#: The Flax NNX Llama 4 layout :func:`hf_llama4_from_nnx` expects. Attention and norms stacked
#: over all L layers (axis 0), as :data:`LLAMA_NNX_NAMES`; the dense layers' MLPs over the dense
#: layers, the MoE blocks over the MoE layers (``config.moe_layers``), experts on axis 1.
LLAMA4_NNX_NAMES: dict[str, str] = dict(
    {k: v for k, v in LLAMA_NNX_NAMES.items() if not k.startswith(("gate_", "up_", "down_")) and not k.endswith("_bias")},
    **{
        "dense_gate": "dense_layers/mlp/gate/kernel",        # (Ld, d, ffn_mlp)
        "dense_up": "dense_layers/mlp/up/kernel",            # (Ld, d, ffn_mlp)
        "dense_down": "dense_layers/mlp/down/kernel",        # (Ld, ffn_mlp, d)
        "router": "moe_layers/moe/router/kernel",            # (Lm, d, E)
        "gate": "moe_layers/moe/gate/kernel",                # (Lm, E, d, ffn)
        "up": "moe_layers/moe/up/kernel",                    # (Lm, E, d, ffn)
        "down": "moe_layers/moe/down/kernel",                # (Lm, E, ffn, d)
        "shared_gate": "moe_layers/moe/shared/gate/kernel",  # (Lm, d, ffn)
        "shared_up": "moe_layers/moe/shared/up/kernel",      # (Lm, d, ffn)
        "shared_down": "moe_layers/moe/shared/down/kernel",  # (Lm, ffn, d)
    })


def hf_llama4_from_nnx(config: Any, *, model: tuple[str, str] = ("model", "model"),
                       optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                       names: dict[str, str] | None = None, ignore: Sequence[str] = ("optimizer/step",),
                       keep: Sequence[str] = ("optim/param_groups",),
                       step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Llama 4 text decoder to HF ``Llama4ForCausalLM``.

    Attention and norms as :func:`hf_llama_from_nnx`, with the JAX model rotating interleaved
    pairs as Llama 4 does (rows copied, no reorder). Each dense layer's MLP (the layers not in
    ``config.moe_layers``) reads the dense stack at its index among the dense layers; each MoE
    layer's router (L, d, E) -> ``feed_forward.router.weight`` (E, d), experts (gate and up
    concatenated on the last axis into ``experts.gate_up_proj`` (E, d, 2F), ``down_proj`` as it
    is: HF stores them (in, out)) and shared expert read the MoE stack at its index among the
    MoE layers (one rule per layer with a fixed ``Select`` index: no ``inverse()`` for those;
    loads and torch saves work). Name table: :data:`LLAMA4_NNX_NAMES`. ValueError for a config
    without ``moe_layers`` or ``interleave_moe_layer_step``.
    """
    dims = dict(llama_dims(config), qkv_bias=False, o_bias=False, mlp_bias=False)
    t = _names(LLAMA4_NNX_NAMES, names, "hf_llama4_from_nnx")
    L = dims["layers"]
    moe = _get(config, "moe_layers")
    if moe is None:
        step_ = _get(config, "interleave_moe_layer_step")
        if step_ is None:
            raise ValueError("hf_llama4_from_nnx: the config names neither moe_layers nor interleave_moe_layer_step")
        moe = list(range(int(step_) - 1, L, int(step_)))
    moe = [int(i) for i in moe]
    dense = [i for i in range(L) if i not in moe]
    ff = int(_get(config, "intermediate_size"))
    mlp_free = dict(t, gate_kernel="", up_kernel="", down_kernel="")  # the MLP entries are this preset's own
    entries: list[tuple[Any, str, tuple[Transform, ...]]] = [
        e for e in _llama_entries(dims, mlp_free, "halves") if ".mlp." not in e[1]]
    T = Transpose((1, 0))
    for i in range(L):
        ffn = f"model.layers.{i}.feed_forward"
        if i in dense:
            s = Select(0, dense.index(i), len(dense))
            entries += [(t["dense_gate"], f"{ffn}.gate_proj.weight", (s, T)), (t["dense_up"], f"{ffn}.up_proj.weight", (s, T)),
                        (t["dense_down"], f"{ffn}.down_proj.weight", (s, T))]
            continue
        s = Select(0, moe.index(i), len(moe))
        entries += [
            (t["router"], f"{ffn}.router.weight", (s, T)),
            ((t["gate"], t["up"]), f"{ffn}.experts.gate_up_proj", (s, Concat(2, (ff, ff)))),
            (t["down"], f"{ffn}.experts.down_proj", (s,)),
            (t["shared_gate"], f"{ffn}.shared_expert.gate_proj.weight", (s, T)),
            (t["shared_up"], f"{ffn}.shared_expert.up_proj.weight", (s, T)),
            (t["shared_down"], f"{ffn}.shared_expert.down_proj.weight", (s, T)),
        ]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)
