"""Which output tensors a mapping makes from a checkpoint (an export has no target to ask).

A load resolves target keys it is given; an export must first name them. :func:`mapped_tensors`
walks each rule forward: every checkpoint key that matches the rule's (first) source pattern
binds the placeholders the target shares; a target-only placeholder that indexes a
:class:`Select` ranges over the stacked axis; a target-only placeholder that is dropped (optax's
one ``count`` feeding every torch ``step``) cannot be named from the checkpoint, so such a rule
exports nothing (it is reported). Each target key so named is then resolved exactly as a load
would resolve it (the first rule that applies wins) and bound to the checkpoint's shapes
(:class:`bridges._chain.Chain`), which the export engine reads block by block.
"""
from __future__ import annotations

from itertools import product
from typing import Any, Sequence

from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.interop import ExportTensor, output_dtype
from ckptfmt._stexport import natural_key

from ._joins import Stack
from ._rules import Mapping, Rule, _compile, _fill, _placeholders
from ._chain import MappingError
from ._transforms import NotApplicable, Select

__all__ = ["mapped_tensors", "strip_target_prefix", "PRESETS", "preset_mapping"]

#: Presets an export can name (``ckptfmt export --mapping NAME --config config.json``).
PRESETS = ("hf_llama_from_nnx", "hf_llama_from_maxtext", "hf_gpt2_from_nnx")


def strip_target_prefix(mapping: Mapping, prefix: str) -> Mapping:
    """The rules whose target starts with ``prefix``, with it removed (e.g. ``"model/"``: a
    preset's state-dict targets ``model/model.layers.{i}...`` become the file names
    ``model.layers.{i}...``); other rules are dropped, ``keep`` globs likewise."""
    rules = tuple(Rule(r.source, r.target[len(prefix):], r.permute, r.transforms)
                  for r in mapping.rules if r.target.startswith(prefix) and len(r.target) > len(prefix))
    keep = tuple(g[len(prefix):] for g in mapping.keep if g.startswith(prefix))
    return Mapping(rules, mapping.ignore, keep, mapping.source_sep, mapping.target_sep)


def preset_mapping(name: str, config: Any, **kwargs: Any) -> Mapping:
    """A preset of :mod:`bridges.presets` for the model weights alone, named as Hugging Face names
    them in files (``model.layers.0.self_attn.q_proj.weight``): the mapping an export applies, and
    whose ``.inverse()`` restores a ``save_pretrained`` directory into the JAX layout.
    ValueError for an unknown name; the preset's own errors for a config without its sizes."""
    from . import presets

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    m = getattr(presets, name)(config, optimizer=None, **kwargs)
    return strip_target_prefix(m, "model/")


def _select_sizes(rule: Rule, names: Sequence[str], key: str, shape: tuple[int, ...]) -> list[int]:
    """The stacked length behind each Select placeholder in ``names``, from the source's shape.
    MappingError when the rule's transforms before a Select do not apply to that shape."""
    out: dict[str, int] = {}
    level = tuple(shape)
    for i, raw in enumerate(rule.transforms):
        if isinstance(raw, Select) and isinstance(raw.index, str) and raw.index in names:
            if raw.axis >= len(level):
                raise MappingError(f"{rule.describe()} does not apply: Select(axis={raw.axis}) of a {len(level)}-d "
                                   "tensor", key=key, expected=f"> {raw.axis} dims", found=shape)
            out[raw.index] = raw.size if raw.size is not None else level[raw.axis]
        if len(out) == len(names) or raw.join:
            break
        try:
            level = raw.bind({n: 0 for n in rule.index_names}).out_shape(level)
        except NotApplicable as e:
            raise MappingError(f"{rule.describe()} does not apply: transform {i} {raw} -- {e.reason}", key=key,
                               expected=e.expected, found=e.found) from None
    missing = [n for n in names if n not in out]
    if missing:
        raise MappingError(f"{rule.describe()}: no Select before its join names {missing}", key=key)
    return [out[n] for n in names]


def _targets(mapping: Mapping, rule: Rule, keys: Sequence[str], shapes: dict[str, tuple[int, ...]],
             notes: list[str]) -> list[tuple[str, int]]:
    """(target key, source ndim) for every checkpoint key the rule's first source pattern matches."""
    stack = next((op for op in rule.transforms if isinstance(op, Stack)), None)
    rx = _compile(rule.sources[0], ints=(stack.over,) if stack is not None else ())
    tnames = _placeholders(rule.target)
    selects = {op.index for op in rule.transforms if isinstance(op, Select) and isinstance(op.index, str)}
    out: list[tuple[str, int]] = []
    for key in keys:
        m = rx.match(key)
        if m is None:
            continue
        got = {k: v for k, v in m.groupdict().items() if stack is None or k != stack.over}
        bound = {n: got[n].replace(mapping.source_sep, mapping.target_sep) for n in tnames if n in got}
        free = [n for n in tnames if n not in bound]
        if any(n not in selects for n in free):
            notes.append(f"{rule.describe()}: target placeholder(s) {[n for n in free if n not in selects]} "
                         "cannot be named from the checkpoint; not exported")
            return []
        sizes = _select_sizes(rule, free, key, shapes[key]) if free else []
        for combo in product(*(range(n) for n in sizes)):
            out.append((_fill(rule.target, {**bound, **dict(zip(free, combo))}), len(shapes[key])))
    return out


def mapped_tensors(ckpt: Any, mapping: Mapping, dtype: str | None = None) -> tuple[list[ExportTensor], list[str], list[str]]:
    """(output tensors in natural name order, checkpoint keys no output reads (``ignore`` globs
    excluded), notes on rules that named nothing). A rule that matched but does not fit the
    checkpoint's shapes raises MappingError naming it, before anything is written."""
    keys = sorted(ckpt.keys())
    keyset = set(keys)
    shapes = {k: tuple(int(n) for n in ckpt.tensor(k).shape) for k in keys}
    notes: list[str] = []
    outs: dict[str, ExportTensor] = {}
    consumed: set[str] = set()
    for rule in mapping.rules:
        for target, ndim in _targets(mapping, rule, keys, shapes, notes):
            if target in outs:
                continue
            res = mapping.resolve(target, ndim, keyset)
            if any(k not in keyset for k in res.source_keys):
                notes.append(f"{target}: {'; '.join(res.notes) or 'sources missing'}")
                continue
            entries = [ckpt.tensor(k) for k in res.source_keys]
            chain = res.chain([tuple(e.shape) for e in entries], [numpy_dtype(e.dtype) for e in entries])
            src = dtype_name(chain.target_dtype)
            outs[target] = ExportTensor(target, tuple(chain.target_shape), output_dtype(src, dtype), src, chain)
            consumed.update(res.source_keys)
    unmapped = sorted(k for k in keyset - consumed if not mapping.is_ignored(k))
    return [outs[k] for k in sorted(outs, key=natural_key)], unmapped, notes
