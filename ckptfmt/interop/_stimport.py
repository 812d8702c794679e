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
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from ckptfmt._types import Box, LocalShard
from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.errors import CheckpointError, InvalidSourceError, ShapeMismatchError
from ckptfmt.session import SaveOptions, save

__all__ = ["ImportTensor", "ImportReport", "import_tensors", "row_boxes", "BatchReader", "BLOCK_BYTES", "SAVE_WINDOW",
           "BATCH_BYTES", "MAX_IMPORT_TENSORS"]

#: The most tensors one import takes by default. A save costs host memory and time per tensor
#: (about 2 KB and 70 µs: docs/performance.md), so a header listing a million empty tensors
#: would otherwise cost gigabytes; 2^17 covers every published model we know of
#: (DeepSeek-V3's per-expert files list about 91,000). Raise it with ``max_tensors=``
#: (``ckptfmt import --max-tensors``); the manifest's own cap (2^20) still applies.
MAX_IMPORT_TENSORS = 1 << 17

#: Largest block read from a source at once (a row block of one tensor; one row when rows are larger).
BLOCK_BYTES = 64 << 20
#: The import's save keeps at most about this many bytes of written blocks in flight.
SAVE_WINDOW = 64 << 20
#: Whole tensors a :class:`BatchReader` loads at once (a larger tensor alone).
BATCH_BYTES = 64 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
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


def import_tensors(url: str, step: int, tensors: Iterable[ImportTensor], *, provenance: Mapping[str, Any],
                   progress: Progress | None = None, block_bytes: int = BLOCK_BYTES,
                   options: Any = None, state: Any = None, max_tensors: int | None = None) -> ImportReport:
    """Save ``tensors`` as step ``step`` of the repository at ``url`` (one process), streaming.

    Returns an :class:`ImportReport` once the step is committed. On any failure nothing is
    committed and the first error a source read raised (a CheckpointError: ChecksumMismatchError,
    SizeMismatchError, MissingShardError, InvalidSourceError ...) is raised, else the save's own.
    A source with no tensors is InvalidSourceError (nothing committed), never an empty step; so is
    one with more than ``max_tensors`` (default :data:`MAX_IMPORT_TENSORS`), before anything is read.
    ``provenance`` (plain JSON) becomes ``metadata["import"]``; ``state`` the global non-tensor
    state (e.g. the JAX profile's record of scalar leaves). ``tensors`` may be any iterable: from
    an iterator (that the caller keeps no list of) each tensor, its reader included, is let go of
    once its blocks are written, before the commit.
    """
    t0 = time.perf_counter()
    tensors = list(tensors)
    if not tensors:  # an empty step would look like a successful import of nothing
        raise InvalidSourceError("the source holds no tensors: nothing to import", object=str(provenance.get("source")),
                                 expected="at least one tensor", found="none")
    cap = MAX_IMPORT_TENSORS if max_tensors is None else int(max_tensors)
    if len(tensors) > cap:
        raise InvalidSourceError(f"the source holds {len(tensors):,} tensors, over the import cap of {cap:,}; pass "
                                 "max_tensors= (ckptfmt import --max-tensors) to import it anyway",
                                 object=str(provenance.get("source")), expected=f"<= {cap} tensors", found=len(tensors))
    keys = Counter(t.key for t in tensors)
    if len(keys) != len(tensors):
        dup = sorted(k for k, n in keys.items() if n > 1)
        raise InvalidSourceError("two source tensors map to one key", key=dup[0], expected="distinct keys", found=dup[:5])
    del keys
    run = _Run(sum(t.nbytes for t in tensors), progress)
    shards: list[LocalShard] = []
    dtypes: dict[str, np.dtype] = {}  # one dtype object per name, shared by every shard
    for t in tensors:
        dt = dtypes.get(t.dtype)
        if dt is None:
            dt = dtypes[t.dtype] = numpy_dtype(dtype_name(numpy_dtype(t.dtype), key=t.key))
        for box in row_boxes(t.shape, dt.itemsize, block_bytes):
            shards.append(LocalShard(t.key, t.shape, dt, box, _Block(t, box, dt, run)))
    count = len(tensors)
    del tensors, t  # each tensor lives on in its blocks only, which the save lets go of once written
    opts = options if options is not None else SaveOptions(max_inflight_bytes=SAVE_WINDOW)
    try:  # the save takes the blocks one by one and lets go of them once written
        save(url, step, _drain(shards), state=state, metadata={"import": dict(provenance)}, options=opts)
    except CheckpointError as e:
        if run.failures:
            raise run.failures[0] from e
        raise
    return ImportReport(str(url), int(step), count, run.total, time.perf_counter() - t0, dict(provenance))


