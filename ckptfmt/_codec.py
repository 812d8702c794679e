"""Decoding encoded inner chunks (codec "zstd", FORMAT.md 6.3) on the verified read path.

Decoding goes through tensorstore's own zarr v3 codec chain (``bytes``, ``zstd``, ``crc32c``), the
same implementation that encoded the chunks, so the core needs no other compression library. A
:class:`ChunkDecoder` owns a small in-memory zarr3 array whose every chunk has the tensor's
``chunk_shape``: one decode writes the verified encoded bytes and their trailer under a fresh chunk
key, reads that chunk back decoded, and deletes the key. tensorstore decodes into the chunk's fixed
size and fails on a frame that would decode to more or fewer bytes, so a hostile frame costs at most
one chunk. With the ``crc32c`` codec after ``zstd`` (as in every ckptfmt array) it also fails on any
byte after the frame (a skippable frame, an empty frame, garbage); without it, it lets them pass.

Only bytes that already passed their crc32c check against the manifest are ever decoded.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

from . import layout
from .checksum import crc32c
from .errors import InvalidDataError

__all__ = ["ChunkDecoder", "decoder_for", "verify_encoded"]

#: Chunk slots of one decoder's scratch array: enough for every reader thread to decode at once.
_SLOTS = 1 << 16


class ChunkDecoder:
    """Decodes zstd inner chunks of one (dtype, chunk_shape) into fresh numpy arrays. Thread-safe."""

    def __init__(self, zarr_dtype: str, numpy_dtype: np.dtype, chunk_shape: tuple[int, ...]) -> None:
        import tensorstore as ts

        self.chunk_shape = tuple(chunk_shape)
        self.dtype = numpy_dtype
        # A leading slot axis: slot k is chunk (k, 0, ..., 0); a 0-d chunk is a chunk of shape [1].
        inner = self.chunk_shape or (1,)
        meta = {"shape": [_SLOTS, *inner] if self.chunk_shape else [_SLOTS],
                "data_type": zarr_dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *inner] if self.chunk_shape else [1]}},
                "chunk_key_encoding": {"name": "default"},
                "fill_value": layout.fill_value(zarr_dtype),
                "codecs": layout.inner_codecs(zarr_dtype, "zstd")}  # the crc32c codec makes tensorstore refuse trailing bytes
        self._array = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": meta, "create": True,
                               "fill_missing_data_reads": False, "recheck_cached_data": False},
                              context=ts.Context()).result()
        self._kv = self._array.kvstore
        self._zeros = "/0" * len(self.chunk_shape)
        self._slots = itertools.count()
        self._lock = threading.Lock()

    def decode(self, data: Any, *, key: str, obj: str) -> np.ndarray:
        """The decoded chunk (shape ``chunk_shape``) of the encoded bytes ``data`` (the chunk without
        its trailer). InvalidDataError, naming ``key`` and ``obj``, when ``data`` is not exactly one
        zstd frame of exactly the chunk's size with nothing after it (FORMAT.md 6.3)."""
        with self._lock:
            slot = next(self._slots) % _SLOTS
        ck = f"c/{slot}{self._zeros}"
        try:
            self._kv.write(ck, b"".join((data, crc32c(data).to_bytes(layout.CRC_BYTES, "little")))).result()
            out = self._array[slot].read().result()
        except Exception as e:  # tensorstore raises ValueError for a frame it cannot decode
            raise InvalidDataError("encoded chunk is not exactly one zstd frame of its chunk size", key=key, object=obj,
                                   expected=f"exactly one zstd frame of {int(np.prod(self.chunk_shape, dtype=np.int64)) * self.dtype.itemsize} "
                                            "decoded bytes and nothing after it", found=str(e)[:200]) from None
        finally:
            try:
                self._kv.delete_range(_range(ck)).result()
            except Exception:
                pass
        return np.asarray(out, dtype=self.dtype).reshape(self.chunk_shape)


def decoder_for(cache: dict[tuple[str, tuple[int, ...]], ChunkDecoder], zarr_dtype: str,
                chunk_shape: tuple[int, ...]) -> ChunkDecoder:
    """The decoder of ``cache`` for (dtype, chunk shape), made on first use."""
    from .dtypes import numpy_dtype

    d = cache.get((zarr_dtype, chunk_shape))
    if d is None:
        d = cache.setdefault((zarr_dtype, chunk_shape), ChunkDecoder(zarr_dtype, numpy_dtype(zarr_dtype), chunk_shape))
    return d


def _range(key: str) -> Any:
    import tensorstore as ts

    return ts.KvStore.KeyRange(key, key + "\x00")


def verify_encoded(storage: Any, written: list[Any], save_id: str) -> list[Any]:
    """Phase 4 for encoded chunks (codec zstd, FORMAT.md 6.3): they differ in size and their crc32c
    covers the encoded bytes, so the source crc32c cannot be compared with the trailers. Each
    written object is read back whole; its index and every trailer are checked against its bytes,
    every chunk is decoded, and the decoded bytes' crc32c is compared with the source's.
    IncompleteSaveError when anything differs; returns the shards' records."""
    from ._manifest_entries import max_encoded_chunk_nbytes
    from ._shardwriter import ShardRecord
    from .errors import IncompleteSaveError
    from .plan import stored_chunk_counts

    decoders: dict[tuple[str, tuple[int, ...]], ChunkDecoder] = {}
    records = []
    for w in written:
        p, it, g = w.plan, w.item, w.plan.geometry
        key = layout.shard_key(layout.array_path(save_id, p.index), it.cell)
        obj = storage.read(key)
        if obj is None or len(obj) < g.index_nbytes:
            raise IncompleteSaveError("written shard is missing or shorter than its index", key=p.key, object=key,
                                      expected=f">= {g.index_nbytes} bytes", found=None if obj is None else len(obj))
        total, view = len(obj), memoryview(obj)
        body, stored = layout.split_trailer(view[total - g.index_nbytes:])
        if crc32c(body) != stored:
            raise IncompleteSaveError("written shard index fails its checksum", key=p.key, object=key)
        entries = layout.index_entries(body)
        dec = decoder_for(decoders, p.dtype, g.chunk_shape)
        offs, sizes, crcs = [], [], []
        limit = max_encoded_chunk_nbytes(g.chunk_nbytes - layout.CRC_BYTES)
        cells = itertools.product(*(range(k) for k in stored_chunk_counts(g, it.box.offset)))
        for cell, want in zip(cells, w.crcs):
            flat = int(np.ravel_multi_index(cell, g.inner)) if g.inner else 0
            off, nb = (int(x) for x in entries[flat])
            if not layout.CRC_BYTES < nb <= limit or off + nb > total - g.index_nbytes:
                raise IncompleteSaveError("written shard index points at an unexpected byte range", key=p.key,
                                          object=key, expected=f"1..{limit} bytes inside the data section",
                                          found=f"[{off}, {off + nb})")
            data, trailer = layout.split_trailer(view[off:off + nb])
            if crc32c(data) != trailer:
                raise IncompleteSaveError("written chunk fails its checksum", key=p.key, object=key,
                                          expected=trailer, found=crc32c(data))
            got = crc32c(dec.decode(data, key=p.key, obj=key))
            if got != want:
                raise IncompleteSaveError("written chunk does not decode to the source bytes", key=p.key, object=key,
                                          expected=f"crc32c {want} (decoded)", found=f"crc32c {got}")
            offs.append(off)
            sizes.append(nb)
            crcs.append(trailer)
        records.append(ShardRecord(p.index, it.cell, total, stored, tuple(offs), tuple(crcs),
                                   chunk_nbytes=tuple(sizes)))
    return records
