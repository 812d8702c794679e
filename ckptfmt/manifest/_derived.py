"""The columns of a tensor entry that its geometry determines (FORMAT.md 5.14, the extension
``ckptfmt.derived``): what a manifest in the derived form leaves out, and what the fast path
compares an explicit entry with. Pure: built from the geometry alone."""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ckptfmt.plan import TensorGeometry
from ckptfmt.shard import shard_sizes

if TYPE_CHECKING:
    from ckptfmt.manifest._entries import TensorEntry

__all__ = ["DerivedColumns", "TooManyChunks", "derived_columns"]


@dataclass(frozen=True, eq=False)
class DerivedColumns:
    """The five columns of a tensor in the written layout, which its geometry determines
    (FORMAT.md 5.14): what a manifest in the derived form leaves out. Arrays are read-only."""

    offset: np.ndarray       # (S, ndim) shard offsets, grid cells in C order
    key: tuple[str, ...]     # shard keys derived from the offsets
    nbytes: np.ndarray       # (S,) shard object sizes
    chunk_offset: np.ndarray  # (C,) chunk offsets, back to back from 0 inside each shard
    chunk_nbytes: np.ndarray  # (C,) all chunk_nbytes
    chunk_start: np.ndarray  # (S + 1,) where each shard's rows begin in the chunk table

    @functools.cached_property
    def _raw(self) -> tuple[bytes, ...]:
        return tuple(a.tobytes() for a in (self.offset, self.nbytes, self.chunk_offset, self.chunk_nbytes))

    def matches(self, entry: "TensorEntry") -> bool:
        """Whether ``entry`` holds exactly these columns (and may therefore leave them out). Compared
        as int64 bytes: a table of another dtype or shape simply keeps the explicit form."""
        sh, ch = entry.shards, entry.chunks
        cols = (sh.offset, sh.nbytes, ch.offset, ch.nbytes)
        last = self.__dict__.get("_last")  # the very arrays of the last match: a parsed manifest's tensors share them
        if last is not None and sh.key is last[0] and all(a is b for a, b in zip(cols, last[1])):
            return entry.array.codec == "raw"
        same = (entry.array.codec == "raw" and all(type(a) is np.ndarray and a.dtype == np.int64 for a in cols)
                and sh.offset.shape == self.offset.shape and ch.offset.shape == self.chunk_offset.shape
                and tuple(a.tobytes() for a in cols) == self._raw and (sh.key is self.key or sh.key == self.key))
        if same and not any(a.flags.writeable for a in cols):  # read-only: they cannot change under us
            self.__dict__["_last"] = (sh.key, cols)
        return same


class TooManyChunks(ValueError):
    """A geometry stores more chunks than the caller allows (``total``, the number it stores)."""

    def __init__(self, total: int, limit: int):
        super().__init__(f"{total} stored chunks, more than {limit}")
        self.total = total


def derived_columns(geom: TensorGeometry, max_chunks: int | None = None) -> DerivedColumns:
    """The columns FORMAT.md 5.14 derives from ``geom`` (pure; callers memoize by geometry).
    :class:`TooManyChunks` when the tensor stores more than ``max_chunks`` chunks (checked before
    the chunk columns are built: a hostile geometry must not size them).

    Built from per-dimension pieces, with no Python object per row but the shard keys: the
    offset table is written in place one dimension at a time, and the chunk counts are an outer
    product of per-dimension counts (what a shard stores along a dimension depends on its cell
    along that dimension only). Memory: the returned arrays plus one column."""
    nd, grid, n = len(geom.shape), geom.grid, math.prod(geom.grid)
    offsets = np.empty((n, nd), np.int64)
    counts = np.ones(n, np.int64) if nd == 0 else np.zeros(0, np.int64)
    if nd and n:
        cube = offsets.reshape(*grid, nd)
        per_dim = []
        for d, (g, s, c, size) in enumerate(zip(grid, geom.shard_shape, geom.chunk_shape, geom.shape)):
            cell = np.arange(g, dtype=np.int64)
            cube[..., d] = (cell * s).reshape((1,) * d + (g,) + (1,) * (nd - d - 1))
            per_dim.append(-(-np.minimum(s, size - cell * s) // c))
        counts = functools.reduce(np.multiply.outer, per_dim).reshape(n)
    # An empty tensor has no shards, however long its other dimensions are.
    keys = tuple(map("/".join, itertools.product(("c",), *(list(map(str, range(g))) for g in grid)))) if n else ()
    start = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    total = int(start[-1])
    if max_chunks is not None and total > max_chunks:
        raise TooManyChunks(total, max_chunks)
    sizes = shard_sizes(geom)
    cn = sizes.chunk
    coff = (np.arange(total, dtype=np.int64) - np.repeat(start[:-1], counts)) * cn
    arrays = (offsets, sizes.shard(counts), coff, np.full(total, cn, np.int64), start)
    for a in arrays:
        a.flags.writeable = False
    return DerivedColumns(arrays[0], keys, *arrays[1:])
