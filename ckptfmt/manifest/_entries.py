"""Tensor and state entries of a manifest: their frozen dataclasses, and the exact checks of one
tensor entry against every rule of format v1 (FORMAT.md 5.3, 5.7, 5.9, 5.11). :mod:`ckptfmt.manifest`
parses the whole document; :mod:`ckptfmt.manifest._fast` checks the common case across tensors at
once and falls back on :func:`_tensors_exact` here."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterator, Mapping

import numpy as np

from ckptfmt.dtypes import DTYPES, itemsize_of
from ckptfmt.errors import DuplicateShardError, InvalidManifestError, UnsupportedVersionError
from ckptfmt.layout import MAX_DIM, MAX_NDIM, MAX_TENSOR_BYTES, shard_key
from ckptfmt.manifest._derived import DerivedColumns, TooManyChunks, derived_columns
from ckptfmt.plan import TensorGeometry, chunk_count_table
from ckptfmt.shard import shard_sizes

_CONTROL = re.compile("[\x00-\x1f\x7f]")  # C0 controls and DEL

__all__ = ["ArraySpec", "PackedRows", "ShardTable", "ChunkTable", "TensorEntry", "StateEntry", "check_object_key", "CODECS",
           "empty_tables", "replace_entry"]

MAX_KEY_LEN = 4096
MAX_OBJECT_KEY_LEN = 1024
_U32 = 1 << 32
#: The inner-chunk codecs (FORMAT.md 5.7, 6.3): "raw", and "zstd" (extension ckptfmt.zstd, revision 1.1).
CODECS = ("raw", "zstd")


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
    elif _CONTROL.search(k):
        bad = "control character"
    elif prefix and not k.startswith(prefix):
        bad = f"outside {prefix!r}"
    if bad:
        raise InvalidManifestError(f"object key escapes the repository ({bad})", key=key, object=str(k)[:200],
                                   expected=f"a relative key under {prefix or 'the repository'}", found=str(k)[:200])
    return k


# Entries, specs and tables are slotted: a manifest holds one of each per tensor (100,000 tensors
# and more), and a per-object __dict__ would be most of an empty tensor's cost.
@dataclass(frozen=True, slots=True)
class ArraySpec:
    path: str
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    codec: str = "raw"


@dataclass(frozen=True, eq=False, slots=True)
class ShardTable:
    offset: np.ndarray        # (S, ndim) int64
    writer: np.ndarray        # (S,) int64
    key: tuple[str, ...]
    nbytes: np.ndarray        # (S,) int64
    index_crc32c: np.ndarray  # (S,) uint32

    def __len__(self) -> int:
        return len(self.key)


@dataclass(frozen=True, eq=False, slots=True)
class ChunkTable:
    offset: np.ndarray  # (C,) int64, byte offset inside the shard object
    nbytes: np.ndarray  # (C,) int64, includes the 4-byte crc32c trailer
    crc32c: np.ndarray  # (C,) uint32, crc32c of the chunk's data bytes


@functools.cache
def empty_tables(ndim: int) -> tuple[ShardTable, ChunkTable]:
    """The shard and chunk tables of a tensor with no shards (a zero-length dimension), of rank
    ``ndim``: read-only, and one pair per rank shared by every such entry (they are values)."""
    i64, u32, off = np.zeros(0, np.int64), np.zeros(0, np.uint32), np.zeros((0, ndim), np.int64)
    for a in (i64, u32, off):
        a.flags.writeable = False
    return ShardTable(off, i64, (), i64, u32), ChunkTable(i64, i64, u32)


@dataclass(frozen=True, eq=False, slots=True)
class PackedRows:
    """Where a packed tensor's shard rows lie (FORMAT.md 5.15, ``ckptfmt.packs``): row ``j``'s
    bytes are ``[start[j], start[j] + shards.nbytes[j])`` of object ``keys[object[j]]``, which
    has exactly ``sizes[object[j]]`` bytes. ``keys`` and ``sizes`` are the manifest's object
    table, shared by every entry."""

    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    object: np.ndarray  # (S,) int64, a position in the object table
    start: np.ndarray   # (S,) int64, the object offset of the shard's first byte


class _NoObjects(Mapping[int, str]):
    """The ``objects`` of an entry that references nothing: an empty read-only map, one for all
    of them (a dict per entry is 64 bytes per tensor)."""

    __slots__ = ()

    def __getitem__(self, row: int) -> str:
        raise KeyError(row)

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"

    def __reduce__(self) -> tuple[Any, ...]:
        return _no_objects, ()


_NO_OBJECTS = _NoObjects()


def _no_objects() -> Mapping[int, str]:
    return _NO_OBJECTS


@dataclass(frozen=True, eq=False, slots=True)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    dtype: str
    sharding: dict[str, Any] | None
    array: ArraySpec
    shards: ShardTable
    chunks: ChunkTable
    #: Shard rows whose object belongs to an earlier save (FORMAT.md 5.13, ckptfmt.references):
    #: row -> that save's array path. Every other row's object lies under ``array.path``.
    objects: Mapping[int, str] = field(default_factory=_no_objects)
    #: Revision 1.3 (FORMAT.md 5.15, ckptfmt.packs): where each row lies in the save's pack
    #: objects; None for a tensor whose rows are shard objects of their own.
    packed: PackedRows | None = None
    # What geometry and chunk_start computed, or what the parser already knew (shared by the
    # tensors of one geometry); not part of the value.
    _geometry: TensorGeometry | None = field(default=None, init=False, repr=False)
    _chunk_start: np.ndarray | None = field(default=None, init=False, repr=False)

    @property
    def geometry(self) -> TensorGeometry:
        g = self._geometry
        if g is None:
            g = TensorGeometry(self.shape, self.array.shard_shape, self.array.chunk_shape, itemsize_of(self.dtype))
            object.__setattr__(self, "_geometry", g)
        return g

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize_of(self.dtype)

    @property
    def chunk_start(self) -> np.ndarray:
        """Where each shard's entries begin in the chunk table (length S + 1)."""
        c = self._chunk_start
        if c is None:
            counts = np.prod(chunk_count_table(self.geometry, self.shards.offset), axis=1, dtype=np.int64)
            c = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
            object.__setattr__(self, "_chunk_start", c)
        return c

    def object_key(self, s: int) -> str:
        """The key of the object that holds shard row ``s``: its pack (FORMAT.md 5.15), or its
        own shard object under this save's array or a referenced save's."""
        if self.packed is not None:
            return self.packed.keys[int(self.packed.object[s])]
        return shard_key(self.objects.get(s, self.array.path) if self.objects else self.array.path, self.shards.key[s])

    def object_nbytes(self, s: int) -> int:
        """The exact length of the object that holds shard row ``s``: its pack's, or the shard's."""
        if self.packed is not None:
            return self.packed.sizes[int(self.packed.object[s])]
        return int(self.shards.nbytes[s])

    def shard_start(self, s: int) -> int:
        """The object offset of shard row ``s``'s first byte (0 for a shard object of its own)."""
        return 0 if self.packed is None else int(self.packed.start[s])

    def is_referenced(self, s: int, save_id: str) -> bool:
        """Whether row ``s``'s object belongs to an earlier save than ``save_id``."""
        if self.packed is not None:
            return not self.object_key(s).startswith(f"saves/{save_id}/")
        return s in self.objects

    @property
    def referenced_nbytes(self) -> int:
        """Bytes of the shard objects this entry references in earlier saves."""
        if self.packed is not None:
            own = f"saves/{self.array.path.split('/')[1]}/"
            return int(sum(int(self.shards.nbytes[s]) for s in range(len(self.shards))
                           if not self.packed.keys[int(self.packed.object[s])].startswith(own)))
        return int(sum(int(self.shards.nbytes[s]) for s in self.objects))

    def to_json(self, derived: DerivedColumns | None = None) -> dict[str, Any]:
        """The entry's JSON object; in the derived form (FORMAT.md 5.14) when ``derived`` is given
        and this entry holds exactly those columns."""
        head = {
            "shape": list(self.shape), "dtype": self.dtype, "sharding": self.sharding,
            "array": {"path": self.array.path, "shard_shape": list(self.array.shard_shape),
                      "chunk_shape": list(self.array.chunk_shape), "codec": self.array.codec},
        }
        pack = {} if self.packed is None else {"object": self.packed.object.tolist(), "start": self.packed.start.tolist()}
        if derived is not None and derived.matches(self):
            return head | {"shards": {"writer": self.shards.writer.tolist(), "index_crc32c": self.shards.index_crc32c.tolist()} | pack,
                           "chunks": {"crc32c": self.chunks.crc32c.tolist()}}
        return head | {
            "shards": {"offset": self.shards.offset.reshape(len(self.shards), len(self.shape)).tolist(),
                       "writer": self.shards.writer.tolist(), "key": list(self.shards.key),
                       "nbytes": self.shards.nbytes.tolist(), "index_crc32c": self.shards.index_crc32c.tolist()} | pack,
            "chunks": {"offset": self.chunks.offset.tolist(), "nbytes": self.chunks.nbytes.tolist(),
                       "crc32c": self.chunks.crc32c.tolist()},
        }


