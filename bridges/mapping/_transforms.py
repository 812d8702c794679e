"""Layout transforms of the mapping language, and their box arithmetic (numpy only).

Every transform maps an INPUT array (the checkpoint side, "source") to an OUTPUT array (the side
being loaded into, "target"), in GLOBAL coordinates. Besides the whole-array function each one
answers the three questions a sharded bridge asks:

* ``in_box(box, in_shape)``: the input box that holds everything the output ``box`` needs, so a
  rank reads only that. Most transforms map a box to exactly its preimage; a merge of axes maps a
  range that does not fall on boundaries of the inner axes to the smallest covering box (see
  :class:`Merge`), and a reorder to the covering range of the permuted indices.
* ``apply(block, in_box, out_box, in_shape)``: the output block ``out_box`` from the block read
  at ``in_box`` (exactly that box, nothing else).
* ``pieces(box, block, in_shape)``: the exact inverse used when SAVING from the output side: the
  output block at ``box`` as a list of ``(input box, input block)`` that tile its preimage exactly
  (a merge splits a range that is not aligned to rows into up to 2k-1 boxes).

Merges live in ``_reshape.py``; the join transforms (:class:`Concat`, :class:`Stack`, in
``_joins.py``) take several inputs (fused qkv; one stacked tensor from per-layer keys).
Transforms raise :class:`NotApplicable` with the reason when an input does not fit them; the
mapping turns it into an error naming the rule.

Exactness of the inverse (saves): transposes, selects, merges, reorders, concatenations are exact.
:class:`Scale` is exact for powers of two; any other factor is checked on the data at save time
and refused when ``(y / f) * f != y`` for some element, unless declared with
``allow_inexact_inverse=True``; :class:`Shift` (an added constant) is always checked so.
:class:`Cast` with a ``source_dtype`` is checked the same way
(the round trip through the narrower type must give the value back).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt import Box
from ckptfmt.dtypes import numpy_dtype

__all__ = [
    "NotApplicable", "NotExact", "Transform", "Transpose", "Reorder", "Scale", "Shift", "Cast",
    "interleaved_to_halves", "halves_to_interleaved",
]

Shape = tuple[int, ...]


class NotApplicable(Exception):
    """A transform cannot take this input (the reason, and what it expected against what it found)."""

    def __init__(self, reason: str, expected: Any = None, found: Any = None) -> None:
        super().__init__(reason)
        self.reason, self.expected, self.found = reason, expected, found


class NotExact(Exception):
    """A save would store values whose load gives back something else (a lossy inverse)."""


def _check_ndim(shape: Shape, need: int, what: str) -> None:
    if len(shape) < need:
        raise NotApplicable(f"{what} needs at least {need} dimensions", expected=f">= {need} dims", found=shape)


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _put(t: tuple, axis: int, value: Any) -> tuple:
    return t[:axis] + (value,) + t[axis + 1:]


def _ins(t: tuple, axis: int, value: Any) -> tuple:
    return t[:axis] + (value,) + t[axis:]


def _sl(ndim: int, axis: int, s: slice) -> tuple:
    return (slice(None),) * axis + (s,)


class Transform:
    """Base class. Subclasses are frozen dataclasses; see the module docstring for the protocol."""

    join = False

    def bind(self, values: dict[str, int]) -> "Transform":  # placeholders -> concrete indices
        return self

    def out_shape(self, shape: Shape) -> Shape:
        raise NotImplementedError

    def in_shape(self, shape: Shape) -> Shape:
        raise NotImplementedError

    def out_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        raise NotImplementedError

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        raise NotImplementedError

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        raise NotImplementedError

    def inverse(self) -> "Transform":
        raise NotImplementedError


class _Elementwise(Transform):
    """A transform of each element alone: shapes and boxes pass through unchanged."""

    def out_shape(self, shape: Shape) -> Shape:
        return shape

    def in_shape(self, shape: Shape) -> Shape:
        return shape

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        return box


# ---------------------------------------------------------------------------------------- transpose


@dataclass(frozen=True)
class Transpose(Transform):
    """``out = in.transpose(axes)`` (torch Linear weight (out, in) from a Flax kernel (in, out): ``(1, 0)``)."""

    axes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        if sorted(self.axes) != list(range(len(self.axes))):
            raise ValueError(f"{self.axes} is not a permutation of {len(self.axes)} axes")

    def _inv(self) -> tuple[int, ...]:
        inv = [0] * len(self.axes)
        for i, a in enumerate(self.axes):
            inv[a] = i
        return tuple(inv)

    def _check(self, shape: Shape) -> None:
        if len(shape) != len(self.axes):
            raise NotApplicable(f"Transpose{self.axes} needs {len(self.axes)} dimensions",
                                expected=f"{len(self.axes)} dims", found=shape)

    def out_shape(self, shape: Shape) -> Shape:
        self._check(shape)
        return tuple(shape[a] for a in self.axes)

    def in_shape(self, shape: Shape) -> Shape:
        self._check(shape)
        return tuple(shape[a] for a in self._inv())

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        inv = self._inv()
        return Box(tuple(box.offset[a] for a in inv), tuple(box.shape[a] for a in inv))

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return block.transpose(self.axes)

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        return [(self.in_box(box, in_shape), block.transpose(self._inv()))]

    def inverse(self) -> "Transpose":
        return Transpose(self._inv())




# ---------------------------------------------------------------------------------------- reorder


@dataclass(frozen=True)
class Reorder(Transform):
    """``out[..., j, ...] = in[..., perm[j], ...]`` along ``axis``: an index permutation.

    Use :func:`interleaved_to_halves` / :func:`halves_to_interleaved` for the rotary layouts of
    q/k rows within a head. Box mapping: the covering range of the permuted indices.
    """

    axis: int
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "perm", tuple(int(p) for p in self.perm))
        if sorted(self.perm) != list(range(len(self.perm))):
            raise ValueError(f"Reorder: {self.perm[:8]}... is not a permutation")

    def out_shape(self, shape: Shape) -> Shape:
        _check_ndim(shape, self.axis + 1, f"Reorder(axis={self.axis})")
        if shape[self.axis] != len(self.perm):
            raise NotApplicable(f"Reorder expects axis {self.axis} of size {len(self.perm)}",
                                expected=len(self.perm), found=shape)
        return shape

    def in_shape(self, shape: Shape) -> Shape:
        return self.out_shape(shape)

    def in_box(self, box: Box, in_shape: Shape) -> Box:
        a = self.axis
        s, n = box.offset[a], box.shape[a]
        if n == 0:
            return box
        src = self.perm[s:s + n]
        return Box(_put(box.offset, a, min(src)), _put(box.shape, a, max(src) - min(src) + 1))

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        a = self.axis
        s, n = out_box.offset[a], out_box.shape[a]
        idx = np.asarray(self.perm[s:s + n], np.int64) - in_box.offset[a]
        return np.take(block, idx, axis=a)

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        a = self.axis
        s, n = box.offset[a], box.shape[a]
        src = np.asarray(self.perm[s:s + n], np.int64)
        order = np.argsort(src, kind="stable")
        out, i = [], 0
        while i < n:  # runs of consecutive input indices
            j = i + 1
            while j < n and src[order[j]] == src[order[j - 1]] + 1:
                j += 1
            out.append((Box(_put(box.offset, a, int(src[order[i]])), _put(box.shape, a, j - i)),
                        np.take(block, order[i:j], axis=a)))
            i = j
        return out

    def inverse(self) -> "Reorder":
        inv = [0] * len(self.perm)
        for j, p in enumerate(self.perm):
            inv[p] = j
        return Reorder(self.axis, tuple(inv))


def interleaved_to_halves(head_dim: int) -> tuple[int, ...]:
    """Permutation taking rotary pairs (x0, y0, x1, y1, ...) to split halves (x0, x1, ..., y0, y1, ...)."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    return tuple(range(0, head_dim, 2)) + tuple(range(1, head_dim, 2))


