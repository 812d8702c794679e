"""Which output tensors a mapping makes from a checkpoint (an export has no target to ask).

A load resolves target keys it is given; an export must first name them. :func:`mapped_tensors`
walks each rule forward: every checkpoint key that matches the rule's (first) source pattern
binds the placeholders the target shares; a target-only placeholder that indexes a
:class:`Select` ranges over the stacked axis; a target-only placeholder that is dropped (optax's
one ``count`` feeding every torch ``step``) cannot be named from the checkpoint, so such a rule
exports nothing (it is reported). Each target key so named is then resolved exactly as a load
would resolve it (the first rule that applies wins) and bound to the checkpoint's shapes
(:class:`bridges.mapping._chain.Chain`), which the export engine reads block by block.

Completeness (:func:`export_tensors`, docs/INTEROP.md section 3): the names a mapping gives for
the whole model are known without the checkpoint wherever a rule's target placeholders are all
indices of Selects with a size (a preset configured by ``config.json``: ``model.layers.{i}`` for
i < num_hidden_layers). An export that would leave one of them unwritten, leave a checkpoint key
unread (``ignore`` globs excepted), or keep a rule that named nothing, is refused before anything
is written, unless a partial export is asked for (``allow_partial``). Every count is checked by
arithmetic (:data:`MAX_OUTPUTS`) before a name is enumerated.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Iterator, Sequence

from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.errors import KeyMismatchError
from ckptfmt.interop import ExportTensor, output_dtype
from ckptfmt.manifest import MAX_TENSORS
from ckptfmt.reader import Checkpoint
from ckptfmt.interop import identity_tensors, natural_key
from ckptfmt.restoreplan import is_optimizer_state

from bridges.mapping._joins import Concat, Stack
from bridges.mapping._rules import Mapping, Rule, _compile, _fill, _placeholders
from bridges.mapping._chain import MappingError
from bridges.mapping._transforms import NotApplicable
from bridges.mapping._joins import Select
from bridges.presets._registry import REGISTRY

__all__ = ["mapped_tensors", "export_tensors", "Coverage", "strip_target_prefix", "PRESETS",
           "preset_mapping", "MAX_OUTPUTS"]

#: Presets an export can name (``ckptfmt export --mapping NAME --config config.json``): the names
#: of :data:`bridges.presets.REGISTRY`, where a preset is defined.
PRESETS = tuple(REGISTRY)
#: Output tensors one export may name (a manifest's tensor cap).
MAX_OUTPUTS = MAX_TENSORS
#: Regex matches spent looking for another rule's output among the names (then: fail closed).
_MATCH_BUDGET = 1 << 22
_SHOWN = 8


def strip_target_prefix(mapping: Mapping, prefix: str) -> Mapping:
    """The rules whose target starts with ``prefix``, with it removed (e.g. ``"model/"``: a
    preset's state-dict targets ``model/model.layers.{i}...`` become the file names
    ``model.layers.{i}...``); other rules are dropped, ``keep`` globs likewise."""
    pairs = [(Rule(r.source, r.target[len(prefix):], r.permute, r.transforms, also=r.also), t)
             for r, t in zip(mapping.rules, mapping.tiers) if r.target.startswith(prefix) and len(r.target) > len(prefix)]
    keep = tuple(g[len(prefix):] for g in mapping.keep if g.startswith(prefix))
    return Mapping(tuple(r for r, _ in pairs), mapping.ignore, keep, mapping.source_sep, mapping.target_sep,
                   tuple(t for _, t in pairs))


def preset_mapping(name: str, config: Any, **kwargs: Any) -> Mapping:
    """A preset of :mod:`bridges.presets` for the model weights alone, named as Hugging Face names
    them in files (``model.layers.0.self_attn.q_proj.weight``): the mapping an export applies, and
    whose ``.inverse()`` restores a ``save_pretrained`` directory into the JAX layout. It ignores
    the checkpoint's training state (``optimizer/*``; MaxText: ``opt_state/*``, ``step``).

    ``kwargs`` are the preset function's own (``names=``, ``model=``, ``rope=``, ``ignore=``, ...;
    ``optimizer`` defaults to None here, and the optimizer's rules name no file tensor anyway).
    ValueError for an unknown name or name key; TypeError for an argument the preset lacks; the
    preset's own errors for a config without its sizes."""
    if name not in REGISTRY:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    preset = REGISTRY[name]
    kwargs.setdefault("optimizer", None)
    model = kwargs.get("model", "model")
    prefix = (model if isinstance(model, str) else model[1]) + "/"  # the torch state dict's prefix
    m = strip_target_prefix(preset.build(config, **kwargs), prefix)
    return Mapping(m.rules, m.ignore + preset.source.training_state, m.keep, m.source_sep, m.target_sep, m.tiers)


