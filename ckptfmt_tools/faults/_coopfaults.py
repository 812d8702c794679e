"""Faults of kind ``"coop"``: a cooperative restore (FORMAT.md 9.1, ckptfmt/reader/_cooperative.py).

Two ranks (threads) restore step 1 of a repository (tensor ``a``, 16 x 8 float32 in four shards
of four rows; step 2 holds the same layout with other values) through
:func:`ckptfmt.reader.cooperative_reads`, both asking for every box, so every stored chunk is
shared: each is read from storage by one rank and sent to the other over an in-memory all-gather
(:class:`ThreadGather`), where the fault is injected. Judged by :func:`_restorejudge.judge`.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ckptfmt_tools.faults._restorejudge import RestoreAttempt, run_ranks

__all__ = ["ThreadGather", "TrustingSource", "OtherStepSender", "transit_flip", "sender_other_step", "peer_lost"]

_KEY = "a"


class ThreadGather:
    """The all-gather of ``world`` ranks in threads of one process (a shared list and a barrier),
    with at most one fault: ``flip=(sender, receiver)`` flips one chunk byte of ``sender``'s buffer
    of round 0 as ``receiver`` gets it; ``lose=(rank, call)`` makes that rank's call number
    ``call`` fail as a lost gloo peer does, and breaks the others' wait."""

    def __init__(self, world: int, *, flip: tuple[int, int] | None = None,
                 lose: tuple[int, int] | None = None) -> None:
        self.world, self.flip, self.lose = world, flip, lose
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.calls = [0] * world
        self.hits: list[str] = []

    def at(self, rank: int) -> Any:
        group = self

        class _Rank:
            coordinator = None

            def __init__(self) -> None:
                self.rank, self.world = rank, group.world

            def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
                if data.size != sizes[rank]:  # the restore's own protocol: a buffer of the announced size
                    raise RuntimeError(f"fixture error: rank {rank} sent {data.size} bytes in {name}, "
                                       f"announced {sizes[rank]}")
                group.calls[rank] += 1
                if group.lose is not None and (rank, group.calls[rank]) == group.lose:
                    group.barrier.abort()
                    group.hits.append(f"rank {rank}'s collective {name} failed")
                    raise RuntimeError("[gloo] Connection closed by peer")
                group.slots[rank] = np.array(data)
                group.barrier.wait()
                out = [np.array(b) for b in group.slots]
                group.barrier.wait()
                if group.flip is not None and rank == group.flip[1] and name.endswith("/0"):
                    at = 8 + 16 + 8  # past the status and the binding: a data byte of the first chunk
                    out[group.flip[0]][at] ^= 0xFF
                    group.hits.append(f"byte {at} of rank {group.flip[0]}'s buffer flipped on its way to rank {rank}")
                return out
        return _Rank()


class TrustingSource:
    """Broken control: a receiver that takes the chunks its peers send as they are (no length,
    no crc32c, no manifest check), as a data plane without the receiver's verification would.
    Each box of this scene is exactly one stored chunk; its bytes are the chunk's less the trailer."""

    def __init__(self, ckpt: Any) -> None:
        self._ckpt = ckpt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ckpt, name)

    def read_boxes(self, requests: Any, *, supplied: Any = None) -> list[np.ndarray]:
        out = []
        for req in requests:
            refs = self._ckpt.chunk_refs([req])
            if supplied and len(refs) == 1 and refs[0] in supplied:
                raw = np.ascontiguousarray(supplied[refs[0]][0]).reshape(-1)[:-4]
                t = self._ckpt.tensor(req[0])
                out.append(np.frombuffer(raw.tobytes(), dtype=np.dtype(t.dtype)).reshape(req[1].shape).copy())
            else:
                out.append(self._ckpt.read_boxes([req])[0])
        return out


class OtherStepSender:
    """A sender whose stored chunks come from another step of the same layout (each with its own
    valid trailer): what a confused or stale peer would send. Everything else is ``ckpt``'s."""

    def __init__(self, ckpt: Any, other: Any) -> None:
        self._ckpt, self._other = ckpt, other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ckpt, name)

    def read_chunks(self, refs: Any) -> Any:
        return self._other.read_chunks(refs)


def _values(step: int) -> np.ndarray:
    return np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 1000 * step


def _scene(run_dir: Path) -> tuple[str, list]:
    import ckptfmt
    from ckptfmt import Box, LocalShard

    url = str(run_dir / "repo")
    for step in (1, 2):
        a = _values(step)
        ckptfmt.save(url, step, [LocalShard(_KEY, a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4])
                                 for r in range(0, 16, 4)], state={"step": step})
    return url, [(_KEY, Box((r, 0), (4, 8))) for r in range(0, 16, 4)]


def _restore(url: str, reqs: list, group: ThreadGather, source: Any) -> Any:
    from ckptfmt.reader import CoopStats, cooperative_reads

    def rank(r: int) -> dict[str, np.ndarray]:
        stats = CoopStats()
        got = list(cooperative_reads(source(r), [reqs], group.at(r), stats=stats))
        if not stats.cooperative:
            raise RuntimeError("fixture error: nothing was shared")
        return {_KEY: np.concatenate(got[0], axis=0)}
    return run_ranks(2, rank)


def _attempt(url: str, ranks: list, where: str, group: ThreadGather, reached: bool) -> RestoreAttempt:
    a = _values(1)
    return RestoreAttempt(where, ranks, [{_KEY: a}, {_KEY: a}], prior=(url, 1, {_KEY: a}, {"step": 1}), repos=(url,),
                          reached=reached, notes=list(group.hits))


def _receiver(source: Any, ctx: Any) -> Any:
    return TrustingSource(source) if ctx.restore_weaken == "receiver_trusts" else source


def transit_flip(run_dir: Path, ctx: Any) -> RestoreAttempt:
    from ckptfmt import Repository

    url, reqs = _scene(run_dir)
    group = ThreadGather(2, flip=None if ctx.restore_clean else (1, 0))
    ranks = _restore(url, reqs, group, lambda r: _receiver(Repository(url).open(1), ctx))
    return _attempt(url, ranks, "cooperative restore of step 1 by 2 ranks: one byte of the chunks rank 1 sends "
                    "flipped on its way to rank 0", group, ctx.restore_clean or bool(group.hits))


def sender_other_step(run_dir: Path, ctx: Any) -> RestoreAttempt:
    from ckptfmt import Repository

    url, reqs = _scene(run_dir)

    def source(r: int) -> Any:
        if r == 1 and not ctx.restore_clean:
            return _receiver(OtherStepSender(Repository(url).open(1), Repository(url).open(2)), ctx)
        return _receiver(Repository(url).open(1), ctx)
    group = ThreadGather(2)
    ranks = _restore(url, reqs, group, source)
    return _attempt(url, ranks, "cooperative restore of step 1 by 2 ranks: rank 1 sends step 2's stored chunks "
                    "(same layout, other values, valid trailers) as step 1's", group, True)


def peer_lost(run_dir: Path, ctx: Any) -> RestoreAttempt:
    from ckptfmt import Repository

    url, reqs = _scene(run_dir)
    # Calls 1-2 gather the needs (lengths, then bytes); call 3 is round 0's chunks.
    group = ThreadGather(2, lose=None if ctx.restore_clean else (1, 3))
    ranks = _restore(url, reqs, group, lambda r: Repository(url).open(1))
    return _attempt(url, ranks, "cooperative restore of step 1 by 2 ranks: rank 1 lost in round 0's all-gather "
                    "(its collective fails as gloo's does; rank 0's breaks)", group, ctx.restore_clean or bool(group.hits))
