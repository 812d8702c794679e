"""FSDP2 over tensor parallelism saved through DCP's CkptfmtStorageWriter, for ``inspect``."""
from __future__ import annotations

from typing import Any

import torch

from torchproc.scenarios import _fsdp_tp_net


def fsdp_tp_dcp_save(args: dict[str, Any]) -> dict[str, Any]:
    """(dp, tp) = (2, 2): the MLP of scenarios._fsdp_tp_net (12 rows, strided and even) plus a
    colwise Linear of 10 rows (5 per tp rank, split 3 + 2 by dp: strided and uneven), saved with
    dcp.save through CkptfmtStorageWriter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from bridges.dcp import CkptfmtStorageWriter
    net, m = _fsdp_tp_net(2, 2, seed=5)
    odd = torch.nn.Sequential(torch.nn.Linear(6, 10))
    parallelize_module(odd, m["tp"], {"0": ColwiseParallel()})
    fully_shard(odd, mesh=m["dp"])
    msd, _ = get_state_dict(net, [])
    osd, _ = get_state_dict(odd, [])
    dcp.save({"model": msd, "odd": osd}, storage_writer=CkptfmtStorageWriter(args["url"], step=1))
    return {"placements": {k: str(v.placements) for k, v in {**msd, **osd}.items()}}
