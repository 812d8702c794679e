"""Save planning: global boxes in, write items out. No I/O, no framework imports.

:func:`plan_save` picks, for each tensor, the shard grid (the zarr regular chunk grid), the inner
chunk shape (its :class:`TensorGeometry`, :mod:`ckptfmt.geometry`), and which writer writes each
shard. Read planning, requested boxes onto stored inner chunks, is :mod:`ckptfmt.readplan`; this
module re-exports its names and the geometry's, the import path the core has used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ._boxcols import Held, _padded, gather, unpack_held
from ._types import Box
from .errors import StepMismatchError
from .geometry import TensorGeometry as TensorGeometry
from .geometry import chunk_count_table as chunk_count_table
from .geometry import grid_cells
from .geometry import stored_chunk_counts as stored_chunk_counts
from .layout import cell_key as cell_key
from .readplan import ReadItem as ReadItem
from .readplan import plan_reads as plan_reads

__all__ = [
    "TensorGeometry", "WriteItem", "TensorWritePlan", "ReadItem", "shard_grid", "chunk_shape_for",
    "plan_save", "plan_save_packed", "plan_reads", "cell_key", "stored_chunk_counts", "chunk_count_table",
    "Owners", "regular_owners",
]

DEFAULT_CHUNK_TARGET_BYTES = 4 << 20
#: A chunk is never chosen smaller than the target divided by this, unless the shard is (14.1).
CHUNK_FLOOR_DIVISOR = 64


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One shard object to write: the grid cell, its global box and its writer."""

    cell: tuple[int, ...]
    box: Box
    writer: int


