"""Two-process check: a JaxCoordinator notices a SIGKILLed peer long before its timeout, and does
not mistake a slow but live peer for a dead one (run by tests/test_jax_bridge.py).

usage: dead_peer_check.py PORT RANK OUT_JSON
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402


def main() -> None:
    port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, 2, rank, timeout=60)
    from bridges.jax._coord import JaxCoordinator
    from ckptfmt.errors import CheckpointError

    res: dict = {}
    c = JaxCoordinator(timeout_s=120, dead_after_s=4)
    c.barrier("start")
    # The control: rank 1 is alive but arrives 8 s late (twice dead_after_s): no false alarm.
    if rank == 1:
        time.sleep(8)
    t = time.monotonic()
    res["slow_peer"] = [p.decode() for p in c.allgather("slow", f"r{rank}".encode())]
    res["slow_peer_s"] = round(time.monotonic() - t, 2)
    c.barrier("before-kill")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies between two collectives, mid-protocol
    t = time.monotonic()
    try:
        c.allgather("after", b"x")
        res["dead_peer"] = "no error"
    except CheckpointError as e:
        res["dead_peer"] = type(e).__name__
        res["dead_peer_message"] = str(e)
    res["dead_peer_s"] = round(time.monotonic() - t, 2)
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)  # the peer is gone: a clean jax.distributed.shutdown() would wait for it


if __name__ == "__main__":
    main()
