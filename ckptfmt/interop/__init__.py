"""Interop with Hugging Face safetensors: export a step, import a file or directory, or read one
directly with the reading interface of a committed step (docs/INTEROP.md).

* :func:`open_source`: a committed step of a repository, or a safetensors source, opened for
  reading; the bridges open every restore through it, so ``bridges.jax.restore`` and
  ``bridges.torch.load`` take a safetensors directory (each process reads only its own boxes).
* :func:`export_safetensors`: a committed step -> ``model-XXXXX-of-YYYYY.safetensors`` +
  ``model.safetensors.index.json`` (+ ``config.json``), streaming, every byte verified against the
  manifest, each file checksummed in its ``__metadata__``. Names and layouts come from
  ``tensors`` (by default every tensor as is; ``bridges.interop.export`` applies a mapping and
  runs several writer processes).
* :func:`import_safetensors`: a file or a sharded directory (local or object store) -> one
  committed step, streaming, with provenance in ``metadata["import"]``.

This module is the format core: numpy only, no framework. Orbax and DCP importers live in
``bridges.interop`` (they read through those libraries).

Subpackage ``ckptfmt.interop``. Interop with Hugging Face safetensors, a second format beside
ckptfmt's own: the defensive header parser and writer, a safetensors file or directory opened as a
source, the streaming export of a step and the import of a file as a step (docs/INTEROP.md). Its
modules: ``_exportfiles``, ``_safetensors``, ``_stexport``, ``_stimport``, ``_stsource``. May
import: floor, manifest, storage, reader, repository, session. The floor: the top-level modules
listed in ``ckptfmt/__init__.py`` (tests/test_layering.py holds the rules and enforces them). No
other subpackage may import it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ckptfmt.interop._safetensors import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from ckptfmt.interop._stexport import (BLOCK_BYTES, CRC_BLOCK, READ_WINDOW, BlockSource, ExportFile, ExportPlan,
                                       ExportReport, ExportTensor, Identity, begin_export, check_out_dir, discard_parts,
                                       finish_export, natural_key, output_dtype, parse_size, plan_export, write_part)
from ckptfmt.interop._stimport import BatchReader, ImportReport, ImportTensor, import_tensors
from ckptfmt.interop._safetensors import encode_header
from ckptfmt.interop._exportfiles import create_exclusive, publish, read_config, temp_name
from ckptfmt.interop._stsource import SafetensorsSource, SourceTensor, find_safetensors
from ckptfmt.interop._zarrrefs import zarr_references as zarr_references
from ckptfmt.interop._fp8 import FP8_BLOCK, FP8_SKIP, quantization_config, quantize_fp8
from ckptfmt._types import Box
from ckptfmt.errors import StepNotFoundError
from ckptfmt.reader import Checkpoint
from ckptfmt.repository import Repository
from ckptfmt.storage import StorageOptions
from ckptfmt.restoreplan import SCALE_COMPANIONS, RestoreSource, scale_companion

__all__ = ["open_source", "zarr_references", "export_safetensors", "prepare_export", "import_safetensors", "import_tensors",
           "identity_tensors", "safetensors_provenance", "SafetensorsSource", "SourceTensor", "find_safetensors",
           "ExportTensor", "BlockSource", "ExportFile", "ExportPlan", "ExportReport", "ImportTensor", "ImportReport", "Identity",
           "parse_size", "check_out_dir", "begin_export", "write_part", "discard_parts", "finish_export", "output_dtype", "CRC_BLOCK", "BLOCK_BYTES",
           "MAX_HEADER_BYTES", "DEFAULT_MAX_SHARD_SIZE", "QUANTIZE_MODES", "FP8_BLOCK", "FP8_SKIP", "quantize_fp8",
           "quantization_config", "quantized",
           # for the bridges' importers and exporters (Orbax, DCP, PEFT): a named interface, not private modules
           "BatchReader", "natural_key", "encode_header", "read_config", "create_exclusive", "publish", "temp_name"]

#: transformers' own default for ``save_pretrained(max_shard_size=...)``.
DEFAULT_MAX_SHARD_SIZE = "5GB"

Progress = Callable[[int, int], None]
TensorsFor = Callable[[Checkpoint], tuple[Sequence[ExportTensor], Sequence[str]]]
#: ``quantize=`` values of an export: None (as the checkpoint holds it) or block-FP8.
QUANTIZE_MODES = (None, "fp8")


def quantized(tensors: TensorsFor | None, quantize: str | None, dtype: str | None,
              kept: list[str]) -> TensorsFor | None:
    """``tensors`` (None: :func:`identity_tensors`) with ``quantize="fp8"`` applied
    (:func:`quantize_fp8`); the module names left in high precision are appended to ``kept``.
    ValueError for another mode."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r}: one of {QUANTIZE_MODES}")
    if quantize is None:
        return tensors

    def fp8(ckpt: Checkpoint) -> tuple[Sequence[ExportTensor], Sequence[str]]:
        outs, unmapped = tensors(ckpt) if tensors is not None else identity_tensors(ckpt, dtype)
        outs, left = quantize_fp8(outs)
        kept.extend(left)
        return outs, unmapped
    return fp8


