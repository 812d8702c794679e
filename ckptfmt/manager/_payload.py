"""The peer replica's payload (FORMAT.md 8.5, 14.8): a host's boxes as one byte buffer.

Layout (little-endian; it never leaves one run of one ckptfmt version, and is not stored)::

    b"ckptbox1"  header length (u64)  header (msgpack)  padding  box data, each 64-byte aligned

The header lists, per box: key path, global shape, dtype name, offset, shape, the data's start in
the payload and its byte count. :func:`pack_payload` copies each box into one preallocated buffer
with ``numpy.copyto``, which releases the GIL, so a local save's background thread does not hold
the interpreter for the copy while the training loop runs (the earlier msgpack payload copied
every box twice under the GIL, ``tobytes`` and ``packb``). :func:`unpack_payload` returns views
into the payload, no copy. A received payload is untrusted until its crc32c matched
(:func:`check_payload`), and :func:`unpack_payload` checks every header field against the buffer
before it makes a view.
"""
from __future__ import annotations

import math
from operator import add, le
from typing import Any, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import DTYPES, dtype_name, numpy_dtype
from ckptfmt.errors import CheckpointError, ChecksumMismatchError, InvalidDataError, InvalidStateError
from ckptfmt.layout import MAX_DIM, MAX_NDIM

__all__ = ["pack_payload", "unpack_payload", "check_payload", "as_bytes_view"]

_MAGIC = b"ckptbox1"
_ALIGN = 64
# Boxes in one payload: a host's first replicas (a few per tensor), each a tensor of the local
# step beside the host's own. Every box costs about 600 bytes of Python objects to decode, so the
# box count, checked before any box is decoded, is what bounds a hostile header's cost.
_MAX_BOXES = 1 << 18
# The fewest header bytes one box record takes: fixarray 1, a one-character key 2, three empty
# lists 3, "bool" 5, start and nbytes 1 each. The header cap allows 256 bytes per box on average.
_MIN_ENTRY = 13
_MAX_HEADER = _MAX_BOXES * 256
_MAX_KEY_BYTES = 1 << 16  # a key path's UTF-8 bytes (the manifest allows 4096 characters)

BoxTuple = tuple[str, tuple[int, ...], Any, Box, np.ndarray]


