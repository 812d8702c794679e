"""Profile ckptfmt saves in one fresh process: wall, user and system CPU, page faults, per-phase
times, what the block device did on the save's clock, and (``--cprofile``) a cProfile top list.

usage: python -m devtools.profile_save [--size 1GiB] [--devices 8] [--saves 2]
           [--after-other SIZE] [--delete-other] [--cache {sync,drop}] [--sync-mode {syncfs,fsync}]
           [--write-threads N] [--cprofile N] [DIR]

Builds the bench's state (row-sharded over ``--devices`` JAX CPU devices), then saves it
``--saves`` times with ``bridges.jax.save`` into DIR (a temporary directory by default). The
first save is the fresh-process one; the rest are steady-state saves in the same process.

``--after-other SIZE`` first writes SIZE bytes as another system would save them (8 files,
one thread each, ``fsync``'d, the directory ``fsync``'d: see :func:`other_save`) into
``DIR/other``, left on disk (``--delete-other``: removed again) before each save; ``--cache``
then syncs (default) or drops the page cache (root) before the save, as ``ckptfmt bench
--rotate --save-cache`` does. The ``disk`` line is the save's delta of the block device's
counters (``/sys/dev/block/M:m/stat``: read requests and their milliseconds, write requests, MiB written, flush requests and the
milliseconds the device spent on them, discards), read before and after the save: the whole
device's, so other processes' I/O is in it; the ``this process`` line is ``/proc/self/io``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

#: Fields of /sys/block/<dev>/stat (Documentation/block/stat.rst), by index.
_STAT_FIELDS = {"reads": 0, "read_ms": 3, "writes": 4, "write_sectors": 6, "write_ms": 7, "discards": 11, "flushes": 15, "flush_ms": 16}


def block_stat(path: str) -> dict[str, int]:
    """The block device counters behind ``path`` (empty when the device has none: tmpfs)."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            v = [int(x) for x in f.read().split()]
    except OSError:
        return {}
    return {k: v[i] for k, i in _STAT_FIELDS.items() if i < len(v)}


def disk_delta(a: dict[str, int], b: dict[str, int]) -> str:
    if not a or not b:
        return "disk: no block-device counters"
    d = {k: b[k] - a[k] for k in a}
    return (f"disk: reads {d['reads']} ({d['read_ms']} ms)  writes {d['writes']}  {d['write_sectors'] * 512 / 2**20:.0f} MiB  write_ms {d['write_ms']}  "
            f"flushes {d.get('flushes', '?')}  flush_ms {d.get('flush_ms', '?')}  discards {d.get('discards', '?')}")


def _proc_io() -> dict[str, int]:
    """``/proc/self/io`` (read_bytes: what this process's reads took from the device, metadata
    such as block bitmaps included)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def other_save(path: str, nbytes: int, files: int = 8) -> None:
    """Another system's save: ``files`` files of ``nbytes / files`` each, written by one thread
    each in 8 MiB pieces and ``fsync``'d, then the directory ``fsync``'d (the raw limit's writer)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    piece = memoryview(os.urandom(8 << 20))

    def one(i: int) -> None:
        fd = os.open(os.path.join(path, f"o{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes // files
            while left > 0:
                left -= os.write(fd, piece[: min(left, len(piece))])
            os.fsync(fd)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _before_save(a: argparse.Namespace, root: str, nbytes: int) -> None:
    if nbytes:
        other_save(os.path.join(root, "other"), nbytes)
        if a.delete_other:
            shutil.rmtree(os.path.join(root, "other"))
    from ckptfmt_tools.bench.child import drop_page_cache

    if a.cache == "drop" and not drop_page_cache():
        print("(page cache could not be dropped: synced only)")
    os.sync()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_save")
    p.add_argument("dir", nargs="?")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--write-threads", type=int, default=None, help="the save's writer threads (default: the library's)")
    p.add_argument("--sync-mode", choices=("syncfs", "fsync"), default=None,
                   help="the repository option sync_mode (default: the library's)")
    p.add_argument("--after-other", default="0", metavar="SIZE", help="write SIZE as another system's save before each save")
    p.add_argument("--delete-other", action="store_true", help="remove the other save again before ours")
    p.add_argument("--cache", choices=("sync", "drop"), default="sync", help="before each save: sync, or sync and drop")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions by cumulative time")
    a = p.parse_args(argv)
    from ckptfmt_tools.bench.args import parse_size
    from ckptfmt_tools.bench.jaxstate import xla_env

    os.environ.update(xla_env(a.devices))
    import bridges.jax as bj  # noqa: F401  -- imported before the state is built

    from ckptfmt_tools.bench.jaxstate import make_state
    from ckptfmt_tools.bench.layout import StateLayout

    layout = StateLayout.for_size(parse_size(a.size), a.tensors, (a.devices,))
    state = make_state(layout, a.devices)
    root = a.dir or tempfile.mkdtemp(prefix="ckptfmt-profile-")
    os.makedirs(root, exist_ok=True)
    for n in range(a.saves):
        _before_save(a, root, parse_size(a.after_other))
        _one_save(a, n, root, state)
    return 0


def _one_save(a: argparse.Namespace, n: int, root: str, state: Any) -> None:
    import cProfile
    import io
    import pstats
    import resource
    import time

    import bridges.jax as bj
    from ckptfmt import Repository, SaveOptions, StorageOptions

    phases: dict[str, float] = {}
    opts = StorageOptions(write_threads=a.write_threads or StorageOptions.write_threads, sync_mode=a.sync_mode or None)
    shutil.rmtree(os.path.join(root, f"s{n}"), ignore_errors=True)
    os.sync()
    repo = Repository(os.path.join(root, f"s{n}"), options=opts)
    io0 = _proc_io()
    d0, r0, t0 = block_stat(root), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    prof = cProfile.Profile() if a.cprofile else None
    if prof:
        prof.enable()
    bj.save(repo, state, step=1, options=SaveOptions(timings=phases))
    if prof:
        prof.disable()
    wall, r1, d1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), block_stat(root)
    io1 = _proc_io()
    kind = "fresh" if n == 0 else "steady"
    print(f"save {n} ({kind}): wall {wall:.3f} s  user {r1.ru_utime - r0.ru_utime:.3f} s  "
          f"sys {r1.ru_stime - r0.ru_stime:.3f} s  minflt {r1.ru_minflt - r0.ru_minflt}  "
          f"majflt {r1.ru_majflt - r0.ru_majflt}  maxrss {r1.ru_maxrss >> 10} MiB")
    print("  phases: " + "  ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print("  " + disk_delta(d0, d1))
    print(f"  this process: read from disk {(io1.get('read_bytes', 0) - io0.get('read_bytes', 0)) / 2**10:.0f} KiB  "
          f"written {(io1.get('write_bytes', 0) - io0.get('write_bytes', 0)) / 2**20:.0f} MiB  "
          f"syscalls r/w {io1.get('syscr', 0) - io0.get('syscr', 0)}/{io1.get('syscw', 0) - io0.get('syscw', 0)}")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.cprofile)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-6000:])
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
