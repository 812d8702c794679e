"""Test helpers: save layouts (who holds which box) and running N writers as threads or processes."""
from __future__ import annotations

import threading
from itertools import product
from typing import Callable, Sequence

import numpy as np

from ckptfmt import Box, LocalShard, TcpCoordinator, save
from ckptfmt.coord import free_port


def chunk_split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-style split of n into `parts` (offset, length) pairs; trailing parts may be empty."""
    size = -(-n // parts) if n else 0
    out = []
    for p in range(parts):
        lo = min(n, p * size)
        out.append((lo, min(n, lo + size) - lo))
    return out


def grid_boxes(shape: Sequence[int], mesh: Sequence[int]) -> list[Box]:
    """Boxes of a tensor split over a mesh (one mesh axis per leading tensor dim; 1 = not split), rank-major."""
    per_dim = [chunk_split(shape[d], mesh[d]) if d < len(mesh) else [(0, shape[d])] for d in range(len(shape))]
    return [Box(tuple(o for o, _ in c), tuple(n for _, n in c)) for c in product(*per_dim)]


def layout(kind: str, shape: Sequence[int], world: int) -> list[list[tuple[Box, int]]]:
    """Per rank: [(box, replica_id)]. kinds: rows, cols, grid (2-D mesh), replicated, partial (rows x 2 replicas)."""
    nd = len(shape)
    if kind == "replicated" or nd == 0:
        return [[(Box.full(tuple(shape)), r)] for r in range(world)]
    if kind == "rows":
        return [[(b, 0)] for b in grid_boxes(shape, [world])]
    if kind == "cols":
        return [[(b, 0)] for b in grid_boxes(shape, [1, world] if nd > 1 else [world])]
    if kind == "grid":
        a = 2 if world % 2 == 0 else 1
        return [[(b, 0)] for b in grid_boxes(shape, [world // a, a] if nd > 1 else [world])]
    if kind == "partial":
        half = max(1, world // 2)
        boxes = grid_boxes(shape, [half])
        return [[(boxes[r % half], r // half)] for r in range(world)]
    raise ValueError(kind)


def shards_for(arrays: dict[str, np.ndarray], held: dict[str, list[tuple[Box, int]]]) -> list[LocalShard]:
    out = []
    for key, arr in arrays.items():
        for box, rep in held[key]:
            sl = box.slices()
            out.append(LocalShard(key, arr.shape, arr.dtype, box, arr[sl] if sl else arr[...], replica_id=rep))
    return out


def save_threads(url: str, step: int, arrays: dict[str, np.ndarray], kind: str | dict[str, str], world: int,
                 **kw) -> list:
    """Run `world` writers as threads, each with its own TcpCoordinator rank; returns per-rank results."""
    addr = f"127.0.0.1:{free_port()}"
    results: list = [None] * world
    kinds = kind if isinstance(kind, dict) else {k: kind for k in arrays}
    lay = {k: layout(kinds[k], a.shape, world) for k, a in arrays.items()}

    def run(r: int) -> None:
        try:
            with TcpCoordinator(addr, r, world, timeout_s=60) as c:
                results[r] = save(url, step, shards_for(arrays, {k: lay[k][r] for k in arrays}), coordinator=c, **kw)
        except Exception as e:  # reported to the test
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results