def as_bytes_view(payload: Any) -> np.ndarray:
    """A payload (bytes, bytearray, memoryview or a uint8 array) as a flat uint8 array, no copy."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack_payload(boxes: Sequence[BoxTuple]) -> np.ndarray:
    """A host's boxes as one exchange payload (a uint8 array; see the module docstring)."""
    metas, arrays, pos = [], [], 0
    for k, shape, dt, b, a in boxes:
        arr = np.asarray(a)
        metas.append([k, [int(x) for x in shape], dtype_name(np.dtype(dt)), list(b.offset), list(b.shape), pos,
                      int(arr.nbytes)])
        arrays.append(arr)
        pos = _up(pos + int(arr.nbytes))
    head = msgpack.packb(metas, use_bin_type=True)
    base = _up(16 + len(head))
    out = np.empty(base + pos, dtype=np.uint8)
    out[:8] = np.frombuffer(_MAGIC, dtype=np.uint8)
    out[8:16] = np.frombuffer(len(head).to_bytes(8, "little"), dtype=np.uint8)
    out[16:16 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[16 + len(head):base] = 0
    for (_, _, _, _, _, start, n), arr in zip(metas, arrays):
        dst = out[base + start:base + start + n]
        np.copyto(dst.view(arr.dtype).reshape(arr.shape), arr)  # any layout; releases the GIL
        out[base + start + n:base + _up(start + n)] = 0  # the padding: the same boxes, the same bytes
    return out


def check_payload(got: Any, crc: int, what: str) -> Any:
    """``got`` when its crc32c is ``crc`` (the sender's, FORMAT.md 8.5); else ChecksumMismatchError
    naming ``what`` (the exchange and the sending rank). Every exchange checks here."""
    mine = crc32c(as_bytes_view(got))  # releases the GIL
    if mine != int(crc):
        raise ChecksumMismatchError("a peer's payload changed in transit", object=what,
                                    expected=f"crc32c {int(crc)}", found=f"crc32c {mine}")
    return got


def unpack_payload(payload: Any, what: str) -> list[BoxTuple]:
    """The boxes of a payload :func:`pack_payload` made, as views into it.

    A peer's payload is untrusted input: every header field is checked before a view is made
    (a known dtype name; a box of its tensor's rank inside the tensor; the byte count the box
    needs, 64-byte aligned, after the previous box's data and inside the payload; no key and box
    twice; one shape and dtype per key), and the header is decoded field by field with a cap on
    the box count checked before any box is decoded, so a hostile header costs at most about
    its own size. Raises InvalidStateError naming ``what`` (and the key and box, where one is
    named) for anything malformed, InvalidDataError for a bool byte other than 0 or 1.
    """
    buf = as_bytes_view(payload)
    try:
        return _unpack(buf, what)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input (msgpack's own errors, a truncated header)
        raise InvalidStateError(f"a peer payload does not decode: {type(e).__name__}: {e}", object=what,
                                expected="the boxes a peer packed", found=f"{buf.size} bytes") from None


class _HeaderFile:
    """A read-only file over the header's bytes: msgpack's Unpacker pulls small pieces from it
    instead of copying the whole header first."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else min(len(self.view), self.pos + n)
        out, self.pos = bytes(self.view[self.pos:end]), end
        return out


def _unpack(buf: np.ndarray, what: str) -> list[BoxTuple]:
    if buf.size < 16 or buf[:8].tobytes() != _MAGIC:
        raise ValueError("no payload header")
    n = int.from_bytes(buf[8:16].tobytes(), "little")
    if n > min(_MAX_HEADER, buf.size - 16):
        raise ValueError(f"header of {n} bytes in a payload of {buf.size} (at most {_MAX_HEADER})")
    base = _up(16 + n)
    room = buf.size - base  # the data region's bytes
    # Arrays and maps are only read through read_array_header (whose lengths are checked here), so
    # unpack() returns scalars: nothing in a field can build a large object.
    u = msgpack.Unpacker(_HeaderFile(memoryview(buf[16:16 + n])), raw=False, read_size=1 << 16, max_array_len=0,
                         max_map_len=0, max_bin_len=0, max_ext_len=0, max_str_len=_MAX_KEY_BYTES)
    count = u.read_array_header()
    if count > _MAX_BOXES or count > n // _MIN_ENTRY:
        raise InvalidStateError("a peer payload lists too many boxes", object=what,
                                expected=f"at most {_MAX_BOXES} boxes of at least {_MIN_ENTRY} header bytes each",
                                found=f"{count} boxes in a header of {n} bytes")
    out: list[BoxTuple] = []
    seen: set[tuple[str, Box]] = set()
    tensors: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    dtypes: dict[str, np.dtype] = {}
    end = 0  # where the previous box's data ended
    for i in range(count):
        if u.read_array_header() != 7:
            raise InvalidStateError("a peer payload's box record is malformed", object=what,
                                    expected="7 fields", found=f"box record {i}")
        k = u.unpack()
        key = k if isinstance(k, str) else None
        shape, dt = _ints(u, what, i, key), u.unpack()
        off, bshape, start, nbytes = _ints(u, what, i, key), _ints(u, what, i, key), u.unpack(), u.unpack()
        if not isinstance(k, str) or not k or not isinstance(dt, str) or dt not in DTYPES \
                or type(start) is not int or type(nbytes) is not int:
            raise InvalidStateError("a peer payload's box record is malformed", key=key,
                                    object=what, expected="a key path, a dtype name of the format and integers",
                                    found=f"box record {i}: key {k!r:.80}, dtype {dt!r:.40}, start {start!r:.40}, "
                                          f"nbytes {nbytes!r:.40}")
        nd = len(shape)
        if len(off) != nd or len(bshape) != nd or not all(map(le, map(add, off, bshape), shape)):
            raise InvalidStateError("a peer payload's box lies outside its tensor", key=k, object=what,
                                    expected=f"a box of {nd} dimensions inside {list(shape)}",
                                    found=f"offset {list(off)}, shape {list(bshape)}")
        box = Box(off, bshape)
        dtype = dtypes.get(dt) or dtypes.setdefault(dt, numpy_dtype(dt))
        if tensors.setdefault(k, (shape, dtype)) != (shape, dtype):
            raise InvalidStateError("a peer payload gives one tensor two shapes or dtypes", key=k, object=what,
                                    expected=f"{list(tensors[k][0])} {dtype_name(tensors[k][1])}",
                                    found=f"{list(shape)} {dt} for box at {list(off)}")
        if (k, box) in seen:
            raise InvalidStateError("a peer payload holds one box twice", key=k, object=what,
                                    expected="each box once", found=str(box))
        seen.add((k, box))
        want = math.prod(bshape) * dtype.itemsize
        # pack_payload lays the boxes out in order, each 64-byte aligned: no two share a byte.
        if nbytes != want or start % _ALIGN or not end <= start <= room - want:
            raise InvalidStateError("a peer payload's box data is out of place", key=k, object=what,
                                    expected=f"{want} bytes at a 64-byte aligned offset in [{end}, {room - want}]",
                                    found=f"{nbytes} bytes at {start} for box {box}")
        end = start + want
        data = buf[base + start:base + end]
        if dtype == np.bool_ and data.size and int(data.max()) > 1:
            raise InvalidDataError("a peer payload's bool box holds a byte other than 0 or 1", key=k, object=what,
                                   expected="0x00 or 0x01", found=f"0x{int(data.max()):02x} in box {box}")
        out.append((k, shape, dtype, box, data.view(dtype).reshape(box.shape)))
    if u.tell() != n:
        raise InvalidStateError("a peer payload's header has bytes after its last box", object=what,
                                expected=f"{n} header bytes", found=f"{count} boxes in {u.tell()} bytes")
    return out


def _ints(u: msgpack.Unpacker, what: str, i: int, key: str | None) -> tuple[int, ...]:
    """One header field of box record ``i``: a list of at most MAX_NDIM integers in [0, 2^62]."""
    m = u.read_array_header()
    if m > MAX_NDIM:
        raise InvalidStateError("a peer payload's box has too many dimensions", key=key, object=what,
                                expected=f"at most {MAX_NDIM}", found=f"{m} in box record {i}")
    vals = tuple([u.unpack() for _ in range(m)])
    if vals and (not all(type(v) is int for v in vals) or min(vals) < 0 or max(vals) > MAX_DIM):
        raise InvalidStateError("a peer payload's box has a negative or non-integer extent", key=key, object=what,
                                expected="integers in [0, 2^62]", found=f"{list(vals)!r:.200} in box record {i}")
    return vals
