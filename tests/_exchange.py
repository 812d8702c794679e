"""In-process stand-ins for a cooperative restore's data plane (FORMAT.md 9.1), shared by
tests/test_cooperative.py and tests/test_integrity.py: several "processes" as threads of one
process, all-gathering through a shared list, and the same with a fault injected on the way.
They stand in for the framework's collectives (gloo, XLA), which the bridges' multi-process tests
run for real; everything a receiver does with the bytes is the library's own code."""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

__all__ = ["Threads", "Tampering", "OtherChunks"]


class Threads:
    """Two ranks in threads of one process: an all-gather through a shared list and a barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=30)

    def at(self, rank: int) -> Any:
        group = self

        class _Rank:
            def __init__(self) -> None:
                self.rank, self.world = rank, group.world

            def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
                assert data.size == sizes[rank], (name, data.size, sizes)
                group.slots[rank] = np.array(data)
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out
        return _Rank()


class Tampering(Threads):
    """The all-gather of :class:`_Threads`, with a fault on what one rank receives from another:
    ``flip`` flips one byte of ``sender``'s buffer of round 0 as ``receiver`` gets it (in
    transit), past the status and binding (a chunk byte); ``lose`` makes ``sender``'s call number ``at`` fail as
    a lost gloo peer does, and the others' wait break (a dead process)."""

    def __init__(self, world: int, *, flip: tuple[int, int] | None = None, lose: tuple[int, int] | None = None) -> None:
        super().__init__(world)
        self.flip, self.lose, self.calls, self.flipped = flip, lose, [0] * world, []

    def at(self, rank: int) -> Any:
        inner, group = super().at(rank), self

        class _Rank:
            def __init__(self) -> None:
                self.rank, self.world = rank, group.world

            def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
                group.calls[rank] += 1
                if group.lose is not None and (rank, group.calls[rank]) == group.lose:
                    group.barrier.abort()  # the survivors' collective breaks, as gloo's does
                    raise RuntimeError("[gloo] Connection closed by peer")
                out = [np.array(b) for b in inner.allgather(name, data, sizes)]
                if group.flip is not None and rank == group.flip[1] and name == "restore/coop/0":
                    before = out[group.flip[0]].copy()
                    out[group.flip[0]][24 + 8] ^= 0xFF
                    group.flipped.append(not np.array_equal(before, out[group.flip[0]]))
                return out
        return _Rank()


class OtherChunks:
    """A cooperative restore's source whose ``read_chunks`` hands out another step's stored chunks
    (each with its own valid trailer, other bytes): a sender that sends other bytes than the
    manifest's. Everything else is the wrapped checkpoint's."""

    def __init__(self, ckpt: Any, other: Any) -> None:
        self._ckpt, self._other = ckpt, other

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ckpt, name)

    def read_chunks(self, refs: Any) -> Any:
        return self._other.read_chunks(refs)
