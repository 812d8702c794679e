"""The save protocol: freeze, write privately, verify, acknowledge, commit.

Call order on every rank (all collectives are named and bounded by ``timeout_s``):

1. rank 0 creates the repository marker ``ckptfmt.json`` if absent, picks the save id and writes
   ``saves/<id>/LEASE``; ``broadcast("save/begin")``.
2. ``allgather("save/freeze")`` of (step, inventory digest, held boxes). Every rank computes the
   same pure plan (:func:`ckptfmt.plan.plan_save_packed`); any disagreement raises StepMismatchError on
   every rank before a byte of tensor data is written.
3. each rank writes the shards it owns (rank 0 also every ``zarr.json`` and the global state;
   each rank its own per-rank state) and verifies them: object size, index checksum, and every
   inner chunk's stored crc32c against the crc32c computed from the source bytes
   (:mod:`ckptfmt.session._shardwriter`; keys from :mod:`ckptfmt.layout`, bytes from :mod:`ckptfmt.shard`).
4. ``allgather("save/ack")`` of the shard records (:class:`~ckptfmt.shard.ShardRecord`, named columns)
   and state entries, or of the writer's error.
5. rank 0 builds and validates the manifest, switches its lease to ``committing`` (a write
   conditional on the lease generation it last wrote: the fence against gc, FORMAT.md 8.3), and
   publishes the manifest with one conditional create of ``manifests/<step>.json``;
   ``broadcast("save/commit")`` of the outcome.

On failure before the commit no manifest exists, so the step is never listed; rank 0 removes
the save's private objects when it can, and ``Repository.gc`` removes them otherwise.

Subpackage ``ckptfmt.session``. The save side: the save protocol (freeze, write privately, verify,
acknowledge, commit), its options, the shard writers, incremental reuse and its digests, and
asynchronous saves (FORMAT.md 7, 8). Its modules: ``_digest``, ``_reuse``, ``_saveopts``,
``_shardwriter``, ``asyncsave``. May import: floor, manifest, storage, shard, repository. The floor:
the top-level modules listed in ``ckptfmt/__init__.py`` (tests/test_layering.py holds the rules and
enforces them). Subpackages that may import it: interop, manager.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Iterable, Mapping

import msgpack
import numpy as np

from ckptfmt._version import __version__
from ckptfmt.session import _reuse
from ckptfmt._boxcols import check_held, pack_boxes
from ckptfmt.repository._gcfence import excluded
from ckptfmt.manifest._refs import DERIVED, REFERENCES, ZSTD, any_in_derived_form, references_payload, wants_derived
from ckptfmt.manifest._packs import PACKS, packs_payload
from ckptfmt.manifest._entries import PackedRows, empty_tables
from ckptfmt.session._saveopts import SaveOptions as SaveOptions
from ckptfmt.session._shardwriter import (PhaseClock, WriteSettings, state_from_wire, state_to_wire, write_and_verify,
                                          write_state)
from ckptfmt._types import LocalShard
from ckptfmt.coord import Coordinator, LocalCoordinator
from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.gcpause import paused_gc
from ckptfmt.errors import (CheckpointError, IncompleteSaveError, InvalidManifestError, StepAlreadyCommittedError,
                            StepMismatchError)
from ckptfmt.layout import (MARKER_BYTES, MARKER_KEY, MAX_STEP, array_path, cell_key, lease_bytes, manifest_key,
                            save_prefix)
from ckptfmt.layout import lease_key as lease_key
from ckptfmt.layout import new_save_id as new_save_id
from ckptfmt.manifest import (MAX_NESTING, ArraySpec, ChunkTable, Manifest, ShardTable, StateEntry, TensorEntry,
                              parse_manifest)
from ckptfmt.plan import TensorWritePlan, plan_save_packed
from ckptfmt.repository import Repository
from ckptfmt.shard import ShardRecord, records_from_wire, records_to_wire, shard_sizes
from ckptfmt.storage import NO_VALUE, Storage

__all__ = ["SaveOptions", "save", "lease_key", "new_save_id"]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def _versions(extra: Mapping[str, str] | None) -> dict[str, str]:
    v = {"ckptfmt": __version__, "python": platform.python_version(), "numpy": np.__version__}
    try:
        v["tensorstore"] = version("tensorstore")
    except (PackageNotFoundError, ValueError):
        v["tensorstore"] = "unknown"
    v.update({str(k): str(x) for k, x in (extra or {}).items()})
    return v


class _Heartbeat:
    """Rank 0 refreshes the lease so gc can tell a live save from an abandoned one.

    Every write is conditional on the generation this save last wrote: a lease that gc claimed or
    removed is never brought back. Once a refresh finds the lease gone or replaced, the save is
    ``lost`` and must not commit (its objects may already be deleted). :meth:`begin_commit` is
    the last write: it switches the lease to ``committing`` under the same lock as the beats,
    and no beat follows it (FORMAT.md 10.1).
    """

    def __init__(self, storage: Storage, key: str, body: dict[str, Any], every_s: float) -> None:
        self.storage, self.key, self.body, self.every_s = storage, key, body, every_s
        self.generation: bytes = NO_VALUE
        self.lost = False
        self.committing = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptfmt-lease", daemon=True)

    def beat(self) -> None:
        with self._lock:
            if self.committing or self.lost:
                return
            gen = self.storage.write_if(self.key, lease_bytes(self.body), self.generation)
            if not gen:
                self.lost = True
                self._stop.set()
            else:
                self.generation = gen

    def begin_commit(self) -> bool:
        """Switch the lease to ``committing``, conditionally on our last generation. True when
        this save may now create its manifest; False when a collector claimed the lease first.
        Raises StorageError when the outcome is unknown (the caller must not commit then)."""
        with self._lock:
            self._stop.set()
            if self.lost:
                return False
            gen = self.storage.write_if(self.key, lease_bytes(dict(self.body, state="committing")), self.generation)
            if not gen:
                self.lost = True
                return False
            self.generation, self.committing = gen, True
            return True

    def start(self) -> "_Heartbeat":
        self.beat()
        if self.lost:
            raise StepMismatchError("a lease for this save id already exists", object=self.key,
                                    expected="a new save id", found="existing lease")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except CheckpointError:
                pass  # transient; the commit re-checks the lease itself

    def holds(self) -> bool:
        """True while this save still owns its lease (checked right before the commit)."""
        if self.lost:
            return False
        value, gen = self.storage.read_with_generation([self.key])[0]
        return value is not None and gen == self.generation

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def save(repo: Repository | str | os.PathLike[str], step: int, shards: Iterable[LocalShard], *, state: Any = None, rank_state: Any = None,
         metadata: Mapping[str, Any] | None = None, coordinator: Coordinator | None = None,
         versions: Mapping[str, str] | None = None, options: SaveOptions | None = None) -> Manifest:
    """Save one logical step from every rank, and return the committed manifest.

    Every rank calls this with the same ``step`` and the blocks it holds. Returns only after the
    manifest is committed. On any failure every rank raises a CheckpointError subclass and no
    manifest is published: the step is not listed and earlier steps are untouched. An unknown
    ``options.reuse`` raises ValueError before anything is written.

    With ``options.reuse`` "auto" (the default) or "compare", a shard whose bytes are proven equal
    to the previous committed step's is referenced there instead of written (FORMAT.md 8.4).
    ``options`` were checked when built (:class:`SaveOptions` raises ValueError then).
    """
    opts = options or SaveOptions()
    with paused_gc(opts.pause_gc):  # its per-leaf objects are acyclic (ckptfmt.gcpause)
        return _save(repo, step, shards, state, rank_state, metadata, coordinator, versions, opts)


def _save(repo: Repository | str | os.PathLike[str], step: int, shards: Iterable[LocalShard], state: Any, rank_state: Any,
          metadata: Mapping[str, Any] | None, coordinator: Coordinator | None, versions: Mapping[str, str] | None,
          opts: SaveOptions) -> Manifest:
    repository = repo if isinstance(repo, Repository) else Repository(str(repo))
    storage = repository.storage
    coord = coordinator or LocalCoordinator()
    rank, world = coord.rank, coord.world
    # Inputs are checked on every rank before anything is written. A rank whose inputs are bad
    # still joins the collectives and reports its error there, so that every rank fails the same
    # way at once instead of the others waiting for a timeout.
    local_error: CheckpointError | None = None
    try:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= MAX_STEP:
            raise StepMismatchError("step must be an integer in [0, 2^63)", expected=f"0 <= step <= {MAX_STEP}",
                                    found=repr(step))
        step = int(step)
        _check_metadata(metadata)
        local: dict[str, list[LocalShard]] = _index_shards(shards)
    except CheckpointError as e:
        local_error, local, step = e, {}, int(step) if isinstance(step, (int, np.integer)) and not isinstance(step, bool) else -1
        if world == 1:
            raise

    # 1. begin: save id and lease (rank 0), before any rank writes anything.
    heartbeat, begin = _begin(repository, opts, step, world, local_error) if rank == 0 else (None, {})
    committed = False
    save_id = begin.get("save_id", "")
    try:
        begin = _unpack(coord.broadcast("save/begin", _pack(begin) if rank == 0 else None, 0, opts.timeout_s))
        if "error" in begin:
            raise CheckpointError.from_json(begin["error"])
        save_id = begin["save_id"]
        # _run holds the only reference to this rank's blocks, and lets go of them once they are
        # written: the commit of a large state does not keep its inputs (a caller that passed an
        # iterator holds none either).
        inputs: list[dict[str, list[LocalShard]] | CheckpointError] = [local_error or local]
        del local
        manifest = _run(repository, storage, coord, opts, step, save_id, inputs, state, rank_state,
                        metadata, versions, heartbeat, begin.get("previous"))
        committed = True
        return manifest
    finally:
        if heartbeat is not None:
            _end(storage, heartbeat, step, save_id, committed)


def _begin(repository: Repository, opts: SaveOptions, step: int, world: int,
           local_error: CheckpointError | None) -> tuple["_Heartbeat | None", dict[str, Any]]:
    """Step 1 on rank 0: the marker, a fresh save id and its lease, which pins the saves this one
    may reference (FORMAT.md 8.4); (heartbeat, the begin message)."""
    storage = repository.storage
    try:
        if local_error is not None:
            raise local_error
        if storage.read(manifest_key(step)) is not None:
            raise StepAlreadyCommittedError(f"step {step} is already committed (a step is written once): save it "
                                            "as another step, or delete this one first", object=manifest_key(step),
                                            expected="no manifest", found="committed manifest")
        storage.create_if_absent(MARKER_KEY, MARKER_BYTES)  # FORMAT.md 4.5; False: already there
        save_id = opts.save_id or new_save_id(step)
        previous = _reuse.pin_previous(repository, step, opts.reuse)
        body: dict[str, Any] = {"save_id": save_id, "step": step, "world": world}
        if previous is not None:
            body["refs"] = _reuse.lease_refs(previous)
        heartbeat = _Heartbeat(storage, lease_key(save_id), body, opts.heartbeat_s).start()
        begin: dict[str, Any] = {"save_id": save_id}
        if previous is not None:
            # Pinned. Now the claims (FORMAT.md 8.4, 10.3): nothing of a save whose lease says
            # "collected" is referenced; then each rank confirms P is still committed.
            begin["previous"] = [previous.step, previous.save_id, sorted(excluded(storage, body["refs"]))]
        return heartbeat, begin
    except CheckpointError as e:
        return None, {"error": _err_json(e)}


def _end(storage: Storage, heartbeat: "_Heartbeat", step: int, save_id: str, committed: bool) -> None:
    """Rank 0, whatever happened: remove the lease of a committed save, or the objects of a failed one."""
    heartbeat.stop()
    try:
        # Never delete a save whose manifest was written, even if a later collective failed:
        # the manifest, not this process's view of the protocol, decides what is committed.
        if committed or _published_by(storage, step, save_id):
            storage.write_if(lease_key(save_id), None, heartbeat.generation)
        elif not heartbeat.lost:  # best effort; gc collects whatever a slow peer writes later
            storage.delete_prefix(save_prefix(save_id))
    except CheckpointError:
        pass


def _published_by(storage: Storage, step: int, save_id: str) -> bool:
    """Whether the manifest of ``step`` names ``save_id`` (read only when this process does not
    know its commit: a committed manifest of 100,000 tensors is 30 MB)."""
    published = storage.read(manifest_key(step))
    return published is not None and save_id.encode() in published


def _check_metadata(metadata: Any) -> None:
    """User metadata goes into the manifest: plain JSON with str keys and finite numbers only, nested
    no deeper than a reader parses (FORMAT.md 5.10: metadata is level 2 of the manifest). Iterative,
    so that a deep or cyclic value raises InvalidManifestError, not RecursionError."""
    stack: list[tuple[Any, str, int]] = [(metadata, "metadata", 2)]
    while stack:
        value, path, level = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if level > MAX_NESTING:
                raise InvalidManifestError("metadata nests arrays and objects too deeply (or holds a cycle)", object=path,
                                           expected=f"<= {MAX_NESTING} levels (the manifest's top-level object is level 1)",
                                           found=f"more than {MAX_NESTING} levels")
            if isinstance(value, Mapping):
                for k, v in value.items():
                    if not isinstance(k, str):
                        raise InvalidManifestError("metadata keys must be strings", object=path, expected="str",
                                                   found=repr(k)[:80])
                    stack.append((v, f"{path}/{k}", level + 1))
            else:
                stack.extend((v, f"{path}/{i}", level + 1) for i, v in enumerate(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidManifestError("metadata numbers must be finite", object=path, expected="finite", found=repr(value))
        elif not (value is None or isinstance(value, (str, int, bool))):
            raise InvalidManifestError("metadata must be plain JSON", object=path,
                                       expected="dict, list, str, int, float, bool, None", found=type(value).__name__)


def _index_shards(shards: Iterable[LocalShard]) -> dict[str, list[LocalShard]]:
    out: dict[str, list[LocalShard]] = {}
    for s in shards:
        if not isinstance(s, LocalShard):
            raise StepMismatchError("save() takes LocalShard objects", expected="LocalShard", found=type(s).__name__)
        check_held(s)
        prev = out.get(s.key)
        if prev and (prev[0].global_shape != s.global_shape or prev[0].dtype != s.dtype):
            raise StepMismatchError("one tensor key has two shapes or dtypes on this rank", key=s.key,
                                    expected=(prev[0].global_shape, str(prev[0].dtype)), found=(s.global_shape, str(s.dtype)))
        if prev is None:
            out[s.key] = [s]  # sized to its one shard: a save of many tensors holds one list per tensor
        else:
            prev.append(s)
    return out


def _run(repository: Repository, storage: Storage, coord: Coordinator, opts: SaveOptions, step: int, save_id: str,
         inputs: list[dict[str, list[LocalShard]] | CheckpointError], state: Any, rank_state: Any,
         metadata: Mapping[str, Any] | None, versions: Mapping[str, str] | None,
         heartbeat: "_Heartbeat | None", pinned: Any = None) -> Manifest:
    """Steps 2 to 5 of a save. ``inputs`` holds this rank's blocks by key (or the error its inputs
    raised), taken out of it here: they are let go of once written."""
    rank, world = coord.rank, coord.world
    local = inputs.pop()
    if isinstance(local, CheckpointError):  # this rank's inputs were bad: say so in the freeze, then fail
        coord.allgather("save/freeze", _pack({"error": _err_json(local)}), opts.timeout_s)
        raise local
    # 2. freeze: agree on step, inventory and ownership before any write.
    clock = PhaseClock(opts.timings)
    t = time.perf_counter()
    plans = _freeze(coord, opts, step, save_id, local)
    t = clock.add("plan", t)

    # 3. write privately and verify; 4. acknowledge (records or the error).
    reuse = _reuse.ReusePlanner(storage, _reuse.previous_manifest(repository, pinned), mode=opts.reuse,
                                codec=opts.codec, exclude=frozenset(pinned[2]) if pinned else frozenset(),
                                packed=opts.layout == "packed" and opts.codec == "raw")
    records: list[ShardRecord] = []
    shardings: dict[str, Any] = {}  # what the commit records of the blocks' sharding (rank 0's)
    try:
        shardings = {k: (v[0].sharding.to_json() if v[0].sharding is not None else None) for k, v in local.items()}
        settings = WriteSettings(opts.write_window_bytes, opts.max_write_bytes_per_s, opts.jitter_s, opts.codec,
                                 opts.codec_level, opts.layout == "packed" and opts.codec == "raw", opts.pack_bytes)
        records = write_and_verify(storage, plans, local, save_id, rank, settings, clock, reuse=reuse)
        del local  # written and verified: the blocks are not needed again
        t = time.perf_counter()
        state_entries = write_state(storage, save_id, rank, state, rank_state)
        t = clock.add("state", t)
        # One process is its own only writer: its records go to the commit as they are, not through
        # the wire form and back (at 20,000 leaves that round trip cost seconds).
        ack: dict[str, Any] = {"records": records if world == 1 else records_to_wire(records),
                               "state": [state_to_wire(e) for e in state_entries]}
    except CheckpointError as e:
        ack = {"error": _err_json(e)}
    except Exception as e:  # a writer bug must still reach every rank, not hang them
        ack = {"error": _err_json(IncompleteSaveError(f"writer failed: {type(e).__name__}: {e}"))}
    if world == 1:
        coord.allgather("save/ack", b"", opts.timeout_s)  # the collective's sequence, as on every world
        acks = [ack]
    else:
        acks = [_unpack(b) for b in coord.allgather("save/ack", _pack(ack), opts.timeout_s)]
    t = clock.add("ack", t)

    # 5. commit (rank 0), then tell everyone.
    outcome: dict[str, Any] = {}
    if rank == 0:
        outcome = _commit(repository, storage, heartbeat, save_id, step, world, plans, acks, shardings, metadata, versions, opts)
    checked = outcome.pop("parsed", None)  # rank 0 validated the manifest it created: not parsed twice
    # The other ranks learn the outcome (and the manifest's bytes) from rank 0; rank 0 keeps its own
    # and a single process sends nothing: a manifest of 100,000 tensors is 30 MB, and its packed
    # message and the copy unpacked from it were two more.
    message = None if rank != 0 else _pack(outcome) if world > 1 else b""
    got = coord.broadcast("save/commit", message, 0, opts.timeout_s)
    del message
    if rank != 0:
        outcome = _unpack(got)
    elif "error" in outcome:  # the error rank 0 raises reads as every other rank's, from the same message
        outcome = _unpack(_pack(outcome))
    del got
    clock.add("commit", t)
    if "error" in outcome:
        raise CheckpointError.from_json(outcome["error"])
    reuse.remember(save_id, records)
    committed = checked if checked is not None else parse_manifest(outcome["manifest"], max_bytes=repository.max_manifest_bytes)
    repository.remember_manifest(manifest_key(step), bytes(outcome["manifest"]), committed)  # read back by retention
    return committed


def _freeze(coord: Coordinator, opts: SaveOptions, step: int, save_id: str,
            local: dict[str, list[LocalShard]]) -> list[TensorWritePlan]:
    """Step 2: agree on step, inventory and ownership before any write; every rank's same plan."""
    inventory = {k: (list(v[0].global_shape), dtype_name(v[0].dtype)) for k, v in sorted(local.items())}
    digest = hashlib.sha256(_pack(sorted(inventory.items()))).hexdigest()
    # Each held box with its replica id and whether this rank offers its data (a candidate writer),
    # as columns: gathering 640,000 boxes from 64 ranks is then 64 concatenations.
    boxes = pack_boxes({k: [(s.box, int(s.replica_id), s.data is not None) for s in v] for k, v in sorted(local.items())},
                       keys_known=list(inventory))  # the digest below proves every rank holds these keys
    gathered = [_unpack(b) for b in coord.allgather("save/freeze", _pack(
        {"step": step, "digest": digest, "save_id": save_id, "boxes": boxes}), opts.timeout_s)]
    for r, g in enumerate(gathered):
        if "error" in g:
            e = g["error"]
            raise StepMismatchError(f"rank {r} rejected its inputs ({e['error']}: {e['message']}); nothing was written",
                                    key=e.get("key"), object=e.get("object"), expected=e.get("expected"), found=e.get("found"))
        if g["step"] != step or g["save_id"] != save_id:
            raise StepMismatchError("ranks disagree on the step being saved", expected=f"step {step} everywhere",
                                    found=f"rank {r} saves step {g['step']}")
        if g["digest"] != digest:
            raise StepMismatchError("ranks disagree on the tensor inventory (keys, shapes or dtypes)",
                                    expected=f"digest {digest[:12]}", found=f"rank {r} digest {g['digest'][:12]}")
    packed = [g["boxes"] for g in gathered]
    key = _plan_key(digest, opts.chunk_target_bytes, packed)
    with _PLANS_LOCK:
        plans = _PLANS.get(key)
    if plans is None:
        inv = {k: (tuple(shape), dt, numpy_dtype(dt).itemsize) for k, (shape, dt) in inventory.items()}
        plans = plan_save_packed(inv, packed, opts.chunk_target_bytes)
        for p in plans:  # shared by later saves of the same layout: never written to
            p.cells.flags.writeable = False
            p.writers.flags.writeable = False
        with _PLANS_LOCK:
            _PLANS[key] = plans
            while len(_PLANS) > _PLANS_MAX:
                _PLANS.pop(next(iter(_PLANS)))
    return plans


