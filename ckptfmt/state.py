"""Non-tensor training state (step counters, RNG state, data-loader position) as msgpack.

Never pickle: a checkpoint is untrusted input, and decoding it must not be able to run code.
The encoding is plain msgpack (``use_bin_type=True``) plus three extension types:

====  ==============  ==========================================================================
ext   name            payload
====  ==============  ==========================================================================
1     big int         two's-complement, big-endian, minimal length; only for ints outside int64
2     ndarray         msgpack ``[dtype name, shape (list of int), raw little-endian C-order bytes]``
3     numpy scalar    same payload as 2, with shape ``[]``
====  ==============  ==========================================================================

Allowed values: ``None``, ``bool``, ``int`` (any size), ``float``, ``str``, ``bytes``, ``list``,
``tuple``, ``dict`` with ``str`` keys, numpy arrays and numpy scalars of a numeric dtype
(``bool``, signed/unsigned ints, floats, complex, and the ml_dtypes types such as ``bfloat16``
and ``float8_e4m3fn``). Tuples come back as lists and dict subclasses as plain dicts, so
``random.getstate()`` round-trips as nested lists (``random.setstate`` needs it converted
back to tuples). Every failure raises :class:`InvalidStateError` naming the key path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from ckptfmt.dtypes import STATE_DTYPES
from ckptfmt.errors import InvalidStateError, ReferenceCycleError

__all__ = ["encode_state", "decode_state", "MAX_DEPTH", "MAX_ELEMENTS", "ALLOWED_DTYPES"]

EXT_BIGINT = 1
EXT_NDARRAY = 2
EXT_NPSCALAR = 3

#: Containers deeper than this are rejected on both encode and decode.
MAX_DEPTH = 64
#: At most this many array dimensions (numpy's own limit is 64).
MAX_NDIM = 32
#: At most this many msgpack elements in one state object (FORMAT.md 7.1): the root, every array
#: item, every map key and value, an ext once. Decoded, each costs up to ~75 bytes.
MAX_ELEMENTS = 1 << 22

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

#: dtype name (as written in the encoding) -> numpy dtype (native byte order).
ALLOWED_DTYPES: dict[str, np.dtype] = STATE_DTYPES


def _path_str(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "<root>"


def _fail(path: tuple[str, ...], message: str, *, found: Any = None) -> InvalidStateError:
    where = _path_str(path)
    return InvalidStateError(f"state at {where!r}: {message}", key=where, found=found)


# ----------------------------------------------------------------------------------- encode


def _int_to_ext(value: int) -> msgpack.ExtType:
    length = (value + (value < 0)).bit_length() // 8 + 1
    return msgpack.ExtType(EXT_BIGINT, value.to_bytes(length, "big", signed=True))


def _array_to_ext(array: np.ndarray, code: int, path: tuple[str, ...]) -> msgpack.ExtType:
    name = array.dtype.name
    if ALLOWED_DTYPES.get(name) != array.dtype.newbyteorder("="):
        raise _fail(path, f"numpy dtype {array.dtype!s} is not allowed", found=str(array.dtype))
    if array.ndim > MAX_NDIM:
        raise _fail(path, f"array has {array.ndim} dimensions, more than {MAX_NDIM}")
    if array.dtype.kind == "b":  # stored as 0x00/0x01 only; a reinterpreted byte may hold more
        array = np.not_equal(np.asarray(array, order="C").view(np.uint8), 0).reshape(array.shape)
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    payload = msgpack.packb([name, list(array.shape), little.tobytes()], use_bin_type=True)
    return msgpack.ExtType(code, payload)


def _to_packable(obj: Any, path: tuple[str, ...], depth: int, within: set[int]) -> Any:
    """Return a fresh msgpack-ready copy of ``obj``; the input is never modified. ``within``: the
    ids of the containers on the path to ``obj`` (one of them again is a reference cycle)."""
    if obj is None:
        return None
    if type(obj) in (np.ndarray, np.memmap):  # not subclasses: a masked array would lose its mask
        return _array_to_ext(obj, EXT_NDARRAY, path)
    if isinstance(obj, np.generic) and not isinstance(obj, (str, bytes)):
        return _array_to_ext(np.asarray(obj), EXT_NPSCALAR, path)
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        value = int(obj)
        return value if _INT64_MIN <= value <= _INT64_MAX else _int_to_ext(value)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str.__str__(obj)
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    if not isinstance(obj, (list, tuple, Mapping)):
        raise _fail(path, f"type {type(obj).__module__}.{type(obj).__qualname__} is not allowed",
                    found=type(obj).__qualname__)
    if id(obj) in within:
        where = _path_str(path)
        raise ReferenceCycleError(f"state at {where!r} contains itself (a reference cycle closes here)",
                                  key=where, expected="a tree of values", found=f"a {type(obj).__name__} seen above")
    if depth >= MAX_DEPTH:
        raise _fail(path, f"nesting deeper than {MAX_DEPTH} levels")
    within.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items = [_to_packable(item, path + (str(i),), depth + 1, within) for i, item in enumerate(obj)]
        within.discard(id(obj))
        return items
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise _fail(path, f"dict key {key!r} has type {type(key).__name__}, expected str",
                        found=type(key).__name__)
        out[str(key)] = _to_packable(value, path + (key,), depth + 1, within)
    within.discard(id(obj))
    return out


def encode_state(obj: object, *, max_bytes: int = 64 << 20, max_elements: int = MAX_ELEMENTS) -> bytes:
    """Encode ``obj`` as msgpack bytes.

    Raises :class:`InvalidStateError` naming the key path of the first value whose type is not
    allowed (:class:`ReferenceCycleError` where a container contains itself), or if the encoding
    would be larger than ``max_bytes`` or hold more than
    ``max_elements`` msgpack elements (so that a save never writes state that :func:`decode_state`
    would refuse with its default limits). ``obj`` is not modified.
    """
    data = msgpack.packb(_to_packable(obj, (), 0, set()), use_bin_type=True)
    if len(data) > max_bytes:
        raise InvalidStateError(f"encoded state is {len(data)} bytes, more than max_bytes={max_bytes}",
                                expected=max_bytes, found=len(data))
    _check_elements(data, max_elements)  # the reader's own count: never write state it would refuse
    return data


# ----------------------------------------------------------------------------------- decode


# Bytes a msgpack element's header takes beyond its first byte, and whether a length follows
# (str, bin, ext: that many payload bytes; array, map: that many elements, or pairs).
_HEAD: dict[int, tuple[int, str]] = {
    0xC4: (1, "bytes"), 0xC5: (2, "bytes"), 0xC6: (4, "bytes"), 0xD9: (1, "bytes"), 0xDA: (2, "bytes"),
    0xDB: (4, "bytes"), 0xC7: (1, "ext"), 0xC8: (2, "ext"), 0xC9: (4, "ext"), 0xDC: (2, "array"),
    0xDD: (4, "array"), 0xDE: (2, "map"), 0xDF: (4, "map"),
}
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}


def _count_elements(data: bytes, limit: int) -> int:
    """The number of msgpack elements of ``data``'s first document, counted from headers alone
    (nothing is built), stopping as soon as more than ``limit`` are certain. Malformed input ends
    the count early; the decoder then says what is wrong with it."""
    n, pos, count, pending = len(data), 0, 0, 1
    while pending and pos < n:
        b = data[pos]
        pending -= 1
        count += 1
        pos += 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            continue
        if b <= 0x8F:  # fixmap
            pending += 2 * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            pending += b & 0x0F
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _HEAD:
            width, kind = _HEAD[b]
            length = int.from_bytes(data[pos:pos + width], "big")
            pos += width
            if kind == "bytes":
                pos += length
            elif kind == "ext":
                pos += 1 + length
            else:
                pending += length if kind == "array" else 2 * length
        else:  # 0xc1: never used
            break
        if count + pending > limit:  # every pending element takes at least one more byte
            return count + pending
    return count


def _check_elements(data: bytes, limit: int) -> None:
    if len(data) > limit:  # every element takes at least one byte: a shorter state cannot exceed it
        count = _count_elements(data, limit)
        if count > limit:
            raise InvalidStateError(f"state holds more than {limit} msgpack elements (store long runs of numbers "
                                    "as one numpy array, which is one element)", expected=f"<= {limit}",
                                    found=f"at least {count}")


def _unpack(data: bytes, ext_hook: Any, *, max_array_len: int = MAX_ELEMENTS, max_map_len: int = MAX_ELEMENTS // 2) -> Any:
    # unpackb has no max_buffer_size: the caller has already capped len(data). Each limit below
    # is what the input can hold at most, so a declared length larger than the input fails fast
    # (msgpack allocates a declared array before reading its items).
    n = len(data)
    return msgpack.unpackb(
        data, raw=False, use_list=True, strict_map_key=True, ext_hook=ext_hook, object_pairs_hook=_no_duplicates,
        max_str_len=n, max_bin_len=n, max_ext_len=n, max_array_len=min(n, max_array_len),
        max_map_len=min(n // 2, max_map_len),
    )


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):  # FORMAT.md 7.1: a map holds each key once
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"map holds the key {str(dup)[:80]!r} twice")
    return d


def _reject_inner_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code} is not allowed inside an array payload")


def _decode_array(payload: bytes, want_scalar: bool) -> Any:
    fields = _unpack(payload, _reject_inner_ext, max_array_len=MAX_NDIM, max_map_len=0)  # [name, shape, data]
    if not (isinstance(fields, list) and len(fields) == 3):
        raise ValueError("array payload must be [dtype, shape, data]")
    name, shape, raw = fields
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise ValueError(f"array dtype {name!r} is not allowed")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValueError(f"array shape must be a list of at most {MAX_NDIM} ints")
    if not all(type(d) is int and 0 <= d <= _INT64_MAX for d in shape):
        raise ValueError(f"array shape {shape!r} must hold non-negative int64 values")
    if want_scalar and shape:
        raise ValueError(f"numpy scalar must have shape [], found {shape!r}")
    if not isinstance(raw, bytes):
        raise ValueError("array data must be bytes")
    dtype = ALLOWED_DTYPES[name]
    # Python ints do not overflow; still refuse shapes numpy cannot index (e.g. [0, 2**62, 2**62]).
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > _INT64_MAX:
        raise ValueError(f"array shape {shape!r} is too large")
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw):
        raise ValueError(f"array of shape {shape} and dtype {name} needs {count * dtype.itemsize} "
                         f"bytes, found {len(raw)}")
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype)
    if dtype.kind == "b" and np.any(np.frombuffer(raw, dtype=np.uint8) > 1):
        raise ValueError("bool array holds bytes other than 0 and 1")
    return array[()] if want_scalar else array


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_BIGINT:
        if not data:
            raise ValueError("empty big-int extension")
        value = int.from_bytes(data, "big", signed=True)
        # One encoding per value (FORMAT.md 7.2): minimal length, and only outside int64.
        if len(data) != (value + (value < 0)).bit_length() // 8 + 1:
            raise ValueError(f"big-int extension of {len(data)} bytes is not minimal")
        if _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError("big-int extension holds a value that fits in int64")
        return value
    if code in (EXT_NDARRAY, EXT_NPSCALAR):
        return _decode_array(data, want_scalar=code == EXT_NPSCALAR)
    raise ValueError(f"unknown msgpack extension type {code}")


#: What a decoded tree may hold (anything else came from a msgpack type the format does not allow:
#: ext type -1 becomes a msgpack.Timestamp without asking the ext hook).
_DECODED = (type(None), bool, int, float, str, bytes, list, dict, np.ndarray, np.generic)


def _check_tree(obj: Any, path: tuple[str, ...], depth: int) -> None:
    """Enforce the allowed types, the depth cap and str-only keys on a freshly decoded tree."""
    if not isinstance(obj, _DECODED):
        what = "ext type -1 (msgpack timestamp)" if isinstance(obj, msgpack.Timestamp) else type(obj).__name__
        raise _fail(path, f"{what} is not allowed", found=type(obj).__name__)
    if isinstance(obj, (list, dict)) and depth >= MAX_DEPTH:
        raise _fail(path, f"nesting deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            _check_tree(item, path + (str(i),), depth + 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise _fail(path, f"dict key has type {type(key).__name__}, expected str",
                            found=type(key).__name__)
            _check_tree(value, path + (key,), depth + 1)


def decode_state(data: bytes, *, max_bytes: int = 64 << 20, max_elements: int = MAX_ELEMENTS) -> object:
    """Decode bytes written by :func:`encode_state`.

    Raises :class:`InvalidStateError`, and nothing else, for any input that is not a valid
    encoding: oversized input, more than ``max_elements`` elements (counted before decoding),
    malformed msgpack, trailing bytes, non-str or repeated keys,
    nesting deeper than :data:`MAX_DEPTH`, unknown extension types (the msgpack timestamp, ext -1,
    included), a big int that is not minimal or fits in int64, or arrays whose dtype is not
    allowed, whose byte length does not match their shape, or whose bools are not 0 or 1.
    Nothing in the input is ever executed.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidStateError(f"state must be bytes, found {type(data).__name__}",
                                found=type(data).__name__)
    if len(data) > max_bytes:
        raise InvalidStateError(f"state is {len(data)} bytes, more than max_bytes={max_bytes}",
                                expected=max_bytes, found=len(data))
    data = bytes(data)
    _check_elements(data, max_elements)  # before anything is decoded
    try:
        obj = _unpack(data, _ext_hook, max_array_len=max_elements, max_map_len=max_elements // 2)
    except InvalidStateError:
        raise
    except Exception as exc:  # msgpack errors, ValueError, RecursionError, MemoryError, ...
        raise InvalidStateError(f"state is not valid: {type(exc).__name__}: {exc}",
                                found=type(exc).__name__) from exc
    _check_tree(obj, (), 0)
    return obj
