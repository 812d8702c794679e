"""The raw limit: the same bytes written by parallel fsync'd writers, then read back.

One file per shard (the same shards the checkpoint writers own), written by a
pool of ``threads`` threads (one file per task: ``os.write`` in 8 MiB pieces,
then ``fsync``), then the directory fsync'd. Reads use a pool of ``threads``
threads, one whole file per task, into preallocated buffers. The pool is as
wide as ckptfmt's own reader (32 threads), so the limit is not a straw man; a
narrower pool measures lower on a virtual disk. Nothing here is a checkpoint
format; it is what the storage gives to a simple parallel program.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .child import Meter, rss_bytes, sync_after, tree_stats
from .layout import StateLayout, block_data

_PIECE = 8 << 20


def _shard_name(i: int, b: int) -> str:
    return f"t{i:04d}-b{b:04d}.bin"


def _write_file(path: str, buf: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(buf), _PIECE):
            os.write(fd, buf[off : off + _PIECE])
        os.fsync(fd)
    finally:
        os.close(fd)


def write(params: dict) -> dict:
    """Child task: write the state as raw shard files; time until all are durable."""
    layout = StateLayout.from_json(params["layout"])
    writers, path = params["writers"], params["path"]
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    rss_base = rss_bytes()
    per = layout.blocks // writers
    # Each writer's shards, in memory before the clock starts (as a trained state would be).
    shards = {
        w: [(i, w, np.concatenate([block_data(layout, i, w * per + k) for k in range(per)])) for i in range(layout.tensors)]
        for w in range(writers)
    }

    files = [(os.path.join(path, _shard_name(i, b)), memoryview(arr).cast("B")) for w in range(writers) for i, b, arr in shards[w]]
    threads = int(params.get("threads", writers))

    with Meter("save") as m:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda f: _write_file(*f), files))
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return {"phase": m.result | {"rss_base": rss_base, "state_bytes": layout.nbytes, "sync_after_s": sync_after()}, "disk": tree_stats(path)}


def read(params: dict) -> dict:
    """Child task: read every raw shard file back with a pool of ``threads`` threads."""
    path, readers = params["path"], params["readers"]
    threads = int(params.get("threads", readers))
    names = sorted(os.listdir(path))
    sizes = [os.stat(os.path.join(path, n)).st_size for n in names]
    rss_base = rss_bytes()

    def read_file(name: str, size: int) -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            view = memoryview(buf)
            while got_now := f.readinto(view):
                view = view[got_now:]
        if view.nbytes:
            raise AssertionError(f"raw read of {name}: {view.nbytes} bytes short")
        return buf

    with Meter("restore") as m:
        with ThreadPoolExecutor(threads) as pool:
            out = list(pool.map(read_file, names, sizes))
    total = sum(int(b.nbytes) for b in out)
    if total != sum(sizes):
        raise AssertionError(f"raw read {total} of {sum(sizes)} bytes")
    return {"phase": m.result | {"rss_base": rss_base, "bytes_restored": total, "bytes_read_per_reader": total / readers,
                                 "threads": threads}}
