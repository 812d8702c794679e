"""Cooperative restore (FORMAT.md 9.1): several processes that restore the same stored chunk read
it from storage once, and every process verifies what it receives.

Call order (a bridge's batched restore, ``bridges._contract.read_batches``): every process of
the restore calls :func:`cooperative_reads` at the same point with its own batches of requests
(its ``(key path, box)`` reads, batch by batch), and drains the iterator to its end. Inside:

1. each process plans its own batches into the stored chunks they touch (``source.chunk_refs``);
   one all-gather of every process's chunks, batch by batch (the *needs*, a JSON document,
   checked on receipt against this process's manifest);
2. :func:`plan_cooperative` (pure): round ``r`` is every process's ``r``-th batch; a chunk that
   several processes need in one round is *shared*, assigned to one of them (balanced by bytes);
3. per round: each process reads the shared chunks assigned to it, as stored (data and crc32c
   trailer), checked against the manifest (``source.read_chunks``); one all-gather carries each
   process's status, the digest of the step and save it restores, and those stored chunks; then
   each process reads its own requests with the chunks its peers sent (``source.read_boxes(...,
   supplied=...)``), which checks every received chunk against this process's own manifest
   exactly as a chunk read from storage (the receiver verifies: a byte flipped in transit, or a
   peer that sends other bytes than the manifest's, fails there); a last small all-gather of
   every process's outcome. A process that failed sends its error, and every process raises the
   lowest failed rank's error (:meth:`ckptfmt.CheckpointError.from_json`), so none returns
   partial state; a peer lost in a collective is a CoordinatorLostError naming the round.

The data plane is the framework's own collectives, behind the :class:`Exchange` protocol (the
JAX bridge: ``bridges.jax._share``; torch: ``bridges.torch._share``). Framework-free: numpy only.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import CheckpointError, CoordinatorLostError, InvalidStateError, StepMismatchError
from ckptfmt.restoreplan import RestoreSource

__all__ = ["Exchange", "ChunkSource", "RoundPlan", "CoopPlan", "CoopStats", "plan_cooperative",
           "cooperative_reads", "gather_bytes"]

Request = tuple[str, Box]
#: A stored chunk: (key path, row of the tensor's chunk table).
ChunkRef = tuple[str, int]
_HEADER = 8  # bytes before a process's blocks in a round: 0, or the length of its error's JSON
_BIND = 16  # then the digest of the step and save it restores (:func:`_binding`)


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


def _chunk_order(ref: ChunkRef) -> tuple:
    return (ref[0], int(ref[1]))


def plan_cooperative(needs: Sequence[Sequence[Sequence[Any]]], nbytes: Callable[[Any], int],
                     rank: int, *, order: Callable[[Any], tuple] = _order) -> CoopPlan:
    """The cooperative plan of process ``rank`` from every process's batches (``needs[p][r]``:
    process ``p``'s units of round ``r``: requests, or the stored chunks they touch, which
    :func:`cooperative_reads` shares). Pure and deterministic: every process computes the same
    assignment from the same needs.

    A unit that several processes need in one round goes to one of them: the shared units of a
    round, largest first (ties in ``order``: key path, then offset or chunk row), each to the
    process among those needing it that serves the fewest bytes so far (over all rounds; ties:
    the lowest rank).
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
        shared = sorted((q for q, ps in who.items() if len(ps) > 1), key=lambda q: (-nbytes(q), order(q)))
        serves: list[list[Request]] = [[] for _ in range(world)]
        for req in shared:
            owner = min(who[req], key=lambda p: (load[p], p))
            serves[owner].append(req)
            load[owner] += nbytes(req)
        shared_total += len(shared)
        mine = [q for q, ps in who.items() if ps == [rank]] + serves[rank]
        out.append(RoundPlan(tuple(mine), tuple(tuple(s) for s in serves)))
    return CoopPlan(rank, tuple(out), shared_total)


def _head(n: int) -> np.ndarray:
    """The 8 bytes (little-endian u64) that lead a process's buffer: a length, or 0."""
    return np.frombuffer(int(n).to_bytes(_HEADER, "little"), dtype=np.uint8)


def _head_of(buf: np.ndarray) -> int:
    return int.from_bytes(np.ascontiguousarray(buf[:_HEADER]).tobytes(), "little")


def gather_bytes(exchange: Exchange, name: str, payload: bytes) -> list[bytes]:
    """Every process's ``payload`` (any lengths): their lengths first, then the bytes."""
    sizes = [_head_of(b) for b in _allgather(exchange, name + "/len", _head(len(payload)), [_HEADER] * exchange.world)]
    got = _allgather(exchange, name, np.frombuffer(payload, dtype=np.uint8), sizes)
    return [bytes(memoryview(np.ascontiguousarray(b[:s]))) for b, s in zip(got, sizes)]


