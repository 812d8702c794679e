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
