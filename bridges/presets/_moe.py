"""The mixture-of-experts presets of :mod:`bridges.presets` (Mixtral, Qwen2-MoE): experts stacked
``(L, E, ...)`` in the JAX layout, fused or one tensor per expert on the Hugging Face side. Import
them from ``bridges.presets``."""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._mapping import Concat, Mapping, Select, Transform, Transpose
from bridges.presets._base import _get, llama_dims, _names, _mapping, _llama_entries, _rope, LLAMA_NNX_NAMES


_ATTN_ONLY = ("attn_norm", "mlp_norm", "norm", "embed", "lm_head")
_ATTN_NAMES = {k: v for k, v in LLAMA_NNX_NAMES.items() if k.endswith("_kernel") and k[0] in "qkvo" or k in _ATTN_ONLY}
#: The Flax NNX Mixtral layout :func:`hf_mixtral_from_nnx` expects: the Llama attention and norms
#: of :data:`LLAMA_NNX_NAMES`, experts stacked (L, E, ...) as ``nnx.vmap`` over experts builds them.
MIXTRAL_NNX_NAMES: dict[str, str] = dict(_ATTN_NAMES, **{
    "router_kernel": "layers/moe/router/kernel",    # (L, d, E)
    "gate_kernel": "layers/moe/gate/kernel",        # (L, E, d, ffn)   w1
    "up_kernel": "layers/moe/up/kernel",            # (L, E, d, ffn)   w3
    "down_kernel": "layers/moe/down/kernel",        # (L, E, ffn, d)   w2
})
#: The Flax NNX Qwen2-MoE layout :func:`hf_qwen2_moe_from_nnx` expects: :data:`MIXTRAL_NNX_NAMES`
#: plus the shared expert and its sigmoid gate.
QWEN2_MOE_NNX_NAMES: dict[str, str] = dict(MIXTRAL_NNX_NAMES, **{
    "q_bias": "layers/attn/q/bias", "k_bias": "layers/attn/k/bias", "v_bias": "layers/attn/v/bias",  # (L, n, hd)
    "shared_gate_kernel": "layers/moe/shared/gate/kernel",  # (L, d, shared_ffn)
    "shared_up_kernel": "layers/moe/shared/up/kernel",      # (L, d, shared_ffn)
    "shared_down_kernel": "layers/moe/shared/down/kernel",  # (L, shared_ffn, d)
    "shared_expert_gate": "layers/moe/shared_gate/kernel",  # (L, d, 1)
})
#: The Flax NNX Qwen3-MoE layout :func:`hf_qwen3_moe_from_nnx` expects: :data:`MIXTRAL_NNX_NAMES`
#: plus Qwen3's per-head q/k RMSNorms and, with ``attention_bias``, the q/k/v/o biases (no shared expert).
QWEN3_MOE_NNX_NAMES: dict[str, str] = dict(MIXTRAL_NNX_NAMES, **{
    "q_norm": "layers/attn/q_norm/scale",       # (L, head_dim)
    "k_norm": "layers/attn/k_norm/scale",       # (L, head_dim)
}, **{k: LLAMA_NNX_NAMES[k] for k in ("q_bias", "k_bias", "v_bias", "o_bias")})  # attention_bias=True only
EXPERT_LAYOUTS = ("fused", "per_expert")


def _moe_entries(dims: dict[str, Any], table: dict[str, str], rope: str, experts: str, E: int, ff: int,
                 block: str, files: tuple[str, str, str]) -> list[tuple[Any, str, tuple[Transform, ...]]]:
    """Llama attention and norms plus routed experts: ``fused`` into the model's
    ``{block}.experts.gate_up_proj`` (E, 2ff, d) / ``down_proj`` (E, d, ff), or ``per_expert`` into
    ``{block}.experts.{j}.{files}.weight`` (the hub's and save_pretrained's names)."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    lay = "model.layers.{i}"
    entries = [e for e in _llama_entries(dims, dict(table, up_kernel="", down_kernel="", gate_kernel=""), rope)
               if ".mlp." not in e[1]]
    sel = Select(0, "i", dims["layers"])
    gate, up, down = (table[f"{n}_kernel"] for n in ("gate", "up", "down"))
    if experts == "fused":  # (L, E, d, ff) -> (E, ff, d), gate then up along the rows
        entries += [((gate, up), f"{lay}.mlp.experts.gate_up_proj", (sel, Transpose((0, 2, 1)), Concat(1, (ff, ff)))),
                    (down, f"{lay}.mlp.experts.down_proj", (sel, Transpose((0, 2, 1))))]
    else:
        one = (sel, Select(0, "j", E), Transpose((1, 0)))
        entries += [(src, f"{lay}.{block}.experts.{{j}}.{name}.weight", one) for src, name in zip((gate, up, down), files)]
    router = f"{lay}.{block if experts == 'per_expert' else 'mlp'}.gate.weight"
    return entries + [(table["router_kernel"], router, (sel, Transpose((1, 0))))]


def hf_mixtral_from_nnx(config: Any, *, experts: str = "fused", model: tuple[str, str] = ("model", "model"),
                        optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                        rope: str = "halves", names: dict[str, str] | None = None,
                        ignore: Sequence[str] = ("optimizer/step",), keep: Sequence[str] = ("optim/param_groups",),
                        step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Mixtral (layers stacked on axis 0, experts on axis 1) to HF
    ``MixtralForCausalLM``. Attention and norms as :func:`hf_llama_from_nnx`; the router kernel
    (L, d, E) -> ``mlp.gate.weight`` (E, d). ``experts="fused"``: the model's state dict
    (``mlp.experts.gate_up_proj`` = gate then up kernels, transposed, concatenated on axis 1;
    ``mlp.experts.down_proj``); ``"per_expert"``: the files' names
    (``block_sparse_moe.experts.{j}.w1/w3/w2.weight``, ``block_sparse_moe.gate.weight``), for
    ``preset_mapping`` exports and restores of ``save_pretrained`` directories.
    Name table: :data:`MIXTRAL_NNX_NAMES`. ValueError for an unknown ``experts`` or ``rope``."""
    dims = dict(llama_dims(config), qkv_bias=False, o_bias=False, mlp_bias=False)
    table = _names(MIXTRAL_NNX_NAMES, names, "hf_mixtral_from_nnx")
    entries = _moe_entries(dims, table, rope, experts, int(_get(config, "num_local_experts")), dims["ffn"],
                           "block_sparse_moe", ("w1", "w3", "w2"))
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


