"""Optional zstd compression (issue 18, FORMAT.md 6.3): ratio and speed by kind of state.

``ckptfmt bench --compression [--size 64MiB] [--levels 1,3]`` (or ``python -m
ckptfmt_tools.bench.compression``) saves float32 weights, bfloat16 weights and Adam moments
(first and second) through the core API, once raw and once per zstd level, and prints for each
the stored bytes, the ratio, the save and restore time (every restore verified). Weights are
N(0, 0.02); gradients N(0, 1e-3) give mu = 0.1 g and nu = 0.001 g^2, as early in training.
Figures depend on the disk and on what else runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "run"]

_COLS = 1024


def kinds(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    rows = max(1, nbytes // (4 * _COLS))
    w = (rng.standard_normal((rows, _COLS)) * 0.02).astype(np.float32)
    g = (rng.standard_normal((rows, _COLS)) * 1e-3).astype(np.float32)
    bf = (rng.standard_normal((2 * rows, _COLS)) * 0.02).astype(ml_dtypes.bfloat16)
    return {"float32 weights": w, "bfloat16 weights": bf, "adam mu (float32)": 0.1 * g, "adam nu (float32)": 1e-3 * g * g}


def run(root: Path, *, size: int, levels: tuple[int, ...]) -> dict[str, Any]:
    import ckptfmt
    from ckptfmt import Box, LocalShard, SaveOptions

    rows: list[dict[str, Any]] = []
    step = 0
    for name, v in kinds(size).items():
        blocks = [LocalShard("x", v.shape, v.dtype, Box((r, 0), (v.shape[0] // 4, _COLS)), v[r:r + v.shape[0] // 4])
                  for r in range(0, v.shape[0], v.shape[0] // 4)]
        raw_bytes = None
        for codec, level in [("raw", 0), *(("zstd", lv) for lv in levels)]:
            url = str(root / f"{step}")
            t0 = time.perf_counter()
            m = ckptfmt.save(url, 0, blocks, options=SaveOptions(codec=codec, codec_level=level or 3, reuse="off"))
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = ckptfmt.Repository(url).open(0).read("x")
            restore_s = time.perf_counter() - t0
            stored = int(m.tensors["x"].shards.nbytes.sum())
            raw_bytes = raw_bytes or stored
            rows.append({"kind": name, "codec": codec if codec == "raw" else f"zstd-{level}", "data_bytes": v.nbytes,
                         "stored_bytes": stored, "ratio": round(raw_bytes / stored, 3), "save_s": round(save_s, 3),
                         "restore_s": round(restore_s, 3), "save_MiB_s": round(v.nbytes / save_s / 2**20, 1),
                         "restore_MiB_s": round(v.nbytes / restore_s / 2**20, 1),
                         "bit_for_bit": got.tobytes() == v.tobytes()})
            shutil.rmtree(url, ignore_errors=True)
            step += 1
    return {"ok": all(r["bit_for_bit"] for r in rows), "rows": rows}


def _table(doc: dict[str, Any]) -> str:
    lines = [f"{'kind':<20} {'codec':<8} {'MiB':>7} {'stored MiB':>10} {'ratio':>6} {'save MiB/s':>10} {'restore MiB/s':>13}"]
    for r in doc["rows"]:
        lines.append(f"{r['kind']:<20} {r['codec']:<8} {r['data_bytes'] / 2**20:>7.1f} {r['stored_bytes'] / 2**20:>10.1f} "
                     f"{r['ratio']:>6.3f} {r['save_MiB_s']:>10.1f} {r['restore_MiB_s']:>13.1f}")
    lines.append("every restore bit for bit: " + str(doc["ok"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .args import parse_size

    p = argparse.ArgumentParser(prog="ckptfmt bench --compression", description=__doc__.splitlines()[0])
    p.add_argument("--compression", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=parse_size, default=64 << 20, help="bytes of each kind (default 64MiB)")
    p.add_argument("--levels", default="1,3", help="zstd levels (default 1,3)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ckptfmt-zstd-"))
    try:
        doc = run(tmp, size=args.size, levels=tuple(int(x) for x in args.levels.split(",") if x.strip()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(doc, indent=2) if args.json else _table(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
