"""The manifest: frozen dataclasses <-> JSON, and every validation rule of format v1.

A manifest is self-contained: a reader needs nothing else to locate and verify every
byte of a checkpoint. Tables are columnar (numpy arrays) so 10^5..10^6 shards stay cheap.
"""
from __future__ import annotations

import functools
import gc
import json
import math
from itertools import chain
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from .dtypes import DTYPES, itemsize_of
from .errors import (CheckpointError, DuplicateShardError, InvalidManifestError, ManifestTooLargeError,
                     UnsupportedVersionError)
from ._manifest_caps import MAX_CHUNK_ROWS as MAX_CHUNK_ROWS
from ._manifest_caps import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from ._manifest_caps import MAX_NESTING as MAX_NESTING
from ._manifest_caps import MAX_SHARD_ROWS as MAX_SHARD_ROWS
from ._manifest_caps import MAX_STRUCTURAL_BYTES as MAX_STRUCTURAL_BYTES
from ._manifest_caps import MAX_TENSORS as MAX_TENSORS
from ._manifest_caps import CountCaps, check_nesting, count_structural
from ._manifest_fast import Fallback, check_encodable, count_literals, encode_tensors, tensors_fast
from .layout import MARKER_BYTES as MARKER_BYTES
from .layout import MARKER_KEY as MARKER_KEY
from .layout import MAX_STEP as MAX_STEP
from .layout import SAVE_ID_RE as SAVE_ID_RE
from .layout import manifest_key as manifest_key
from .layout import arrays_prefix, shard_key, state_key, state_name, state_prefix
from .layout import step_of_manifest_key as step_of_manifest_key
from .plan import TensorGeometry, chunk_count_table

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MAX_MANIFEST_BYTES", "MAX_NESTING", "check_nesting", "ArraySpec",
           "ShardTable", "ChunkTable", "TensorEntry", "StateEntry", "Manifest", "parse_manifest", "check_object_key",
           "manifest_key", "step_of_manifest_key", "MARKER_KEY", "MARKER_BYTES"]

FORMAT_NAME = "ckptfmt"
FORMAT_VERSION = 1
MAX_NDIM = 64
MAX_DIM = 1 << 62
MAX_TENSOR_BYTES = 1 << 62
MAX_KEY_LEN = 4096
MAX_OBJECT_KEY_LEN = 1024
KNOWN_EXTENSIONS: frozenset[str] = frozenset()
_U32 = 1 << 32


def check_object_key(k: Any, *, prefix: str = "", key: str | None = None) -> str:
    """Reject object keys that could escape the repository; return the key.

    Keys are relative, "/"-separated, with no empty, "." or ".." segment, no backslash,
    no URL scheme and no control character. With ``prefix`` the key must lie under it.
    """
    bad = None
    if not isinstance(k, str) or not k:
        bad = "not a non-empty string"
    elif len(k) > MAX_OBJECT_KEY_LEN:
        bad = "longer than 1024 characters"
    elif k.startswith("/") or "\\" in k or ":" in k:
        bad = "absolute, backslash or URL scheme"
    elif any(seg in ("", ".", "..") for seg in k.split("/")):
        bad = "empty, '.' or '..' segment"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in k):
        bad = "control character"
    elif prefix and not k.startswith(prefix):
        bad = f"outside {prefix!r}"
    if bad:
        raise InvalidManifestError(f"object key escapes the repository ({bad})", key=key, object=str(k)[:200],
                                   expected=f"a relative key under {prefix or 'the repository'}", found=str(k)[:200])
    return k


@dataclass(frozen=True)
class ArraySpec:
    path: str
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    codec: str = "raw"


@dataclass(frozen=True, eq=False)
class ShardTable:
    offset: np.ndarray        # (S, ndim) int64
    writer: np.ndarray        # (S,) int64
    key: tuple[str, ...]
    nbytes: np.ndarray        # (S,) int64
    index_crc32c: np.ndarray  # (S,) uint32

    def __len__(self) -> int:
        return len(self.key)


