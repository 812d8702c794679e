"""Pure planning: global boxes in, write and read items out. No I/O, no framework imports.

Save planning (:func:`plan_save`) picks, for each tensor, the shard grid (the zarr
regular chunk grid), the inner chunk shape, and which writer writes each shard.
Read planning (:func:`plan_reads`) maps requested global boxes onto the stored inner
chunks and the byte ranges that hold them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Iterable, Mapping, Sequence

import numpy as np

from ._types import Box
from .errors import ShapeMismatchError, StepMismatchError

__all__ = [
    "TensorGeometry", "WriteItem", "TensorWritePlan", "ReadItem", "shard_grid", "chunk_shape_for",
    "plan_save", "plan_reads", "cell_key", "stored_chunk_counts", "chunk_count_table",
]

DEFAULT_CHUNK_TARGET_BYTES = 4 << 20


@dataclass(frozen=True)
class TensorGeometry:
    """The storage geometry of one tensor: global shape, shard shape, inner chunk shape."""

    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    itemsize: int

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of shards along each dimension (0 along a zero-length dimension)."""
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shard_shape))

    @property
    def inner(self) -> tuple[int, ...]:
        """Inner chunks per shard along each dimension (the shard index covers all of them)."""
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape))

    @property
    def chunk_nbytes(self) -> int:
        """Stored bytes of one inner chunk with the raw codec: data plus the 4-byte crc32c."""
        return math.prod(self.chunk_shape) * self.itemsize + 4

    @property
    def index_nbytes(self) -> int:
        """Bytes of a shard index: 16 per inner chunk plus the 4-byte crc32c."""
        return math.prod(self.inner) * 16 + 4

    def shard_box(self, cell: tuple[int, ...]) -> Box:
        off = tuple(c * s for c, s in zip(cell, self.shard_shape))
        return Box(off, tuple(min(s, n - o) for s, n, o in zip(self.shard_shape, self.shape, off)))


@dataclass(frozen=True)
class WriteItem:
    """One shard object to write: the grid cell, its global box and its writer."""

    cell: tuple[int, ...]
    box: Box
    writer: int


@dataclass(frozen=True, eq=False)
class TensorWritePlan:
    """Which writer writes each shard of one tensor: grid cells in C order and their writers."""

    key: str
    index: int
    dtype: str
    geometry: TensorGeometry
    cells: np.ndarray    # (N, ndim) int64, C order over the shard grid
    writers: np.ndarray  # (N,) int64

    @property
    def items(self) -> tuple[WriteItem, ...]:
        return tuple(self._item(i) for i in range(len(self.writers)))

    def items_for(self, rank: int) -> list[WriteItem]:
        """The shards ``rank`` writes (built on demand: a plan may hold millions of cells)."""
        return [self._item(int(i)) for i in np.flatnonzero(self.writers == rank)]

    def _item(self, i: int) -> WriteItem:
        cell = tuple(int(c) for c in self.cells[i])
        return WriteItem(cell, self.geometry.shard_box(cell), int(self.writers[i]))


@dataclass(frozen=True)
class ReadItem:
    """Read one stored inner chunk and copy part of it into a requested box.

    ``shard`` indexes the tensor's shard table, ``chunk`` its chunk table.
    ``src`` selects inside the decoded chunk (full chunk_shape); ``dst`` inside the request.
    """

    request: int
    shard: int
    chunk: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def cell_key(cell: tuple[int, ...]) -> str:
    """The zarr v3 "default" chunk key of a grid cell, relative to the array path."""
    return "c" if not cell else "c/" + "/".join(str(c) for c in cell)


def shard_grid(shape: tuple[int, ...], boxes: Iterable[Box]) -> tuple[int, ...]:
    """The shard shape: per dimension, the gcd of every interior box boundary.

    Regular splits (including torch.chunk-style uneven tails) give the block size itself.
    A dimension with no interior boundary gets one shard spanning it. Empty boxes are ignored.
    """
    held = [b for b in boxes if not b.is_empty()]
    nd = len(shape)
    offs = np.array([b.offset for b in held], np.int64).reshape(len(held), nd)
    shps = np.array([b.shape for b in held], np.int64).reshape(len(held), nd)
    return _grid_from_arrays(shape, offs, shps)