def halves_to_interleaved(head_dim: int) -> tuple[int, ...]:
    """The inverse of :func:`interleaved_to_halves`."""
    return Reorder(0, interleaved_to_halves(head_dim)).inverse().perm


# ---------------------------------------------------------------------------------------- scale, cast


def _is_power_of_two(f: float) -> bool:
    return f > 0 and math.isfinite(f) and math.frexp(f)[0] == 0.5


@dataclass(frozen=True)
class Scale(_Elementwise):
    """``out = in * factor`` (``divide=True``: ``in / factor``), computed in the input's float dtype.

    The inverse divides (multiplies). It is exact for a power-of-two factor; otherwise a save
    checks every element and raises :class:`NotExact` when one would not come back bit for bit,
    unless ``allow_inexact_inverse=True`` declares the rounding acceptable.
    """

    factor: float
    divide: bool = False
    allow_inexact_inverse: bool = False

    def _do(self, block: np.ndarray, divide: bool) -> np.ndarray:
        if block.dtype.kind not in "fc" and block.dtype.name not in ("bfloat16",) and "float8" not in block.dtype.name:
            raise NotApplicable("Scale needs a floating-point tensor", expected="float", found=str(block.dtype))
        comp = np.float64 if block.dtype.itemsize > 4 else np.float32
        f = np.asarray(self.factor, comp)
        wide = block.astype(comp, copy=False)
        return (wide / f if divide else wide * f).astype(block.dtype, copy=False)

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return self._do(block, self.divide)

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        back = self._do(block, not self.divide)
        if not (_is_power_of_two(self.factor) or self.allow_inexact_inverse):
            _require_exact(self._do(back, self.divide), block, f"Scale({self.factor})")
        return [(box, back)]

    def inverse(self) -> "Scale":
        return Scale(self.factor, not self.divide, self.allow_inexact_inverse)


