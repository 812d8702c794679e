"""Safety probe: flip 64 bytes inside tensor data, restore, and see who notices.

The parent flips bytes in the middle of the largest object of a checkpoint
(:func:`corrupt`); a fresh child then runs that system's ordinary restore task
and compares the values with the generator (:func:`probe`). Outcomes:

- ``detected``: the restore raised (the error's type is reported);
- ``silent``: the restore returned, and the values are wrong;
- ``missed``: the restore returned correct values (the flip hit unused bytes).
"""

from __future__ import annotations

import importlib
import os

FLIP_BYTES = 64


def corrupt(path: str, system: str = "") -> dict:
    """XOR 64 bytes inside tensor data of the checkpoint at ``path``; return where.

    DCP: the middle of its largest stored item (located through its own metadata);
    every other system: the middle of the largest file (ckptfmt keeps the shard
    index at the end of each shard object, so the middle is chunk data).
    """
    if system == "dcp":
        return _corrupt_dcp(path)
    best: tuple[int, str] | None = None
    for root, _dirs, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            size = os.path.getsize(p)
            if best is None or (size, p) > best:
                best = (size, p)
    if best is None or best[0] < 2 * FLIP_BYTES:
        raise FileNotFoundError(f"no data object to corrupt under {path}")
    size, victim = best
    return _flip(path, victim, (size // 2) // 4096 * 4096)


def _corrupt_dcp(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata()
    info = max(md.storage_data.values(), key=lambda i: (i.length, i.relative_path, i.offset))
    return _flip(path, os.path.join(path, info.relative_path), info.offset + info.length // 2)


def _flip(path: str, victim: str, offset: int) -> dict:
    with open(victim, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(FLIP_BYTES))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return {"object": os.path.relpath(victim, path), "offset": offset, "bytes": FLIP_BYTES}


def probe(params: dict) -> dict:
    """Child task: run ``params["task"]`` (a restore task) with ``params["inner"]``; classify the outcome."""
    mod, fn = params["task"].split(":")
    task = getattr(importlib.import_module(mod), fn)
    try:
        task(params["inner"] | {"check": True})
    except AssertionError as e:  # the restore returned, the values differ
        return {"outcome": "silent", "detail": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException derives from BaseException
        return {"outcome": "detected", "error_type": getattr(e, "error_type", type(e).__name__), "detail": str(e)[:300]}
    return {"outcome": "missed", "detail": "values were correct: the flip hit bytes no tensor uses"}
