"""Read planning: requested global boxes -> the stored inner chunks that hold them, and where each
part goes (:class:`ReadItem`). Pure: no I/O. The reader (:mod:`ckptfmt.reader`) plans every read
with :func:`plan_reads`.
"""
from __future__ import annotations

import math
from functools import lru_cache, partial
from typing import NamedTuple, Sequence

import numpy as np

from ._types import Box
from .errors import ShapeMismatchError
from .geometry import TensorGeometry, grid_cells

__all__ = ["ReadItem", "plan_reads"]


class ReadItem(NamedTuple):
    """Read one stored inner chunk and copy part of it into a requested box.

    ``shard`` indexes the tensor's shard table, ``chunk`` its chunk table.
    ``src`` selects inside the decoded chunk (full chunk_shape); ``dst`` inside the request.
    A named tuple, not a dataclass: a large restore plans millions of them.
    """

    request: int
    shard: int
    chunk: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


# ReadItem from a tuple of its five fields, without the keyword-handling constructor (hot loop).
_read_item = partial(tuple.__new__, ReadItem)


def plan_reads(geom: TensorGeometry, shard_offsets: np.ndarray, chunk_start: np.ndarray,
               requests: Sequence[Box]) -> list[ReadItem]:
    """Map requested boxes to stored inner chunks.

    ``shard_offsets`` is the (S, ndim) table of shard offsets; ``chunk_start[s]`` is where
    shard s's entries begin in the chunk table. Raises ShapeMismatchError for a request
    outside the tensor. Pure: no I/O.
    """
    shape = geom.shape
    nd = len(shape)
    grid, dims = _read_dims(tuple(shape), tuple(geom.shard_shape), tuple(geom.chunk_shape))
    shard_of = _shard_lookup(geom, shard_offsets, grid)
    items: list[ReadItem] = []
    for ri, req in enumerate(requests):
        ro, rs = req.offset, req.shape
        if len(rs) != nd or any(o < 0 or o + s > n for o, s, n in zip(ro, rs, shape)):
            raise ShapeMismatchError("requested box lies outside the tensor", expected=f"inside {shape}", found=str(req))
        if 0 in rs:  # empty
            continue
        if not nd:
            items.append(ReadItem(ri, 0, int(chunk_start[0]), (), ()))
            continue
        # Models repeat a few (geometry, box) pairs over and over: memoize the small ones.
        chunks = math.prod(-(-(o + n) // c) - o // c for (c, *_), o, n in zip(dims, ro, rs))
        touched = (_touched_memo if chunks <= _MEMO_CHUNKS else _touched)(dims, ro, rs)
        if shard_of is None:  # shard s is flat cell s
            items += [_read_item((ri, t, int(chunk_start[t]) + f, s, d)) for t, f, s, d in touched]
        else:
            for t, f, s, d in touched:
                shard = int(shard_of[t])
                items.append(ReadItem(ri, shard, int(chunk_start[shard]) + f, s, d))
    return items


_MEMO_CHUNKS = 64  # memoize boxes touching at most this many chunks (bounds the memo's size)


@lru_cache(maxsize=256)
def _read_dims(shape: tuple[int, ...], shard_shape: tuple[int, ...],
               chunk_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The shard grid, and per dimension (chunk, shard, size, inner chunks per full shard,
    stored chunks of a full shard, flat-cell stride), all Python ints."""
    shape, shard_shape, chunk_shape = (tuple(map(int, x)) for x in (shape, shard_shape, chunk_shape))
    grid = tuple(-(-n // s) for n, s in zip(shape, shard_shape))
    strides, acc = [], 1
    for g in reversed(grid):
        strides.append(acc)
        acc *= g
    return grid, tuple(zip(chunk_shape, shard_shape, shape, (s // c for s, c in zip(shard_shape, chunk_shape)),
                           (-(-s // c) for s, c in zip(shard_shape, chunk_shape)), reversed(strides)))


def _touched(dims: tuple[tuple[int, ...], ...], offset: tuple[int, ...],
             shape: tuple[int, ...]) -> list[tuple[int, int, tuple[slice, ...], tuple[slice, ...]]]:
    """Every inner chunk a non-empty box inside the tensor touches, in C order, as (flat shard
    cell, flat chunk index within that shard, src slices, dst slices)."""
    # Fold the dimensions in C order; per dimension, each chunk touched and its shard's chunk count.
    acc: list[tuple[int, int, tuple[slice, ...], tuple[slice, ...]]] = [(0, 0, (), ())]
    for (c, sh, n, inner, full, stride), o, ln in zip(dims, offset, shape):
        end = o + ln
        opts = []
        for g in range(o // c, -(-end // c)):
            start = g * c
            lo, hi = (o if o > start else start), (end if end < start + c else start + c)
            cell = start // sh
            left = n - cell * sh
            opts.append((cell * stride, g - cell * inner, full if left >= sh else -(-left // c),
                         slice(lo - start, hi - start), slice(lo - o, hi - o)))
        acc = [(t + dt, f * k + x, s + (ds,), d + (dd,)) for t, f, s, d in acc for dt, x, k, ds, dd in opts]
    return acc


@lru_cache(maxsize=256)
def _touched_memo(dims: tuple[tuple[int, ...], ...], offset: tuple[int, ...],
                  shape: tuple[int, ...]) -> tuple[tuple[int, int, tuple[slice, ...], tuple[slice, ...]], ...]:
    """:func:`_touched`, memoized; its result is immutable, so callers may share it."""
    return tuple(_touched(dims, offset, shape))


def _shard_lookup(geom: TensorGeometry, shard_offsets: np.ndarray, grid: tuple[int, ...]) -> np.ndarray | None:
    """Shard index per flat grid cell (-1: none), or None when shard s is cell s in C order (the
    layout every save writes)."""
    nd = len(geom.shape)
    offs = np.asarray(shard_offsets, np.int64)
    offs = offs.reshape(-1, nd) if nd else np.zeros((len(offs), 0), np.int64)
    canon = _canonical_offsets(tuple(geom.shape), tuple(geom.shard_shape)) if nd else None
    if canon is not None and offs.shape == canon.shape and (offs == canon).all():
        return None
    shard_of = np.full(max(1, math.prod(grid)), -1, np.int64)
    if len(offs):
        if nd:
            cells = offs // np.asarray(geom.shard_shape, np.int64)
            shard_of[np.ravel_multi_index(tuple(cells.T), grid)] = np.arange(len(offs))
        else:
            shard_of[0] = 0
    return shard_of


@lru_cache(maxsize=64)
def _canonical_offsets(shape: tuple[int, ...], shard_shape: tuple[int, ...]) -> np.ndarray | None:
    """Every shard's offset in C order over the grid (read-only), or None for a grid too large to cache."""
    grid = tuple(-(-n // s) for n, s in zip(shape, shard_shape))
    if math.prod(grid) > 1 << 16:
        return None
    out = grid_cells(grid) * np.asarray(shard_shape, np.int64)
    out.flags.writeable = False
    return out
