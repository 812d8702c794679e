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

from ckptfmt import layout
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import InvalidDataError
from ckptfmt.shard._bytes import TRAILER_BYTES

__all__ = ["ChunkDecoder", "decoder_for"]

#: Chunk slots of one decoder's scratch array: enough for every reader thread to decode at once.
_SLOTS = 1 << 16


class ChunkDecoder:
    """Decodes zstd inner chunks of one (dtype, chunk_shape) into fresh numpy arrays. Thread-safe."""

    def __init__(self, zarr_dtype: str, numpy_dtype: np.dtype, chunk_shape: tuple[int, ...]) -> None:
        import tensorstore as ts  # here, not at import: `import ckptfmt` does not load tensorstore

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
        self._key_range = ts.KvStore.KeyRange
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
            self._kv.write(ck, b"".join((data, crc32c(data).to_bytes(TRAILER_BYTES, "little")))).result()
            out = self._array[slot].read().result()
        except Exception as e:  # tensorstore raises ValueError for a frame it cannot decode
            raise InvalidDataError("encoded chunk is not exactly one zstd frame of its chunk size", key=key, object=obj,
                                   expected=f"exactly one zstd frame of {int(np.prod(self.chunk_shape, dtype=np.int64)) * self.dtype.itemsize} "
                                            "decoded bytes and nothing after it", found=str(e)[:200]) from None
        finally:
            try:
                self._kv.delete_range(self._key_range(ck, ck + "\x00")).result()
            except Exception:
                pass
        return np.asarray(out, dtype=self.dtype).reshape(self.chunk_shape)


def decoder_for(cache: dict[tuple[str, tuple[int, ...]], ChunkDecoder], zarr_dtype: str,
                chunk_shape: tuple[int, ...]) -> ChunkDecoder:
    """The decoder of ``cache`` for (dtype, chunk shape), made on first use."""
    d = cache.get((zarr_dtype, chunk_shape))
    if d is None:
        d = cache.setdefault((zarr_dtype, chunk_shape), ChunkDecoder(zarr_dtype, numpy_dtype(zarr_dtype), chunk_shape))
    return d
