"""The torch ranks of the Mixtral expert-parallel load (tests/test_hf_presets_families.py):
scenario ``hf_moe_side:moe_ep`` (see worker.py), 2 gloo ranks."""
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


def _save_split(url: str, params: dict[str, np.ndarray], mesh: Any) -> None:
    """Both ranks save ``params`` (the NNX layout) split per :data:`JAX_EP`."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from bridges import torch as bt

    root: dict = {}
    for key, a in params.items():
        node = root
        *parts, last = f"model/{key}".split("/")
        for part in parts:
            node = node.setdefault(part, {})
        dim = JAX_EP.get(key)
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
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from bridges import torch as bt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = tf.MixtralConfig(**args["config"])
    torch.manual_seed(7)
    model = tf.MixtralForCausalLM(config).eval()
    for mod_name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False)):
            dim = next((d for s, d in EP.items() if f"{mod_name}.{pname}".endswith(s)), None)
            placement = [Shard(dim)] if dim is not None else [Replicate()]
            mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.data, mesh, placement)))
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
