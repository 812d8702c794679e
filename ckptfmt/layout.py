"""The repository layout: every key, the save-id grammar and the zarr metadata (FORMAT.md 4, 6.1).

This module is the one owner of these facts; every other module asks it instead of rebuilding a
key string or an offset. Pure: no I/O, no imports from the rest of ckptfmt.

Keys (FORMAT.md 4.2)::

    ckptfmt.json                                    marker_key (MARKER_KEY)
    manifests/<step:020d>.json                      manifest_key(step) / step_of_manifest_key(key)
    saves/<save_id>/                                save_prefix(save_id)
    saves/<save_id>/LEASE                           lease_key(save_id)
    saves/<save_id>/t/<i:06d>                       array_path(save_id, i)
    saves/<save_id>/t/<i:06d>/c/<g0>/<g1>/...       shard_key(array_path, cell)
    saves/<save_id>/p/<r:05d>-<n:06d>               pack_key(save_id, rank, n)
    saves/<save_id>/state/global.msgpack            state_key(save_id, None)
    saves/<save_id>/state/rank-<r:05d>.msgpack      state_key(save_id, r)

The bytes inside a shard object (FORMAT.md 6.3, 6.4) are :mod:`ckptfmt.shard`'s: their sizes and
positions are computed there and nowhere else.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
    "MARKER_KEY", "MARKER_BYTES", "MANIFESTS", "SAVES", "LEASE_NAME", "MAX_STEP", "MAX_NDIM",
    "MAX_DIM", "MAX_TENSOR_BYTES", "manifest_key",
    "step_of_manifest_key", "save_prefix", "arrays_prefix", "state_prefix", "lease_key", "array_path",
    "cell_key", "shard_key", "packs_prefix", "pack_key", "fill_value", "inner_codecs", "state_name", "state_key", "SAVE_ID_RE", "WRITER_SAVE_ID_RE", "WRITER_ID_TAIL",
    "WriterSaveId", "new_save_id", "parse_writer_save_id", "is_save_id", "writer_save_ids_in",
    "zarr_array_metadata", "Lease", "LEASE_STATES", "LEASE_MAX_BYTES", "lease_bytes", "parse_lease",
]

MAX_STEP = (1 << 63) - 1
#: Largest tensor rank (FORMAT.md 5.10): a zarr v3 sharded array's shard index has one dimension
#: more than the array, and tensorstore, which writes and reads the arrays, allows at most 32.
MAX_NDIM = 31
MAX_DIM = 1 << 62
MAX_TENSOR_BYTES = 1 << 62

# ----------------------------------------------------------------------------- keys
#: The repository marker (FORMAT.md 4.5): written once by the first save's leader.
MARKER_KEY = "ckptfmt.json"
MARKER_BYTES = b'{"format":"ckptfmt","format_version":1}\n'
MANIFESTS = "manifests/"  # the only prefix discovery lists (FORMAT.md 4.2)
SAVES = "saves/"
LEASE_NAME = "LEASE"

_MANIFEST_KEY_RE = re.compile(r"manifests/([0-9]{20})\.json")


def manifest_key(step: int) -> str:
    """The key of the committed manifest of ``step``."""
    return f"{MANIFESTS}{step:020d}.json"


def step_of_manifest_key(key: str) -> int | None:
    """The step a key under ``manifests/`` names, or None when it names none (FORMAT.md 4.2):
    not exactly 20 digits, or a value above 2^63 - 1."""
    m = _MANIFEST_KEY_RE.fullmatch(key)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def save_prefix(save_id: str) -> str:
    """``saves/<save_id>/``: everything one save writes lies below it."""
    return f"{SAVES}{save_id}/"


def arrays_prefix(save_id: str) -> str:
    """``saves/<save_id>/t/``: every tensor array of a save lies below it (FORMAT.md 5.9)."""
    return f"{SAVES}{save_id}/t/"


def state_prefix(save_id: str) -> str:
    """``saves/<save_id>/state/``: every state object of a save lies below it."""
    return f"{SAVES}{save_id}/state/"


def lease_key(save_id: str) -> str:
    return f"{SAVES}{save_id}/{LEASE_NAME}"


def array_path(save_id: str, index: int) -> str:
    """The zarr array of tensor number ``index`` (no trailing "/")."""
    return f"{arrays_prefix(save_id)}{index:06d}"


def cell_key(cell: Sequence[int]) -> str:
    """The zarr v3 "default" chunk key of a grid cell, relative to the array path."""
    return "c" if not len(cell) else "c/" + "/".join(str(c) for c in cell)


def shard_key(path: str, cell_or_key: Sequence[int] | str) -> str:
    """The object key of one shard: the array path, then its cell key (a cell, or its key)."""
    return f"{path}/{cell_or_key if isinstance(cell_or_key, str) else cell_key(cell_or_key)}"


def packs_prefix(save_id: str) -> str:
    """The prefix of a save's pack objects (FORMAT.md 4.2, 5.15)."""
    return f"saves/{save_id}/p/"


