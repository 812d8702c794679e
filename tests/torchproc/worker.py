"""Zygote for N torch ranks: import torch once, then fork one child per rank.

Usage: ``worker.py <scenario> <args.json> <world> <port>``. Each child initializes gloo from
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, runs ``scenarios.<scenario>(args)``, and writes
``<workdir>/<tag>-result-<rank>.json``; its output goes to ``<tag>-rank<r>.log``. Forking after
the imports saves each rank the several CPU-seconds that importing torch costs. The zygote exits
non-zero if any rank fails; when one rank fails the others are killed after a short grace.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]  # repo root (ckptfmt, bridges), tests/


def _child(rank: int, world: int, port: int, scenario: str, args: dict) -> int:
    log = os.open(Path(args["workdir"]) / f"{args['tag']}-rank{rank}.log",
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist
        from torchproc import scenarios

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        module, _, name = scenario.rpartition(":")  # "module:function" runs torchproc.<module>.<function>
        result = getattr(importlib.import_module(f"torchproc.{module}") if module else scenarios, name)(args)
        out = Path(args["workdir"]) / f"{args['tag']}-result-{rank}.json"
        out.write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    scenario, argfile, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    args = json.loads(Path(argfile).read_text())
    import torch  # noqa: F401  (imported once, shared by the forked ranks)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from torchproc import scenarios  # noqa: F401

    if ":" in scenario:
        importlib.import_module(f"torchproc.{scenario.rpartition(':')[0]}")  # imported once, before the fork
    if scenario.startswith("hf_"):
        import transformers  # noqa: F401  (imported once, before the fork)

    from ckptfmt_tools.drill._procs import reap_forked

    pids = {}
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            os._exit(_child(r, world, port, scenario, args))
        pids[pid] = r
    sys.exit(1 if reap_forked(pids, grace_s=3.0) else 0)


if __name__ == "__main__":
    main()
