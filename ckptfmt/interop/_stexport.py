"""Export a committed step to a Hugging Face safetensors directory, streaming with bounded memory.

Call order: :func:`plan_export` (pure: which tensor goes to which file, their dtypes, the digest
every writer must agree on) -> :func:`write_part` on each writer (its files only, disjoint by file
number; each file under its temporary name) -> :func:`finish_export` once every writer
succeeded (writes the temporary ``config.json`` and ``model.safetensors.index.json``, then gives
every file its final name, the index last: a directory with an index is complete). Files are
created and published as :mod:`ckptfmt.interop._exportfiles` says: never over, or through, a name that
exists in the output directory.

Each output tensor is produced block by block: a block is a C-contiguous range of the output
(rows of the leading axis, or of a later axis when one row is larger than the block), its
source boxes are read with :meth:`Checkpoint.iter_read_boxes` (every byte verified against the
manifest before it is handed over; the next blocks are read while this one is written), then
assembled (the mapping's transforms), cast (``dtype``) and written at its offset. Host memory
held at once: the reader's window (:data:`READ_WINDOW`) plus one block and its cast, whatever the
tensor and checkpoint sizes, plus the stored chunks several blocks share (a stacked tensor's
chunks span its layers), read once and held for the blocks that need them, up to
:data:`SHARED_CHUNK_BYTES`. The header is written last, at offset 0, with the crc32c of every
:data:`CRC_BLOCK` bytes of each tensor (their hex digits have a fixed width, so the header's size
is known before the data): docs/INTEROP.md, "Checksummed safetensors".
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import crc32c as _crc32c
import numpy as np

from ckptfmt.storage._durable import fill, fsync_dir, pwritev_all
from ckptfmt.interop._exportfiles import CONFIG_NAME, check_out_dir, create_exclusive, encode_config, publish, temp_name
from ckptfmt.interop._safetensors import (FORMAT_DTYPES, META_BLOCK, META_CRC, META_TABLE_CRC, META_VERSION,
                                          encode_header, table_crc)
from ckptfmt._types import Box
from ckptfmt.dtypes import DTYPES, dtype_name, numpy_dtype
from ckptfmt.errors import StorageError
from ckptfmt.reader import Checkpoint

__all__ = ["ExportTensor", "BlockSource", "ExportFile", "ExportPlan", "ExportReport", "Identity", "plan_export", "write_part",
           "finish_export", "begin_export", "discard_parts", "check_out_dir", "output_dtype", "parse_size", "natural_key", "INDEX_NAME", "CRC_BLOCK",
           "BLOCK_BYTES", "READ_WINDOW"]

INDEX_NAME = "model.safetensors.index.json"
#: Bytes per checksummed block of a tensor (recorded in each file; readers take it from there).
CRC_BLOCK = 1 << 20
#: Output bytes produced at once (one block of one tensor).
BLOCK_BYTES = 16 << 20
#: Bytes of source reads in flight (the reader's window during an export).
READ_WINDOW = 64 << 20
#: Stored chunks an export holds for the later blocks that read them again (stacked layers).
SHARED_CHUNK_BYTES = 256 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Identity:
    """The source of an output tensor that is one checkpoint tensor as is."""

    key: str

    def reads(self, box: Box) -> list[tuple[str, Box]]:
        return [(self.key, box)]

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        return blocks[0]


class BlockSource(Protocol):
    """Where an output tensor's blocks come from: :class:`Identity`, or a mapping's chain (a
    :class:`ckptfmt.restoreplan.MappingChain`)."""

    def reads(self, box: Box) -> list[tuple[str, Box]]:
        """The (checkpoint key, box) reads that the output block at ``box`` needs."""
        ...

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        """The output block at ``box`` from the verified blocks of :meth:`reads`, in order."""
        ...


@dataclass(frozen=True)
class ExportTensor:
    """One output tensor: its name, shape and dtype in the file, and where its blocks come from
    (``source.reads(box)`` -> [(checkpoint key, box)], ``source.assemble(box, blocks)`` -> array;
    :class:`Identity` or a mapping's ``Chain``). ``source_dtype``: what ``assemble`` returns."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source_dtype: str
    source: BlockSource

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]


