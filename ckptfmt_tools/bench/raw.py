"""The raw limit: the same bytes written by several honest writers (the fastest counts), then read back.

The writers (:data:`WRITERS`), each timed until its bytes are durable, one after another in the
same child with the previous one's files removed and synced off the clock:

- ``stream``: one file, one thread, ``os.write`` in 8 MiB pieces, then ``fsync``;
- ``direct``: the same through ``O_DIRECT`` from a page-aligned buffer (skipped where the file
  system refuses ``O_DIRECT``), then ``fsync`` (the file's metadata);
- ``dd``: ``dd bs=8M conv=fsync`` from ``/dev/zero`` (skipped without ``dd``; zeros, so a
  storage that compresses or deduplicates would flatter it);
- ``threads`` (last, so that its files are the ones read back): one file per shard (the same
  shards the checkpoint writers own), written by a pool of ``threads`` threads (one file per
  task: ``os.write`` in 8 MiB pieces, then ``fsync``), then the directory fsync'd.

The save row is the fastest writer's; it says which one (``method``) and keeps every writer's
seconds (``methods``). Reads use a pool of ``threads``
threads, one whole file per task, into preallocated buffers. The pool is as
wide as ckptfmt's own reader (32 threads), so the limit is not a straw man; a
narrower pool measures lower on a virtual disk. Nothing here is a checkpoint
format; it is what the storage gives to a simple parallel program.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .child import Meter, rss_bytes, sync_after, tree_stats
from .layout import StateLayout, block_data

_PIECE = 8 << 20
#: The raw limit's writers, in the order they run (``threads`` last: its files are read back).
WRITERS = ("stream", "direct", "dd", "threads")


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


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stream(path: str, files: list[tuple[str, memoryview]], threads: int) -> None:
    """One file, one thread, buffered writes, one fsync."""
    fd = os.open(os.path.join(path, "stream.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _name, buf in files:
            for off in range(0, len(buf), _PIECE):
                os.write(fd, buf[off : off + _PIECE])
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_path(path)


def _direct(path: str, files: list[tuple[str, memoryview]], threads: int) -> None:
    """One file through O_DIRECT from a page-aligned staging buffer (OSError where refused)."""
    stage = mmap.mmap(-1, _PIECE)  # anonymous mappings are page aligned, as O_DIRECT needs
    fd = os.open(os.path.join(path, "direct.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view = memoryview(stage)
        for _name, buf in files:
            for off in range(0, len(buf), _PIECE):
                n = len(buf[off : off + _PIECE])
                view[:n] = buf[off : off + n]
                os.write(fd, view[: -(-n // 4096) * 4096])  # whole blocks; the tail is padded
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        stage.close()
    _fsync_path(path)


def _dd(path: str, files: list[tuple[str, memoryview]], threads: int) -> None:
    nbytes = sum(len(b) for _n, b in files)
    subprocess.run(["dd", "if=/dev/zero", f"of={os.path.join(path, 'dd.bin')}", f"bs={_PIECE}",
                    f"count={-(-nbytes // _PIECE)}", "conv=fsync", "status=none"], check=True)
    _fsync_path(path)


def _threads(path: str, files: list[tuple[str, memoryview]], threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda f: _write_file(*f), files))
    _fsync_path(path)


_WRITER_FNS = {"stream": _stream, "direct": _direct, "dd": _dd, "threads": _threads}


def write(params: dict) -> dict:
    """Child task: write the state with each writer of ``params["writers_used"]`` (default all of
    :data:`WRITERS`); the phase is the fastest one's, time until its bytes are durable."""
    layout = StateLayout.from_json(params["layout"])
    writers, path = params["writers"], params["path"]
    rss_base = rss_bytes()
    per = layout.blocks // writers
    # Each writer's shards, in memory before the clock starts (as a trained state would be).
    shards = {
        w: [(i, w, np.concatenate([block_data(layout, i, w * per + k) for k in range(per)])) for i in range(layout.tensors)]
        for w in range(writers)
    }
    files = [(os.path.join(path, _shard_name(i, b)), memoryview(arr).cast("B")) for w in range(writers) for i, b, arr in shards[w]]
    threads = int(params.get("threads", writers))
    methods: dict[str, float | str] = {}
    best: dict | None = None
    for name in [w for w in WRITERS if w in params.get("writers_used", WRITERS)]:
        if name == "dd" and shutil.which("dd") is None:
            methods[name] = "skipped: no dd"
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        os.sync()  # the previous writer's blocks are freed off the clock
        try:
            with Meter("save") as m:
                _WRITER_FNS[name](path, files, threads)
        except (OSError, subprocess.CalledProcessError) as e:
            methods[name] = f"skipped: {type(e).__name__}: {e}"[:200]
            continue
        methods[name] = m.result["wall_s"]
        if best is None or m.result["wall_s"] < best["wall_s"]:
            best = m.result | {"method": name}
    if best is None:
        raise RuntimeError(f"no raw writer ran: {methods}")
    label = {"threads": f"{threads} threads"}.get(best["method"], best["method"])
    return {"phase": best | {"rss_base": rss_base, "state_bytes": layout.nbytes, "sync_after_s": sync_after(),
                             "methods": methods, "method_label": label}, "disk": tree_stats(path)}


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