def chunk_shape_for(shard_shape: tuple[int, ...], itemsize: int,
                    target_bytes: int = DEFAULT_CHUNK_TARGET_BYTES) -> tuple[int, ...]:
    """Inner chunk shape: divisors of the shard shape, near-cubic, at most ``target_bytes``.

    Repeatedly splits the largest dimension by its smallest prime factor until the chunk fits.
    """
    chunk = list(shard_shape)
    while math.prod(chunk) * itemsize > target_bytes:
        order = sorted(range(len(chunk)), key=lambda d: -chunk[d])
        for d in order:
            p = _smallest_factor(chunk[d])
            if p:
                chunk[d] //= p
                break
        else:
            break
    return tuple(chunk)


def _smallest_factor(n: int) -> int:
    if n < 2:
        return 0
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def plan_save(inventory: Mapping[str, tuple[tuple[int, ...], str, int]],
              rank_boxes: Sequence[Mapping[str, Sequence[tuple[Box, int]]]],
              chunk_target_bytes: int = DEFAULT_CHUNK_TARGET_BYTES) -> list[TensorWritePlan]:
    """Plan a save from every rank's held boxes.

    ``inventory`` maps key -> (global shape, dtype name, itemsize); ``rank_boxes[r]`` maps
    key -> [(box, replica_id), ...] held by rank r. Each shard goes to the holder with the
    lowest (replica_id, rank). Every rank computes the same plan from the same inputs.

    Raises StepMismatchError when a box falls outside its tensor, a rank names an unknown
    tensor, or part of a tensor is held by no rank.
    """
    world = max(1, len(rank_boxes))
    for r, held in enumerate(rank_boxes):
        for key in held:
            if key not in inventory:
                raise StepMismatchError("a rank holds a tensor the inventory does not list",
                                        key=key, expected="a key of rank 0's inventory", found=f"rank {r}")
    plans: list[TensorWritePlan] = []
    for index, key in enumerate(sorted(inventory)):
        shape, dtype, itemsize = inventory[key]
        shape = tuple(shape)
        nd = len(shape)
        held = [(r, b, rep) for r, hb in enumerate(rank_boxes) for b, rep in hb.get(key, ())]
        try:
            offs = np.array([b.offset for _, b, _ in held], np.int64).reshape(len(held), nd)
            shps = np.array([b.shape for _, b, _ in held], np.int64).reshape(len(held), nd)
        except ValueError:  # ragged: some box has the wrong number of dimensions
            r, b, _ = next(h for h in held if h[1].ndim != nd)
            raise StepMismatchError("a held box has the wrong rank", key=key, expected=f"{nd} dims",
                                    found=f"{b} on rank {r}") from None
        shp = np.asarray(shape, np.int64)
        bad = np.flatnonzero(np.any((offs < 0) | (shps < 0) | (offs + shps > shp), axis=1)) if held else []
        if len(bad):
            r, b, _ = held[int(bad[0])]
            raise StepMismatchError("a held box lies outside its tensor", key=key,
                                    expected=f"inside {shape}", found=f"{b} on rank {r}")
        nonempty = np.all(shps > 0, axis=1) if held else np.zeros(0, bool)
        shard_shape = _grid_from_arrays(shape, offs[nonempty], shps[nonempty])
        geom = TensorGeometry(shape, shard_shape, chunk_shape_for(shard_shape, itemsize, chunk_target_bytes), itemsize)
        grid = geom.grid
        ncells = math.prod(grid)
        prio = (np.array([rep for _, _, rep in held], np.int64) * world + np.array([r for r, _, _ in held], np.int64))[nonempty] \
            if held else np.zeros(0, np.int64)
        owner = np.full(ncells, np.iinfo(np.int64).max, np.int64)
        if nd == 0:
            if len(prio):
                owner[0] = prio.min()
        elif ncells:
            ss = np.asarray(shard_shape, np.int64)
            lo = offs[nonempty] // ss
            hi = -(-(offs[nonempty] + shps[nonempty]) // ss)
            single = np.all(hi - lo == 1, axis=1)
            if len(lo) and single.all():
                np.minimum.at(owner, np.ravel_multi_index(tuple(lo.T), grid), prio)
            else:
                view = owner.reshape(grid)
                for l, h, pr in zip(lo, hi, prio):
                    sl = tuple(slice(int(a), int(b)) for a, b in zip(l, h))
                    view[sl] = np.minimum(view[sl], pr)
        missing = np.flatnonzero(owner == np.iinfo(np.int64).max)
        if len(missing):
            cell = tuple(int(c) for c in np.unravel_index(int(missing[0]), grid)) if nd else ()
            raise StepMismatchError("part of a tensor is held by no rank", key=key, expected="every shard held",
                                    found=f"{len(missing)} unheld shard(s), first {geom.shard_box(cell)}")
        cells = np.indices(grid, dtype=np.int64).reshape(nd, -1).T if nd else np.zeros((ncells, 0), np.int64)
        plans.append(TensorWritePlan(key, index, dtype, geom, np.ascontiguousarray(cells), owner % world))
    return plans


def _grid_from_arrays(shape: tuple[int, ...], offs: np.ndarray, shps: np.ndarray) -> tuple[int, ...]:
    """Vectorized :func:`shard_grid` over (B, ndim) offset and shape arrays of non-empty boxes."""
    out = []
    for d, n in enumerate(shape):
        b = np.concatenate([offs[:, d], offs[:, d] + shps[:, d]]) if len(offs) else np.zeros(0, np.int64)
        interior = b[(b > 0) & (b < n)]
        out.append(int(np.gcd.reduce(interior)) if interior.size else max(n, 1))
    return tuple(out)


def stored_chunk_counts(geom: TensorGeometry, shard_offset: tuple[int, ...]) -> tuple[int, ...]:
    """Per dimension, how many inner chunks of the shard at ``shard_offset`` intersect the array."""
    return tuple(int(x) for x in chunk_count_table(geom, np.asarray([shard_offset], np.int64))[0])


def chunk_count_table(geom: TensorGeometry, shard_offsets: np.ndarray) -> np.ndarray:
    """(S, ndim) table of :func:`stored_chunk_counts` for every shard, vectorized."""
    off = np.asarray(shard_offsets, np.int64)
    if not len(geom.shape):
        return np.zeros((len(off), 0), np.int64)
    off = off.reshape(-1, len(geom.shape))
    shape = np.asarray(geom.shape, np.int64)
    return -(-np.minimum(np.asarray(geom.shard_shape, np.int64), shape - off) // np.asarray(geom.chunk_shape, np.int64))


def plan_reads(geom: TensorGeometry, shard_offsets: np.ndarray, chunk_start: np.ndarray,
               requests: Sequence[Box]) -> list[ReadItem]:
    """Map requested boxes to stored inner chunks.

    ``shard_offsets`` is the (S, ndim) table of shard offsets; ``chunk_start[s]`` is where
    shard s's entries begin in the chunk table. Raises ShapeMismatchError for a request
    outside the tensor. Pure: no I/O.
    """
    nd = len(geom.shape)
    offs = np.asarray(shard_offsets, np.int64)
    offs = offs.reshape(-1, nd) if nd else np.zeros((len(offs), 0), np.int64)
    grid = geom.grid
    shard_of = np.full(max(1, math.prod(grid)), -1, np.int64)
    if len(offs):
        if nd:
            cells = offs // np.asarray(geom.shard_shape, np.int64)
            shard_of[np.ravel_multi_index(tuple(cells.T), grid)] = np.arange(len(offs))
        else:
            shard_of[0] = 0
    per_shard = geom.inner  # inner chunks per full shard, per dimension
    items: list[ReadItem] = []
    for ri, req in enumerate(requests):
        if req.ndim != nd or any(o < 0 or o + s > n for o, s, n in zip(req.offset, req.shape, geom.shape)):
            raise ShapeMismatchError("requested box lies outside the tensor", expected=f"inside {geom.shape}", found=str(req))
        if req.is_empty():
            continue
        # Per dimension: (shard cell, local chunk index, stored chunk count of that shard, src slice, dst slice)
        dims = []
        for d in range(nd):
            c, sh, n, o, ln = geom.chunk_shape[d], geom.shard_shape[d], geom.shape[d], req.offset[d], req.shape[d]
            opts = []
            for g in range(o // c, -(-(o + ln) // c)):
                lo, hi = max(o, g * c), min(o + ln, (g + 1) * c)
                cell = g * c // sh
                count = -(-min(sh, n - cell * sh) // c)
                opts.append((cell, g - cell * per_shard[d], count, slice(lo - g * c, hi - g * c), slice(lo - o, hi - o)))
            dims.append(opts)
        for combo in product(*dims):
            cell = tuple(x[0] for x in combo)
            s = int(shard_of[np.ravel_multi_index(cell, grid)]) if nd else 0
            flat = 0
            for x in combo:
                flat = flat * x[2] + x[1]
            items.append(ReadItem(ri, s, int(chunk_start[s]) + flat, tuple(x[3] for x in combo), tuple(x[4] for x in combo)))
    return items