@dataclass(frozen=True)
class ExportFile:
    name: str
    tensors: tuple[ExportTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ExportPlan:
    """What goes where. ``digest`` names the plan (files, tensors, shapes, dtypes, sources) so that
    writers in other processes can prove they computed the same one."""

    url: str
    step: int
    save_id: str
    files: tuple[ExportFile, ...]
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: files, tensors, tensor bytes, bytes read from the checkpoint, seconds;
    ``unmapped``: checkpoint keys no output reads; ``unwritten``: target tensors the mapping names
    for the whole model that a partial export (``allow_partial``) left out."""

    out_dir: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    bytes_read: int
    seconds: float
    step: int
    save_id: str
    unmapped: tuple[str, ...] = ()
    unwritten: tuple[str, ...] = ()


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B?)\s*", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string as ``transformers`` writes them: ``"5GB"`` (10^9), ``"500MiB"``
    (2^20), ``"100KB"``, ``"4096"``. ValueError for anything else, or a size below 1 byte."""
    if isinstance(size, bool):
        raise ValueError(f"not a size: {size!r}")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(str(size))
        if m is None:
            raise ValueError(f"not a size: {size!r} (e.g. 5GB, 500MiB, 100KB, 4096)")
        unit = m.group(2).upper().rstrip("B")
        scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
        n = int(float(m.group(1)) * scale)
    if n < 1:
        raise ValueError(f"size must be at least 1 byte, got {size!r}")
    return n


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"([0-9]+)", name) if p)


def plan_export(url: str, step: int, save_id: str, tensors: Sequence[ExportTensor], max_shard_bytes: int) -> ExportPlan:
    """Pack ``tensors`` (in their order) into files of at most ``max_shard_bytes`` (a larger tensor gets
    a file of its own), named ``model-XXXXX-of-YYYYY.safetensors``. Pure. ValueError for a repeated
    name or a dtype safetensors cannot hold."""
    seen: set[str] = set()
    groups: list[list[ExportTensor]] = []
    held = 0
    for t in tensors:
        if t.name in seen or t.name == "__metadata__":
            raise ValueError(f"two output tensors are named {t.name!r}")
        if t.dtype not in FORMAT_DTYPES:
            raise ValueError(f"{t.name!r}: dtype {t.dtype} has no safetensors dtype")
        seen.add(t.name)
        if not groups or (held + t.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            held = 0
        groups[-1].append(t)
        held += t.nbytes
    n = len(groups)
    files = tuple(ExportFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups))
    h = hashlib.sha256()
    for f in files:
        for t in f.tensors:
            h.update(json.dumps([f.name, t.name, list(t.shape), t.dtype, t.source_dtype, repr(t.source)]).encode())
    return ExportPlan(str(url), int(step), str(save_id), files, h.hexdigest())