def open_source(url: str, step: int | None = None, *, resolve: Callable[[Repository, int | None], int | None] | None = None,
                options: StorageOptions | Mapping[str, Any] | None = None) -> RestoreSource:
    """A committed step of the repository at ``url`` (a :class:`ckptfmt.Checkpoint`), or, when
    ``url`` names a safetensors file or directory, a :class:`SafetensorsSource` with the same
    reading interface (no steps: ``step`` must be None or the step its export recorded).

    ``resolve(repository, step)`` picks the step to open (the bridges agree on the latest step
    across processes); default: ``step`` itself (None: the latest). Fails as
    :meth:`Repository.open` does, or as :class:`SafetensorsSource` does (InvalidSourceError,
    SizeMismatchError, ...), before any tensor byte is read.
    """
    found = find_safetensors(str(url), options)
    if found is not None:
        source = SafetensorsSource(str(url), options=options, found=found)
        if step is not None and step != source.step:
            raise StepNotFoundError("a safetensors source holds one set of tensors, not steps", object=str(url),
                                    expected=f"step None (or {source.step}, the step it was exported from)", found=step)
        return source
    repo = Repository(str(url), options=options)
    return repo.open(resolve(repo, step) if resolve is not None else step)


def identity_tensors(ckpt: Checkpoint, dtype: str | None = None) -> tuple[list[ExportTensor], list[str]]:
    """Every tensor of the checkpoint under its own key path (natural order), cast to ``dtype``
    when floating-point, but quantized weights (float8 codes with a scale companion, and the
    companion): a cast would lose their scaling."""
    out = []
    keys = set(ckpt.keys())
    for key in sorted(keys, key=natural_key):
        t = ckpt.tensor(key)
        want = t.dtype if _quantized(ckpt, key, keys) else output_dtype(t.dtype, dtype)
        out.append(ExportTensor(key, tuple(int(n) for n in t.shape), want, t.dtype, Identity(key)))
    return out, []


def _quantized(ckpt: Checkpoint, key: str, keys: set[str]) -> bool:
    """``key`` holds float8 codes with a scale companion, or is such a companion: its dtype stays."""
    if str(ckpt.tensor(key).dtype).startswith("float8") and scale_companion(key, keys) is not None:
        return True
    return any(key.endswith(x) and key[:-len(x)] in keys and str(ckpt.tensor(key[:-len(x)]).dtype).startswith("float8")
               for x in SCALE_COMPANIONS)


