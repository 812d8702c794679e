"""Splitting one axis into parts and joining several sources (Concat, Stack); see :mod:`bridges.mapping._transforms`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Sequence

import numpy as np

from ckptfmt import Box

from bridges.mapping._transforms import NotApplicable, Shape, Transform, _check_ndim, _ins, _put, _sl

__all__ = ["Part", "Join", "Concat", "Stack", "Stacks", "ConcatStacks", "Select"]



def _part_sizes(sizes: tuple[int, ...] | int, total: int) -> tuple[int, ...]:
    if isinstance(sizes, int):
        if total % sizes:
            raise NotApplicable(f"axis of size {total} does not split into {sizes} equal parts",
                                expected=f"a multiple of {sizes}", found=total)
        return (total // sizes,) * sizes
    if sum(sizes) != total:
        raise NotApplicable(f"parts {sizes} do not add up to the axis size", expected=sum(sizes), found=total)
    return sizes


# ---------------------------------------------------------------------------------------- select


@dataclass(frozen=True)
class Select(Transform):
    """Take one index along ``axis`` (a stacked layer axis) and drop that axis.

    ``index`` is an int, or the name of an integer placeholder of the rule's TARGET pattern
    (``"i"`` in ``model.layers.{i}.mlp.up_proj.weight``), bound when a key matches. ``size``, the
    length of the stacked axis, is checked on load and needed to save (the bridge infers it from
    the layers saved when absent). The inverse is :class:`Stack` over the same placeholder.
    """

    axis: int
    index: int | str
    size: int | None = None

    def bind(self, values: dict[str, int]) -> "Select":
        if isinstance(self.index, str):
            if self.index not in values:
                raise NotApplicable(f"placeholder {{{self.index}}} is not bound")
            return Select(self.axis, int(values[self.index]), self.size)
        return self

    def out_shape(self, shape: Shape) -> Shape:
        _check_ndim(shape, self.axis + 1, f"Select(axis={self.axis})")
        n = shape[self.axis]
        if self.size is not None and n != self.size:
            raise NotApplicable(f"stacked axis {self.axis} has {n} entries, the rule says {self.size}",
                                expected=self.size, found=shape)
        if isinstance(self.index, int) and not 0 <= self.index < n:
            raise NotApplicable(f"index {self.index} is out of range for axis {self.axis} of size {n}",
                                expected=f"0 <= index < {n}", found=self.index)
        return shape[:self.axis] + shape[self.axis + 1:]

    def in_shape(self, shape: Shape) -> Shape:
        if self.size is None:
            raise NotApplicable(f"Select(axis={self.axis}) has no size: the stacked length is unknown")
        return _ins(shape, self.axis, self.size)

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        return Box(_ins(box.offset, self.axis, int(self.index)), _ins(box.shape, self.axis, 1))

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return block[(slice(None),) * self.axis + (0,)]

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        return [(self.in_box(box, in_shape), np.expand_dims(block, self.axis))]

    def inverse(self) -> Transform:
        if not isinstance(self.index, str):
            raise ValueError(f"Select(axis={self.axis}, index={self.index}) picks a fixed index; only a "
                             "placeholder index (a key family such as layers.{i}) has an inverse")
        return Stack(self.axis, self.index, self.size)


@dataclass(frozen=True)
class Part(Transform):
    """Part ``index`` of an axis split into ``parts`` (a count of equal parts, or their sizes).

    The inverse of one source of :class:`Concat`: a fused ``c_attn`` (d, 3d) read as the query part.
    """

    axis: int
    index: int
    parts: tuple[int, ...] | int

    def __post_init__(self) -> None:
        if not isinstance(self.parts, int):
            object.__setattr__(self, "parts", tuple(int(p) for p in self.parts))
        n = self.parts if isinstance(self.parts, int) else len(self.parts)
        if not 0 <= self.index < n:
            raise ValueError(f"Part index {self.index} out of range for {n} parts")

    def _span(self, total: int) -> tuple[int, int]:
        sizes = _part_sizes(self.parts, total)
        return sum(sizes[:self.index]), sizes[self.index]

    def out_shape(self, shape: Shape) -> Shape:
        _check_ndim(shape, self.axis + 1, f"Part(axis={self.axis})")
        return _put(shape, self.axis, self._span(shape[self.axis])[1])

    def in_shape(self, shape: Shape) -> Shape:
        if isinstance(self.parts, int):
            return _put(shape, self.axis, shape[self.axis] * self.parts)
        return _put(shape, self.axis, sum(self.parts))

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        start = self._span(in_shape[self.axis])[0]
        return Box(_put(box.offset, self.axis, box.offset[self.axis] + start), box.shape)

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return block

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        return [(self.in_box(box, in_shape), block)]

    def inverse(self) -> Transform:
        raise ValueError("a Part has no inverse on its own: invert the Concat rule it came from")


class Join(Transform):
    """A transform of several inputs: part shapes -> one output (see Concat and Stack)."""

    join = True

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        raise NotImplementedError

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        raise NotImplementedError

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        raise NotImplementedError

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        raise NotImplementedError

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        raise NotImplementedError

    def inverse_ops(self) -> list[Transform]:
        """The transforms that undo this join on the joined tensor (a Stack: its Select)."""
        return [self.inverse()]


def _intervals(box: Box, axis: int, sizes: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(part, part start, overlap start, overlap length) for the parts ``box`` touches along ``axis``."""
    out, start = [], 0
    s, e = box.offset[axis], box.offset[axis] + box.shape[axis]
    for k, n in enumerate(sizes):
        lo, hi = max(s, start), min(e, start + n)
        if hi > lo:
            out.append((k, start, lo, hi - lo))
        start += n
    return out