def _require_exact(again: np.ndarray, block: np.ndarray, what: str) -> None:
    """NotExact unless ``again`` (the saved block loaded back through the forward transform)
    equals ``block`` bit for bit."""
    if not np.array_equal(again.view(np.uint8), np.ascontiguousarray(block).view(np.uint8)):
        raise NotExact(f"{what} is not exactly invertible for these values: a load would not give them back "
                       "bit for bit (declare allow_inexact_inverse=True to accept the rounding)")


@dataclass(frozen=True)
class Shift(_Elementwise):
    """``out = in + offset``, computed in the input's float dtype (Gemma's norm scales: MaxText
    stores the multiplier ``1 + scale``, Hugging Face ``scale``: ``Shift(-1.0)``).

    The inverse subtracts. A save checks every element and raises :class:`NotExact` when one
    would not come back bit for bit (``(y - offset) + offset != y``: small values lose low bits),
    unless ``allow_inexact_inverse=True`` declares the rounding acceptable.
    """

    offset: float
    allow_inexact_inverse: bool = False

    def _do(self, block: np.ndarray, sign: float) -> np.ndarray:
        if block.dtype.kind != "f" and block.dtype.name != "bfloat16":
            raise NotApplicable("Shift needs a floating-point tensor", expected="float", found=str(block.dtype))
        comp = np.float64 if block.dtype.itemsize > 4 else np.float32
        return (block.astype(comp, copy=False) + np.asarray(sign * self.offset, comp)).astype(block.dtype, copy=False)

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return self._do(block, 1.0)

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        back = self._do(block, -1.0)
        if not self.allow_inexact_inverse:
            _require_exact(self._do(back, 1.0), block, f"Shift({self.offset})")
        return [(box, back)]

    def inverse(self) -> "Shift":
        return Shift(-self.offset, self.allow_inexact_inverse)


@dataclass(frozen=True)
class Cast(_Elementwise):
    """``out = in.astype(dtype)``. ``source_dtype`` (the checkpoint's) makes it invertible: a save
    casts back and raises :class:`NotExact` when a value does not survive the round trip."""

    dtype: str
    source_dtype: str | None = None

    def out_dtype(self, dtype: np.dtype) -> np.dtype:
        return _np_dtype(self.dtype)

    def apply(self, block: np.ndarray, in_box: Box, out_box: Box, in_shape: Shape) -> np.ndarray:
        return block.astype(_np_dtype(self.dtype), copy=False)

    def pieces(self, box: Box, block: np.ndarray, in_shape: Shape) -> list[tuple[Box, np.ndarray]]:
        if self.source_dtype is None:
            return [(box, block)]
        back = block.astype(_np_dtype(self.source_dtype))
        if not np.array_equal(back.astype(block.dtype), block, equal_nan=block.dtype.kind in "fc"):
            raise NotExact(f"Cast {self.dtype} -> {self.source_dtype} loses information for these values")
        return [(box, back)]

    def inverse(self) -> "Cast":
        if self.source_dtype is None:
            raise ValueError(f"Cast({self.dtype!r}) has no source_dtype, so no inverse")
        return Cast(self.source_dtype, self.dtype)


def _np_dtype(name: str) -> np.dtype:
    return numpy_dtype(str(name))

