"""The torch replacement of the drill: ``world`` gloo ranks load the JAX checkpoint and take one step.

A zygote imports torch once and forks the ranks (as torchrun's agent starts workers; forking after
the import saves each rank the seconds the import costs). Each rank:

1. joins the gloo process group and builds the torch twin of ``ckptfmt_tools.training.MLP``
   (``Linear -> ReLU -> Linear``; the drill trains the JAX job without dropout for this variant,
   since torch cannot reproduce JAX's threefry dropout masks), with the 2-D weights as DTensors
   ``Shard(0)`` over a 1-D device mesh, and ``torch.optim.AdamW`` with optax's hyperparameters;
2. loads the newest committed step through ``bridges.torch.load`` with
   ``bridges.mapping.flax_nnx_to_torch`` (kernel (in, out) -> weight (out, in); adamw mu/nu/count ->
   exp_avg/exp_avg_sq/step), each rank reading only its own boxes;
3. validates: the reconstructed tensors, permuted back to the JAX layout, hash to the sha256
   saved with the step, and the optimizer step count equals the saved count;
4. runs exactly one step on the batch at the saved data cursor (global norm clipping and the
   warmup-cosine learning rate as optax computes them), and reports its loss and batch ids;
5. runs the rejected control: every rank loads a copy of the step with one shard object deleted;
   the ranks agree (all-reduce) whether every load succeeded before anything is applied.

usage: python -m ckptfmt_tools.drill._torch_job --url URL --out PATH --world N [--rejected-control URL]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

T_START = time.time()

#: Loss of the resumed step, torch vs the JAX run, relative. The parameters are bit-identical;
#: the forward differs only in kernels and summation order (XLA's dot vs torch's sgemm, over
#: ``d_in`` and ``hidden`` terms in float32, unit roundoff 6e-8): a few hundred ulps at most.
TORCH_LOSS_RTOL = 1e-5
#: Loss after the torch AdamW step vs the JAX run's next loss: informative (the update passes
#: through sqrt and division of moments near zero, where float32 rounding differs more).
TORCH_NEXT_LOSS_RTOL = 1e-4
#: Checkpoint keys the torch twin has no use for (dropout RNG, loss scale, the step counter
#: kept as a bridge leaf, the schedule's own count, which equals adam's count).
IGNORED = ("optimizer/step", "aux_key", "loss_scale/*", "model/drop/*", "optimizer/opt_state/1/2/count")
ADAM_PREFIX = "optimizer/opt_state/1/0"


# ------------------------------------------------------- the data pipeline (numpy, as in JAX)
# The same arithmetic as ckptfmt_tools.training.dataset / batch_ids (that module imports jax). The
# receipt compares the batch ids and the loss with the JAX run, so any divergence fails it.

def dataset(cfg: dict[str, Any]) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(cfg["data_seed"])
    x = rng.standard_normal((cfg["n_samples"], cfg["d_in"]), dtype=np.float32)
    w = rng.standard_normal((cfg["d_in"], cfg["d_out"]), dtype=np.float32) / np.sqrt(cfg["d_in"])
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((cfg["n_samples"], cfg["d_out"]), dtype=np.float32)
    return x, y.astype(np.float32)


def batch_ids(cursor: dict[str, int], cfg: dict[str, Any]) -> Any:
    import numpy as np

    pos = cursor["position"] + np.arange(cfg["global_batch"])
    epochs, within = pos // cfg["n_samples"], pos % cfg["n_samples"]
    out = np.empty(cfg["global_batch"], dtype=np.int64)
    for e in np.unique(epochs):
        perm = np.random.default_rng([cursor["shuffle_seed"], int(e)]).permutation(cfg["n_samples"])
        sel = epochs == e
        out[sel] = perm[within[sel]]
    return out


def learning_rate(count: int, cfg: dict[str, Any]) -> float:
    """optax.warmup_cosine_decay_schedule(0, lr, warmup, total_steps) at ``count``."""
    peak, warm, total = cfg["lr"], cfg["warmup"], cfg["total_steps"]
    if count < warm:
        return peak * count / warm
    decay = total - warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(count - warm, decay) / decay))


def digest(a: Any) -> str:
    """The sha256 recipe of ckptfmt_tools.training.digest_tree (dtype name, shape, bytes)."""
    import numpy as np

    a = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------- one rank


def _rank_main(args: argparse.Namespace, rank: int, times: dict[str, float]) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from bridges import torch as bt
    from bridges.mapping import flax_nnx_to_torch, torch_adamw_kwargs
    from ckptfmt import Repository

    torch.set_num_threads(1)
    # drill --tiers --elastic: one local tier directory per surviving machine ("{rank}": this rank's)
    args.local = args.local.replace("{rank}", str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    t_ready = time.time()

    # -- job setup: the torch twin, sharded, with its optimizer and restore target -------------
    mesh = init_device_mesh("cpu", (world,))
    repo = Repository(args.url)
    # The job's hyperparameters come from the checkpoint (the JAX run saved its Config in extra).
    k = torch.tensor([repo.latest() if rank == 0 else -1], dtype=torch.int64)
    dist.broadcast(k, 0)
    step = int(k.item())
    ckpt = repo.open(step)
    gstate = ckpt.state()
    t_manifest = time.time()
    cfg = gstate["extra"]["config"]
    saved_digests = gstate["extra"]["digests"]
    leaves = gstate["bridge"]["leaves"]
    cursor = {"position": int(leaves["data/position"]), "epoch": int(leaves["data/epoch"]),
              "shuffle_seed": int(leaves["data/shuffle_seed"])}

    class Twin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = torch.nn.Linear(cfg["d_in"], cfg["hidden"])
            self.l2 = torch.nn.Linear(cfg["hidden"], cfg["d_out"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.relu(self.l1(x)))

    net = Twin()
    for mod in net.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            placements = [Shard(_shard_dim(mod, net, args))] if p.ndim == 2 else [Replicate()]
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, mesh, placements)))
    opt = torch.optim.AdamW(net.parameters(), **torch_adamw_kwargs(learning_rate=cfg["lr"],
                                                                    weight_decay=cfg["weight_decay"]))
    msd, osd = get_state_dict(net, opt)
    target = {"model": msd, "optim": osd}
    mapping = flax_nnx_to_torch(optimizer=(ADAM_PREFIX, "optim/state"), layers=bt.layer_kinds(net),
                                ignore=IGNORED)
    t_setup = time.time()

    # -- restore --------------------------------------------------------------------------------
    tiers: dict[str, Any] = {}
    if args.local:  # drill --tiers: the torch manager restores through the JAX job's local tiers
        loaded, tiers = _restore_tiers(args, target, mapping)
        step, saved_digests = loaded.step, loaded.extra["digests"]
        cursor = {k: int(v) for k, v in loaded.extra["cursor"].items()}
    else:
        loaded = bt.load(args.url, target, step=step, mapping=mapping)
    t_restored = time.time()

    # -- validation: reconstructed hashes (in the JAX layout) vs the hashes saved with the step ---
    def full(v: Any) -> Any:
        return (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy()

    flat: dict[str, Any] = {}
    for key, v in loaded["model"].items():
        flat[f"model/{key}"] = v
    for fqn, slots in loaded["optim"]["state"].items():
        for slot, v in slots.items():
            flat[f"optim/state/{fqn}/{slot}"] = v
    checked, differ, counts = 0, [], set()
    for key, v in sorted(flat.items()):
        if key.endswith("/step"):
            counts.add(float(v))
            continue
        r = mapping.resolve_unique(key, v.ndim)
        a = full(v)
        if r.axes is not None:
            a = a.transpose(tuple(r.axes.index(d) for d in range(len(r.axes))))
        checked += 1
        if saved_digests.get(r.source_key) != digest(a):
            differ.append(r.source_key)
    saved_count = _saved_count(args, step) if args.local else int(ckpt.read(f"{ADAM_PREFIX}/count"))
    if counts != {float(saved_count)}:
        differ.append(f"{ADAM_PREFIX}/count")
    set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    t_valid = time.time()

    # -- exactly one step -------------------------------------------------------------------------
    x_all, y_all = dataset(cfg)
    ids = batch_ids(cursor, cfg)
    x, y = torch.from_numpy(x_all[ids]), torch.from_numpy(y_all[ids])
    plain = Twin()
    with torch.no_grad():
        for (_, p), (_, q) in zip(net.named_parameters(), plain.named_parameters()):
            q.copy_(p.full_tensor() if isinstance(p, DTensor) else p)
    loss = ((plain(x) - y) ** 2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    gnorm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    scale = 1.0 / gnorm if gnorm > 1.0 else 1.0  # optax.clip_by_global_norm(1.0)
    for n, p in net.named_parameters():
        p.grad = distribute_tensor(grads[n] * scale, mesh, p.placements, src_data_rank=None)
    for group in opt.param_groups:
        group["lr"] = learning_rate(saved_count, cfg)
    opt.step()
    t_step = time.time()
    loss_value = float(loss.detach())

    # Informative: the loss of the next batch after the torch AdamW step (forward only).
    nxt = {"position": cursor["position"] + cfg["global_batch"], "shuffle_seed": cursor["shuffle_seed"]}
    ids2 = batch_ids(nxt, cfg)
    with torch.no_grad():
        for (_, p), (_, q) in zip(net.named_parameters(), plain.named_parameters()):
            q.copy_(p.full_tensor() if isinstance(p, DTensor) else p)
        next_loss = float(((plain(torch.from_numpy(x_all[ids2])) - torch.from_numpy(y_all[ids2])) ** 2).mean())

    per_rank = torch.zeros(world, dtype=torch.int64)
    per_rank[rank] = int(loaded.bytes_read)
    dist.all_reduce(per_rank)
    mb = float(per_rank.sum()) / 1e6
    out: dict[str, Any] = {
        "mode": "restore", "framework": "torch", "topology": f"{world} torch gloo ranks, DTensor Shard(0)",
        "devices": world, "restored_step": step, "step": step + 1, "loss": loss_value, "ids": [int(i) for i in ids],
        "next_loss": next_loss, "next_loss_rtol": TORCH_NEXT_LOSS_RTOL,
        "hashes": {"leaves": checked, "differ": differ, "exact": checked > 0 and not differ},
        "loss_rtol": TORCH_LOSS_RTOL, "bytes_read": int(per_rank.sum()),
        "bytes_read_per_process": [int(b) for b in per_rank],
        "init_note": "torch import (zygote), fork, gloo process group",
        "step_note": "forward, backward, clip, AdamW on DTensors",
        "restore_phases": [
            ["manifest load", t_manifest - t_ready,
             "agree on the newest step, parse + validate manifest, read state (before job setup: the "
             "twin's widths come from it)"],
            ["plan + transfer + reshard + checksums", t_restored - t_setup,
             f"{'the torch manager through the local tiers' if args.local else 'bridges.torch.load'}, Flax->torch "
             f"mapping, {mb:.2f} MB over {world} ranks (bridge reports bytes only)"],
            ["validation: state hashes", t_valid - t_restored, f"{checked} tensors sha256 vs saved, step count"],
        ],
        "t_ready": t_ready, "t_setup": t_setup, "t_restored": t_restored, "t_valid": t_valid, "t_step": t_step,
        **times}
    # The manifest is read before the job setup (the twin's widths come from it).
    out["job_setup_s"] = t_setup - t_manifest
    out["restore_s"] = (t_manifest - t_ready) + (t_restored - t_setup)
    out.update(tiers)
    if args.rejected_control:
        out["rejected_control"] = _rejected(args, rank, world, step, net, opt, target, mapping)
    dist.barrier()
    return out


def _shard_dim(mod: Any, net: Any, args: argparse.Namespace) -> int:
    """The dimension a 2-D weight is sharded on. Tiers: each rank's shard is the union of the JAX
    process's device boxes (l1's kernel is split P("data", "model") and l2's P("model", "data") on
    a data x model mesh whose process p holds data rows [p/P, (p+1)/P)): l1.weight (hidden, d_in)
    by d_in, l2.weight (d_out, hidden) by d_out; otherwise by rows."""
    return 1 if args.local and mod is net.l1 else 0


def _saved_count(args: argparse.Namespace, step: int) -> int:
    """Adam's count in ``step`` as a copy of it holds it: the persistent tier's, else the first
    local copy (any host's) that still holds it. Compared by value: the hash saved for a 0-d leaf
    does not equal a 0-d array's hash in this drill (seen for every 0-d leaf; probably the
    cross-process gather in training.digest_tree, not investigated)."""
    from ckptfmt import Repository
    from ckptfmt.errors import CheckpointError

    key = f"{ADAM_PREFIX}/count"
    if step in Repository(args.url).steps():
        return int(Repository(args.url).open(step).read(key))
    for h in sorted(os.listdir(args.local)) if os.path.isdir(args.local) else []:
        try:
            ckpt = Repository(os.path.join(args.local, h)).open(step)
            local = next(b[0] for b in ckpt.state()["tiers"]["boxes"] if b[2] == key)
            return int(ckpt.read(local))
        except (CheckpointError, StopIteration, KeyError, OSError):
            continue
    return -1


def _restore_tiers(args: argparse.Namespace, target: Any, mapping: Any) -> tuple[Any, dict[str, Any]]:
    """Restore through ``bridges.torch.CheckpointManager`` with the JAX job's local tier; the
    bytes each tier served on every rank and each rank's tier token."""
    import torch
    import torch.distributed as dist

    from bridges import torch as bt
    from ckptfmt.manager import LocalTier

    tier = LocalTier(args.local, every=args.local_every, keep=3)
    with bt.CheckpointManager(args.url, local=tier, mapping=mapping) as mgr:
        res = mgr.restore(target)
    t = res.stats.get("tiers") or {}
    # [local, peer, persistent, persistent bytes of pieces a surviving copy held (elastic)]
    per = torch.zeros((dist.get_world_size(), 4), dtype=torch.int64)
    per[dist.get_rank()] = torch.tensor([t.get("local", 0), t.get("peer", 0), t.get("persistent", 0),
                                         t.get("persistent_held", 0)])
    dist.all_reduce(per)
    tokens: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tokens, str(res.stats.get("tier_token") or ""))
    return res.state, {"tiers_per_process": per.tolist(), "tokens_per_process": tokens, "elastic": res.stats.get("elastic"),
                       "restore_stats": {k: v for k, v in res.stats.items() if k in ("tiers", "tier_token", "restore_s")}}


