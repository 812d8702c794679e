"""The safetensors file format: a defensive header parser and the header writer (numpy only).

A safetensors file is ``N`` (8 bytes, little-endian u64), ``N`` bytes of JSON (the header), then
the data section. The header maps each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the data section, C order, little-endian) and may hold
``"__metadata__"``, a map of strings to strings.

:func:`parse_header` checks, from the header bytes and the file's size alone and before anything
else is read or allocated: the header-size cap and that the header fits in the file; strict JSON
(no duplicate names, no NaN, bounded nesting); the exact members of every entry; a dtype this
format knows; shapes and offsets that are non-negative integers below 2^63; every tensor's byte
length equal to its shape's element count times its dtype's size (exact integer arithmetic);
offsets that exactly tile the data section, in order, with no gap and no overlap (which also makes
the file end exactly where the last tensor ends). Any violation is :class:`InvalidSourceError`
naming the tensor and what was expected against what was found.

What the format cannot give: safetensors carries no checksum, so a flipped data byte in a file
written by another tool is not detectable. Files written by ckptfmt's export carry a crc32c per
block of each tensor's bytes and one over the tensor table in ``__metadata__``
(:data:`META_CRC`, :data:`META_TABLE_CRC`); :mod:`ckptfmt.interop._stsource` verifies them.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ckptfmt.manifest._caps import MAX_NESTING, MAX_TENSORS, CountCaps, check_nesting, count_structural
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import DTYPES
from ckptfmt.errors import InvalidManifestError, InvalidSourceError

__all__ = ["StEntry", "StHeader", "parse_header", "encode_header", "ST_DTYPES", "FORMAT_DTYPES",
           "MAX_HEADER_BYTES", "META_CRC", "META_TABLE_CRC", "META_BLOCK", "table_crc", "header_size",
           "strict_pairs", "reject_constant", "check_json_caps", "check_text", "HEADER_STRUCTURAL", "MAX_TENSORS",
           "MAX_INDEX_BYTES", "INDEX_STRUCTURAL", "parse_index"]

#: The safetensors reference implementation's own cap on the header (100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Structural bytes ("{", "[", ",") a header may hold: the manifest's cap (FORMAT.md 5.10) scaled
#: to the header's size cap, so that decoding builds at most about 1 GB, whatever the text.
HEADER_STRUCTURAL = CountCaps.for_size_cap(MAX_HEADER_BYTES).structural
#: Largest index file accepted (a 400B-parameter model's index is a few MB), and its structural bytes.
MAX_INDEX_BYTES = 64 << 20
INDEX_STRUCTURAL = CountCaps.for_size_cap(MAX_INDEX_BYTES).structural
_FILE_NAME = re.compile(r"[^/\\\x00]{1,255}")
#: Largest integer accepted for a dimension or an offset (the format's own bound on sizes).
_MAX_INT = (1 << 63) - 1
_MAX_NDIM = 64

#: safetensors dtype -> format dtype name (only those the format stores; F4, F6_*, F8_E8M0 are not).
ST_DTYPES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
#: format dtype name -> safetensors dtype (complex128 has no safetensors dtype).
FORMAT_DTYPES: dict[str, str] = {v: k for k, v in ST_DTYPES.items()}

# The __metadata__ members ckptfmt's export writes (docs/INTEROP.md, "Checksummed safetensors").
META_VERSION = "ckptfmt.export"      # "1"
META_BLOCK = "ckptfmt.crc32c_block"  # bytes per checksummed block of a tensor, decimal
META_CRC = "ckptfmt.crc32c"          # JSON: name -> concatenated 8-hex-digit crc32c of each block
META_TABLE_CRC = "ckptfmt.table_crc32c"  # 8 hex digits: crc32c of the canonical tensor table


@dataclass(frozen=True, slots=True)
class StEntry:
    """One tensor of a safetensors file: absolute byte range ``[begin, end)`` in the file."""

    name: str
    dtype: str                  # format dtype name
    shape: tuple[int, ...]
    begin: int                  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class StHeader:
    """A parsed, validated header. ``data_start`` = 8 + header length; ``size`` = the file's size."""

    tensors: Mapping[str, StEntry]
    metadata: Mapping[str, str]
    data_start: int
    size: int