def _encode(refs: Sequence[Sequence[ChunkRef]] | None) -> bytes:
    """A process's needs: per batch, the stored chunks it touches (``null``: it shares nothing)."""
    return json.dumps(None if refs is None else [[[k, int(c)] for k, c in batch] for batch in refs]).encode()


def _decode(blob: bytes, rank: int, source: ChunkSource) -> list[list[ChunkRef]] | None:
    """Another process's needs, each chunk row checked against this process's manifest (untrusted input)."""
    try:
        doc = json.loads(blob)
        if doc is None:
            return None
        out = []
        for batch in doc:
            refs = []
            for k, c in batch:
                key, row = str(k), int(c)
                if isinstance(c, bool) or not 0 <= row < len(source.tensor(key).chunks.nbytes):
                    raise ValueError(f"chunk row {c!r} of {key!r}")
                refs.append((key, row))
            out.append(refs)
        return out
    except (ValueError, TypeError, CheckpointError) as e:  # another process's document: untrusted input
        raise InvalidStateError(f"a process's needs do not decode: {type(e).__name__}: {e}"[:300],
                                object=f"needs of rank {rank}", expected="per batch, the stored chunks it reads",
                                found=f"{len(blob)} bytes") from None


def _error_json(e: BaseException) -> dict[str, Any]:
    if isinstance(e, CheckpointError):
        return e.to_json()
    return {"error": type(e).__name__, "message": str(e)[:500], "untyped": True}


class ChunkSource(Protocol):
    """What a cooperative restore needs of its source besides ``iter_read_boxes``: its tensor
    entries, the stored chunks a read touches, their stored lengths, their stored bytes (verified),
    and a read that takes chunks another process delivered (:class:`ckptfmt.reader.Checkpoint`). A
    source without these is read by each process alone."""

    def tensor(self, key: str) -> Any: ...

    def chunk_refs(self, requests: Sequence[Request]) -> list[ChunkRef]: ...

    def chunk_nbytes(self, ref: ChunkRef) -> int: ...

    def read_chunks(self, refs: Sequence[ChunkRef]) -> list[np.ndarray]: ...

    def read_boxes(self, requests: Sequence[Request], *,
                   supplied: Mapping[ChunkRef, tuple[Any, str]] | None = None) -> list[np.ndarray]: ...


def _shares_chunks(source: object) -> bool:
    return all(callable(getattr(source, m, None)) for m in ("chunk_refs", "chunk_nbytes", "read_chunks"))


def _binding(source: ChunkSource) -> bytes:
    """What every process's buffer of a round starts with after its status: the step and the save
    it restores (FORMAT.md 9.1: an answer is bound to the save asked), as 16 bytes."""
    manifest = getattr(source, "manifest", None)
    ident = f"{getattr(manifest, 'step', '')}/{getattr(manifest, 'save_id', '')}".encode()
    return hashlib.blake2b(ident, digest_size=_BIND).digest()


def cooperative_reads(source: RestoreSource, batches: Sequence[Sequence[Request]], exchange: Exchange, *,
                      stats: CoopStats | None = None, name: str = "restore/coop") -> Iterator[list[np.ndarray]]:
    """What ``source.iter_read_boxes(batches)`` yields (each batch's arrays, in order, every byte
    verified), with the stored chunks that several processes need read from storage once (module
    docstring).

    Every process of ``exchange`` must call it at the same point and drain the iterator to its end
    (it runs the rounds of the processes with more batches after its own last yield). Fails
    closed, on every process at once: a read that fails on any process, or a chunk a process
    received that does not verify against its own manifest, raises, at the same round on every
    process, that process's error (of several, the lowest rank's) (the same CheckpointError
    class, key, object, expected and found; the message prefixed ``rank p: `` on the others; an
    untyped error arrives as a CheckpointError naming its class). A peer lost in a round raises
    CoordinatorLostError naming the round. Nothing is yielded from a round that failed.
    """
    stats = stats if stats is not None else CoopStats()
    coordinator = getattr(exchange, "coordinator", None)
    # Each process plans only its own requests into the stored chunks they touch and sends those:
    # no process plans another's requests (that would grow with the world size).
    shares = _shares_chunks(source)
    mine = [source.chunk_refs(batch) for batch in batches] if shares else None
    blobs = (coordinator.allgather(name + "/needs", _encode(mine)) if coordinator is not None
             else gather_bytes(exchange, name + "/needs", _encode(mine)))
    chunk_needs = [_decode(b, p, source) for p, b in enumerate(blobs)]
    if not shares or any(n is None for n in chunk_needs):  # nothing a receiver could verify: each reads alone
        yield from source.iter_read_boxes(batches)
        return
    plan = plan_cooperative(chunk_needs, source.chunk_nbytes, exchange.rank, order=_chunk_order)  # type: ignore[arg-type]
    stats.rounds, stats.shared_boxes = len(plan.rounds), plan.shared
    if not plan.shared:  # nothing to share: every process reads on its own
        yield from source.iter_read_boxes(batches)
        return
    stats.cooperative = True
    bind = _binding(source)
    for r, rp in enumerate(plan.rounds):
        want = list(batches[r]) if r < len(batches) else []
        needed = set(mine[r]) if r < len(mine) else set()  # type: ignore[index,arg-type]
        got = _round(source, exchange, f"{name}/{r}", rp, want, needed, bind, stats)
        if want:
            yield got