def _select_sizes(rule: Rule, names: Sequence[str], key: str, shape: tuple[int, ...],
                  joined: Sequence[tuple[int, ...]] | None = None) -> list[int]:
    """The stacked length behind each Select placeholder in ``names``, from the source's shape.
    ``joined``: the shapes of every source of the rule for this key (the first is ``shape``), when
    they are known; a Select after the rule's Concat is then sized from the joined shape (MaxText
    Gemma 2 concatenates its local and global layers, then selects one). MappingError when the
    rule's transforms before a Select do not apply to those shapes."""
    out: dict[str, int] = {}
    level = tuple(shape)
    levels = None if joined is None else [tuple(s) for s in joined]  # every source's, up to the join
    for i, raw in enumerate(rule.transforms):
        if isinstance(raw, Select) and isinstance(raw.index, str) and raw.index in names:
            if raw.axis >= len(level):
                raise MappingError(f"{rule.describe()} does not apply: Select(axis={raw.axis}) of a {len(level)}-d "
                                   "tensor", key=key, expected=f"> {raw.axis} dims", found=shape)
            n = level[raw.axis]
            if raw.size is not None and raw.size != n:  # before anything is enumerated from the declared size
                raise MappingError(f"{rule.describe()} does not apply: Select(axis={raw.axis}) declares a stacked "
                                   f"length of {raw.size}, the tensor has {n}", key=key, expected=raw.size, found=shape)
            out[raw.index] = n
        if len(out) == len(names) or (raw.join and (levels is None or not isinstance(raw, Concat))):
            break
        try:
            op = raw.bind({n: 0 for n in rule.index_names})
            if raw.join:  # a Concat of a fixed list of sources (a key family's Stack is not sized here)
                level, levels = op.join_shape(levels), None  # type: ignore[attr-defined, arg-type]
            else:
                level = op.out_shape(level)
                levels = None if levels is None else [op.out_shape(s) for s in levels]
        except NotApplicable as e:
            raise MappingError(f"{rule.describe()} does not apply: transform {i} {raw} -- {e.reason}", key=key,
                               expected=e.expected, found=e.found) from None
    missing = [n for n in names if n not in out]
    if missing:
        raise MappingError(f"{rule.describe()}: no Select before its join names {missing}", key=key)
    return [out[n] for n in names]


def _too_many(rule: Rule, n: int, key: str | None = None) -> MappingError:
    return MappingError(f"{rule.describe()} would name {n} or more output tensors, more than an export holds",
                        key=key, expected=f"<= {MAX_OUTPUTS} output tensors", found=n)


def _targets(mapping: Mapping, rule: Rule, keys: Sequence[str], shapes: dict[str, tuple[int, ...]],
             notes: list[str], budget: list[int]) -> list[tuple[str, int]]:
    """(target key, source ndim) for every checkpoint key the rule's first source pattern matches.
    ``budget[0]``: names still allowed (MAX_OUTPUTS in all); each key's count is checked before
    its names are enumerated."""
    overs = {op.over for op in rule.transforms if isinstance(op, Stack)}  # key families (layers, experts)
    rx = _compile(rule.sources[0], ints=overs)
    tnames = _placeholders(rule.target)
    selects = {op.index for op in rule.transforms if isinstance(op, Select) and isinstance(op.index, str)}
    out: list[tuple[str, int]] = []
    for key in keys:
        m = rx.match(key)
        if m is None:
            continue
        got = {k: v for k, v in m.groupdict().items() if k not in overs}
        bound = {n: got[n].replace(mapping.source_sep, mapping.target_sep) for n in tnames if n in got}
        free = [n for n in tnames if n not in bound]
        if any(n not in selects for n in free):
            notes.append(f"{rule.describe()}: target placeholder(s) {[n for n in free if n not in selects]} "
                         "cannot be named from the checkpoint; not exported")
            return []
        sizes = _select_sizes(rule, free, key, shapes[key], _source_shapes(rule, got, overs, shapes)) if free else []
        count = math.prod(sizes)
        if count > budget[0]:
            raise _too_many(rule, count, key)
        budget[0] -= count
        for combo in product(*(range(n) for n in sizes)):
            out.append((_fill(rule.target, {**bound, **dict(zip(free, combo))}), len(shapes[key])))
    return out


