"""The fast path of manifest validation: the common, valid case, checked across all tensors at once.

:func:`ckptfmt.manifest.parse_manifest` checks every tensor entry. One tensor at a time that
costs ~200 µs per tensor, 2 s for a model of 10,000 tensors. Here the per-tensor work is a few
comparisons against a cache keyed by the tensor's geometry (the tensors of a model share a
handful of geometries): the shard keys, the shard offsets, the shard sizes, the chunk offsets
and the chunk sizes of a tensor written in the canonical layout (FORMAT.md 6.4: shards in C
order of the grid, chunks back to back from offset 0) are fully determined by its geometry, so
they are compared by value with lists derived once from an entry the exact checks accepted. The
remaining columns (writers and checksums) are checked once, vectorized, over all tensors.

The fast path only ever accepts. A tensor it does not cover (another layout, an unusual object
key) goes through the exact per-tensor checks inline; any broken rule anywhere
raises :class:`Fallback`, and the caller then reruns the exact per-tensor checks over the whole
manifest, which raise the precise error (the same one, for the same first tensor, as without
the fast path). Both paths accept exactly the same manifests (tests/test_manifest_fast.py).
"""
from __future__ import annotations

import functools
import json
import re
from json.encoder import encode_basestring as _jstr  # type: ignore[attr-defined]
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ckptfmt.manifest._derived import derived_columns
from ckptfmt.manifest._entries import ChunkTable, ShardTable, empty_tables
from ckptfmt.errors import InvalidManifestError
from ckptfmt.plan import TensorGeometry

__all__ = ["Fallback", "tensors_fast", "count_literals", "check_encodable", "encode_tensors"]

_TENSOR = frozenset({"shape", "dtype", "sharding", "array", "shards", "chunks"})
_ARRAY = frozenset({"path", "shard_shape", "chunk_shape", "codec"})
_SHARDS = frozenset({"offset", "writer", "key", "nbytes", "index_crc32c"})
_CHUNKS = frozenset({"offset", "nbytes", "crc32c"})
_SHARDS_DERIVED = frozenset({"writer", "index_crc32c"})  # the derived form (FORMAT.md 5.14)
_CHUNKS_DERIVED = frozenset({"crc32c"})
# Keys made only of these characters, with no segment starting with ".", pass every rule of
# check_object_key except the length and the prefix (both checked next to it).
_SAFE_PATH = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*")
_U32 = 1 << 32


class Fallback(Exception):
    """The fast path cannot vouch for this manifest; run the exact per-tensor checks."""


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class _Layout:
    """What a canonical tensor of one geometry holds, derived once from an entry the exact checks
    accepted. The lists, compared with an explicit entry's columns, are built on first use: a
    geometry seen only in the derived form never needs them (no Python object per row)."""

    geom: TensorGeometry
    keys_t: tuple[str, ...]
    offsets: np.ndarray           # read-only (S, ndim)
    nbytes: np.ndarray            # shard object sizes
    coff: np.ndarray              # chunk offsets, back to back inside each shard
    cnb: np.ndarray               # chunk sizes
    chunk_start: np.ndarray
    n: int
    total: int

    @functools.cached_property
    def lists(self) -> tuple[list[str], list[list[int]], list[int], list[int], list[int]]:
        """keys, offsets, nbytes, chunk offsets and chunk sizes as JSON decodes them."""
        return list(self.keys_t), self.offsets.tolist(), self.nbytes.tolist(), self.coff.tolist(), self.cnb.tolist()

    @classmethod
    def of(cls, entry: Any, derived: bool = False) -> "_Layout | None":
        """The layout of an accepted entry when it holds exactly the columns its geometry derives
        (FORMAT.md 5.14), else None. ``derived``: the entry was in the derived form, so its columns
        are the derived ones already. 0-d and empty tensors have one too (one shard "c"; no
        shards), so that a manifest of many of them is as cheap."""
        if derived:
            sh, ch = entry.shards, entry.chunks
            return cls(entry.geometry, sh.key, sh.offset, sh.nbytes, ch.offset, ch.nbytes, entry.chunk_start,
                       len(sh.key), len(ch.offset))
        c = derived_columns(entry.geometry)
        if not c.matches(entry):
            return None
        return cls(entry.geometry, c.key, c.offset, c.nbytes, c.chunk_offset, c.chunk_nbytes, c.chunk_start,
                   len(c.key), len(c.chunk_offset))

    def holds(self, sh: dict[str, Any], ch: dict[str, Any]) -> bool:
        """Whether an explicit entry's five derivable columns equal this layout's, by value."""
        keys, offsets, nbytes, coff, cnb = self.lists
        return (sh["key"] == keys and sh["offset"] == offsets and sh["nbytes"] == nbytes and ch["offset"] == coff
                and ch["nbytes"] == cnb)


