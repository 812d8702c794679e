"""The small, deterministic training state every fault run saves and compares against.

Values depend only on ``(seed, step)``, so any process can rebuild the ground truth of any
step bit for bit. Tensors are split by rows across the writers so that each writer owns
whole shards; one tensor is replicated (only rank 0's replica is written).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TENSORS", "truth", "global_state", "rank_state", "local_shards", "CHUNK_TARGET_BYTES"]

#: key -> (global shape, dtype, split rows across writers?)
TENSORS: dict[str, tuple[tuple[int, ...], str, bool]] = {
    "opt/step_mu": ((48, 8), "int32", True),
    "params/dense/bias": ((32,), "float32", False),
    "params/dense/kernel": ((64, 32), "float32", True),
}

#: Frozen in an incremental run (``incremental=True``): their value does not change with the step,
#: so an incremental save references the previous step's objects (FORMAT.md 8.4).
FROZEN = frozenset({"params/dense/kernel"})

#: Small inner chunks, so that every shard holds several chunks and a real shard index.
CHUNK_TARGET_BYTES = 1024


def _rng(seed: int, step: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, step, sum(key.encode())])


def truth(seed: int, step: int, incremental: bool = False) -> dict[str, np.ndarray]:
    """The full global value of every tensor at ``step`` (the FROZEN ones at step 0 when
    ``incremental``)."""
    out: dict[str, np.ndarray] = {}
    for key, (shape, dtype, _) in TENSORS.items():
        rng = _rng(seed, 0 if incremental and key in FROZEN else step, key)
        if np.dtype(dtype).kind == "f":
            out[key] = rng.standard_normal(shape).astype(dtype)
        else:
            out[key] = rng.integers(-1000, 1000, size=shape).astype(dtype)
    return out


def global_state(seed: int, step: int) -> dict[str, Any]:
    return {"step": step, "seed": seed, "loader": {"epoch": step // 10, "cursor": step * 17},
            "rng": np.arange(4, dtype=np.uint32) + np.uint32(step), "lr": 1e-3 / (1 + step)}


def rank_state(seed: int, step: int, rank: int) -> dict[str, Any]:
    return {"rank": rank, "step": step, "sampler_offset": 1000 * rank + step}


def row_split(rows: int, world: int) -> list[tuple[int, int]]:
    """Even row ranges (start, stop) per rank; ``rows`` is a multiple of ``world`` here."""
    per = rows // world
    return [(r * per, (r + 1) * per) for r in range(world)]


def local_shards(seed: int, step: int, rank: int, world: int, data_hook=None, incremental: bool = False) -> list:
    """This rank's LocalShards. ``data_hook(i, array)`` may wrap each block's data (lazy callables)."""
    from ckptfmt import Box, LocalShard

    full = truth(seed, step, incremental)
    shards = []
    for i, (key, (shape, dtype, split)) in enumerate(TENSORS.items()):
        if split:
            lo, hi = row_split(shape[0], world)[rank]
            box = Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])
            replica = 0
        else:
            box, replica = Box.full(shape), (0 if rank == 0 else 1)
        block = np.ascontiguousarray(full[key][box.slices()])
        data = block if data_hook is None else data_hook(i, block)
        shards.append(LocalShard(key, shape, dtype, box, data, replica_id=replica))
    return shards
