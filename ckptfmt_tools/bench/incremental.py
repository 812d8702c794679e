"""Incremental saves (issue 18, FORMAT.md 8.4): a frozen base plus trained adapters and their Adam
moments, saved by ``bridges.jax.save`` from N JAX CPU devices.

``ckptfmt bench --incremental [--base-size 1GiB] [--adapter-size 16MiB] [--saves 4]``
(or ``python -m ckptfmt_tools.bench.incremental ...``) prints, for every save, the bytes it wrote
and referenced and its wall time; restores every step onto M devices and compares it bit for bit;
then deletes the base step's manifest through retention and shows that the objects the later steps
reference stay until no manifest references them. ``--adapter-size`` is the adapters and their two
Adam moments together (a third each). One child process, since JAX's device count is fixed by
``XLA_FLAGS`` before it is imported. Figures depend on the disk and on what else runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run"]

_CHILD = "_CKPTFMT_BENCH_INCREMENTAL_CHILD"
_COLS = 1024  # float32 columns of every tensor


def _parser() -> argparse.ArgumentParser:
    from .args import parse_size

    p = argparse.ArgumentParser(prog="ckptfmt bench --incremental", description=__doc__.splitlines()[0])
    p.add_argument("--incremental", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base-size", type=parse_size, default=1 << 30, help="frozen base bytes (default 1GiB)")
    p.add_argument("--base-tensors", type=int, default=8, help="frozen base tensors (default 8)")
    p.add_argument("--adapter-size", type=parse_size, default=16 << 20,
                   help="adapters plus their two Adam moments, bytes (default 16MiB)")
    p.add_argument("--saves", type=int, default=4, help="saves, the first one full (default 4)")
    p.add_argument("--save-devices", type=int, default=8)
    p.add_argument("--restore-devices", type=int, default=4)
    p.add_argument("--output-dir", "-o", default=None, help="where the repository goes (default: a temporary dir)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run in a child process with the JAX device count set; print its figures. 1 when a check failed."""
    args = _parser().parse_args(argv)
    if os.environ.get(_CHILD) != "1":
        from .jaxstate import xla_env

        env = dict(os.environ, **xla_env(max(args.save_devices, args.restore_devices)), **{_CHILD: "1"})
        argv = list(sys.argv[1:] if argv is None else argv)
        return subprocess.call([sys.executable, "-m", "ckptfmt_tools.bench.incremental", *argv], env=env)
    tmp = None
    out = Path(args.output_dir) if args.output_dir else Path(tmp := tempfile.mkdtemp(prefix="ckptfmt-inc-"))
    try:
        doc = run(out / "repo", base_size=args.base_size, base_tensors=args.base_tensors,
                  adapter_size=args.adapter_size, saves=args.saves, save_devices=args.save_devices,
                  restore_devices=args.restore_devices)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(doc, indent=2) if args.json else _table(doc))
    return 0 if doc["ok"] else 1


