"""Rules, resolution and the load report of the mapping language (see :mod:`bridges.mapping`)."""
from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping as TMapping, Sequence

import numpy as np

from ckptfmt.restoreplan import RestoreReport

from ._chain import Chain, split_chain, with_select_size
from ._joins import Concat, Stack
from ._transforms import Cast, NotApplicable, Select, Transform, Transpose

__all__ = ["Rule", "Mapping", "Resolved", "LoadReport", "KeptValuesWarning", "closest_key"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
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


def _compile(pattern: str, known: TMapping[str, str] | None = None, ints: Iterable[str] = ()) -> re.Pattern[str]:
    """Anchored regex for ``pattern``; placeholders in ``known`` must equal the given text, those in
    ``ints`` match decimal digits only."""
    ints = set(ints)
    out, pos, seen = [], 0, set()
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        name = m.group(1)
        if known is not None and name in known:
            out.append(re.escape(known[name]))
        elif name in seen:
            out.append(f"(?P={name})")
        else:
            out.append(f"(?P<{name}>[0-9]+)" if name in ints else f"(?P<{name}>.+?)")
            seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


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
    :class:`Concat` or :class:`Stack` may join several sources (transforms before it apply to
    each source, those after it to the joined tensor). ``permute`` (the older form) maps
    ndim -> axes with ``target = source.transpose(axes)``; a rule whose table lacks the tensor's
    ndim does not apply. Give one or the other.

    Placeholders: one that only the target has is either the index of a :class:`Select` (then it
    matches digits and picks that entry of the stacked axis) or dropped (many targets read one
    source: optax's single ``count`` feeds every torch ``step``). One that only the source has is
    either the key family of a :class:`Stack` (``layers.{i}`` for i = 0, 1, ...) or filled from the
    first matching checkpoint key in sorted order.
    """

    source: str | tuple[str, ...]
    target: str
    permute: TMapping[int, tuple[int, ...]] | None = None
    transforms: tuple[Transform, ...] = ()

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
        _, join, _ = split_chain(self.transforms)  # ValueError for two joins
        srcs = self.sources
        if isinstance(join, Concat) and len(srcs) < 2:
            raise ValueError(f"{where}: Concat needs two or more sources")
        if not isinstance(join, Concat) and len(srcs) != 1:
            raise ValueError(f"{where}: {len(srcs)} sources need a Concat to join them")
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
        return f"rule {src!r} -> {self.target!r}{ops}"

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
        mid = [join.inverse()] if join is not None else []
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
    # (optax's count -> torch's step) changes no shape or box, so they take it too.
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
        from ckptfmt import Box
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
        self._compiled.extend((r, _compile(r.target, ints=r.index_names)) for r in self.rules)

    def __add__(self, other: "Mapping") -> "Mapping":
        if (self.source_sep, self.target_sep) != (other.source_sep, other.target_sep):
            raise ValueError("cannot combine mappings with different separators")
        return Mapping(self.rules + other.rules, self.ignore + other.ignore, self.keep + other.keep,
                       self.source_sep, self.target_sep)

    def inverse(self) -> "Mapping":
        """The mapping for the opposite direction (target becomes source; ``ignore`` <-> ``keep``).

        Raises ValueError when a rule has a transform without an inverse.
        """
        return Mapping(tuple(r for rule in self.rules for r in rule.inverses()), ignore=self.keep,
                       keep=self.ignore, source_sep=self.target_sep, target_sep=self.source_sep)

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

    def _sources(self, rule: Rule, got: dict[str, str], keys: Any) -> tuple[str, ...] | None:
        """Source keys for a match; None when they cannot be known (source-only placeholders, no keys)."""
        stack = next((op for op in rule.transforms if isinstance(op, Stack)), None)
        out: list[str] = []
        for pattern in rule.sources:
            names = _placeholders(pattern)
            if all(n in got for n in names):
                out.append(_fill(pattern, got))
                continue
            if keys is None:
                return None
            if stack is not None and [n for n in names if n not in got] == [stack.over]:
                rx = _compile(pattern, got, ints=(stack.over,))
                found = sorted({int(m.group(stack.over)) for k in keys if (m := rx.match(k))})
                out += [_fill(pattern, {**got, stack.over: i}) for i in range(_family_length(found))]
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
        for idx, (rule, rx) in enumerate(self._compiled):
            m = rx.match(target_key)
            if m is None:
                continue
            where = f"rule {idx} ({rule.describe()})"
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            ops = self._bind(rule, ndim, got, where)
            if isinstance(ops, str):
                notes.append(ops)
                continue
            srcs = self._sources(rule, got, keys)
            if srcs is None:
                continue
            lacking = [] if keys is None else [s for s in srcs if s not in keys]
            if not lacking:
                return Resolved(target_key, srcs, ops, rule, tuple(notes))
            notes.append(f"{where} matched but the checkpoint lacks {lacking[:3]}")
            first = first or Resolved(target_key, srcs, ops, rule)
        if first is not None:
            return Resolved(first.target_key, first.source_keys, first.transforms, first.rule, tuple(notes))
        return Resolved(target_key, (target_key,), (), None, tuple(notes))

    def resolve_unique(self, target_key: str, ndim: int) -> Resolved:
        """Like :meth:`resolve` without checkpoint keys (for writing), but every matching rule
        must agree; ValueError names the candidates otherwise (e.g. a 2-D torch ``weight`` under
        generic Flax rules: Dense kernel or Embed embedding)."""
        found: list[Resolved] = []
        for rule, rx in self._compiled:
            m = rx.match(target_key)
            if m is None:
                continue
            got = {k: v.replace(self.target_sep, self.source_sep) for k, v in m.groupdict().items()}
            ops = self._bind(rule, ndim, got, "")
            if isinstance(ops, str) or not all(n in got for s in rule.sources for n in _placeholders(s)):
                continue
            found.append(Resolved(target_key, tuple(_fill(s, got) for s in rule.sources), ops, rule))
        distinct = {(r.source_keys, r.transforms) for r in found}
        if len(distinct) > 1:
            raise ValueError(f"{target_key!r} matches several mapping rules: {sorted(distinct, key=str)}; "
                             "use exact rules (e.g. flax_nnx_to_torch(layers=...))")
        return found[0] if found else Resolved(target_key, (target_key,))


