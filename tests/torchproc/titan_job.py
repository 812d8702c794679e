"""A torchtitan training loop on gloo ranks, checkpointed by ``bridges.torchtitan``.

torchtitan 0.3.0's ``Trainer`` cannot run on this machine's CPU build: importing any of its models
(``torchtitan.models.common`` -> ``token_dispatcher`` -> ``distributed.minimal_async_ep``) imports
``triton``, a GPU compiler package, and the trainer also needs tensorboard, wandb, ``datasets`` and
the tokenizer and dataset assets of its source tree. So the loop here composes the components the
trainer composes: torchtitan's ``OptimizersContainer`` (AdamW, flattened FQN-keyed state),
``LRSchedulersContainer`` and our :class:`CkptfmtCheckpointManager` (its ``CheckpointManager``),
driving a Llama 3 with torchtitan's parameter names and math (interleaved complex rotary, as
``ComplexRoPE``) under FSDP2 over tensor parallelism on a (dp, tp) gloo mesh.

``train``: N steps, saved every ``interval`` through the manager; rank 0 writes the model's logits
on EVAL ids after training (``logits.npy``). ``resume``: a fresh model and manager load the
latest step and the parameters equal the trained ones (``resumed.npy`` holds the same logits).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0)
EVAL_IDS = [[3, 17, 40, 5, 88, 21, 9, 60, 33, 2, 71, 14]]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class _QKV(nn.Module):
    def __init__(self, d: int, h: int, kv: int, hd: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False), nn.Linear(
            d, kv * hd, bias=False)


def _weight(n: int) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.ones(n))
    return m


class Attention(nn.Module):
    """Llama 3's attention (interleaved complex rotary), or with ``c["qwen3"]`` Qwen3's: per-head
    q/k RMSNorms (``attention.q_norm`` / ``k_norm``) and split-halves rotary (``CosSinRoPE``)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd, self.rep, self.eps, self.qwen3 = d // h, h // kv, c["rms_norm_eps"], bool(c.get("qwen3"))
        self.qkv_linear = _QKV(d, h, kv, self.hd)
        self.wo = nn.Linear(h * self.hd, d, bias=False)
        if self.qwen3:
            self.q_norm, self.k_norm = _weight(self.hd), _weight(self.hd)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # heads are -1: under tensor parallelism each rank holds its own heads
        q = self.qkv_linear.wq(x).view(b, t, -1, self.hd)
        k = self.qkv_linear.wk(x).view(b, t, -1, self.hd)
        v = self.qkv_linear.wv(x).view(b, t, -1, self.hd)
        if self.qwen3:
            q, k = _rms(q, self.q_norm.weight, self.eps), _rms(k, self.k_norm.weight, self.eps)

        def rot(u: torch.Tensor) -> torch.Tensor:
            if self.qwen3:  # split halves
                cos, sin = freqs.real[None, :, None, :], freqs.imag[None, :, None, :]
                a, c2 = u[..., :self.hd // 2], u[..., self.hd // 2:]
                return torch.cat([a * cos - c2 * sin, c2 * cos + a * sin], -1)
            uc = torch.view_as_complex(u.float().reshape(*u.shape[:-1], -1, 2))  # torchtitan's ComplexRoPE
            return torch.view_as_real(uc * freqs[None, :, None, :]).flatten(3).to(u.dtype)

        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(self.rep, dim=2), v.repeat_interleave(self.rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.eps = c["rms_norm_eps"]
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c["hidden_size"], c["intermediate_size"])
        self.attention_norm, self.ffn_norm = _weight(c["hidden_size"]), _weight(c["hidden_size"])

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(_rms(x, self.attention_norm.weight, self.eps), freqs)
        return x + self.feed_forward(_rms(x, self.ffn_norm.weight, self.eps))


class Llama3(nn.Module):
    """torchtitan's Llama 3 parameter names (``Llama3StateDictAdapter.from_hf_map``) and math; with
    ``c["qwen3"]``, its Qwen3 (``Qwen3StateDictAdapter``: the same names plus the q/k norms)."""

    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c["num_hidden_layers"])})
        self.norm = _weight(c["hidden_size"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hd = self.c["hidden_size"] // self.c["num_attention_heads"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.polar(torch.ones(ids.shape[1], hd // 2), torch.outer(torch.arange(ids.shape[1]).float(), inv))
        x = self.tok_embeddings(ids)
        for layer in self.layers.values():
            x = layer(x, freqs)
        return self.lm_head(_rms(x, self.norm.weight, self.c["rms_norm_eps"]))


def _parallel(model: Llama3, dp: int, tp: int) -> Any:
    """FSDP2 over tensor parallelism, as torchtitan's ``parallelize_llama`` applies them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    for layer in model.layers.values():
        parallelize_module(layer, mesh["tp"], {
            "attention.qkv_linear.wq": ColwiseParallel(), "attention.qkv_linear.wk": ColwiseParallel(),
            "attention.qkv_linear.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


class TrainState:
    """torchtitan's ``train_state`` (a ``Stateful``): the step and the tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


def _components(args: dict[str, Any], seed: int) -> tuple[Llama3, Any, Any, Any, TrainState]:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from bridges.torchtitan import CkptfmtCheckpointManager

    torch.manual_seed(seed)
    model = Llama3(CFG)
    _parallel(model, args["dp"], args["tp"])
    opt = OptimizersContainer.Config(implementation="for-loop", param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW",
        optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})]).build(
        model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=args["steps"])
    ts = TrainState()
    mgr = CkptfmtCheckpointManager.Config(enable=True, folder="ckpt", interval=args["interval"], keep_latest_k=0,
                                          last_save_model_only=False,
                                          async_mode=args.get("async_mode", "disabled")).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={"train_state": ts},
        sd_adapter=None, base_folder=args["workdir"])
    return model, opt, sched, mgr, ts


