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

from bridges.torch._coord import for_group

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Replicate = None  # type: ignore[assignment,misc]

__all__ = ["TorchExchange", "replicated_over_ranks", "collectives_pay"]


def collectives_pay() -> bool:
    """Whether sharing verified bytes over the default group beats each rank reading them: on an
    accelerator's collectives (NCCL), yes; over gloo on the host, no (docs/cooperative-restore.md:
    gloo's all-gather moved 71 MB/s per rank on the 2-core CI machine, storage 2 GB/s)."""
    return dist.get_backend() == "nccl"


class TorchExchange:
    """An all-gather of uint8 buffers over every rank of the default process group."""

    def __init__(self, coordinator: Any = None) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.coordinator = coordinator if coordinator is not None else for_group()
        # NCCL moves CUDA tensors only; gloo moves host tensors
        self.device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                       else torch.device("cpu"))

    def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
        n = max(int(s) for s in sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        if data.size:
            mine[:data.size] = torch.from_numpy(np.ascontiguousarray(data))
        mine = mine.to(self.device)
        out = [torch.empty(n, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.cpu().numpy()[:int(s)] for t, s in zip(out, sizes)]


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
