"""Every rank's held boxes as columns: the input of the save plan (FORMAT.md 8.1). Pure: no I/O.

The save protocol's freeze step gathers the boxes every rank holds: at 10,000 tensors x 64
ranks, 640,000 of them, gathered by every rank. Each rank packs its own boxes into a few integer
columns (:func:`pack_boxes`), so that gathering them is a concatenation per rank
(:func:`unpack_held`) instead of Python work per box. :func:`gather` builds the same columns
from Box objects, for :func:`ckptfmt.plan.plan_save`.
"""
from __future__ import annotations

import math
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ._types import Box, LocalShard
from .dtypes import dtype_name
from .errors import ShapeMismatchError, StepMismatchError
from .layout import MAX_DIM, MAX_NDIM, MAX_TENSOR_BYTES

__all__ = ["Held", "check_held", "gather", "pack_boxes", "unpack_held"]

_I8 = "<i8"


class Held(NamedTuple):
    """Every held box of every rank, flattened in rank order (then each rank's own order)."""

    tensor: np.ndarray    # (N,) index into the sorted keys
    rank: np.ndarray      # (N,)
    reps: np.ndarray      # (N,) replica ids
    writable: np.ndarray  # (N,) bool: the holder offers data for the box
    ndim: np.ndarray      # (N,) dimensions of each box
    offs: np.ndarray      # (N, D) offsets, padded with 0 up to the widest tensor or box
    shps: np.ndarray      # (N, D) shapes, padded with 1

    def box(self, j: int) -> Box:
        nd = int(self.ndim[j])
        return Box(tuple(self.offs[j, :nd].tolist()), tuple(self.shps[j, :nd].tolist()))


def check_held(s: LocalShard) -> None:
    """A held block that a manifest can record (FORMAT.md 5.10), checked before anything is packed
    or written: a dtype the format stores (InvalidManifestError), a tensor of at most MAX_NDIM
    dimensions, each in [0, 2^62], of at most 2^62 bytes (ShapeMismatchError), and a box of its
    rank inside it (StepMismatchError, as the planner says it). Each names the tensor."""
    dtype_name(s.dtype, key=s.key)
    shape, box = s.global_shape, s.box
    if len(shape) > MAX_NDIM:
        raise ShapeMismatchError("tensor has more dimensions than the format stores", key=s.key,
                                 expected=f"<= {MAX_NDIM} dimensions", found=len(shape))
    if any(not 0 <= n <= MAX_DIM for n in shape):
        raise ShapeMismatchError("a dimension of the tensor is out of range", key=s.key,
                                 expected="each dimension in [0, 2^62]", found=list(shape))
    if math.prod(max(n, 1) for n in shape) * s.dtype.itemsize > MAX_TENSOR_BYTES:
        raise ShapeMismatchError("tensor too large (shape x itemsize)", key=s.key,
                                 expected=f"<= {MAX_TENSOR_BYTES} bytes", found=f"{list(shape)} x {s.dtype.itemsize} B")
    if box.ndim != len(shape):
        raise StepMismatchError("a held box has the wrong rank", key=s.key, expected=f"{len(shape)} dims", found=str(box))
    if any(o < 0 or b < 0 or o + b > n for o, b, n in zip(box.offset, box.shape, shape)):
        raise StepMismatchError("a held box lies outside its tensor", key=s.key, expected=f"inside {shape}",
                                found=str(box))


def _unknown_key(index: Mapping[str, int], keys: Any, rank: int) -> StepMismatchError:
    key = next(k for k in keys if k not in index)
    return StepMismatchError("a rank holds a tensor the inventory does not list", key=key,
                             expected="a key of rank 0's inventory", found=f"rank {rank}")