def _source_shapes(rule: Rule, got: dict[str, str], overs: set[str],
                   shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, ...]] | None:
    """The shapes of the rule's sources named by one match (``got``), or None when a source is a
    key family (a Stack's placeholder), names a placeholder the match lacks, or is not stored."""
    if any(n in overs or n not in got for p in rule.sources for n in _placeholders(p)):
        return None
    keys = [_fill(p, got) for p in rule.sources]
    return [shapes[k] for k in keys] if all(k in shapes for k in keys) else None


@dataclass(frozen=True)
class _Walk:
    outs: list[ExportTensor]
    unmapped: list[str]
    notes: list[str]
    named: frozenset[int]          # rules that named at least one output from a checkpoint key
    dropped: tuple[str, ...]       # names a rule gave whose sources are not all in the checkpoint


def _walk(ckpt: Checkpoint, mapping: Mapping, dtype: str | None) -> _Walk:
    keys = sorted(ckpt.keys())
    keyset = set(keys)
    shapes = {k: tuple(int(n) for n in ckpt.tensor(k).shape) for k in keys}
    notes: list[str] = []
    outs: dict[str, ExportTensor] = {}
    consumed: set[str] = set()
    named: set[int] = set()
    dropped: list[str] = []
    budget = [MAX_OUTPUTS]
    for idx, rule in enumerate(mapping.rules):
        targets = _targets(mapping, rule, keys, shapes, notes, budget)
        if targets:
            named.add(idx)
        for target, ndim in targets:
            if target in outs:
                continue
            res = mapping.resolve(target, ndim, keyset)
            if any(k not in keyset for k in res.source_keys):
                notes.append(f"{target}: {'; '.join(res.notes) or 'sources missing'}")
                dropped.append(target)
                continue
            entries = [ckpt.tensor(k) for k in res.source_keys]
            chain = res.chain([tuple(e.shape) for e in entries], [numpy_dtype(e.dtype) for e in entries])
            src = dtype_name(chain.target_dtype)
            outs[target] = ExportTensor(target, tuple(chain.target_shape), output_dtype(src, dtype), src, chain)
            consumed.update(res.source_keys)
    unmapped = sorted(k for k in keyset - consumed if not mapping.is_ignored(k))
    return _Walk([outs[k] for k in sorted(outs, key=natural_key)], unmapped, notes, frozenset(named),
                 tuple(t for t in dropped if t not in outs))


def mapped_tensors(ckpt: Checkpoint, mapping: Mapping, dtype: str | None = None) -> tuple[list[ExportTensor], list[str], list[str]]:
    """(output tensors in natural name order, checkpoint keys no output reads (``ignore`` globs
    excluded), notes on rules that named nothing). A rule that matched but does not fit the
    checkpoint's shapes raises MappingError naming it, before anything is written; so does one
    that would name more than MAX_OUTPUTS tensors. No completeness check: :func:`export_tensors`."""
    w = _walk(ckpt, mapping, dtype)
    return w.outs, w.unmapped, w.notes


def _sized(rule: Rule) -> list[int] | None:
    """The Select sizes behind each target placeholder, or None when one is not a sized Select."""
    sizes = {op.index: op.size for op in rule.transforms if isinstance(op, Select) and isinstance(op.index, str)}
    names = _placeholders(rule.target)
    if rule.permute is not None and names:
        return None
    if any(sizes.get(n) is None for n in names):
        return None
    return [int(sizes[n]) for n in names]  # type: ignore[arg-type]


def _names(rule: Rule, sizes: Sequence[int]) -> Iterator[str]:
    names = _placeholders(rule.target)
    return (_fill(rule.target, dict(zip(names, combo))) for combo in product(*(range(n) for n in sizes)))


@dataclass(frozen=True)
class Coverage:
    """What an export through a mapping would leave out. ``unwritten``: target names the mapping
    gives for the whole model (or named from the checkpoint) that no output is (of a rule that
    matched no checkpoint key, its first few: the rule is in ``idle`` with its count);
    ``unmatched``: checkpoint keys no output reads (``ignore`` globs excepted); ``idle``: rules that
    named no output and whose targets no other rule's outputs fill."""

    unwritten: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()
    idle: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not (self.unwritten or self.unmatched or self.idle)

    def error(self) -> KeyMismatchError:
        def shown(xs: Sequence[str]) -> str:
            return ", ".join(xs[:_SHOWN]) + (f", ... ({len(xs)} in all)" if len(xs) > _SHOWN else "")
        parts = []
        if self.unwritten:
            parts.append(f"{len(self.unwritten)} target tensor(s) the model needs would be left unwritten "
                         f"(from_pretrained would fill them with random values): {shown(self.unwritten)}")
        if self.unmatched:
            parts.append(f"{len(self.unmatched)} checkpoint key(s) match no rule: {shown(self.unmatched)}")
        if self.idle:
            parts.append(f"{len(self.idle)} rule(s) matched no checkpoint key: {shown(self.idle)}")
        return KeyMismatchError(
            "the export is incomplete, so nothing was written: " + "; ".join(parts) + ". Fit the names to the "
            "checkpoint: preset_mapping(PRESET, config, names={...}) (the preset's names table) or a mapping file "
            "(--mapping FILE, docs/INTEROP.md section 5); leave checkpoint keys out on purpose with ignore globs "
            "(--ignore GLOB, ignore=...); or write only what fits with --allow-partial (allow_partial=True)",
            key=(self.unwritten or self.unmatched or (None,))[0], object="export",
            expected=list(self.unwritten[:16]) or "every target tensor written", found=list(self.unmatched[:16]) or None)