def pack_key(save_id: str, rank: int, n: int) -> str:
    """Pack object ``n`` of writer ``rank`` (FORMAT.md 4.2, revision 1.3)."""
    return f"{packs_prefix(save_id)}{rank:05d}-{n:06d}"


def state_name(rank: int | None) -> str:
    """The manifest's name of a state entry: "global", or "rank/<r>"."""
    return "global" if rank is None else f"rank/{rank}"


def state_key(save_id: str, rank: int | None) -> str:
    """The object of the global state (``rank`` None) or of one rank's state."""
    name = "global.msgpack" if rank is None else f"rank-{rank:05d}.msgpack"
    return f"{state_prefix(save_id)}{name}"


# ----------------------------------------------------------------------------- save ids (FORMAT.md 4.3)
#: What a reader accepts as a save id.
SAVE_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,127}$")
#: The writer's form: the only names gc may collect unless a manifest named them.
WRITER_SAVE_ID_RE = re.compile(r"([0-9]{12,19})-([0-9]{8}T[0-9]{6})-([0-9a-f]{8})")
#: The tail every writer-form id ends with; it starts with a literal, so scanners find it fast.
WRITER_ID_TAIL = re.compile(rb"T[0-9]{6}-[0-9a-f]{8}")


@dataclass(frozen=True)
class WriterSaveId:
    """The parts of a writer-form save id."""

    step: int
    utc: str    # YYYYMMDDTHHMMSS
    token: str  # 8 lowercase hex digits


def new_save_id(step: int, *, now_unix: float | None = None, token: str | None = None) -> str:
    """A fresh save id in the writer's form: the step, the UTC time, 32 random bits."""
    utc = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_unix))
    return f"{step:012d}-{utc}-{token if token is not None else secrets.token_hex(4)}"


def parse_writer_save_id(name: str) -> WriterSaveId | None:
    """The parts of ``name`` when it is exactly in the writer's form, else None."""
    m = WRITER_SAVE_ID_RE.fullmatch(name)
    return None if m is None else WriterSaveId(int(m.group(1)), m.group(2), m.group(3))


def is_save_id(name: Any) -> bool:
    """Whether a reader accepts ``name`` as a save id: the whole string matches (``$`` alone would
    also let a trailing line feed through)."""
    return isinstance(name, str) and SAVE_ID_RE.fullmatch(name) is not None


def writer_save_ids_in(data: bytes, wanted: set[str]) -> set[str]:
    """The ids of ``wanted`` (all in the writer's form) that occur anywhere in ``data``, found by
    scanning for the id's fixed tail: linear in ``data`` whatever the number of ids."""
    found: set[str] = set()
    for m in WRITER_ID_TAIL.finditer(data):  # every writer-form id is "<digits>-YYYYMMDD" + this tail
        dash = m.start() - 9
        if dash < 12 or data[dash] != 0x2D or not data[dash + 1:m.start()].isdigit():
            continue
        first = dash
        while first > 0 and dash - first < 19 and 0x30 <= data[first - 1] <= 0x39:
            first -= 1
        for k in range(first, dash - 11):  # 12 to 19 step digits
            sid = data[k:m.end()].decode("ascii")
            if sid in wanted:
                found.add(sid)
    return found