def prepare_export(url: str, *, step: int | None = None, tensors: TensorsFor | None = None, dtype: str | None = None,
                   max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> tuple[Checkpoint, ExportPlan, list[str]]:
    """Open the step (reads held to :data:`READ_WINDOW` in flight) and plan the files. Pure but for
    reading the manifest. ``tensors(ckpt)`` -> (output tensors, checkpoint keys left out); default
    :func:`identity_tensors`. Returns (checkpoint, plan, keys left out)."""
    ckpt = Repository(str(url), options={"read_window_bytes": READ_WINDOW}).open(step)
    outs, unmapped = tensors(ckpt) if tensors is not None else identity_tensors(ckpt, dtype)
    plan = plan_export(str(url), ckpt.step, ckpt.manifest.save_id, outs, parse_size(max_shard_size))
    return ckpt, plan, list(unmapped)


def export_safetensors(url: str, out_dir: str, *, step: int | None = None, tensors: TensorsFor | None = None,
                       dtype: str | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                       config: Mapping[str, Any] | None = None, progress: Progress | None = None,
                       quantize: str | None = None) -> ExportReport:
    """Export step ``step`` (None: the latest) of ``url`` to ``out_dir`` in one process (for several
    writer processes and mappings: ``bridges.interop.export``).

    Writes ``model-XXXXX-of-YYYYY.safetensors`` files of at most ``max_shard_size`` each (a larger
    tensor alone in its file), then ``config.json`` (when ``config`` is given) and last
    ``model.safetensors.index.json``. ``dtype`` casts floating-point tensors (e.g. ``"bfloat16"``).
    ``progress(done, total)`` is called with tensor bytes written. ``quantize="fp8"`` writes every
    floating-point ``*.weight`` of 2+ dims but embeddings, norms, the head and routers
    (:data:`FP8_SKIP`) as block-FP8 codes with their ``*.weight_scale_inv`` and adds
    ``quantization_config`` to ``config.json`` (:mod:`ckptfmt.interop._fp8`); ValueError for another mode.

    Every file is created under its temporary name with ``O_EXCL | O_NOFOLLOW`` and published
    without replacing anything (docs/INTEROP.md, section 3): nothing is written outside ``out_dir``.
    Fails closed: before any byte is written, OutputExistsError when ``out_dir`` already holds
    safetensors files, an index, a ``config.json`` (when ``config`` is given) or one of the
    export's temporary names (files or links), InvalidConfigError for a config that cannot be
    written; later the reader's CheckpointError (ChecksumMismatchError, MissingShardError, ...) or
    StorageError, after which no file of this export is left and no index exists.
    """
    t0 = time.perf_counter()
    kept: list[str] = []
    tensors = quantized(tensors, quantize, dtype, kept)
    ckpt, plan, unmapped = prepare_export(url, step=step, tensors=tensors, dtype=dtype, max_shard_size=max_shard_size)
    if quantize is not None:
        config = dict(config or {}, quantization_config=quantization_config(kept))
    begin_export(out_dir, plan, config)
    files = write_part(ckpt, plan, out_dir, progress=progress)
    try:
        finish_export(out_dir, plan, config)
    except BaseException:
        discard_parts(out_dir, files)
        raise
    return ExportReport(str(out_dir), tuple(files), sum(len(f.tensors) for f in plan.files), plan.nbytes,
                        int(ckpt.stats.bytes_read), time.perf_counter() - t0, plan.step, plan.save_id, tuple(unmapped))


def safetensors_provenance(source: SafetensorsSource, src: str) -> dict[str, Any]:
    """What an import records about a safetensors source (``metadata["import"]``)."""
    checked = (f"crc32c of every {next(iter(source.manifest.tensors.values())).block}-byte block of each tensor "
               "(ckptfmt export): verified" if source.checksummed and source.manifest.tensors else
               "none: the files carry no checksums; headers, index and file sizes verified only")
    return {"format": "safetensors", "source": str(src), "index": source.index_name,
            "files": [{"name": f, "bytes": n} for f, n in sorted(source.file_sizes.items())],
            "tensors": len(source.manifest.tensors), "bytes": source.manifest.nbytes,
            "source_checksums": checked, "origin": {k: v for k, v in source.origin.items() if v is not None}}


def import_safetensors(src: str, url: str, *, step: int | None = None, prefix: str = "",
                       progress: Progress | None = None, options: StorageOptions | Mapping[str, Any] | None = None,
                       max_tensors: int | None = None) -> ImportReport:
    """Import a safetensors file or sharded directory (with its index; local, ``s3://``, ...) as
    step ``step`` of ``url`` (None: the step an export of ours recorded, else 0). Tensor ``name``
    becomes key path ``prefix + name``.

    Every header, the index and the file sizes are checked before anything is written; each
    block is read when the save writes it (bounded memory) and, where the files carry our
    checksums, verified first. Fails closed: InvalidSourceError, SizeMismatchError,
    MissingShardError, ChecksumMismatchError, StepAlreadyCommittedError ...; nothing committed.
    """
    source = SafetensorsSource(str(src), options=options)
    provenance = safetensors_provenance(source, str(src))
    at = source.step if step is None else step
    tensors = _source_tensors(source, prefix)
    del source  # its readers hold it, and go once their blocks are written: the commit does not keep it
    return import_tensors(url, at, tensors, provenance=provenance, progress=progress, max_tensors=max_tensors)


def _source_tensors(source: SafetensorsSource, prefix: str) -> Iterator[ImportTensor]:
    """The tensors of ``source`` in natural key order, each read through a :class:`_SourceBlock`."""
    for k in sorted(source.keys(), key=natural_key):
        t = source.tensor(k)
        yield ImportTensor(prefix + k, tuple(t.shape), t.dtype, _SourceBlock(source, k))


class _SourceBlock:
    """``read(box)`` of one tensor of a safetensors source (a small object per tensor)."""

    __slots__ = ("source", "name")

    def __init__(self, source: SafetensorsSource, name: str) -> None:
        self.source, self.name = source, name

    def __call__(self, box: Box) -> Any:
        return self.source.read_boxes([(self.name, box)])[0]
