"""Figures for the torch bridge (not a test): load into 4 ranks, ours vs DCP's own format.

    python tests/torchproc/bench_load.py OUTDIR [n rows cols repeats]

Saves n float32 (rows, cols) tensors as DTensor Shard(0) at world 8, once with
bridges.torch.save and once with dcp.save; then at world 4 (Shard(0): 8 -> 4 resharding) times
bridges.torch.load, dcp.load of DCP's own format, and dcp.load through CkptfmtStorageReader
(medians of ``repeats``, warm page cache), and reports bytes read per rank vs its shard bytes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent.parent), str(Path(__file__).resolve().parent.parent)]
from torchproc.launch import run_world  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    n, rows, cols, repeats = (int(x) for x in (sys.argv[2:6] or (16, 512, 1024, 3)))
    args = {"ours": str(out / "ours"), "dcp": str(out / "dcp"), "n": n, "rows": rows, "cols": cols,
            "repeats": repeats}
    saved = run_world("bench_save", 8, out, args, timeout=600)
    loaded = run_world("bench_load", 4, out, args, timeout=600)
    total = n * rows * cols * 4
    print(json.dumps({"total_bytes": total, "save_rank0": saved[0],
                      "load": [{k: r[k] for k in ("median_s", "bytes_read", "bytes_read_via_dcp", "local_bytes")}
                               for r in loaded]}, indent=1))


if __name__ == "__main__":
    main()