@dataclass(frozen=True)
class Concat(Join):
    """Concatenate the rule's sources along ``axis`` (fused qkv, fused gate/up, GPT-2 ``c_attn``).

    ``sizes`` (optional) pins each source's extent; without it the sources' shapes decide, and the
    inverse splits into equal parts. Box mapping: each source intersecting the output box is read
    for its overlap only.
    """

    axis: int
    sizes: tuple[int, ...] | None = None

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        first = shapes[0]
        _check_ndim(first, self.axis + 1, f"Concat(axis={self.axis})")
        for s in shapes[1:]:
            if len(s) != len(first) or _put(s, self.axis, 0) != _put(first, self.axis, 0):
                raise NotApplicable(f"Concat(axis={self.axis}) needs sources equal in every other axis",
                                    expected=first, found=s)
        got = tuple(s[self.axis] for s in shapes)
        if self.sizes is not None and got != tuple(self.sizes):
            raise NotApplicable(f"Concat sources have extents {got}, the rule says {self.sizes}",
                                expected=tuple(self.sizes), found=got)
        return _put(first, self.axis, sum(got))

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        sizes = _part_sizes(tuple(self.sizes) if self.sizes is not None else int(n or 1), shape[self.axis])
        return [_put(shape, self.axis, m) for m in sizes]

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        sizes = [s[self.axis] for s in shapes]
        return [(k, Box(_put(box.offset, self.axis, lo - start), _put(box.shape, self.axis, n)))
                for k, start, lo, n in _intervals(box, self.axis, sizes)]

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=self.axis)

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        sizes = [s[self.axis] for s in shapes]
        s0 = box.offset[self.axis]
        return [(k, Box(_put(box.offset, self.axis, lo - start), _put(box.shape, self.axis, n)),
                 block[_sl(block.ndim, self.axis, slice(lo - s0, lo - s0 + n))])
                for k, start, lo, n in _intervals(box, self.axis, sizes)]

    def out_shape(self, shape: Shape) -> Shape:  # a join is shaped by join_shape
        raise NotApplicable("Concat joins several sources")

    def inverse_part(self, index: int, n: int) -> Part:
        return Part(self.axis, index, tuple(self.sizes) if self.sizes is not None else n)


@dataclass(frozen=True)
class Stack(Join):
    """Stack the rule's key family ``{over}`` = 0, 1, ... along a new ``axis``: the inverse of
    :class:`Select` (per-layer torch keys -> one stacked JAX tensor)."""

    axis: int
    over: str
    size: int | None = None

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        if self.size is not None and len(shapes) != self.size:
            raise NotApplicable(f"Stack over {{{self.over}}} expects {self.size} keys", expected=self.size,
                                found=len(shapes))
        for s in shapes[1:]:
            if s != shapes[0]:
                raise NotApplicable(f"Stack over {{{self.over}}} needs equal shapes", expected=shapes[0], found=s)
        _check_ndim(_ins(shapes[0], self.axis, len(shapes)), self.axis + 1, f"Stack(axis={self.axis})")
        return _ins(shapes[0], self.axis, len(shapes))

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        return [shape[:self.axis] + shape[self.axis + 1:]] * shape[self.axis]

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        a = self.axis
        inner = Box(box.offset[:a] + box.offset[a + 1:], box.shape[:a] + box.shape[a + 1:])
        return [(k, inner) for k in range(box.offset[a], box.offset[a] + box.shape[a])]

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        return np.stack(blocks, axis=self.axis)

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        a = self.axis
        inner = Box(box.offset[:a] + box.offset[a + 1:], box.shape[:a] + box.shape[a + 1:])
        return [(box.offset[a] + j, inner, np.take(block, j, axis=a)) for j in range(box.shape[a])]

    def out_shape(self, shape: Shape) -> Shape:
        raise NotApplicable("Stack joins several sources")

    def inverse(self) -> Select:
        return Select(self.axis, self.over, self.size)


