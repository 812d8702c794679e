"""Presets from torchtitan's checkpoints (its own parameter names, its flattened optimizer) to
Hugging Face ``transformers``.

torchtitan (0.3.0) saves what its ``CheckpointManager`` holds: the model's FQNs at the root
(``tok_embeddings.weight``, ``layers.0.attention.qkv_linear.wq.weight``, ...), and its
``OptimizersContainer`` flattened by FQN under ``optimizer`` (``state.<fqn>.exp_avg``,
``state.<fqn>.exp_avg_sq``, ``state.<fqn>.step``, ``param_groups.<fqn>.lr``, ...), beside
``lr_scheduler``, ``dataloader`` and ``train_state``. Facts relied on (read from torchtitan 0.3.0):

* ``models/llama3/state_dict_adapter.py`` (``Llama3StateDictAdapter.from_hf_map``): the names
  below, and ``_permute`` on q and k: Llama 3 in torchtitan rotates interleaved pairs
  (``ComplexRoPE``), HF split halves, so each head's q/k rows go interleaved -> halves.
* ``models/qwen3/state_dict_adapter.py``: the same names plus ``attention.{q,k}_norm.weight``; no
  permutation (``CosSinRoPE`` rotates halves, as HF does).
* ``components/optimizer/utils.py`` (``get_flat_optim_state_dict``): ``state.{fqn}.{state_name}``
  and ``param_groups.{fqn}.{key}``.
"""
from __future__ import annotations

from typing import Any, Sequence

from bridges.mapping._mapping import (TORCH_ADAM, TORCHTITAN_ADAM, Mapping, Merge, MomentLayout, Reorder, Rule,
                                      Transform, Unmerge, interleaved_to_halves, with_moments)
from bridges.presets._base import _names, llama_dims

__all__ = ["TORCHTITAN_LLAMA3_NAMES", "TORCHTITAN_QWEN3_NAMES", "TORCHTITAN_TRAINING_STATE",
           "hf_llama_from_torchtitan", "hf_qwen3_from_torchtitan"]

