"""Incremental saves: reference the previous committed save's shard object instead of writing it
again (FORMAT.md 8.4, extension ``ckptfmt.references``).

The leader picks the previous committed step ``P`` (the newest one below the step being saved),
pins its save id and the saves ``P`` itself references in its lease, and only then confirms that
``P``'s manifest is still committed (:func:`pin_previous`): a collector that deletes ``P`` later
reads the lease and keeps the pinned saves (FORMAT.md 10.3). Every rank then calls a
:class:`ReusePlanner` once per shard it owns, before it writes anything of that shard; it returns
a reference record or None ("write it"). A shard is referenced only when ``P`` stores the same
tensor, box, dtype and geometry and its bytes are proven equal; a crc32c match alone is never
proof (FORMAT.md 8.4):

* **identity and digest proof** (``reuse="auto"``, for shards with a ``LocalShard.source``, the
  global ``jax.Array`` the JAX bridge passes): this process saved that very object, still alive
  and not deleted, in an earlier committed save of this repository; the object it recorded then
  (save id, path, size, every checksum) is the one ``P`` names for this shard; and the source
  block's digest (:mod:`ckptfmt.session._digest`, SHA-256) now equals the one taken of the block it
  wrote (or proved) then. No stored
  byte is read. The identity alone proves nothing: a ``jax.Array`` may share its buffer with a
  mutable host object (on CPU, ``jax.device_put`` of a 64-byte-aligned numpy array, or
  ``jax.dlpack.from_dlpack``), and JAX exposes no way to tell such an array from one that owns
  its buffer; the digest catches a change made through the other object. The digest of a shard
  being written is taken only where it may serve (:meth:`ReusePlanner._may_recur`): ``P`` has no
  row for it, or its chunk crc32c equal the row's; a shard that changed since ``P`` is proven
  by bytes at its next save, which then takes it.
* **byte proof** (``reuse="auto"`` for every other shard and where the identity proof fails,
  ``reuse="compare"`` for all): the
  chunk crc32c (computed anyway) equal ``P``'s, then the stored object is read, checked against
  ``P``'s manifest as a restore checks it, and compared byte for byte with the source.
* ``reuse="off"``: every shard is written.

A reference names the object's own save (one level deep), never a chain through ``P``. After
its lease pins them, the leader reads the lease of every pinned save: nothing of a save whose
lease says ``collected`` (a collector has claimed it, FORMAT.md 10.3) is referenced.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckptfmt import layout
from ckptfmt.shard._blockcheck import BlockChecks
from ckptfmt.session._digest import DigestWindow, PendingDigest, start_digest
from ckptfmt.errors import CheckpointError
from ckptfmt.manifest import Manifest, TensorEntry
from ckptfmt.shard import ShardRecord, chunk_data, padded_chunks, shard_bytes, shard_sizes

if TYPE_CHECKING:
    from ckptfmt.session._shardwriter import Materialize
    from ckptfmt._types import LocalShard
    from ckptfmt.plan import TensorWritePlan, WriteItem
    from ckptfmt.repository import Repository
    from ckptfmt.storage import Storage

__all__ = ["ReuseMemory", "ReusePlanner", "default_memory", "pin_previous", "previous_manifest"]


@dataclass(frozen=True)
class Remembered:
    """What this process stored for one source shard: the object (located, every chunk's length
    listed, as :meth:`ShardRecord.of_manifest` reads it), and its block's digest."""

    shard: ShardRecord
    digest: bytes


class ReuseMemory:
    """What this process saved from which source object: the identity proof's record.

    Keyed by the source object itself, held weakly (an entry dies with its object, so a recycled
    ``id`` never matches), then by (repository, key path, box, dtype, geometry). Thread-safe.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, dict[tuple, Remembered]]] = {}
        self._lock = threading.Lock()

    def remember(self, source: object, where: tuple, shard: Remembered) -> None:
        with self._lock:
            entry = self._by_id.get(id(source))
            if entry is None or entry[0]() is not source:
                try:
                    ref = weakref.ref(source, self._forget(id(source)))
                except TypeError:  # not weakly referenceable: no identity proof for it
                    return
                entry = self._by_id[id(source)] = (ref, {})
            entry[1][where] = shard

    def recall(self, source: object, where: tuple) -> Remembered | None:
        with self._lock:
            entry = self._by_id.get(id(source))
            if entry is None or entry[0]() is not source:
                return None
            return entry[1].get(where)

    def _forget(self, ident: int) -> Callable[[weakref.ref], None]:
        def drop(ref: weakref.ref) -> None:
            with self._lock:
                if self._by_id.get(ident, (None,))[0] is ref:
                    del self._by_id[ident]
        return drop

    def __len__(self) -> int:
        return len(self._by_id)


_DEFAULT: list[ReuseMemory] = []
_DEFAULT_LOCK = threading.Lock()


def default_memory() -> ReuseMemory:
    """The process's identity memory (created on first use, not at import)."""
    with _DEFAULT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(ReuseMemory())
        return _DEFAULT[0]