# ----------------------------------------------------------------------------- zarr array metadata
_ONE_BYTE = ("bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2")


def fill_value(dtype: str) -> Any:
    """The zarr v3 fill value of a dtype's arrays (FORMAT.md 6.1): false, 0, or [0.0, 0.0]."""
    return False if dtype == "bool" else [0.0, 0.0] if dtype.startswith("complex") else 0


def inner_codecs(dtype: str, codec: str = "raw", level: int = 3) -> list[dict[str, Any]]:
    """The codecs of one inner chunk (FORMAT.md 6.1, 6.3): bytes, then for "zstd" the zstd frame at
    ``level``, then the crc32c (of the encoded bytes)."""
    bytes_codec = {"name": "bytes"} if dtype in _ONE_BYTE else {"name": "bytes", "configuration": {"endian": "little"}}
    zstd = [{"name": "zstd", "configuration": {"level": int(level), "checksum": False}}] if codec == "zstd" else []
    return [bytes_codec, *zstd, {"name": "crc32c"}]


def zarr_array_metadata(shape: Sequence[int], dtype: str, shard_shape: Sequence[int],
                        chunk_shape: Sequence[int], codec: str = "raw", level: int = 3) -> dict[str, Any]:
    """The zarr v3 metadata of one tensor's array (FORMAT.md 6.1): sharding_indexed, crc32c, and
    the inner codec: "raw" (bytes only) or "zstd" (bytes, zstd at ``level``, then the crc32c of
    the encoded bytes, revision 1.1)."""
    return {
        "shape": list(shape), "data_type": dtype,
        "fill_value": fill_value(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunk_shape),
            "codecs": inner_codecs(dtype, codec, level),
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}],
    }


# ----------------------------------------------------------------------------- leases (FORMAT.md 10.1)
LEASE_STATES = ("writing", "committing", "collected")
LEASE_MAX_BYTES = 64 << 10  # a lease is ~100 bytes; a larger one is not parsed


@dataclass(frozen=True)
class Lease:
    """What a lease says. ``heartbeat_unix`` is 0.0 when unreadable (such a lease is stale).
    ``refs``: the earlier save ids whose objects the save may reference (FORMAT.md 10.1, 10.5).
    A lease its leader did not write (unreadable) pins nothing: that leader's fence fails."""

    heartbeat_unix: float
    state: str            # one of LEASE_STATES
    step: int | None
    refs: frozenset[str] = frozenset()


def lease_bytes(body: Mapping[str, Any], *, now_unix: float | None = None) -> bytes:
    """The JSON of a lease: ``body`` (``save_id``, ``step``, ``world``, ``state``, and ``refs``
    when the save may reference earlier saves) with a fresh ``heartbeat_unix``."""
    return json.dumps(dict(body, heartbeat_unix=time.time() if now_unix is None else now_unix), sort_keys=True).encode()


def parse_lease(value: bytes) -> Lease:
    """A lease's content; anything unreadable reads as a stale "writing" lease of no known step."""
    try:
        doc = json.loads(value) if len(value) <= LEASE_MAX_BYTES else None
        beat = float(doc["heartbeat_unix"])
        state = doc.get("state", "writing")
        step = doc.get("step")
        refs_doc = doc.get("refs", [])
    except (ValueError, KeyError, TypeError, AttributeError):
        return Lease(0.0, "writing", None)
    if state not in LEASE_STATES:
        state = "writing"
    step = step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP else None
    refs = frozenset(r for r in refs_doc if is_save_id(r)) if isinstance(refs_doc, list) else frozenset()
    return Lease(beat if beat == beat else 0.0, state, step, refs)

