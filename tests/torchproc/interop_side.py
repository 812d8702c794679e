"""Torch ranks of the interop acceptance tests (tests/test_interop.py), run by worker.py as
``interop_side:<function>``.

* :func:`dcp_save` (8 ranks): a state dict of DTensors (``Shard(0)``, an uneven bfloat16
  ``Shard(1)``) and plain tensors, saved with ``torch.distributed.checkpoint.save``.
* :func:`load_dcp` (4 ranks): the ckptfmt step imported from it, loaded with ``bridges.torch.load``
  into other placements (``Shard(1)``, ``Shard(0)``, ``Replicate()``): bit for bit.
* :func:`load_hf` (2 ranks): the step imported from ``save_pretrained``'s directory, loaded into
  zeroed tensors of the model's state dict with the tensor-parallel placements of
  ``hf_side.TP`` (DTensors): bit for bit against the files as the reference ``safetensors``
  reader reads them. (No ``transformers`` in the ranks: importing it costs each run seconds.)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import safetensors.torch  # noqa: F401  (imported once, before the fork)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from bridges import torch as bt

def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {"w": torch.randn(64, 32, generator=g), "e": torch.randn(10, 20, generator=g).to(torch.bfloat16),
            "b": torch.randn(32, generator=g), "i": torch.arange(7, dtype=torch.int64) * 3}


def dcp_save(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                       "e": distribute_tensor(full["e"], mesh, [Shard(1)]),  # 20 columns over 8: torch.chunk, uneven
                       "b": full["b"], "i": full["i"]}, "step": 5}
    dcp.save(state, checkpoint_id=args["dcp"])
    return {"ok": True}


def _bits(t: torch.Tensor) -> bytes:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def load_dcp(args: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    target = {"model": {"w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(1)]),
                        "e": distribute_tensor(torch.zeros_like(full["e"]), mesh, [Shard(0)]),
                        "b": distribute_tensor(torch.zeros_like(full["b"]), mesh, [Replicate()]),
                        "i": torch.zeros_like(full["i"])}}
    out = bt.load(args["url"], target)
    same = {k: _bits(out["model"][k]) == _bits(v) and out["model"][k].dtype == v.dtype for k, v in full.items()}
    return {"same": same, "bytes_read": out.bytes_read}


def load_hf(args: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from torchproc.hf_side import TP

    want: dict[str, torch.Tensor] = {}
    for f in sorted(Path(args["hf"]).glob("model-*.safetensors")):
        want.update(safetensors.torch.load_file(str(f)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = {}
    for k, v in want.items():
        dim = next((d for suffix, d in TP["llama"].items() if k.endswith(suffix)), None)
        zeros = torch.zeros_like(v)
        target[k] = distribute_tensor(zeros, mesh, [Shard(dim)]) if dim is not None else zeros
    out = bt.load(args["url"], {"model": target})
    differ = sorted(k for k, v in want.items() if _bits(out["model"][k]) != _bits(v) or out["model"][k].dtype != v.dtype)
    sharded = sum(isinstance(v, DTensor) for v in out["model"].values())
    return {"differ": differ, "keys": len(want), "sharded": sharded, "bytes_read": out.bytes_read}