def _alive(source: object) -> bool:
    """A donated or deleted jax.Array's buffer may hold anything: it proves nothing."""
    deleted = getattr(source, "is_deleted", None)
    try:
        return not (callable(deleted) and deleted())
    except Exception:
        return False


def pin_previous(repo: Repository, step: int, check_mode: str) -> Manifest | None:
    """Rank 0, before the lease: the previous committed step's manifest (the newest step below
    ``step`` whose manifest validates), or None (no reuse) when there is none or reuse is off."""
    if check_mode == "off":
        return None
    try:
        older = [s for s in repo.steps() if s < step]
        return repo.manifest(older[-1]) if older else None
    except CheckpointError:
        return None  # no reuse when the previous step cannot be read: everything is written


def lease_refs(previous: Manifest | None) -> list[str]:
    """The save ids a save that may reference ``previous``'s objects pins in its lease (10.1)."""
    return [] if previous is None else sorted({previous.save_id} | set(previous.referenced_saves))


def previous_manifest(repo: Repository, pinned: Any) -> Manifest | None:
    """After the lease names the pinned saves: ``P``'s manifest if it is still committed (the
    slot still names the same save id), else None. Every rank calls it; a rank that cannot read
    it writes everything (the objects stay pinned, so a slower rank never reads a deleted one)."""
    if not pinned:
        return None
    step, save_id = int(pinned[0]), str(pinned[1])
    try:
        m = repo.manifest(step)
    except CheckpointError:
        return None
    return m if m.save_id == save_id else None


def _same_crcs(crcs: Any, stored: ShardRecord) -> bool:
    """The source block's chunk crc32c equal the stored row's (a raw shard's chunks)."""
    return crcs is not None and tuple(int(c) for c in crcs) == stored.chunk_crc32c


@dataclass
class _Seen:
    source: object  # the framework's array that held the block (compared by identity)
    where: tuple
    chunk_nbytes: int  # of a raw chunk, for records that do not list their chunks' lengths
    digest: PendingDigest | None = None  # of the block written or proved; None: nothing to remember


