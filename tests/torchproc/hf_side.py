"""The torch half of the Hugging Face acceptance tests: HF models from the tiny configs, tensor-
parallel placements, and the 4-rank gloo scenario ``hf_tp`` (see worker.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from bridges import presets
from torchproc.hf_configs import EVAL_IDS, GPT2, LLAMA

#: Megatron-style tensor parallelism: column-parallel Shard(0) of nn.Linear weights (out, in),
#: row-parallel Shard(1); GPT-2's Conv1D weights are (in, out), so the dims swap.
TP = {
    "llama": {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
              "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "self_attn.o_proj.weight": 1,
              "mlp.down_proj.weight": 1},
    "gpt2": {"attn.c_attn.weight": 1, "attn.c_attn.bias": 0, "attn.c_proj.weight": 0, "mlp.c_fc.weight": 1,
             "mlp.c_fc.bias": 0, "mlp.c_proj.weight": 0},
}


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised HF model of the tiny config (eval mode: no dropout)."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).eval()
    return tf.GPT2LMHeadModel(tf.GPT2Config(**GPT2)).eval()


def preset(name: str, **kw: Any) -> Any:
    return presets.hf_llama_from_nnx(LLAMA, **kw) if name == "llama" else presets.hf_gpt2_from_nnx(GPT2, **kw)


def logits(model: torch.nn.Module, ids: np.ndarray = EVAL_IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


def tp_shard(model: torch.nn.Module, mesh: Any, name: str) -> None:
    """Every parameter becomes a DTensor: TP placements per :data:`TP`, Replicate otherwise (tied
    parameters stay tied)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    params: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, pname))
            params.setdefault(id(p), (f"{mod_name}.{pname}", p))
    for pid, (fqn, p) in params.items():
        dim = next((d for suffix, d in TP[name].items() if fqn.endswith(suffix)), None)
        placement = [Shard(dim)] if dim is not None else [Replicate()]
        new = torch.nn.Parameter(distribute_tensor(p.data, mesh, placement))
        for mod, pname in owners[pid]:
            mod.register_parameter(pname, new)


def gathered(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A plain replica with full weights (collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    plain = hf_model(name)
    plain.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()})
    return plain


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def local_nbytes(tree: Any, replicated: bool | None = None) -> int:
    """Bytes of this rank's local blocks, each storage once (a tied head shares the embedding's);
    ``replicated``: only the tensors held whole (True) or only the sharded ones (False)."""
    from torch.distributed.tensor import DTensor, Shard

    seen: dict[int, int] = {}
    for t in _leaves(tree):
        sharded = isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)
        if replicated is not None and sharded == replicated:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.data_ptr()] = max(seen.get(local.data_ptr(), 0), local.numel() * local.element_size())
    return sum(seen.values())


def hf_tp(args: dict[str, Any]) -> dict[str, Any]:
    """4 ranks: each model loads with TP placements; logits of the gathered model; bytes read."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from bridges import torch as bt

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    res: dict[str, Any] = {}
    for name in ("llama", "gpt2"):
        model = hf_model(name, seed=5)
        tp_shard(model, mesh, name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        loaded = bt.load(str(Path(args["workdir"]) / name), target, mapping=preset(name))
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        out = logits(gathered(model, name))
        if rank == 0:
            np.save(Path(args["workdir"]) / f"tp_logits_{name}.npy", out)
        placements = {k: str(v.placements) for k, v in loaded["model"].items() if k in
                      (f"model.layers.0.{s}" if name == "llama" else f"transformer.h.0.{s}" for s in TP[name])}
        res[name] = {"bytes_read": loaded.bytes_read, "local_bytes": local_nbytes(target),
                     "sharded_bytes": local_nbytes(target, replicated=False),
                     "replicated_bytes": local_nbytes(target, replicated=True),
                     "objects_read": loaded.objects_read, "placements": placements}
    return res