def tensors_fast(doc: dict[str, Any], prefix: str, writers: int, *, exact: Callable[..., Any],
                 make: Callable[..., Any], max_key_len: int, max_object_key_len: int,
                 no_float_or_bool: bool = False, derived: bool = False) -> dict[str, Any]:
    """Validate and build every tensor entry of ``doc`` (the manifest's "tensors" member).

    ``prefix`` is the save's arrays prefix (``saves/<save_id>/t/``, :func:`ckptfmt.layout.arrays_prefix`).
    ``exact(k, t, prefix, writers)`` is the exact per-tensor parser and ``make(key, dtype, sharding,
    path, geometry, shards, chunks, chunk_start=...)`` builds a TensorEntry from checked parts.
    ``no_float_or_bool`` is the caller's word (from counting the JSON literals) that no tensor
    entry holds a float or a boolean; without it the columns
    compared by value are also type-checked. ``derived``: the manifest lists ckptfmt.derived, so
    entries may be in the derived form (FORMAT.md 5.14); ``exact`` must then accept that form too.
    Raises :class:`Fallback` on anything it cannot accept.
    """
    cache: dict[tuple, _Layout | None] = {}
    out: list[Any] = []           # per tensor: a finished entry, or the index of a fast record
    recs: list[tuple] = []        # (key, shape, dtype, sharding, path, layout)
    paths: set[str] = set()
    header: list[Any] = []        # shape / shard_shape / chunk_shape elements, compared as a cache key
    by_value: list[Any] = []      # values compared with a layout: their types still count
    w: list[Any] = []
    ic: list[Any] = []
    cc: list[Any] = []
    for k, t in doc.items():
        if not k or len(k) > max_key_len:
            raise Fallback
        if type(t) is dict and t.keys() == _TENSOR:
            a, sh, ch = t["array"], t["shards"], t["chunks"]
            full = type(sh) is dict and sh.keys() == _SHARDS and type(ch) is dict and ch.keys() == _CHUNKS
            short = (not full and derived and type(sh) is dict and sh.keys() == _SHARDS_DERIVED
                     and type(ch) is dict and ch.keys() == _CHUNKS_DERIVED)
            if type(a) is dict and a.keys() == _ARRAY and (full or short):
                shape, ss, cs, path, sharding = t["shape"], a["shard_shape"], a["chunk_shape"], a["path"], t["sharding"]
                if (type(shape) is list and type(ss) is list and type(cs) is list and type(path) is str
                        and (sharding is None or type(sharding) is dict) and a["codec"] == "raw"
                        and len(path) <= max_object_key_len and path.startswith(prefix) and _SAFE_PATH.fullmatch(path)):
                    try:
                        ck: tuple | None = (tuple(shape), t["dtype"], tuple(ss), tuple(cs))
                        lay = cache.get(ck, False)  # type: ignore[arg-type]
                    except TypeError:  # an unhashable element: the exact checks will say what is wrong
                        ck, lay = None, None
                    if lay is False:
                        entry = _exact(exact, k, t, prefix, writers)
                        lay = cache[ck] = _Layout.of(entry, short)  # type: ignore[index]
                        if lay is None:
                            _take(entry, paths, out)
                            continue
                    w_, ic_, cc_ = sh["writer"], sh["index_crc32c"], ch["crc32c"]
                    if (lay is not None and (short or lay.holds(sh, ch)) and type(w_) is list and type(ic_) is list
                            and type(cc_) is list and len(w_) == len(ic_) == lay.n and len(cc_) == lay.total):
                        if path in paths:
                            raise Fallback
                        paths.add(path)
                        if not no_float_or_bool:  # else only ints can equal the cache key's ints
                            header += shape
                            header += ss
                            header += cs
                        if not no_float_or_bool and full:
                            by_value.extend(chain.from_iterable(sh["offset"]))
                            by_value += sh["nbytes"]
                            by_value += ch["offset"]
                            by_value += ch["nbytes"]
                        w += w_
                        ic += ic_
                        cc += cc_
                        out.append(len(recs))
                        recs.append((k, t["dtype"], sharding, path, lay))
                        continue
        _take(_exact(exact, k, t, prefix, writers), paths, out)
    return _finish(doc, out, recs, (header, by_value), (w, ic, cc), writers, make)