# The plan is a pure function of the inventory, every rank's held boxes and the chunk target, which
# a job repeats at every save (torch DCP caches its save plans likewise): the plans of the last few
# layouts, keyed by a digest of exactly those inputs.
_PLANS: dict[bytes, list[TensorWritePlan]] = {}
_PLANS_MAX = 4
_PLANS_LOCK = threading.Lock()


def _plan_key(inventory_digest: str, chunk_target_bytes: int, packed: list[Any]) -> bytes:
    h = hashlib.sha256(f"{inventory_digest}/{chunk_target_bytes}/{len(packed)}".encode())
    for p in packed:
        h.update(_pack(p))
    return h.digest()


def _commit(repository: Repository, storage: Storage, heartbeat: "_Heartbeat | None", save_id: str, step: int, world: int,
            plans: list[TensorWritePlan], acks: list[dict[str, Any]], shardings: Mapping[str, Any],
            metadata: Mapping[str, Any] | None, versions: Mapping[str, str] | None, opts: SaveOptions) -> dict[str, Any]:
    """Step 5 on rank 0: build and check the manifest, pass the fence, create it; the outcome message."""
    failed = [(r, a["error"]) for r, a in enumerate(acks) if "error" in a]
    if failed:
        r, e = failed[0]
        return {"error": _err_json(IncompleteSaveError(
            f"writer rank {r} failed ({e['error']}: {e['message']}); nothing was committed",
            key=e.get("key"), object=e.get("object"), expected=e.get("expected"), found=e.get("found")))}
    try:
        manifest = _build_manifest(save_id, step, world, plans, acks, shardings, metadata, versions, opts)
        data = manifest.to_bytes()
        del manifest  # the parse of its bytes below is what the commit returns: one copy at a time
        checked = parse_manifest(data, max_bytes=repository.max_manifest_bytes)
        # The fence (FORMAT.md 8.3): only a lease switched to "committing" may commit. A
        # gc that claimed the stale lease first makes this conditional write fail.
        if heartbeat is None or not heartbeat.begin_commit():
            raise IncompleteSaveError("the save's lease was collected by gc (stalled past the grace period)",
                                      object=lease_key(save_id), expected="lease held by this save",
                                      found="missing or replaced")
        if not storage.create_if_absent(manifest_key(step), data):
            raise StepAlreadyCommittedError("another save committed this step first", object=manifest_key(step),
                                            expected="no manifest", found="a manifest from another save")
        return {"ok": True, "manifest": data, "parsed": checked}
    except CheckpointError as e:
        return {"error": _err_json(e)}
    except Exception as e:  # never leave the other ranks waiting on a bug here
        return {"error": _err_json(IncompleteSaveError(f"commit failed: {type(e).__name__}: {e}"))}


