"""Which global boxes a rank's DTensor block covers (FORMAT.md 13.3), by global coordinates.

``Shard(d)`` splits dimension ``d`` as ``torch.chunk`` does (uneven and empty blocks included),
several placements on one tensor dimension split it again in mesh-dimension order, and
``_StridedShard`` (FSDP2 over tensor parallelism on one dimension) splits it with a stride. The
indices a rank holds along each dimension are computed by the placements' own split functions,
applied left to right to an index vector, as ``distribute_tensor`` applies them to data; runs of
consecutive indices are the rank's boxes, so a strided block is written (and read) as several
boxes. ``Partial`` is refused: it must be reduced first.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ckptfmt import Box, TensorSharding
from ckptfmt.errors import InvalidStateError

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except Exception:  # pragma: no cover - torch built without distributed
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]
    compute_local_shape_and_global_offset = None  # type: ignore[assignment]
try:  # FSDP2 over TP; private in torch, and not a subclass of Shard in every version
    from torch.distributed.tensor.placement_types import _StridedShard
except Exception:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]

_SPLITS = tuple(c for c in (Shard, _StridedShard) if c is not None)

__all__ = ["Piece", "dtensor_pieces", "is_plain_layout"]


@dataclass(frozen=True)
class Piece:
    """One box of a rank's block: its global ``box`` and where it lies in the local tensor."""

    box: Box
    local: tuple[slice, ...]


def is_plain_layout(t: Any) -> bool:
    """Whether every placement of DTensor ``t`` is exactly ``Shard`` or ``Replicate`` (one box)."""
    return all(type(p) is Shard or type(p) is Replicate for p in t.placements)


def _runs(idx: list[int]) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run of consecutive indices."""
    out: list[tuple[int, int, int]] = []
    for i, g in enumerate(idx):
        if out and out[-1][0] + out[-1][2] == g and out[-1][1] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, i, 1))
    return out


def _indices(t: Any, key: str, coord: Any = None) -> list[list[int]]:
    """The global indices this rank (or the mesh coordinate ``coord``) holds along each dimension,
    in local order."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate() if coord is None else coord
    ndim = t.ndim
    idx = [torch.arange(int(n)) for n in t.shape]
    for m, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, _SPLITS) or not hasattr(p, "_split_tensor"):
            raise InvalidStateError(f"placement {p} on mesh dim {m} cannot be saved; reduce or redistribute it "
                                    "first (a Partial must be reduced)", key=key,
                                    expected="Shard, _StridedShard or Replicate", found=str(p))
        d = p.dim % max(ndim, 1)
        shaped = idx[d].reshape([1] * d + [-1] + [1] * (ndim - d - 1))
        pieces, _ = p._split_tensor(shaped, mesh.size(m), with_padding=False, contiguous=True)
        mine = pieces[coord[m]] if coord[m] < len(pieces) else shaped.narrow(d, 0, 0)
        idx[d] = mine.reshape(-1)
    return [v.tolist() for v in idx]


def _strided_sharding(t: Any, key: str, names: tuple[str, ...], replicated: list[int]) -> TensorSharding | None:
    """The description of a strided layout that is a plain split of each dimension by several mesh
    axes in another order than the mesh's (FSDP2 over TP: ``_StridedShard`` on dp and ``Shard`` on
    tp of one dimension hold the rows of ``P(("tp", "dp"))``, tp major), or None: checked for every
    mesh coordinate, for evenly divided dimensions only."""
    mesh, placements = t.device_mesh, t.placements
    splits: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if not isinstance(p, Replicate):
            splits.setdefault(p.dim % max(t.ndim, 1), []).append(m)
    coords = list(itertools.product(*(range(mesh.size(m)) for m in range(mesh.ndim))))
    held = [_indices(t, key, list(c)) for c in coords]
    partition: list[tuple[str, ...] | None] = [None] * t.ndim
    for d, axes in splits.items():
        n, parts = int(t.shape[d]), 1
        for m in axes:
            parts *= mesh.size(m)
        if n % parts:
            return None
        size = n // parts
        for order in itertools.permutations(axes):
            def start(c: tuple[int, ...]) -> int:
                k = 0
                for m in order:
                    k = k * mesh.size(m) + c[m]
                return k * size
            if all(h[d] == list(range(start(c), start(c) + size)) for c, h in zip(coords, held)):
                partition[d] = tuple(names[m] for m in order)
                break
        else:
            return None
    return TensorSharding("torch", tuple(mesh.shape), names, tuple(partition), tuple(names[i] for i in replicated))


def dtensor_pieces(t: Any, key: str) -> tuple[list[Piece] | None, int, TensorSharding | None]:
    """This rank's pieces of DTensor ``t``, its replica id, and the sharding description.

    None pieces: this rank is not on the DTensor's mesh. The replica id is the rank's coordinate
    on the ``Replicate()`` mesh dimensions, read row-major (FORMAT.md 13.3). The description is
    given for plain layouts, and for strided ones that split each dimension evenly by its mesh axes
    in another order (FSDP2 over TP: ``partition`` ``[["tp", "dp"], ...]``, major to minor); None
    for other strided layouts.
    Raises InvalidStateError, naming the key, for a placement that cannot be saved.
    """
    mesh, placements = t.device_mesh, t.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None, 0, None
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    replicated = [i for i, p in enumerate(placements) if isinstance(p, Replicate)]
    rid = 0
    for i in replicated:
        rid = rid * mesh.size(i) + coord[i]
    if is_plain_layout(t):
        partition: list[list[str]] = [[] for _ in range(t.ndim)]
        for i, p in enumerate(placements):
            if type(p) is Shard:
                partition[p.dim % max(t.ndim, 1)].append(names[i])
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        box = Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))
        sharding = TensorSharding("torch", tuple(mesh.shape), names,
                                  tuple(tuple(p) if p else None for p in partition),
                                  tuple(names[i] for i in replicated))
        return [Piece(box, tuple(slice(0, n) for n in box.shape))], rid, sharding
    runs = [_runs(ix) for ix in _indices(t, key)]
    if any(not r for r in runs):  # an empty block: one empty box at the origin
        return [Piece(Box((0,) * t.ndim, (0,) * t.ndim), tuple(slice(0, 0) for _ in range(t.ndim)))], rid, None
    pieces = [Piece(Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo)),
                    tuple(slice(r[1], r[1] + r[2]) for r in combo))
              for combo in itertools.product(*runs)]
    return pieces, rid, _strided_sharding(t, key, names, replicated)
