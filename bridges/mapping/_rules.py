"""Rules, resolution and the load report of the mapping language (see :mod:`bridges.mapping`)."""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Iterable, Mapping as TMapping, Sequence

import numpy as np

from ckptfmt import Box
from ckptfmt.restoreplan import RestoreReport

from bridges.mapping._chain import Chain, InvalidRuleError, split_chain, with_select_size
from bridges.mapping._joins import Concat, ConcatStacks, Part, Stack
from bridges.mapping._pattern import PLACEHOLDER, Pattern
from bridges.mapping._quant import Dequantize
from bridges.mapping._transforms import Cast, NotApplicable, Transform, Transpose
from bridges.mapping._joins import Select

__all__ = ["Rule", "Mapping", "Resolved", "LoadReport", "KeptValuesWarning", "closest_key"]

_PLACEHOLDER = PLACEHOLDER
_CLOSE_MAX = 4096  # checkpoints with more keys get no "closest key" hint (difflib is slow)


class KeptValuesWarning(UserWarning):
    """A non-strict load left target keys at their initial values (the checkpoint lacks them)."""


#: What a restore did, key by key: the core planner's report (ckptfmt.restoreplan), one type in
#: every bridge (``bridges.torch.Loaded.report`` and ``stats["report"]`` of both bridges).
LoadReport = RestoreReport


def closest_key(key: str, keys: Iterable[str]) -> str | None:
    """The checkpoint key most like ``key`` (for error messages), or None; slow: call it for a few."""
    pool = list(keys)
    if len(pool) > _CLOSE_MAX:
        return None
    close = difflib.get_close_matches(key, pool, n=1)
    return close[0] if close else None


def _placeholders(pattern: str) -> list[str]:
    return _PLACEHOLDER.findall(pattern)


def _compile(pattern: str, known: TMapping[str, str] | None = None, ints: Iterable[str] = ()) -> Pattern:
    """The matcher of ``pattern`` (:mod:`bridges.mapping._pattern`): placeholders in ``known`` must equal
    the given text, those in ``ints`` match decimal digits only."""
    return Pattern(pattern, known, ints)


def _fill(pattern: str, values: TMapping[str, Any]) -> str:
    return _PLACEHOLDER.sub(lambda mm: str(values[mm.group(1)]), pattern)


def _family_length(found: Sequence[int]) -> int:
    """How many keys of a Stack's family to name, from the sorted distinct indices present: all of
    them when they are 0..n-1, else up to the first gap (that key is then reported missing).
    Never more than one past the keys present, whatever index a key spells."""
    for i, v in enumerate(found):
        if v != i:
            return i + 1
    return max(1, len(found))