def hf_qwen2_moe_from_nnx(config: Any, *, experts: str = "fused", model: tuple[str, str] = ("model", "model"),
                          optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                          rope: str = "halves", names: dict[str, str] | None = None,
                          ignore: Sequence[str] = ("optimizer/step",), keep: Sequence[str] = ("optim/param_groups",),
                          step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Qwen2-MoE to HF ``Qwen2MoeForCausalLM``: as
    :func:`hf_mixtral_from_nnx` (``moe_intermediate_size`` experts, files
    ``mlp.experts.{j}.{gate,up,down}_proj.weight``), q/k/v biases when ``qkv_bias``, plus the
    shared expert (``mlp.shared_expert.{gate,up,down}_proj.weight``) and its gate (L, d, 1) ->
    ``mlp.shared_expert_gate.weight`` (1, d). Every layer must be sparse: ValueError for a config
    with ``mlp_only_layers`` or ``decoder_sparse_step`` other than 1. Name table:
    :data:`QWEN2_MOE_NNX_NAMES`."""
    _all_sparse(config, "hf_qwen2_moe_from_nnx")
    dims = dict(llama_dims(config), qkv_bias=bool(_get(config, "qkv_bias", True)), o_bias=False, mlp_bias=False)
    table = _names(QWEN2_MOE_NNX_NAMES, names, "hf_qwen2_moe_from_nnx")
    entries = _moe_entries(dims, table, rope, experts, int(_get(config, "num_experts")),
                           int(_get(config, "moe_intermediate_size")), "mlp", ("gate_proj", "up_proj", "down_proj"))
    sel, lay = Select(0, "i", dims["layers"]), "model.layers.{i}.mlp"
    entries += [(table[f"shared_{n}_kernel"], f"{lay}.shared_expert.{n}_proj.weight", (sel, Transpose((1, 0))))
                for n in ("gate", "up", "down")]
    entries.append((table["shared_expert_gate"], f"{lay}.shared_expert_gate.weight", (sel, Transpose((1, 0)))))
    return _mapping(entries, model, optimizer, "", ignore, keep, step)


def _all_sparse(config: Any, preset: str) -> None:
    if list(_get(config, "mlp_only_layers", [])) or int(_get(config, "decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{preset}: every layer must be sparse (mlp_only_layers=[], decoder_sparse_step=1)")


def hf_qwen3_moe_from_nnx(config: Any, *, experts: str = "fused", model: tuple[str, str] = ("model", "model"),
                          optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                          rope: str = "halves", names: dict[str, str] | None = None,
                          ignore: Sequence[str] = ("optimizer/step",), keep: Sequence[str] = ("optim/param_groups",),
                          step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """Mapping from a Flax NNX Qwen3-MoE to HF ``Qwen3MoeForCausalLM``: the routed experts of
    :func:`hf_qwen2_moe_from_nnx` (``moe_intermediate_size`` wide, fused ``mlp.experts.gate_up_proj``
    / ``down_proj`` or the files' ``mlp.experts.{j}.{gate,up,down}_proj.weight``, router
    ``mlp.gate.weight``) with Qwen3's attention: q/k/v/o biases when ``attention_bias``, per-head ``q_norm`` / ``k_norm``
    (L, head_dim) reordered with the q/k rows for ``rope="interleaved"``, no shared expert.
    ValueError for a config with dense layers (``mlp_only_layers``, ``decoder_sparse_step``).
    Name table: :data:`QWEN3_MOE_NNX_NAMES`."""
    _all_sparse(config, "hf_qwen3_moe_from_nnx")
    dims = dict(llama_dims(config), mlp_bias=False)  # attention_bias: q/k/v/o biases, as Qwen3
    table = _names(QWEN3_MOE_NNX_NAMES, names, "hf_qwen3_moe_from_nnx")
    # Qwen3MoeConfig keeps num_experts as num_local_experts (its attribute_map; its JSON has only that)
    n_experts = int(_get(config, "num_local_experts", _get(config, "num_experts")))
    entries = _moe_entries(dims, table, rope, experts, n_experts, int(_get(config, "moe_intermediate_size")), "mlp",
                           ("gate_proj", "up_proj", "down_proj"))
    sel = Select(0, "i", dims["layers"])
    entries += [(table[f"{n}_norm"], f"model.layers.{{i}}.self_attn.{n}_norm.weight", (sel,) + _rope(rope, 0, dims["head_dim"]))
                for n in ("q", "k")]
    return _mapping(entries, model, optimizer, "", ignore, keep, step)
