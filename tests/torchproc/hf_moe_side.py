"""The torch ranks of the tensor- and expert-parallel preset loads (tests/test_hf_presets_families.py):
scenarios ``hf_moe_side:moe_ep`` (Mixtral) and ``hf_moe_side:families_tp`` (Qwen3, Gemma 2,
Qwen2-MoE in one launch), 2 gloo ranks (see worker.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from bridges.presets import hf_mixtral_from_nnx
from torchproc.hf_side import local_nbytes

#: Expert parallelism for the experts (Shard(0): each rank holds E / world experts), tensor
#: parallelism for attention (q/k/v column-parallel, o row-parallel); the rest replicated.
EP = {"mlp.experts.gate_up_proj": 0, "mlp.experts.down_proj": 0, "self_attn.q_proj.weight": 0,
      "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0, "self_attn.o_proj.weight": 1}


#: The same split of the JAX-layout arrays (experts (L, E, ...) on axis 1, heads of q/k/v/o), as a
#: JAX expert/tensor-parallel job would save them.
JAX_EP = {"layers/moe/gate/kernel": 1, "layers/moe/up/kernel": 1, "layers/moe/down/kernel": 1,
          "layers/attn/q/kernel": 2, "layers/attn/k/kernel": 2, "layers/attn/v/kernel": 2, "layers/attn/o/kernel": 1}


def _save_split(url: str, params: dict[str, np.ndarray], mesh: Any, split: dict[str, int] = JAX_EP) -> None:
    """Both ranks save ``params`` (the NNX layout) split per ``split`` (key -> axis)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from bridges import torch as bt

    root: dict = {}
    for key, a in params.items():
        node = root
        *parts, last = f"model/{key}".split("/")
        for part in parts:
            node = node.setdefault(part, {})
        dim = split.get(key)
        node[last] = distribute_tensor(torch.from_numpy(a), mesh, [Shard(dim)] if dim is not None else [Replicate()])
    bt.save(url, root, step=1)


def moe_ep(args: dict[str, Any]) -> dict[str, Any]:
    """Both ranks save the NNX-layout arrays of ``args["params"]`` (an .npz) split per
    :data:`JAX_EP`, then load them into a Mixtral whose parameters are DTensors placed
    per :data:`EP`; rank 0 writes the gathered weights (``ep_state.npz``) and their logits
    (``ep_logits.npy``)."""
    import torch.distributed as dist
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from bridges import torch as bt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = tf.MixtralConfig(**args["config"])
    torch.manual_seed(7)
    model = tf.MixtralForCausalLM(config).eval()
    _distribute(model, mesh, EP)
    url = str(Path(args["workdir"]) / "split")
    _save_split(url, dict(np.load(args["params"])), mesh)
    target = {"model": model.state_dict()}
    loaded = bt.load(url, target, mapping=hf_mixtral_from_nnx(config, optimizer=None))
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in loaded["model"].items()}
    plain = tf.MixtralForCausalLM(config).eval()
    plain.load_state_dict(full)
    if dist.get_rank() == 0:
        with torch.no_grad():
            out = plain(torch.from_numpy(np.asarray(args["ids"])).long()).logits.numpy()
        np.save(Path(args["workdir"]) / "ep_logits.npy", out)
        np.savez(Path(args["workdir"]) / "ep_state.npz", **{k: v.numpy() for k, v in full.items()})
    return {"bytes_read": loaded.bytes_read, "local_bytes": local_nbytes(target),
            "sharded_bytes": local_nbytes(target, replicated=False), "objects_read": loaded.objects_read,
            "placements": sorted({str(v.placements) for v in loaded["model"].values() if isinstance(v, DTensor)})}


#: Tensor parallelism of the dense families (heads of q/k/v and their biases, ffn of the MLPs and
#: of Qwen2-MoE's shared expert; o and down row-parallel) and expert parallelism of Qwen2-MoE's
#: experts; torch FQN suffix -> Shard dim. Embeddings, norms and routers replicated.
TP = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0, "k_proj.bias": 0,
      "v_proj.bias": 0, "o_proj.weight": 1, "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1,
      "experts.gate_up_proj": 0, "experts.down_proj": 0}
#: The same split of the NNX-layout arrays.
JAX_TP = {"layers/attn/q/kernel": 2, "layers/attn/k/kernel": 2, "layers/attn/v/kernel": 2, "layers/attn/q/bias": 1,
          "layers/attn/k/bias": 1, "layers/attn/v/bias": 1, "layers/attn/o/kernel": 1, "layers/mlp/gate/kernel": 2,
          "layers/mlp/up/kernel": 2, "layers/mlp/down/kernel": 1, "layers/moe/shared/gate/kernel": 2,
          "layers/moe/shared/up/kernel": 2, "layers/moe/shared/down/kernel": 1, "layers/moe/gate/kernel": 1,
          "layers/moe/up/kernel": 1, "layers/moe/down/kernel": 1}


def _distribute(model: Any, mesh: Any, table: dict[str, int]) -> None:
    """Every parameter of ``model`` a DTensor: Shard(dim) where its FQN ends with a key of
    ``table``, replicated otherwise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for mod_name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            dim = next((d for s, d in table.items() if f"{mod_name}.{pname}".endswith(s)), None)
            placement = [Shard(dim)] if dim is not None else [Replicate()]
            mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.data, mesh, placement)))


def families_tp(args: dict[str, Any]) -> dict[str, Any]:
    """For each of ``args["families"]`` ({family, config class, model class, config, params}):
    both ranks save the NNX-layout arrays split per :data:`JAX_TP`, then load them through the
    family's preset into its model with parameters placed per :data:`TP`; rank 0 writes the
    gathered model's logits (``<family>_tp_logits.npy``). Per family: bytes read, the rank's
    local bytes (its share) and the sharded part of them."""
    import torch.distributed as dist
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from bridges import presets
    from bridges import torch as bt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for job in args["families"]:
        family, work = job["family"], Path(args["workdir"])
        config = getattr(tf, job["config_cls"])(**job["config"], attn_implementation="eager")
        torch.manual_seed(7)
        model = getattr(tf, job["model_cls"])(config).eval()
        _distribute(model, mesh, TP)
        url = str(work / f"{family}_split")
        _save_split(url, dict(np.load(job["params"])), mesh, JAX_TP)
        target = {"model": model.state_dict()}
        loaded = bt.load(url, target, mapping=getattr(presets, f"hf_{family}_from_nnx")(config, optimizer=None))
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in loaded["model"].items()}
        if dist.get_rank() == 0:
            plain = getattr(tf, job["model_cls"])(config).eval()
            plain.load_state_dict(full)
            with torch.no_grad():
                np.save(work / f"{family}_tp_logits.npy",
                        plain(torch.from_numpy(np.asarray(args["ids"])).long()).logits.numpy())
        out[family] = {"bytes_read": loaded.bytes_read, "local_bytes": local_nbytes(target),
                       "sharded_bytes": local_nbytes(target, replicated=False), "objects_read": loaded.objects_read,
                       "unmatched": loaded.report.missing + loaded.report.unexpected}
    return out
