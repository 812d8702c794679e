"""The torch half of the JAX -> torch acceptance test (4 gloo ranks, DTensor Shard(0) weights).

Loads the checkpoint written by ``jax_side.py train`` with ``flax_nnx_to_torch()``, checks the
forward output and one more AdamW step against JAX's, runs the broken controls, then saves the
stepped state back with the mapping for ``jax_side.py restore``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from bridges import torch as bt
from bridges.mapping import Mapping, Rule, flax_nnx_to_torch, torch_adamw_kwargs
from ckptfmt.errors import CheckpointError

VOCAB, D, OUT, SEQ, TRAIN_STEPS = 50, 32, 16, 6, 3  # as in jax_side.py
HP = dict(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
#: one more AdamW step, torch vs optax, max |delta param| and |delta moment|; see MAPPING.md.
STEP_ATOL = 1e-6


class TorchNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.norm = torch.nn.LayerNorm(D, eps=1e-5)
        self.fc1 = torch.nn.Linear(D, D)
        self.fc2 = torch.nn.Linear(D, OUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(self.embed(ids)))))


def data(seed: int, batch: int) -> tuple[np.ndarray, np.ndarray]:  # == jax_side.data
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int32),
            rng.standard_normal((batch, SEQ, OUT)).astype(np.float32))


def sharded_net(seed: int, mesh: Any) -> TorchNet:
    """Large weights Shard(0) (embedding rows 13,13,13,11 on 4 ranks); small ones Replicate."""
    torch.manual_seed(seed)
    net = TorchNet()
    for mod in net.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            placements = [Shard(0)] if p.ndim == 2 else [Replicate()]
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, mesh, placements)))
    return net


def gathered(net: TorchNet) -> TorchNet:
    """A plain replica of ``net`` with full weights (collective: every rank calls it)."""
    plain = TorchNet()
    with torch.no_grad():
        for (name, p), (_, q) in zip(net.named_parameters(), plain.named_parameters()):
            q.copy_(p.full_tensor() if isinstance(p, DTensor) else p)
    return plain


def full(sd: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(full(v, key))
        elif isinstance(v, torch.Tensor):
            out[key] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()
    return out


def forward_err(net: TorchNet, ids: np.ndarray, y_ref: np.ndarray) -> float:
    with torch.no_grad():
        y = gathered(net)(torch.from_numpy(ids).long()).numpy()
    return float(np.abs(y - y_ref).max())


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _local_nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    la = a.to_local() if isinstance(a, DTensor) else a
    lb = b.to_local() if isinstance(b, DTensor) else b
    return bool(torch.equal(la, lb))


def accept_load(args: dict[str, Any]) -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref = dict(np.load(args["jax_npz"]))
    net = sharded_net(5, mesh)
    mapping = flax_nnx_to_torch(layers=bt.layer_kinds(net))
    res: dict[str, Any] = {"generic_mapping": False}
    opt = torch.optim.AdamW(net.parameters(), **torch_adamw_kwargs(**HP))
    msd, osd = get_state_dict(net, opt)
    before = full({"model": msd, "optim": osd})

    # Broken control: one target shape is wrong -> CheckpointError naming it, nothing loaded.
    bad = dict(msd, **{"fc2.weight": distribute_tensor(torch.zeros(OUT, D - 1), mesh, [Shard(0)])})
    try:
        bt.load(args["url"], {"model": bad, "optim": osd}, mapping=mapping)
        res["bad_shape"] = "no error"
    except CheckpointError as e:
        res["bad_shape"] = [type(e).__name__, e.key]
    after_bad = full(dict(zip(("model", "optim"), get_state_dict(net, opt))))
    res["unchanged_after_bad"] = sorted(before) == sorted(after_bad) and all(
        np.array_equal(before[k], after_bad[k]) for k in before)

    t0 = time.perf_counter()
    loaded = bt.load(args["url"], {"model": msd, "optim": osd}, mapping=mapping)
    res["load_s"] = time.perf_counter() - t0
    res["bytes_read"] = loaded.bytes_read
    res["local_bytes"] = sum(_local_nbytes(v) for v in _leaves({"model": msd, "optim": osd}))
    # The generic mapping (no layer kinds) resolves the same keys on load.
    g = bt.load(args["url"], {"model": msd, "optim": osd}, mapping=flax_nnx_to_torch())
    res["generic_mapping"] = all(_same(g["model"][k], loaded["model"][k]) for k in msd)
    res["placements"] = {k: str(v.placements) for k, v in loaded["model"].items()}
    set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    res["forward_err"] = forward_err(net, ref["eval_ids"], ref["y_ref"])

    # Broken control: the same mapping without the fc1 transpose (fc1 is square, so it loads).
    broken = Mapping((Rule("model/fc1/kernel", "model/fc1.weight"),), source_sep="/", target_sep=".") + mapping
    net2 = sharded_net(6, mesh)
    lb = bt.load(args["url"], {"model": get_model_state_dict(net2)}, mapping=broken, strict=False)
    set_model_state_dict(net2, lb["model"])
    res["broken_forward_err"] = forward_err(net2, ref["eval_ids"], ref["y_ref"])
    res["broken_unexpected"] = len(lb.unexpected_keys)

    # One more step: grads from a gathered replica, then torch AdamW on the DTensor parameters.
    ids, y = data(TRAIN_STEPS, 8)
    plain = gathered(net)
    loss = ((plain(torch.from_numpy(ids).long()) - torch.from_numpy(y)) ** 2).mean()
    loss.backward()
    grads = dict((n, p.grad) for n, p in plain.named_parameters())
    for n, p in net.named_parameters():
        p.grad = distribute_tensor(grads[n], mesh, p.placements, src_data_rank=None)
    opt.step()
    msd2, osd2 = get_state_dict(net, opt)
    got = full({"model": msd2, "optim": osd2})
    src_keys = {k.split("|", 1)[1] for k in ref if k.startswith("after|")}
    errs: dict[str, float] = {}
    for key, value in got.items():
        r = mapping.resolve(key, value.ndim, src_keys)
        want = r.to_target(ref["after|" + r.source_key])
        errs[key] = float(np.abs(value.astype(np.float64) - want.astype(np.float64)).max())
    res["step_errs"] = errs
    res["torch_step"] = float(osd2["state"]["fc1.weight"]["step"])

    # torch -> JAX: save the stepped state in the JAX layout (same mapping, reversed on write).
    bt.save(args["out_url"], {"model": msd2, "optim": osd2}, step=TRAIN_STEPS + 1, mapping=mapping)
    if dist.get_rank() == 0:
        out = {}
        for key, value in got.items():
            r = mapping.resolve_unique(key, value.ndim)
            inv = None if r.axes is None else tuple(r.axes.index(d) for d in range(len(r.axes)))
            out[r.source_key.replace("/", "|")] = value if inv is None else value.transpose(inv)
        np.savez(Path(args["workdir"]) / "torch_after.npz", **out)
    return res
