"""DCP's process-based async save through CkptfmtStorageWriter, killed after staging (issue 51).

Each rank trains a Shard(0) DTensor model with AdamW, saves step 1 with ``dcp.async_save(...,
async_checkpointer_type=PROCESS)`` and waits for it, trains on, stages step 2 the same way and,
once the staging has returned, records what it staged, trains one more step (the staged copy must
not see it) and SIGKILLs itself; with ``kill_checkpointer`` it first SIGKILLs its DCP checkpoint
process too (a lost node). Step 2's writes are throttled so that the kills land before its commit.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from torchproc.scenarios import fake_step, full_np, net_and_optim, train_state


def _expect(args: dict[str, Any], name: str, net: Any, opt: Any) -> None:
    """Every rank takes part (full_tensor is collective); rank 0 writes the npz."""
    expect = full_np(dict(zip(("model", "optim"), train_state(net, opt))))
    if dist.get_rank() == 0:
        np.savez(Path(args["workdir"]) / f"{name}.npz", **{k.replace("/", "|"): v for k, v in expect.items()})


def _wait_request_sent(timeout: float) -> None:
    """DCP sends the staged state to its checkpoint process from a thread of its own once the
    staging completes, and then waits for the answer (``_wait_for_response``, torch 2.13). A kill
    before that send loses the request, which is not what this scenario kills: wait for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code.co_name == "_wait_for_response":
                    return
                frame = frame.f_back
        time.sleep(0.02)
    raise RuntimeError(f"DCP did not send the save request to its checkpoint process within {timeout} s")


def train_and_kill(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    import ckptfmt
    from bridges.dcp import CkptfmtStorageWriter

    world, rank = dist.get_world_size(), dist.get_rank()
    kill_checkpointer = bool(args["kill_checkpointer"])
    # async staging in a thread (returns AsyncSaveResponse) or synchronous staging (a Future)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                          use_async_staging=not kill_checkpointer, use_non_blocking_copy=False))
    net, opt = net_and_optim(seed=1, world=world)

    def save(step: int, options: Any = None) -> Any:
        msd, osd = train_state(net, opt)
        writer = CkptfmtStorageWriter(args["url"], step=step, extra={"step": step}, options=options)
        return dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    fake_step(net, opt, world)
    first = save(1)
    (first.upload_completion if isinstance(first, AsyncSaveResponse) else first).result(timeout=120)
    _expect(args, "step1", net, opt)
    fake_step(net, opt, world)
    _expect(args, "step2", net, opt)
    # throttled writes (seconds for this rank's few hundred bytes) keep the commit after the kill
    second = save(2, ckptfmt.SaveOptions(max_write_bytes_per_s=float(args["write_bytes_per_s"])))
    if isinstance(second, AsyncSaveResponse):
        second.staging_completion.result(timeout=120)
    if not kill_checkpointer:
        _wait_request_sent(timeout=60)
    fake_step(net, opt, world)  # the training goes on; the staged copy must not change
    _expect(args, "after", net, opt)
    dist.barrier()  # both ranks staged before either dies
    children = [p.pid for p in multiprocessing.active_children()]  # DCP's checkpoint process
    steps_at_kill = ckptfmt.Repository(args["url"]).steps()
    marker = Path(args["workdir"]) / f"killed-{rank}.json"
    marker.write_text(json.dumps({"pid": os.getpid(), "children": children, "steps_at_kill": steps_at_kill,
                                  "response": type(second).__name__}))
    if kill_checkpointer:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}  # never reached