@dataclass(frozen=True, eq=False)
class ChunkTable:
    offset: np.ndarray  # (C,) int64, byte offset inside the shard object
    nbytes: np.ndarray  # (C,) int64, includes the 4-byte crc32c trailer
    crc32c: np.ndarray  # (C,) uint32, crc32c of the chunk's data bytes


@dataclass(frozen=True, eq=False)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    dtype: str
    sharding: dict[str, Any] | None
    array: ArraySpec
    shards: ShardTable
    chunks: ChunkTable

    @functools.cached_property
    def geometry(self) -> TensorGeometry:
        return TensorGeometry(self.shape, self.array.shard_shape, self.array.chunk_shape, itemsize_of(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize_of(self.dtype)

    @functools.cached_property
    def chunk_start(self) -> np.ndarray:
        """Where each shard's entries begin in the chunk table (length S + 1)."""
        counts = np.prod(chunk_count_table(self.geometry, self.shards.offset), axis=1, dtype=np.int64)
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)

    def object_key(self, s: int) -> str:
        return shard_key(self.array.path, self.shards.key[s])

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape), "dtype": self.dtype, "sharding": self.sharding,
            "array": {"path": self.array.path, "shard_shape": list(self.array.shard_shape),
                      "chunk_shape": list(self.array.chunk_shape), "codec": self.array.codec},
            "shards": {"offset": self.shards.offset.reshape(len(self.shards), len(self.shape)).tolist(),
                       "writer": self.shards.writer.tolist(), "key": list(self.shards.key),
                       "nbytes": self.shards.nbytes.tolist(), "index_crc32c": self.shards.index_crc32c.tolist()},
            "chunks": {"offset": self.chunks.offset.tolist(), "nbytes": self.chunks.nbytes.tolist(),
                       "crc32c": self.chunks.crc32c.tolist()},
        }


@dataclass(frozen=True)
class StateEntry:
    name: str
    key: str
    nbytes: int
    crc32c: int
    scope: str  # "global" or "rank"
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "nbytes": self.nbytes, "crc32c": self.crc32c, "scope": self.scope}
        if self.rank is not None:
            d["rank"] = self.rank
        return d