def replace_entry(t: TensorEntry, **changes: Any) -> TensorEntry:
    """``dataclasses.replace(t, **changes)`` that keeps what ``t`` already knows of its geometry
    and chunk table when only its references, packed rows or sharding change."""
    e = dataclasses.replace(t, **changes)
    if not set(changes) - {"objects", "packed", "sharding"}:
        object.__setattr__(e, "_geometry", t._geometry)
        object.__setattr__(e, "_chunk_start", t._chunk_start)
    return e


def _known(e: TensorEntry, geom: TensorGeometry, chunk_start: np.ndarray) -> TensorEntry:
    """``e`` with its geometry and chunk starts set to what the parser already built."""
    object.__setattr__(e, "_geometry", geom)
    object.__setattr__(e, "_chunk_start", chunk_start)
    return e


@dataclass(frozen=True, slots=True)
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


def _members(d: dict[str, Any], allowed: set[str], what: str, key: str | None = None) -> None:
    """Format v1 is closed: unknown members are errors (new things go in "extensions")."""
    extra = set(d) - allowed
    if extra:
        _fail(f"unknown member(s) in {what}", key=key, expected=sorted(allowed), found=sorted(extra)[:10])


def _tensors_exact(tensors_doc: dict[str, Any], prefix: str, writers: int,
                   codecs: tuple[str, ...] = ("raw",), derived: bool = False) -> dict[str, TensorEntry]:
    """Every tensor entry checked one at a time; raises the first broken rule, in document order.
    ``derived``: the manifest lists ckptfmt.derived (entries may be in the derived form)."""
    tensors: dict[str, TensorEntry] = {}
    paths: set[str] = set()
    for k, t in tensors_doc.items():
        if not k or len(k) > MAX_KEY_LEN:
            _fail("tensor key path is empty or too long", key=k[:200], expected=f"1..{MAX_KEY_LEN} chars", found=len(k))
        e = _tensor(k, t, prefix, writers, codecs, derived)
        if e.array.path in paths:
            raise DuplicateShardError("two tensors share one storage array", key=k, object=e.array.path)
        paths.add(e.array.path)
        tensors[k] = e
    return tensors