def _invert(axes: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(axes)
    for i, a in enumerate(axes):
        inv[a] = i
    return tuple(inv)


@dataclass(frozen=True)
class Rule:
    """``source`` pattern(s) <-> ``target`` pattern, with a chain of layout transforms.

    ``transforms`` apply in order from the source layout to the target layout; one
    :class:`Concat`, or one or more adjacent :class:`Stack` s (a family over several placeholders:
    layers and experts), may join several sources (transforms before it apply to each source,
    those after it to the joined tensor). ``permute`` (the older form) maps
    ndim -> axes with ``target = source.transpose(axes)``; a rule whose table lacks the tensor's
    ndim does not apply. Give one or the other.

    Placeholders: one that only the target has is either the index of a :class:`Select` (then it
    matches digits and picks that entry of the stacked axis) or dropped (many targets read one
    source: optax's single ``count`` feeds every torch ``step``). One that only the source has is
    either the key family of a :class:`Stack` (``layers.{i}`` for i = 0, 1, ...) or filled from the
    first matching checkpoint key in sorted order.

    ``also=True`` makes the rule a copy: a save writes the target's value to this rule's source
    too (besides the rule that resolves the key), and a load reads it only when no earlier rule
    applies. torch's ``step`` is saved as optax's ``count`` and, by a copy, as NNX's
    ``optimizer/step``.
    """

    source: str | tuple[str, ...]
    target: str
    permute: TMapping[int, tuple[int, ...]] | None = None
    transforms: tuple[Transform, ...] = ()
    also: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            object.__setattr__(self, "source", tuple(str(s) for s in self.source))
        object.__setattr__(self, "transforms", tuple(self.transforms))
        where = f"rule {self.source!r} -> {self.target!r}"
        if self.permute is not None:
            if self.transforms:
                raise ValueError(f"{where}: give permute or transforms, not both")
            table = {int(n): tuple(int(a) for a in axes) for n, axes in dict(self.permute).items()}
            for n, axes in table.items():
                if sorted(axes) != list(range(n)):
                    raise ValueError(f"{where}: {axes} is not a permutation of {n} axes")
            object.__setattr__(self, "permute", table)
        for op in self.transforms:
            if not isinstance(op, Transform):
                raise ValueError(f"{where}: {op!r} is not a transform")
        _, join, _ = split_chain(self.transforms)  # InvalidRuleError for joins that do not compose
        srcs = self.sources
        concat = join.concat if isinstance(join, ConcatStacks) else join
        if isinstance(concat, Concat) and len(srcs) < 2:
            raise ValueError(f"{where}: Concat needs two or more sources")
        if isinstance(join, Dequantize) and len(srcs) != 2:
            raise ValueError(f"{where}: Dequantize needs two sources, the codes and their scales")
        if not isinstance(concat, (Concat, Dequantize)) and len(srcs) != 1:
            raise ValueError(f"{where}: {len(srcs)} sources need a Concat to join them")
        if isinstance(join, ConcatStacks) and join.parts != len(srcs):
            raise InvalidRuleError(f"{where}: the Concat's sizes name {join.parts} parts for {len(srcs)} sources",
                                   key=self.target, expected=len(srcs), found=join.parts)
        tnames = set(_placeholders(self.target))
        for op in self.transforms:
            if isinstance(op, Select) and isinstance(op.index, str) and op.index not in tnames:
                raise ValueError(f"{where}: Select index {{{op.index}}} is not a placeholder of the target")
            if isinstance(op, Stack) and (op.over not in _placeholders(srcs[0]) or op.over in tnames):
                raise ValueError(f"{where}: Stack over {{{op.over}}} needs it in the source pattern only")

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    @property
    def index_names(self) -> set[str]:
        """Placeholders used as integer indices (Select in the target, Stack in the source)."""
        out = set()
        for op in self.transforms:
            if isinstance(op, Select) and isinstance(op.index, str):
                out.add(op.index)
            elif isinstance(op, Stack):
                out.add(op.over)
        return out

    def describe(self) -> str:
        src = self.source if isinstance(self.source, str) else list(self.source)
        ops = f" via {list(self.transforms)}" if self.transforms else (f" permute={self.permute}" if self.permute else "")
        return f"rule {src!r} -> {self.target!r}{ops}" + (" (also)" if self.also else "")

    def axes_for(self, ndim: int) -> tuple[int, ...] | None | bool:
        """The permute axes for ``ndim`` dims; None: identity; False: the permute table lacks ndim."""
        if self.permute is None:
            return None
        axes = self.permute.get(ndim)
        if axes is None:
            return False
        return None if axes == tuple(range(ndim)) else axes

    def inverses(self) -> tuple["Rule", ...]:
        """The same correspondence read the other way. A Concat of n sources becomes n rules,
        each a :class:`Part` of the joined tensor; a Select over a placeholder becomes a Stack.
        Raises ValueError for a transform without an inverse (a fixed-index Select, a Part)."""
        if self.permute is not None or not self.transforms:
            perm = None if self.permute is None else {n: _invert(a) for n, a in self.permute.items()}
            return (Rule(source=self.target, target=self.sources[0], permute=perm),)
        pre, join, post = split_chain(self.transforms)
        tail = [op.inverse() for op in reversed(post)]
        head = [op.inverse() for op in reversed(pre)]
        if isinstance(join, Concat):
            n = len(self.sources)
            return tuple(Rule(self.target, src, transforms=tuple(tail + [join.inverse_part(k, n)] + head))
                         for k, src in enumerate(self.sources))
        if isinstance(join, ConcatStacks):  # each part: the Stacks' Selects, then its Part
            return tuple(Rule(self.target, src, transforms=tuple(tail + join.inverse_part(k) + head))
                         for k, src in enumerate(self.sources))
        mid = join.inverse_ops() if join is not None else []
        return (Rule(self.target, self.sources[0], transforms=tuple(tail + mid + head)),)

    def inverse(self) -> "Rule":
        """The single inverse rule (ValueError for a Concat, which has several: use :meth:`inverses`)."""
        out = self.inverses()
        if len(out) != 1:
            raise ValueError(f"{self.describe()} inverts to {len(out)} rules; use Rule.inverses() or Mapping.inverse()")
        return out[0]


@dataclass(frozen=True)
class Resolved:
    """Where a target key's data comes from: the source key(s) and the bound transforms.

    ``notes`` says why earlier matching rules did not apply (for error messages). Bind it to the
    checkpoint's shapes with :meth:`chain` (load) or to the state's shape with
    :meth:`chain_for_target` (save).
    """

    target_key: str
    source_keys: tuple[str, ...] | str
    transforms: tuple[Transform, ...] = ()
    rule: Rule | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.source_keys, str):
            object.__setattr__(self, "source_keys", (self.source_keys,))
        object.__setattr__(self, "source_keys", tuple(self.source_keys))
        object.__setattr__(self, "transforms", tuple(self.transforms))

    @property
    def source_key(self) -> str:
        """The (first) source key."""
        return self.source_keys[0]  # type: ignore[index]

    @property
    def where(self) -> str:
        return self.rule.describe() if self.rule is not None else "the identity (no rule matched)"

    @property
    def axes(self) -> tuple[int, ...] | None:
        """The transpose axes when the chain is one Transpose (None: identity or another chain)."""
        if len(self.transforms) == 1 and isinstance(self.transforms[0], Transpose):
            return self.transforms[0].axes
        return None

    @property
    def unsized_select(self) -> Select | None:
        """The bound Select whose stacked length is not given (a save infers it), else None."""
        for op in self.transforms:
            if isinstance(op, Select) and op.size is None:
                return op
        return None

    def chain(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> Chain:
        """Bind to the checkpoint's source shapes and dtypes. Raises MappingError naming the rule."""
        return Chain.from_sources(self.target_key, self.source_keys, self.transforms,  # type: ignore[arg-type]
                                  [tuple(s) for s in shapes], [np.dtype(d) for d in dtypes], self.where)

    def chain_for_target(self, shape: Sequence[int], dtype: Any, select_size: int | None = None) -> Chain:
        """Bind backward from the state's shape (saves); ``select_size`` sizes an unsized Select."""
        ops = self.transforms if select_size is None else with_select_size(self.transforms, select_size)
        return Chain.from_target(self.target_key, self.source_keys, ops, tuple(shape), np.dtype(dtype),  # type: ignore[arg-type]
                                 self.where)

    # The transpose-only helpers of the first mapping version (whole tensors and boxes); a Cast
    # (the step counters' rules) is elementwise, so they take it too.
    def _transpose_only(self) -> None:
        if any(not isinstance(op, (Transpose, Cast)) for op in self.transforms) or len(self.source_keys) != 1:
            raise ValueError(f"{self.where}: this helper handles transposes and casts only; use Resolved.chain()")

    def source_shape(self, target_shape: Sequence[int]) -> tuple[int, ...]:
        self._transpose_only()
        shape = tuple(target_shape)
        for op in reversed(self.transforms):
            shape = op.in_shape(shape)
        return shape

    def target_shape(self, source_shape: Sequence[int]) -> tuple[int, ...]:
        self._transpose_only()
        shape = tuple(source_shape)
        for op in self.transforms:
            shape = op.out_shape(shape)
        return shape

    def source_box(self, offset: Sequence[int], shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The source-coordinate box holding exactly the target box ``(offset, shape)``."""
        self._transpose_only()
        box = Box(tuple(offset), tuple(shape))
        for op in reversed(self.transforms):
            box = op.in_box(box, ())
        return box.offset, box.shape

    def to_target(self, source_block: np.ndarray) -> np.ndarray:
        """A whole source tensor (or a block read at :meth:`source_box`) in the target layout."""
        self._transpose_only()
        for op in self.transforms:
            source_block = op.apply(source_block, None, None, source_block.shape)  # type: ignore[arg-type]
        return source_block


@dataclass(frozen=True)
class Mapping:
    """Ordered rename/transform rules plus two glob lists.

    ``ignore``: checkpoint keys that are never reported as unexpected (e.g. ``nnx`` step counters).
    ``keep``: target keys that keep the target's own value when the checkpoint lacks them
    (e.g. torch ``param_groups``, which hold hyperparameters rather than state).
    The first rule whose target pattern matches AND whose source keys all exist wins; if none
    does, the first matching rule's source keys are reported missing (with ``notes`` saying why
    each matching rule did not apply). No rule matching: identity.

    ``tiers`` (one per rule; 0 when not given) is the precedence :meth:`override` records: of the
    rules whose target pattern matches a key, only those of the lowest tier are considered, on
    load and on save (a user's rule replaces the preset's rules for the keys it matches).
    """

    rules: tuple[Rule, ...] = ()
    ignore: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    source_sep: str = "/"
    target_sep: str = "/"
    tiers: tuple[int, ...] = ()
    _compiled: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "ignore", tuple(self.ignore))
        object.__setattr__(self, "keep", tuple(self.keep))
        tiers = tuple(int(t) for t in self.tiers) or (0,) * len(self.rules)
        if len(tiers) != len(self.rules):
            raise ValueError(f"tiers has {len(tiers)} entries for {len(self.rules)} rules")
        object.__setattr__(self, "tiers", tiers)
        self._compiled.extend((r, _compile(r.target, ints=r.index_names), t) for r, t in zip(self.rules, tiers))

    def __add__(self, other: "Mapping") -> "Mapping":
        if (self.source_sep, self.target_sep) != (other.source_sep, other.target_sep):
            raise ValueError("cannot combine mappings with different separators")
        return Mapping(self.rules + other.rules, self.ignore + other.ignore, self.keep + other.keep,
                       self.source_sep, self.target_sep, self.tiers + other.tiers)

    def override(self, *rules: Rule, ignore: Sequence[str] = (), keep: Sequence[str] = ()) -> "Mapping":
        """This mapping with ``rules`` taking precedence (a fresh Mapping; ``self`` is unchanged).

        For every key one of ``rules`` matches, this mapping's own rules are not considered, on
        load or on save: that replaces a preset's rule (and its ``also`` copies); a key none of
        them matches resolves as before, so a rule for a key the preset does not name adds one.
        ``ignore`` / ``keep`` globs are added to this mapping's. Raises ValueError for a non-Rule.
        """
        for r in rules:
            if not isinstance(r, Rule):
                raise ValueError(f"override takes Rule objects, got {type(r).__name__}")
        return Mapping(tuple(rules) + self.rules, self.ignore + tuple(ignore), self.keep + tuple(keep),
                       self.source_sep, self.target_sep, (0,) * len(rules) + tuple(t + 1 for t in self.tiers))

    def inverse(self) -> "Mapping":
        """The mapping for the opposite direction (target becomes source; ``ignore`` <-> ``keep``;
        the precedence of :meth:`override` kept). Rules that each read one :class:`Part` of the
        same source (a fused qkv or gate|up kernel, stacked or not) invert together, to one rule
        that concatenates their targets (and stacks them, where the parts were selected from a
        stacked axis). Raises ValueError when a rule has a transform without an inverse (a fixed
        Select; Parts of one source that do not cover it, or equal parts under a Select, which
        need their sizes).
        """
        fused = _fused_parts(self.rules)
        pairs = [(r, t) for k, (rule, t) in enumerate(zip(self.rules, self.tiers)) if fused.get(k, ()) is not None
                 for r in (fused[k] if k in fused else rule.inverses())]
        return Mapping(tuple(r for r, _ in pairs), ignore=self.keep, keep=self.ignore, source_sep=self.target_sep,
                       target_sep=self.source_sep, tiers=tuple(t for _, t in pairs))

    def _matching(self, target_key: str) -> list[tuple[int, Rule, re.Match[str]]]:
        """(index, rule, match) of the rules whose target pattern matches, the lowest tier only."""
        found = [(i, r, m, t) for i, (r, rx, t) in enumerate(self._compiled) if (m := rx.match(target_key))]
        low = min((t for *_, t in found), default=0)
        return [(i, r, m) for i, r, m, t in found if t == low]

    def is_ignored(self, source_key: str) -> bool:
        return any(fnmatch.fnmatchcase(source_key, g) for g in self.ignore)

    def is_kept(self, target_key: str) -> bool:
        return any(fnmatch.fnmatchcase(target_key, g) for g in self.keep)

    def _bind(self, rule: Rule, ndim: int, got: dict[str, str], where: str) -> tuple[Transform, ...] | str:
        """The rule's transforms with indices bound, or a note saying why the rule does not apply."""
        if rule.permute is not None:
            axes = rule.axes_for(ndim)
            if axes is False:
                return (f"{where} matched but its permute table has no entry for {ndim} dims "
                        f"(it has {sorted(rule.permute)}): use transforms=(...) for other layouts")
            return () if axes is None else (Transpose(axes),)  # type: ignore[arg-type]
        try:
            return tuple(op.bind({k: int(v) for k, v in got.items() if k in rule.index_names})
                         for op in rule.transforms)
        except NotApplicable as e:
            return f"{where} matched but {e.reason}"

    def _sources(self, rule: Rule, got: dict[str, str], keys: Any,
                 family: dict[str, int] | None = None) -> tuple[str, ...] | None:
        """Source keys for a match; None when they cannot be known (source-only placeholders, no keys)."""
        overs = [op.over for op in rule.transforms if isinstance(op, Stack)][::-1]  # outermost first
        out: list[str] = []
        for pattern in rule.sources:
            names = _placeholders(pattern)
            if all(n in got for n in names):
                out.append(_fill(pattern, got))
                continue
            if keys is None:
                return None
            if overs and sorted({n for n in names if n not in got}) == sorted(overs):
                rx = _compile(pattern, got, ints=overs)
                hits = [m for k in keys if (m := rx.match(k))]
                sizes = [_family_length(sorted({int(m.group(o)) for m in hits})) for o in overs]
                if family is not None:
                    family.update(zip(overs, sizes))
                out += [_fill(pattern, {**got, **dict(zip(overs, idx))}) for idx in product(*map(range, sizes))]
                continue
            rx = _compile(pattern, got)
            cands = sorted(k for k in keys if rx.match(k))
            if not cands:
                out.append(_fill(pattern, {**{n: f"{{{n}}}" for n in names}, **got}))
                continue
            out.append(cands[0])
        return tuple(out)

    def resolve(self, target_key: str, ndim: int, source_keys: Iterable[str] | None = None) -> Resolved:
        """Where ``target_key`` (a tensor of ``ndim`` dims) reads from.

        ``source_keys``: the checkpoint's keys (a set is fastest); used to pick among rules, to
        expand key families and to fill placeholders that only the source side has. Never raises
        for an unknown key: the caller checks the returned ``source_keys`` against the checkpoint
        and reports ``notes``.
        """
        keys = source_keys if source_keys is None or isinstance(source_keys, (set, frozenset, dict)) \
            else set(source_keys)
        first: Resolved | None = None
        notes: list[str] = []
        for idx, rule, m in self._matching(target_key):
            where = f"rule {idx} ({rule.describe()})"
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            ops = self._bind(rule, ndim, got, where)
            if isinstance(ops, str):
                notes.append(ops)
                continue
            family: dict[str, int] = {}
            srcs = self._sources(rule, got, keys, family)
            if srcs is None:
                continue
            if len(family) > 1:  # the family's sizes tell the Stacks how its keys are laid out
                ops = tuple(Stack(op.axis, op.over, family[op.over]) if isinstance(op, Stack) and op.size is None
                            else op for op in ops)
            lacking = [] if keys is None else [s for s in srcs if s not in keys]
            if not lacking:
                return Resolved(target_key, srcs, ops, rule, tuple(notes))
            notes.append(f"{where} matched but the checkpoint lacks {lacking[:3]}")
            first = first or Resolved(target_key, srcs, ops, rule)
        if first is not None:
            return Resolved(first.target_key, first.source_keys, first.transforms, first.rule, tuple(notes))
        if not notes and keys is not None and target_key not in keys:
            notes += self._level_hint(target_key)
        return Resolved(target_key, (target_key,), (), None, tuple(notes))

    def _level_hint(self, target_key: str) -> list[str]:
        """A key no rule names, that a rule names one level down (``model/`` + key): the target
        lacks the top level the mapping's targets have (a state dict passed where ``{"model": ...}``
        was meant). One note saying so, or none."""
        seps = dict.fromkeys(("/", self.target_sep))  # a state dict's level is "/" whatever the leaves use
        tops = {(r.target.split(sep, 1)[0], sep) for r in self.rules for sep in seps if sep in r.target}
        for top, sep in sorted(t for t in tops if "{" not in t[0]):
            if next(iter(self._matching(f"{top}{sep}{target_key}")), None) is not None:
                return [f"TARGET LEVEL: the mapping names {top}{sep}{target_key}, not {target_key}: the target "
                        f"lacks the {top!r} level the mapping's rules have; pass {{{top!r}: ...}} around it"]
        return []

    def resolve_unique(self, target_key: str, ndim: int) -> Resolved:
        """Like :meth:`resolve` without checkpoint keys (for writing), but every matching rule
        must agree (``also`` copies aside: see :meth:`resolve_writes`); InvalidRuleError (a
        ValueError) names the candidates otherwise (e.g. a 2-D torch ``weight`` under generic
        Flax rules: Dense kernel or Embed embedding)."""
        return self.resolve_writes(target_key, ndim)[0]

    def resolve_writes(self, target_key: str, ndim: int) -> tuple[Resolved, ...]:
        """Every checkpoint-side tensor a save writes ``target_key`` to: the one rule that resolves
        it (all matching rules must agree), then the ``also`` copies. InvalidRuleError (a
        ValueError) when matching rules disagree, naming them and the way out."""
        found: list[Resolved] = []
        for _, rule, m in self._matching(target_key):
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            ops = self._bind(rule, ndim, got, "")
            if isinstance(ops, str) or not all(n in got for s in rule.sources for n in _placeholders(s)):
                continue
            found.append(Resolved(target_key, tuple(_fill(s, got) for s in rule.sources), ops, rule))
        main = [r for r in found if not r.rule.also] or found[:1]  # type: ignore[union-attr]
        distinct = {(r.source_keys, r.transforms) for r in main}
        if len(distinct) > 1:
            raise InvalidRuleError(
                f"{target_key!r} matches several mapping rules, so a save cannot tell where to write it: "
                f"{sorted(distinct, key=str)}; use exact rules (e.g. flax_nnx_to_torch(layers=...)), or "
                "mapping.override(Rule(...)) to replace a preset's rule for this key",
                key=target_key, expected="one matching rule", found=[r.where for r in main][:4])
        if not main:
            return (Resolved(target_key, (target_key,)),)
        copies = [r for r in found if r not in main and r.source_keys != main[0].source_keys]
        return (main[0], *copies)


def _fused_parts(rules: Sequence[Rule]) -> dict[int, tuple[Rule, ...] | None]:
    """Rules reading parts of one fused source, grouped: rule index -> its group's one inverse rule
    (on the group's first rule) or None (the others). Parts are grouped by source, the transforms
    around the Part and the Part's axis and sizes; every part must be there."""
    groups: dict[tuple, list[tuple[int, int, Rule]]] = {}
    for k, r in enumerate(rules):
        parts = [i for i, op in enumerate(r.transforms) if isinstance(op, Part)]
        if r.permute is not None or len(r.sources) != 1 or len(parts) != 1:
            continue
        i = parts[0]
        part = r.transforms[i]
        key = (r.source, r.transforms[:i], r.transforms[i + 1:], part.axis, part.parts, r.also)  # type: ignore[attr-defined]
        groups.setdefault(key, []).append((part.index, k, r))  # type: ignore[attr-defined]
    out: dict[int, tuple[Rule, ...] | None] = {}
    for (source, head, tail, axis, sizes, also), members in groups.items():
        members.sort()
        n = sizes if isinstance(sizes, int) else len(sizes)
        if [m[0] for m in members] != list(range(n)):
            raise ValueError(f"the Parts of {source!r} cannot invert: parts {[m[0] for m in members]} of {n} are "
                             f"mapped (a fused tensor restores from all of its parts)")
        selects = [op for op in head if isinstance(op, Select)]
        if selects and isinstance(sizes, int):
            raise ValueError(f"the Parts of {source!r} are equal parts under a Select: give Part(..., parts=sizes) "
                             f"so that the stacked inverse knows each layer's sizes")
        ops = ([op.inverse() for op in reversed(tail)] + [Concat(axis, None if isinstance(sizes, int) else sizes)]
               + [op.inverse() for op in reversed(head)])
        joined = Rule(tuple(m[2].target for m in members), source, transforms=tuple(ops), also=also)
        out[members[0][1]] = (joined,)
        out.update({m[1]: None for m in members[1:]})
    return out
