"""A small declarative mapping from checkpoint keys to restore-target keys.

A :class:`Mapping` is an ordered list of :class:`Rule` s plus two glob lists. Each rule pairs a
*source* pattern (a key in the checkpoint) with a *target* pattern (a key in the state you load
into) and may carry a layout transform. Patterns are literal text with ``{name}`` placeholders;
a placeholder matches one or more characters, and every placeholder text is carried from one
side to the other, with the separators translated (``source_sep`` <-> ``target_sep``), so that
``params/blocks/0/fc/kernel`` and ``blocks.0.fc.weight`` map onto each other.

Layout transforms are permutations applied in GLOBAL coordinates: ``target = source.transpose(axes)``.
They are stored per number of dimensions (``{2: (1, 0), 4: (3, 2, 0, 1)}``) so one rule covers a
Dense kernel and a Conv kernel; a rule whose permutation table lacks the target's ndim does not
apply. Because the transform is a pure permutation, a box of the target maps to exactly one box of
the source (:meth:`Resolved.source_box`), which is what lets a sharded restore read only its own
bytes and permute them locally.

Keys that no rule matches map to themselves unchanged: equal keys need no rule.

This module is framework-free (numpy only). See ``bridges/MAPPING.md`` for the documented
Flax NNX / optax <-> torch mapping built by :func:`flax_nnx_to_torch`.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping as TMapping, Sequence

import numpy as np

__all__ = [
    "Rule", "Mapping", "Resolved", "IDENTITY", "flax_nnx_to_torch", "torch_to_flax_nnx",
    "torch_adamw_kwargs", "CONV_KERNEL_AXES", "DENSE_KERNEL_AXES", "LAYER_LEAVES",
]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

#: Flax Dense kernel (in, out) -> torch Linear weight (out, in).
DENSE_KERNEL_AXES: dict[int, tuple[int, ...]] = {2: (1, 0)}
#: Flax Conv kernel (spatial..., in, out) -> torch ConvNd weight (out, in, spatial...).
CONV_KERNEL_AXES: dict[int, tuple[int, ...]] = {
    n: (n - 1, n - 2) + tuple(range(n - 2)) for n in (3, 4, 5)}


def _placeholders(pattern: str) -> list[str]:
    return _PLACEHOLDER.findall(pattern)


def _compile(pattern: str, known: TMapping[str, str] | None = None) -> re.Pattern[str]:
    """Anchored regex for ``pattern``; placeholders in ``known`` must equal the given text."""
    out, pos, seen = [], 0, set()
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if known is not None and name in known:
            out.append(re.escape(known[name]))
        elif name in seen:
            out.append(f"(?P={name})")
        else:
            out.append(f"(?P<{name}>.+?)")
            seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


def _invert(axes: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(axes)
    for i, a in enumerate(axes):
        inv[a] = i
    return tuple(inv)


@dataclass(frozen=True)
class Rule:
    """``source`` key pattern <-> ``target`` key pattern, with an optional permutation.

    ``permute`` maps ndim -> axes with ``target = source.transpose(axes)``; ``None`` means no
    transform at any ndim. A placeholder may appear on one side only: a target-only placeholder is
    dropped (many targets read one source, e.g. optax's single ``count`` feeding every torch
    ``step``); a source-only placeholder (the reverse of that) is filled from the first matching
    checkpoint key in sorted order.
    """

    source: str
    target: str
    permute: TMapping[int, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if self.permute is not None:
            table = {int(n): tuple(int(a) for a in axes) for n, axes in dict(self.permute).items()}
            for n, axes in table.items():
                if sorted(axes) != list(range(n)):
                    raise ValueError(f"rule {self.source!r} -> {self.target!r}: {axes} is not a "
                                     f"permutation of {n} axes")
            object.__setattr__(self, "permute", table)

    def axes_for(self, ndim: int) -> tuple[int, ...] | None | bool:
        """The axes for a tensor of ``ndim`` dims; None: identity; False: rule does not apply."""
        if self.permute is None:
            return None
        axes = self.permute.get(ndim)
        if axes is None:
            return False
        return None if axes == tuple(range(ndim)) else axes

    def inverse(self) -> "Rule":
        """The same correspondence read the other way (axes inverted)."""
        perm = None if self.permute is None else {n: _invert(a) for n, a in self.permute.items()}
        return Rule(source=self.target, target=self.source, permute=perm)


@dataclass(frozen=True)
class Resolved:
    """Where a target key's data comes from: ``source_key`` and the permutation to apply."""

    target_key: str
    source_key: str
    axes: tuple[int, ...] | None = None  # target = source.transpose(axes); None = identity

    def source_shape(self, target_shape: Sequence[int]) -> tuple[int, ...]:
        return self._to_source(tuple(target_shape))

    def target_shape(self, source_shape: Sequence[int]) -> tuple[int, ...]:
        if self.axes is None:
            return tuple(source_shape)
        return tuple(source_shape[a] for a in self.axes)

    def source_box(self, offset: Sequence[int], shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The source-coordinate box holding exactly the target box ``(offset, shape)``."""
        return self._to_source(tuple(offset)), self._to_source(tuple(shape))

    def to_target(self, source_block: np.ndarray) -> np.ndarray:
        """Permute a block read in source coordinates into target coordinates (a view)."""
        return source_block if self.axes is None else source_block.transpose(self.axes)

    def _to_source(self, values: tuple[int, ...]) -> tuple[int, ...]:
        if self.axes is None:
            return values
        out = [0] * len(values)
        for i, a in enumerate(self.axes):
            out[a] = values[i]
        return tuple(out)


@dataclass(frozen=True)
class Mapping:
    """Ordered rename/transform rules plus two glob lists.

    ``ignore``: checkpoint keys that are never reported as unexpected (e.g. ``nnx`` step counters).
    ``keep``: target keys that keep the target's own value when the checkpoint lacks them
    (e.g. torch ``param_groups``, which hold hyperparameters rather than state).
    The first rule whose target pattern matches AND whose source key exists wins; if none exists,
    the first matching rule's source key is reported as missing. No rule matching: identity.
    """

    rules: tuple[Rule, ...] = ()
    ignore: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    source_sep: str = "/"
    target_sep: str = "/"
    _compiled: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "ignore", tuple(self.ignore))
        object.__setattr__(self, "keep", tuple(self.keep))
        self._compiled.extend((r, _compile(r.target)) for r in self.rules)

    def __add__(self, other: "Mapping") -> "Mapping":
        if (self.source_sep, self.target_sep) != (other.source_sep, other.target_sep):
            raise ValueError("cannot combine mappings with different separators")
        return Mapping(self.rules + other.rules, self.ignore + other.ignore, self.keep + other.keep,
                       self.source_sep, self.target_sep)

    def inverse(self) -> "Mapping":
        """The mapping for the opposite direction (target becomes source)."""
        return Mapping(tuple(r.inverse() for r in self.rules), ignore=self.keep, keep=self.ignore,
                       source_sep=self.target_sep, target_sep=self.source_sep)

    def is_ignored(self, source_key: str) -> bool:
        return any(fnmatch.fnmatchcase(source_key, g) for g in self.ignore)

    def is_kept(self, target_key: str) -> bool:
        return any(fnmatch.fnmatchcase(target_key, g) for g in self.keep)

    def resolve(self, target_key: str, ndim: int, source_keys: Iterable[str] | None = None) -> Resolved:
        """Where ``target_key`` (a tensor of ``ndim`` dims) reads from.

        ``source_keys``: the checkpoint's keys (a set is fastest); used to pick among rules and to
        fill placeholders that only the source side has. Never raises for an unknown key: the
        caller checks the returned ``source_key`` against the checkpoint.
        """
        keys = source_keys if source_keys is None or isinstance(source_keys, (set, frozenset, dict)) \
            else set(source_keys)
        first: Resolved | None = None
        for rule, rx in self._compiled:
            m = rx.match(target_key)
            if m is None:
                continue
            axes = rule.axes_for(ndim)
            if axes is False:
                continue
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            names = _placeholders(rule.source)
            if all(n in got for n in names):
                src = _PLACEHOLDER.sub(lambda mm: got[mm.group(1)], rule.source)
            elif keys is None:
                continue
            else:
                srx = _compile(rule.source, got)
                cands = sorted(k for k in keys if srx.match(k))
                if not cands:
                    continue
                src = cands[0]
            res = Resolved(target_key, src, axes)
            if keys is None or src in keys:
                return res
            first = first or res
        return first or Resolved(target_key, target_key, None)

    def resolve_unique(self, target_key: str, ndim: int) -> Resolved:
        """Like :meth:`resolve` without checkpoint keys (for writing), but every matching rule
        must agree; ValueError names the candidates otherwise (e.g. a 2-D torch ``weight`` under
        generic Flax rules: Dense kernel or Embed embedding)."""
        found: list[Resolved] = []
        for rule, rx in self._compiled:
            m = rx.match(target_key)
            axes = rule.axes_for(ndim) if m is not None else False
            if axes is False:
                continue
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            if not all(n in got for n in _placeholders(rule.source)):
                continue
            found.append(Resolved(target_key, _PLACEHOLDER.sub(lambda mm: got[mm.group(1)], rule.source), axes))
        distinct = {(r.source_key, r.axes) for r in found}
        if len(distinct) > 1:
            raise ValueError(f"{target_key!r} matches several mapping rules: {sorted(distinct, key=str)}; "
                             "use exact rules (e.g. flax_nnx_to_torch(layers=...))")
        return found[0] if found else Resolved(target_key, target_key, None)


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
}
_GENERIC_LEAVES = (("kernel", "weight", {**DENSE_KERNEL_AXES, **CONV_KERNEL_AXES}), ("bias", "bias", None),
                   ("scale", "weight", None), ("embedding", "weight", None),
                   ("mean", "running_mean", None), ("var", "running_var", None))


def flax_nnx_to_torch(*, model: tuple[str, str] = ("model", "model"),
                      optimizer: tuple[str, str] | None = ("optimizer/opt_state/0", "optim/state"),
                      layers: TMapping[str, str] | None = None,
                      ignore: Sequence[str] = ("optimizer/step",),
                      keep: Sequence[str] = ("optim/param_groups",)) -> Mapping:
    """The ready mapping from a Flax NNX model (+ optax adam/adamw state) to torch.

    ``model``: (checkpoint prefix of the NNX ``Param`` tree, prefix of the torch model state dict).
    ``optimizer``: (checkpoint prefix of optax's ``ScaleByAdamState`` — element 0 of the adamw
    chain —, prefix of torch's FQN-keyed optimizer ``state``), or None for weights only.
    ``layers``: torch module path -> kind (``linear``, ``conv``, ``norm``, ``batchnorm``,
    ``embedding``; :func:`bridges.torch.layer_kinds` derives it from an ``nn.Module``). With it
    every rule is exact; without it the rules are generic and a torch ``weight`` is told apart
    (kernel, scale or embedding) by which Flax key the checkpoint holds — which works for
    loading but is ambiguous for saving torch -> JAX, where ``layers`` is required.
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
        rules.append(Rule(_join(src_o, "count"), _join(dst_o, "{p}/step")))
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