def _err_json(e: CheckpointError) -> dict[str, Any]:
    return e.to_json()


def _build_manifest(save_id: str, step: int, world: int, plans: list[TensorWritePlan], acks: list[dict[str, Any]],
                    shardings: Mapping[str, Any], metadata: Mapping[str, Any] | None, versions: Mapping[str, str] | None,
                    opts: SaveOptions) -> Manifest:
    """The manifest from the plan and every writer's acknowledged records; IncompleteSaveError
    when a planned shard was not acknowledged."""
    by_cell: dict[tuple[int, tuple[int, ...]], ShardRecord] = {}
    for a in acks:
        wire = a["records"]
        for r in (wire if isinstance(wire, list) else records_from_wire(wire)):
            by_cell[(r.tensor, r.cell)] = r
    tensors: dict[str, TensorEntry] = {}
    refs: dict[str, dict[int, tuple[str, str]]] = {}
    packed = opts.layout == "packed" and opts.codec == "raw"
    table: dict[str, int] = {}      # FORMAT.md 5.15: the object table, in order of first use
    table_sizes: list[int] = []
    for p in plans:
        g = p.geometry
        nd = len(g.shape)
        # Only a tensor with shards needs its sizes (kept on the plan's geometry once asked).
        raw_chunk = shard_sizes(g).chunk if p.items else 0
        offsets, writers, keys, nbytes, icrcs, coff, cnb, ccrc = [], [], [], [], [], [], [], []
        objs, starts = [], []
        for row, it in enumerate(p.items):
            rec = by_cell.get((p.index, it.cell))
            if rec is None:
                raise IncompleteSaveError("a planned shard was not acknowledged", key=p.key,
                                          object=cell_key(it.cell), expected=f"ack from rank {it.writer}", found="none")
            if packed:  # its pack, or the earlier save's object a reference names (FORMAT.md 5.15)
                if rec.where is None:
                    raise IncompleteSaveError("a packed save's shard was acknowledged without its object", key=p.key,
                                              object=cell_key(it.cell), expected="(object, start)", found="none")
                okey, ostart, osize = rec.where
                if okey not in table:
                    table[okey] = len(table)
                    table_sizes.append(int(osize))
                objs.append(table[okey])
                starts.append(int(ostart))
            elif rec.ref is not None:  # the object of an earlier save (FORMAT.md 5.13)
                refs.setdefault(p.key, {})[row] = rec.ref
            offsets.append(list(it.box.offset))
            writers.append(it.writer)
            keys.append(cell_key(it.cell))
            nbytes.append(rec.nbytes)
            icrcs.append(rec.index_crc32c)
            coff.extend(rec.chunk_offsets)
            cnb.extend(rec.chunk_nbytes or [raw_chunk] * len(rec.chunk_offsets))
            ccrc.extend(rec.chunk_crc32c)
        if p.items:
            shards = ShardTable(np.asarray(offsets, np.int64).reshape(len(offsets), nd), np.asarray(writers, np.int64),
                                tuple(keys), np.asarray(nbytes, np.int64), np.asarray(icrcs, np.uint32))
            chunks = ChunkTable(np.asarray(coff, np.int64), np.asarray(cnb, np.int64), np.asarray(ccrc, np.uint32))
        else:  # no shard (an empty tensor): the read-only tables every such entry of its rank shares
            shards, chunks = empty_tables(nd)
        tensors[p.key] = TensorEntry(
            p.key, g.shape, p.dtype, shardings.get(p.key),
            ArraySpec(array_path(save_id, p.index), g.shard_shape, g.chunk_shape, opts.codec), shards, chunks,
            packed=PackedRows((), (), np.asarray(objs, np.int64), np.asarray(starts, np.int64)) if packed and objs else None)
    if table:  # every packed entry shares the one object table
        keys_t, sizes_t = tuple(table), tuple(table_sizes)
        tensors = {k: t if t.packed is None else dataclasses.replace(t, packed=dataclasses.replace(t.packed, keys=keys_t, sizes=sizes_t))
                   for k, t in tensors.items()}
    state: dict[str, StateEntry] = {}
    for a in acks:
        for wire in a["state"]:
            e = state_from_wire(wire)
            state[e.name] = e
    mu, extensions = [], {}
    if table:
        mu.append(PACKS)
        extensions[PACKS] = packs_payload(tuple(table), table_sizes)
    if refs:
        mu.append(REFERENCES)
        extensions[REFERENCES] = references_payload(refs)
    if opts.codec != "raw":
        mu.append(ZSTD)
        extensions[ZSTD] = {}
    if wants_derived(opts.manifest_columns, sum(len(t.shards) for t in tensors.values())) and any_in_derived_form(tensors):
        mu.append(DERIVED)
        extensions[DERIVED] = {}
    ext = {"must_understand": tuple(sorted(mu)), "extensions": extensions} if mu else {}
    return Manifest(save_id=save_id, step=step, created_unix=opts.created_unix if opts.created_unix is not None else time.time(),
                    writers=world, tensors=tensors, state=state, versions=_versions(versions), metadata=dict(metadata or {}),
                    **ext)