def gather(index: Mapping[str, int], rank_boxes: Sequence[Mapping[str, Sequence[tuple[Any, ...]]]],
           width: int) -> Held:
    """The columns of ``rank_boxes[r][key] = [(box, replica_id[, writable]), ...]``; raises
    StepMismatchError for a key not in ``index``."""
    tensor: list[np.ndarray] = []
    rank: list[np.ndarray] = []
    pairs: list[tuple[Any, ...]] = []
    last: list[str] | None = None
    for r, hb in enumerate(rank_boxes):
        keys = list(hb)
        if keys != last:  # ranks usually hold the same keys in the same order
            if not index.keys() >= hb.keys():
                raise _unknown_key(index, hb, r)
            tids, last = np.fromiter(map(index.__getitem__, keys), np.int64, count=len(keys)), keys
        vals = list(hb.values())
        try:
            counts = list(map(len, vals))
        except TypeError:  # an iterator, not a sequence
            vals = [list(v) for v in vals]
            counts = list(map(len, vals))
        if counts.count(1) == len(counts):  # one box per tensor: the common case
            pairs.extend(map(itemgetter(0), vals))
            tensor.append(tids)
        else:
            pairs.extend(chain.from_iterable(vals))
            tensor.append(np.repeat(tids, counts))
        rank.append(np.full(sum(counts), r, np.int64))
    boxes = list(map(itemgetter(0), pairs))
    reps = np.fromiter(map(itemgetter(1), pairs), np.int64, count=len(pairs))
    if set(map(len, pairs)) <= {2}:  # (box, replica_id): every holder offers data
        writable = np.ones(len(pairs), bool)
    else:
        writable = np.fromiter((bool(p[2]) if len(p) > 2 else True for p in pairs), bool, count=len(pairs))
    offsets = list(map(attrgetter("offset"), boxes))
    widths = set(map(len, offsets))
    ndim = np.full(len(boxes), widths.pop(), np.int64) if len(widths) == 1 else \
        np.fromiter(map(len, offsets), np.int64, count=len(boxes))
    total = int(ndim.sum())
    flat_o = np.fromiter(chain.from_iterable(offsets), np.int64, count=total)
    flat_s = np.fromiter(chain.from_iterable(map(attrgetter("shape"), boxes)), np.int64, count=total)
    return _held(_cat(tensor), _cat(rank), reps, writable, ndim, flat_o, flat_s, width)


def pack_boxes(boxes: Mapping[str, Sequence[tuple[Box, int, bool]]],
               keys_known: Sequence[str] | None = None) -> dict[str, Any]:
    """One rank's ``{key: [(box, replica_id, writable), ...]}`` as columns (msgpack-ready). When its
    keys are exactly ``keys_known`` in that order (the save protocol passes the sorted inventory,
    which every rank agrees on), they are left out of the message: the receiver knows them."""
    keys = list(boxes)
    rows = list(chain.from_iterable(boxes.values()))
    ndim = np.fromiter((len(b.offset) for b, _, _ in rows), np.int64, count=len(rows))
    total = int(ndim.sum())
    offs = np.fromiter(chain.from_iterable(b.offset for b, _, _ in rows), np.int64, count=total)
    shps = np.fromiter(chain.from_iterable(b.shape for b, _, _ in rows), np.int64, count=total)
    reps = np.fromiter((r for _, r, _ in rows), np.int64, count=len(rows))
    writable = np.fromiter((bool(w) for _, _, w in rows), np.uint8, count=len(rows))
    counts = np.fromiter(map(len, boxes.values()), np.int64, count=len(keys))
    return {"keys": None if keys_known is not None and keys == list(keys_known) else keys,
            "counts": counts.astype(_I8).tobytes(), "ndim": ndim.astype(_I8).tobytes(),
            "offset": offs.astype(_I8).tobytes(), "shape": shps.astype(_I8).tobytes(),
            "replica": reps.astype(_I8).tobytes(), "writable": writable.tobytes()}


