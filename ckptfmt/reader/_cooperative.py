"""Cooperative restore (FORMAT.md 9.1): several processes that restore the same box read it once.

Call order (a bridge's batched restore, ``bridges._contract.read_batches``): every process of
the restore calls :func:`cooperative_reads` at the same point with its own batches of requests
(its ``(key path, box)`` reads, batch by batch), and drains the iterator to its end. Inside:

1. one all-gather of every process's batches (the *needs*, a small JSON document);
2. :func:`plan_cooperative` (pure): round ``r`` is every process's ``r``-th batch; a request that
   several processes need in one round is a *shared* box, assigned to one of them (balanced by
   bytes); every other request is read by the process that needs it;
3. per round: each process reads, from storage, its own requests and the shared boxes assigned
   to it; the reader verifies every crc32c (FORMAT.md 9, steps 4-6) before a byte is returned;
   then one all-gather carries each process's status and its verified shared boxes to every
   process. A process whose read failed sends its error instead of bytes, and every process
   raises that error (:meth:`ckptfmt.CheckpointError.from_json`), so none returns partial state.

The data plane is the framework's own collectives, behind the :class:`Exchange` protocol (the
JAX bridge: ``bridges._jaxshare``; torch: ``bridges._torchshare``). Framework-free: numpy only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import CheckpointError

__all__ = ["Exchange", "RoundPlan", "CoopPlan", "CoopStats", "plan_cooperative", "cooperative_reads",
           "gather_bytes"]

Request = tuple[str, Box]
_HEADER = 8  # bytes before a process's blocks in a round: 0, or the length of its error's JSON


class Exchange(Protocol):
    """The data plane of a cooperative restore: one all-gather of byte buffers over the processes.

    ``allgather(name, data, sizes)``: every process calls it at the same point with the same
    ``name`` and ``sizes`` (``sizes[p]`` is process ``p``'s buffer length, which every process
    knows from the plan) and its own 1-D uint8 ``data`` of ``sizes[rank]`` bytes; it returns every
    process's buffer, index = rank (this process's own may be ``data`` itself). Raises on a lost
    peer (the framework's error).

    ``coordinator`` (a :class:`ckptfmt.coord.Coordinator` of the same processes, or None): the
    needs are gathered through it, so a process that never reaches the restore (it failed
    before, or died) makes the others raise the coordinator's CoordinatorTimeoutError or
    CoordinatorLostError within its timeout, instead of waiting in a collective without one."""

    rank: int
    world: int
    coordinator: Any

    def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class RoundPlan:
    """One round of a cooperative restore, for one process: ``reads`` from storage (its own
    requests and the shared boxes it serves), ``serves[p]`` the shared boxes process ``p`` reads
    and sends, in the order they lie in its buffer (the same on every process)."""

    reads: tuple[Request, ...]
    serves: tuple[tuple[Request, ...], ...]


@dataclass(frozen=True)
class CoopPlan:
    """A cooperative restore, planned for process ``rank``: one :class:`RoundPlan` per round;
    ``shared`` counts the shared boxes of all rounds (0: no process needs a box another needs,
    and every process reads on its own)."""

    rank: int
    rounds: tuple[RoundPlan, ...]
    shared: int


@dataclass
class CoopStats:
    """What one process's cooperative restore moved: ``bytes_sent`` (verified shared boxes it read
    and sent), ``bytes_received`` (boxes it took from peers instead of storage), ``shared_boxes``
    (of every round), ``rounds``, ``cooperative`` (False when nothing was shared), ``served``
    (the ``[key path, offset]`` of each shared box this process read for the others)."""

    cooperative: bool = False
    shared_boxes: int = 0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    served: list[list[Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cooperative": self.cooperative, "shared_boxes": self.shared_boxes, "rounds": self.rounds,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "served": list(self.served)}


def _order(req: Request) -> tuple:
    return (req[0], req[1].offset, req[1].shape)


def plan_cooperative(needs: Sequence[Sequence[Sequence[Request]]], nbytes: Callable[[Request], int],
                     rank: int) -> CoopPlan:
    """The cooperative plan of process ``rank`` from every process's batches (``needs[p][r]``:
    process ``p``'s requests of round ``r``). Pure and deterministic: every process computes the
    same assignment from the same needs.

    A request that several processes need in one round goes to one of them: the shared boxes of
    a round, largest first (ties in key path, offset order), each to the process among those
    needing it that serves the fewest bytes so far (over all rounds; ties: the lowest rank).
    """
    world = len(needs)
    rounds = max((len(n) for n in needs), default=0)
    load = [0] * world
    out: list[RoundPlan] = []
    shared_total = 0
    for r in range(rounds):
        who: dict[Request, list[int]] = {}
        for p in range(world):
            for req in (dict.fromkeys(needs[p][r]) if r < len(needs[p]) else ()):
                who.setdefault(req, []).append(p)
        shared = sorted((q for q, ps in who.items() if len(ps) > 1), key=lambda q: (-nbytes(q), _order(q)))
        serves: list[list[Request]] = [[] for _ in range(world)]
        for req in shared:
            owner = min(who[req], key=lambda p: (load[p], p))
            serves[owner].append(req)
            load[owner] += nbytes(req)
        shared_total += len(shared)
        mine = [q for q, ps in who.items() if ps == [rank]] + serves[rank]
        out.append(RoundPlan(tuple(mine), tuple(tuple(s) for s in serves)))
    return CoopPlan(rank, tuple(out), shared_total)


def gather_bytes(exchange: Exchange, name: str, payload: bytes) -> list[bytes]:
    """Every process's ``payload`` (any lengths): their lengths first, then the bytes."""
    n = np.frombuffer(np.array([len(payload)], dtype="<u8").tobytes(), dtype=np.uint8)
    sizes = [int(np.frombuffer(b[:_HEADER].tobytes(), dtype="<u8")[0])
             for b in exchange.allgather(name + "/len", n, [_HEADER] * exchange.world)]
    got = exchange.allgather(name, np.frombuffer(payload, dtype=np.uint8), sizes)
    return [bytes(memoryview(np.ascontiguousarray(b[:s]))) for b, s in zip(got, sizes)]


