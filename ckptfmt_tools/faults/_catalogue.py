"""The fault catalogue: one entry per fault, each injected into a fresh copy of a real save.

Faults of kind ``"disk"`` damage the newest committed step (2) of a two-writer save on disk;
the check then restores step 2 into live buffers and verifies it. Faults of kind ``"save"``
break a new save (step 3) while it runs. Faults of kind ``"gc"`` make the repository hostile to
garbage collection (:mod:`ckptfmt_tools.faults._gcfaults`). Faults of kind ``"reuse"`` change a
source between incremental saves (:mod:`ckptfmt_tools.faults._aliased`): each saved step must
restore the values it was saved with. Faults of kinds ``"coop"`` and ``"tier"`` break a restore
across processes: a cooperative restore (:mod:`ckptfmt_tools.faults._coopfaults`) and the
manager's local tier (:mod:`ckptfmt_tools.faults._tierfaults`), judged by
:mod:`ckptfmt_tools.faults._restorejudge`. Either way the prior step must stay intact.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptfmt import errors as E
from ckptfmt_tools.faults import _gcfaults as G
from ckptfmt_tools.faults._aliased import aliased_mutated
from ckptfmt_tools.faults import _gcraces as R
from ckptfmt_tools.faults import _coopfaults as C
from ckptfmt_tools.faults import _tierfaults as T
from ckptfmt_tools.faults._scene import TARGET_SHARD, TARGET_TENSOR, Scene, flip

__all__ = ["Fault", "CATALOGUE", "SaveAttempt", "by_name"]

_STALE = getattr(E, "StaleShardError", E.ChecksumMismatchError)


@dataclass
class SaveAttempt:
    """What a save fault reports back: every rank's result, and facts for the checks."""

    results: list[dict[str, Any]]
    where: str
    hung: bool = False
    returncodes: list[int | None] = field(default_factory=list)
    winner_seed: int | None = None      # two concurrent saves: whose data should be committed
    notes: list[str] = field(default_factory=list)
    cleanup: Callable[[], None] | None = None  # run after the checks (e.g. unmount a tmpfs)
    names: tuple[str, ...] | None = None       # overrides Fault.names for this run


@dataclass(frozen=True)
class Fault:
    name: str
    where: str
    kind: str  # "disk" | "save" | "gc" | "reuse" | "coop" | "tier"
    # "gc": what gc must raise; () for "must not raise" ("reuse": always); "tier": what the restore
    # must report on its way to the documented fallback (() for "must not raise")
    expect: tuple[type[E.CheckpointError], ...]
    action: Callable[..., Any]
    names: tuple[str, ...] = ()  # the error's message must contain one of these (when given)


# ------------------------------------------------------------------------- shard objects


def _missing(s: Scene) -> str:
    p = s.shard_path(2)
    p.unlink()
    return f"deleted {s.rel(p)}"


