"""The implementation behind :mod:`bridges.mapping` (its face re-exports the public names)."""
from __future__ import annotations

from typing import Any, Mapping as TMapping, Sequence

from bridges.mapping._chain import Chain, InvalidRuleError, MappingError, split_chain
from bridges.mapping._rules import KeptValuesWarning, LoadReport, Mapping, Resolved, Rule
from bridges.mapping._joins import Concat, Part, Stack
from bridges.mapping._quant import FP8_BLOCK, SCALE_SUFFIX, Dequantize
from bridges.mapping._reshape import Merge, Unmerge
from bridges.mapping._transforms import (Cast, Reorder, Scale, Shift, Transform, Transpose, halves_to_interleaved, interleaved_to_halves)
from bridges.mapping._joins import Select
from bridges.mapping._compose import compose
from bridges.mapping._moments import OPTAX_ADAM, TORCH_ADAM, TORCHTITAN_ADAM, MomentLayout, with_moments

__all__ = [
    "Rule", "Mapping", "Resolved", "IDENTITY", "LoadReport", "MappingError", "KeptValuesWarning",
    "flax_nnx_to_torch", "torch_to_flax_nnx", "torch_adamw_kwargs", "CONV_KERNEL_AXES",
    "DENSE_KERNEL_AXES", "LAYER_LEAVES", "Chain", "Transform", "Transpose", "Select", "Merge",
    "Unmerge", "Reorder", "Concat", "Part", "Stack", "Scale", "Shift", "Cast", "Dequantize", "dequantized", "interleaved_to_halves",
    "halves_to_interleaved", "optimizer_step_rules", "InvalidRuleError", "MomentLayout", "OPTAX_ADAM",
    "TORCH_ADAM", "TORCHTITAN_ADAM", "with_moments", "compose",
]

#: Flax Dense kernel (in, out) -> torch Linear weight (out, in).
DENSE_KERNEL_AXES: dict[int, tuple[int, ...]] = {2: (1, 0)}
#: Flax Conv kernel (spatial..., in, out) -> torch ConvNd weight (out, in, spatial...).
CONV_KERNEL_AXES: dict[int, tuple[int, ...]] = {
    n: (n - 1, n - 2) + tuple(range(n - 2)) for n in (3, 4, 5)}

#: No rules: every key maps to itself.
IDENTITY = Mapping()


def _join(prefix: str, rest: str) -> str:
    return f"{prefix}/{rest}" if prefix else rest


#: Per layer kind: (Flax NNX leaf, torch leaf, permutation table).
LAYER_LEAVES: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "linear": (("kernel", "weight", DENSE_KERNEL_AXES), ("bias", "bias", None)),
    "conv": (("kernel", "weight", CONV_KERNEL_AXES), ("bias", "bias", None)),
    "norm": (("scale", "weight", None), ("bias", "bias", None)),  # LayerNorm, RMSNorm, GroupNorm
    "batchnorm": (("scale", "weight", None), ("bias", "bias", None),
                  ("mean", "running_mean", None), ("var", "running_var", None)),
    "embedding": (("embedding", "weight", None),),
    # transformers' Conv1D (GPT-2) stores its weight (in, out), as a Flax kernel: no transpose.
    "conv1d": (("kernel", "weight", None), ("bias", "bias", None)),
}
_GENERIC_LEAVES = (("kernel", "weight", {**DENSE_KERNEL_AXES, **CONV_KERNEL_AXES}), ("bias", "bias", None),
                   ("scale", "weight", None), ("embedding", "weight", None),
                   ("mean", "running_mean", None), ("var", "running_var", None))


def optimizer_step_rules(count_prefix: str, torch_state: str, step: tuple[str, str] | None = None) -> list[Rule]:
    """optax's ``{count_prefix}/count`` (int32) <-> every torch ``{torch_state}/{p}/step`` (float32),
    and with ``step`` = (key, dtype) the framework's own counter (NNX: ``("optimizer/step",
    "uint32")``) as an ``also`` copy: a torch save writes it too, a load reads ``count`` first.
    Each ``Cast`` checks on save that the float value is a whole number in range (MappingError)."""
    rules = [Rule(_join(count_prefix, "count"), _join(torch_state, "{p}/step"),
                  transforms=(Cast("float32", source_dtype="int32"),))]
    if step is not None:
        rules.append(Rule(step[0], _join(torch_state, "{p}/step"),
                          transforms=(Cast("float32", source_dtype=step[1]),), also=True))
    return rules


