"""Merging and splitting contiguous axes (reshapes) with their box arithmetic; see :mod:`bridges.mapping._transforms`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ckptfmt import Box

from bridges.mapping._transforms import NotApplicable, Shape, Transform, _check_ndim, _sl

__all__ = ["Merge", "Unmerge"]



def _cover(s: int, e: int, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Smallest box over ``sizes`` (row-major) holding the flat range [s, e): it is itself one flat range."""
    if len(sizes) == 1:
        return [s], [e - s]
    inner = math.prod(sizes[1:])
    r0, r1 = s // inner, (e - 1) // inner
    if r0 == r1:  # one row: size 1 here, recurse inside it
        o, n = _cover(s - r0 * inner, e - r0 * inner, sizes[1:])
        return [r0] + o, [1] + n
    return [r0] + [0] * (len(sizes) - 1), [r1 - r0 + 1] + list(sizes[1:])


def _decompose(s: int, e: int, sizes: Sequence[int]) -> list[tuple[list[int], list[int], int]]:
    """Exact boxes over ``sizes`` tiling the flat range [s, e): (offset, shape, flat start) each."""
    if s >= e:
        return []
    if len(sizes) == 1:
        return [([s], [e - s], s)]
    inner = math.prod(sizes[1:])
    out: list[tuple[list[int], list[int], int]] = []
    r0, r1 = -(-s // inner), e // inner  # whole rows [r0, r1)
    if r0 > r1:  # inside one row
        r = s // inner
        return [([r] + o, [1] + n, f + r * inner) for o, n, f in _decompose(s - r * inner, e - r * inner, sizes[1:])]
    if s < r0 * inner:  # the tail of the row before
        r = r0 - 1
        out += [([r] + o, [1] + n, f + r * inner) for o, n, f in _decompose(s - r * inner, inner, sizes[1:])]
    if r1 > r0:
        out.append(([r0] + [0] * (len(sizes) - 1), [r1 - r0] + list(sizes[1:]), r0 * inner))
    if e > r1 * inner:  # the head of the row after
        out += [([r1] + o, [1] + n, f + r1 * inner) for o, n, f in _decompose(0, e - r1 * inner, sizes[1:])]
    return out


@dataclass(frozen=True)
class Merge(Transform):
    """Merge the contiguous input axes ``axis .. axis+k-1`` into one (row-major).

    (d_model, heads, head_dim) -> (d_model, heads*head_dim) is ``Merge(1, (heads, head_dim))``.
    ``sizes`` is the tuple of the merged axes' sizes (checked on load, needed to save), or just
    their count ``k`` (sizes taken from the input; then a save cannot infer the input shape).
    Box mapping: an output range that falls on boundaries of the inner axes (whole heads) maps to
    exactly one input box. A range that does not (half a head on a rank) maps to the smallest
    covering input box: the rows it touches, whole in the inner axes unless the range lies inside
    one row, where it recurses (so a range inside one head reads only its part of that head).
    """

    axis: int
    sizes: tuple[int, ...] | int

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, int):
            object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        k = self.sizes if isinstance(self.sizes, int) else len(self.sizes)
        if k < 2 or (not isinstance(self.sizes, int) and min(self.sizes) < 1):
            raise ValueError(f"Merge needs at least two axes of positive size, got {self.sizes}")

    @property
    def count(self) -> int:
        return self.sizes if isinstance(self.sizes, int) else len(self.sizes)

    def _sizes(self, in_shape: Shape) -> tuple[int, ...]:
        return tuple(in_shape[self.axis:self.axis + self.count]) if isinstance(self.sizes, int) else self.sizes

    def out_shape(self, shape: Shape) -> Shape:
        k = self.count
        _check_ndim(shape, self.axis + k, f"Merge(axis={self.axis}, sizes={self.sizes})")
        if not isinstance(self.sizes, int) and tuple(shape[self.axis:self.axis + k]) != self.sizes:
            raise NotApplicable(f"Merge expects axes {self.axis}..{self.axis + k - 1} of sizes {self.sizes}",
                                expected=self.sizes, found=shape)
        return shape[:self.axis] + (math.prod(shape[self.axis:self.axis + k]),) + shape[self.axis + k:]

    def in_shape(self, shape: Shape) -> Shape:
        if isinstance(self.sizes, int):
            raise NotApplicable(f"Merge(axis={self.axis}, {self.sizes} axes) does not know the sizes to split "
                                "back into; give Merge(axis, sizes=(...))")
        return Unmerge(self.axis, self.sizes).out_shape(shape)

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        a, sizes = self.axis, self._sizes(in_shape)
        k = len(sizes)
        s = box.offset[a]
        if box.shape[a] == 0:
            o, n = [0] * k, [0] * k
        else:
            o, n = _cover(s, s + box.shape[a], sizes)
        return Box(box.offset[:a] + tuple(o) + box.offset[a + 1:], box.shape[:a] + tuple(n) + box.shape[a + 1:])

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        a, sizes = self.axis, self._sizes(in_shape)
        k = len(sizes)
        flat = block.reshape(block.shape[:a] + (-1,) + block.shape[a + k:])
        start = int(np.ravel_multi_index(in_box.offset[a:a + k], sizes)) if flat.shape[a] else 0
        lo = out_box.offset[a] - start
        return flat[_sl(flat.ndim, a, slice(lo, lo + out_box.shape[a]))]

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        a, sizes = self.axis, self._sizes(in_shape)
        s = box.offset[a]
        out = []
        for o, n, f in _decompose(s, s + box.shape[a], sizes):
            part = block[_sl(block.ndim, a, slice(f - s, f - s + math.prod(n)))]
            out.append((Box(box.offset[:a] + tuple(o) + box.offset[a + 1:], box.shape[:a] + tuple(n) + box.shape[a + 1:]),
                        part.reshape(part.shape[:a] + tuple(n) + part.shape[a + 1:])))
        return out

    def inverse(self) -> "Unmerge":
        if isinstance(self.sizes, int):
            raise ValueError(f"Merge(axis={self.axis}, {self.sizes} axes) needs its sizes to be inverted")
        return Unmerge(self.axis, self.sizes)