def _make_entry(k: str, dtype: str, sharding: dict[str, Any] | None, path: str, geom: TensorGeometry,
                shards: ShardTable, chunks: ChunkTable, codec: str = "raw",
                chunk_start: np.ndarray | None = None) -> TensorEntry:
    """A checked entry. Its shape is ``geom.shape`` and its dtype the interned name (both shared
    by the tensors of a model); with ``chunk_start`` the entry keeps ``geom`` and it as known."""
    e = TensorEntry(k, geom.shape, sys.intern(dtype), sharding, ArraySpec(path, geom.shard_shape, geom.chunk_shape, codec),
                    shards, chunks)
    return e if chunk_start is None else _known(e, geom, chunk_start)


_SHARD_DERIVED = ("offset", "key", "nbytes")
_CHUNK_DERIVED = ("offset", "nbytes")


def _geometry(k: str, a: Mapping[str, Any], shape_t: tuple[int, ...], item: int) -> TensorGeometry:
    """The array's shard and chunk shapes checked against the tensor shape and the size caps."""
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
    sizes = shard_sizes(geom)
    if sizes.chunk > MAX_TENSOR_BYTES or sizes.index > MAX_TENSOR_BYTES:
        _fail("encoded chunk or shard index too large", key=k, expected=f"<= {MAX_TENSOR_BYTES} bytes",
              found=max(sizes.chunk, sizes.index))
    return geom