def _logits(model: Llama3) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(EVAL_IDS)).float().numpy()


def _full(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy()
            for k, v in model.state_dict().items()}


def train(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, sched, mgr, ts = _components(args, seed=0)
    g = torch.Generator().manual_seed(1)  # the same batches on every rank (one data-parallel batch)
    losses = []
    for step in range(1, args["steps"] + 1):
        ids = torch.randint(0, CFG["vocab_size"], (2, 16), generator=g)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ts.step, ts.ntokens_seen = step, ts.ntokens_seen + ids.numel()
        losses.append(float(loss))
        mgr.save(step, last_step=step == args["steps"])
    mgr.maybe_wait_for_saving()
    logits = _logits(model)
    full = _full(model)
    if dist.get_rank() == 0:
        np.save(Path(args["workdir"]) / "logits.npy", logits)
        np.savez(Path(args["workdir"]) / "params.npz", **full)
    mgr.close()
    return {"losses": losses}


def resume(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt, sched, mgr, ts = _components(args, seed=123)  # other initial values: the load must replace them
    assert mgr.load()
    full = _full(model)
    trained = np.load(Path(args["workdir"]) / "params.npz")
    differ = sorted(k for k in trained.files if not np.array_equal(trained[k], full[k]))
    logits = _logits(model)
    if dist.get_rank() == 0:
        np.save(Path(args["workdir"]) / "resumed.npy", logits)
    mgr.close()
    return {"step": ts.step, "ntokens_seen": ts.ntokens_seen, "differ": differ,
            "lr": [g["lr"] for o in opt.optimizers for g in o.param_groups][:1]}


def hf_config(qwen3: bool = False) -> Any:
    """The HF ``LlamaConfig`` (``Qwen3Config``) of :data:`CFG` (torchtitan's rotary base and norm epsilon)."""
    import transformers

    c = dict(CFG)
    theta = c.pop("rope_theta")
    return (transformers.Qwen3Config if qwen3 else transformers.LlamaConfig)(**c, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": theta},
                                    max_position_embeddings=64, head_dim=c["hidden_size"] // c["num_attention_heads"],
                                    attn_implementation="eager")