@dataclass(frozen=True, eq=False)
class Manifest:
    save_id: str
    step: int
    created_unix: float
    writers: int
    tensors: Mapping[str, TensorEntry]
    state: Mapping[str, StateEntry] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    must_understand: tuple[str, ...] = ()
    extensions: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored object (shards and state) the manifest references."""
        return int(sum(int(t.shards.nbytes.sum()) for t in self.tensors.values()) + sum(s.nbytes for s in self.state.values()))

    def _head(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version,
            "must_understand": list(self.must_understand), "extensions": dict(self.extensions),
            "save_id": self.save_id, "step": self.step, "created_unix": self.created_unix,
            "writers": self.writers, "versions": dict(self.versions), "metadata": dict(self.metadata),
            "state": {k: self.state[k].to_json() for k in sorted(self.state)},
        }

    def to_json(self) -> dict[str, Any]:
        return self._head() | {"tensors": {k: self.tensors[k].to_json() for k in sorted(self.tensors)}}

    def to_bytes(self) -> bytes:
        """Canonical encoding: UTF-8 JSON, sorted keys, compact separators, trailing newline.

        Byte for byte ``json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"),
        ensure_ascii=False, allow_nan=False) + "\n"``; the tensors member is encoded by
        :func:`encode_tensors`, which reuses the text of repeated columns."""
        with _no_gc():
            try:
                text = json.dumps(self._head() | {"tensors": {}}, sort_keys=True, separators=(",", ":"),
                                  ensure_ascii=False, allow_nan=False)
                # Only "versions" (strings) and "writers" (an int) sort after "tensors", so the last
                # '"tensors":{}' is the top-level member (metadata may hold one of its own).
                before, sep, after = text.rpartition('"tensors":{}')
                assert sep, "the tensors member is missing from the encoded head"
                return (before + '"tensors":' + encode_tensors(self.tensors) + after + "\n").encode()
            except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as e:  # NaN, a lone surrogate, a non-JSON value
                raise InvalidManifestError("manifest cannot be encoded as canonical JSON",
                                           found=f"{type(e).__name__}: {str(e)[:200]}") from None

    def validate(self) -> "Manifest":
        """Re-check every rule of format v1 on this manifest. Returns self; raises InvalidManifestError.

        (The commit itself parses the exact bytes it publishes with :func:`parse_manifest`.)"""
        with _no_gc():
            try:
                _from_doc(self.to_json())
            except CheckpointError:
                raise
            except (TypeError, ValueError, KeyError, OverflowError, AttributeError, IndexError, RecursionError) as e:
                raise InvalidManifestError("manifest is malformed", found=f"{type(e).__name__}: {str(e)[:200]}") from None
        return self


# ----------------------------------------------------------------------------- parsing


def _fail(msg: str, *, key: str | None = None, object: str | None = None, expected: Any = None, found: Any = None) -> None:
    raise InvalidManifestError(msg, key=key, object=object, expected=expected, found=found)


def _int(v: Any, lo: int, hi: int, what: str, key: str | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        _fail(f"{what} must be an integer in [{lo}, {hi}]", key=key, expected=f"int in [{lo}, {hi}]", found=repr(v)[:80])
    return v


def _typed(v: Any, t: type | tuple[type, ...], what: str, key: str | None = None) -> Any:
    if not isinstance(v, t) or isinstance(v, bool) and t is not bool:
        _fail(f"{what} has the wrong type", key=key, expected=getattr(t, "__name__", str(t)), found=type(v).__name__)
    return v


def _int_array(v: Any, n: int, lo: int, hi: int, what: str, key: str, width: int | None = None) -> np.ndarray:
    _typed(v, list, what, key)
    if len(v) != n:
        _fail(f"{what} has the wrong length", key=key, expected=n, found=len(v))
    if width is None:
        types = set(map(type, v))
    else:
        if set(map(type, v)) - {list}:
            _fail(f"{what} must hold lists", key=key, expected="list of lists")
        if set(map(len, v)) - {width}:
            _fail(f"{what} rows have the wrong length", key=key, expected=width)
        types = set(map(type, chain.from_iterable(v)))
    if types - {int}:  # exactly int: no bool, float or string sneaks through a numpy cast
        _fail(f"{what} must hold integers", key=key, expected="int", found=sorted(t.__name__ for t in types))
    try:
        a = np.array(v, dtype=np.int64) if n else np.zeros((0,) if width is None else (0, width), np.int64)
    except OverflowError:
        _fail(f"{what} out of range", key=key, expected=f"[{lo}, {hi}]", found="beyond int64")
    if width is not None:
        a = a.reshape(n, width)
    if a.size and (a.min() < lo or a.max() > hi):
        _fail(f"{what} out of range", key=key, expected=f"[{lo}, {hi}]", found=f"[{a.min()}, {a.max()}]")
    return a


def parse_manifest(data: bytes, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Parse and fully validate manifest bytes.

    Raises ManifestTooLargeError past ``max_bytes``, UnsupportedVersionError for an unknown
    version or a must_understand extension, DuplicateShardError for overlapping shards and
    InvalidManifestError for every other rule. Never raises anything else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        _fail("manifest must be bytes", found=type(data).__name__)
    if len(data) > max_bytes:
        raise ManifestTooLargeError("manifest exceeds the size cap", expected=f"<= {max_bytes} bytes", found=len(data))
    data = bytes(data)
    caps = CountCaps.for_size_cap(max_bytes)
    structural = count_structural(data)
    if structural > caps.structural:  # before json.loads builds anything
        raise ManifestTooLargeError("manifest holds too many JSON values", found=structural,
                                    expected=f"<= {caps.structural} structural bytes ({{ [ ,)")
    with _no_gc():
        return _parse(data, caps.after_counting(structural))


@contextmanager
def _no_gc() -> Iterator[None]:
    """Millions of small containers (no cycles): cyclic GC passes would dominate encode and parse."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _parse(data: bytes, caps: CountCaps) -> Manifest:
    floats = [0]

    def _float(text: str) -> float:
        floats[0] += 1
        value = float(text)
        if not math.isfinite(value):  # 1e400: JSON allows the literal, the canonical encoding cannot hold it
            raise InvalidManifestError("manifest holds a number out of float range", expected="a finite number",
                                       found=text[:40])
        return value

    data = bytes(data)
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates,
                         parse_float=_float)
    except InvalidManifestError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidManifestError("manifest is not valid UTF-8 JSON", expected="JSON object", found=str(e)[:200]) from None
    if b"\\" in data:  # only \u escapes can smuggle in a lone surrogate (strict UTF-8 decoding rejects raw ones)
        check_encodable(doc)
    # Every float literal is counted above; every boolean literal is a "true" or "false" in the text.
    try:
        return _from_doc(doc, literals=(floats[0], data.count(b"true") + data.count(b"false")), caps=caps)
    except (InvalidManifestError, UnsupportedVersionError):
        raise
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError, IndexError, RecursionError) as e:
        raise InvalidManifestError("manifest is malformed", found=f"{type(e).__name__}: {str(e)[:200]}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidManifestError("manifest repeats a JSON member", expected="unique members", found=dup[:200])
    return d


def _reject_constant(c: str) -> Any:
    raise InvalidManifestError("manifest holds a non-finite number", found=c)


_TOP = {"format", "format_version", "must_understand", "extensions", "save_id", "step", "created_unix",
        "writers", "versions", "metadata", "tensors", "state"}


def _members(d: dict[str, Any], allowed: set[str], what: str, key: str | None = None) -> None:
    """Format v1 is closed: unknown members are errors (new things go in "extensions")."""
    extra = set(d) - allowed
    if extra:
        _fail(f"unknown member(s) in {what}", key=key, expected=sorted(allowed), found=sorted(extra)[:10])


def _from_doc(doc: Any, literals: tuple[int, int] | None = None, caps: CountCaps = CountCaps()) -> Manifest:
    """Build and check a manifest from its parsed JSON. ``literals``: the document's float count
    and an upper bound of its boolean count, which lets the fast path skip type checks when
    neither occurs inside a tensor entry's tables."""
    _typed(doc, dict, "manifest")
    if doc.get("format") != FORMAT_NAME:
        _fail("not a ckptfmt manifest", expected=FORMAT_NAME, found=repr(doc.get("format"))[:80])
    version = doc.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise UnsupportedVersionError("unsupported format version", expected=FORMAT_VERSION, found=repr(version)[:80])
    mu = _typed(doc.get("must_understand", []), list, "must_understand")
    unknown = [m for m in mu if m not in KNOWN_EXTENSIONS]
    if unknown:
        raise UnsupportedVersionError("manifest requires extensions this reader does not understand",
                                      expected=sorted(KNOWN_EXTENSIONS), found=[str(u)[:80] for u in unknown])
    _members(doc, _TOP, "the manifest")  # after the version checks: a newer manifest is "unsupported"
    missing = sorted(_TOP - {"must_understand", "extensions"} - set(doc))
    if missing:
        _fail("manifest lacks required fields", expected=sorted(_TOP), found=f"missing {missing}")
    save_id = _typed(doc["save_id"], str, "save_id")
    if not SAVE_ID_RE.match(save_id):
        _fail("save_id has invalid characters", expected=SAVE_ID_RE.pattern, found=save_id[:80])
    step = _int(doc["step"], 0, MAX_STEP, "step")
    created = _typed(doc["created_unix"], (int, float), "created_unix")
    writers = _int(doc["writers"], 1, 1 << 31, "writers")
    versions = _typed(doc["versions"], dict, "versions")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        _fail("versions must map names to version strings")
    metadata = _typed(doc["metadata"], dict, "metadata")
    extensions = _typed(doc.get("extensions", {}), dict, "extensions")
    prefix = arrays_prefix(save_id)
    tensors_doc = _typed(doc["tensors"], dict, "tensors")
    if len(tensors_doc) > caps.tensors:
        raise ManifestTooLargeError("manifest holds too many tensors", expected=f"<= {caps.tensors}", found=len(tensors_doc))
    # The free-form members are the only ones that can nest deeply (the rest is at most 6 levels).
    check_nesting(metadata, 2, "metadata")
    check_nesting(extensions, 2, "extensions")
    for k, t in tensors_doc.items():
        if type(t) is dict and type(sd := t.get("sharding")) is dict:
            check_nesting(sd, 4, "sharding", key=k)
    if caps.count_rows:  # else the structural count already keeps every column below the row caps
        shard_rows = chunk_rows = 0
        for t in tensors_doc.values():
            sh, ch = (t.get("shards"), t.get("chunks")) if type(t) is dict else (None, None)
            if type(sh) is dict and type(sh.get("key")) is list:
                shard_rows += len(sh["key"])
            if type(ch) is dict and type(ch.get("offset")) is list:
                chunk_rows += len(ch["offset"])
        for what, rows, cap in (("shard", shard_rows, caps.shard_rows), ("chunk", chunk_rows, caps.chunk_rows)):
            if rows > cap:  # before any table is built
                raise ManifestTooLargeError(f"manifest holds too many {what} rows", expected=f"<= {cap}", found=rows)
    clean = False
    if literals is not None:
        f0, b0 = count_literals([v for m, v in doc.items() if m != "tensors"])
        f1, b1 = count_literals([t.get("sharding") for t in tensors_doc.values() if type(t) is dict])
        clean = literals == (f0 + f1, b0 + b1)
    try:
        tensors = tensors_fast(tensors_doc, prefix, writers, exact=_tensor, make=_make_entry, max_key_len=MAX_KEY_LEN,
                               max_object_key_len=MAX_OBJECT_KEY_LEN, no_float_or_bool=clean)
    except Fallback:  # something is off: the exact checks find it and name it
        tensors = _tensors_exact(tensors_doc, prefix, writers)
    state_doc = _typed(doc["state"], dict, "state")
    state: dict[str, StateEntry] = {}
    for name, s in state_doc.items():
        _typed(s, dict, "state entry", name)
        scope = s.get("scope")
        if scope not in ("global", "rank"):
            _fail("state scope must be 'global' or 'rank'", key=name, found=repr(scope)[:40])
        _members(s, {"key", "nbytes", "crc32c", "scope"} | ({"rank"} if scope == "rank" else set()), "a state entry", name)
        rank = _int(s.get("rank"), 0, writers - 1, "state rank", name) if scope == "rank" else None
        want_name, want_key = state_name(rank), state_key(save_id, rank)
        if name != want_name:
            _fail("state entry name does not match its scope", key=name, expected=want_name, found=name)
        skey = check_object_key(s.get("key"), prefix=state_prefix(save_id), key=name)
        if skey != want_key:
            _fail("state object key does not match its entry", key=name, object=skey, expected=want_key, found=skey)
        state[name] = StateEntry(name, skey, _int(s.get("nbytes"), 0, MAX_TENSOR_BYTES, "state nbytes", name),
                                 _int(s.get("crc32c"), 0, _U32 - 1, "state crc32c", name), scope, rank)
    return Manifest(save_id=save_id, step=step, created_unix=float(created), writers=writers, tensors=tensors,
                    state=state, versions=versions, metadata=metadata, format_version=version,
                    must_understand=tuple(mu), extensions=extensions)


def _tensors_exact(tensors_doc: dict[str, Any], prefix: str, writers: int) -> dict[str, TensorEntry]:
    """Every tensor entry checked one at a time; raises the first broken rule, in document order."""
    tensors: dict[str, TensorEntry] = {}
    paths: set[str] = set()
    for k, t in tensors_doc.items():
        if not k or len(k) > MAX_KEY_LEN:
            _fail("tensor key path is empty or too long", key=k[:200], expected=f"1..{MAX_KEY_LEN} chars", found=len(k))
        e = _tensor(k, t, prefix, writers)
        if e.array.path in paths:
            raise DuplicateShardError("two tensors share one storage array", key=k, object=e.array.path)
        paths.add(e.array.path)
        tensors[k] = e
    return tensors


def _make_entry(k: str, shape: tuple[int, ...], dtype: str, sharding: dict[str, Any] | None, path: str,
                geom: TensorGeometry, offset: np.ndarray, keys: tuple[str, ...], writer: np.ndarray,
                nbytes: np.ndarray, icrc: np.ndarray, coff: np.ndarray, cnb: np.ndarray, ccrc: np.ndarray) -> TensorEntry:
    return TensorEntry(k, shape, dtype, sharding, ArraySpec(path, geom.shard_shape, geom.chunk_shape, "raw"),
                       ShardTable(offset, writer, keys, nbytes, icrc), ChunkTable(coff, cnb, ccrc))


def _tensor(k: str, t: Any, prefix: str, writers: int) -> TensorEntry:
    _typed(t, dict, "tensor entry", k)
    _members(t, {"shape", "dtype", "sharding", "array", "shards", "chunks"}, "a tensor entry", k)
    shape = _typed(t.get("shape"), list, "shape", k)
    if len(shape) > MAX_NDIM:
        _fail("too many dimensions", key=k, expected=f"<= {MAX_NDIM}", found=len(shape))
    shape_t = tuple(_int(n, 0, MAX_DIM, "shape entry", k) for n in shape)
    dtype = t.get("dtype")
    if type(dtype) is not str or dtype not in DTYPES:
        _fail("unknown dtype", key=k, expected=sorted(DTYPES), found=repr(dtype)[:40])
    item = itemsize_of(dtype)
    # max(n, 1): a zero-length dimension must not lift the bound on the others ([0, 2^62, 2^62]).
    if math.prod(max(n, 1) for n in shape_t) * item > MAX_TENSOR_BYTES:
        _fail("tensor too large (shape x itemsize overflows)", key=k, expected=f"<= {MAX_TENSOR_BYTES} bytes", found=shape_t)
    sharding = t.get("sharding")
    if sharding is not None:
        _typed(sharding, dict, "sharding", k)
    a = _typed(t.get("array"), dict, "array", k)
    _members(a, {"path", "shard_shape", "chunk_shape", "codec"}, "array", k)
    path = check_object_key(a.get("path"), prefix=prefix, key=k)
    if a.get("codec") != "raw":
        raise UnsupportedVersionError("unsupported codec", key=k, expected="raw", found=repr(a.get("codec"))[:40])
    nd = len(shape_t)
    shard_shape = tuple(_int(x, 1, MAX_DIM, "shard_shape entry", k) for x in _typed(a.get("shard_shape"), list, "shard_shape", k))
    chunk_shape = tuple(_int(x, 1, MAX_DIM, "chunk_shape entry", k) for x in _typed(a.get("chunk_shape"), list, "chunk_shape", k))
    if len(shard_shape) != nd or len(chunk_shape) != nd:
        _fail("shard_shape/chunk_shape rank differs from shape", key=k, expected=nd, found=(len(shard_shape), len(chunk_shape)))
    if any(s % c for s, c in zip(shard_shape, chunk_shape)):
        _fail("chunk_shape must divide shard_shape", key=k, expected=f"divisors of {shard_shape}", found=chunk_shape)
    if any(s > max(n, 1) and n > 0 for s, n in zip(shard_shape, shape_t)):
        _fail("shard_shape exceeds the tensor shape", key=k, expected=f"<= {shape_t}", found=shard_shape)
    if math.prod(chunk_shape) * item > MAX_TENSOR_BYTES or math.prod(shard_shape) > (1 << 40) * max(1, math.prod(chunk_shape)):
        _fail("chunk too large", key=k, found=chunk_shape)
    geom = TensorGeometry(shape_t, shard_shape, chunk_shape, item)
    if geom.chunk_nbytes > MAX_TENSOR_BYTES or geom.index_nbytes > MAX_TENSOR_BYTES:
        _fail("encoded chunk or shard index too large", key=k, expected=f"<= {MAX_TENSOR_BYTES} bytes",
              found=max(geom.chunk_nbytes, geom.index_nbytes))
    sh = _typed(t.get("shards"), dict, "shards", k)
    _members(sh, {"offset", "writer", "key", "nbytes", "index_crc32c"}, "shards", k)
    keys = _typed(sh.get("key"), list, "shards.key", k)
    n = len(keys)
    expected_n = math.prod(geom.grid)
    if n != expected_n:
        if n > expected_n:
            raise DuplicateShardError("more shards than grid cells (a box is claimed twice)", key=k,
                                      expected=expected_n, found=n)
        _fail("shards do not tile the tensor (gap)", key=k, expected=f"{expected_n} shards", found=n)
    offset = _int_array(sh.get("offset"), n, 0, MAX_DIM, "shards.offset", k, width=nd)
    writer = _int_array(sh.get("writer"), n, 0, writers - 1, "shards.writer", k)
    nbytes = _int_array(sh.get("nbytes"), n, geom.index_nbytes, MAX_TENSOR_BYTES, "shards.nbytes", k)
    icrc = _int_array(sh.get("index_crc32c"), n, 0, _U32 - 1, "shards.index_crc32c", k)
    if n:
        ss = np.asarray(shard_shape, np.int64)
        if nd and (np.any(offset % ss) or np.any(offset >= np.asarray(shape_t, np.int64))):
            _fail("a shard box is off the grid or outside the tensor", key=k, expected=f"multiples of {shard_shape} inside {shape_t}")
        cells = offset // ss if nd else np.zeros((n, 0), np.int64)
        flat = np.ravel_multi_index(tuple(cells.T), geom.grid) if nd else np.zeros(n, np.int64)
        if len(np.unique(flat)) != n:
            raise DuplicateShardError("two shards claim the same box", key=k, expected="each box once", found="duplicate offset")
        template = "c" + "/{}" * nd
        expected_keys = list(map(template.format, *cells.T.tolist())) if nd else ["c"] * n
        if keys != expected_keys:
            i = next(i for i, (a, b) in enumerate(zip(keys, expected_keys)) if a != b)
            check_object_key(keys[i], key=k)
            _fail("shard object key does not match its box", key=k, object=str(keys[i])[:200],
                  expected=expected_keys[i], found=str(keys[i])[:200])
    ch = _typed(t.get("chunks"), dict, "chunks", k)
    _members(ch, {"offset", "nbytes", "crc32c"}, "chunks", k)
    counts = np.prod(chunk_count_table(geom, offset), axis=1, dtype=np.int64) if n else np.zeros(0, np.int64)
    total = int(counts.sum())
    coff = _int_array(ch.get("offset"), total, 0, MAX_TENSOR_BYTES, "chunks.offset", k)
    cnb = _int_array(ch.get("nbytes"), total, geom.chunk_nbytes, geom.chunk_nbytes, "chunks.nbytes", k)
    ccrc = _int_array(ch.get("crc32c"), total, 0, _U32 - 1, "chunks.crc32c", k)
    if total:
        owner = np.repeat(np.arange(n), counts)
        if np.any(coff > (nbytes[owner] - geom.index_nbytes) - cnb):  # written so that nothing can overflow int64
            _fail("a chunk byte range runs past its shard's data section", key=k)
        # No two chunks of one shard share a byte: sorted by (shard, offset), neighbours lie a whole
        # chunk apart (every chunk of a tensor has nbytes = chunk_nbytes).
        order = np.lexsort((coff, owner))
        so, sw = coff[order], owner[order]
        clash = np.flatnonzero((sw[1:] == sw[:-1]) & (so[1:] - so[:-1] < geom.chunk_nbytes))
        if clash.size:
            a, b = sorted(int(x) for x in order[clash[0]:clash[0] + 2])
            _fail("two chunks of one shard share bytes", key=k, object=f"{path}/{keys[int(owner[a])]}",
                  expected=f"disjoint byte ranges of {geom.chunk_nbytes} bytes",
                  found=f"chunk rows {a} and {b} at offsets {int(coff[a])} and {int(coff[b])}")
    tables = (offset, writer, nbytes, icrc.astype(np.uint32), coff, cnb, ccrc.astype(np.uint32))
    for a in tables:  # a parsed manifest is immutable, whichever path checked it
        a.flags.writeable = False
    return _make_entry(k, shape_t, dtype, sharding, path, geom, *tables[:1], tuple(keys), *tables[1:])