def _bad(msg: str, obj: str, *, key: str | None = None, expected: Any = None, found: Any = None) -> InvalidSourceError:
    return InvalidSourceError(f"safetensors header: {msg}", key=key, object=obj, expected=expected, found=found)


def header_size(prefix: bytes, file_size: int, obj: str) -> int:
    """The header length from the file's first 8 bytes, checked against the cap and the file's size
    before the header itself is read."""
    if file_size < 8 or len(prefix) < 8:
        raise _bad("file is shorter than the 8-byte header length", obj, expected=">= 8 bytes", found=file_size)
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _bad("header length exceeds the cap", obj, expected=f"<= {MAX_HEADER_BYTES} bytes", found=n)
    if n < 2 or 8 + n > file_size:
        raise _bad("header length does not fit in the file", obj, expected=f"2..{max(2, file_size - 8)} bytes",
                   found=n)
    return n


def strict_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for strict JSON: a duplicate name raises ValueError."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate name {k[:200]!r}")
        out[k] = v
    return out


def reject_constant(name: str) -> Any:
    """``parse_constant`` for strict JSON: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not JSON")


def check_json_caps(data: bytes, structural_cap: int, obj: str, what: str) -> None:
    """InvalidSourceError, before ``data`` is decoded, when its text holds more JSON values than
    ``structural_cap`` allows (FORMAT.md 5.10's structural bytes: every value but the root follows
    a "{", "[" or ","; counted with a byte search)."""
    n = count_structural(data)
    if n > structural_cap:
        raise InvalidSourceError(f"{what} holds too many JSON values", object=obj,
                                 expected=f"<= {structural_cap} structural bytes ({{ [ ,)", found=n)


def check_text(names: Any, obj: str, what: str) -> None:
    """InvalidSourceError for a string UTF-8 cannot encode (a lone surrogate from a \\uD800 escape):
    it could never become a key path, a file name or manifest text."""
    for v in names:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidSourceError(f"{what} is not valid Unicode (a lone surrogate)", object=obj, key=ascii(v)[:200],
                                     expected="UTF-8 encodable text", found=ascii(v)[:200]) from None


def _int(v: Any, what: str, obj: str, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_INT:
        raise _bad(f"{what} must be an integer in [0, 2^63)", obj, key=key, expected="0 <= int < 2^63",
                   found=repr(v)[:80])
    return v


def _entry(name: str, e: Any, obj: str, data_start: int, data_len: int | None) -> StEntry:
    """One tensor entry of a header, checked: its members, dtype, shape and data_offsets."""
    if not name:
        raise _bad("a tensor name is empty", obj, expected="a non-empty name", found="''")
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise _bad("a tensor entry must have exactly dtype, shape and data_offsets", obj, key=name,
                   expected=["data_offsets", "dtype", "shape"],
                   found=sorted(e) if isinstance(e, dict) else type(e).__name__)
    st = e["dtype"]
    if not isinstance(st, str) or st not in ST_DTYPES:
        raise _bad("dtype is not one this format stores", obj, key=name, expected=sorted(ST_DTYPES),
                   found=repr(st)[:40])
    shape = e["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM:
        raise _bad("shape must be a list of at most 64 integers", obj, key=name, expected="list",
                   found=repr(shape)[:80])
    dims = tuple(_int(d, "a dimension", obj, name) for d in shape)
    offs = e["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2:
        raise _bad("data_offsets must be [begin, end]", obj, key=name, expected="[begin, end]",
                   found=repr(offs)[:80])
    begin, end = (_int(o, "an offset", obj, name) for o in offs)
    dtype = ST_DTYPES[st]
    want = math.prod(dims) * DTYPES[dtype]  # exact: Python integers do not overflow
    if end < begin or end - begin != want:
        raise _bad("data_offsets do not span shape x dtype size", obj, key=name,
                   expected=f"{want} bytes ({list(dims)} x {DTYPES[dtype]} B)", found=f"[{begin}, {end})")
    if data_len is not None and end > data_len:
        raise _bad("a tensor lies past the end of the file", obj, key=name,
                   expected=f"end <= {data_len} (data section)", found=end)
    return StEntry(name, dtype, dims, data_start + begin, data_start + end)


def parse_header(header: bytes, file_size: int | None, obj: str, max_tensors: int = MAX_TENSORS) -> StHeader:
    """Validate the header bytes (the ``N`` bytes after the length) of a file of ``file_size`` bytes
    (None on an object store without a cheap size: the returned ``size`` is then the size the
    header implies, which the caller must confirm before reading tensor bytes).

    Pure: reads nothing, allocates nothing but the parsed JSON, and that within the caps: at most
    :data:`HEADER_STRUCTURAL` JSON values (counted before decoding) and ``max_tensors`` tensors
    (counted before any per-tensor work; an import's whole source shares the manifest's cap).
    Raises InvalidSourceError, naming the tensor and what was expected and found, for any
    violation listed in the module docstring.
    """
    n = len(header)
    if not header[:1] == b"{":
        raise _bad("header does not start with '{'", obj, expected="{", found=header[:8].decode("latin-1"))
    check_json_caps(header, HEADER_STRUCTURAL, obj, "safetensors header")
    # Every tensor entry has a "data_offsets" member, so more of those tokens than the cap allows
    # is refused before the (costly) decoding; an escaped spelling falls to the count below.
    listed = bytes(header).count(b'"data_offsets"')
    if listed > max_tensors:
        raise _bad("header holds too many tensors", obj, expected=f"<= {max_tensors} tensors",
                   found=f"{listed} data_offsets members")
    try:
        doc = json.loads(bytes(header).decode("utf-8"), object_pairs_hook=strict_pairs, parse_constant=reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _bad("header is not strict JSON", obj, expected="a JSON object with unique names",
                   found=f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise _bad("header is not a JSON object", obj, expected="object", found=type(doc).__name__)
    if len(doc) - ("__metadata__" in doc) > max_tensors:
        raise _bad("header holds too many tensors", obj, expected=f"<= {max_tensors} tensors",
                   found=len(doc) - ("__metadata__" in doc))
    if b"\\" in header:  # only a \u escape can smuggle in a lone surrogate (strict UTF-8 decoding rejects raw ones)
        check_text(doc, obj, "a tensor name")
    data_start = 8 + n
    data_len = None if file_size is None else file_size - data_start
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad("__metadata__ must map strings to strings", obj, key="__metadata__", expected="{str: str}",
                   found=type(meta).__name__)
    if b"\\" in header:
        check_text([*meta, *meta.values()], obj, "a __metadata__ string")
    entries = [_entry(name, e, obj, data_start, data_len) for name, e in doc.items()]
    # The data section must be tiled exactly: sorted by (begin, end), each tensor starts where the
    # previous one ended (zero-length ones sit anywhere on that line), and the last ends the file.
    pos = data_start
    for t in sorted(entries, key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise _bad(f"data_offsets do not tile the data section: the tensor {what}", obj, key=t.name,
                       expected=f"begin {pos - data_start}", found=f"begin {t.begin - data_start}")
        pos = t.end
    if file_size is not None and pos != file_size:
        raise _bad("the data section is not exactly covered by the tensors", obj,
                   expected=f"{pos} bytes in the file", found=f"{file_size} bytes")
    return StHeader({t.name: t for t in entries}, dict(meta), data_start, pos)


def parse_index(data: bytes, obj: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight_map, metadata) of an index file's bytes, checked within the manifest's caps
    (FORMAT.md 5.10): its JSON values counted before decoding, its nesting after, its tensors before
    any file is opened; names UTF-8 encodable; files plain names of the index's directory. Pure.
    Raises InvalidSourceError naming the index (and the tensor, where one is at fault)."""
    check_json_caps(data, INDEX_STRUCTURAL, obj, "safetensors index")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=strict_pairs, parse_constant=reject_constant)
        if isinstance(doc, (dict, list)):
            check_nesting(doc, 1, "safetensors index")
    except (ValueError, RecursionError) as e:
        raise InvalidSourceError("safetensors index is not strict JSON", object=obj,
                                 expected="a JSON object with unique names", found=f"{type(e).__name__}: {str(e)[:200]}") from None
    except InvalidManifestError as e:
        raise InvalidSourceError("safetensors index nests arrays and objects too deeply", object=obj,
                                 expected=f"<= {MAX_NESTING} levels", found=e.found) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in wm.items()):
        raise InvalidSourceError("safetensors index has no weight_map of names to files", object=obj,
                                 expected="{'weight_map': {name: file}}", found=type(wm).__name__)
    if len(wm) > MAX_TENSORS:
        raise InvalidSourceError("safetensors index names too many tensors", object=obj,
                                 expected=f"<= {MAX_TENSORS} tensors", found=len(wm))
    if b"\\" in data:
        check_text([*wm, *wm.values()], obj, "a name in the index")
    for k, v in wm.items():
        if not _FILE_NAME.fullmatch(v) or v in (".", ".."):
            raise InvalidSourceError("the index names a file outside its directory", key=k, object=obj,
                                     expected="a plain file name", found=v[:200])
    meta = doc.get("metadata")
    return wm, meta if isinstance(meta, dict) else {}