def unpack_held(index: Mapping[str, int], packed: Sequence[Mapping[str, Any]], width: int) -> Held:
    """The columns of every rank's :func:`pack_boxes` message, rank ``r`` being ``packed[r]``; a
    message without keys holds those of ``index``, in its order. StepMismatchError for a key not
    in ``index``, a message whose columns disagree, or one with more than MAX_NDIM dimensions, a
    writable byte other than 0 or 1, or an offset, extent or their sum beyond 2^62 in magnitude (a
    message comes from another process: the planner's int64 arithmetic must not wrap)."""
    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("tensor", "rank", "reps", "writable", "ndim", "offs", "shps")}
    known = list(index)
    last: list[str] | None = None
    tids = np.zeros(0, np.int64)
    for r, p in enumerate(packed):
        try:
            keys, counts = p["keys"], np.frombuffer(p["counts"], _I8)
            keys = known if keys is None else list(keys)
            ndim = np.frombuffer(p["ndim"], _I8)
            offs, shps = np.frombuffer(p["offset"], _I8), np.frombuffer(p["shape"], _I8)
            reps, writable = np.frombuffer(p["replica"], _I8), np.frombuffer(p["writable"], np.uint8)
        except (KeyError, TypeError, ValueError) as e:
            raise StepMismatchError("a rank's freeze message is malformed", expected="pack_boxes columns",
                                    found=f"rank {r}: {type(e).__name__}: {e}") from None
        n = int(counts.sum())
        if (len(keys) != len(counts) or (counts < 0).any() or len(ndim) != n or len(reps) != n or len(writable) != n
                or (ndim < 0).any() or len(offs) != int(ndim.sum()) or len(shps) != len(offs)):
            raise StepMismatchError("a rank's freeze message is malformed", expected="columns of equal length",
                                    found=f"rank {r}")
        # Offsets and shapes within +-2^62 whose sums stay within 2^62 (so the planner's int64 sums
        # cannot wrap); a negative or outside box that passes here is named by the planner.
        if ((ndim > MAX_NDIM).any() or (writable > 1).any() or (offs < -MAX_DIM).any() or (offs > MAX_DIM).any()
                or (shps < -MAX_DIM).any() or (shps > MAX_DIM).any() or (offs > MAX_DIM - np.maximum(shps, 0)).any()):
            raise StepMismatchError("a rank's freeze message holds a value out of range",
                                    expected=f"<= {MAX_NDIM} dims, extents and their sums within 2^62, writable 0 or 1",
                                    found=f"rank {r}")
        if keys is not last and keys != last:  # ranks usually hold the same keys in the same order
            if not index.keys() >= set(keys):
                raise _unknown_key(index, keys, r)
            tids, last = np.fromiter(map(index.__getitem__, keys), np.int64, count=len(keys)), keys
        cols["tensor"].append(np.repeat(tids, counts))
        cols["rank"].append(np.full(n, r, np.int64))
        for c, a in (("reps", reps), ("writable", writable), ("ndim", ndim), ("offs", offs), ("shps", shps)):
            cols[c].append(a)
    c = {k: _cat(v) for k, v in cols.items()}
    return _held(c["tensor"], c["rank"], c["reps"], c["writable"].astype(bool), c["ndim"], c["offs"], c["shps"], width)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _held(tensor: np.ndarray, rank: np.ndarray, reps: np.ndarray, writable: np.ndarray, ndim: np.ndarray,
          flat_o: np.ndarray, flat_s: np.ndarray, width: int) -> Held:
    width = max(width, int(ndim.max(initial=0)))
    return Held(tensor, rank, reps, writable, ndim, _padded(flat_o, ndim, width, 0), _padded(flat_s, ndim, width, 1))


def _padded(flat: np.ndarray, lens: np.ndarray, width: int, fill: int) -> np.ndarray:
    """(len(lens), width) int64 array of ragged rows (``lens[i]`` values each, back to back in
    ``flat``), padded with ``fill``."""
    if (lens == width).all():
        return flat.reshape(len(lens), width)
    out = np.full((len(lens), width), fill, np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    out[np.repeat(np.arange(len(lens)), lens), np.arange(len(flat)) - starts] = flat
    return out
