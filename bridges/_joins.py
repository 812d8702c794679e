"""Splitting one axis into parts and joining several sources (Concat, Stack); see :mod:`bridges._transforms`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ckptfmt import Box

from ._transforms import NotApplicable, Select, Shape, Transform, _check_ndim, _ins, _put, _sl

__all__ = ["Part", "Join", "Concat", "Stack"]



def _part_sizes(sizes: tuple[int, ...] | int, total: int) -> tuple[int, ...]:
    if isinstance(sizes, int):
        if total % sizes:
            raise NotApplicable(f"axis of size {total} does not split into {sizes} equal parts",
                                expected=f"a multiple of {sizes}", found=total)
        return (total // sizes,) * sizes
    if sum(sizes) != total:
        raise NotApplicable(f"parts {sizes} do not add up to the axis size", expected=sum(sizes), found=total)
    return sizes


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
