"""Our DCP writer and reader against DCP's own ``FileSystemWriter`` / ``FileSystemReader``.

Prints figures; it is not a test. The same state (``--mib`` MiB of float32 in 16 tensors, each
a DTensor ``Shard(0)`` over 8 gloo ranks) is saved through ``dcp.save`` with
``bridges.dcp.CkptfmtStorageWriter`` ("ours") and with ``FileSystemWriter(sync_files=True)``
("dcp"), then restored through ``dcp.load`` with the matching reader on 4 ranks (``Shard(0)``,
"8 -> 4") and, in the last pair only, on a (2, 2) mesh (``Shard(0), Shard(1)``, "2-D"). Pairs are run ``--reps`` times,
the order of the two rotated each repetition, the page cache dropped before every phase when
this process may (root), else synced only (the output says which). Reported: medians of the
durable save time (first barrier to the last rank's return, after every file is fsync'd), of
the restore time, of the peak RSS summed over ranks, bytes read per rank (``/proc/self/io``
rchar; ours also by the reader's own count) against the rank's 1/N share; and, once at the end,
what a 64-byte flip in the middle of the largest data file does to each restore.

usage: python -m devtools.dcp_writer [--mib 1024] [--reps 5] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from ckptfmt.coord import free_port

from ckptfmt_tools.bench.child import drop_page_cache

TENSORS, COLS = 16, 4096
SYSTEMS = ("ours", "dcp")


def _value(rows: tuple[int, int], cols: tuple[int, int], key: int) -> np.ndarray:
    """The stored value of a block: exact in float32, different in every tensor."""
    r = np.arange(*rows, dtype=np.int64)[:, None]
    c = np.arange(*cols, dtype=np.int64)[None, :]
    return ((r * 7919 + c * 31 + key * 101) % 65521).astype(np.float32)


def _state(rows: int, layout: str, empty: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (rows, COLS)
    if layout == "2d":
        mesh, placements = init_device_mesh("cpu", (2, world // 2)), [Shard(0), Shard(1)]
        i, j = divmod(rank, world // 2)
        rr, cc = rows // 2, COLS // (world // 2)
        box = ((i * rr, (i + 1) * rr), (j * cc, (j + 1) * cc))
    else:
        mesh, placements = init_device_mesh("cpu", (world,)), [Shard(0)]
        rr = rows // world
        box = ((rank * rr, (rank + 1) * rr), (0, COLS))
    out = {}
    for k in range(TENSORS):
        local = (torch.empty((box[0][1] - box[0][0], box[1][1] - box[1][0])) if empty
                 else torch.from_numpy(_value(box[0], box[1], k)))
        out[f"w{k:02d}"] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                              stride=(COLS, 1))
    return {"model": out, "_box": box}


def _io_rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _rank_phase(p: dict[str, Any]) -> dict[str, Any]:
    """One rank of one phase: save (8 ranks) or load ("1d" 4 ranks, "2d" (2, 2)); checks values."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from bridges.dcp import CkptfmtStorageReader, CkptfmtStorageWriter

    st = _state(p["rows"], p["layout"], empty=p["mode"] == "load")
    box, sd = st["_box"], {"model": st["model"]}
    dist.barrier()
    _hwm_reset()
    rss0 = _hwm()  # the state (or the target) is allocated: what follows is the save's or load's own
    io0, t0 = _io_rchar(), time.perf_counter()
    out: dict[str, Any] = {}
    try:
        if p["mode"] == "save":
            writer = (CkptfmtStorageWriter(p["path"], step=1) if p["system"] == "ours"
                      else dcp.FileSystemWriter(p["path"], sync_files=True))
            dcp.save(sd, storage_writer=writer)
        else:
            reader = (CkptfmtStorageReader(p["path"]) if p["system"] == "ours" else dcp.FileSystemReader(p["path"]))
            dcp.load(sd, storage_reader=reader)
            out["reader_bytes"] = int(getattr(reader, "bytes_read", -1))
    except BaseException as e:  # noqa: BLE001 -- DCP wraps rank errors in CheckpointException(BaseException)
        inner = [f[0] if isinstance(f, tuple) else getattr(f, "exception", f)
                 for f in getattr(e, "failures", {}).values()]
        out["error"] = type(e).__name__ + "".join(f" / {type(x).__name__}: {str(x)[:160]}" for x in inner[:1])
    out.update(wall_s=time.perf_counter() - t0, rchar=_io_rchar() - io0, peak_rss=_hwm(), rss_before=rss0)
    dist.barrier()
    if p["mode"] == "load" and "error" not in out:
        wrong = sum(int((v.to_local().numpy() != _value(box[0], box[1], int(k[1:]))).sum())
                    for k, v in sd["model"].items())
        out["wrong_values"] = wrong
    out["share"] = (box[0][1] - box[0][0]) * (box[1][1] - box[1][0]) * 4 * TENSORS
    return out