def table_crc(entries: Sequence[StEntry], data_start: int) -> str:
    """crc32c (8 hex digits) of the canonical tensor table: ``[name, st dtype, shape, begin, end]``
    per tensor, sorted by name, as compact JSON (offsets relative to the data section)."""
    rows = [[t.name, FORMAT_DTYPES[t.dtype], list(t.shape), t.begin - data_start, t.end - data_start]
            for t in sorted(entries, key=lambda t: t.name)]
    return f"{crc32c(json.dumps(rows, separators=(',', ':')).encode()):08x}"


def encode_header(tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str]) -> tuple[bytes, list[StEntry]]:
    """The full header (8-byte length + JSON, padded with spaces to a multiple of 8 as the reference
    writer does) for tensors laid out back to back in the given order: (name, format dtype, shape).

    Returns the bytes and the entries with absolute offsets. Raises ValueError for a dtype that
    safetensors cannot hold (complex128) or a repeated name.
    """
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    rel: list[tuple[str, str, tuple[int, ...], int, int]] = []
    pos = 0
    for name, dtype, shape in tensors:
        if dtype not in FORMAT_DTYPES:
            raise ValueError(f"{name!r}: dtype {dtype} has no safetensors dtype (supported: {sorted(FORMAT_DTYPES)})")
        if name in doc or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is repeated or reserved")
        n = math.prod(int(d) for d in shape) * DTYPES[dtype]
        doc[name] = {"dtype": FORMAT_DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [pos, pos + n]}
        rel.append((name, dtype, tuple(int(d) for d in shape), pos, pos + n))
        pos += n
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    start = 8 + len(body)
    entries = [StEntry(name, dt, shape, start + b, start + e) for name, dt, shape, b, e in rel]
    return len(body).to_bytes(8, "little") + body, entries


def bool_bytes_valid(raw: np.ndarray) -> bool:
    """True when every byte of a bool tensor is 0x00 or 0x01 (the format stores no other)."""
    return not bool((raw.view(np.uint8) > 1).any())