def _coverage(mapping: Mapping, w: _Walk) -> Coverage:
    """What the walk left out. A sized rule (every target placeholder a sized Select: a configured
    preset) names its targets for the whole model; one that matched no checkpoint key is scanned
    lazily, stopping at its first name no other rule wrote (its count is arithmetic). An unsized
    rule that named nothing is idle unless another rule's output matches its target pattern.
    Regex and scan work is bounded by _MATCH_BUDGET; past it, a rule counts as idle (fail closed)."""
    written = {t.name for t in w.outs}
    unwritten, idle = list(w.dropped), []
    budget = _MATCH_BUDGET
    for i, (rule, rx, _) in enumerate(mapping._compiled):
        sizes = _sized(rule)
        src = rule.source if isinstance(rule.source, str) else list(rule.source)
        if sizes is not None:
            count = math.prod(sizes)
            if count > MAX_OUTPUTS:
                raise _too_many(rule, count)
            if i in w.named:  # its sizes equal a checkpoint tensor's: the walk enumerated as many names
                unwritten += [t for t in _names(rule, sizes) if t not in written]
                continue
            missing: list[str] = []
            for t in _names(rule, sizes):
                budget -= 1
                if t not in written or budget < 0:
                    missing.append(t)
                    if len(missing) == _SHOWN or budget < 0:
                        break
            if missing:
                unwritten += missing
                idle.append(f"rule {i} ({src!r} -> {rule.target!r}: {count} target(s))")
            continue
        if i in w.named:
            continue
        filled = False
        for t in w.outs:
            budget -= 1
            if budget < 0:
                break
            if rx.match(t.name):
                filled = True
                break
        if not filled:
            idle.append(f"rule {i} ({src!r} -> {rule.target!r})")
    return Coverage(tuple(sorted(dict.fromkeys(unwritten), key=natural_key)), tuple(w.unmapped), tuple(idle))


def model_tensors(ckpt: Checkpoint, dtype: str | None = None, *, ignore: Sequence[str] = (),
                  optimizer: bool = False) -> tuple[list[ExportTensor], list[str]]:
    """The export without a mapping: every tensor under its own key path, but those ``ignore``
    globs name (``fnmatch``, ``*`` crosses ``/``) and, unless ``optimizer``, optimizer state
    (:func:`ckptfmt.restoreplan.is_optimizer_state`: Adam moments and counts are no model weights).
    Returns (output tensors, the checkpoint keys left out)."""
    outs, _ = identity_tensors(ckpt, dtype)
    kept: list[ExportTensor] = []
    left: list[str] = []
    for t in outs:
        out = any(fnmatch.fnmatchcase(t.name, g) for g in ignore) or (not optimizer and is_optimizer_state(t.name))
        (left.append(t.name) if out else kept.append(t))
    return kept, left


def export_tensors(ckpt: Checkpoint, mapping: Mapping, dtype: str | None = None, *,
                   allow_partial: bool = False) -> tuple[list[ExportTensor], list[str], Coverage]:
    """(output tensors in natural name order, checkpoint keys no output reads, the coverage).

    Raises, before anything is written: MappingError as :func:`mapped_tensors`; KeyMismatchError
    naming the target tensors left unwritten, the checkpoint keys that match no rule and the rules
    that matched nothing (with how to fit them), unless ``allow_partial`` (then they are only
    reported in the returned Coverage)."""
    w = _walk(ckpt, mapping, dtype)  # first: a declared Select size that the checkpoint contradicts fails here
    cov = _coverage(mapping, w)
    if not cov.complete and not allow_partial:
        raise cov.error()
    return w.outs, w.unmapped, cov