def _tensor(k: str, t: Any, prefix: str, writers: int, codecs: tuple[str, ...] = ("raw",),
            derived: bool = False) -> TensorEntry:
    """One tensor entry checked against every rule. ``codecs``: the codecs this manifest may use
    ("zstd" only when it lists the extension ckptfmt.zstd in must_understand); ``derived``: the
    manifest lists ckptfmt.derived, so the entry may leave out the columns of FORMAT.md 5.14."""
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
    codec = a.get("codec")
    if type(codec) is not str or codec not in CODECS:
        raise UnsupportedVersionError("unsupported codec", key=k, expected=list(CODECS), found=repr(codec)[:40])
    if codec not in codecs:  # a codec other than raw changes how chunks are read: it must be declared
        raise UnsupportedVersionError(f"codec {codec!r} is used without its extension in must_understand", key=k,
                                      expected=f"must_understand lists ckptfmt.{codec}", found="not listed")
    geom = _geometry(k, a, shape_t, item)
    nd = len(shape_t)
    sh = _typed(t.get("shards"), dict, "shards", k)
    _members(sh, {"offset", "writer", "key", "nbytes", "index_crc32c"}, "shards", k)
    ch = _typed(t.get("chunks"), dict, "chunks", k)
    _members(ch, {"offset", "nbytes", "crc32c"}, "chunks", k)
    cols = _fill_derived(k, sh, ch, geom, codec, derived)
    if cols is not None:
        return _derived_entry(k, shape_t, dtype, sharding, path, geom, sh, ch, writers, cols)
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
    sizes = shard_sizes(geom)
    nbytes = _int_array(sh.get("nbytes"), n, sizes.index, MAX_TENSOR_BYTES, "shards.nbytes", k)
    icrc = _int_array(sh.get("index_crc32c"), n, 0, _U32 - 1, "shards.index_crc32c", k)
    if n:
        _check_shard_boxes(k, geom, offset, keys)
    counts = np.prod(chunk_count_table(geom, offset), axis=1, dtype=np.int64) if n else np.zeros(0, np.int64)
    total = int(counts.sum())
    coff = _int_array(ch.get("offset"), total, 0, MAX_TENSOR_BYTES, "chunks.offset", k)
    # raw: exactly a raw chunk; encoded: at least one byte before its trailer, at most zstd's bound
    cnb = _int_array(ch.get("nbytes"), total, *sizes.stored_chunk(codec), "chunks.nbytes", k)
    ccrc = _int_array(ch.get("crc32c"), total, 0, _U32 - 1, "chunks.crc32c", k)
    if total:
        _check_chunk_ranges(k, geom, path, keys, nbytes, counts, coff, cnb)
    if not n:  # no shard, no chunk: the shared empty tables
        return _make_entry(k, dtype, sharding, path, geom, *empty_tables(nd), codec=codec)
    tables = (offset, writer, nbytes, icrc.astype(np.uint32), coff, cnb, ccrc.astype(np.uint32))
    for a in tables:  # a parsed manifest is immutable, whichever path checked it
        a.flags.writeable = False
    return _make_entry(k, dtype, sharding, path, geom, ShardTable(offset, writer, tuple(keys), nbytes, tables[3]),
                       ChunkTable(*tables[4:]), codec=codec)


def _derived_entry(k: str, shape: tuple[int, ...], dtype: str, sharding: dict[str, Any] | None, path: str,
                   geom: TensorGeometry, sh: dict[str, Any], ch: dict[str, Any], writers: int,
                   cols: DerivedColumns) -> TensorEntry:
    """The entry of a tensor in the derived form: the derived columns as they are (they tile the
    tensor and its shards' bytes by construction, FORMAT.md 5.14), the written ones checked."""
    n, total = len(cols.key), len(cols.chunk_offset)
    writer = _int_array(sh.get("writer"), n, 0, writers - 1, "shards.writer", k)
    # The largest shard is shard 0 (whole along every dimension): its size, in exact arithmetic.
    sizes = shard_sizes(geom)
    top = sizes.full if n else 0
    if top > MAX_TENSOR_BYTES:
        _fail("shards.nbytes out of range", key=k, expected=f"[{sizes.index}, {MAX_TENSOR_BYTES}]",
              found=f"{top} (derived)")
    icrc = _int_array(sh.get("index_crc32c"), n, 0, _U32 - 1, "shards.index_crc32c", k)
    ccrc = _int_array(ch.get("crc32c"), total, 0, _U32 - 1, "chunks.crc32c", k)
    tables = (writer, icrc.astype(np.uint32), ccrc.astype(np.uint32))
    for a in tables:
        a.flags.writeable = False
    return _make_entry(k, dtype, sharding, path, geom, ShardTable(cols.offset, tables[0], cols.key, cols.nbytes, tables[1]),
                       ChunkTable(cols.chunk_offset, cols.chunk_nbytes, tables[2]), chunk_start=cols.chunk_start)


