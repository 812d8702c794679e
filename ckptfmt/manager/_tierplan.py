"""The elastic local tier's planner (FORMAT.md 8.5, "Elastic restore"): pure, no I/O.

A restore on a process count other than the save's (or one whose processes hold other hosts'
local tiers than their own rank's) plans each box it needs against every surviving copy: the
held boxes of the host repositories each process of the new job holds (its *sources*). Input:
this process's requests (global key path and box) and the sources; output: one
:class:`TierRead` per piece, each naming the process and host repository that serves it (this
process's own first, then the least loaded peer that holds it), and the pieces no source holds,
which only the persistent tier can serve. A request is cut along the edges of every held box that
overlaps it, so a box is assembled from several held boxes, of one source or of several, where
they tile it; nothing is read twice.

Both sides of a restore ask this planner: the feasibility vote (every process plans, then all
agree on a step) and the read, so a restore reads exactly what it planned.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import CheckpointError
from ckptfmt.manager._tiers import HeldBox

__all__ = ["TierSource", "TierRead", "TierPlan", "plan_tier_reads", "assign_hosts"]

Request = tuple[str, Box]
#: A request cut into more cells than this is read from its sources cell by cell only up to here;
#: beyond it the planner gives up on the tiers for that request (the persistent tier serves it).
MAX_CELLS = 1 << 14


@dataclass(frozen=True)
class TierSource:
    """The held boxes of one host repository (``host-<host>``, one local step) that process
    ``rank`` of the restoring job holds."""

    rank: int
    host: int
    boxes: tuple[HeldBox, ...]


@dataclass(frozen=True)
class TierRead:
    """One piece of request ``request`` (an index into the requests): ``part`` in global
    coordinates, served by process ``rank`` from host repository ``host`` (held box ``source``),
    or by the persistent tier when ``rank`` is None. ``held``: the piece is held by
    some source (a persistent read of a held piece is a fallback, counted apart)."""

    request: int
    key: str
    part: Box
    rank: int | None = None
    host: int | None = None
    source: HeldBox | None = None
    held: bool = False
    nbytes: int = 0

    @property
    def local(self) -> tuple[str, Box]:
        """The held tensor and the box within it that this piece reads (a tier read only)."""
        assert self.source is not None
        return self.source.local, self.source.within(self.part)


@dataclass(frozen=True)
class TierPlan:
    """The reads of one process, and its empty requests with their dtypes (nothing to read)."""

    reads: tuple[TierRead, ...]
    empty: tuple[tuple[int, str], ...]

    def by_rank(self, rank: int | None) -> list[TierRead]:
        return [r for r in self.reads if r.rank == rank]

    @property
    def persistent(self) -> list[TierRead]:
        return self.by_rank(None)

    def peers(self, me: int) -> list[int]:
        """The other processes this plan reads from, in order."""
        return sorted({r.rank for r in self.reads if r.rank is not None and r.rank != me})


def assign_hosts(listed: Sequence[Sequence[int]]) -> dict[int, int]:
    """Which process holds each host repository: ``listed[r]`` names the host repositories process
    ``r`` finds under its tier path. A host repository found by several processes (a path they
    share, as on one machine) is held by the process whose rank is the host's number when that
    process finds it, else by the lowest such rank. Pure; every process computes the same map."""
    out: dict[int, int] = {}
    for rank, hosts in enumerate(listed):
        for h in hosts:
            h = int(h)
            if h not in out or (h == rank and out[h] != h):
                out[h] = rank
    return out


def _cells(box: Box, held: Sequence[Box]) -> list[Box]:
    """``box`` cut along every edge of ``held`` (each overlapping it): each cell lies inside or
    outside each held box."""
    edges = []
    for d in range(box.ndim):
        lo, hi = box.offset[d], box.stop[d]
        cuts = {lo, hi}
        for h in held:
            cuts.update(x for x in (h.offset[d], h.stop[d]) if lo < x < hi)
        edges.append(sorted(cuts))
    out = []
    for idx in itertools.product(*(range(len(e) - 1) for e in edges)):
        out.append(Box(tuple(edges[d][i] for d, i in enumerate(idx)),
                       tuple(edges[d][i + 1] - edges[d][i] for d, i in enumerate(idx))))
    return out


def _inside(cell: Box, box: Box) -> bool:
    return all(o0 <= o and o + n <= o0 + n0 for o0, n0, o, n in zip(box.offset, box.shape, cell.offset, cell.shape))


def _itemsize(dtype: str) -> int:
    try:
        return int(np.dtype(numpy_dtype(dtype)).itemsize)
    except (CheckpointError, TypeError, ValueError):
        return 1


def plan_tier_reads(me: int, requests: Sequence[Request], sources: Sequence[TierSource]) -> TierPlan:
    """Plan ``requests`` of process ``me`` against ``sources`` (FORMAT.md 8.5, "Elastic restore").

    Each request is cut into cells along the edges of the held boxes (of its key and rank) that
    overlap it; each distinct held geometry gets one serving source: this process's own when it
    holds one, else the peer with the fewest bytes planned so far (ties: the first listed), so a
    piece held by several survivors is read from one; each cell is served by a geometry that
    contains it. A held geometry's cells are read as one piece when it serves all of them. Cells
    no source holds are read from the persistent tier (one piece when the whole request is
    unheld). Pure and deterministic; never raises for well-formed inputs."""
    index: dict[str, list[tuple[TierSource, HeldBox]]] = {}
    for s in sources:
        for h in s.boxes:
            index.setdefault(h.key, []).append((s, h))
    load: dict[int, int] = {}
    reads: list[TierRead] = []
    empty: list[tuple[int, str]] = []
    for i, (key, box) in enumerate(requests):
        cands = [(s, h) for s, h in index.get(key, ()) if h.box.ndim == box.ndim]
        if box.is_empty():
            if cands:
                empty.append((i, cands[0][1].dtype))
            else:
                reads.append(TierRead(i, key, box))
            continue
        item = _itemsize(cands[0][1].dtype) if cands else 0
        # One serving source per distinct held geometry.
        geoms: dict[Box, tuple[TierSource, HeldBox]] = {}
        for s, h in cands:
            if h.box.intersect(box) is None:
                continue
            g = geoms.get(h.box)
            if g is None or (g[0].rank != me and s.rank == me):
                geoms[h.box] = (s, h)
        for g, (s, h) in list(geoms.items()):
            if s.rank == me:
                continue
            holders = [(s2, h2) for s2, h2 in cands if h2.box == g]
            best = min(holders, key=lambda sh: (load.get(sh[0].rank, 0), holders.index(sh)))
            geoms[g] = best
            part = g.intersect(box)
            load[best[0].rank] = load.get(best[0].rank, 0) + (part.size if part is not None else 0) * item
        order = sorted(geoms, key=lambda g: (geoms[g][0].rank != me, -g.size))
        cells = _cells(box, order) if order else [box]
        if len(cells) > MAX_CELLS:
            reads.append(TierRead(i, key, box))
            continue
        served: dict[Box, list[Box]] = {}
        unheld: list[Box] = []
        for c in cells:
            g = next((g for g in order if _inside(c, g)), None)
            (unheld if g is None else served.setdefault(g, [])).append(c)
        for g, cs in served.items():
            s, h = geoms[g]
            whole = g.intersect(box)
            pieces = [whole] if whole is not None and sum(c.size for c in cs) == whole.size else cs
            for p in pieces:
                reads.append(TierRead(i, key, p, s.rank, s.host, h, True, p.size * item))
        if len(unheld) == len(cells):
            reads.append(TierRead(i, key, box))
        else:
            reads.extend(TierRead(i, key, c) for c in unheld)
    return TierPlan(tuple(reads), tuple(empty))
