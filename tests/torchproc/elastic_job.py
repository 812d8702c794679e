"""One rank of the elastic local-tier scenarios (tests/test_tiers_elastic.py): gloo ranks.

``save``: 4 ranks save steps 1..8 (local steps 6 and 8 kept; persistent steps 4 and 8) through ``bridges.torch.CheckpointManager`` (persistent every
4, local every 2, keep 2, peer replicas) with DTensors ``Shard(0)`` (one uneven) and a replicated
tensor. ``restore``: a job of ``--world`` ranks (3 or 2: no spare) restores through the tiers of
the hosts that survived (the test deletes the lost hosts' tiers), into its own placements (other
boxes than any host held), and records the bytes each tier served. ``--tamper MODE``: rank
``--tamper-rank`` answers its peers dishonestly (``corrupt``: one chunk byte flipped;
``other-step``: the manifest of another local step), so its pieces must be refused and read from
the persistent tier. Writes what the restore returned to --out.

usage: elastic_job.py save|restore --dir D --port P --rank R --world W --out JSON [--tamper MODE --tamper-rank R]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402


def state(mesh, step: int) -> dict:
    w = torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6) + 1000 * step
    u = torch.arange(10, dtype=torch.int64) * 7 + step
    return {"w": distribute_tensor(w, mesh, [Shard(0)]), "u": distribute_tensor(u, mesh, [Shard(0)]),
            "b": torch.full((3,), step, dtype=torch.int32), "n": step}


class Tampering:
    """A peer exchange that answers dishonestly on one rank (a broken peer, for the controls)."""

    def __init__(self, inner, mode: str, rank: int, local_dir: str) -> None:
        self.inner, self.mode, self.rank, self.local_dir = inner, mode, rank, local_dir
        self.background = inner.background
        self.tampered = 0

    def _tamper(self, payload) -> bytes:
        from ckptfmt import Repository
        from ckptfmt.manager._tieranswer import pack_answers, unpack_answers

        docs = unpack_answers(payload)
        for h, one in sorted(docs.items()):
            if self.mode == "corrupt" and len(one["chunks"]):
                c = bytearray(one["chunks"][0])
                c[0] ^= 0xFF
                one["chunks"] = [bytes(c)] + [bytes(x) for x in one["chunks"][1:]]
            elif self.mode == "other-step":
                repo = Repository(os.path.join(self.local_dir, f"host-{h}"))
                one["manifest"] = repo.open(min(repo.steps())).manifest_bytes  # step 6's manifest for a step-8 ask
            self.tampered += 1
        return pack_answers(sorted(docs.items()))

    def shift(self, name, payload, offset):
        if "/serve/" in name and dist.get_rank() == self.rank:
            payload = self._tamper(payload)
        return self.inner.shift(name, payload, offset)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    for name in ("--dir", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--tamper", default="")
    ap.add_argument("--tamper-rank", type=int, default=1)
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=60))
    import bridges.torch as bt
    from bridges.torch._manager import TorchTierHooks
    from ckptfmt.manager import LocalTier

    mesh = init_device_mesh("cpu", (a.world,))
    persistent, local_dir = os.path.join(a.dir, "persistent"), os.path.join(a.dir, "local")
    tier = LocalTier(local_dir, every=2, keep=2)
    out: dict = {}
    if a.mode == "save":
        with bt.CheckpointManager(persistent, save_every_steps=4, local=tier) as mgr:
            for step in range(1, 9):
                mgr.save(step, state(mesh, step), extra={"step": step})
            mgr.wait()
            out["local_saves"] = [s.step for s in mgr.tier_history if s.committed]
    else:
        wrapped: list = []

        class Hooks(TorchTierHooks):
            def new_exchange(self, world):
                ex = super().new_exchange(world)
                if a.tamper and ex is not None:
                    ex = Tampering(ex, a.tamper, a.tamper_rank, local_dir)
                    wrapped.append(ex)
                return ex

        class Manager(bt.CheckpointManager):
            def _new_tier_hooks(self):
                return Hooks(self.mapping)

        with Manager(persistent, local=tier) as mgr:
            r = mgr.restore(state(mesh, 0))
        expect = state(mesh, r.step)
        out = {"step": r.step, "tiers": r.stats.get("tiers"), "elastic": r.stats.get("elastic"),
               "token": r.stats.get("tier_token"), "extra": r.extra, "n": r.state["n"],
               "tampered": sum(w.tampered for w in wrapped),
               "needed": sum(int(t.to_local().numel() * t.to_local().element_size()) for t in
                             (expect["w"], expect["u"])) + 12,
               "exact": bool(all(torch.equal(r.state[k].full_tensor(), expect[k].full_tensor()) for k in ("w", "u"))
                             and torch.equal(r.state["b"], expect["b"]))}
    with open(a.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