def flax_nnx_to_torch(*, model: tuple[str, str] = ("model", "model"),
                      optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                      layers: TMapping[str, str] | None = None,
                      ignore: Sequence[str] = ("optimizer/step",),
                      keep: Sequence[str] = ("optim/param_groups",),
                      step: tuple[str, str] | None = ("optimizer/step", "uint32")) -> Mapping:
    """The ready mapping from a Flax NNX model (+ optax adam/adamw state) to torch.

    ``model``: (checkpoint prefix of the NNX ``Param`` tree, prefix of the torch model state dict).
    ``optimizer``: (checkpoint prefix of optax's ``ScaleByAdamState`` — element 0 of the adamw
    chain —, prefix of torch's FQN-keyed optimizer ``state``), or None for weights only.
    ``layers``: torch module path -> kind (``linear``, ``conv``, ``conv1d``, ``norm``, ``batchnorm``,
    ``embedding``; :func:`bridges.torch.layer_kinds` derives it from an ``nn.Module``). With it
    every rule is exact; without it the rules are generic and a torch ``weight`` is told apart
    (kernel, scale or embedding) by which Flax key the checkpoint holds — which works for
    loading but is ambiguous for saving torch -> JAX, where ``layers`` is required.
    ``step``: see :func:`optimizer_step_rules`.
    Flax paths use ``/``; torch module paths use ``.``; see MAPPING.md for the full table.
    """
    src_m, dst_m = model
    if layers is None:
        per = [("{m}", "{m}", leaves) for leaves in [_GENERIC_LEAVES]]
    else:
        unknown = sorted(set(layers.values()) - set(LAYER_LEAVES))
        if unknown:
            raise ValueError(f"unknown layer kinds {unknown}; known: {sorted(LAYER_LEAVES)}")
        per = [(path.replace(".", "/"), path, LAYER_LEAVES[kind]) for path, kind in layers.items()]
    rules = [Rule(_join(src_m, f"{fp}/{f}"), _join(dst_m, f"{tp}.{t}"), p)
             for fp, tp, leaves in per for f, t, p in leaves]
    if optimizer is not None:
        src_o, dst_o = optimizer
        for moment, slot in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            rules += [Rule(_join(src_o, f"{moment}/{fp}/{f}"), _join(dst_o, f"{tp}.{t}/{slot}"), p)
                      for fp, tp, leaves in per for f, t, p in leaves
                      if t not in ("running_mean", "running_var")]
        # optax keeps one shared count; torch keeps a step per parameter ({p} is target-only).
        rules += optimizer_step_rules(src_o, dst_o, step)
    return Mapping(tuple(rules), ignore=tuple(ignore), keep=tuple(keep),
                   source_sep="/", target_sep=".")


def torch_to_flax_nnx(**kwargs: Any) -> Mapping:
    """The reverse of :func:`flax_nnx_to_torch` (torch checkpoint -> Flax NNX target)."""
    return flax_nnx_to_torch(**kwargs).inverse()


def torch_adamw_kwargs(*, learning_rate: float, b1: float = 0.9, b2: float = 0.999,
                       eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 1e-4,
                       mask: Any = None, nesterov: bool = False) -> dict[str, Any]:
    """``torch.optim.AdamW`` keyword arguments equivalent to ``optax.adamw(...)`` with these args.

    Both compute ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with the bias-corrected
    moments and the decay applied to the pre-update parameter (decoupled, scaled by lr), and eps
    added outside the square root. optax's ``eps_root`` (inside the root) has no torch
    counterpart, nor does a weight-decay ``mask`` (use a torch param group with weight_decay=0)
    or ``nesterov`` (torch NAdam differs); those raise ValueError instead of silently differing.
    Note the defaults differ: optax weight_decay=1e-4, torch 1e-2 — pass it explicitly.
    """
    if eps_root:
        raise ValueError("optax eps_root != 0 has no torch.optim.AdamW equivalent")
    if mask is not None:
        raise ValueError("optax weight-decay mask: build torch param groups with weight_decay=0 instead")
    if nesterov:
        raise ValueError("optax adamw(nesterov=True) has no torch.optim.AdamW equivalent")
    if callable(learning_rate):
        raise ValueError("an optax schedule has no AdamW kwarg; set lr per step from the schedule")
    return {"lr": float(learning_rate), "betas": (float(b1), float(b2)), "eps": float(eps),
            "weight_decay": float(weight_decay)}


def dequantized(mapping: Mapping, *, block: Sequence[int] = FP8_BLOCK, dtype: str = "float32",
                suffix: str = SCALE_SUFFIX) -> Mapping:
    """``mapping`` (a :class:`bridges.mapping.Mapping`, e.g. a preset's) reading block-FP8
    weights: every rule of one source and no join gets a twin that reads ``(source,
    source + suffix)`` through :class:`Dequantize` first (then the rule's own transforms), tried
    before it; where the checkpoint has no scale companion the original rule applies. A mapping
    without rules (the identity) gets one generic pair for ``{name}weight``. Returns a new Mapping;
    ``mapping`` is unchanged.
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"dequantized() takes a bridges.mapping.Mapping, got {type(mapping).__name__}")
    op = Dequantize(tuple(block), dtype)
    rules: list = []
    tiers: list[int] = []
    base = mapping.rules or (Rule("{name}weight", "{name}weight"),)
    base_tiers = mapping.tiers or (0,)
    for rule, tier in zip(base, base_tiers):
        if len(rule.sources) == 1 and rule.permute is None and split_chain(rule.transforms)[1] is None:
            src = rule.sources[0]
            rules.append(Rule((src, src + suffix), rule.target, transforms=(op, *rule.transforms), also=rule.also))
            tiers.append(tier)
        rules.append(rule)
        tiers.append(tier)
    return Mapping(tuple(rules), mapping.ignore, mapping.keep, mapping.source_sep, mapping.target_sep, tuple(tiers))

