"""What a save's folders cost the file system under a save cadence: ckptfmt's keys against a flat chunk key.

A measurement of the file system, not of ckptfmt: one thread writes the objects of the training
cadence's state (:data:`ARRAYS`: the 16 tensors of ``tailstep``'s 32 MiB state, one object
each) in two layouts, alternately, each keeping its two newest saves and deleting the older ones,
with a pause between rounds as a cadence has:

- ``keys``: ckptfmt's own keys (:func:`ckptfmt.layout.shard_key`, ``t/<i>/c/<g0>/<g1>``: zarr's
  "default" chunk-key encoding, one folder per key level), plus each array's ``zarr.json`` and the
  global state object;
- ``flat``: the same objects with a flat chunk key (``t/<i>/c.<g0>.<g1>``: zarr's "default"
  encoding with the separator "."), which would make no folder below the array's.

Each save's objects are written with ``O_DIRECT`` (no page cache, as ckptfmt's writer does) and
made durable with one ``syncfs``. It prints, per block of rounds, the median CPU time of the
thread per save and per delete (``time.thread_time``) and the save's wall time, and the inodes
of one save in each layout. ``python -m devtools.inode_churn DIR [--rounds N]``.

On ext4 without a journal the inode allocator skips recently freed inodes one at a time
(``recently_deleted`` in ``fs/ext4/ialloc.c``), so a cadence that deletes as it saves pays for
every inode it creates (docs/profile-save.md section 11).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time
from typing import Any

from ckptfmt import layout
from ckptfmt.storage import _durable

#: (rank, bytes) of the cadence state's tensors (``tailstep.MODEL``: 4 layers of 1024 x 1024
#: float32 weights and 1024 biases, params and momentum), one object each.
ARRAYS: tuple[tuple[int, int], ...] = ((2, 4 << 20), (1, 4 << 10)) * 8
LAYOUTS = ("keys", "flat")
_ALIGN = 4096


def objects(kind: str, save_id: str) -> list[tuple[str, int]]:
    """Every object of one save of the state in layout ``kind`` (``keys`` or ``flat``), with its size."""
    if kind not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {kind!r}")
    out = [(layout.state_key(save_id, None), 1024)]
    for i, (ndim, nbytes) in enumerate(ARRAYS):
        path = layout.array_path(save_id, i)
        cell = (0,) * ndim
        chunk = layout.shard_key(path, cell) if kind == "keys" else f"{path}/c." + ".".join(map(str, cell))
        out += [(f"{path}/zarr.json", 512), (chunk, nbytes)]
    return out


def _syncfs(path: str) -> None:
    """ckptfmt's own ``syncfs`` of the file system (``fsync`` of ``path`` where it is missing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        (_durable.syncfs if _durable.filesystem_sync_available() else os.fsync)(fd)
    finally:
        os.close(fd)


def write_save(root: str, kind: str, save_id: str, buf: Any) -> None:
    """One save's objects under ``root``, each written with O_DIRECT where the file system allows it."""
    for key, nbytes in objects(kind, save_id):
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        padded = -(-nbytes // _ALIGN) * _ALIGN
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # a file system without O_DIRECT (tmpfs)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.pwrite(fd, memoryview(buf)[:padded], 0)
        finally:
            os.close(fd)
    _syncfs(root)


def inodes(folder: str) -> int:
    """Files and folders in ``folder``, itself included."""
    return 1 + sum(len(d) + len(f) for _, d, f in os.walk(folder))


def run(root: str, rounds: int = 100, block: int = 20, pause_s: float = 0.2, log: Any = print) -> dict:
    """Alternate the two layouts for ``rounds`` rounds under ``root`` (removed first and after);
    the per-round figures by layout, and the inodes of one save in each."""
    shutil.rmtree(root, ignore_errors=True)
    buf = mmap.mmap(-1, max(n for _, n in ARRAYS))
    buf.write(os.urandom(len(buf)))
    out: dict[str, dict[str, list[float]]] = {k: {"save_cpu": [], "save_wall": [], "delete_cpu": []} for k in LAYOUTS}
    kept: dict[str, list[str]] = {k: [] for k in LAYOUTS}
    counts: dict[str, int] = {}
    try:
        for r in range(rounds):
            for kind in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                base = os.path.join(root, kind)
                save_id = f"{r:012d}-churn"
                w0, c0 = time.perf_counter(), time.thread_time()
                write_save(base, kind, save_id, buf)
                out[kind]["save_cpu"].append(time.thread_time() - c0)
                out[kind]["save_wall"].append(time.perf_counter() - w0)
                kept[kind].append(os.path.join(base, layout.save_prefix(save_id)))
                counts[kind] = inodes(kept[kind][-1])
                if len(kept[kind]) > 2:
                    c0 = time.thread_time()
                    shutil.rmtree(kept[kind].pop(0))
                    out[kind]["delete_cpu"].append(time.thread_time() - c0)
                time.sleep(pause_s)
            if log and (r + 1) % block == 0:
                log(f"rounds {r + 1 - block:>3}-{r:>3}: " + "; ".join(
                    f"{k}: save CPU {_ms(v['save_cpu'][-block:])} ms (wall {_ms(v['save_wall'][-block:])}), "
                    f"delete CPU {_ms(v['delete_cpu'][-block:])} ms" for k, v in out.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if log:
        log("inodes per save: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    return {"rounds": out, "inodes": counts}


def _ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.1f}" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.inode_churn", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="a scratch folder on the file system to measure (removed first and after)")
    p.add_argument("--rounds", type=int, default=100, help="rounds, each one save of each layout (default 100)")
    p.add_argument("--block", type=int, default=20, help="rounds per printed line (default 20)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between saves (default 0.2)")
    a = p.parse_args(argv)
    run(a.dir, a.rounds, a.block, a.pause)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