#: torchtitan's Llama 3 parameter names (``{i}``: the layer), as its state-dict adapter lists them.
TORCHTITAN_LLAMA3_NAMES: dict[str, str] = {
    "embed": "tok_embeddings.weight",
    "q": "layers.{i}.attention.qkv_linear.wq.weight",
    "k": "layers.{i}.attention.qkv_linear.wk.weight",
    "v": "layers.{i}.attention.qkv_linear.wv.weight",
    "o": "layers.{i}.attention.wo.weight",
    "gate": "layers.{i}.feed_forward.w1.weight",
    "up": "layers.{i}.feed_forward.w3.weight",
    "down": "layers.{i}.feed_forward.w2.weight",
    "attn_norm": "layers.{i}.attention_norm.weight",
    "mlp_norm": "layers.{i}.ffn_norm.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}
#: torchtitan's Qwen3 (dense) names: Llama 3's plus the per-head q/k RMSNorms.
TORCHTITAN_QWEN3_NAMES: dict[str, str] = dict(TORCHTITAN_LLAMA3_NAMES, **{
    "q_norm": "layers.{i}.attention.q_norm.weight",
    "k_norm": "layers.{i}.attention.k_norm.weight",
})
#: What a torchtitan checkpoint holds besides the model (an export of the weights leaves it out).
#: (A state that is None, such as an absent data loader, is one key: hence the bare names too.)
TORCHTITAN_TRAINING_STATE = ("optimizer/*", "lr_scheduler", "lr_scheduler/*", "dataloader", "dataloader/*",
                             "train_state", "train_state/*")

_HF = {"embed": "model.embed_tokens.weight", "q": "model.layers.{i}.self_attn.q_proj.weight",
       "k": "model.layers.{i}.self_attn.k_proj.weight", "v": "model.layers.{i}.self_attn.v_proj.weight",
       "o": "model.layers.{i}.self_attn.o_proj.weight", "gate": "model.layers.{i}.mlp.gate_proj.weight",
       "up": "model.layers.{i}.mlp.up_proj.weight", "down": "model.layers.{i}.mlp.down_proj.weight",
       "attn_norm": "model.layers.{i}.input_layernorm.weight",
       "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight", "norm": "model.norm.weight",
       "lm_head": "lm_head.weight", "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
       "k_norm": "model.layers.{i}.self_attn.k_norm.weight"}


def _halves(n: int, head_dim: int) -> tuple[Transform, ...]:
    """(n*hd, d) rows interleaved within each head -> split halves (torchtitan's ``_permute``)."""
    return (Unmerge(0, (n, head_dim)), Reorder(1, interleaved_to_halves(head_dim)), Merge(0, (n, head_dim)))


def _torchtitan_mapping(config: Any, table: dict[str, str], permute_qk: bool, model: str,
                        optimizer: tuple[str, str] | None, ignore: Sequence[str] | None, keep: Sequence[str]) -> Mapping:
    if ignore is None:  # the training state the rules do not read
        ignore = TORCHTITAN_TRAINING_STATE if optimizer is None else (
            f"{optimizer[0]}/param_groups.*",) + TORCHTITAN_TRAINING_STATE[1:]
    dims = llama_dims(config)
    hd = dims["head_dim"]
    ops: dict[str, tuple[Transform, ...]] = {k: () for k in table}
    if permute_qk:
        ops["q"], ops["k"] = _halves(dims["heads"], hd), _halves(dims["kv"], hd)
    names = [k for k in table if not (k == "lm_head" and dims["tied"])]
    params = [Rule(table[k], f"{model}/{_HF[k]}" if model else _HF[k], transforms=ops[k]) for k in names]
    if dims["tied"]:  # HF's head is the embedding; torchtitan keeps no separate head when tied
        params.append(Rule(table["embed"], f"{model}/lm_head.weight" if model else "lm_head.weight"))
    rules = list(params)
    if optimizer is not None:
        src_o, dst_o = optimizer
        source = MomentLayout("", f"{src_o}/state.{{path}}.{{slot}}", TORCHTITAN_ADAM.slots)
        target = MomentLayout(model, f"{dst_o}/{{path}}/{{slot}}", TORCH_ADAM.slots)
        triples = [with_moments(r, source, target) for r in params[:len(names)]]
        rules += [t[1] for t in triples] + [t[2] for t in triples]
        # torch keeps one step per parameter, as torchtitan does: copied as it is.
        rules += [Rule(f"{src_o}/state.{r.source}.step", target.template.replace("{slot}", "step").replace(
            "{path}", r.target[len(model) + 1:] if model else r.target)) for r in params[:len(names)]]
    return Mapping(tuple(rules), ignore=tuple(ignore), keep=tuple(keep), source_sep="/", target_sep=".")


def hf_llama_from_torchtitan(config: Any, *, model: str = "model",
                             optimizer: tuple[str, str] | None = ("optimizer", "optim/state"),
                             names: dict[str, str] | None = None,
                             ignore: Sequence[str] | None = None,
                             keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """Mapping from a torchtitan Llama 3 checkpoint to HF ``LlamaForCausalLM``.

    ``config``: the HF config (``LlamaConfig`` or a dict) of the same sizes. Names:
    :data:`TORCHTITAN_LLAMA3_NAMES` (override with ``names``). q and k rows go from torchtitan's
    interleaved rotary pairs to HF's halves within each head; every other tensor is copied.
    ``model``: the prefix of the HF state in the target (``{"model": model.state_dict(), ...}``;
    ``""`` for a bare state dict). ``optimizer``: (torchtitan's optimizer key, the torch target's
    ``state`` prefix) of the AdamW moments and steps, or None for the weights only. ``ignore``
    (globs of checkpoint keys no rule reads) defaults to the rest of the training state
    (:data:`TORCHTITAN_TRAINING_STATE`, less the moments when ``optimizer`` is given). A checkpoint
    whose tensors do not fit raises MappingError at load, naming the rule.
    """
    table = _names(TORCHTITAN_LLAMA3_NAMES, names, "hf_llama_from_torchtitan")
    return _torchtitan_mapping(config, table, True, model, optimizer, ignore, keep)


def hf_qwen3_from_torchtitan(config: Any, *, model: str = "model",
                             optimizer: tuple[str, str] | None = ("optimizer", "optim/state"),
                             names: dict[str, str] | None = None,
                             ignore: Sequence[str] | None = None,
                             keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """Mapping from a torchtitan Qwen3 (dense) checkpoint to HF ``Qwen3ForCausalLM``: as
    :func:`hf_llama_from_torchtitan` with :data:`TORCHTITAN_QWEN3_NAMES` (the q/k norms added) and
    no row permutation (torchtitan's Qwen3 rotates halves, as HF does)."""
    table = _names(TORCHTITAN_QWEN3_NAMES, names, "hf_qwen3_from_torchtitan")
    return _torchtitan_mapping(config, table, False, model, optimizer, ignore, keep)
