"""Cooperative load (FORMAT.md 9.1) on 2 gloo ranks (run by tests/test_torch_bridge.py as
``coop:load``): a state every rank holds whole (DTensors Replicate over a mesh of both ranks, so
both load the same boxes), loaded cooperatively (the default) and with ``cooperative=False``
(the control); then rank 1 flips one data byte of a shard it served and both load again.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from bridges import torch as bt
from ckptfmt import Repository
from ckptfmt.errors import CheckpointError

ROWS, COLS, TENSORS = 256, 256, 4  # 256 KiB each


def _value(t: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + t


def _target(mesh: Any) -> dict[str, Any]:
    return {f"w{t}": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Replicate()]) for t in range(TENSORS)}


def _flip_served(url: str, served: list) -> str:
    key, row = served[0]  # a stored chunk this process read and sent: (key path, chunk row)
    t = Repository(url).manifest(1).tensors[key]
    s = int(np.searchsorted(t.chunk_start, row, side="right")) - 1
    at = int(t.chunks.offset[row]) + 8  # inside that chunk's data
    with open(os.path.join(url, t.object_key(s)), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    return key


def load(args: dict) -> dict:
    rank = dist.get_rank()
    url = str(Path(args["workdir"]) / "repo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bt.save(url, {f"w{t}": _value(t) for t in range(TENSORS)}, step=1, save_rng=False)
    res: dict = {"rank": rank, "replicated_bytes": TENSORS * ROWS * COLS * 4}
    for name, coop in (("coop", True), ("independent", False), ("plain", True), ("default", None)):
        dist.barrier()
        target = _target(mesh) if name != "plain" else {f"w{t}": torch.zeros(ROWS, COLS) for t in range(TENSORS)}
        out = bt.load(url, target, step=1, cooperative=coop)
        exact = all(torch.equal(out[f"w{t}"].to_local() if name != "plain" else out[f"w{t}"], _value(t))
                    for t in range(TENSORS))
        res[name] = {"exact": exact, "bytes_read": out.bytes_read, "coop": out.cooperative}
    dist.barrier()
    if rank == 1:
        res["flipped"] = _flip_served(url, res["coop"]["coop"]["served"])
    dist.barrier()
    try:
        bt.load(url, _target(mesh), step=1, cooperative=True)
        res["corrupt"] = None
    except CheckpointError as e:
        res["corrupt"] = {"error": type(e).__name__, "key": e.key, "message": str(e)[:300]}
    return res


def dead_peer(args: dict) -> dict:
    """Rank 1 dies (``os._exit``) at the first data round's all-gather of a cooperative read, after
    the needs were gathered; rank 0, in gloo's all-gather, must get a typed error (issue 47 item 7),
    not gloo's RuntimeError. ``args["die"]`` False is the control: both read every box exactly."""
    import time

    from bridges.torch._share import TorchExchange
    from ckptfmt import Box
    from ckptfmt.reader import cooperative_reads

    rank = dist.get_rank()
    url = str(Path(args["workdir"]) / "repo")
    bt.save(url, {f"w{t}": _value(t) for t in range(TENSORS)}, step=1, save_rng=False)
    dist.barrier()

    class Dying(TorchExchange):
        def allgather(self, name: str, data: Any, sizes: Any) -> Any:
            if name == "restore/coop/0":
                os._exit(3)  # a process lost mid-restore: no goodbye to its peers
            return super().allgather(name, data, sizes)

    ex = Dying() if (rank == 1 and args.get("die")) else TorchExchange()
    reqs = [(f"w{t}", Box.full((ROWS, COLS))) for t in range(TENSORS)]
    t0 = time.monotonic()
    try:
        got = list(cooperative_reads(Repository(url).open(1), [reqs], ex))
        exact = all(torch.equal(torch.from_numpy(a), _value(t)) for t, a in enumerate(got[0]))
        return {"rank": rank, "error": None, "exact": exact}
    except Exception as e:  # noqa: BLE001 - the test looks at what rank 0 raised
        return {"rank": rank, "error": type(e).__name__, "typed": isinstance(e, CheckpointError),
                "object": getattr(e, "object", None), "message": str(e)[:300], "seconds": time.monotonic() - t0}
