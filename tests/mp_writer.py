"""A writer process for multi-process tests: python mp_writer.py URL STEP RANK WORLD ADDR [stall_rank]."""
import sys
import time

import numpy as np

from ckptfmt import Box, LocalShard, TcpCoordinator, save
from _layouts import layout


def arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"layer/w": rng.standard_normal((96, 40)).astype(np.float32),
            "layer/b": rng.standard_normal((40,)).astype(np.float32),
            "emb": rng.integers(0, 100, (30, 8)).astype(np.int64),
            "step": np.asarray(step, np.int64)}


KINDS = {"layer/w": "rows", "layer/b": "replicated", "emb": "cols", "step": "replicated"}


def main() -> None:
    url, step, rank, world, addr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    stall = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    arrs = arrays(step)
    shards = []
    for k, a in arrs.items():
        for box, rep in layout(KINDS[k], a.shape, world)[rank]:
            sl = box.slices()
            data = a[sl] if sl else a
            if rank == stall:
                def slow(d=data):
                    time.sleep(60)
                    return d
                shards.append(LocalShard(k, a.shape, a.dtype, box, slow, replica_id=rep))
            else:
                shards.append(LocalShard(k, a.shape, a.dtype, box, data, replica_id=rep))
    with TcpCoordinator(addr, rank, world, timeout_s=30) as c:
        m = save(url, step, shards, coordinator=c, state={"step": step, "cursor": {"pos": step * 64}},
                 rank_state={"rank": rank})
    print("COMMITTED", m.step, m.save_id, flush=True)


if __name__ == "__main__":
    main()