def _fill_derived(k: str, sh: dict[str, Any], ch: dict[str, Any], geom: TensorGeometry, codec: str,
                  derived: bool) -> DerivedColumns | None:
    """The derived columns of an entry in the derived form (FORMAT.md 5.14), after checking that
    the form is allowed and that the columns it holds have the lengths the geometry implies (so
    that nothing is sized by the geometry alone); None for an entry holding all its columns."""
    present = [c for c in _SHARD_DERIVED if c in sh] + [f"chunks.{c}" for c in _CHUNK_DERIVED if c in ch]
    if len(present) == len(_SHARD_DERIVED) + len(_CHUNK_DERIVED):
        return None
    if present:
        _fail("tensor entry leaves out some of the derivable columns but not all (FORMAT.md 5.14)", key=k,
              expected="all of shards.offset, shards.key, shards.nbytes, chunks.offset, chunks.nbytes, or none",
              found=f"present: {present}")
    if not derived:
        _fail("tensor entry leaves out shards.offset, shards.key, shards.nbytes, chunks.offset and chunks.nbytes "
              "without the extension ckptfmt.derived in must_understand", key=k,
              expected="all five columns (or ckptfmt.derived listed)", found="none of them")
    if codec != "raw":
        _fail("only a tensor with codec 'raw' may be in the derived form (FORMAT.md 5.14)", key=k,
              expected="raw", found=codec)
    n = math.prod(geom.grid)  # checked against the document's own columns before anything is built from it
    for col in ("writer", "index_crc32c"):
        if len(_typed(sh.get(col), list, f"shards.{col}", k)) != n:
            _fail(f"shards.{col} has the wrong length", key=k, expected=n, found=len(sh[col]))
    crcs = _typed(ch.get("crc32c"), list, "chunks.crc32c", k)
    try:
        cols = derived_columns(geom, max_chunks=len(crcs))
    except TooManyChunks as e:
        _fail("chunks.crc32c has the wrong length", key=k, expected=e.total, found=len(crcs))
    return cols


def _check_shard_boxes(k: str, geom: TensorGeometry, offset: np.ndarray, keys: list[Any]) -> None:
    """Every shard sits on the grid inside the tensor, once, under the key of its box (FORMAT.md 5.11)."""
    n, nd = len(keys), len(geom.shape)
    ss = np.asarray(geom.shard_shape, np.int64)
    if nd and (np.any(offset % ss) or np.any(offset >= np.asarray(geom.shape, np.int64))):
        _fail("a shard box is off the grid or outside the tensor", key=k,
              expected=f"multiples of {geom.shard_shape} inside {geom.shape}")
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


def _check_chunk_ranges(k: str, geom: TensorGeometry, path: str, keys: list[Any], nbytes: np.ndarray,
                        counts: np.ndarray, coff: np.ndarray, cnb: np.ndarray) -> None:
    """Every chunk lies inside its shard's data section, and no two chunks of a shard share a byte."""
    owner = np.repeat(np.arange(len(keys)), counts)
    if np.any(coff > shard_sizes(geom).data_stop(nbytes[owner]) - cnb):  # written so that nothing can overflow int64
        _fail("a chunk byte range runs past its shard's data section", key=k)
    # Sorted by (shard, offset), each chunk must end before the next one of its shard begins.
    order = np.lexsort((coff, owner))
    so, sw = coff[order], owner[order]
    clash = np.flatnonzero((sw[1:] == sw[:-1]) & (so[1:] - so[:-1] < cnb[order][:-1]))
    if clash.size:
        a, b = sorted(int(x) for x in order[clash[0]:clash[0] + 2])
        _fail("two chunks of one shard share bytes", key=k, object=shard_key(path, keys[int(owner[a])]),
              expected="disjoint byte ranges",
              found=f"chunk rows {a} and {b} at offsets {int(coff[a])} and {int(coff[b])}")
