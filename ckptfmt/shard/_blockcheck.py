"""Checks of the bytes read from a shard object against its manifest (FORMAT.md 6.4, 9 step 6).

:class:`BlockChecks` is the collaborator a :class:`ckptfmt.reader.Checkpoint` is given (its
``checks``); every read path (positional, kvstore, supplied chunks, verify) calls it before it
hands anything back, and so does the reuse check. The checks themselves are :mod:`ckptfmt.shard`'s;
a test builds a broken control by passing a subclass with a check replaced by a no-op. It also
decodes encoded chunks, which needs tensorstore.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ckptfmt import shard
from ckptfmt.shard._codec import decoder_for
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.shard._bytes import ShardedTensor

__all__ = ["BlockChecks"]


class BlockChecks:
    """Shard, index, entry and chunk checks; each raises a CheckpointError naming the tensor and object.

    One per reader (it keeps the decoders of encoded chunks). A test that needs a broken control
    passes a subclass that overrides a method by a no-op: :meth:`whole` calls :meth:`index` and
    :meth:`chunk`, and :meth:`index` calls :meth:`entries`, through the instance."""

    def __init__(self) -> None:
        self._decoders: dict[Any, Any] = {}

    def whole(self, t: ShardedTensor, s: int, obj: str, buf: bytes, chunks: Sequence[int]) -> dict[int, memoryview]:
        """Check a whole shard object (exact size, index, the given chunks) against the manifest;
        returns a view of each checked chunk's stored bytes."""
        return shard.check_whole(t, s, obj, buf, chunks, index=self.index, chunk=self.chunk)

    def index(self, t: ShardedTensor, s: int, obj: str, index: memoryview) -> None:
        """The index's crc32c, recomputed and as stored, against the manifest; then its entries."""
        shard.check_index_crc(t, s, obj, index)
        self.entries(t, s, obj, index)

    def entries(self, t: ShardedTensor, s: int, obj: str, index: memoryview) -> None:
        """The index's entries against the manifest's chunk table."""
        shard.check_entries(t, s, obj, index)

    def chunk(self, t: ShardedTensor, c: int, obj: str, mv: Any, trailer: Any = None) -> None:
        """Chunk row ``c``'s stored bytes (data and trailer) against the manifest."""
        shard.check_chunk(t, c, obj, mv, trailer)

    def decode(self, t: ShardedTensor, c: int, obj: str, mv: Any) -> np.ndarray:
        """The elements of chunk row ``c`` (shape ``chunk_shape``) from its stored bytes, trailer
        included, which :meth:`chunk` has already checked. Raw chunks are viewed in place;
        encoded ones are decoded (FORMAT.md 6.3), InvalidDataError when they do not decode."""
        g = t.geometry
        if t.array.codec == "raw":
            return np.frombuffer(shard.chunk_data(mv), dtype=numpy_dtype(t.dtype)).reshape(g.chunk_shape)
        out = decoder_for(self._decoders, t.dtype, g.chunk_shape).decode(shard.chunk_data(mv), key=t.key, obj=obj)
        if t.dtype == "bool":
            shard.check_bool(t, c, obj, out.view(np.uint8), decoded=True)
        return out