def _truncated(s: Scene) -> str:
    p = s.shard_path(2)
    n = p.stat().st_size
    os.truncate(p, n // 2)
    return f"{s.rel(p)} cut from {n} to {n // 2} bytes"


def _stale(s: Scene) -> str:
    old, new = s.shard_path(1), s.shard_path(2)
    shutil.copyfile(old, new)
    return f"{s.rel(new)} <- step 1's {s.rel(old)}"


def _grown(s: Scene) -> str:
    p = s.shard_path(2)
    n = p.stat().st_size
    os.truncate(p, n + s.grown_bytes)  # sparse: costs no disk, but a reader that reads to the end pays
    return f"{s.rel(p)} grown from {n} to {n + s.grown_bytes} bytes (sparse)"


def _fifo(s: Scene) -> str:
    p = s.shard_path(2)
    p.unlink()
    os.mkfifo(p)  # opening it for reading would wait for a writer forever
    return f"{s.rel(p)} replaced by a FIFO"


def _dup_entry(s: Scene) -> str:
    def edit(doc: dict[str, Any]) -> None:
        t = doc["tensors"][TARGET_TENSOR]
        sh, ch = t["shards"], t["chunks"]
        nchunks = len(ch["offset"]) // len(sh["key"])  # every shard of this tensor holds as many chunks
        for col in sh:
            sh[col].append(sh[col][0])
        for col in ch:
            ch[col].extend(ch[col][:nchunks])

    s.edit_manifest(2, edit)
    return f"manifest: second entry for {TARGET_TENSOR} shard 0 (same box, same object)"


def _chunk_overlap(s: Scene) -> str:
    def edit(doc: dict[str, Any]) -> None:
        ch = doc["tensors"][TARGET_TENSOR]["chunks"]
        ch["offset"][1], ch["crc32c"][1] = ch["offset"][0], ch["crc32c"][0]

    s.edit_manifest(2, edit)
    return f"manifest: {TARGET_TENSOR} chunk row 1 given row 0's offset and crc32c (every crc32c still matches)"


def _entries_swapped(s: Scene) -> str:
    from ckptfmt.checksum import crc32c

    lay, p = s.shard_layout(2), s.shard_path(2)
    raw = bytearray(p.read_bytes())
    a = lay["index_start"]
    raw[a:a + 16], raw[a + 16:a + 32] = raw[a + 16:a + 32], raw[a:a + 16]
    t = lay["index_trailer_start"]  # the index's crc32c trailer (ckptfmt.shard knows where)
    crc = crc32c(bytes(raw[a:t]))
    raw[t:t + 4] = crc.to_bytes(4, "little")
    p.write_bytes(bytes(raw))
    s.edit_manifest(2, lambda doc: doc["tensors"][TARGET_TENSOR]["shards"]["index_crc32c"].__setitem__(TARGET_SHARD, crc))
    return f"{s.rel(p)} index entries 0 and 1 swapped, index crc32c recomputed in the object and the manifest"


def _dup_object(s: Scene) -> str:
    src, dst = s.shard_path(2, shard=0), s.shard_path(2, shard=TARGET_SHARD)
    a, b = s.shard_layout(2, shard=0), s.shard_layout(2, shard=TARGET_SHARD)
    if a["start"] == 0 and b["start"] == 0 and src != dst:  # an object per shard (FORMAT.md 6.2)
        shutil.copyfile(src, dst)
        return f"{s.rel(dst)} <- copy of {s.rel(src)} (box already covered)"
    # Packed (FORMAT.md 5.15): shard 0's bytes over the target's range, in its pack, as long as it
    # is (an equally long shard of another box: every crc32c of its own still matches).
    n = min(a["nbytes"], b["nbytes"])
    data = src.read_bytes()[a["start"]:a["start"] + n]
    raw = bytearray(dst.read_bytes())
    raw[b["start"]:b["start"] + n] = data
    dst.write_bytes(bytes(raw))
    return f"{s.rel(dst)} bytes [{b['start']}, +{n}) <- shard 0's from {s.rel(src)} (box already covered)"


def _flip_data(nbytes: int) -> Callable[[Scene], str]:
    def inject(s: Scene) -> str:
        lay, p = s.shard_layout(2), s.shard_path(2)
        at = flip(p, lay["chunk0_offset"] + 100, nbytes, single_bit=nbytes == 0)
        return f"{s.rel(p)} chunk data, {at}"
    return inject


def _flip_index(nbytes: int) -> Callable[[Scene], str]:
    def inject(s: Scene) -> str:
        lay, p = s.shard_layout(2), s.shard_path(2)
        at = flip(p, lay["index_start"] + (3 if nbytes == 0 else 0), nbytes, single_bit=nbytes == 0)
        return f"{s.rel(p)} shard index, {at}"
    return inject


def _flip_state(nbytes: int) -> Callable[[Scene], str]:
    def inject(s: Scene) -> str:
        p = s.state_path(2)
        size = p.stat().st_size
        n = min(nbytes, size)
        at = flip(p, size // 2 if nbytes == 0 else 0, n, single_bit=nbytes == 0)
        return f"{s.rel(p)} ({size} B), {at}"
    return inject


# ------------------------------------------------------------------------------ manifest


def _manifest_missing(s: Scene) -> str:
    p = s.manifest_path(2)
    p.unlink()
    return f"deleted {s.rel(p)}"


def _manifest_truncated(s: Scene) -> str:
    p = s.manifest_path(2)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return f"{s.rel(p)} cut from {len(data)} to {len(data) // 2} bytes"


def _manifest_not_json(s: Scene) -> str:
    p = s.manifest_path(2)
    p.write_text("format: ckptfmt\nformat_version: 1\nstep: 2\ntensors: {}\n")
    return f"{s.rel(p)} replaced by YAML"


def _manifest_future(s: Scene) -> str:
    s.edit_manifest(2, lambda d: d.update(format_version=2))
    return "manifest format_version 1 -> 2"


def _manifest_over_cap(s: Scene) -> str:
    from ckptfmt.manifest import MAX_MANIFEST_BYTES

    cap = s.max_manifest_bytes or MAX_MANIFEST_BYTES
    p = s.manifest_path(2)
    with open(p, "r+b") as f:  # sparse: the real manifest, then zeros up to the cap + 1
        f.truncate(cap + 1)
    return f"{s.rel(p)} grown to {cap + 1} bytes (cap + 1, sparse)"


def _metadata_too_deep(s: Scene) -> str:
    deep: list[Any] = []
    for _ in range(100):
        deep = [deep]
    s.edit_manifest(2, lambda d: d["metadata"].update(deep=deep))
    return "manifest metadata nested to level 103 (the manifest's top-level object is level 1; the cap is 64)"


def _manifest_value_flood(s: Scene) -> str:
    from ckptfmt.manifest import MAX_MANIFEST_BYTES, MAX_STRUCTURAL_BYTES

    cap = s.max_manifest_bytes or MAX_MANIFEST_BYTES
    n = MAX_STRUCTURAL_BYTES * min(cap, MAX_MANIFEST_BYTES) // MAX_MANIFEST_BYTES  # empty arrays: one value each
    doc = s.manifest_doc(2)
    doc["metadata"]["flood"] = "@"
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    s.manifest_path(2).write_bytes(text.replace(b'"@"', b"[" + b"[]," * n + b"[]]") + b"\n")
    return f"manifest metadata holds {n + 1:,} empty arrays ({3 * n + 3:,} bytes, within the size cap; cost ~75 B each decoded)"


def _key_dotdot(s: Scene) -> str:
    outside = s.root.parent / "outside"
    array = s.root / s.manifest_doc(2)["tensors"][TARGET_TENSOR]["array"]["path"]
    if array.is_dir():  # an unpacked save; a packed one keeps its shards in packs (FORMAT.md 5.15)
        shutil.copytree(array, outside)

    def edit(doc: dict[str, Any]) -> None:
        t = doc["tensors"][TARGET_TENSOR]
        t["array"]["path"] = f"saves/{doc['save_id']}/t/../../../../outside"
    s.edit_manifest(2, edit)
    return f"{TARGET_TENSOR} array.path -> saves/<id>/t/../../../../outside (a valid copy lies there)"


def _key_absolute(s: Scene) -> str:
    target = s.state_path(2)
    s.edit_manifest(2, lambda d: d["state"]["global"].update(key=str(target)))
    return f"state global key -> absolute path /.../{s.rel(target)} (the real file)"


def _key_scheme(s: Scene) -> str:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][TARGET_TENSOR]["array"]["path"] = f"file://{s.root}/saves/{doc['save_id']}/t/000002"
    s.edit_manifest(2, edit)
    return f"{TARGET_TENSOR} array.path -> file://<repo>/saves/<id>/t/000002"


# ------------------------------------------------------------------------- msgpack state


def _msgpack_ext(code: int, payload: bytes) -> bytes:
    if len(payload) < 256:
        return b"\xc7" + bytes([len(payload), code]) + payload
    return b"\xc8" + len(payload).to_bytes(2, "big") + bytes([code]) + payload


def _state_hostile(s: Scene) -> str:
    # An unknown extension type whose payload is a pickle that would create a marker file if
    # anything ever unpickled it, then 100 000 nested one-element arrays.
    import pickle

    marker = s.root.parent / "PWNED"

    class _Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    data = (b"\x82" + b"\xa4evil" + _msgpack_ext(99, pickle.dumps(_Evil()))
            + b"\xa4deep" + b"\x91" * 100_000 + b"\xc0")
    where = s.replace_state(2, data)
    return f"{where}: ext type 99 holding a pickle + 100k-deep nesting (manifest size/crc updated)"


def _state_timestamp(s: Scene) -> str:
    # ext -1, the msgpack timestamp: plain msgpack decodes it into a Timestamp on its own.
    data = b"\x82\xa4step\x02\xa4when" + b"\xd6\xff" + (1767225600).to_bytes(4, "big")
    where = s.replace_state(2, data)
    return f"{where}: a msgpack timestamp (ext type -1) in the state (manifest size/crc updated)"


def _state_duplicate_key(s: Scene) -> str:
    # {"step": 2, "step": 7}: plain msgpack keeps the last value.
    where = s.replace_state(2, b"\x82\xa4step\x02\xa4step\x07")
    return f"{where}: a map holding the key 'step' twice (manifest size/crc updated)"


def _state_element_flood(s: Scene) -> str:
    from ckptfmt.state import MAX_ELEMENTS

    n = MAX_ELEMENTS  # with the array itself, one element over the cap; 1 byte each, ~64 bytes decoded
    where = s.replace_state(2, b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
    return f"{where}: an array of {n:,} empty arrays ({n + 5:,} bytes, within the state cap; manifest size/crc updated)"


def _state_oversized(s: Scene) -> str:
    from ckptfmt.state import decode_state

    cap = decode_state.__kwdefaults__["max_bytes"]
    n = cap + 1024
    body = n - 5
    where = s.replace_state(2, b"\xc6" + body.to_bytes(4, "big"), sparse_size=n)
    return f"{where}: valid msgpack bin32 of {n} bytes (state cap {cap}; manifest size/crc updated)"


# ------------------------------------------------------------------------ save faults


def _run_writers(s: Scene, ctx: Any, *, kill: str | None, kill_rank: int, world: int = 2) -> SaveAttempt:
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    run = wait_writers(start_writers(s.url, [3], world, s.seed, kill=kill, kill_rank=kill_rank,
                                     timeout_s=ctx.save_timeout_s, weaken=ctx.writer_weaken),
                       ctx.save_timeout_s * 2 + 10)
    return SaveAttempt(run.results, "", hung=run.hung, returncodes=run.returncodes,
                       notes=[e.strip().splitlines()[-1] for e in run.stderr if e.strip() and "Traceback" in e])


def _writer_killed(s: Scene, ctx: Any) -> SaveAttempt:
    a = _run_writers(s, ctx, kill="during_write", kill_rank=1)
    a.where = f"rank 1 of 2 SIGKILLed materializing its 2nd block (exit {a.returncodes[1] if len(a.returncodes) > 1 else '?'})"
    return a


def _writer_killed_after_ack(s: Scene, ctx: Any) -> SaveAttempt:
    a = _run_writers(s, ctx, kill="before_commit", kill_rank=1)
    a.where = ("rank 1 of 2 SIGKILLed right after the ack all-gather (all shards written), while rank 0 "
               f"commits (exit {a.returncodes[1] if len(a.returncodes) > 1 else '?'})")
    return a


def _coordinator_killed(s: Scene, ctx: Any) -> SaveAttempt:
    a = _run_writers(s, ctx, kill="before_commit", kill_rank=0)
    a.where = ("rank 0 (hosts the TcpCoordinator, commits) SIGKILLed after all acks, before the commit "
               f"(exit {a.returncodes[0] if a.returncodes else '?'})")
    return a


def _concurrent(s: Scene, ctx: Any) -> SaveAttempt:
    """Two independent jobs save step 3 at once (different data); exactly one may win."""
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    go = s.root.parent / "GO"
    # Both jobs meet inside save() (while materializing their first block), so both are past
    # the start-of-save check before either can commit: the conditional create decides.
    meet = str(s.root.parent / "rendezvous")
    runs = [start_writers(s.url, [3], 1, seed, go_file=str(go), timeout_s=ctx.save_timeout_s,
                          weaken=ctx.writer_weaken, rendezvous=meet)
            for seed in (s.seed + 1, s.seed + 2)]
    import time

    time.sleep(0.5)  # both imported and waiting on the go file
    go.write_text("go")
    results, hung, codes = [], False, []
    for seed, r in zip((s.seed + 1, s.seed + 2), runs):
        wait_writers(r, ctx.save_timeout_s + 10)
        for res in r.results:
            res["seed"] = seed
        results += r.results
        hung |= r.hung
        codes += r.returncodes
    winners = [r["seed"] for r in results if r.get("ok")]
    a = SaveAttempt([r for r in results if not r.get("ok")],
                    "two single-writer jobs save step 3, both past the start of save() before either commits",
                    hung=hung, returncodes=codes, winner_seed=winners[0] if len(winners) == 1 else None)
    if len(winners) != 1:
        a.notes.append(f"{len(winners)} saves reported success; exactly one must")
        if len(winners) == 0:
            a.winner_seed = None
        a.results.append({"ok": False, "error": "BothCommitted" if winners else "NoneCommitted",
                          "message": f"{len(winners)} of 2 saves succeeded", "untyped": True})
    return a


def _frozen_at_commit(s: Scene, ctx: Any) -> SaveAttempt:
    """The leader SIGSTOPped at its commit while gc (grace 1 s) judges the lease stale (FORMAT.md 8.3)."""
    from ckptfmt_tools.faults._fence import frozen_commit

    run = frozen_commit(s.url, 3, s.seed, freeze="before_fence", gc_grace_s=1.0, weaken=ctx.writer_weaken,
                        timeout_s=ctx.save_timeout_s)
    removed = run.report.removed_saves if run.report is not None else []
    a = SaveAttempt(run.results, "single-writer save of step 3, leader SIGSTOPped right before its commit; "
                    f"gc(grace_s=1) ran meanwhile and removed {len(removed)} save(s); then SIGCONT",
                    hung=run.hung or not run.froze, returncodes=run.returncodes,
                    notes=[e.strip().splitlines()[-1] for e in run.stderr if e.strip() and "Traceback" in e])
    if not run.froze:
        a.notes.append("the writer never reached its commit")
    return a


def _enospc(s: Scene, ctx: Any) -> SaveAttempt:
    from ckptfmt_tools.faults._enospc import enospc_save

    return enospc_save(s, ctx)


# --------------------------------------------------------------------------- catalogue

_SHARD = f"{TARGET_TENSOR} shard {TARGET_SHARD} (rank 1)"

CATALOGUE: list[Fault] = [
    Fault("shard-missing", _SHARD, "disk", (E.MissingShardError,), _missing),
    Fault("shard-truncated", _SHARD, "disk", (E.SizeMismatchError,), _truncated),
    Fault("shard-stale", _SHARD, "disk", (_STALE,), _stale),
    Fault("shard-grown", _SHARD, "disk", (E.SizeMismatchError,), _grown),
    Fault("shard-fifo", _SHARD, "disk", (E.StorageError,), _fifo),
    Fault("shard-duplicate-entry", f"manifest, {TARGET_TENSOR}", "disk", (E.DuplicateShardError,), _dup_entry),
    Fault("shard-duplicate-object", _SHARD, "disk", (E.ChecksumMismatchError,), _dup_object),
    Fault("manifest-chunk-overlap", f"manifest, {TARGET_TENSOR}", "disk", (E.InvalidManifestError,), _chunk_overlap),
    Fault("index-entries-swapped", _SHARD + " index", "disk", (E.ChecksumMismatchError,), _entries_swapped),
    Fault("data-bitflip", _SHARD + " data", "disk", (E.ChecksumMismatchError,), _flip_data(0)),
    Fault("data-64-bytes", _SHARD + " data", "disk", (E.ChecksumMismatchError,), _flip_data(64)),
    Fault("index-bitflip", _SHARD + " index", "disk", (E.ChecksumMismatchError,), _flip_index(0)),
    Fault("index-64-bytes", _SHARD + " index", "disk", (E.ChecksumMismatchError,), _flip_index(64)),
    Fault("state-bitflip", "global msgpack state", "disk", (E.ChecksumMismatchError,), _flip_state(0)),
    Fault("state-64-bytes", "global msgpack state", "disk", (E.ChecksumMismatchError,), _flip_state(64)),
    Fault("manifest-missing", "manifests/<step 2>.json", "disk", (E.StepNotFoundError,), _manifest_missing),
    Fault("manifest-truncated", "manifests/<step 2>.json", "disk", (E.InvalidManifestError,), _manifest_truncated),
    Fault("manifest-not-json", "manifests/<step 2>.json", "disk", (E.InvalidManifestError,), _manifest_not_json),
    Fault("manifest-future-version", "manifests/<step 2>.json", "disk", (E.UnsupportedVersionError,),
          _manifest_future),
    Fault("manifest-over-cap", "manifests/<step 2>.json", "disk", (E.ManifestTooLargeError,), _manifest_over_cap),
    Fault("manifest-value-flood", "manifests/<step 2>.json", "disk", (E.ManifestTooLargeError,), _manifest_value_flood),
    Fault("manifest-too-deep", "manifest metadata", "disk", (E.InvalidManifestError,), _metadata_too_deep),
    Fault("manifest-key-dotdot", "manifest array.path", "disk", (E.InvalidManifestError,), _key_dotdot),
    Fault("manifest-key-absolute", "manifest state key", "disk", (E.InvalidManifestError,), _key_absolute),
    Fault("manifest-key-scheme", "manifest array.path", "disk", (E.InvalidManifestError,), _key_scheme),
    Fault("state-hostile", "global msgpack state", "disk", (E.InvalidStateError,), _state_hostile),
    Fault("state-oversized", "global msgpack state", "disk", (E.InvalidStateError,), _state_oversized),
    Fault("state-element-flood", "global msgpack state", "disk", (E.InvalidStateError,), _state_element_flood),
    Fault("state-timestamp", "global msgpack state", "disk", (E.InvalidStateError,), _state_timestamp),
    Fault("state-duplicate-key", "global msgpack state", "disk", (E.InvalidStateError,), _state_duplicate_key),
    Fault("writer-sigkill", "save of step 3, rank 1", "save",
          (E.IncompleteSaveError, E.CoordinatorLostError, E.CoordinatorTimeoutError), _writer_killed),
    Fault("writer-sigkill-after-ack", "save of step 3, rank 1", "save",
          (E.IncompleteSaveError, E.CoordinatorLostError, E.CoordinatorTimeoutError), _writer_killed_after_ack),
    Fault("coordinator-sigkill", "save of step 3, rank 0", "save",
          (E.CoordinatorLostError, E.CoordinatorTimeoutError), _coordinator_killed),
    Fault("disk-full", "save of step 3, storage", "save", (E.StorageError, E.IncompleteSaveError), _enospc,
          names=("disk full", "No space left", "ENOSPC", "File too large", "EFBIG")),
    Fault("concurrent-same-step", "two saves of step 3", "save", (E.StepAlreadyCommittedError,), _concurrent),
    Fault("writer-frozen-at-commit", "save of step 3, rank 0", "save", (E.IncompleteSaveError,), _frozen_at_commit,
          names=("collected by gc",)),
    Fault("gc-symlink-escape", "saves/evil -> outside", "gc", (), G.symlink_escape),
    Fault("gc-not-a-repository", "a home folder", "gc", (E.NotARepositoryError,), G.not_a_repository),
    Fault("gc-retention-newest-truncated", "manifests/<step 3>.json", "gc", (), G.retention_newest_truncated),
    Fault("gc-retention-newest-data-missing", "step 3's objects", "gc", (), G.retention_newest_data_missing),
    Fault("gc-stray-objects", "saves/, manifests/", "gc", (), G.stray_objects),
    Fault("gc-shared-save-id", "manifests/<step 9>.json", "gc", (), G.shared_save_id),
    Fault("gc-oversized-manifest", "manifests/<step 1>.json", "gc", (), G.oversized_manifest),
    # issue 24
    Fault("gc-retention-newest-flipped", _SHARD + " (step 2) chunk data", "gc", (), R.retention_newest_flipped),
    Fault("gc-delete-racing-a-save", "delete of step 2, save of step 3", "gc", (), R.delete_racing_a_save),
    Fault("aliased-array-mutated", "steps 3-5 from one aliased array", "reuse", (), aliased_mutated),
    # issue 47: restores across processes (the receiver verifies, FORMAT.md 8.5, 9.1)
    Fault("coop-transit-flip", "cooperative restore, rank 1 -> rank 0", "coop", (E.ChecksumMismatchError,),
          C.transit_flip),
    Fault("coop-sender-other-step", "cooperative restore, rank 1's chunks", "coop",
          (E.ChecksumMismatchError, E.StepMismatchError), C.sender_other_step),
    Fault("coop-peer-lost", "cooperative restore, rank 1", "coop", (E.CoordinatorLostError,), C.peer_lost),
    Fault("tier-peer-other-step", "local tier, host 0's replica answer", "tier", (E.StepMismatchError,),
          T.peer_other_step),
    Fault("tier-peer-flipped-chunk", "local tier, host 0's replica answer", "tier", (E.ChecksumMismatchError,),
          T.peer_flipped_chunk),
    Fault("tier-elastic-peer-flipped-chunk", "elastic restore, rank 0's answer", "tier", (E.ChecksumMismatchError,),
          T.elastic_peer_flipped_chunk),
    Fault("tier-elastic-peer-other-step", "elastic restore, rank 0's answer", "tier", (E.StepMismatchError,),
          T.elastic_peer_other_step),
    Fault("tier-mapped-rewrite", "local tier file, after a restore", "tier", (), T.mapped_rewrite),
]


def by_name(name: str) -> Fault:
    for f in CATALOGUE:
        if f.name == name:
            return f
    raise KeyError(f"no fault named {name!r}; known: {', '.join(f.name for f in CATALOGUE)}")