def _allgather(exchange: Exchange, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """The exchange's all-gather; a peer lost in it (the framework's own error) is a typed error."""
    try:
        return exchange.allgather(name, data, sizes)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo, XLA and others raise their own types
        raise CoordinatorLostError(f"a process of the cooperative restore was lost: {type(e).__name__}: {e}",
                                   object=name, expected=f"{exchange.world} processes in the round",
                                   found="the collective failed") from e


def _status(exchange: Exchange, name: str, failure: BaseException | None) -> None:
    """Every process's outcome of a step of a round; when any failed, every process raises the
    lowest failed rank's error (its own, or a copy prefixed ``rank p: ``)."""
    err = json.dumps(_error_json(failure)).encode() if failure is not None else b""
    bufs = _allgather(exchange, name, _head(len(err)), [_HEADER] * exchange.world)
    _raise_first(exchange, name, bufs, failure, err)


def _raise_first(exchange: Exchange, name: str, bufs: Sequence[np.ndarray], failure: BaseException | None,
                 err: bytes) -> None:
    errs = [_head_of(b) for b in bufs]
    if not any(errs):
        return
    docs = gather_bytes(exchange, name + "/error", err)
    first = next(p for p, n in enumerate(errs) if n)  # several failed: the lowest rank's, everywhere
    if first == exchange.rank and failure is not None:
        raise failure
    try:
        doc = json.loads(docs[first])
    except ValueError:
        doc = {"error": "CheckpointError", "message": "an unreadable error", "untyped": True}
    raise CheckpointError.from_json(doc, prefix=f"rank {first}: ")


def _round(source: ChunkSource, exchange: Exchange, name: str, rp: RoundPlan, want: list[Request], mine: set[ChunkRef],
           bind: bytes, stats: CoopStats) -> list[np.ndarray]:
    """One round: read and verify the chunks this process serves; one all-gather of status,
    binding and chunks; then read this process's requests with the chunks its peers sent, each
    verified here against this process's manifest (the receiver verifies, FORMAT.md 9.1); one
    all-gather of the outcome. Returns this process's arrays of the round."""
    me, world = exchange.rank, exchange.world
    failure: BaseException | None = None
    served: list[np.ndarray] = []
    try:
        served = source.read_chunks(list(rp.serves[me])) if rp.serves[me] else []
    except Exception as e:  # noqa: BLE001 - every process must hear of it, typed or not
        failure = e
    sizes = [_HEADER + _BIND + sum(source.chunk_nbytes(q) for q in rp.serves[p]) for p in range(world)]
    stats.served.extend([q[0], int(q[1])] for q in rp.serves[me])
    buf = np.zeros(sizes[me], dtype=np.uint8)
    buf[_HEADER:_HEADER + _BIND] = np.frombuffer(bind, dtype=np.uint8)
    err = b""
    if failure is not None:
        err = json.dumps(_error_json(failure)).encode()
        buf[:_HEADER] = _head(len(err))
    else:
        at = _HEADER + _BIND
        for blk in served:  # verified by read_chunks; each receiver verifies again
            buf[at:at + blk.size] = blk
            at += blk.size
        stats.bytes_sent += at - _HEADER - _BIND
    bufs = _allgather(exchange, name, buf, sizes)
    _raise_first(exchange, name, bufs, failure, err)
    supplied: dict[ChunkRef, tuple[Any, str]] = {}
    received = 0
    for p, b in enumerate(bufs):
        if not rp.serves[p]:
            continue
        if p != me and bytes(np.ascontiguousarray(b[_HEADER:_HEADER + _BIND])) != bind:
            failure = StepMismatchError("a process of the cooperative restore sent chunks of another save",
                                        object=f"{name} from rank {p}", expected="the step and save this process restores",
                                        found="another step or save")
            break
        at = _HEADER + _BIND
        for q in rp.serves[p]:
            n = source.chunk_nbytes(q)
            if q in mine:
                supplied[q] = (b[at:at + n], "this process" if p == me else f"rank {p}")
                received += n if p != me else 0
            at += n
    got: list[np.ndarray] = []
    if failure is None and want:
        try:
            got = source.read_boxes(want, supplied=supplied)
        except Exception as e:  # noqa: BLE001 - every process must hear of it, typed or not
            failure = e
    if failure is None:
        stats.bytes_received += received
    _status(exchange, name + "/done", failure)
    return got
