"""Checks of the bytes read from a shard object against its manifest (FORMAT.md 6.4, 9 step 6).

:class:`BlockChecks` is mixed into :class:`ckptfmt.reader.Checkpoint`; every read path (positional,
kvstore, verify) calls these, through the instance, before it hands anything back. The checks
themselves are :mod:`ckptfmt.shard`'s; the methods here are the points a test may replace by a
no-op (a broken control), and the decoding of encoded chunks, which needs tensorstore.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ckptfmt import shard
from ckptfmt.shard._codec import decoder_for
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.manifest import TensorEntry

__all__ = ["BlockChecks"]


class BlockChecks:
    """Shard, index, entry and chunk checks; each raises a CheckpointError naming the tensor and object."""

    def _check_whole(self, t: TensorEntry, s: int, obj: str, buf: bytes, chunks: Sequence[int]) -> dict[int, memoryview]:
        """Check a whole shard object (exact size, index, the given chunks) against the manifest;
        returns a view of each checked chunk's stored bytes."""
        return shard.check_whole(t, s, obj, buf, chunks, index=self._check_index, chunk=self._check_chunk)

    @classmethod
    def _check_index(cls, t: TensorEntry, s: int, obj: str, index: memoryview) -> None:
        """The index's crc32c, recomputed and as stored, against the manifest; then its entries."""
        shard.check_index_crc(t, s, obj, index)
        cls._check_entries(t, s, obj, index)

    @staticmethod
    def _check_entries(t: TensorEntry, s: int, obj: str, index: memoryview) -> None:
        shard.check_entries(t, s, obj, index)

    @staticmethod
    def _check_chunk(t: TensorEntry, c: int, obj: str, mv: Any, trailer: Any = None) -> None:
        shard.check_chunk(t, c, obj, mv, trailer)

    def _decode(self, t: TensorEntry, c: int, obj: str, mv: Any) -> np.ndarray:
        """The elements of chunk row ``c`` (shape ``chunk_shape``) from its stored bytes, trailer
        included, which :meth:`_check_chunk` has already checked. Raw chunks are viewed in place;
        encoded ones are decoded (FORMAT.md 6.3), InvalidDataError when they do not decode."""
        g = t.geometry
        if t.array.codec == "raw":
            return np.frombuffer(shard.chunk_data(mv), dtype=numpy_dtype(t.dtype)).reshape(g.chunk_shape)
        out = self._decoder(t).decode(shard.chunk_data(mv), key=t.key, obj=obj)
        if t.dtype == "bool":
            shard.check_bool(t, c, obj, out.view(np.uint8), decoded=True)
        return out

    def _decoder(self, t: TensorEntry) -> Any:
        return decoder_for(self.__dict__.setdefault("_decoders", {}), t.dtype, t.geometry.chunk_shape)