def _finish(doc: dict[str, Any], out: list[Any], recs: list[tuple], compared: tuple[list[Any], list[Any]],
            columns: tuple[list[Any], list[Any], list[Any]], writers: int, make: Callable[..., Any]) -> dict[str, Any]:
    """The entries of :func:`tensors_fast` from its fast records: the columns compared by value
    must all be ints, the writer and crc columns in range; each record is built by ``make``."""
    w, ic, cc = columns
    if not recs:
        return dict(zip(doc, out))
    if any(c and set(map(type, c)) != {int} for c in compared):
        raise Fallback
    w_a, ic_a, cc_a = _ints(w), _ints(ic), _ints(cc)
    if w_a.size and (w_a.min() < 0 or w_a.max() > writers - 1):
        raise Fallback
    for c in (ic_a, cc_a):
        if c.size and (c.min() < 0 or c.max() > _U32 - 1):
            raise Fallback
    ic_a, cc_a = _readonly(ic_a.astype(np.uint32)), _readonly(cc_a.astype(np.uint32))
    _readonly(w_a)
    result: dict[str, Any] = {}
    s0 = c0 = 0
    for k, o in zip(doc, out):
        if type(o) is not int:
            result[k] = o
            continue
        key, dtype, sharding, path, lay = recs[o]
        if lay.n:  # the layout's columns, and views of the manifest-wide writer and crc columns
            s1, c1 = s0 + lay.n, c0 + lay.total
            shards = ShardTable(lay.offsets, _rows(w_a, s0, s1), lay.keys_t, lay.nbytes, _rows(ic_a, s0, s1))
            chunks = ChunkTable(lay.coff, lay.cnb, _rows(cc_a, c0, c1))
            s0, c0 = s1, c1
        else:  # a tensor with no shards: the tables every such tensor of its rank shares
            shards, chunks = empty_tables(len(lay.geom.shape))
        result[k] = make(key, dtype, sharding, path, lay.geom, shards, chunks, chunk_start=lay.chunk_start)
    return result


