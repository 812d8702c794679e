"""The PyTorch bridge's data plane for a cooperative restore (FORMAT.md 9.1): an all-gather of
byte buffers over the default process group (``torch.distributed.all_gather``, gloo on CPU),
implementing :class:`ckptfmt.reader.Exchange`. Buffers are padded to the longest of the round,
which the plan keeps balanced.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Replicate = None  # type: ignore[assignment,misc]

__all__ = ["TorchExchange", "replicated_over_ranks"]


class TorchExchange:
    """An all-gather of uint8 buffers over every rank of the default process group."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
        n = max(int(s) for s in sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        if data.size:
            mine[:data.size] = torch.from_numpy(np.ascontiguousarray(data))
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.numpy()[:int(s)] for t, s in zip(out, sizes)]


def replicated_over_ranks(target: Any, world: int) -> bool:
    """Whether some DTensor value of ``target`` (a flat list of (key, value)) lies on a mesh of all
    ``world`` ranks with a Replicate placement over a mesh dimension of more than one rank: its
    boxes repeat across ranks, and a load of a DTensor is collective."""
    if DTensor is None:
        return False
    for _, v in target:
        if isinstance(v, DTensor) and v.device_mesh.size() == world and any(
                isinstance(p, Replicate) and n > 1 for p, n in zip(v.placements, v.device_mesh.shape)):
            return True
    return False
