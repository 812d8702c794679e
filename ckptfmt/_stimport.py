"""Import tensors from another format as one committed ckptfmt step, streaming block by block.

Call order: the importer of a format (safetensors here; Orbax and DCP in ``bridges.interop``)
opens and validates its source, then lists :class:`ImportTensor` s (key, shape, dtype and a
``read(box)`` that returns that block, checked as far as the source allows) ->
:func:`import_tensors` splits each tensor into row blocks of at most :data:`BLOCK_BYTES` and hands
them to :func:`ckptfmt.save` as lazily produced shards: a block is read when the save writes it
and let go once written, so host memory holds about one block plus the save's in-flight window
(:data:`SAVE_WINDOW`), whatever the source's size. The save verifies every written chunk against
the crc32c of the bytes it was given and commits only if everything was written; a read that fails
(a checksum, a truncated file, a missing shard) raises its own CheckpointError and nothing is
committed. Provenance goes into the manifest's ``metadata["import"]``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ._types import Box, LocalShard
from .dtypes import dtype_name, numpy_dtype
from .errors import CheckpointError, InvalidSourceError, ShapeMismatchError

__all__ = ["ImportTensor", "ImportReport", "import_tensors", "row_boxes", "BLOCK_BYTES", "SAVE_WINDOW"]

#: Largest block read from a source at once (a row block of one tensor; one row when rows are larger).
BLOCK_BYTES = 64 << 20
#: The import's save keeps at most about this many bytes of written blocks in flight.
SAVE_WINDOW = 64 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ImportTensor:
    """One tensor of a source: the key it gets, its global shape and format dtype, and ``read(box)``,
    which returns that block (C order, that dtype), raising a CheckpointError when it cannot."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    read: Callable[[Box], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ImportReport:
    """What an import committed: the step, tensors, bytes, seconds and the provenance recorded."""

    url: str
    step: int
    tensors: int
    nbytes: int
    seconds: float
    provenance: Mapping[str, Any]


def row_boxes(shape: tuple[int, ...], itemsize: int, block_bytes: int = BLOCK_BYTES) -> list[Box]:
    """Boxes of whole rows of the leading axis, each at most ``block_bytes`` (at least one row),
    equal in size but the last: their interior boundaries are one grid, so each becomes one shard."""
    nbytes = math.prod(shape) * itemsize
    if not shape or nbytes <= block_bytes or shape[0] <= 1:
        return [Box.full(shape)]
    k = min(shape[0], -(-nbytes // block_bytes))
    per = -(-shape[0] // k)
    return [Box((lo,) + (0,) * (len(shape) - 1), (min(per, shape[0] - lo),) + tuple(shape[1:]))
            for lo in range(0, shape[0], per)]


def import_tensors(url: str, step: int, tensors: Sequence[ImportTensor], *, provenance: Mapping[str, Any],
                   progress: Progress | None = None, block_bytes: int = BLOCK_BYTES,
                   options: Any = None) -> ImportReport:
    """Save ``tensors`` as step ``step`` of the repository at ``url`` (one process), streaming.

    Returns an :class:`ImportReport` once the step is committed. On any failure nothing is
    committed and the first error a source read raised (a CheckpointError: ChecksumMismatchError,
    SizeMismatchError, MissingShardError, InvalidSourceError ...) is raised, else the save's own.
    ``provenance`` (plain JSON) becomes ``metadata["import"]``.
    """
    from .session import SaveOptions, save

    t0 = time.perf_counter()
    keys = [t.key for t in tensors]
    if len(set(keys)) != len(keys):
        dup = sorted(k for k in set(keys) if keys.count(k) > 1)
        raise InvalidSourceError("two source tensors map to one key", key=dup[0], expected="distinct keys", found=dup[:5])
    total = sum(t.nbytes for t in tensors)
    done = [0]
    failures: list[CheckpointError] = []
    shards: list[LocalShard] = []
    for t in tensors:
        dt = numpy_dtype(dtype_name(numpy_dtype(t.dtype), key=t.key))
        for box in row_boxes(tuple(t.shape), dt.itemsize, block_bytes):
            shards.append(LocalShard(t.key, tuple(t.shape), dt, box, _producer(t, box, dt, failures, done, total, progress)))
    opts = options if options is not None else SaveOptions(max_inflight_bytes=SAVE_WINDOW)
    try:
        save(url, step, shards, metadata={"import": dict(provenance)}, options=opts)
    except CheckpointError as e:
        if failures:
            raise failures[0] from e
        raise
    return ImportReport(str(url), int(step), len(tensors), total, time.perf_counter() - t0, dict(provenance))


def _producer(t: ImportTensor, box: Box, dt: np.dtype, failures: list[CheckpointError], done: list[int],
              total: int, progress: Progress | None) -> Callable[[], np.ndarray]:
    def produce() -> np.ndarray:
        try:
            arr = t.read(box)
            if tuple(arr.shape) != box.shape or arr.dtype != dt:
                raise ShapeMismatchError("a source block does not have the shape and dtype its header declares",
                                         key=t.key, expected=(box.shape, dt.name), found=(tuple(arr.shape), arr.dtype.name))
        except CheckpointError as e:
            failures.append(e)
            raise
        done[0] += int(arr.nbytes)
        if progress:
            progress(done[0], total)
        return arr
    return produce
