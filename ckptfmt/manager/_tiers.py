"""The checkpoint manager's local tier (FORMAT.md 8.5): the save side, and the values both sides share.

A :class:`LocalTier` is a directory next to the processes (``/dev/shm``, a local disk). Host
``h`` (one process of the job) keeps one ordinary ckptfmt repository, ``<path>/host-<h>``, written by
that process alone (world 1) with the ordinary save protocol: private writes, verification, one
atomic manifest per step. A local step holds the host's own boxes and, with ``replicate``, a replica
of host ``(h + 1) mod H``'s boxes, received over the framework's collectives (a
:class:`PeerExchange`, supplied by the bridge). Each box is a tensor of the local repository whose
key path is ``h<owner>/<n>``; the global state object maps it back (``tiers.boxes``) and records the
step's *tier token*, the identity that every copy of one manager save shares (the persistent
tier records it in ``metadata["ckptfmt.tiers"]`` when the same call saved the step there too).

Call order: at construction rank 0 draws the run's nonce and broadcasts it (the manager's
coordinator, metadata only); a step's token is ``<nonce>-<step>``. A local save (every process,
from ``CheckpointManager.save``): wait for the previous local save (back-pressure, one in
flight); the bridge copies the own boxes to host memory; then a background thread exchanges the
copies with the peers (in the caller's thread when the exchange says it cannot run in the
background), saves the local step, and applies the tier's retention (``keep`` newest steps). A failed local
save is logged and recorded in ``tier_history``; it never fails training (the persistent tier
stays the authority). Restore: :mod:`ckptfmt.manager._tierrestore`.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ckptfmt._types import Box, LocalShard
from ckptfmt.coord import LocalCoordinator
from ckptfmt.dtypes import dtype_name
from ckptfmt.errors import CheckpointError, InvalidStateError
from ckptfmt.repository import Repository
from ckptfmt.session import save
from ckptfmt.session._saveopts import SaveOptions
from ckptfmt.session.asyncsave import BackgroundWorker
from ckptfmt.manager._payload import check_payload, pack_payload, unpack_payload

__all__ = ["LocalTier", "PeerExchange", "HeldBox", "TierSave", "TIERS_KEY", "RUN_KEY", "TierWriter", "distinct_boxes",
           "run_identity",
           "check_payload", "pack_payload", "unpack_payload"]

_log = logging.getLogger("ckptfmt.manager")

#: The inner-chunk target of a mapped local tier: any box is one chunk.
WHOLE_CHUNK_BYTES = 1 << 62

#: The persistent repository's run identity (FORMAT.md 4.2, 8.5): ``{"run": "<32 hex digits>"}``.
RUN_KEY = "tiers/run.json"
_RUN_MAX_BYTES = 4096


def run_identity(repo: Repository) -> str:
    """The run identity of the persistent repository ``repo`` (FORMAT.md 8.5): created, if absent,
    with one create-if-absent write of a fresh random identity, then read back (so concurrent
    creators agree on the first). Raises InvalidStateError for an object that is not a run
    identity, StorageError when the store refuses the write or the read."""
    fresh = json.dumps({"run": secrets.token_hex(16)}, separators=(",", ":")).encode() + b"\n"
    repo.storage.create_if_absent(RUN_KEY, fresh)
    data = repo.storage.read(RUN_KEY, max_bytes=_RUN_MAX_BYTES)
    try:
        run = json.loads(data or b"")["run"]
        if not (isinstance(run, str) and len(run) == 32 and all(c in "0123456789abcdef" for c in run)):
            raise ValueError(run)
    except (ValueError, KeyError, TypeError):
        raise InvalidStateError("the repository's run identity is malformed", key=RUN_KEY, object=repo.url,
                                expected='{"run": "<32 hex digits>"}', found=repr(data)[:80]) from None
    return run


#: The key of the tier record: in a local step's global state, and in a persistent manifest's
#: ``metadata`` (the token only) when one manager call saved the step on both tiers.
TIERS_KEY = "ckptfmt.tiers"


@dataclass(frozen=True)
class LocalTier:
    """A local tier: ``path`` (a directory: one repository ``host-<h>`` per host under it), its own
    cadence ``every`` (a step divisible by it is saved there; ``force=True`` saves too), its
    retention ``keep`` (newest steps kept per host), ``replicate`` (hold a replica of the
    next host's boxes) and ``mapped`` (restore by mapping verified boxes instead of copying them:
    off by default, see the field).
    Bad values raise ValueError."""

    path: str
    every: int = 10
    keep: int = 2
    replicate: bool = True
    #: False (the default): a restore copies each verified box into memory of its own, so nothing
    #: done to the tier's files afterwards can reach the restored state. True: each box is saved as
    #: one inner chunk and a restore maps it (``MAP_PRIVATE``) after checking its crc32c instead of
    #: copying it (FORMAT.md 14.8), which saves the copy into fresh pages, AT A RISK: the restored
    #: arrays then share pages with the tier's files, so a later write to a tier file by any process
    #: changes the live training state (Linux shows a shared file's writes through a private
    #: mapping until the process itself writes that page), and a truncation kills the process with
    #: SIGBUS on its next access. Only for a tier directory that nothing but this job writes
    #: (docs/tiers.md, "Mapped restores").
    mapped: bool = False
    #: A local step belongs to the run of the persistent repository it was saved beside (its run
    #: identity, FORMAT.md 8.5); a restore uses only local steps of this manager's repository's
    #: run. True adopts the tier's steps whatever run they record (a tier moved to a new
    #: repository on purpose); never needed to resume a run from its own tier.
    adopt: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"LocalTier.path must be a directory path, got {self.path!r}")
        for name in ("every", "keep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LocalTier.{name} must be a positive int, got {v!r}")
        object.__setattr__(self, "path", str(self.path))

    def url(self, host: int) -> str:
        """The repository of host ``host``."""
        return os.path.join(self.path, f"host-{int(host)}")


@runtime_checkable
class PeerExchange(Protocol):
    """The data plane between hosts: the framework's collectives or its transfer service (never
    the coordinator's key-value store, which carries metadata only).

    ``shift(name, payload, offset)`` is a collective: every rank calls it with the same ``name``
    and ``offset``; rank ``r``'s payload goes to rank ``(r + offset) mod world``, and the call
    returns what rank ``(r - offset) mod world`` sent. A payload is a bytes-like object (a uint8
    array from :func:`~ckptfmt.manager._payload.pack_payload`); what comes back may be any bytes-like
    object, a view of the exchange's own buffer included, checked with ``check_payload``. Raises
    the framework's error, or a CheckpointError, on every rank when the exchange fails.

    ``background``: whether ``shift`` may run in a background thread while the caller's thread
    runs the framework's own collectives (torch: a process group of its own; JAX: its transfer
    service, which launches no cross-process program). An exchange whose ``background`` is False
    runs in the caller's thread, in program order.

    ``close()`` (optional) releases the data plane; the manager calls it when it closes with no
    local save in flight."""

    background: bool

    def shift(self, name: str, payload: Any, offset: int) -> Any: ...


@dataclass(frozen=True)
class HeldBox:
    """One box a local step holds: its tensor in the local repository, the host whose box it
    is, and the global tensor (key path, global shape, dtype name) and box it is part of."""

    local: str
    owner: int
    key: str
    shape: tuple[int, ...]
    dtype: str
    box: Box

    def to_wire(self) -> list[Any]:
        return [self.local, self.owner, self.key, list(self.shape), self.dtype, list(self.box.offset),
                list(self.box.shape)]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> "HeldBox":
        if not isinstance(w, (list, tuple)) or len(w) != 7:
            raise InvalidStateError("a tier box record is malformed", key=TIERS_KEY, expected="7 fields", found=repr(w)[:80])
        return cls(str(w[0]), int(w[1]), str(w[2]), tuple(int(x) for x in w[3]), str(w[4]), Box(tuple(w[5]), tuple(w[6])))

    def contains(self, key: str, box: Box) -> bool:
        return key == self.key and box.ndim == self.box.ndim and all(
            o0 <= o and o + n <= o0 + n0 for o0, n0, o, n in zip(self.box.offset, self.box.shape, box.offset, box.shape))

    def within(self, box: Box) -> Box:
        """``box`` in the coordinates of this held box (which contains it)."""
        return Box(tuple(o - o0 for o, o0 in zip(box.offset, self.box.offset)), box.shape)


@dataclass(frozen=True)
class TierSave:
    """One local save as this process saw it: step, token, whether it committed, the caller's
    blocked seconds, the background seconds to the commit (``exchange_s`` of them with the peers),
    bytes of own and replicated boxes."""

    step: int
    token: str
    committed: bool
    blocked_s: float
    write_s: float
    own_bytes: int
    peer_bytes: int
    error: str | None = None
    exchange_s: float = 0.0


def distinct_boxes(shards: Sequence[LocalShard]) -> list[tuple[str, tuple[int, ...], Any, Box, np.ndarray]]:
    """The host-copied boxes of a bridge's staged shards, each distinct ``(key, box)`` once (its
    first replica) and empty boxes left out, as :func:`pack_payload` takes them."""
    seen: set[tuple[str, Box]] = set()
    out = []
    for s in shards:
        if not isinstance(s.data, np.ndarray) or (s.key, s.box) in seen or (s.box.ndim and s.box.size == 0):
            continue
        seen.add((s.key, s.box))
        out.append((s.key, tuple(s.global_shape), np.dtype(s.dtype), s.box, s.data))
    return out


def write_local_step(repo: Repository, step: int, host: int, hosts: int, token: str,
                     boxes: Sequence[tuple[int, tuple[str, tuple[int, ...], Any, Box, np.ndarray]]],
                     global_state: Any, options: SaveOptions | None, whole_chunks: bool = False,
                     run: str | None = None) -> Any:
    """Save one local step of ``host`` (world 1): every (owner, box) as tensor ``h<owner>/<n>``, the
    box map and token in the global state; ``whole_chunks``: each box one inner chunk (so that a
    restore can map it); ``run``: the persistent repository's run identity, recorded in the step
    (a restore uses only steps of its own run). A step already committed there (an earlier run's)
    is deleted first, so a local step always holds one save. Raises the save's CheckpointError."""
    shards, held = [], []
    for n, (owner, (key, shape, dt, box, arr)) in enumerate(boxes):
        local = f"h{owner}/{n:06d}"
        data = np.asarray(arr) if np.asarray(arr).flags.c_contiguous else np.array(arr)  # keeps a 0-d shape
        shards.append(LocalShard(local, data.shape, data.dtype, Box.full(data.shape), data))
        held.append(HeldBox(local, owner, key, tuple(shape), dtype_name(np.dtype(dt)), box).to_wire())
    if step in repo.steps():
        repo.delete(step)
    state = {"global": global_state, "tiers": {"token": token, "host": host, "hosts": hosts, "boxes": held, "run": run}}
    opts = options or SaveOptions()
    return save(repo, step, shards, state=state,
                metadata={TIERS_KEY: {"token": token, "host": host, "hosts": hosts, "run": run}},
                coordinator=LocalCoordinator(), options=SaveOptions(
                    timeout_s=opts.timeout_s, reuse="off",
                    chunk_target_bytes=WHOLE_CHUNK_BYTES if whole_chunks else opts.chunk_target_bytes))


@dataclass
class _LocalJob:
    step: int
    record: TierSave | None = None
    done: threading.Event = field(default_factory=threading.Event)


class TierWriter:
    """The local tier's save side for one manager: cadence, one save in flight, token, retention."""

    def __init__(self, tier: LocalTier, rank: int, world: int, coord: Any, exchange: PeerExchange | None,
                 options: SaveOptions | None, persistent: Repository | None = None) -> None:
        self.tier, self.rank, self.world, self.coord = tier, rank, world, coord
        self.exchange = exchange if tier.replicate and world > 1 else None
        self.options = options
        self.repository = Repository(tier.url(rank), options={"mapped_reads": tier.mapped})
        self.tokens: dict[int, str] = {}
        self.history: list[TierSave] = []
        self._job: _LocalJob | None = None
        self._last: int | None = None
        self._worker = BackgroundWorker("ckptfmt-local")
        # The run's nonce, drawn by rank 0 once, here: no save of this manager is in flight yet, so
        # the coordinator is never used by two threads at once (the torch store client is not
        # safe for that). A step's token is the nonce and the step: unique per manager and step.
        # The persistent repository's run identity too (rank 0 reads or creates it): None when the
        # store refuses, and then no local step is ever restored unless the tier is adopted.
        mine = None
        if rank == 0:
            run = ""
            try:
                run = run_identity(persistent) if persistent is not None else ""
            except CheckpointError as e:
                _log.warning("local tier: no run identity in %s (%s); its local steps will not be restored",
                             getattr(persistent, "url", "?"), e)
            mine = json.dumps([secrets.token_hex(8), run]).encode()
        nonce, run = json.loads(bytes(mine if world == 1 else coord.broadcast("tiers/nonce", mine)).decode())
        self.nonce, self.run = str(nonce), (str(run) or None)

    def due(self, step: int, force: bool) -> bool:
        return step != self._last and (force or step % self.tier.every == 0)

    def token(self, step: int) -> str:
        return f"{self.nonce}-{int(step)}"

    def start(self, step: int, token: str, snapshot: Any, global_state: Any, blocked_s: float) -> None:
        """Run the exchange and the local save of ``snapshot`` (the own boxes, host copies) in the background."""
        self._last = step
        self.tokens[step] = token
        for s in [s for s in self.tokens if s < step - 1000 * self.tier.every]:
            del self.tokens[s]
        job = _LocalJob(step)
        received = None
        if self.exchange is not None and not getattr(self.exchange, "background", False):
            received = self._exchange(step, snapshot)  # in the caller's thread, in program order
            blocked_s += received[1]
        self._job = job
        # A kept thread: the caller does not wait for a thread to start (milliseconds on a loaded host).
        self._worker.submit(functools.partial(self._run, job, token, snapshot, global_state, blocked_s, received))

    def _exchange(self, step: int, own: list) -> tuple[bytes | BaseException, float]:
        t0 = time.perf_counter()
        try:
            return self.exchange.shift(f"tiers/save/{step}", pack_payload(own), -1), time.perf_counter() - t0  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - recorded by the local save, which then fails
            return e, time.perf_counter() - t0

    def _run(self, job: _LocalJob, token: str, own: list, global_state: Any, blocked_s: float,
             received: tuple[bytes | BaseException, float] | None) -> None:
        t0 = time.perf_counter()
        own_bytes = sum(int(a.nbytes) for *_, a in own)
        peer_bytes, exchange_s = 0, 0.0
        try:
            boxes: list = [(self.rank, b) for b in own]
            if self.exchange is not None:
                # Host h holds host h+1's boxes: every rank sends its own to rank - 1.
                got, exchange_s = received if received is not None else self._exchange(job.step, own)
                if isinstance(got, BaseException):
                    raise got
                peer = unpack_payload(got, f"the boxes of host {(self.rank + 1) % self.world} for step {job.step}")
                peer_bytes = sum(int(a.nbytes) for *_, a in peer)
                boxes += [((self.rank + 1) % self.world, b) for b in peer]
            write_local_step(self.repository, job.step, self.rank, self.world, token, boxes, global_state, self.options,
                             whole_chunks=self.tier.mapped, run=self.run)
            job.record = TierSave(job.step, token, True, blocked_s, time.perf_counter() - t0, own_bytes, peer_bytes,
                                  exchange_s=exchange_s)
            self._retain()
        except Exception as e:  # noqa: BLE001 - a local tier never fails training; recorded and logged
            job.record = TierSave(job.step, token, False, blocked_s, time.perf_counter() - t0, own_bytes, peer_bytes,
                                  f"{type(e).__name__}: {e}")
            _log.error("local tier: step %d was not saved on host %d: %s: %s", job.step, self.rank, type(e).__name__, e)
        finally:
            self.history.append(job.record)  # type: ignore[arg-type]
            job.done.set()

    def _retain(self) -> None:
        steps = self.repository.steps()
        for s in steps[:-self.tier.keep]:
            try:
                self.repository.delete(s)
                _log.info("local tier: deleted step %d on host %d (keep %d)", s, self.rank, self.tier.keep)
            except CheckpointError as e:
                _log.warning("local tier: could not delete step %d on host %d: %s", s, self.rank, e)
        # A process killed during a local save leaves its private objects in host memory
        # (/dev/shm): collect abandoned saves (FORMAT.md 10; leases younger than the grace are kept).
        try:
            report = self.repository.gc()
            if report.removed_saves:
                _log.info("local tier: collected %d abandoned saves on host %d", len(report.removed_saves), self.rank)
        except CheckpointError as e:
            _log.warning("local tier: gc on host %d failed: %s", self.rank, e)

    def close(self) -> None:
        """Release the exchange's data plane, unless a local save still runs (it then goes with the process)."""
        close = getattr(self.exchange, "close", None)
        if self._job is None:
            self._worker.stop()
            if close is not None:
                close()

    def join(self, timeout: float | None = None) -> TierSave | None:
        job = self._job
        if job is None:
            return None
        if not job.done.wait(timeout):
            return None
        self._job = None
        return job.record
