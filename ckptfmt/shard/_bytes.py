"""Where each byte of a shard lies in its object (FORMAT.md 6.3-6.4), and how long each part is:
the one place that computes a shard's byte sizes and positions. The manifest's parser checks a
document's lengths against :func:`shard_sizes`, the writers size their objects with it, and the
readers cut their reads with :func:`shard_bytes`.

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

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ckptfmt.plan import TensorGeometry

__all__ = ["TRAILER_BYTES", "INDEX_ENTRY_BYTES", "INDEX_ENTRY", "NOT_STORED", "ShardedTensor", "ShardSizes",
           "shard_sizes", "max_encoded_chunk_nbytes", "ShardBytes", "shard_bytes", "raw_shard_nbytes",
           "split_trailer", "index_entries", "data_and_trailer", "chunk_data"]

#: Bytes of the crc32c trailer after every stored chunk and after the index: what a buffer that
#: receives a trailer alone holds.
TRAILER_BYTES = 4
INDEX_ENTRY_BYTES = 16   # offset and nbytes, two little-endian uint64
#: An index entry of an inner chunk that is not stored: offset and nbytes both 2^64-1.
NOT_STORED = 2**64 - 1
#: The entry table of a shard index: (offset, nbytes) rows of little-endian uint64.
INDEX_ENTRY = np.dtype("<u8")


class ShardedTensor(Protocol):
    """What this subpackage reads of a tensor's entry in a manifest (a
    :class:`ckptfmt.manifest.TensorEntry` has it; the manifest sits above the shard and is not
    imported here): its key, dtype and geometry, its array spec (``codec``, ``path``), its shard
    table (``nbytes``, ``index_crc32c``, ``offset``) and chunk table (``offset``, ``nbytes``,
    ``crc32c``), each shard's first chunk row, and where each shard starts in its object."""

    key: str
    dtype: str
    geometry: TensorGeometry
    array: Any
    shards: Any
    chunks: Any
    chunk_start: np.ndarray

    def shard_start(self, s: int) -> int: ...


def max_encoded_chunk_nbytes(raw_nbytes: int) -> int:
    """The largest encoded chunk (zstd frame plus the 4-byte crc32c) a reader accepts for a chunk of
    ``raw_nbytes`` decoded bytes: zstd's own worst case, ZSTD_COMPRESSBOUND (FORMAT.md 6.3)."""
    small = ((128 << 10) - raw_nbytes) >> 11 if raw_nbytes < (128 << 10) else 0
    return raw_nbytes + (raw_nbytes >> 8) + small + TRAILER_BYTES


@dataclass(frozen=True)
class ShardSizes:
    """The lengths the shards of one geometry are made of (FORMAT.md 5.7, 6.3-6.4): what the
    manifest's parser checks a document's numbers against and what the raw encoder writes.
    Build it with :func:`shard_sizes`."""

    chunk_data: int   # one inner chunk's elements, undecoded: what a codec encodes
    chunk: int        # one raw chunk as stored: its data, then its trailer
    index: int        # the index: one entry per inner chunk, then its trailer
    full: int         # the largest shard: every inner chunk stored raw, then the index

    def shard(self, nchunks: Any) -> Any:
        """The length of a shard of ``nchunks`` raw chunks back to back from its start, its index
        after them (the layout :func:`ckptfmt.shard.encode` writes); an int or an array."""
        return nchunks * self.chunk + self.index

    def stored_chunk(self, codec: str) -> tuple[int, int]:
        """(least, most) bytes a stored chunk of ``codec`` may take, its trailer included: a raw
        chunk exactly :attr:`chunk`; an encoded one at least one byte before its trailer and at
        most zstd's bound (FORMAT.md 6.3)."""
        if codec == "raw":
            return self.chunk, self.chunk
        return TRAILER_BYTES + 1, max_encoded_chunk_nbytes(self.chunk_data)

    def data_stop(self, nbytes: Any) -> Any:
        """Where the data section of a shard of ``nbytes`` ends (its index starts), relative to
        the shard's start; an int or an array."""
        return nbytes - self.index


def shard_sizes(g: TensorGeometry) -> ShardSizes:
    """The :class:`ShardSizes` of geometry ``g``, in exact integer arithmetic (a hostile geometry
    gives large numbers, never an overflow). Asked per shard by saves and reads: kept on the
    geometry object once computed (a derived value; equality and hashing use the fields alone)."""
    kept = g.__dict__.get("_shard_sizes")
    if kept is None:
        kept = _sizes_of(g)
        object.__setattr__(g, "_shard_sizes", kept)  # a frozen dataclass: its fields stay as they are
    return kept


@functools.lru_cache(maxsize=4096)  # tensors alike share a geometry
def _sizes_of(g: TensorGeometry) -> ShardSizes:
    data = math.prod(g.chunk_shape) * g.itemsize
    inner = math.prod(g.inner)
    index = inner * INDEX_ENTRY_BYTES + TRAILER_BYTES
    return ShardSizes(data, data + TRAILER_BYTES, index, inner * (data + TRAILER_BYTES) + index)


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
        return stop - TRAILER_BYTES, stop

    def chunk(self, c: int) -> tuple[int, int]:
        """Chunk row ``c`` as stored: its data and its trailer."""
        lo = self.start + int(self.chunk_offset[c])
        return lo, lo + int(self.chunk_nbytes[c])

    def chunk_bounds(self, c: int) -> tuple[int, int, int]:
        """Chunk row ``c`` as (start, where its trailer starts, stop): its data is the first
        range, its trailer the second."""
        lo = self.start + int(self.chunk_offset[c])
        hi = lo + int(self.chunk_nbytes[c])
        return lo, hi - TRAILER_BYTES, hi

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


def shard_bytes(t: ShardedTensor, s: int) -> ShardBytes:
    """The byte ranges of shard row ``s`` of tensor entry ``t`` (a :class:`ckptfmt.manifest.TensorEntry`)."""
    return ShardBytes(t.shard_start(s), int(t.shards.nbytes[s]), shard_sizes(t.geometry).index, t.chunks.offset,
                      t.chunks.nbytes)


def raw_shard_nbytes(g: TensorGeometry, nchunks: Any) -> Any:
    """The length of a shard of ``nchunks`` raw chunks back to back from its start, its index
    after them (the layout :func:`ckptfmt.shard.encode` writes); ``nchunks`` an int or an array."""
    return shard_sizes(g).shard(nchunks)


def split_trailer(buf: Any) -> tuple[Any, int]:
    """(the bytes before the trailer, the crc32c stored in it) of an encoded chunk or index."""
    return buf[:-TRAILER_BYTES], int.from_bytes(bytes(buf[-TRAILER_BYTES:]), "little")


def index_entries(body: Any) -> np.ndarray:
    """The (offset, nbytes) rows of an index's entry table (``body``: the index without its trailer),
    in C order of the inner grid."""
    return np.frombuffer(body, INDEX_ENTRY).reshape(-1, 2)


def data_and_trailer(mv: Any) -> tuple[Any, Any]:
    """A stored chunk's or index's bytes split into (data, its crc32c trailer), both views."""
    return mv[:-TRAILER_BYTES], mv[-TRAILER_BYTES:]


def chunk_data(mv: Any) -> Any:
    """A stored chunk's bytes without its crc32c trailer."""
    return mv[:-TRAILER_BYTES]