def _local_hashes(net: Any, opt: Any) -> dict[str, str]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(net, opt)
    out = {}
    for key, v in msd.items():
        out[f"model/{key}"] = digest((v.to_local() if isinstance(v, DTensor) else v).detach().numpy())
    for fqn, slots in osd["state"].items():
        for slot, v in slots.items():
            out[f"optim/{fqn}/{slot}"] = digest((v.to_local() if isinstance(v, DTensor) else v).detach().numpy())
    return out


def _rejected(args: argparse.Namespace, rank: int, world: int, step: int, net: Any, opt: Any, target: Any,
              mapping: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from bridges import torch as bt
    from ckptfmt import Repository
    from ckptfmt.errors import CheckpointError

    from ._damage import copy_without_one_shard

    removed = None
    if rank == 0:
        removed = copy_without_one_shard(args.url, args.rejected_control, step, prefer_writer=args.victim)
    dist.barrier()
    before = _local_hashes(net, opt)
    t0 = time.time()
    raised, message = None, ""
    try:
        got = bt.load(args.rejected_control, target, step=step, mapping=mapping)
    except CheckpointError as exc:
        got, raised, message = None, type(exc).__name__, str(exc)[:300]
    # Fail closed as one job: state is applied only if every rank loaded everything.
    ok = torch.tensor([0 if got is None else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if int(ok.item()) == 1:
        set_state_dict(net, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    reject_s = time.time() - t0
    unchanged = torch.tensor([1 if _local_hashes(net, opt) == before else 0], dtype=torch.int64)
    dist.all_reduce(unchanged, op=dist.ReduceOp.MIN)
    errs = torch.zeros(world, dtype=torch.int64)
    errs[rank] = 1 if raised else 0
    dist.all_reduce(errs)
    path = os.path.join(os.path.dirname(args.out), f"torch-rejected-rank{rank}.json")
    with open(path, "w") as f:
        json.dump({"rank": rank, "raised": raised, "message": message}, f)
    dist.barrier()
    res: dict[str, Any] = {"fault": "missing shard", "step": step, "copy": args.rejected_control, "removed": removed,
                           "reject_s": reject_s, "exposed": int(ok.item()) == 1,
                           "live_state_unchanged": bool(unchanged.item()), "live_state_leaves": len(before),
                           "ranks_that_raised": [r for r in range(world) if int(errs[r])]}
    if rank == 0:
        per = []
        for r in range(world):
            with open(os.path.join(os.path.dirname(args.out), f"torch-rejected-rank{r}.json")) as f:
                per.append(json.load(f))
        first = next((p for p in per if p["raised"]), None)
        res.update(raised=first["raised"] if first else None, message=first["message"] if first else "",
                   per_rank=per)
        try:
            res["original_verified_bytes"] = int(Repository(args.url).verify(step))
            res["original_intact"] = True
        except CheckpointError as exc:
            res.update(original_intact=False, original_error=type(exc).__name__)
    return res


# ------------------------------------------------------------------------------- zygote


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.drill._torch_job")
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rejected-control", default="")
    ap.add_argument("--victim", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--local", default="", help="the JAX job's local tier (drill --tiers): restore through it "
                                                "({rank}: this rank's, drill --tiers --elastic)")
    ap.add_argument("--local-every", type=int, default=5)
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (imported once, shared by the forked ranks)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import bridges.torch  # noqa: F401

    times = {"t_start": T_START, "t_import": time.time()}
    from ckptfmt.coord import free_port

    from ._procs import reap_forked

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.world))
    pids = {}
    for r in range(args.world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(r), LOCAL_RANK=str(r))
            code = 0
            try:
                res = _rank_main(args, r, times)
                if r == 0:
                    with open(args.out + ".tmp", "w") as f:
                        json.dump(res, f, indent=1, default=str)
                    os.replace(args.out + ".tmp", args.out)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        pids[pid] = r
    sys.exit(1 if reap_forked(pids, grace_s=2.0) else 0)


if __name__ == "__main__":
    main()