@dataclass(frozen=True, eq=False, slots=True)
class TensorWritePlan:
    """Which writer writes each shard of one tensor: grid cells in C order and their writers."""

    key: str
    index: int
    dtype: str
    geometry: TensorGeometry
    cells: np.ndarray    # (N, ndim) int64, C order over the shard grid
    writers: np.ndarray  # (N,) int64
    # Items built so far, by rank (None: all of them): a save reuses the plan of an earlier save of
    # the same layout (ckptfmt.session), and its items too. Not a field of the plan's value.
    _items: dict[int | None, tuple[WriteItem, ...]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def items(self) -> tuple[WriteItem, ...]:
        return self._memo(None, lambda: tuple(self._item(i) for i in range(len(self.writers))))

    def items_for(self, rank: int) -> list[WriteItem]:
        """The shards ``rank`` writes (built on demand: a plan may hold millions of cells; the
        items of :attr:`items` where those are built already)."""
        def build() -> tuple[WriteItem, ...]:
            rows = np.flatnonzero(self.writers == rank)
            if len(rows) == len(self.writers):  # the only writer (one process): the items themselves
                return self.items
            built = self._items.get(None) if self._items is not None else None
            return tuple(built[int(i)] if built is not None else self._item(int(i)) for i in rows)

        return list(self._memo(rank, build))

    def _memo(self, rank: int | None, build: Any) -> tuple[WriteItem, ...]:
        if not len(self.writers):  # no shard (an empty tensor): nothing to build or keep
            return ()
        memo = self._items
        if memo is None:
            memo = {}
            object.__setattr__(self, "_items", memo)
        got = memo.get(rank)
        if got is None:
            got = memo[rank] = build()
        return got

    def _item(self, i: int) -> WriteItem:
        cell = tuple(int(c) for c in self.cells[i])
        return WriteItem(cell, self.geometry.shard_box(cell), int(self.writers[i]))


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
    """Inner chunk shape: divisors of the shard shape, near-cubic, at most ``target_bytes`` where
    the shard's factors allow it, and never far below it (FORMAT.md 14.1).

    Repeatedly splits the largest dimension by its smallest prime factor until the chunk fits.
    When that ends below ``target_bytes / CHUNK_FLOOR_DIVISOR`` (a dimension whose only factor is
    a large prime: a tensor of prime length became one chunk per element), it splits again and
    takes only the splits that stay at or above that floor, so the chunk may then exceed the
    target, up to the whole shard. Every chunk divides the shard (the format requires it, 5.7),
    and a shard holds at most ``CHUNK_FLOOR_DIVISOR`` x its bytes / ``target_bytes`` chunks, or one.
    """
    chunk = _split(shard_shape, itemsize, target_bytes, 0)
    floor = target_bytes // CHUNK_FLOOR_DIVISOR
    if math.prod(chunk) * itemsize >= floor:
        return chunk  # the plain rule, as earlier revisions chose it: those layouts are kept
    return _split(shard_shape, itemsize, target_bytes, floor)


def _split(shard_shape: tuple[int, ...], itemsize: int, target_bytes: int, floor: int) -> tuple[int, ...]:
    """The largest dimension that divides into a chunk of at least ``floor`` bytes, divided by its
    smallest prime factor, until the chunk fits ``target_bytes`` or no such split is left."""
    chunk = list(shard_shape)
    while (nbytes := math.prod(chunk) * itemsize) > target_bytes:
        order = sorted(range(len(chunk)), key=lambda d: -chunk[d])
        for d in order:
            p = _smallest_factor(chunk[d])
            if p and nbytes // p >= floor:
                chunk[d] //= p
                break
        else:
            break
    return tuple(chunk)


@lru_cache(maxsize=4096)  # the floor rule asks again for a prime dimension it cannot split
def _smallest_factor(n: int) -> int:
    if n < 2:
        return 0
    for p in range(2, int(math.isqrt(n)) + 1):
        if n % p == 0:
            return p
    return n


def plan_save(inventory: Mapping[str, tuple[tuple[int, ...], str, int]],
              rank_boxes: Sequence[Mapping[str, Sequence[tuple[Box, int]]]],
              chunk_target_bytes: int = DEFAULT_CHUNK_TARGET_BYTES, *,
              owners: Callable[[Sequence[tuple[int, ...]], Held, int], Owners] | None = None) -> list[TensorWritePlan]:
    """Plan a save from every rank's held boxes.

    ``inventory`` maps key -> (global shape, dtype name, itemsize); ``rank_boxes[r]`` maps
    key -> [(box, replica_id), ...] or [(box, replica_id, writable), ...] held by rank r
    (``writable`` False: the rank holds the box but offers no data for it). Each shard goes to
    one of its candidates (FORMAT.md 8.1): the holders that offer data (all holders when none
    does), one per rank (its lowest replica id), ordered by (replica_id, rank); the shard at
    flat cell ``c`` of the tensor at position ``i`` in key order goes to candidate
    ``(i + c) mod k``, so replicated shards are spread over their replicas. Every rank computes
    the same plan from the same inputs.

    ``owners`` plans the tensors held as whole grid cells at once (default :func:`regular_owners`);
    every other tensor takes the per-tensor path. A test passes a broken one as a control.

    Raises StepMismatchError when a box falls outside its tensor, a rank names an unknown
    tensor, or part of a tensor is held by no rank.
    """
    keys = sorted(inventory)
    width = max((len(inventory[k][0]) for k in keys), default=0)
    held = gather({k: i for i, k in enumerate(keys)}, rank_boxes, width)
    return _plan(inventory, keys, held, max(1, len(rank_boxes)), chunk_target_bytes, owners or regular_owners)


def plan_save_packed(inventory: Mapping[str, tuple[tuple[int, ...], str, int]], packed: Sequence[Mapping[str, Any]],
                     chunk_target_bytes: int = DEFAULT_CHUNK_TARGET_BYTES) -> list[TensorWritePlan]:
    """:func:`plan_save` from every rank's :func:`ckptfmt._boxcols.pack_boxes` columns (the save
    protocol's freeze messages, rank ``r`` being ``packed[r]``): the same plan, without a Python
    object per box."""
    keys = sorted(inventory)
    width = max((len(inventory[k][0]) for k in keys), default=0)
    held = unpack_held({k: i for i, k in enumerate(keys)}, packed, width)
    return _plan(inventory, keys, held, max(1, len(packed)), chunk_target_bytes, regular_owners)


def _plan(inventory: Mapping[str, tuple[tuple[int, ...], str, int]], keys: list[str], held: Held, world: int,
          chunk_target_bytes: int, owners: Callable[[Sequence[tuple[int, ...]], Held, int], Owners]) -> list[TensorWritePlan]:
    specs = [inventory[k] for k in keys]
    shapes = [tuple(s[0]) for s in specs]
    # Every tensor whose boxes are each exactly one grid cell is planned at once, vectorized;
    # any other tensor (including every one that fails) takes the per-tensor path, in key order.
    fast = owners(shapes, held, world)
    slow, gcds, base, writers = fast.slow, fast.gcds, fast.base, fast.writers
    shared: dict[tuple, tuple[TensorGeometry, np.ndarray]] = {}  # tensors alike share geometry and cells
    order: np.ndarray | None = None  # held boxes sorted by tensor, for the per-tensor path
    bounds: list[int] = []
    plans: list[TensorWritePlan] = []
    no_writers = writers[:0]  # the writer column every empty tensor's plan shares
    for index, (key, shape, (_, dtype, itemsize), is_slow) in enumerate(zip(keys, shapes, specs, slow.tolist())):
        if is_slow:
            if order is None:
                order = np.argsort(held.tensor, kind="stable")
                bounds = np.searchsorted(held.tensor[order], np.arange(len(keys) + 1)).tolist()
            mine = order[bounds[index]:bounds[index + 1]].tolist()
            boxes = [(int(held.rank[j]), held.box(j), int(held.reps[j]), bool(held.writable[j])) for j in mine]
            plans.append(_plan_tensor(index, key, shape, dtype, itemsize, boxes, world, chunk_target_bytes))
            continue
        like = shared.get((shape, gcds[index], itemsize))
        if like is None:
            shard_shape = tuple(int(g) if g else max(n, 1) for g, n in zip(gcds[index], shape))
            geom = TensorGeometry(shape, shard_shape, chunk_shape_for(shard_shape, itemsize, chunk_target_bytes), itemsize)
            like = shared[shape, gcds[index], itemsize] = (geom, grid_cells(geom.grid))
            like[1].flags.writeable = False
        geom, cells = like
        mine = writers[base[index]:base[index] + len(cells)] if len(cells) else no_writers
        plans.append(TensorWritePlan(key, index, dtype, geom, cells, mine))
    return plans


@dataclass(frozen=True, eq=False)
class Owners:
    """The vectorized plan (:func:`regular_owners`). For each tensor ``t`` that is not ``slow[t]``
    (those need the per-tensor path):"""

    slow: np.ndarray
    gcds: list[tuple[int, ...]]  # per dimension, the gcd of interior box boundaries (0: none)
    base: list[int]              # its writers, in C order over the grid, start at writers[base[t]]
    writers: np.ndarray


def regular_owners(shapes: Sequence[tuple[int, ...]], held: Held, world: int) -> Owners:
    """Vectorized plan of every tensor whose boxes all lie inside it, are non-empty, have its
    rank and cover exactly one grid cell each, and whose every cell is held, and of every empty
    tensor (a zero dimension: no cell) that some rank holds with boxes of its rank inside it: the writers
    :func:`plan_save`'s per-tensor path would choose, for all of them at once. Pure."""
    t, offs, shps = held.tensor, held.offs, held.shps
    T, D = len(shapes), offs.shape[1]
    tndim = np.fromiter(map(len, shapes), np.int64, count=T)
    tshape = _padded(np.fromiter(chain.from_iterable(shapes), np.int64, count=int(tndim.sum())), tndim, D, 1).T  # (D, T)
    # An empty tensor (a zero dimension) has no shard: its held boxes need only its rank and to
    # lie inside it; any other tensor's boxes must each be non-empty as well.
    empty = np.any(tshape <= 0, axis=0)
    in_empty = empty.take(t)
    bad = held.ndim != tndim[t]
    gcds = np.zeros((D, T), np.int64)
    for d in range(D):  # column by column: D is small, the box count large
        a, n = offs[:, d], tshape[d].take(t)
        b = a + shps[:, d]
        bad |= (a < 0) | np.where(in_empty, b < a, b <= a) | (b > n)
        # The gcd of interior boundaries (for a box inside its tensor, a == n or b == 0 only when empty).
        np.gcd.at(gcds[d], t, np.gcd(np.where(a < n, a, 0), np.where(b < n, b, 0)))
    gcds[:, empty] = 0  # no interior boundary: one shard spanning each dimension, as plan_save has it
    slow = (np.bincount(t[bad], minlength=T) > 0) | (np.bincount(t, minlength=T) == 0)
    ss = np.where(gcds > 0, gcds, np.maximum(tshape, 1))
    grid = -(-tshape // ss)
    # Offsets are multiples of the shard shape, so a box is one cell iff no wider than one shard.
    multi = np.zeros(len(t), bool)
    cell = np.zeros(len(t), np.int64)
    for d in range(D):
        sd = ss[d].take(t)
        multi |= shps[:, d] > sd
        cell *= grid[d].take(t)
        cell += offs[:, d] // sd
    slow |= np.bincount(t[multi & ~in_empty], minlength=T) > 0
    ncells = np.where(slow, 0, np.prod(grid, axis=0))  # 0 for an empty tensor: nothing to deal
    base = np.cumsum(ncells) - ncells
    good = ~slow[t] & ~in_empty
    total = int(ncells.sum())
    of_cell = np.repeat(np.arange(T), ncells)
    # Each cell's turn: its tensor's position in key order plus its flat index in the tensor.
    turn = of_cell + np.arange(total) - np.repeat(base, ncells)
    owner = _deal((cell + base[t])[good], held.rank[good], held.reps[good],
                  held.writable[good], total, turn)
    slow[of_cell[owner < 0]] = True  # gaps: the slow path raises
    return Owners(slow, list(map(tuple, gcds.T.tolist())), base.tolist(), owner)


def _deal(cell: np.ndarray, rank: np.ndarray, rep: np.ndarray, writable: np.ndarray, ncells: int,
          turn: np.ndarray) -> np.ndarray:
    """The writer rank of each of ``ncells`` cells (-1: held by no one), from its holders (one
    row per held (cell, rank, replica id, writable)): the candidates are the holders that offer
    data (all of them when none does), one per rank (its lowest replica id), ordered by
    (replica id, rank); cell ``c`` goes to candidate ``turn[c] mod k`` (FORMAT.md 8.1)."""
    owner = np.full(ncells, -1, np.int64)
    if not len(cell):
        return owner
    count = np.bincount(cell, minlength=ncells)
    if (count <= 1).all():  # no cell held twice: nothing to choose (the common case, and fast)
        owner[cell] = rank
        return owner
    offers = np.zeros(ncells, bool)
    offers[cell[writable]] = True
    cand = writable | ~offers[cell]
    c, r, p = cell[cand], rank[cand], rep[cand]
    o = np.lexsort((p, r, c))  # by cell, then rank, then replica id: keep each rank's lowest
    c, r, p = c[o], r[o], p[o]
    first = np.ones(len(c), bool)
    first[1:] = (c[1:] != c[:-1]) | (r[1:] != r[:-1])
    c, r, p = c[first], r[first], p[first]
    o = np.lexsort((r, p, c))  # candidate order within a cell: (replica id, rank)
    c, r = c[o], r[o]
    k = np.bincount(c, minlength=ncells)
    start = np.cumsum(k) - k
    held = np.flatnonzero(k)
    owner[held] = r[start[held] + turn[held] % k[held]]
    return owner


def _plan_tensor(index: int, key: str, shape: tuple[int, ...], dtype: str, itemsize: int,
                 held: Sequence[tuple], world: int, chunk_target_bytes: int) -> TensorWritePlan:
    """The general plan of one tensor from its (rank, box, replica_id[, writable]) list; raises
    like plan_save."""
    nd = len(shape)
    try:
        offs = np.array([h[1].offset for h in held], np.int64).reshape(len(held), nd)
        shps = np.array([h[1].shape for h in held], np.int64).reshape(len(held), nd)
    except ValueError:  # ragged: some box has the wrong number of dimensions
        r, b = next((h[0], h[1]) for h in held if h[1].ndim != nd)
        raise StepMismatchError("a held box has the wrong rank", key=key, expected=f"{nd} dims",
                                found=f"{b} on rank {r}") from None
    shp = np.asarray(shape, np.int64)
    bad = np.flatnonzero(np.any((offs < 0) | (shps < 0) | (offs + shps > shp), axis=1)) if held else []
    if len(bad):
        r, b = held[int(bad[0])][:2]
        raise StepMismatchError("a held box lies outside its tensor", key=key,
                                expected=f"inside {shape}", found=f"{b} on rank {r}")
    nonempty = np.all(shps > 0, axis=1) if held else np.zeros(0, bool)
    shard_shape = _grid_from_arrays(shape, offs[nonempty], shps[nonempty])
    geom = TensorGeometry(shape, shard_shape, chunk_shape_for(shard_shape, itemsize, chunk_target_bytes), itemsize)
    grid = geom.grid
    ncells = math.prod(grid)
    ranks = np.array([h[0] for h in held], np.int64)[nonempty] if held else np.zeros(0, np.int64)
    reps = np.array([h[2] for h in held], np.int64)[nonempty] if held else np.zeros(0, np.int64)
    writable = np.array([h[3] if len(h) > 3 else True for h in held], bool)[nonempty] if held else np.zeros(0, bool)
    # One row per (cell, holder): every cell each non-empty box covers.
    if nd == 0:
        cell = np.zeros(len(ranks), np.int64)
        rows = np.arange(len(ranks))
    elif ncells and len(ranks):
        ss = np.asarray(shard_shape, np.int64)
        lo = offs[nonempty] // ss
        hi = -(-(offs[nonempty] + shps[nonempty]) // ss)
        if np.all(hi - lo == 1):
            cell, rows = np.ravel_multi_index(tuple(lo.T), grid), np.arange(len(ranks))
        else:
            parts = [np.ravel_multi_index(tuple(np.indices(tuple(h - l)).reshape(nd, -1) + l[:, None]), grid)
                     for l, h in zip(lo, hi)]
            cell = np.concatenate(parts)
            rows = np.repeat(np.arange(len(ranks)), [len(x) for x in parts])
    else:
        cell = rows = np.zeros(0, np.int64)
    owner = _deal(cell, ranks[rows], reps[rows], writable[rows], max(ncells, 1) if nd == 0 else ncells,
                  index + np.arange(max(ncells, 1) if nd == 0 else ncells))
    missing = np.flatnonzero(owner < 0)
    if len(missing):
        cell = tuple(int(c) for c in np.unravel_index(int(missing[0]), grid)) if nd else ()
        raise StepMismatchError("part of a tensor is held by no rank", key=key, expected="every shard held",
                                found=f"{len(missing)} unheld shard(s), first {geom.shard_box(cell)}")
    return TensorWritePlan(key, index, dtype, geom, grid_cells(grid), owner)


def _grid_from_arrays(shape: tuple[int, ...], offs: np.ndarray, shps: np.ndarray) -> tuple[int, ...]:
    """Vectorized :func:`shard_grid` over (B, ndim) offset and shape arrays of non-empty boxes."""
    out = []
    for d, n in enumerate(shape):
        b = np.concatenate([offs[:, d], offs[:, d] + shps[:, d]]) if len(offs) else np.zeros(0, np.int64)
        interior = b[(b > 0) & (b < n)]
        out.append(int(np.gcd.reduce(interior)) if interior.size else max(n, 1))
    return tuple(out)
