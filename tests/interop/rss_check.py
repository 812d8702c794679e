"""Peak RSS rise and throughput of a streaming export and import (one fresh process each).

usage: rss_check.py WORKDIR SIZE_MIB [TENSOR_MIB] [--no-raw]   -> one JSON line: sizes, per phase seconds, bytes/s and the
peak RSS rise (VmHWM after - VmRSS before, in bytes), and the raw disk's write+fsync and read
throughput on the same directory for comparison. The step holds SIZE_MIB of float32 tensors of at
most TENSOR_MIB (default 64) MiB each, plus a small one. tests/test_safetensors.py runs it at
192 MiB in 16 MiB tensors; the 2 GiB figures of docs/INTEROP.md come from
``rss_check.py /tmp/rss 2048``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def make(workdir: str, mib: int, tensor_mib: int) -> None:
    import numpy as np

    import ckptfmt
    from ckptfmt import Box, LocalShard

    rng = np.random.default_rng(0)
    shards, left, i = [], mib << 20, 0
    while left > 0:
        n = min(tensor_mib << 20, left)
        arr = np.frombuffer(rng.bytes(n), np.float32).reshape(-1, 1024)
        shards.append(LocalShard(f"layers.{i}.w", arr.shape, arr.dtype, Box.full(arr.shape), arr))
        left -= n
        i += 1
    small = np.arange(1000, dtype=np.int32)
    shards.append(LocalShard("small", small.shape, small.dtype, Box.full(small.shape), small))
    ckptfmt.save(os.path.join(workdir, "repo"), 1, shards)


def phase(workdir: str, which: str) -> None:
    from ckptfmt.interop import export_safetensors, import_safetensors

    before = _status("VmRSS")
    t0 = time.perf_counter()
    if which == "export":
        rep = export_safetensors(os.path.join(workdir, "repo"), os.path.join(workdir, "out"), max_shard_size="1GB")
        nbytes = rep.nbytes
    else:
        rep = import_safetensors(os.path.join(workdir, "out"), os.path.join(workdir, "back"))
        nbytes = rep.nbytes
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "bytes": nbytes, "bytes_per_s": nbytes / dt,
                      "rss_rise": _status("VmHWM") - before, "rss_before": before}))


def raw_disk(workdir: str, mib: int) -> dict:
    """os.write + fsync of mib MiB in 64 MiB pieces, then read back (page cache as it is)."""
    path = os.path.join(workdir, "raw.bin")
    buf = os.urandom(min(mib, 64) << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = mib << 20
    while left > 0:
        left -= os.write(fd, buf[:min(len(buf), left)])
    os.fsync(fd)
    os.close(fd)
    tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass
    tr = time.perf_counter() - t0
    os.unlink(path)
    return {"write_fsync_bytes_per_s": (mib << 20) / tw, "read_bytes_per_s": (mib << 20) / tr}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    workdir, mib = args[0], int(args[1])
    tensor_mib = int(args[2]) if len(args) > 2 and args[2].isdigit() else 64
    what = args[-1] if not args[-1].isdigit() and len(args) > 2 else None
    if what is not None:
        {"make": lambda: make(workdir, mib, tensor_mib), "export": lambda: phase(workdir, "export"),
         "import": lambda: phase(workdir, "import")}[what]()
        return
    os.makedirs(workdir, exist_ok=True)
    run = lambda w: subprocess.run([sys.executable, __file__, workdir, str(mib), str(tensor_mib), w],  # noqa: E731
                                   check=True, capture_output=True, text=True).stdout.strip().splitlines()
    run("make")
    doc = {"size": mib << 20, "largest": min(mib, tensor_mib) << 20}
    doc["export"] = json.loads(run("export")[-1])
    doc["import"] = json.loads(run("import")[-1])
    if "--no-raw" not in sys.argv:
        doc["raw_disk"] = raw_disk(workdir, mib)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