def _rows(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of a read-only column: the column itself when that is all of it."""
    return a if lo == 0 and hi == len(a) else a[lo:hi]


def _exact(exact: Callable[..., Any], *args: Any) -> Any:
    try:
        return exact(*args)
    except Exception:
        raise Fallback from None


def _take(entry: Any, paths: set[str], out: list[Any]) -> None:
    if entry.array.path in paths:
        raise Fallback
    paths.add(entry.array.path)
    out.append(entry)


def _ints(v: list[Any]) -> np.ndarray:
    if v and set(map(type, v)) != {int}:  # exactly int: no bool, float or string
        raise Fallback
    try:
        return np.fromiter(v, np.int64, len(v))
    except (OverflowError, ValueError, TypeError):
        raise Fallback from None


def count_literals(obj: Any) -> tuple[int, int]:
    """(floats, booleans) held anywhere in a JSON value."""
    floats = bools = 0
    stack = [obj]
    while stack:
        v = stack.pop()
        tv = type(v)
        if tv is float:
            floats += 1
        elif tv is bool:
            bools += 1
        elif tv is dict:
            stack.extend(v.values())
        elif tv is list:
            stack.extend(v)
    return floats, bools


def _dump(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_tensors(tensors: Mapping[str, Any], derived: bool = False) -> Iterator[str]:
    """The canonical JSON text of the manifest's "tensors" member, a member (``"key":{...}``) at a
    time in key order: joined with "," inside "{" and "}", exactly what ``json.dumps`` (sorted
    keys, compact separators, no ASCII escaping) gives for ``{k: t.to_json(cols)}``, built from
    per-column pieces (a member at a time: the caller need not hold the whole text twice). The
    columns a geometry determines (shard keys, offsets and sizes, chunk offsets and sizes) repeat
    across the tensors of a model and are encoded once each; with ``derived`` (the manifest lists
    ckptfmt.derived) they are left out of every entry that holds exactly the derived columns
    (FORMAT.md 5.14; ``cols`` is then that entry's :func:`derived_columns`, else None)."""
    dump = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
    memo: dict[bytes, str] = {}
    small: dict[Any, str] = {}  # shapes, dtypes and codecs repeat across tensors
    derived_of: dict[Any, Any] = {}

    def col(a: np.ndarray) -> str:
        raw = a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()
        text = memo.get(raw)
        if text is None:
            text = memo[raw] = dump(a.tolist())
        return text

    def val(v: Any) -> str:
        key = repr(v)  # not v: (1,), (1.0,) and (True,) are equal keys but encode differently
        text = small.get(key)
        if text is None:
            text = small[key] = dump(list(v) if type(v) is tuple else v)
        return text

    keys_memo: dict[tuple[str, ...], str] = {}
    for k in sorted(tensors):
        t = tensors[k]
        sh, ch, ar = t.shards, t.chunks, t.array
        # Strings through the very function json.dumps uses for them (ensure_ascii=False).
        head = (f'{_jstr(k)}:{{"array":{{"chunk_shape":{val(ar.chunk_shape)},"codec":{val(ar.codec)},'
                f'"path":{_jstr(ar.path)},"shard_shape":{val(ar.shard_shape)}}},')
        mid = (f'"dtype":{val(t.dtype)},"shape":{val(t.shape)},'
               f'"sharding":{"null" if t.sharding is None else dump(t.sharding)},')
        pk = t.packed  # FORMAT.md 5.15: "object" sorts after "nbytes", "start" after "offset"
        obj = "" if pk is None else f'"object":{_ints_text(pk.object)},'
        start = "" if pk is None else f'"start":{_ints_text(pk.start)},'
        if derived:
            cols = derived_of.get(t.geometry)
            if cols is None:
                cols = derived_of[t.geometry] = derived_columns(t.geometry)
            if cols.matches(t):
                yield (f'{head}"chunks":{{"crc32c":{_ints_text(ch.crc32c)}}},{mid}'
                       f'"shards":{{"index_crc32c":{_ints_text(sh.index_crc32c)},{obj}'
                       f'{start}"writer":{_ints_text(sh.writer)}}}}}')
                continue
        keys = keys_memo.get(sh.key)
        if keys is None:
            keys = keys_memo[sh.key] = dump(list(sh.key))
        offset = col(np.ascontiguousarray(sh.offset).reshape(len(sh), len(t.shape)))
        yield (f'{head}"chunks":{{"crc32c":{_ints_text(ch.crc32c)},"nbytes":{col(ch.nbytes)},"offset":{col(ch.offset)}}},{mid}'
               f'"shards":{{"index_crc32c":{_ints_text(sh.index_crc32c)},"key":{keys},"nbytes":{col(sh.nbytes)},'
               f'{obj}"offset":{offset},{start}"writer":{_ints_text(sh.writer)}}}}}')


def _ints_text(a: np.ndarray) -> str:
    """``json.dumps(a.tolist())`` with compact separators, for a 1-d integer array."""
    if a.dtype.kind not in "iu" or a.ndim != 1:
        return _dump(a.tolist())
    return "[" + ",".join(map(str, a.tolist())) + "]"


def check_encodable(doc: Any) -> None:
    """Reject strings (keys or values) that UTF-8 cannot encode: lone surrogates from \\uD800-style escapes."""
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(v.keys())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidManifestError("manifest holds a string that is not valid Unicode (a lone surrogate)",
                                           expected="UTF-8 encodable text", found=ascii(v)[:80]) from None
