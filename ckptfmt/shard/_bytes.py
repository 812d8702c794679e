"""Where each byte of a shard lies in its object (FORMAT.md 6.3-6.4): the one place outside the
format's definitions (``ckptfmt.layout``) that computes a shard's byte positions.

A shard's bytes start at :attr:`ShardBytes.start` of its object (0 for a shard object of its
own; the manifest's ``shards.start`` in a pack object, FORMAT.md 5.15) and run for the manifest's ``shards.nbytes``: its stored inner chunks, each its data then
its 4-byte crc32c trailer, at the offsets the chunk table gives (relative to the shard's start);
then its index (one entry per inner chunk) and the index's own trailer, which end the shard.
Every range here is a half-open ``(start, stop)`` of object offsets, what a storage read takes.

Pure arithmetic on the manifest's columns: no I/O, and nothing here checks them (the manifest
parser has: every chunk lies inside its shard's data section, FORMAT.md 5.11). The readers build
one :class:`ShardBytes` per shard they read; the chunk columns are the manifest's own arrays, not
copies, and :meth:`ShardBytes.chunks` gives a run of rows as arrays, so that no Python object is
made per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfmt.layout import CRC_BYTES
from ckptfmt.plan import TensorGeometry

__all__ = ["TRAILER_BYTES", "ShardBytes", "shard_bytes", "raw_shard_nbytes", "data_and_trailer", "chunk_data"]

#: Bytes of the crc32c trailer after every stored chunk and after the index: what a buffer that
#: receives a trailer alone holds.
TRAILER_BYTES = CRC_BYTES


@dataclass(frozen=True)
class ShardBytes:
    """The byte ranges of one shard: its whole extent, its index, and each stored chunk by its
    global row of the tensor's chunk table. Build it with :func:`shard_bytes`."""

    start: int                     # object offset of the shard's first byte
    nbytes: int                    # the shard's length (manifest shards.nbytes)
    index_len: int                 # the index's length, entries and trailer (FORMAT.md 6.4)
    chunk_offset: np.ndarray = field(repr=False, compare=False)  # the tensor's chunks.offset (shard-relative)
    chunk_nbytes: np.ndarray = field(repr=False, compare=False)  # the tensor's chunks.nbytes (trailer included)

    @property
    def stop(self) -> int:
        """Object offset just past the shard's last byte (its index's trailer)."""
        return self.start + self.nbytes

    @property
    def whole(self) -> tuple[int, int]:
        """The shard's bytes: what one read of the whole shard takes."""
        return self.start, self.start + self.nbytes

    @property
    def index(self) -> tuple[int, int]:
        """The index, its trailer included: the shard's last ``index_len`` bytes."""
        stop = self.start + self.nbytes
        return stop - self.index_len, stop

    @property
    def index_trailer(self) -> tuple[int, int]:
        """The index's crc32c trailer."""
        stop = self.start + self.nbytes
        return stop - CRC_BYTES, stop

    def chunk(self, c: int) -> tuple[int, int]:
        """Chunk row ``c`` as stored: its data and its trailer."""
        lo = self.start + int(self.chunk_offset[c])
        return lo, lo + int(self.chunk_nbytes[c])

    def chunk_bounds(self, c: int) -> tuple[int, int, int]:
        """Chunk row ``c`` as (start, where its trailer starts, stop): its data is the first
        range, its trailer the second."""
        lo = self.start + int(self.chunk_offset[c])
        hi = lo + int(self.chunk_nbytes[c])
        return lo, hi - CRC_BYTES, hi

    def data(self, c: int) -> tuple[int, int]:
        """Chunk row ``c``'s data, without its trailer."""
        lo, mid, _ = self.chunk_bounds(c)
        return lo, mid

    def trailer(self, c: int) -> tuple[int, int]:
        """Chunk row ``c``'s crc32c trailer."""
        _, mid, hi = self.chunk_bounds(c)
        return mid, hi

    def chunks(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """(starts, stops) of the stored chunk rows ``rows`` (a slice or an index array), data and
        trailer included, as int64 arrays."""
        lo = self.chunk_offset[rows] + np.int64(self.start)
        return lo, lo + self.chunk_nbytes[rows]

    def local(self, r: tuple[int, int]) -> slice:
        """Range ``r`` as a slice of a buffer that holds the shard's bytes (its :attr:`whole`)."""
        return slice(r[0] - self.start, r[1] - self.start)


def shard_bytes(t: Any, s: int) -> ShardBytes:
    """The byte ranges of shard row ``s`` of tensor entry ``t`` (a :class:`ckptfmt.manifest.TensorEntry`)."""
    return ShardBytes(t.shard_start(s), int(t.shards.nbytes[s]), t.geometry.index_nbytes, t.chunks.offset, t.chunks.nbytes)


def raw_shard_nbytes(g: TensorGeometry, nchunks: Any) -> Any:
    """The length of a shard of ``nchunks`` raw chunks back to back from its start, its index
    after them (the layout :func:`ckptfmt.shard.encode` writes); ``nchunks`` an int or an array."""
    return nchunks * g.chunk_nbytes + g.index_nbytes


def data_and_trailer(mv: Any) -> tuple[Any, Any]:
    """A stored chunk's or index's bytes split into (data, its crc32c trailer), both views."""
    return mv[:-CRC_BYTES], mv[-CRC_BYTES:]


def chunk_data(mv: Any) -> Any:
    """A stored chunk's bytes without its crc32c trailer."""
    return mv[:-CRC_BYTES]
