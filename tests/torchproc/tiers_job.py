"""One rank of the torch local-tier scenarios (tests/test_tiers.py): 2 gloo ranks.

The same run as tests/jaxproc/tiers_job.py: steps 1..6 through ``bridges.torch.CheckpointManager``
(persistent every 4, local every 2, keep 2) with a DTensor ``Shard(0)`` and a replicated tensor,
then four restores with rank 0 damaging the tiers between them (intact, one own box corrupt,
host 1's tier lost, every tier lost). Writes what each restore returned to --out.

usage: tiers_job.py --dir D --port P --rank R --out JSON
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.join(os.path.dirname(HERE), "jaxproc")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402


def _mapped(a: argparse.Namespace, mesh, state) -> dict:
    """A manager with a mapping (``w`` stored transposed as ``wt``): its local tier holds the
    checkpoint's layout, and a restore through the tiers maps it back (intact, then host 1 lost)."""
    import bridges.torch as bt
    from bridges.mapping import Mapping, Rule
    from ckptfmt import Repository
    from ckptfmt.manager import LocalTier

    mapping = Mapping((Rule("wt", "w", permute={2: (1, 0)}),))
    persistent, local_dir = os.path.join(a.dir, "mapped-p"), os.path.join(a.dir, "mapped-local")
    tier = LocalTier(local_dir, every=2, keep=2)
    with bt.CheckpointManager(persistent, save_every_steps=4, local=tier, mapping=mapping) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step), extra={"step": step})
    out = {"keys": sorted(Repository(persistent).manifest(4).tensors)}
    for scenario in ("intact", "lost-host"):
        if a.rank == 0 and scenario == "lost-host":
            shutil.rmtree(os.path.join(local_dir, "host-1"))
        dist.barrier()
        with bt.CheckpointManager(persistent, local=tier, mapping=mapping) as mgr:
            r = mgr.restore(state(0))
        out[scenario] = {"step": r.step, "tiers": r.stats.get("tiers"), "exact": bool(torch.equal(
            r.state["w"].full_tensor(), state(r.step)["w"].full_tensor()) and torch.equal(r.state["b"], state(r.step)["b"]))}
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--dir", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=2,
                            timeout=timedelta(seconds=60))
    import bridges.torch as bt
    from ckptfmt.manager import LocalTier
    from tiers_job_damage import corrupt_own_box

    mesh = init_device_mesh("cpu", (2,))

    def state(step: int) -> dict:
        w = torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1000 * step
        return {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": torch.full((3,), step, dtype=torch.int32), "n": step}

    persistent, local_dir = os.path.join(a.dir, "persistent"), os.path.join(a.dir, "local")
    tier = LocalTier(local_dir, every=2, keep=2)
    with bt.CheckpointManager(persistent, save_every_steps=4, local=tier) as mgr:
        for step in range(1, 7):
            mgr.save(step, state(step), extra={"step": step}, rank_state={"cursor": step * 10 + a.rank})
        mgr.wait()
        saves = [s.step for s in mgr.tier_history if s.committed]
    out: dict = {"local_saves": saves, "restores": {}}
    for scenario in ("intact", "corrupt", "lost-host", "all-lost"):
        if a.rank == 0:
            if scenario == "intact":
                shutil.copytree(os.path.join(local_dir, "host-0"), os.path.join(a.dir, "host-0-clean"))
            elif scenario == "corrupt":
                out["corrupted"] = corrupt_own_box(local_dir, 0, 6)
            elif scenario == "lost-host":
                shutil.rmtree(os.path.join(local_dir, "host-0"))
                os.rename(os.path.join(a.dir, "host-0-clean"), os.path.join(local_dir, "host-0"))
                shutil.rmtree(os.path.join(local_dir, "host-1"))
            else:
                shutil.rmtree(local_dir)
        dist.barrier()
        with bt.CheckpointManager(persistent, local=tier) as mgr:
            r = mgr.restore(state(0))
        w = r.state["w"].full_tensor()
        expect = state(r.step)
        out["restores"][scenario] = {
            "step": r.step, "tiers": r.stats.get("tiers"), "token": r.stats.get("tier_token"), "n": r.state["n"],
            "extra": r.extra, "rank_state": r.state.rank_state, "n_ok": r.state["n"] == r.step,
            "exact": bool(torch.equal(w, expect["w"].full_tensor()) and torch.equal(r.state["b"], expect["b"]))}
        dist.barrier()
    out["mapped"] = _mapped(a, mesh, state)
    with open(a.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