def _drop(t: tuple, axis: int) -> tuple:
    return t[:axis] + t[axis + 1:]


@dataclass(frozen=True)
class Stacks(Join):
    """Several adjacent :class:`Stack` s of one rule as one join: the key family over every
    placeholder (``layers.{i}.experts.{j}``) stacked into one tensor, ``stacks[0]`` applied first
    (innermost). Sources are ordered with the last stack's index slowest (row-major (i, j) for
    ``(Stack(0, "j"), Stack(0, "i"))``). Each stack's ``size`` is bound from the key family by the
    mapping; at most one may be left to infer from the number of sources.

    Box mapping: a target box touches the product of its index ranges along the stacked axes;
    each source is read for the inner box only (an expert-parallel rank reads its experts' keys).
    """

    stacks: tuple[Stack, ...]

    def _sizes(self, n: int) -> tuple[int, ...]:
        known = [s.size for s in self.stacks]
        free = [k for k, v in enumerate(known) if v is None]
        fixed = math.prod(v for v in known if v is not None)
        if len(free) > 1:
            raise NotApplicable(f"Stacks over {self.overs} need the family sizes of all but one placeholder",
                                expected="sized Stacks", found=known)
        if free:
            if fixed == 0 or n % fixed:
                raise NotApplicable(f"{n} keys do not fill Stacks over {self.overs} of sizes {known}",
                                    expected=f"a multiple of {fixed}", found=n)
            known[free[0]] = n // fixed
        if math.prod(known) != n:  # type: ignore[arg-type]
            raise NotApplicable(f"Stacks over {self.overs} of sizes {known} expect {math.prod(known)} keys",  # type: ignore[arg-type]
                                expected=math.prod(known), found=n)  # type: ignore[arg-type]
        return tuple(known)  # type: ignore[arg-type]

    @property
    def overs(self) -> tuple[str, ...]:
        return tuple(s.over for s in self.stacks)

    def _index(self, outer_first: Sequence[int], sizes: Sequence[int]) -> int:
        k = 0
        for i, n in zip(outer_first, reversed(sizes)):
            k = k * n + i
        return k

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        sizes = self._sizes(len(shapes))
        for s in shapes[1:]:
            if s != shapes[0]:
                raise NotApplicable(f"Stacks over {self.overs} need equal shapes", expected=shapes[0], found=s)
        out = shapes[0]
        for st, n in zip(self.stacks, sizes):
            _check_ndim(_ins(out, st.axis, n), st.axis + 1, f"Stack(axis={st.axis})")
            out = _ins(out, st.axis, n)
        return out

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        count = 1
        for st in reversed(self.stacks):
            count *= shape[st.axis]
            shape = _drop(shape, st.axis)
        return [shape] * count

    def _grid(self, box: Box, sizes: Sequence[int]) -> tuple[list[tuple[int, ...]], Box]:
        """The outer-first index tuples ``box`` touches, and the inner box they share."""
        ranges = []
        for st in reversed(self.stacks):
            a = st.axis
            ranges.append(range(box.offset[a], box.offset[a] + box.shape[a]))
            box = Box(_drop(box.offset, a), _drop(box.shape, a))
        return list(product(*ranges)), box

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        sizes = self._sizes(len(shapes))
        grid, inner = self._grid(box, sizes)
        return [(self._index(idx, sizes), inner) for idx in grid]

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        counts = []  # along each stacked axis, outermost first (peeled as _grid does)
        for st in reversed(self.stacks):
            counts.append(box.shape[st.axis])
            box = Box(_drop(box.offset, st.axis), _drop(box.shape, st.axis))
        counts.reverse()
        level = list(blocks)
        for st, n in zip(self.stacks, counts):  # consecutive runs of n share every outer index
            level = [np.stack(level[k:k + n], axis=st.axis) for k in range(0, len(level), n)]
        return level[0]

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        sizes = self._sizes(len(shapes))
        out: list[tuple[int, Box, np.ndarray]] = []

        def peel(level: int, b: Box, blk: np.ndarray, idx: tuple[int, ...]) -> None:
            if level < 0:
                out.append((self._index(idx, sizes), b, blk))
                return
            a = self.stacks[level].axis
            inner = Box(_drop(b.offset, a), _drop(b.shape, a))
            for j in range(b.shape[a]):
                peel(level - 1, inner, np.take(blk, j, axis=a), idx + (b.offset[a] + j,))

        peel(len(self.stacks) - 1, box, block, ())
        return out

    def out_shape(self, shape: Shape) -> Shape:
        raise NotApplicable("Stacks join several sources")

    def inverse(self) -> Transform:
        raise ValueError("Stacks invert to several Selects: use inverse_ops()")

    def inverse_ops(self) -> list[Transform]:
        return [st.inverse() for st in reversed(self.stacks)]


