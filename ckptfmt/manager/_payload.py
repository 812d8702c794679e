"""The peer replica's payload (FORMAT.md 8.5, 14.8): a host's boxes as one byte buffer.

Layout (little-endian; it never leaves one run of one ckptfmt version, and is not stored)::

    b"ckptbox1"  header length (u64)  header (msgpack)  padding  box data, each 64-byte aligned

The header lists, per box: key path, global shape, dtype name, offset, shape, the data's start in
the payload and its byte count. :func:`pack_boxes` copies each box into one preallocated buffer
with ``numpy.copyto``, which releases the GIL, so a local save's background thread does not hold
the interpreter for the copy while the training loop runs (the earlier msgpack payload copied
every box twice under the GIL, ``tobytes`` and ``packb``). :func:`unpack_boxes` returns views
into the payload, no copy. A received payload is untrusted until its crc32c matched
(:func:`check_payload`), and :func:`unpack_boxes` checks every header field against the buffer
before it makes a view.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.errors import CheckpointError, ChecksumMismatchError, InvalidStateError

__all__ = ["pack_boxes", "unpack_boxes", "check_payload", "as_bytes_view"]

_MAGIC = b"ckptbox1"
_ALIGN = 64
_MAX_HEADER = 64 << 20  # 64 MiB of header: about a million boxes

BoxTuple = tuple[str, tuple[int, ...], Any, Box, np.ndarray]


def as_bytes_view(payload: Any) -> np.ndarray:
    """A payload (bytes, bytearray, memoryview or a uint8 array) as a flat uint8 array, no copy."""
    if isinstance(payload, np.ndarray):
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack_boxes(boxes: Sequence[BoxTuple]) -> np.ndarray:
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


def unpack_boxes(payload: Any, what: str) -> list[BoxTuple]:
    """The boxes of a payload :func:`pack_boxes` made, as views into it; InvalidStateError naming
    ``what`` for anything malformed (a peer's payload is untrusted input)."""
    buf = as_bytes_view(payload)
    try:
        return _unpack(buf)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input
        raise InvalidStateError(f"a peer payload does not decode: {type(e).__name__}: {e}", object=what,
                                expected="the boxes a peer packed", found=f"{buf.size} bytes") from None


def _unpack(buf: np.ndarray) -> list[BoxTuple]:
    if buf.size < 16 or buf[:8].tobytes() != _MAGIC:
        raise ValueError("no payload header")
    n = int.from_bytes(buf[8:16].tobytes(), "little")
    if n > min(_MAX_HEADER, buf.size - 16):
        raise ValueError(f"header of {n} bytes in a payload of {buf.size}")
    base = _up(16 + n)
    metas = msgpack.unpackb(buf[16:16 + n].tobytes(), raw=False)
    out: list[BoxTuple] = []
    for k, shape, dt, off, bshape, start, nbytes in metas:
        dtype = numpy_dtype(dt)
        box = Box(tuple(off), tuple(bshape))
        want = math.prod(box.shape) * dtype.itemsize
        if not isinstance(k, str) or int(nbytes) != want or not 0 <= int(start) <= buf.size - base - want:
            raise ValueError(f"box {k!r}: {nbytes} bytes at {start}, want {want} within {buf.size - base}")
        data = buf[base + int(start):base + int(start) + want].view(dtype).reshape(box.shape)
        out.append((k, tuple(int(x) for x in shape), dtype, box, data))
    return out
