"""One writer process of ``bridges.interop.export(processes=N)``: ``python -m bridges.interop._export_worker
RANK WORLD`` with the export's spec (JSON) on stdin.

It opens the step, plans the export exactly as the parent did (the plan digests must agree, or it
writes nothing), writes the files whose number ``i`` has ``i % WORLD == RANK``, and prints JSON
lines on stdout: ``{"done": bytes}`` as it goes, then ``{"ok": [files], "bytes_read": n}`` or ``{"error": {...}}``
(a CheckpointError's JSON; exit status 1).
"""
from __future__ import annotations

import json
import sys
import time

from ckptfmt.errors import CheckpointError, StepMismatchError
from ckptfmt.interop import prepare_export, quantized, write_part

from bridges.interop._export_map import mapped_tensors, model_tensors
from bridges.mapping._mapfile import mapping_from_json


def main(argv: list[str]) -> int:
    rank, world = int(argv[0]), int(argv[1])
    spec = json.loads(sys.stdin.read())
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.1 or done == total:
            last[0] = now
            print(json.dumps({"done": done}), flush=True)

    try:
        mapping = mapping_from_json(spec["mapping"]) if spec["mapping"] is not None else None
        tensors = ((lambda ckpt: mapped_tensors(ckpt, mapping, spec["dtype"])[:2]) if mapping is not None else
                   lambda ckpt: model_tensors(ckpt, spec["dtype"], ignore=spec["ignore"], optimizer=spec["optimizer"]))
        tensors = quantized(tensors, spec.get("quantize"), spec["dtype"], [])
        ckpt, plan, _ = prepare_export(spec["url"], step=spec["step"], tensors=tensors, dtype=spec["dtype"],
                                       max_shard_size=spec["max_shard_size"])
        if plan.digest != spec["digest"]:
            raise StepMismatchError("this writer planned a different export than the first one", object=spec["url"],
                                    expected=spec["digest"][:16], found=plan.digest[:16])
        files = write_part(ckpt, plan, spec["out_dir"], part=(rank, world), progress=progress)
    except CheckpointError as e:
        print(json.dumps({"error": e.to_json()}), flush=True)
        return 1
    print(json.dumps({"ok": files, "bytes_read": int(ckpt.stats.bytes_read)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