def _drain(items: list[LocalShard]) -> Iterator[LocalShard]:
    """``items`` in order, each taken out of the list as it is handed over (the list is this
    module's own): the caller then holds no block that the save has let go of."""
    items.reverse()
    while items:
        yield items.pop()


class _Run:
    """What every block of one import shares: the bytes read so far, the first failures, progress."""

    __slots__ = ("total", "done", "failures", "progress")

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress
        self.failures: list[CheckpointError] = []


class _Block:
    """A shard's data: reads ``box`` of ``tensor`` when the save writes it and checks its shape and
    dtype (a small object per shard: an import of 100,000 tensors holds 100,000 of them)."""

    __slots__ = ("tensor", "box", "dtype", "run")

    def __init__(self, tensor: ImportTensor, box: Box, dtype: np.dtype, run: _Run) -> None:
        self.tensor, self.box, self.dtype, self.run = tensor, box, dtype, run

    def __call__(self) -> np.ndarray:
        t, box, dt, run = self.tensor, self.box, self.dtype, self.run
        try:
            arr = t.read(box)
            if tuple(arr.shape) != box.shape or arr.dtype != dt:
                raise ShapeMismatchError("a source block does not have the shape and dtype its header declares",
                                         key=t.key, expected=(box.shape, dt.name), found=(tuple(arr.shape), arr.dtype.name))
        except CheckpointError as e:
            run.failures.append(e)
            raise
        run.done += int(arr.nbytes)
        if run.progress:
            run.progress(run.done, run.total)
        return arr


class BatchReader:
    """Serves blocks of whole tensors that a foreign library loads (Orbax, DCP): ``load(keys)`` ->
    {key: array} loads a batch of at most ``batch_bytes`` (in key order; a larger tensor alone)
    when one of them is first asked for; a tensor is dropped once every byte of it was served, so
    it holds about one batch (or one tensor) at a time when blocks are asked for in key order."""

    def __init__(self, nbytes: Mapping[str, int], load: Callable[[list[str]], Mapping[str, np.ndarray]],
                 batch_bytes: int = BATCH_BYTES) -> None:
        self.load = load
        self.cache: dict[str, np.ndarray] = {}
        self.served: dict[str, int] = {}
        self.batch_of: dict[str, list[str]] = {}
        batch: list[str] = []
        held = 0
        for k in sorted(nbytes):
            if batch and held + nbytes[k] > batch_bytes:
                batch, held = [], 0
            batch.append(k)
            held += nbytes[k]
            self.batch_of[k] = batch

    def read(self, key: str, box: Box) -> np.ndarray:
        """The block at ``box`` of tensor ``key`` (a fresh C-ordered array unless it is the whole)."""
        if key not in self.cache:
            todo = [k for k in self.batch_of[key] if k not in self.served or k == key]
            for k, arr in self.load(todo).items():
                self.cache[k] = arr
                self.served.setdefault(k, 0)
        arr = self.cache[key]
        block = arr if box.shape == arr.shape else arr[box.slices()].copy()  # a copy: the tensor goes once served
        self.served[key] += int(block.nbytes)
        if self.served[key] >= arr.nbytes:
            del self.cache[key]
        return block if block.flags.c_contiguous else block.copy(order="C")