@dataclass(frozen=True)
class ConcatStacks(Join):
    """A :class:`Concat` of ``parts`` sources followed by :class:`Stack` s of each one's key family,
    as one join: per-layer ``q_proj``, ``k_proj``, ``v_proj`` (or ``gate_proj``, ``up_proj``) fused
    along ``concat.axis`` and stacked over the layers, the inverse of a stacked, fused JAX kernel
    read as ``Select`` + ``Part``. Sources are ordered part-major (every layer of the first part,
    then of the second, ...), as the rule's patterns expand.

    Box mapping: the stacked indices the target box touches, and within each, the parts its
    range along the concat axis overlaps, each read for its overlap only (a rank reads its own
    layers' slices of its own parts).
    """

    concat: Concat
    stacks: Join  # a Stack, or Stacks over several placeholders
    parts: int

    def _n(self, count: int) -> int:
        if count % self.parts:
            raise NotApplicable(f"{count} keys do not divide into {self.parts} parts of one key family",
                                expected=f"a multiple of {self.parts}", found=count)
        return count // self.parts

    def _by_member(self, items: Sequence) -> list[list]:
        """Regroup part-major items as [member][part]."""
        n = self._n(len(items))
        return [[items[p * n + m] for p in range(self.parts)] for m in range(n)]

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        joined = [self.concat.join_shape(group) for group in self._by_member(shapes)]
        return self.stacks.join_shape(joined)

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        members = self.stacks.part_shapes(shape, None if n is None else self._n(n))
        per = [self.concat.part_shapes(m, self.parts) for m in members]
        return [per[m][p] for p in range(self.parts) for m in range(len(members))]

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        n = self._n(len(shapes))
        groups = self._by_member(shapes)
        member_shapes = [self.concat.join_shape(g) for g in groups]
        out = []
        for m, inner in self.stacks.part_boxes(box, member_shapes):
            out += [(p * n + m, b) for p, b in self.concat.part_boxes(inner, groups[m])]
        return out

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        members = math.prod(box.shape[st.axis] for st in self._stack_list())
        per = len(blocks) // members  # the same parts overlap every member's inner box
        joined = [self.concat.join_blocks(blocks[k:k + per], box) for k in range(0, len(blocks), per)]
        return self.stacks.join_blocks(joined, box)

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        n = self._n(len(shapes))
        groups = self._by_member(shapes)
        member_shapes = [self.concat.join_shape(g) for g in groups]
        out = []
        for m, inner, x in self.stacks.split(box, block, member_shapes):
            out += [(p * n + m, b, y) for p, b, y in self.concat.split(inner, x, groups[m])]
        return out

    def _stack_list(self) -> tuple[Stack, ...]:
        return self.stacks.stacks if isinstance(self.stacks, Stacks) else (self.stacks,)  # type: ignore[return-value]

    def out_shape(self, shape: Shape) -> Shape:
        raise NotApplicable("a Concat with Stacks joins several sources")

    def inverse(self) -> Transform:
        raise ValueError("a Concat with Stacks inverts to one rule per part: use Rule.inverses()")

    def inverse_part(self, index: int) -> list[Transform]:
        """The transforms that take part ``index`` back out of the joined tensor: the Stacks'
        Selects, then the Concat's Part."""
        return list(self.stacks.inverse_ops()) + [self.concat.inverse_part(index, self.parts)]