def _rows(nbytes: int, devices: int) -> int:
    """Rows of a [rows, _COLS] float32 tensor of about ``nbytes``, a multiple of ``devices``."""
    return max(devices, (nbytes // (4 * _COLS)) // devices * devices)


def run(root: Path, *, base_size: int, base_tensors: int, adapter_size: int, saves: int, save_devices: int,
        restore_devices: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bridges import jax as bridge
    from ckptfmt import Repository, SaveOptions

    if root.exists():
        shutil.rmtree(root)
    url = str(root)

    def sharding(n: int) -> NamedSharding:
        return NamedSharding(Mesh(np.array(jax.devices()[:n]), ("rows",)), PartitionSpec("rows", None))

    save_sh = sharding(save_devices)
    base_rows = _rows(base_size // base_tensors, save_devices)
    ad_rows = _rows(adapter_size // 3 // 4, save_devices)  # 4 adapters, each with mu and nu

    def host_base(i: int) -> np.ndarray:
        return (np.arange(base_rows * _COLS, dtype=np.float32) * (i + 1) % 1009).reshape(base_rows, _COLS)

    base = {f"b{i}": jax.device_put(host_base(i), save_sh) for i in range(base_tensors)}

    def host_trained(step: int) -> dict[str, np.ndarray]:
        out = {}
        for j in range(4):
            v = np.full((ad_rows, _COLS), step + j / 8, np.float32)
            out[f"params/adapter/a{j}"] = v
            out[f"opt/mu/a{j}"] = v * 0.1
            out[f"opt/nu/a{j}"] = v * v
        return out

    def state(step: int) -> dict[str, Any]:
        s: dict[str, Any] = {"params": {"base": dict(base), "adapter": {}}, "opt": {"mu": {}, "nu": {}}}
        for k, v in host_trained(step).items():
            a, b, c = k.split("/")
            s[a][b][c] = jax.device_put(v, save_sh)
        return s

    figures: list[dict[str, Any]] = []
    for step in range(saves):
        st = state(step)
        jax.block_until_ready(jax.tree.leaves(st))
        t0 = time.perf_counter()
        m = bridge.save(url, st, step=step)
        dt = time.perf_counter() - t0
        figures.append({"step": step, "seconds": round(dt, 3), "bytes": m.nbytes, "written_bytes": m.written_nbytes,
                        "referenced_bytes": m.referenced_nbytes, "reuse": "auto"})
    # The byte proof, for a base whose arrays are new objects with the same values (a jitted step
    # that returns the frozen params, say): read and compared instead of rewritten.
    base = {k: jax.device_put(host_base(i), save_sh) for i, k in enumerate(base)}
    st = state(saves)
    jax.block_until_ready(jax.tree.leaves(st))
    t0 = time.perf_counter()
    m = bridge.save(url, st, step=saves)
    figures.append({"step": saves, "seconds": round(time.perf_counter() - t0, 3), "bytes": m.nbytes,
                    "written_bytes": m.written_nbytes, "referenced_bytes": m.referenced_nbytes,
                    "reuse": "auto (new base arrays: byte proof)"})

    # Every step restores bit for bit onto restore_devices devices.
    rsh = sharding(restore_devices)
    restored: dict[int, bool] = {}
    for f in figures:
        step = f["step"]
        want = {f"params/base/b{i}": host_base(i) for i in range(base_tensors)} | host_trained(step)
        target: dict[str, Any] = {}
        for k, v in want.items():
            a, b, c = k.split("/")
            target.setdefault(a, {}).setdefault(b, {})[c] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rsh)
        t0 = time.perf_counter()
        got = bridge.restore(url, target, step=step)
        f["restore_seconds"] = round(time.perf_counter() - t0, 3)
        ok = True
        for k, v in want.items():
            a, b, c = k.split("/")
            arr = got[a][b][c]
            ok &= len(arr.sharding.device_set) == restore_devices and np.asarray(arr).tobytes() == v.tobytes()
        restored[step] = bool(ok)
        del got

    # Retention deletes the base step's manifest; the objects later steps reference stay.
    repo = Repository(url)
    base_save = repo.manifest(0).save_id
    base_dir = root / "saves" / base_save
    report = repo.gc(keep_last=2)
    kept_after_retention = base_dir.is_dir() and 0 not in repo.steps()
    newest = repo.steps()[-1]
    newest_ok = repo.verify(newest) == repo.manifest(newest).nbytes
    # Once no manifest references the base save, collection removes it.
    st = state(saves + 1)
    bridge.save(url, st, step=saves + 1, options=SaveOptions(reuse="off"))
    repo.gc(keep_last=1, grace_s=0.0)
    freed = not base_dir.exists()

    first = figures[0]
    later = figures[1:saves]
    ratio_bytes = max(f["written_bytes"] for f in later) / first["written_bytes"] if later else 0.0
    speedup = first["seconds"] / max(f["seconds"] for f in later) if later else 0.0
    median = sorted(f["seconds"] for f in later)[len(later) // 2] if later else 0.0
    speedup_median = first["seconds"] / median if median else 0.0
    ok = (all(restored.values()) and kept_after_retention and newest_ok and freed
          and ratio_bytes <= 0.03 and speedup >= 10.0)
    return {"ok": bool(ok), "base_bytes": base_rows * _COLS * 4 * base_tensors,
            "trained_bytes": ad_rows * _COLS * 4 * 12, "save_devices": save_devices,
            "restore_devices": restore_devices, "saves": figures,
            "later_written_over_first": round(ratio_bytes, 5), "first_over_slowest_later_seconds": round(speedup, 1),
            "first_over_median_later_seconds": round(speedup_median, 1),
            "restored_bit_for_bit": {str(k): v for k, v in restored.items()},
            "retention": {"removed_steps": report.removed_steps, "base_objects_kept": kept_after_retention,
                          "newest_verifies": bool(newest_ok), "base_objects_freed_once_unreferenced": freed}}


def _table(doc: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [f"incremental saves: base {doc['base_bytes'] / mib:.0f} MiB frozen, {doc['trained_bytes'] / mib:.1f} MiB "
             f"trained (adapters + Adam mu, nu), {doc['save_devices']} devices -> restore on {doc['restore_devices']}",
             f"{'step':>4} {'wrote MiB':>10} {'referenced MiB':>15} {'save s':>8} {'restore s':>10}  proof"]
    for f in doc["saves"]:
        lines.append(f"{f['step']:>4} {f['written_bytes'] / mib:>10.2f} {f['referenced_bytes'] / mib:>15.2f} "
                     f"{f['seconds']:>8.3f} {f.get('restore_seconds', 0):>10.3f}  {f['reuse']}")
    lines.append(f"later saves wrote {100 * doc['later_written_over_first']:.2f}% of the first save's bytes (bound 3%); "
                 f"first save / slowest later save = {doc['first_over_slowest_later_seconds']}x, / median later save = "
                 f"{doc['first_over_median_later_seconds']}x (bound 10x, checked on the slowest)")
    lines.append(f"every step restored bit for bit: {all(doc['restored_bit_for_bit'].values())}; retention: "
                 f"{json.dumps(doc['retention'])}")
    lines.append("OK" if doc["ok"] else "FAILED")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