def _encode(batches: Sequence[Sequence[Request]]) -> bytes:
    return json.dumps([[[k, list(b.offset), list(b.shape)] for k, b in batch] for batch in batches]).encode()


def _decode(blob: bytes) -> list[list[Request]]:
    return [[(str(k), Box(tuple(o), tuple(s))) for k, o, s in batch] for batch in json.loads(blob)]


def _error_json(e: BaseException) -> dict[str, Any]:
    if isinstance(e, CheckpointError):
        return e.to_json()
    return {"error": type(e).__name__, "message": str(e)[:500], "untyped": True}


def cooperative_reads(source: Any, batches: Sequence[Sequence[Request]], exchange: Exchange, *,
                      stats: CoopStats | None = None, name: str = "restore/coop") -> Iterator[list[np.ndarray]]:
    """What ``source.iter_read_boxes(batches)`` yields (each batch's arrays, in order, every byte
    verified), with the boxes that several processes need read from storage once (module docstring).

    Every process of ``exchange`` must call it at the same point and drain the iterator to its end
    (it runs the rounds of the processes with more batches after its own last yield). Fails
    closed, on every process at once: a read that fails on any process raises, at the same
    round on every process, that process's error (of several, the lowest rank's) (the same CheckpointError class, key, object,
    expected and found; the message prefixed ``rank p: `` on the others; an untyped error arrives
    as a CheckpointError naming its class). Nothing is yielded from a round that failed.
    """
    stats = stats if stats is not None else CoopStats()
    coordinator = getattr(exchange, "coordinator", None)
    blobs = (coordinator.allgather(name + "/needs", _encode(batches)) if coordinator is not None
             else gather_bytes(exchange, name + "/needs", _encode(batches)))
    needs = [_decode(b) for b in blobs]

    def size(req: Request) -> int:
        return req[1].size * numpy_dtype(source.tensor(req[0]).dtype).itemsize

    plan = plan_cooperative(needs, size, exchange.rank)
    stats.rounds, stats.shared_boxes = len(plan.rounds), plan.shared
    if not plan.shared:  # nothing to share: every process reads on its own
        yield from source.iter_read_boxes(batches)
        return
    stats.cooperative = True
    reader = source.iter_read_boxes([rp.reads for rp in plan.rounds if rp.reads])  # _round skips the empty
    held: list[np.ndarray] | None = None
    try:
        for r, rp in enumerate(plan.rounds):
            want = batches[r] if r < len(batches) else []
            got = _round(source, exchange, f"{name}/{r}", rp, reader, size, stats, set(want))
            if held is not None:
                yield held
                held = None
            if want:
                held = [got[req] for req in want]
                del got
        if held is not None:
            yield held
    finally:
        reader.close()


def _round(source: Any, exchange: Exchange, name: str, rp: RoundPlan, reader: Iterator[list[np.ndarray]],
           size: Callable[[Request], int], stats: CoopStats, want: set[Request]) -> dict[Request, np.ndarray]:
    """One round: read (verified), then one all-gather of status and shared boxes. Returns the
    blocks this process holds after the round: its reads, and the shared boxes of ``want``."""
    me = exchange.rank
    failure: BaseException | None = None
    got: dict[Request, np.ndarray] = {}
    try:
        got = dict(zip(rp.reads, next(reader))) if rp.reads else {}
    except Exception as e:  # noqa: BLE001 - every process must hear of it, typed or not
        failure = e
    sizes = [_HEADER + sum(size(q) for q in rp.serves[p]) for p in range(exchange.world)]
    stats.served.extend([q[0], list(q[1].offset)] for q in rp.serves[me])
    buf = np.zeros(sizes[me], dtype=np.uint8)
    if failure is not None:
        err = json.dumps(_error_json(failure)).encode()
        buf[:_HEADER] = np.frombuffer(np.array([len(err)], dtype="<u8").tobytes(), dtype=np.uint8)
    else:
        at = _HEADER
        for q in rp.serves[me]:  # verified blocks only: the reader checked every crc32c
            blk = np.ascontiguousarray(got[q])
            buf[at:at + blk.nbytes] = blk.reshape(-1).view(np.uint8)
            at += blk.nbytes
        stats.bytes_sent += at - _HEADER
    bufs = exchange.allgather(name, buf, sizes)
    errs = [int(np.frombuffer(np.ascontiguousarray(b[:_HEADER]).tobytes(), dtype="<u8")[0]) for b in bufs]
    if any(errs):
        docs = gather_bytes(exchange, name + "/error", json.dumps(_error_json(failure)).encode()
                            if failure is not None else b"")
        first = next(p for p, n in enumerate(errs) if n)  # several failed: the lowest rank's, everywhere
        if first == me:
            raise failure  # type: ignore[misc]
        raise CheckpointError.from_json(json.loads(docs[first]), prefix=f"rank {first}: ")
    for p, b in enumerate(bufs):
        if p == me or not rp.serves[p]:
            continue
        b = b if b.flags.writeable else b.copy()  # the restore's own memory, handed out as values
        at = _HEADER
        for q in rp.serves[p]:
            n = size(q)
            if q in want:
                got[q] = b[at:at + n].view(numpy_dtype(source.tensor(q[0]).dtype)).reshape(q[1].shape)
                stats.bytes_received += n
            at += n
    return got