def _launch(p: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Fork ``world`` gloo ranks of this (torch-imported) process for one phase."""
    import torch
    import torch.distributed as dist

    port, tmp = free_port(), tempfile.mkdtemp(prefix="ckptfmt-dcpbench-")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                torch.set_num_threads(1)
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
                res = _rank_phase(p)
                dist.destroy_process_group()
                with open(os.path.join(tmp, f"{rank}.json"), "w") as f:
                    json.dump(res, f)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if any(codes):
        raise RuntimeError(f"phase {p} failed: exit codes {codes}")
    out = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _cold(dropped: list[bool]) -> None:
    dropped.append(drop_page_cache())


def _pair(root: str, rows: int, order: tuple[str, ...], dropped: list[bool], two_d: bool) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {}
    for system in order:
        path = os.path.join(root, system)
        shutil.rmtree(path, ignore_errors=True)
        base = {"system": system, "path": path, "rows": rows}
        _cold(dropped)
        save = _launch(dict(base, mode="save", layout="1d"), 8)
        _cold(dropped)
        load = _launch(dict(base, mode="load", layout="1d"), 4)
        two: list[dict[str, Any]] = []
        if two_d:  # bytes read per rank: one pair is enough (they do not vary between runs)
            _cold(dropped)
            two = _launch(dict(base, mode="load", layout="2d"), 4)
        res[system] = {"save_s": max(r["wall_s"] for r in save), "save_rss": sum(r["peak_rss"] for r in save),
                       "save_extra": sum(r["peak_rss"] - r["rss_before"] for r in save),
                       "load_extra": sum(r["peak_rss"] - r["rss_before"] for r in load),
                       "load_s": max(r["wall_s"] for r in load), "load_rss": sum(r["peak_rss"] for r in load),
                       "load_rchar": [r["rchar"] for r in load], "load_share": load[0]["share"],
                       "two_rchar": [r["rchar"] for r in two], "two_reader": [r.get("reader_bytes") for r in two],
                       "two_share": two[0]["share"] if two else 0, "two_wall": max((r["wall_s"] for r in two), default=0.0),
                       "wrong": sum(r.get("wrong_values", 0) for r in load + two),
                       "errors": [r["error"] for r in load + two if "error" in r]}
    return res


def _flip_target(system: str, path: str) -> tuple[str, int]:
    """A file and an offset inside stored tensor bytes: the middle of our largest shard object;
    for DCP the middle of its largest tensor record (a ``torch.save`` stream), from its metadata."""
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        info = max(dcp.FileSystemReader(path).read_metadata().storage_data.values(), key=lambda i: i.length)
        return os.path.join(path, info.relative_path), info.offset + info.length // 2
    files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names
             if not n.endswith(".json") and "manifest" not in d]
    victim = max(files, key=os.path.getsize)
    return victim, os.path.getsize(victim) // 2


def _flip(root: str, rows: int) -> dict[str, Any]:
    """Flip 64 bytes inside stored tensor data of each system; restore 8 -> 4 once."""
    out = {}
    for system in SYSTEMS:
        path = os.path.join(root, system)
        victim, at = _flip_target(system, path)
        with open(victim, "r+b") as f:
            f.seek(at)
            raw = f.read(64)
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in raw))
        load = _launch({"system": system, "path": path, "rows": rows, "mode": "load", "layout": "1d"}, 4)
        errs = sorted({r["error"] for r in load if "error" in r})
        out[system] = {"file": f"{os.path.relpath(victim, path)} at byte {at:,}", "errors": errs,
                       "wrong_values": sum(r.get("wrong_values", 0) for r in load)}
    return out


def _median(runs: list[dict[str, dict[str, Any]]], system: str, key: str) -> float:
    return statistics.median(r[system][key] for r in runs)


def report(runs: list[dict[str, dict[str, Any]]], flip: dict[str, Any], mib: int, dropped: list[bool]) -> str:
    lines = [f"state {mib} MiB float32 in {TENSORS} tensors; save 8 ranks, restore 4 ranks; {len(runs)} pairs, "
             f"order rotated; page cache {'dropped' if all(dropped) else 'NOT dropped (synced only)'} before each phase"]
    for key, name, scale in (("save_s", "durable save (s)", 1), ("load_s", "restore 8 -> 4 (s)", 1),
                             ("save_rss", "peak RSS, save, sum of 8 ranks (MiB)", 2**20),
                             ("save_extra", "  of which above the state, save (MiB)", 2**20),
                             ("load_rss", "peak RSS, restore 8 -> 4, sum of 4 ranks (MiB)", 2**20),
                             ("load_extra", "  of which above the target, restore (MiB)", 2**20)):
        vals = {s: _median(runs, s, key) / scale for s in SYSTEMS}
        each = {s: ", ".join(f"{r[s][key] / scale:.2f}" for r in runs) for s in SYSTEMS}
        lines.append(f"{name:48s} ours {vals['ours']:9.2f}  dcp {vals['dcp']:9.2f}  ratio {vals['ours'] / vals['dcp']:.2f}"
                     f"   [ours {each['ours']}] [dcp {each['dcp']}]")
    last = runs[-1]
    for s in SYSTEMS:
        share = last[s]["two_share"]
        rd = last[s]["two_rchar"]
        lines.append(f"restore 8 -> (2, 2), {s}: {last[s]['two_wall']:.2f} s (last pair only)")
        own = [f"{b / share:.3f}" for b in last[s]["two_reader"]] if s == "ours" else None
        lines.append(f"2-D restore bytes read per rank, {s}: rchar {[f'{b / share:.3f}' for b in rd]} x the 1/4 share "
                     f"({share:,} B)" + (f"; the reader's own count {own}" if own else ""))
        per = [f"{b / last[s]['load_share']:.3f}" for b in last[s]["load_rchar"]]
        lines.append(f"8 -> 4 restore bytes read per rank, {s}: rchar {per} x the share")
        lines.append(f"values wrong after every clean restore, {s}: {sum(r[s]['wrong'] for r in runs)}; errors: "
                     f"{sorted({e for r in runs for e in r[s]['errors']})}")
    for s in SYSTEMS:
        f = flip[s]
        lines.append(f"64-byte flip in {f['file']}, {s}: errors {f['errors'] or 'none'}; wrong values {f['wrong_values']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m devtools.dcp_writer")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    import torch  # noqa: F401  -- imported once, before the ranks are forked
    import torch.distributed.checkpoint  # noqa: F401

    import bridges.dcp  # noqa: F401

    rows = args.mib * 2**20 // (TENSORS * COLS * 4)
    if rows % 8:
        raise SystemExit(f"--mib {args.mib}: rows per tensor ({rows}) must divide by 8")
    root = args.dir or tempfile.mkdtemp(prefix="ckptfmt-dcpbench-")
    dropped: list[bool] = []
    runs = []
    t0 = time.time()
    for rep in range(args.reps):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        runs.append(_pair(root, rows, order, dropped, two_d=rep == args.reps - 1))
        times = {s: {k: round(v, 2) for k, v in runs[-1][s].items() if k.endswith("_s")} for s in SYSTEMS}
        print(f"pair {rep + 1}/{args.reps} ({' then '.join(order)}): {json.dumps(times)}", flush=True)
    flip = _flip(root, rows)
    print(report(runs, flip, args.mib, dropped))
    print(f"total {time.time() - t0:.0f} s; load average at the end {os.getloadavg()}")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