@dataclass(frozen=True)
class Unmerge(Transform):
    """Split input axis ``axis`` (of size prod(sizes)) into ``len(sizes)`` axes (row-major).

    Box mapping: an output box is a set of rows of the merged axis; the input box is the covering
    range from its first to its last element (exact when the box is whole in all but its first
    split axis). The inverse of :class:`Merge`.
    """

    axis: int
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ValueError(f"Unmerge needs at least two positive sizes, got {self.sizes}")

    def out_shape(self, shape: Shape) -> Shape:
        _check_ndim(shape, self.axis + 1, f"Unmerge(axis={self.axis}, sizes={self.sizes})")
        if shape[self.axis] != math.prod(self.sizes):
            raise NotApplicable(f"Unmerge expects axis {self.axis} of size {math.prod(self.sizes)} = "
                                f"{' x '.join(map(str, self.sizes))}", expected=math.prod(self.sizes), found=shape)
        return shape[:self.axis] + self.sizes + shape[self.axis + 1:]

    def in_shape(self, shape: Shape) -> Shape:
        return Merge(self.axis, self.sizes).out_shape(shape)

    def _range(self, box: Box) -> tuple[int, int]:
        a, k = self.axis, len(self.sizes)
        o, n = box.offset[a:a + k], box.shape[a:a + k]
        if 0 in n:
            return 0, 0
        return (int(np.ravel_multi_index(o, self.sizes)),
                int(np.ravel_multi_index(tuple(x + m - 1 for x, m in zip(o, n)), self.sizes)) + 1)

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        a, k = self.axis, len(self.sizes)
        s, e = self._range(box)
        return Box(box.offset[:a] + (s,) + box.offset[a + k:], box.shape[:a] + (e - s,) + box.shape[a + k:])

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        a, k = self.axis, len(self.sizes)
        o, n = out_box.offset[a:a + k], out_box.shape[a:a + k]
        if block.shape[a] == math.prod(n):  # the box is one flat range: a plain reshape
            return block.reshape(block.shape[:a] + tuple(n) + block.shape[a + 1:])
        grids = np.meshgrid(*[np.arange(x, x + m) for x, m in zip(o, n)], indexing="ij")
        idx = np.ravel_multi_index(tuple(grids), self.sizes).ravel() - in_box.offset[a]
        taken = np.take(block, idx, axis=a)
        return taken.reshape(taken.shape[:a] + tuple(n) + taken.shape[a + 1:])

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        a, k = self.axis, len(self.sizes)
        o, n = list(box.offset[a:a + k]), list(box.shape[a:a + k])
        if 0 in n:
            return []
        j = k  # axes j.. are whole, so axis j-1 with them is one flat run per outer index
        while j > 1 and n[j - 1] == self.sizes[j - 1]:
            j -= 1
        r = j - 1
        length = math.prod(n[r:])
        out = []
        for outer in np.ndindex(*n[:r]):
            first = [x + y for x, y in zip(o[:r], outer)] + o[r:]
            s = int(np.ravel_multi_index(tuple(first), self.sizes))
            part = block[(slice(None),) * a + tuple(outer)]
            part = part.reshape(part.shape[:a] + (length,) + part.shape[a + k - r:])
            out.append((Box(box.offset[:a] + (s,) + box.offset[a + k:], box.shape[:a] + (length,) + box.shape[a + k:]),
                        part))
        return out

    def inverse(self) -> Merge:
        return Merge(self.axis, self.sizes)

