"""The shard object (FORMAT.md 6.2-6.4), both ways: the only module that knows its bytes.

A shard object holds its stored inner chunks back to back from offset 0 in C order of the inner
grid, each followed by the 4-byte crc32c of its bytes (edge chunks zero-padded to the full chunk
shape); then the index, one (offset, nbytes) entry of little-endian uint64 per inner chunk (the
not-stored marker for a chunk outside the array), followed by its own crc32c.

Pure: no I/O and no tensorstore. Writers call :func:`encode` (the buffers of one object and its
record) and :func:`verify_encoded` (the read-back of an object another library encoded); readers
and the reuse check call :func:`check_whole`, :func:`check_index` and :func:`check_chunk`, which
raise a CheckpointError naming the tensor and the object. :class:`ShardRecord` is the one record
of a shard object, written or referenced, and its named wire form. :func:`shard_bytes` answers
where each byte of a shard lies (its index, each chunk's data and trailer) for every reader, so
that no module outside this one computes a shard's byte positions (tests/test_shardbytes.py).

Subpackage ``ckptfmt.shard``. The shard object (FORMAT.md 6.2-6.4): its index, its chunk checks and
the decoding of encoded chunks, shared by the read path, the reuse check and the writers. Its
modules: ``_blockcheck``, ``_bytes``, ``_codec``. May import: floor. The floor: the
top-level modules listed in ``ckptfmt/__init__.py`` (tests/test_layering.py holds the rules and
enforces them). It reads a manifest's tensor entry through :class:`ShardedTensor`, so that the
manifest, whose parser checks its lengths against :func:`shard_sizes`, can sit above it.
Subpackages that may import it: manifest, reader, session.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.errors import ChecksumMismatchError, IncompleteSaveError, InvalidDataError, SizeMismatchError
from ckptfmt.layout import cell_key
from ckptfmt.plan import TensorGeometry, stored_chunk_counts
from ckptfmt.shard._bytes import INDEX_ENTRY as INDEX_ENTRY
from ckptfmt.shard._bytes import INDEX_ENTRY_BYTES as INDEX_ENTRY_BYTES
from ckptfmt.shard._bytes import NOT_STORED as NOT_STORED
from ckptfmt.shard._bytes import TRAILER_BYTES as TRAILER_BYTES
from ckptfmt.shard._bytes import ShardBytes as ShardBytes
from ckptfmt.shard._bytes import ShardedTensor as ShardedTensor
from ckptfmt.shard._bytes import ShardSizes as ShardSizes
from ckptfmt.shard._bytes import chunk_data as chunk_data
from ckptfmt.shard._bytes import data_and_trailer as data_and_trailer
from ckptfmt.shard._bytes import index_entries as index_entries
from ckptfmt.shard._bytes import max_encoded_chunk_nbytes as max_encoded_chunk_nbytes
from ckptfmt.shard._bytes import raw_shard_nbytes as raw_shard_nbytes
from ckptfmt.shard._bytes import shard_bytes as shard_bytes
from ckptfmt.shard._bytes import shard_sizes as shard_sizes
from ckptfmt.shard._bytes import split_trailer as split_trailer

__all__ = ["TRAILER_BYTES", "INDEX_ENTRY_BYTES", "INDEX_ENTRY", "NOT_STORED", "ShardedTensor", "ShardSizes", "shard_sizes",
           "max_encoded_chunk_nbytes", "ShardBytes", "shard_bytes", "raw_shard_nbytes", "split_trailer", "index_entries",
           "data_and_trailer",
           "ShardRecord", "records_to_wire", "records_from_wire", "EncodedShard", "encode", "padded_chunks",
           "chunk_crcs", "index_body", "back_to_back", "chunk_data", "check_whole", "check_index", "check_index_crc", "check_entries", "check_chunk", "check_bool",
           "verify_encoded"]

_NOT_STORED = np.uint64(NOT_STORED)
#: The fields of a record, in the order of its wire columns.
_FIELDS = ("tensor", "cell", "nbytes", "index_crc32c", "chunk_offsets", "chunk_crc32c", "chunk_nbytes", "ref", "where")


@dataclass(frozen=True)
class ShardRecord:
    """One shard object: a shard this save wrote and verified, as its writer acknowledges it to
    the leader; or, with ``ref`` set, an object of an earlier save (an incremental save's
    reference, FORMAT.md 8.4, or a committed manifest's row, :meth:`of_manifest`)."""

    tensor: int                      # the plan's tensor index
    cell: tuple[int, ...]            # grid cell
    nbytes: int                      # object length
    index_crc32c: int
    chunk_offsets: tuple[int, ...]   # stored inner chunks, in C order of the inner grid
    chunk_crc32c: tuple[int, ...]
    chunk_nbytes: tuple[int, ...] = ()  # each stored chunk's length (codec zstd); () means chunk_nbytes each
    ref: tuple[str, str] | None = None  # (save id, array path) of the earlier save holding the object
    #: (object key, start, object length) of a shard in a pack (FORMAT.md 5.15), or of an earlier
    #: save's shard a packed save references (its pack, or its shard object at 0); None otherwise.
    where: tuple[str, int, int] | None = None

    @classmethod
    def of_manifest(cls, t: Any, s: int, *, tensor: int = -1, cell: tuple[int, ...] = ()) -> "ShardRecord":
        """Row ``s`` of a committed manifest's tensor ``t``: where the object lies (``ref``), its
        size and every checksum; every chunk's length listed."""
        # A packed row names its object (FORMAT.md 5.15): the save that wrote it owns the key.
        path = t.object_key(s) if t.packed is not None else t.objects.get(s, t.array.path) if t.objects else t.array.path
        c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
        return cls(tensor, tuple(cell), int(t.shards.nbytes[s]), int(t.shards.index_crc32c[s]),
                   tuple(t.chunks.offset[c0:c1].tolist()), tuple(t.chunks.crc32c[c0:c1].tolist()),
                   tuple(t.chunks.nbytes[c0:c1].tolist()), (path.split("/")[1], path),
                   (t.object_key(s), t.shard_start(s), t.object_nbytes(s)))

    def located(self, save_id: str, path: str, chunk_nbytes: int) -> "ShardRecord":
        """This record with its object's location and every chunk's length filled in (a written
        shard's record as a later save finds it in the manifest)."""
        return ShardRecord(self.tensor, self.cell, self.nbytes, self.index_crc32c, self.chunk_offsets,
                           self.chunk_crc32c, tuple(self.chunk_nbytes) or (chunk_nbytes,) * len(self.chunk_offsets),
                           self.ref or (save_id, self.where[0] if self.where else path),
                           self.where or (f"{path}/{cell_key(self.cell)}", 0, self.nbytes))

    def same_object(self, other: "ShardRecord") -> bool:
        """The same object with the same size and checksums (the tensor index and cell aside)."""
        return self._object() == other._object()

    def _object(self) -> tuple[Any, ...]:  # every field but the tensor index and cell
        return (self.nbytes, self.index_crc32c, self.chunk_offsets, self.chunk_crc32c, self.chunk_nbytes, self.ref,
                self.where)


def records_to_wire(records: Sequence[ShardRecord]) -> dict[str, list[Any]]:
    """The named wire form of a rank's records (its acknowledgement): one column per field."""
    out: dict[str, list[Any]] = {f: [] for f in _FIELDS}
    for r in records:
        out["tensor"].append(r.tensor)
        out["cell"].append(list(r.cell))
        out["nbytes"].append(r.nbytes)
        out["index_crc32c"].append(r.index_crc32c)
        out["chunk_offsets"].append(list(r.chunk_offsets))
        out["chunk_crc32c"].append(list(r.chunk_crc32c))
        out["chunk_nbytes"].append(list(r.chunk_nbytes))
        out["ref"].append(list(r.ref) if r.ref else None)
        out["where"].append(list(r.where) if r.where else None)
    return out


def records_from_wire(wire: Mapping[str, Sequence[Any]]) -> list[ShardRecord]:
    """The inverse of :func:`records_to_wire`."""
    cols = [wire[f] for f in _FIELDS]
    return [ShardRecord(int(tensor), tuple(cell), int(nbytes), int(icrc), tuple(offs), tuple(crcs),
                        tuple(int(x) for x in cnb), (str(ref[0]), str(ref[1])) if ref else None,
                        (str(where[0]), int(where[1]), int(where[2])) if where else None)
            for tensor, cell, nbytes, icrc, offs, crcs, cnb, ref, where in zip(*cols)]


# ---------------------------------------------------------------------- encoding (FORMAT.md 6.2, 6.3)
def padded_chunks(block: np.ndarray, chunk_shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """The stored inner chunks of a shard block, in C order, edge chunks zero-padded (FORMAT.md 6.3)."""
    for view, part in _chunk_views(block, chunk_shape):
        yield part if view is None else view


def chunk_crcs(block: np.ndarray, chunk_shape: tuple[int, ...]) -> list[int]:
    """crc32c of each stored inner chunk of a shard block, in C order; edge chunks zero-padded."""
    return [crc32c(part) for part in padded_chunks(block, chunk_shape)]


def _chunk_views(block: np.ndarray, chunk_shape: tuple[int, ...]) -> Iterator[tuple[Any, np.ndarray]]:
    """Each stored inner chunk of ``block`` in C order: (a uint8 view of the source, the chunk)
    where the chunk is one whole contiguous region of it, else (None, a zero-padded copy)."""
    full = tuple(chunk_shape)
    if block.shape == full and block.flags.c_contiguous:  # one chunk, the whole block (small shards)
        yield block.reshape(-1).view(np.uint8), block
        return
    counts = tuple(-(-n // c) for n, c in zip(block.shape, chunk_shape))
    for idx in product(*(range(k) for k in counts)):
        sl = tuple(slice(i * c, (i + 1) * c) for i, c in zip(idx, chunk_shape))
        part = block[sl] if sl else block
        if part.shape == full and part.flags.c_contiguous:
            yield part.reshape(-1).view(np.uint8), part
            continue
        pad = np.zeros(full, dtype=block.dtype)
        pad[tuple(slice(0, n) for n in part.shape)] = part
        yield None, pad


def index_body(g: TensorGeometry, counts: tuple[int, ...]) -> bytes:
    """The entry table of a shard whose stored chunks (``counts`` per dimension, as
    :func:`ckptfmt.plan.stored_chunk_counts`) lie back to back from offset 0 in C order, each
    ``chunk_nbytes`` long; every other inner chunk the not-stored marker."""
    return _index(g.inner, shard_sizes(g).chunk, tuple(counts))[0]


#: Index tables up to this size are kept (:func:`_index`): every shard of a geometry with the
#: same stored counts has the same table, and building one per shard was most of a small
#: shard's encoding (thousands of leaves: numpy calls that queue for the GIL behind the writers).
_KEEP_INDEX_BYTES = 64 << 10


def _index(inner: tuple[int, ...], cn: int, counts: tuple[int, ...]) -> tuple[bytes, int]:
    """(entry table, its crc32c) of :func:`index_body`."""
    if 16 * math.prod(inner) <= _KEEP_INDEX_BYTES:
        return _kept_index(inner, cn, counts)
    return _build_index(inner, cn, counts)


def _build_index(inner: tuple[int, ...], cn: int, counts: tuple[int, ...]) -> tuple[bytes, int]:
    nchunks = math.prod(counts)
    index = np.full((math.prod(inner), 2), NOT_STORED, INDEX_ENTRY)
    if nchunks:
        cells = np.indices(counts).reshape(len(counts), -1) if counts else np.zeros((0, 1), np.int64)
        flat = np.ravel_multi_index(tuple(cells), inner) if counts else np.zeros(1, np.int64)
        index[flat, 0] = np.arange(nchunks, dtype=np.uint64) * np.uint64(cn)
        index[flat, 1] = cn
    body = index.tobytes()
    return body, crc32c(body)


_kept_index = functools.lru_cache(maxsize=4096)(_build_index)


class EncodedShard:
    """One raw shard object as buffers: iterate :meth:`buffers` once (each chunk's bytes, its
    crc32c, then the index and its crc32c), then take :meth:`record`. A chunk that is one
    contiguous region of the block is a view of it; an edge or strided chunk is a padded copy."""

    def __init__(self, tensor: int, cell: tuple[int, ...], block: np.ndarray, g: TensorGeometry,
                 counts: tuple[int, ...], crcs: Sequence[int] | None = None) -> None:
        self.tensor, self.cell, self.block, self.geometry, self.counts = tensor, tuple(cell), block, g, counts
        self.nchunks = math.prod(counts)
        self.sizes = shard_sizes(g)
        self.nbytes = self.sizes.shard(self.nchunks)
        self._given = None if crcs is None else tuple(int(c) for c in crcs)
        self._crcs: list[int] = []
        self._index_crc: int | None = None

    def buffers(self) -> Iterator[Any]:
        """The object's bytes in order, as buffers; each chunk's crc32c is that of the very bytes
        yielded (or the one given, computed from the same bytes by the reuse check)."""
        self._crcs = []
        for i, (view, part) in enumerate(_chunk_views(self.block, self.geometry.chunk_shape)):
            data = view if view is not None else part.reshape(-1).view(np.uint8)
            c = self._given[i] if self._given is not None else crc32c(data)
            self._crcs.append(c)
            yield data
            yield c.to_bytes(TRAILER_BYTES, "little")
        body, self._index_crc = _index(self.geometry.inner, self.sizes.chunk, self.counts)
        yield body
        yield self._index_crc.to_bytes(TRAILER_BYTES, "little")

    def verified(self, stored: int, *, key: str, obj: str) -> ShardRecord:
        """Verify after write (FORMAT.md 8.1 phase 4): the trailers and the index hold by
        construction (each crc32c is that of the very bytes yielded), so what is left is the
        object's length as the store reports it. Its record; IncompleteSaveError naming ``key``
        and ``obj`` when the length differs."""
        if stored != self.nbytes:
            raise IncompleteSaveError("written shard has an unexpected size", key=key, object=obj,
                                      expected=self.nbytes, found=stored)
        return self.record()

    def record(self) -> ShardRecord:
        """The record of the object :meth:`buffers` yielded (raises if it was not consumed)."""
        if self._index_crc is None or len(self._crcs) != self.nchunks:
            raise RuntimeError("EncodedShard.record() before its buffers were written")
        cn = self.sizes.chunk
        return ShardRecord(self.tensor, self.cell, self.nbytes, self._index_crc,
                           tuple(range(0, self.nchunks * cn, cn)), tuple(self._crcs))


def encode(tensor: int, cell: tuple[int, ...], block: np.ndarray, g: TensorGeometry, offset: tuple[int, ...],
           crcs: Sequence[int] | None = None) -> EncodedShard:
    """The raw shard object of ``block`` (the C-ordered block of the shard at ``offset``)."""
    return EncodedShard(tensor, cell, block, g, stored_chunk_counts(g, offset), crcs)


def back_to_back(t: Any, c0: int, c1: int, nbytes: int) -> bool:
    """True when chunk rows c0..c1 of a shard of ``nbytes`` lie back to back from offset 0 with
    the index right after (the layout :func:`encode` writes): one read takes the whole object."""
    n, sizes = c1 - c0, shard_sizes(t.geometry)
    if nbytes != sizes.shard(n):
        return False
    if n == 1:  # most small shards: one chunk
        return int(t.chunks.offset[c0]) == 0
    return bool(np.array_equal(t.chunks.offset[c0:c1], np.arange(n, dtype=np.int64) * sizes.chunk))


# ---------------------------------------------------------------------- checks against a manifest (6.4, 9)
def check_whole(t: Any, s: int, obj: str, buf: Any, chunks: Sequence[int], *,
                index: Callable[..., None] | None = None, chunk: Callable[..., None] | None = None) -> dict[int, memoryview]:
    """Check a whole shard object (exact size, index, the given chunks) against the manifest;
    returns a view of each checked chunk's stored bytes. ``index``/``chunk``: the index and chunk
    checks to run (default :func:`check_index`, :func:`check_chunk`)."""
    index, chunk = index or check_index, chunk or check_chunk
    nbytes = int(t.shards.nbytes[s])
    if len(buf) != nbytes:
        raise SizeMismatchError("shard object size differs from the manifest", key=t.key, object=obj,
                                expected=nbytes, found=len(buf))
    mv, sb = memoryview(buf), shard_bytes(t, s)
    index(t, s, obj, mv[sb.local(sb.index)])
    out = {}
    for c in chunks:
        out[c] = mv[sb.local(sb.chunk(c))]
        chunk(t, c, obj, out[c])
    return out


def check_index(t: Any, s: int, obj: str, index: memoryview) -> None:
    """The index's crc32c, recomputed and as stored, against the manifest; then its entries."""
    check_index_crc(t, s, obj, index)
    check_entries(t, s, obj, index)


def check_index_crc(t: Any, s: int, obj: str, index: memoryview) -> None:
    """The index's crc32c, recomputed and as stored, against the manifest."""
    want = int(t.shards.index_crc32c[s])
    body, stored = split_trailer(index)
    got = crc32c(body)
    if got != want or stored != want:
        raise ChecksumMismatchError("shard index checksum differs from the manifest (corrupt or stale)",
                                    key=t.key, object=obj, expected=want, found=got if got != want else stored)


def check_entries(t: Any, s: int, obj: str, index: memoryview) -> None:
    """Every index entry equals the manifest (FORMAT.md 6.4): a stored chunk's entry its chunk-table
    row, every other entry the not-stored marker. The crc32c values alone do not show that the
    chunk table describes this index."""
    g = t.geometry
    c0, c1 = int(t.chunk_start[s]), int(t.chunk_start[s + 1])
    if c1 - c0 == 1 and shard_sizes(g).index == INDEX_ENTRY_BYTES + TRAILER_BYTES:  # one inner chunk, stored
        off, n = int(t.chunks.offset[c0]), int(t.chunks.nbytes[c0])
        if 0 <= off < 1 << 64 and 0 <= n < 1 << 64 and bytes(data_and_trailer(index)[0]) == _ONE_ENTRY.pack(off, n):
            return  # (else the full comparison below says which entry differs)
    if c1 - c0 == math.prod(g.inner):  # every inner chunk stored: the entries are the rows, in order
        rows = np.empty((c1 - c0, 2), INDEX_ENTRY)
        rows[:, 0], rows[:, 1] = t.chunks.offset[c0:c1], t.chunks.nbytes[c0:c1]
        if data_and_trailer(index)[0] == rows.tobytes():
            return
    off = t.shards.offset[s]
    counts = tuple(-(-min(ss, n - int(o)) // c) for ss, n, o, c in zip(g.shard_shape, g.shape, off, g.chunk_shape))
    want = np.full(g.inner + (2,), _NOT_STORED, np.uint64)
    want[tuple(slice(0, k) for k in counts)] = np.stack(
        [t.chunks.offset[c0:c1], t.chunks.nbytes[c0:c1]], axis=-1).reshape(counts + (2,))
    got = index_entries(data_and_trailer(index)[0]).reshape(want.shape)
    if not np.array_equal(got, want):
        flat = int(np.flatnonzero(np.any((got != want).reshape(-1, 2), axis=1))[0])
        cell = tuple(int(i) for i in np.unravel_index(flat, g.inner)) if g.inner else ()
        raise ChecksumMismatchError("shard index entry differs from the manifest's chunk table", key=t.key,
                                    object=f"{obj} index entry {cell}",
                                    expected=[int(x) for x in want.reshape(-1, 2)[flat]],
                                    found=[int(x) for x in got.reshape(-1, 2)[flat]])


#: One index entry (FORMAT.md 6.4): offset and length, little-endian uint64 each.
_ONE_ENTRY = struct.Struct("<QQ")


def check_chunk(t: Any, c: int, obj: str, mv: Any, trailer: Any = None) -> None:
    """Check one stored chunk against the manifest: its length, and the crc32c of its data both
    as recomputed and as stored in its trailer. ``trailer`` given: ``mv`` is the data alone."""
    want = int(t.chunks.crc32c[c])
    data, tail = data_and_trailer(mv) if trailer is None else (mv, trailer)
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
        check_bool(t, c, obj, data)


def check_bool(t: Any, c: int, obj: str, data: Any, decoded: bool = False) -> None:
    """FORMAT.md 5.6: a bool byte is 0x00 or 0x01 only; numpy would hand any other byte on as True."""
    raw = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if raw.size and raw.max() > 1:
        at = int(np.argmax(raw > 1))
        where = f"{obj} chunk row {c}, decoded byte {at}" if decoded else f"{obj} byte {int(t.chunks.offset[c]) + at}"
        raise InvalidDataError("bool tensor holds a byte other than 0x00 and 0x01", key=t.key, object=where,
                               expected="0x00 or 0x01", found=f"0x{int(raw[at]):02x}")


# ---------------------------------------------------------------------- verify after write (FORMAT.md 8.1 phase 4)
def verify_encoded(tensor: int, cell: tuple[int, ...], key: str, obj_key: str, g: TensorGeometry,
                   offset: tuple[int, ...], obj: bytes | None, source_crcs: Sequence[int], limit: int,
                   decode: Callable[[Any], np.ndarray]) -> ShardRecord:
    """The record of an object another library encoded (codec zstd), read back whole as ``obj``:
    its index and every trailer checked against its bytes, every entry inside the data section
    and at most ``limit`` bytes long, every chunk decoded (``decode``) to the crc32c of its source
    chunk. IncompleteSaveError, naming ``key`` and ``obj_key``, when anything differs."""
    index_len = shard_sizes(g).index
    if obj is None or len(obj) < index_len:
        raise IncompleteSaveError("written shard is missing or shorter than its index", key=key, object=obj_key,
                                  expected=f">= {index_len} bytes", found=None if obj is None else len(obj))
    total, view = len(obj), memoryview(obj)
    body, stored = split_trailer(view[total - index_len:])
    if crc32c(body) != stored:
        raise IncompleteSaveError("written shard index fails its checksum", key=key, object=obj_key)
    entries = index_entries(body)
    offs, sizes, crcs = [], [], []
    for c, want in zip(product(*(range(k) for k in stored_chunk_counts(g, offset))), source_crcs):
        flat = int(np.ravel_multi_index(c, g.inner)) if g.inner else 0
        off, nb = (int(x) for x in entries[flat])
        if not TRAILER_BYTES < nb <= limit or off + nb > total - index_len:
            raise IncompleteSaveError("written shard index points at an unexpected byte range", key=key,
                                      object=obj_key, expected=f"1..{limit} bytes inside the data section",
                                      found=f"[{off}, {off + nb})")
        data, trailer = split_trailer(view[off:off + nb])
        if crc32c(data) != trailer:
            raise IncompleteSaveError("written chunk fails its checksum", key=key, object=obj_key,
                                      expected=trailer, found=crc32c(data))
        got = crc32c(decode(data))
        if got != want:
            raise IncompleteSaveError("written chunk does not decode to the source bytes", key=key, object=obj_key,
                                      expected=f"crc32c {want} (decoded)", found=f"crc32c {got}")
        offs.append(off)
        sizes.append(nb)
        crcs.append(trailer)
    return ShardRecord(tensor, tuple(cell), total, stored, tuple(offs), tuple(crcs), tuple(sizes))
