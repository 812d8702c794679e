"""Verification records: a step read and checked byte for byte, recorded so that retention pays
for it once per step (FORMAT.md 10.4).

Retention deletes a step only while a newer kept step has been verified byte for byte
(:func:`unverified`). A verification reads every object the step's manifest names (references
to earlier saves included) and checks every crc32c, as a restore does. When it passes, the
record ``saves/<save_id>/VERIFIED`` binds what was verified: the manifest's SHA-256 and a SHA-256
of every object's stamp (size and storage generation, :meth:`Storage.stamps`), taken before the
read. A later check trusts the record only when all of it matches again; anything else (no
stamps on this store, a missing, oversized, malformed or foreign record, a different manifest,
any object written or replaced since) means: verify again. A record proves that the bytes were
checked at its time and have not been written since through the store; not that the medium has
not decayed under an unchanged stamp. So retention reads the licensing step again, ignoring its
record, before a deletion that would leave no step older than it (``fresh=True``; FORMAT.md 10.4).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from typing import TYPE_CHECKING, Any

from ckptfmt.errors import CheckpointError
from ckptfmt.layout import save_prefix
from ckptfmt.manifest import Manifest
from ckptfmt.reader import Checkpoint

if TYPE_CHECKING:  # the package's face imports this module
    from ckptfmt.repository import Repository

__all__ = ["RECORD_NAME", "RECORD_FORMAT", "record_key", "record_bytes", "stamp_lines", "unverified", "forget"]

RECORD_NAME = "VERIFIED"
RECORD_FORMAT = "ckptfmt.verified"
RECORD_MAX_BYTES = 4096
_FIELDS = {"format", "step", "save_id", "manifest_sha256", "stamps_sha256", "verified_unix", "bytes"}
_CLOCK_SLACK_S = 300.0  # a record dated further ahead than this is not trusted


def record_key(save_id: str) -> str:
    return f"{save_prefix(save_id)}{RECORD_NAME}"


def _objects(m: Manifest) -> list[tuple[str, int]]:
    """Every object the step reads, in the order of FORMAT.md 10.4: the shards of each tensor, key
    paths sorted by code point, each tensor's in row order (a referenced row under the earlier
    save's key), then the state objects, names sorted. Sorted, not in the manifest's member order,
    which a reader must not depend on (5.1); for a canonical manifest the two are the same."""
    out = [(t.object_key(i), t.object_nbytes(i)) for _, t in sorted(m.tensors.items())
           for i in range(len(t.shards))]
    return out + [(se.key, int(se.nbytes)) for _, se in sorted(m.state.items())]


def _stamps(st: Any, objects: list[tuple[str, int]]) -> list[str] | None:
    """The stamp of each of ``objects``, each distinct object asked once (a pack holds many rows)."""
    distinct = list(dict.fromkeys(objects))
    got = st.stamps(distinct)
    if got is None:
        return None
    by = dict(zip(distinct, got))
    return [by[o] for o in objects]


def stamp_lines(objects: list[tuple[str, int]], stamps: list[str]) -> bytes:
    """What ``stamps_sha256`` digests (FORMAT.md 10.4): one UTF-8 line ``<key>\\t<stamp>\\n`` per object."""
    return "".join(f"{k}\t{s}\n" for (k, _), s in zip(objects, stamps, strict=True)).encode("utf-8")


def _bindings(m: Manifest, data: bytes, stamps: list[str]) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "step": m.step, "save_id": m.save_id,
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
            "stamps_sha256": hashlib.sha256(stamp_lines(_objects(m), stamps)).hexdigest()}


def record_bytes(bindings: dict[str, Any], verified_unix: float, nbytes: int) -> bytes:
    """The record as stored: canonical JSON (FORMAT.md 5.1: members sorted, no whitespace, UTF-8,
    one line feed at the end). Records written before revision 1.2.7 used ", " and ": " and no
    line feed; a reader parses the JSON and never compares bytes, so they are trusted alike."""
    doc = dict(bindings, verified_unix=float(verified_unix), bytes=int(nbytes))
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode() + b"\n"


def _trusted(st: Any, want: dict[str, Any]) -> bool:
    """Whether the stored record says exactly ``want`` (and nothing else), with a sane time."""
    try:
        raw = st.read(record_key(want["save_id"]), max_bytes=RECORD_MAX_BYTES)
    except CheckpointError:
        return False
    if raw is None or len(raw) > RECORD_MAX_BYTES:
        return False
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(doc, dict) or set(doc) != _FIELDS or any(doc[k] != v for k, v in want.items()):
        return False
    when = doc["verified_unix"]
    return (isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when)
            and when <= time.time() + _CLOCK_SLACK_S)


def unverified(repo: Repository, step: int, *, fresh: bool = False, read: set[int] | None = None) -> str | None:
    """Why ``step`` is not verified byte for byte now, or None: its record matches (unless
    ``fresh``: then the record is not consulted), or it was read and checked in full just now (and
    the record written). A step read in full is added to ``read``. Never raises for bad content."""
    st = repo.storage
    try:
        m, data = repo.manifest_with_bytes(int(step))
        stamps = _stamps(st, _objects(m))  # before the read: a write after this changes them
    except CheckpointError as e:
        return f"{type(e).__name__}: {e.message}"
    want = _bindings(m, data, stamps) if stamps is not None else None
    if not fresh and want is not None and _trusted(st, want):
        return None
    if read is not None:
        read.add(int(step))
    window = st.options.read_window_bytes
    try:
        nbytes = Checkpoint(st, m, max_inflight_bytes=window, checks=repo.checks).verify(
            buffers=getattr(repo, "_read_buffers", None))
    except CheckpointError as e:
        forget(st, m.save_id)
        return f"{type(e).__name__}: {e.message}"
    if want is not None and st.plain_dir(save_prefix(m.save_id)):  # never written through a link
        try:
            st.write(record_key(m.save_id), record_bytes(want, time.time(), nbytes))
        except CheckpointError:
            pass  # verified all the same; the next decision verifies again
    return None


def forget(st: Any, save_id: str) -> None:
    """Remove a step's record (its step is deleted, or failed verification). Best effort: a
    record left behind binds a manifest digest that no committed step has."""
    try:
        if st.plain_dir(save_prefix(save_id)):
            st.delete(record_key(save_id))
    except CheckpointError:
        pass
