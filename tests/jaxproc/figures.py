"""Figures for the closing note (not a test): save/restore time and restore peak RSS vs bytes.

usage: figures.py save|restore DIR MB [--nproc N --rank R --port P]
save:    8 CPU devices (or 4 per process), 8 float32 tensors of MB/8 each, split over data x model 4x2.
restore: 4 CPU devices per process onto mesh data x model 2x2 (x nproc processes), one restore.
Prints one JSON line.
"""
from __future__ import annotations

import json
import os
import sys
import time

mode, d, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = dict(zip(sys.argv[4::2], sys.argv[5::2]))
nproc, rank, port = int(opts.get("--nproc", 1)), int(opts.get("--rank", 0)), int(opts.get("--port", 0))
ndev = (8 if mode == "save" else 4 * nproc) // nproc
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402

if nproc > 1:
    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, nproc, rank)
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bridges.jax as bj  # noqa: E402
from ckptfmt_tools.receipt import _rss_mb as status  # noqa: E402
from ckptfmt_tools.training import make_mesh  # noqa: E402




n = 8
rows = (mb << 20) // n // 4 // 1024
shape = (rows, 1024)
if mode == "save":
    mesh = make_mesh((4, 2))
    sh = NamedSharding(mesh, P("data", "model"))
    state = {f"w{i}": jax.jit(lambda i=i: jax.random.normal(jax.random.key(i), shape), out_shardings=sh)()
             for i in range(n)}
    jax.block_until_ready(state)
    t = time.perf_counter()
    m = bj.save(d, state, step=1)
    print(json.dumps({"save_s": time.perf_counter() - t, "saved_bytes": m.nbytes, "tensor_bytes": n * rows * 1024 * 4}))
else:
    mesh = make_mesh((2 * nproc, 2))
    sh = NamedSharding(mesh, P("data", "model"))
    target = {f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh) for i in range(n)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status()
    st: dict = {}
    t = time.perf_counter()
    r = bj.restore(d, target, stats=st)
    jax.block_until_ready(r)
    dt = time.perf_counter() - t
    after = status()
    res = {"rank": rank, "restore_s": dt, "bytes_restored": st["bytes_restored"], "bytes_read": st["reader"]["bytes_read"],
           "rss_before_mb": before["VmRSS"], "peak_delta_mb": after["VmHWM"] - before["VmRSS"],
           "after_delta_mb": after["VmRSS"] - before["VmRSS"], "timings": st["reader"]["timings"]}
    print(json.dumps(res))
if nproc > 1:
    jax.distributed.shutdown()
