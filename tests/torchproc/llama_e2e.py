"""The torch user's end-to-end run (issue 26 item 5), one gloo rank each (worker.py ``llama_e2e:<fn>``).

A tiny ``LlamaForCausalLM`` (``hf_configs.LLAMA``) with tensor parallelism (``parallelize_module``:
q/k/v/gate/up colwise, o/down rowwise) and FSDP2 (``fully_shard`` per decoder layer and at the
root) on a (dp, tp) mesh, AdamW and a StepLR scheduler, next-token loss on synthetic ids keyed
by the global sample position (a ``Stateful`` loader holds the position).

``train`` (4 ranks, (2, 2)): every SAVE_EVERY steps, ``bridges.torch.CheckpointManager.save``
into ``mgr`` (blocking), then ``dcp.async_save`` with ``CkptfmtStorageWriter`` into ``dcp`` (on
a gloo group of its own), which runs beside the next steps; it is waited for before the next
save (one ckptfmt save of a process at a time). Rank 0 logs each step's loss and batch ids, and
at every save step the digests of the whole state. At step KILL_AT rank 1 SIGKILLs itself, after
the step and before its saves: the other ranks' saves of that step start and can never commit.

``resume`` (2 ranks, (1, 2)): restores the newest committed step once per case and runs two
steps, reporting what ``ckptfmt_tools.receipt.judge`` compares: ``dcp`` (``dcp.load`` with
``CkptfmtStorageReader``), ``manager`` (``CheckpointManager.restore``), and two broken controls,
``no-loader`` (the loader's position not restored) and ``no-optim`` (AdamW left fresh). Rank 0
also writes the logits of the restored model on ``EVAL_IDS`` for the JAX side.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from bridges import torch as bt
from bridges.dcp import CkptfmtStorageReader, CkptfmtStorageWriter
from torchproc.hf_configs import EVAL_IDS, LLAMA

SAVE_EVERY, KILL_AT = 2, 6
N_SAMPLES, BATCH, SEQ = 64, 8, 16
_TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


class Loader:
    """The data position as a DCP ``Stateful``: the batch of a step is a function of it alone."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "samples": N_SAMPLES}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])

    def next_ids(self) -> list[int]:
        epoch, at = divmod(self.position, N_SAMPLES)
        self.position += BATCH
        return [int(i) for i in np.random.default_rng([7, epoch]).permutation(N_SAMPLES)[at:at + BATCH]]


def tokens(ids: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.random.default_rng([11, i]).integers(0, LLAMA["vocab_size"], SEQ + 1)
                                      for i in ids])).long()


class Job:
    """Model, optimizer, scheduler and loader on a (dp, tp) mesh; identical initial values everywhere."""

    def __init__(self, dp: int, tp: int) -> None:
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        self.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for layer in self.model.model.layers:
            parallelize_module(layer, self.mesh["tp"], _TP_PLAN)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(self.model, mesh=self.mesh["dp"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.7)
        self.loader = Loader()
        self.step = 0

    def train_step(self) -> tuple[float, list[int]]:
        ids = self.loader.next_ids()
        dp, r = self.mesh["dp"].size(), self.mesh["dp"].get_local_rank()
        x = tokens(ids[r * BATCH // dp:(r + 1) * BATCH // dp])
        logits = self.model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank of a dp group holds the same loss: the mean over dp groups
        return float(total) / dist.get_world_size(), ids

    def state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd, "sched": self.sched, "data": self.loader}

    def plain_state(self) -> dict[str, Any]:
        """What bridges.torch takes: the Stateful objects as their state dicts."""
        st = self.state()
        return dict(st, sched=self.sched.state_dict(), data=self.loader.state_dict())

    def digests(self) -> dict[str, str]:
        """A digest of every leaf of the live state, full tensors (collective)."""
        msd, osd = get_state_dict(self.model, self.opt)
        flat = {f"model/{k}": v for k, v in msd.items()}
        flat.update({f"optim/{k}/{n}": t for k, st in osd["state"].items() for n, t in st.items()})
        out = {}
        for key, t in sorted(flat.items()):
            a = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().numpy()
            out[key] = hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()[:24]
        for key, value in (("sched", self.sched.state_dict()), ("data", self.loader.state_dict()),
                           ("groups", [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]])):
            out[key] = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return out

    def logits(self) -> np.ndarray:
        with torch.no_grad():
            out = self.model(torch.from_numpy(EVAL_IDS).long()).logits
        return (out.full_tensor() if isinstance(out, DTensor) else out).numpy()


def train(args: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    job = Job(2, 2)
    save_pg = dist.new_group(backend="gloo")  # DCP's collectives, beside training's
    log = open(args["log"], "a", buffering=1) if rank == 0 else None
    pending = None
    # The manager saves blocking, then the DCP save runs beside the next steps: a process runs one
    # ckptfmt save at a time (their commits share the c10d store's client).
    with bt.CheckpointManager(args["mgr"], save_every_steps=SAVE_EVERY, async_save=False) as mgr:
        for _ in range(KILL_AT):
            loss, ids = job.train_step()
            if log:
                log.write(json.dumps({"step": job.step, "loss": loss, "ids": ids}) + "\n")
            if job.step % SAVE_EVERY:
                continue
            if pending is not None:
                pending.result()  # the previous DCP save is committed
            if job.step == KILL_AT:
                dist.barrier()  # every step is logged; rank 1 dies before its saves of this step start
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            digests = job.digests()
            if log:
                log.write(json.dumps({"saved": job.step, "digests": digests}) + "\n")
            mgr.save(job.step, job.plain_state())
            pending = dcp.async_save(job.state(), process_group=save_pg,
                                     storage_writer=CkptfmtStorageWriter(args["dcp"], step=job.step))
    raise AssertionError(f"rank {rank} is past step {KILL_AT}: rank 1 should have been killed")


def _restore(job: Job, case: str, args: dict[str, Any]) -> int:
    """Restore the newest committed step into ``job`` as ``case`` says; returns the step."""
    import ckptfmt

    if case == "manager":
        with bt.CheckpointManager(args["mgr"]) as mgr:
            got = mgr.restore(job.plain_state())
        st = got.state
        set_state_dict(job.model, job.opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
        job.sched.load_state_dict(st["sched"])
        job.loader.load_state_dict(st["data"])
        job.step = got.step
        return got.step
    state = job.state()
    if case == "no-loader":
        state.pop("data")
    if case == "no-optim":
        state.pop("optim")
    dcp.load(state, storage_reader=CkptfmtStorageReader(args["dcp"]))
    set_state_dict(job.model, job.opt, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", get_state_dict(job.model, job.opt)[1]))
    job.step = int(ckptfmt.Repository(args["dcp"]).latest())
    return job.step


def resume(args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in ("dcp", "manager", "no-loader", "no-optim"):
        job = Job(1, 2)
        step = _restore(job, case, args)
        r: dict[str, Any] = {"step": step, "digests": job.digests()}
        if case == "dcp" and dist.get_rank() == 0:
            np.save(Path(args["workdir"]) / "torch_logits.npy", job.logits())
        elif case == "dcp":
            job.logits()  # collective
        loss, ids = job.train_step()
        r.update(loss_k1=loss, batch_ids_k1=ids, loss_k2=job.train_step()[0])
        out[case] = r
    return out
