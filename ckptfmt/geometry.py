"""The storage geometry of one tensor (FORMAT.md 14.1): global shape, shard shape and inner chunk
shape, and what follows from them alone (the shard grid, the inner chunks of a shard, a shard's
stored chunk counts). Pure: no I/O. The save plan (:mod:`ckptfmt.plan`) chooses a geometry; the
read plan (:mod:`ckptfmt.readplan`), the shard layout and the manifest read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ._types import Box

__all__ = ["TensorGeometry", "grid_cells", "stored_chunk_counts", "chunk_count_table"]


@dataclass(frozen=True)
class TensorGeometry:
    """The storage geometry of one tensor: global shape, shard shape, inner chunk shape."""

    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int

    @cached_property
    def grid(self) -> tuple[int, ...]:
        """Number of shards along each dimension (0 along a zero-length dimension)."""
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shard_shape))

    @cached_property
    def inner(self) -> tuple[int, ...]:
        """Inner chunks per shard along each dimension (the shard index covers all of them)."""
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape))

    def shard_box(self, cell: tuple[int, ...]) -> Box:
        off = tuple(c * s for c, s in zip(cell, self.shard_shape))
        return Box(off, tuple(min(s, n - o) for s, n, o in zip(self.shard_shape, self.shape, off)))


def grid_cells(grid: tuple[int, ...]) -> np.ndarray:
    """(N, ndim) int64 grid cells in C order."""
    nd = len(grid)
    if not nd:
        return np.zeros((math.prod(grid), 0), np.int64)
    return np.ascontiguousarray(np.indices(grid, dtype=np.int64).reshape(nd, -1).T)


def stored_chunk_counts(geom: TensorGeometry, shard_offset: tuple[int, ...]) -> tuple[int, ...]:
    """Per dimension, how many inner chunks of the shard at ``shard_offset`` intersect the array
    (one row of :func:`chunk_count_table`, in plain integers: a save asks once per shard)."""
    return tuple(-(-min(s, n - int(o)) // c) for s, n, o, c in zip(geom.shard_shape, geom.shape, shard_offset,
                                                                     geom.chunk_shape))


def chunk_count_table(geom: TensorGeometry, shard_offsets: np.ndarray) -> np.ndarray:
    """(S, ndim) table of :func:`stored_chunk_counts` for every shard, vectorized."""
    off = np.asarray(shard_offsets, np.int64)
    if not len(geom.shape):
        return np.zeros((len(off), 0), np.int64)
    off = off.reshape(-1, len(geom.shape))
    shape = np.asarray(geom.shape, np.int64)
    return -(-np.minimum(np.asarray(geom.shard_shape, np.int64), shape - off) // np.asarray(geom.chunk_shape, np.int64))