def _blocks(shape: tuple[int, ...], item: int, window: int) -> Iterator[Box]:
    """C-contiguous boxes of at most ``window`` bytes (at least one innermost row) tiling ``shape``."""
    if not shape:
        yield Box((), ())
        return
    if 0 in shape:
        return
    k = 0
    while k < len(shape) - 1 and math.prod(shape[k + 1:]) * item > window:
        k += 1
    per = max(1, window // (math.prod(shape[k + 1:]) * item))
    for outer in product(*(range(n) for n in shape[:k])):
        for lo in range(0, shape[k], per):
            yield Box(tuple(outer) + (lo,) + (0,) * (len(shape) - k - 1),
                      (1,) * k + (min(per, shape[k] - lo),) + tuple(shape[k + 1:]))


class _BlockCrc:
    """crc32c of every ``block`` bytes of a byte stream, fed in pieces of any size."""

    def __init__(self, block: int) -> None:
        self.block, self.value, self.filled, self.done = block, 0, 0, []  # type: ignore[var-annotated]

    def feed(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.block - self.filled)
            self.value = _crc32c.crc32c(data[:take], self.value)
            self.filled += take
            data = data[take:]
            if self.filled == self.block:
                self.done.append(self.value)
                self.value, self.filled = 0, 0

    def hex(self) -> str:
        out = self.done + ([self.value] if self.filled else [])
        return "".join(f"{c:08x}" for c in out)


def _metadata(plan: ExportPlan, crcs: Mapping[str, str], table: str) -> dict[str, str]:
    return {"format": "pt", META_VERSION: "1", "ckptfmt.source": plan.url, "ckptfmt.step": str(plan.step),
            "ckptfmt.save_id": plan.save_id, META_BLOCK: str(CRC_BLOCK),
            META_CRC: json.dumps(dict(crcs), separators=(",", ":"), allow_nan=False), META_TABLE_CRC: table}


def begin_export(out_dir: str, plan: ExportPlan, config: Mapping[str, Any] | None = None) -> None:
    """Check what can be checked before any byte is written, and create ``out_dir``: the config
    encodes (InvalidConfigError), and ``out_dir`` holds no safetensors file or index and none of
    this export's names or temporary names (OutputExistsError, links included)."""
    if config is not None:
        encode_config(config)
    names = [f.name for f in plan.files] + [INDEX_NAME] + ([CONFIG_NAME] if config is not None else [])
    check_out_dir(out_dir, names)


def write_part(ckpt: Checkpoint, plan: ExportPlan, out_dir: str, *, part: tuple[int, int] = (0, 1),
               progress: Progress | None = None) -> list[str]:
    """Write the files whose number ``i`` has ``i % world == rank`` (``part = (rank, world)``).

    Every byte read is verified by the checkpoint's reader before it is written; each file is
    created under its temporary name (:func:`ckptfmt.interop._exportfiles.temp_name`) with ``O_EXCL |
    O_NOFOLLOW`` and fsynced; :func:`finish_export` gives it its final name. Returns the file names
    written. On failure raises the reader's CheckpointError, StorageError or OutputExistsError (a
    temporary name exists: nothing is truncated or followed) and removes the files it created.
    """
    rank, world = part
    mine = [f for i, f in enumerate(plan.files) if i % world == rank]
    total = sum(f.nbytes for f in mine)
    done = 0
    written: list[str] = []
    try:
        for f in mine:
            done = _write_file(ckpt, plan, f, out_dir, done, total, progress)
            written.append(f.name)
    except BaseException:
        discard_parts(out_dir, written)
        raise
    return written


def discard_parts(out_dir: str, names: Sequence[str]) -> None:
    """Remove the temporary files of ``names`` that are regular files (what :func:`write_part`
    wrote); links and final names are left alone."""
    for name in names:
        tmp = os.path.join(out_dir, temp_name(name))
        try:
            if stat.S_ISREG(os.lstat(tmp).st_mode):
                os.unlink(tmp)
        except OSError:
            pass


def _write_file(ckpt: Checkpoint, plan: ExportPlan, f: ExportFile, out_dir: str, done: int, total: int,
                progress: Progress | None) -> int:
    dummy = {t.name: "0" * (8 * -(-t.nbytes // CRC_BLOCK)) for t in f.tensors}
    layout = [(t.name, t.dtype, t.shape) for t in f.tensors]
    header, entries = encode_header(layout, _metadata(plan, dummy, "0" * 8))
    table = table_crc(entries, len(header))
    tmp = os.path.join(out_dir, temp_name(f.name))
    # Tensors reading the same checkpoint tensor go one after another (a stacked tensor's layers),
    # so that the stored chunks they share are read once and held only while they are needed.
    order = sorted(f.tensors, key=lambda t: _first_source(t))
    blocks = [(t, b) for t in order for b in _blocks(t.shape, DTYPES[t.dtype], BLOCK_BYTES)]
    fd = create_exclusive(tmp)
    try:
        crcs = {t.name: _BlockCrc(CRC_BLOCK) for t in f.tensors}
        pos = {e.name: e.begin for e in entries}
        reader = _SharedChunkReads(ckpt, [t.source.reads(b) for t, b in blocks], SHARED_CHUNK_BYTES).blocks()
        try:
            for (t, box), got in zip(blocks, reader):
                arr = t.source.assemble(box, got)
                want = numpy_dtype(t.dtype)
                if arr.dtype != want:
                    arr = arr.astype(want)
                if not arr.flags.c_contiguous:
                    arr = arr.copy(order="C")  # np.ascontiguousarray would make a 0-d array 1-d
                if arr.shape != box.shape:
                    raise StorageError("an assembled block does not have its box's shape", key=t.name,
                                       object=f.name, expected=box.shape, found=arr.shape)
                data = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
                crcs[t.name].feed(data)
                pwritev_all(fd, [data], pos[t.name], obj=tmp)
                pos[t.name] += len(data)
                done += len(data)
                del arr, got
                if progress:
                    progress(done, total)
        finally:
            reader.close()
        for e in entries:
            if pos[e.name] != e.end:
                raise StorageError("a tensor was not written whole", key=e.name, object=f.name,
                                   expected=e.end - e.begin, found=pos[e.name] - e.begin)
        final, _ = encode_header(layout, _metadata(plan, {n: c.hex() for n, c in crcs.items()}, table))
        if len(final) != len(header):  # fixed-width digits: cannot differ
            raise StorageError("the header changed size", object=f.name, expected=len(header), found=len(final))
        pwritev_all(fd, [final], 0, obj=tmp)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    return done


def _first_source(t: ExportTensor) -> str:
    """The checkpoint key the first block of ``t`` reads first ("" when it reads nothing)."""
    if 0 in t.shape:
        return ""
    first = t.source.reads(Box((0,) * len(t.shape), (1,) * len(t.shape)))
    return first[0][0] if first else ""


class _SharedChunkReads:
    """The verified arrays of each block's reads, in order, reading each stored chunk that
    several blocks share once (a stacked tensor whose chunks span every layer is otherwise read
    once per layer). A block that shares no chunk is read through the reader's window as before;
    a shared chunk is read with :meth:`Checkpoint.read_chunks` (checked), held until the last
    block that needs it (at most ``budget`` bytes: past it, the chunk needed furthest ahead is
    dropped and read again when needed), and handed to :meth:`Checkpoint.read_boxes` as a
    supplied chunk, which checks it again before assembling."""

    def __init__(self, ckpt: Checkpoint, requests: Sequence[Sequence[tuple[str, Box]]], budget: int) -> None:
        self.ckpt, self.requests, self.budget = ckpt, requests, budget
        self.refs = [ckpt.chunk_refs(r) if r else [] for r in requests]
        self.uses: dict[Any, list[int]] = {}
        for i, refs in enumerate(self.refs):
            for ref in refs:
                self.uses.setdefault(ref, []).append(i)
        self.shared = [any(len(self.uses[ref]) > 1 for ref in refs) for refs in self.refs]

    def blocks(self) -> Iterator[list[np.ndarray]]:
        plain = self.ckpt.iter_read_boxes([r for r, sh in zip(self.requests, self.shared) if not sh])
        held: dict[Any, np.ndarray] = {}
        try:
            for i, reqs in enumerate(self.requests):
                if not self.shared[i]:
                    yield next(plain)
                    continue
                missing = [ref for ref in self.refs[i] if ref not in held]
                held.update(zip(missing, self.ckpt.read_chunks(missing)) if missing else ())
                yield self.ckpt.read_boxes(reqs, supplied={ref: (held[ref], "this export") for ref in self.refs[i]})
                self._release(held, i)
        finally:
            plain.close()

    def _release(self, held: dict[Any, np.ndarray], i: int) -> None:
        """Drop the chunks no later block needs, then the ones needed furthest ahead past the budget."""
        def next_use(ref: Any) -> int:
            uses = self.uses[ref]  # ascending block numbers
            k = bisect.bisect_right(uses, i)
            return uses[k] if k < len(uses) else -1
        ahead = {ref: next_use(ref) for ref in held}
        for ref, j in ahead.items():
            if j < 0:
                del held[ref]
        size = sum(int(a.nbytes) for a in held.values())
        for ref in sorted(held, key=lambda r: -ahead[r]):
            if size <= self.budget:
                break
            size -= int(held.pop(ref).nbytes)


def _write_new(out_dir: str, name: str, data: bytes) -> str:
    """``data`` in a new temporary file for ``name`` (created exclusively), fsynced; its path."""
    tmp = os.path.join(out_dir, temp_name(name))
    fill(create_exclusive(tmp), tmp, [data])
    return tmp


def finish_export(out_dir: str, plan: ExportPlan, config: Mapping[str, Any] | None = None) -> None:
    """Publish the export once every :func:`write_part` succeeded: write the temporary
    ``config.json`` (when given) and index, then give every file its final name, weights first
    and the index last (a directory with an index is complete), fsyncing the directory.

    Raises before publishing anything: InvalidConfigError for a config that cannot be written,
    StorageError when a planned file's temporary file is absent (or not a regular file). Never
    replaces or follows an existing name: OutputExistsError, after which (as after any failure)
    every name it published and every temporary file of this export is removed.
    """
    blob = encode_config(config) if config is not None else None
    for f in plan.files:
        tmp = os.path.join(out_dir, temp_name(f.name))
        try:
            regular = stat.S_ISREG(os.lstat(tmp).st_mode)
        except FileNotFoundError:
            regular = None
        if not regular:
            raise StorageError("a planned safetensors file was not written", object=tmp,
                               expected="a regular file", found="missing" if regular is None else "not a regular file")
    weight_map = {t.name: f.name for f in plan.files for t in f.tensors}
    meta = {"total_size": plan.nbytes, META_VERSION: "1", "ckptfmt.source": plan.url,
            "ckptfmt.step": str(plan.step), "ckptfmt.save_id": plan.save_id}
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items(), key=lambda kv: natural_key(kv[0])))}
    names = [f.name for f in plan.files]
    published: list[str] = []
    try:
        fsync_dir(out_dir)
        if blob is not None:
            _write_new(out_dir, CONFIG_NAME, blob)
            names.append(CONFIG_NAME)
        _write_new(out_dir, INDEX_NAME, (json.dumps(index, indent=2, allow_nan=False) + "\n").encode("utf-8"))
        names.append(INDEX_NAME)
        for name in names:
            publish(os.path.join(out_dir, temp_name(name)), os.path.join(out_dir, name))
            published.append(name)
        fsync_dir(out_dir)
    except BaseException:
        for name in published:
            try:
                os.unlink(os.path.join(out_dir, name))
            except OSError:
                pass
        discard_parts(out_dir, [n for n in names if n not in published])
        raise


def output_dtype(source: str, dtype: str | None) -> str:
    """The file dtype of a tensor: ``dtype`` for floating-point sources when given, else the source's."""
    if dtype is None:
        return source
    want = dtype_name(numpy_dtype(dtype) if dtype in DTYPES else np.dtype(dtype))
    floating = source.startswith(("float", "bfloat"))
    return want if floating else source