class ReusePlanner:
    """The per-shard hook of one rank's save (see the module docstring). Not shared across saves."""

    def __init__(self, storage: Storage, previous: Manifest | None, *, mode: str,
                 memory: ReuseMemory | None = None, codec: str = "raw", exclude: frozenset[str] = frozenset(),
                 packed: bool = True) -> None:
        self.storage, self.previous, self.mode, self.codec = storage, previous, mode, codec
        # An unpacked save (layout "arrays") references through ckptfmt.references, which names
        # whole shard objects: it never references a shard inside a pack (FORMAT.md 5.13, 5.15).
        self.packed = packed
        self.exclude = exclude  # saves a collector has claimed: never referenced (FORMAT.md 8.4)
        self.memory = memory if memory is not None else default_memory()
        self.repo_id = str(getattr(storage, "url", id(storage)))
        self._rows: dict[str, dict[tuple[int, ...], int]] = {}
        self._seen: dict[tuple[int, tuple[int, ...]], _Seen] = {}
        self._checks = BlockChecks()
        self._digests = DigestWindow()
        self._plain_dirs: set[str] = set()  # directories of P found to be no symbolic link
        self.referenced = 0

    def __call__(self, plan: "TensorWritePlan", item: "WriteItem", holder: "LocalShard",
                 materialize: "Materialize") -> ShardRecord | None:
        """A reference record for this shard, or None to write it. Never raises for a bad earlier
        object: it is then simply written anew."""
        if self.mode == "off":
            return None
        g = plan.geometry
        where = (self.repo_id, plan.key, item.box.offset, item.box.shape, g.shape, plan.dtype, g.shard_shape,
                 g.chunk_shape, self.codec)
        source = getattr(holder, "source", None)
        seen = None
        if source is not None and self.mode == "auto":
            seen = self._seen[(plan.index, item.cell)] = _Seen(source, where, shard_sizes(g).chunk)
        found = self._stored(plan, item)
        if found is None or not self._proven(found, seen, materialize):
            if seen is not None and self._may_recur(found, materialize):  # its digest, for the next save's identity proof
                seen.digest = self._digests.add(start_digest(materialize(False)[0]))
            return None
        self.referenced += 1
        return found[2]

    def _proven(self, found: tuple[TensorEntry, int, ShardRecord], seen: _Seen | None,
                materialize: "Materialize") -> bool:
        """The identity and digest proof where the source is tracked and was saved as ``P``'s
        row, else the byte proof. Sets ``seen.digest`` when the shard is proven."""
        t, s, stored = found
        known = self.memory.recall(seen.source, seen.where) if seen is not None and _alive(seen.source) else None
        if seen is not None and known is not None and known.shard.same_object(stored):
            digest = start_digest(materialize(False)[0])
            if digest.result() != known.digest:
                return False  # changed (through a host object sharing its buffer): written again
            seen.digest = digest
            return True
        if not self._same_bytes(t, s, stored, materialize):
            return False
        if seen is not None:
            seen.digest = self._digests.add(start_digest(materialize()[0]))
        return True

    def _may_recur(self, found: tuple[TensorEntry, int, ShardRecord] | None, materialize: "Materialize") -> bool:
        """Whether a shard to be written is worth its digest (what a later identity proof needs):
        when ``P`` has no row for it (a first save: a frozen base is proven cheaply from the second
        save on), or when its chunk crc32c (computed anyway) equal that row's, so that it did not
        change since ``P``. A shard of a training step, new at every save, is then not hashed at
        every save (SHA-256: about 0.6 s of CPU per GiB). Never a proof either way: without a
        digest, the next save's proof of this shard is the byte proof, which then takes it."""
        if found is None or self.codec != "raw":  # an encoded chunk's crc32c covers its encoded bytes
            return True
        return _same_crcs(materialize()[1], found[2])

    def _stored(self, plan: "TensorWritePlan", item: "WriteItem") -> tuple[TensorEntry, int, ShardRecord] | None:
        """``P``'s row for this shard, when ``P`` holds the same tensor with the same geometry: the
        record this save acknowledges when it references the object."""
        if self.previous is None:
            return None
        t = self.previous.tensors.get(plan.key)
        g = plan.geometry
        if (t is None or t.shape != g.shape or t.dtype != plan.dtype or t.array.shard_shape != g.shard_shape
                or t.array.chunk_shape != g.chunk_shape or t.array.codec != self.codec
                or (t.packed is not None and not self.packed)):
            return None
        rows = self._rows.get(plan.key)
        if rows is None:
            rows = self._rows[plan.key] = {tuple(o): j for j, o in enumerate(t.shards.offset.tolist())}
        s = rows.get(tuple(item.box.offset))
        if s is None:  # same shape and shard_shape: the same offset is the same grid cell and box
            return None
        stored = ShardRecord.of_manifest(t, s, tensor=plan.index, cell=item.cell)
        return None if stored.ref[0] in self.exclude else (t, s, stored)  # type: ignore[index]

    def _same_bytes(self, t: TensorEntry, s: int, stored: ShardRecord,
                    materialize: "Materialize") -> bool:
        """The byte proof: the chunk crc32c equal, then the stored object, checked against ``P``'s
        manifest (size, index, every chunk's crc32c), holds exactly the source's chunks."""
        block, crcs = materialize()
        if self.codec == "raw" and not _same_crcs(crcs, stored):
            return False  # (an encoded chunk's crc32c covers its encoded bytes: compared decoded below)
        obj = t.object_key(s)
        try:
            self.storage.check_no_links(obj, self._plain_dirs, tensor=t.key)  # a reader would refuse it
            probe = self.storage.size_check(obj, t.object_nbytes(s), tensor=t.key)
            buf = self.storage.read_range(obj, *shard_bytes(t, s).whole, tensor=t.key).result()
            probe.result()
            c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
            views = self._checks.whole(t, s, obj, buf, range(c0, c1))
            for c, want in zip(range(c0, c1), padded_chunks(block, t.geometry.chunk_shape)):
                got = (np.frombuffer(chunk_data(views[c]), np.uint8) if self.codec == "raw"
                       else self._checks.decode(t, c, obj, views[c]).reshape(-1).view(np.uint8))
                if not np.array_equal(got, want.reshape(-1).view(np.uint8)):
                    return False
        except CheckpointError:
            return False  # a damaged earlier object is never referenced
        return True

    def remember(self, save_id: str, records: list[ShardRecord]) -> None:
        """After the commit: which object now holds each identity-tracked source's bytes."""
        for r in records:
            seen = self._seen.get((r.tensor, r.cell))
            if seen is None or seen.digest is None or not _alive(seen.source):
                continue
            stored = r.located(save_id, layout.array_path(save_id, r.tensor), seen.chunk_nbytes)
            self.memory.remember(seen.source, seen.where, Remembered(stored, seen.digest.result()))
