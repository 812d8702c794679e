"""A safetensors file or sharded directory, opened for reading as a
:class:`ckptfmt.restoreplan.RestoreSource` (the protocol a committed step implements too; here
``state()`` / ``rank_state()`` return None), so the bridges restore from it as from a step.

Call order: :func:`find_safetensors` (is the URL a safetensors source, and which files) ->
:class:`SafetensorsSource` (reads the index and every file's header, validates them all before
any tensor byte is read) -> ``read_boxes`` (per box, only the byte ranges it covers).

What is verified (docs/INTEROP.md, "What is verified"):

* always: every header (:func:`ckptfmt.interop._safetensors.parse_header`), the index against the files
  (every name in the index is in the file it names, every tensor of every file is in the index,
  no name twice), each file's size against its header (before any tensor byte is read), the
  bytes of bool tensors (0x00 / 0x01);
* when the files carry ckptfmt's checksums (our export writes them): the tensor table's crc32c at
  open, and a crc32c per block of each tensor's bytes: a read fetches whole blocks and returns
  nothing until every block it touched matched;
* never, for files without them (every other writer): the tensor bytes themselves. safetensors
  has no checksums; a flipped data byte is returned as read. :attr:`SafetensorsSource.checksummed`
  says which case holds.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ckptfmt.reader._alloc import allocate, check_outputs_fit
from ckptfmt.interop._safetensors import (MAX_INDEX_BYTES, MAX_TENSORS, META_BLOCK, META_CRC, META_TABLE_CRC, META_VERSION,
                                          bool_bytes_valid, header_size, parse_header, parse_index, table_crc)
from ckptfmt._types import Box
from ckptfmt.checksum import crc32c
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import (ChecksumMismatchError, InvalidDataError, InvalidSourceError, KeyMismatchError,
                            ShapeMismatchError, SizeMismatchError)
from ckptfmt.rankstate import RankStatePolicy
from ckptfmt.reader import ReadStats
from ckptfmt.storage import PositionalFile, StorageOptions, open_storage

__all__ = ["SafetensorsSource", "SourceTensor", "SourceManifest", "find_safetensors", "MAX_INDEX_BYTES"]

#: Bytes fetched and held at once by one read (the checksummed path's scratch, in block units).
READ_WINDOW = 16 << 20
#: Remote stores: byte ranges closer than this are fetched as one request.
REMOTE_GAP = 64 << 10


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """One tensor of the source, as :meth:`SafetensorsSource.tensor` returns it (``key``, ``shape``,
    ``dtype`` as a manifest's TensorEntry has them) plus where its bytes lie."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    begin: int
    end: int
    crcs: tuple[int, ...] | None = None  # crc32c per block, when the file carries them
    block: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SourceManifest:
    """What a restore asks of a manifest, for a source that has none: no non-tensor state, one writer."""

    step: int
    tensors: Mapping[str, SourceTensor]
    metadata: Mapping[str, Any]
    writers: int = 1
    state: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _split(url: str) -> tuple[str, str]:
    base, _, name = url.rstrip("/").rpartition("/")
    if not base and url.startswith("/"):
        base = "/"
    return base or ".", name


def find_safetensors(url: str, options: StorageOptions | Mapping[str, Any] | None = None) -> tuple[str, str] | None:
    """(directory URL, index or file name) when ``url`` names a safetensors source, else None.

    A source is a ``.safetensors`` file, a ``.safetensors.index.json`` file, or a directory that is
    not a ckptfmt repository (no ``ckptfmt.json``, no ``manifests/``) and holds one
    ``*.safetensors.index.json`` or else one ``*.safetensors`` (on object stores: the names
    ``model.safetensors.index.json`` or ``model.safetensors``). Reads at most a directory listing
    and a few existence probes; raises only for a URL that cannot be opened at all.
    """
    s = str(url)
    if s.endswith(".safetensors") or s.endswith(".safetensors.index.json"):
        return _split(s)
    storage = open_storage(s, options)
    root = getattr(storage, "root", None)  # a local directory (LocalFileStorage), else None
    if root is not None:
        if not os.path.isdir(root) or os.path.exists(root + "ckptfmt.json") or os.path.exists(root + "manifests"):
            return None
        names = sorted(n for n in os.listdir(root) if os.path.isfile(root + n))
        for suffix, usual in ((".safetensors.index.json", "model.safetensors.index.json"), (".safetensors", "model.safetensors")):
            found = [n for n in names if n.endswith(suffix)]
            if len(found) == 1 or usual in found:
                return s, found[0] if len(found) == 1 else usual
            if found:
                return None  # several and none of the usual name: ambiguous
        return None
    if storage.read_upto("ckptfmt.json", 0, 1) is not None:
        return None
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if storage.read_upto(name, 0, 1) is not None:
            return s, name
    return None


class SafetensorsSource:
    """A safetensors source opened for reading (see the module docstring for what is verified).

    ``url``: a ``.safetensors`` file, an index file, or a directory (local, ``file://``, ``s3://``,
    ``gs://``, ``memory://``). Raises InvalidSourceError (a header, the index, or the two
    disagree), MissingShardError / SizeMismatchError (a file absent or of the wrong size),
    ChecksumMismatchError (the tensor table's checksum), all before any tensor byte is read.
    """

    def __init__(self, url: str, *, options: StorageOptions | Mapping[str, Any] | None = None, found: tuple[str, str] | None = None) -> None:
        self.url = str(url)
        where = found or find_safetensors(self.url, options)
        if where is None:
            raise InvalidSourceError("not a safetensors source", object=self.url,
                                     expected="a .safetensors file, an index, or a directory holding one",
                                     found="none of these")
        self.base, name = where
        self.storage = open_storage(self.base, options)
        self.stats = ReadStats()
        self.header_bytes = 0  # read at open (counted in stats.bytes_read too)
        self.index_name = name if name.endswith(".index.json") else None
        self.index_metadata: dict[str, Any] = {}
        files, weight_map = self._files(name)
        self.file_sizes: dict[str, int] = {}
        self.file_metadata: dict[str, dict[str, str]] = {}
        tensors: dict[str, SourceTensor] = {}
        headers: dict[str, Any] = {}
        for f in files:  # every file present and consistent first; the whole source within the tensor cap
            headers[f] = self._header(f, MAX_TENSORS - sum(len(h.tensors) for h in headers.values()))
        for f, header in headers.items():
            self.file_sizes[f] = header.size
            self.file_metadata[f] = dict(header.metadata)
            crcs, block = self._checksums(f, header.tensors.values(), header.metadata, header.data_start)
            for e in header.tensors.values():
                if weight_map is not None and weight_map.get(e.name) != f:
                    raise InvalidSourceError("a tensor of a file is not listed for that file in the index", key=e.name,
                                             object=f, expected=f"weight_map[{e.name!r}] == {f!r}",
                                             found=weight_map.get(e.name))
                if e.name in tensors:
                    raise InvalidSourceError("a tensor name appears in two files", key=e.name, object=f,
                                             expected="one file", found=[tensors[e.name].file, f])
                tensors[e.name] = SourceTensor(e.name, e.shape, e.dtype, f, e.begin, e.end,
                                               crcs.get(e.name) if crcs is not None else None, block)
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(tensors))
            if lost:
                raise InvalidSourceError("the index names tensors its files do not hold", key=lost[0],
                                         object=self.index_name, expected="every weight_map entry in its file",
                                         found=f"{len(lost)} missing")
        self.checksummed = bool(files) and all(t.crcs is not None for t in tensors.values())
        self.origin = self._origin()
        step = self.origin.get("step")
        self.manifest = SourceManifest(step if isinstance(step, int) else 0, tensors, self.origin)

    # ------------------------------------------------------------------ opening
    def _files(self, name: str) -> tuple[list[str], dict[str, str] | None]:
        if self.index_name is None:
            return [name], None
        self._local_file(name)
        data = self.storage.read(name, max_bytes=MAX_INDEX_BYTES)
        if data is None:
            raise InvalidSourceError("safetensors index is missing", object=name, expected="present", found="missing")
        if len(data) > MAX_INDEX_BYTES:
            raise InvalidSourceError("safetensors index exceeds the size cap", object=name,
                                     expected=f"<= {MAX_INDEX_BYTES} bytes", found="larger")
        wm, self.index_metadata = parse_index(data, name)
        return sorted(set(wm.values())), wm

    def _local_file(self, f: str) -> None:
        """On a local directory: InvalidSourceError unless ``f`` is a plain file of the source directory
        (docs/INTEROP.md: the importer never follows a link, nor reads outside the source)."""
        root = getattr(self.storage, "root", None)
        if root is None:  # an object store: keys, no links
            return
        path = root + f
        if os.path.islink(path):
            raise InvalidSourceError("a safetensors source file is a symbolic link", object=f,
                                     expected="a plain file in the source directory", found=f"a link to {os.readlink(path)!r}")
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise InvalidSourceError("a safetensors source file resolves outside the source directory", object=f,
                                     expected=f"a file under {base}", found=real)

    def _header(self, f: str, max_tensors: int = MAX_TENSORS) -> Any:
        self._local_file(f)
        size = None  # on an object store the header implies the size (checked below)
        if self.storage.positional_reads:
            with self.storage.open_positional(f) as pf:  # MissingShardError when absent
                size = pf.size
        prefix = self._range(f, 0, 8, size)
        n = header_size(prefix, size if size is not None else 1 << 62, f)
        header = parse_header(self._range(f, 8, 8 + n, size), size, f, max(0, max_tensors))
        if size is None:  # an object store: the header implies the size; check it (two one-byte probes)
            faults = self.storage.size_faults([(f, header.size)])
            if faults:
                raise SizeMismatchError("safetensors file size differs from its header", object=f,
                                        expected=f"{header.size} bytes", found=faults[0])
        self.stats.bytes_read += 8 + n
        self.header_bytes += 8 + n
        return header

    def _range(self, f: str, start: int, stop: int, size: int | None) -> bytes:
        if size is not None and stop > size:
            raise SizeMismatchError("safetensors file is shorter than its header needs", object=f,
                                    expected=f">= {stop} bytes", found=size)
        data = self.storage.read_range(f, start, stop).result()
        if len(data) != stop - start:
            raise SizeMismatchError("safetensors file is shorter than its header needs", object=f,
                                    expected=f">= {stop} bytes", found=start + len(data))
        return data

    def _checksums(self, f: str, entries: Any, meta: Mapping[str, str], data_start: int) -> tuple[dict[str, tuple[int, ...]] | None, int]:
        """The file's per-block crc32c (ckptfmt export), checked for form; (None, 0) when absent."""
        if META_CRC not in meta:
            return None, 0
        entries = list(entries)
        try:
            block = int(meta.get(META_BLOCK, ""))
            table = json.loads(meta[META_CRC])
            if block <= 0 or not isinstance(table, dict):
                raise ValueError("block size or table")
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidSourceError("the file's ckptfmt checksums are malformed", object=f, key=META_CRC,
                                     expected="a block size and a map of names to hex digits", found=str(e)[:200]) from None
        want = meta.get(META_TABLE_CRC)
        got = table_crc(entries, data_start)
        if want != got:
            raise ChecksumMismatchError("the tensor table differs from the one the checksums were written for",
                                        object=f, key=META_TABLE_CRC, expected=want, found=got)
        out: dict[str, tuple[int, ...]] = {}
        for e in entries:
            digits = table.get(e.name)
            n = -(-e.nbytes // block)
            if not isinstance(digits, str) or len(digits) != 8 * n or not re.fullmatch(r"[0-9a-f]*", digits):
                raise InvalidSourceError("a tensor's checksums do not match its size", key=e.name, object=f,
                                         expected=f"{n} crc32c of {block}-byte blocks", found=str(digits)[:80])
            out[e.name] = tuple(int(digits[i:i + 8], 16) for i in range(0, len(digits), 8))
        return out, block

    def _origin(self) -> dict[str, Any]:
        """What our export recorded (source, step, save id), when every file agrees; else {}."""
        seen = {(m.get("ckptfmt.source"), m.get("ckptfmt.step"), m.get("ckptfmt.save_id"))
                for m in self.file_metadata.values() if META_VERSION in m}
        if len(seen) != 1 or len(self.file_metadata) == 0 or \
                not all(META_VERSION in m for m in self.file_metadata.values()):
            return {}
        src, step, save_id = seen.pop()
        return {"source": src, "step": int(step) if step and step.isdigit() else None, "save_id": save_id}

    # ------------------------------------------------------------------ the RestoreSource protocol
    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def saved_world(self) -> int:
        return 1

    def keys(self) -> list[str]:
        return sorted(self.manifest.tensors)

    def tensor(self, key: str) -> SourceTensor:
        try:
            return self.manifest.tensors[key]
        except KeyError:
            raise KeyMismatchError("tensor is not in the safetensors source", key=key, object=self.url,
                                   expected="a tensor name of the source", found="missing") from None

    def state(self) -> None:
        return None  # a safetensors source holds no non-tensor state

    def rank_state(self, rank: int, *, world: int | None = None, policy: str | None = None) -> None:
        """A safetensors source holds no per-rank state (an unknown ``policy`` is still a ValueError)."""
        RankStatePolicy.of(policy)

    def read(self, key: str, box: Box | None = None) -> np.ndarray:
        return self.read_boxes([(key, box if box is not None else Box.full(self.tensor(key).shape))])[0]

    def read_boxes(self, requests: Sequence[tuple[str, Box]]) -> list[np.ndarray]:
        """Read boxes of tensors: each box's byte ranges only (whole checksum blocks when the file
        carries them). Returns fresh arrays once every byte read for them passed every check this
        source allows (module docstring); on any fault raises and returns nothing."""
        entries = [self.tensor(k) for k, _ in requests]
        for (key, box), t in zip(requests, entries):
            if len(box.shape) != len(t.shape) or any(o < 0 or o + s > n for o, s, n in zip(box.offset, box.shape, t.shape)):
                raise ShapeMismatchError("requested box lies outside the tensor", key=key, object=t.file,
                                         expected=list(t.shape), found=str(box))
        check_outputs_fit([(k, b.size * numpy_dtype(t.dtype).itemsize) for (k, b), t in zip(requests, entries)], self.url)
        outs = [allocate(k, b, numpy_dtype(t.dtype)) for (k, b), t in zip(requests, entries)]
        fds: dict[str, PositionalFile] = {}
        try:
            for (key, box), t, out in zip(requests, entries, outs):
                if out.size:
                    self._read_box(t, box, out, fds)
                    if t.dtype == "bool" and not bool_bytes_valid(out):
                        raise InvalidDataError("a bool tensor holds a byte other than 0x00 or 0x01", key=key,
                                               object=t.file, expected="0x00 or 0x01", found="another byte")
        finally:
            for pf in fds.values():
                pf.close()
        self.stats.objects += len({t.file for t in entries})
        return outs

    def iter_read_boxes(self, batches: Sequence[Sequence[tuple[str, Box]]]) -> Iterator[list[np.ndarray]]:
        """Each batch's arrays in order, each batch read and checked as :meth:`read_boxes` does."""
        for batch in batches:
            yield self.read_boxes(batch)

    def verify(self, progress: Any = None) -> int:
        """Read every tensor in windows and check what this source allows; returns bytes read."""
        total, done = self.manifest.nbytes, 0
        for key in self.keys():
            t = self.tensor(key)
            item = numpy_dtype(t.dtype).itemsize
            rows = t.shape[0] if t.shape else 1
            per = max(1, READ_WINDOW // max(1, t.nbytes // max(rows, 1))) if t.shape else 1
            for lo in range(0, rows, per) if t.shape and t.nbytes else [0]:
                box = Box((lo,) + (0,) * (len(t.shape) - 1), (min(per, rows - lo),) + t.shape[1:]) if t.shape else Box((), ())
                done += self.read_boxes([(key, box)])[0].size * item
                if progress:
                    progress(done, total)
        return done

    # ------------------------------------------------------------------ reading
    def _read_box(self, t: SourceTensor, box: Box, out: np.ndarray, fds: dict[str, PositionalFile]) -> None:
        starts, run = _runs(t, box, numpy_dtype(t.dtype).itemsize)
        flat = out.reshape(-1).view(np.uint8)
        ends = starts + run
        local = self.storage.positional_reads
        if t.crcs is None:
            ranges = _merge(starts, ends, 0 if local else REMOTE_GAP)
        else:
            blocks = _block_union((starts - t.begin) // t.block, (ends - 1 - t.begin) // t.block)
            ranges = [(t.begin + int(a) * t.block, min(t.end, t.begin + (int(b) + 1) * t.block))
                      for a, b in _consecutive(blocks)]
        for group in _groups(ranges, READ_WINDOW):
            bufs = self._fetch(t, group, fds, starts, run, flat)
            if t.crcs is not None:
                for (rs, re_), buf in zip(group, bufs):
                    _check_blocks(t, rs, re_, buf)
            for (rs, re_), buf in zip(group, bufs):
                if buf is not None and not np.may_share_memory(buf, flat):
                    _copy_runs(starts, run, rs, re_, buf, flat)

    def _fetch(self, t: SourceTensor, group: list[tuple[int, int]], fds: dict[str, PositionalFile], starts: np.ndarray,
               run: int, flat: np.ndarray) -> list[Any]:
        """Bytes of each range (a view of the output where it was read in place; None where no check
        needs it)."""
        self.stats.requests += len(group)
        self.stats.bytes_read += sum(b - a for a, b in group)
        if self.storage.positional_reads:
            pf = fds.get(t.file)
            if pf is None:
                self._local_file(t.file)  # checked at open too; a file swapped for a link since then is refused
                pf = fds[t.file] = self.storage.open_positional(t.file, tensor=t.key)
                size = pf.size
                if size != self.file_sizes[t.file]:
                    raise SizeMismatchError("safetensors file changed size since it was opened", key=t.key,
                                            object=t.file, expected=self.file_sizes[t.file], found=size)
            out: list[Any] = []
            for a, b in group:
                i = int(np.searchsorted(starts, a, side="right")) - 1
                if i >= 0 and b <= int(starts[i]) + run:
                    # inside one run: read straight into its place in the output, which is handed
                    # out only after every block read for it has been checked
                    at = i * run + (a - int(starts[i]))
                    pf.read_into([flat[at:at + (b - a)]], a)
                    out.append(None if t.crcs is None else flat[at:at + (b - a)])
                    continue
                buf = np.empty(b - a, np.uint8)
                pf.read_into([buf], a)
                out.append(buf)
            return out
        pending = [self.storage.read_range(t.file, a, b, tensor=t.key) for a, b in group]
        got = [p.result() for p in pending]
        for (a, b), g in zip(group, got):
            if len(g) != b - a:
                raise SizeMismatchError("safetensors file is shorter than its header says", key=t.key, object=t.file,
                                        expected=f"bytes [{a}, {b})", found=f"{len(g)} bytes")
        return [np.frombuffer(g, np.uint8) for g in got]


def _runs(t: SourceTensor, box: Box, item: int) -> tuple[np.ndarray, int]:
    """Absolute start offsets (C order of the box's outer indices) and the length of the contiguous
    byte runs a box covers. Axes after the last partial one are whole, so each run is contiguous in
    the file and in the box-shaped output alike."""
    shape, nd = t.shape, len(t.shape)
    if nd == 0:
        return np.array([t.begin], np.int64), item
    k = 0
    for d in range(nd - 1, -1, -1):
        if box.shape[d] != shape[d]:
            k = d
            break
    inner = math.prod(shape[k + 1:]) * item
    run = box.shape[k] * inner
    strides = [math.prod(shape[j + 1:]) * item for j in range(k)]
    starts = np.full(1, t.begin + box.offset[k] * inner, np.int64)
    for j in range(k):  # outer axes in C order
        idx = np.arange(box.offset[j], box.offset[j] + box.shape[j], dtype=np.int64) * strides[j]
        starts = (starts[:, None] + idx[None, :]).reshape(-1)
    return starts, run


def _merge(starts: np.ndarray, ends: np.ndarray, gap: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        if out and a - out[-1][1] <= gap and gap > 0:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _block_union(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """Sorted indexes of every block in the union of the inclusive ranges [b0[i], b1[i]]."""
    mark = np.zeros(int(b1.max()) + 2, np.int64)
    np.add.at(mark, b0, 1)
    np.add.at(mark, b1 + 1, -1)
    return np.flatnonzero(np.cumsum(mark)[:-1] > 0)


def _consecutive(blocks: np.ndarray) -> list[tuple[int, int]]:
    if not len(blocks):
        return []
    cut = np.flatnonzero(np.diff(blocks) != 1) + 1
    return [(int(p[0]), int(p[-1])) for p in np.split(blocks, cut)]


def _groups(ranges: list[tuple[int, int]], window: int) -> Iterator[list[tuple[int, int]]]:
    """Ranges in groups of about ``window`` bytes (a longer range is cut at window multiples)."""
    group: list[tuple[int, int]] = []
    held = 0
    for a, b in ranges:
        while b - a > window:
            if group:
                yield group
                group, held = [], 0
            yield [(a, a + window)]
            a += window
        if group and held + (b - a) > window:
            yield group
            group, held = [], 0
        group.append((a, b))
        held += b - a
    if group:
        yield group


def _check_blocks(t: SourceTensor, rs: int, re_: int, buf: np.ndarray) -> None:
    """Every checksum block inside [rs, re_) against the file's crc32c (ranges start on blocks)."""
    assert t.crcs is not None
    for a in range(rs, re_, t.block):
        b = min(a + t.block, t.end)
        i = (a - t.begin) // t.block
        if a - t.begin != i * t.block or (b != t.end and b - a != t.block) or b > re_:
            raise SizeMismatchError("a checked read does not cover whole checksum blocks", key=t.key, object=t.file,
                                    expected=f"block {i}", found=f"[{a}, {b})")
        got = crc32c(buf[a - rs:b - rs])
        if got != t.crcs[i]:
            raise ChecksumMismatchError("tensor bytes do not match the file's checksum", key=t.key, object=t.file,
                                        expected=f"crc32c {t.crcs[i]:08x} (block {i}, bytes [{a}, {b}))",
                                        found=f"crc32c {got:08x}")


def _copy_runs(starts: np.ndarray, run: int, rs: int, re_: int, buf: np.ndarray, flat: np.ndarray) -> None:
    """Copy the parts of every run that fall inside the fetched range [rs, re_) into the output."""
    lo = max(0, int(np.searchsorted(starts, rs - run, side="right")))
    hi = int(np.searchsorted(starts, re_, side="left"))
    for i in range(lo, hi):
        s = int(starts[i])
        a, b = max(s, rs), min(s + run, re_)
        if a < b:
            flat[i * run + (a - s):i * run + (b - s)] = buf[a - rs:b - rs]
