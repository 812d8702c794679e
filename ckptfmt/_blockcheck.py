"""Checks of the bytes read from a shard object against its manifest (FORMAT.md 6.4, 9 step 6).

:class:`BlockChecks` is mixed into :class:`ckptfmt.reader.Checkpoint`; every read path (positional,
kvstore, verify) calls these, through the instance, before it hands anything back.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .checksum import crc32c
from .dtypes import numpy_dtype
from .errors import ChecksumMismatchError, InvalidDataError, SizeMismatchError
from .layout import CRC_BYTES, INDEX_ENTRY, NOT_STORED, index_entries, split_trailer
from .manifest import TensorEntry

__all__ = ["BlockChecks"]

_NOT_STORED = np.uint64(NOT_STORED)


class BlockChecks:
    """Shard, index, entry and chunk checks; each raises a CheckpointError naming the tensor and object."""

    def _check_whole(self, t: TensorEntry, s: int, obj: str, buf: bytes, chunks: Sequence[int]) -> dict[int, memoryview]:
        """Check a whole shard object (exact size, index, the given chunks) against the manifest;
        returns a view of each checked chunk's stored bytes."""
        nbytes = int(t.shards.nbytes[s])
        if len(buf) != nbytes:
            raise SizeMismatchError("shard object size differs from the manifest", key=t.key, object=obj,
                                    expected=nbytes, found=len(buf))
        mv = memoryview(buf)
        self._check_index(t, s, obj, mv[nbytes - t.geometry.index_nbytes:])
        out = {}
        for c in chunks:
            o, n = int(t.chunks.offset[c]), int(t.chunks.nbytes[c])
            out[c] = mv[o:o + n]
            self._check_chunk(t, c, obj, out[c])
        return out

    @classmethod
    def _check_index(cls, t: TensorEntry, s: int, obj: str, index: memoryview) -> None:
        """The index's crc32c, recomputed and as stored, against the manifest; then its entries."""
        want = int(t.shards.index_crc32c[s])
        body, stored = split_trailer(index)
        got = crc32c(body)
        if got != want or stored != want:
            raise ChecksumMismatchError("shard index checksum differs from the manifest (corrupt or stale)",
                                        key=t.key, object=obj, expected=want, found=got if got != want else stored)
        cls._check_entries(t, s, obj, index)

    @staticmethod
    def _check_entries(t: TensorEntry, s: int, obj: str, index: memoryview) -> None:
        """Every index entry equals the manifest (FORMAT.md 6.4): a stored chunk's entry its chunk-table
        row, every other entry the not-stored marker. The crc32c values alone do not show that the
        chunk table describes this index."""
        g = t.geometry
        c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
        if c1 - c0 == math.prod(g.inner):  # every inner chunk stored: the entries are the rows, in order
            rows = np.empty((c1 - c0, 2), INDEX_ENTRY)
            rows[:, 0], rows[:, 1] = t.chunks.offset[c0:c1], t.chunks.nbytes[c0:c1]
            if index[:-CRC_BYTES] == rows.tobytes():
                return
        off = t.shards.offset[s]
        counts = tuple(-(-min(ss, n - int(o)) // c) for ss, n, o, c in zip(g.shard_shape, g.shape, off, g.chunk_shape))
        want = np.full(g.inner + (2,), _NOT_STORED, np.uint64)
        want[tuple(slice(0, k) for k in counts)] = np.stack(
            [t.chunks.offset[c0:c1], t.chunks.nbytes[c0:c1]], axis=-1).reshape(counts + (2,))
        got = index_entries(index[:-CRC_BYTES]).reshape(want.shape)
        if not np.array_equal(got, want):
            flat = int(np.flatnonzero(np.any((got != want).reshape(-1, 2), axis=1))[0])
            cell = tuple(int(i) for i in np.unravel_index(flat, g.inner)) if g.inner else ()
            raise ChecksumMismatchError("shard index entry differs from the manifest's chunk table", key=t.key,
                                        object=f"{obj} index entry {cell}",
                                        expected=[int(x) for x in want.reshape(-1, 2)[flat]],
                                        found=[int(x) for x in got.reshape(-1, 2)[flat]])

    @staticmethod
    def _check_chunk(t: TensorEntry, c: int, obj: str, mv: Any, trailer: Any = None) -> None:
        """Check one stored chunk against the manifest: its length, and the crc32c of its data both
        as recomputed and as stored in its trailer. ``trailer`` given: ``mv`` is the data alone."""
        want = int(t.chunks.crc32c[c])
        data, tail = (mv[:-CRC_BYTES], mv[-CRC_BYTES:]) if trailer is None else (mv, trailer)
        if len(memoryview(data).cast("B")) + len(tail) != int(t.chunks.nbytes[c]):
            raise SizeMismatchError("chunk byte range is short", key=t.key, object=obj,
                                    expected=int(t.chunks.nbytes[c]), found=len(memoryview(data).cast("B")) + len(tail))
        got = crc32c(data)
        stored = int.from_bytes(bytes(tail), "little")
        if got != want or stored != want:
            raise ChecksumMismatchError("chunk checksum differs from the manifest (corrupt or stale data)",
                                        key=t.key, object=f"{obj} bytes [{int(t.chunks.offset[c])}, +{int(t.chunks.nbytes[c])})",
                                        expected=want, found=got if got != want else stored)
        if t.dtype == "bool" and t.array.codec == "raw":  # an encoded chunk is checked once decoded
            _check_bool(t, c, obj, data)

    def _decode(self, t: TensorEntry, c: int, obj: str, mv: Any) -> np.ndarray:
        """The elements of chunk row ``c`` (shape ``chunk_shape``) from its stored bytes, trailer
        included, which :meth:`_check_chunk` has already checked. Raw chunks are viewed in place;
        encoded ones are decoded (FORMAT.md 6.3), InvalidDataError when they do not decode."""
        g = t.geometry
        if t.array.codec == "raw":
            return np.frombuffer(mv[:-CRC_BYTES], dtype=numpy_dtype(t.dtype)).reshape(g.chunk_shape)
        out = self._decoder(t).decode(mv[:-CRC_BYTES], key=t.key, obj=obj)
        if t.dtype == "bool":
            _check_bool(t, c, obj, out.view(np.uint8), decoded=True)
        return out

    def _decoder(self, t: TensorEntry) -> Any:
        from ._codec import decoder_for

        return decoder_for(self.__dict__.setdefault("_decoders", {}), t.dtype, t.geometry.chunk_shape)


def _check_bool(t: TensorEntry, c: int, obj: str, data: Any, decoded: bool = False) -> None:
    """FORMAT.md 5.6: a bool byte is 0x00 or 0x01 only; numpy would hand any other byte on as True."""
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if raw.size and raw.max() > 1:
        at = int(np.argmax(raw > 1))
        where = f"{obj} chunk row {c}, decoded byte {at}" if decoded else f"{obj} byte {int(t.chunks.offset[c]) + at}"
        raise InvalidDataError("bool tensor holds a byte other than 0x00 and 0x01", key=t.key, object=where,
                               expected="0x00 or 0x01", found=f"0x{int(raw[at]):02x}")
