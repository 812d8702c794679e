"""Import a ``torch.distributed.checkpoint`` (DCP) directory, read through torch's own
``FileSystemReader``, as one committed ckptfmt step in the PyTorch profile's key paths.

Trust: DCP's ``.metadata`` is a Python pickle, and its data files hold ``torch.save`` payloads
(read back with ``torch.load(weights_only=True)``). Reading them runs the unpickler on the file's
bytes, so importing is an explicit act on a source the user trusts; ``ckptfmt import --from dcp``
asks for ``--trust-pickle``. The step written is plain ckptfmt (JSON, msgpack, raw tensor bytes).

Call order: :func:`import_dcp` reads the metadata -> checks, before anything is written, that every
data file it names exists and is long enough (MissingShardError / SizeMismatchError) -> one tensor
per ``TensorStorageMetadata``, its key path the state dict's nesting joined with ``/`` (DCP's
``planner_data``: ``{"model": {"fc.weight": t}}`` -> ``model/fc.weight``, as
``bridges.torch.save`` names it) -> ``import_tensors`` streams the save: tensors are loaded by
``dcp.load`` a batch at a time (at most :data:`BATCH_BYTES`, or one larger tensor) and dropped once
written. Non-tensor entries (``BytesStorageMetadata``: pickled Python objects) are not imported;
their names are listed in the provenance. DCP keeps no checksums: the bytes are taken as torch
reads them.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import numpy as np

from bridges._requires import require

# This module is the DCP import, and needs torch: bridges.interop imports it when an import runs.
require("bridges.interop.import_dcp", "torch", "torch")  # before the framework imports: names the extra

import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckptfmt import Box
from ckptfmt.dtypes import DTYPES
from ckptfmt.errors import CheckpointError, InvalidSourceError, MissingShardError, SizeMismatchError
from ckptfmt.interop import ImportReport, ImportTensor, import_tensors
from ckptfmt.interop import BatchReader

from bridges.torch._conv import dtype_name, to_numpy

__all__ = ["import_dcp", "BATCH_BYTES"]

BATCH_BYTES = 64 << 20


def _typed(e: BaseException, what: str, key: str | None, path: str) -> CheckpointError:
    msg = f"{type(e).__name__}: {e}"[:600]
    if isinstance(e, FileNotFoundError) or "No such file" in msg:
        return MissingShardError(f"DCP could not {what}: a file is missing", key=key, object=path, found=msg)
    return InvalidSourceError(f"DCP could not {what}", key=key, object=path, found=msg)


def _key(fqn: str, planner_data: Any) -> str:
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) and str(p) and "/" not in str(p)
                                                        for p in path):
        return "/".join(str(p) for p in path)
    return fqn


def import_dcp(src: str, url: str, *, step: int | None = None, prefix: str = "",
               progress: Callable[[int, int], None] | None = None, max_tensors: int | None = None) -> ImportReport:
    """Import the DCP checkpoint directory ``src`` (a TRUSTED source: see the module docstring) as
    step ``step`` (default 0) of ``url``; key paths are ``prefix`` + the state dict's path.

    Fails closed: InvalidSourceError (no readable ``.metadata``, a tensor DCP cannot load),
    MissingShardError / SizeMismatchError (a data file missing or shorter than the metadata says,
    found before anything is written), StepAlreadyCommittedError; nothing committed.
    """
    path = os.path.abspath(os.fspath(src))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise InvalidSourceError("not a DCP checkpoint (no .metadata)", object=path, expected=".metadata",
                                 found="missing")
    try:
        md = FileSystemReader(path).read_metadata()  # a pickle: the caller trusts this source
    except Exception as e:
        raise _typed(e, "read .metadata", None, path) from None
    # The pickle may hold anything: check its form before any attribute of it is used.
    if (not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict)
            or not all(isinstance(k, str) for k in md.state_dict_metadata)
            or not isinstance(getattr(md, "storage_data", None) or {}, dict)):
        raise InvalidSourceError("DCP .metadata does not hold a checkpoint's metadata", object=os.path.join(path, ".metadata"),
                                 expected="torch.distributed.checkpoint.metadata.Metadata with dict members",
                                 found=type(md).__name__)
    try:
        need = _files_needed(md)
    except (AttributeError, TypeError, ValueError) as e:
        raise InvalidSourceError("DCP .metadata names a data file in a form torch does not write",
                                 object=os.path.join(path, ".metadata"), found=f"{type(e).__name__}: {e}"[:300]) from None
    for rel, n in sorted(need.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise MissingShardError("a DCP data file is missing", object=rel, expected="present", found="missing")
        if os.path.getsize(f) < n:
            raise SizeMismatchError("a DCP data file is shorter than its metadata says", object=rel,
                                    expected=f">= {n} bytes", found=os.path.getsize(f))
    planner_data = getattr(md, "planner_data", None)
    tensors: dict[str, tuple[str, tuple[int, ...], str, Any]] = {}
    skipped = []
    for fqn, meta in sorted(md.state_dict_metadata.items()):
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        key = _key(fqn, planner_data)
        try:
            tensors[key] = (fqn, tuple(int(n) for n in meta.size), dtype_name(meta.properties.dtype, key),
                            meta.properties.dtype)
        except (AttributeError, TypeError, ValueError) as e:
            raise InvalidSourceError("DCP .metadata describes a tensor in a form torch does not write", key=key,
                                     object=os.path.join(path, ".metadata"), found=f"{type(e).__name__}: {e}"[:300]) from None
    reader = _DcpBatchReader(path, tensors)
    items = [ImportTensor(prefix + k, shape, dt, (lambda box, k=k: reader.read(k, box)))
             for k, (_, shape, dt, _) in sorted(tensors.items())]
    provenance = {"format": "dcp", "source": path, "trusted_pickle": True, "dcp_version": str(getattr(md, "version", "")),
                  "files": [{"name": r, "bytes": os.path.getsize(os.path.join(path, r))} for r in sorted(need)],
                  "tensors": len(items), "bytes": sum(t.nbytes for t in items), "skipped_non_tensors": skipped,
                  "source_checksums": "none: DCP keeps no checksums; data files' presence and sizes verified"}
    return import_tensors(url, 0 if step is None else int(step), items, provenance=provenance, progress=progress,
                          max_tensors=max_tensors)


def _files_needed(md: Any) -> dict[str, int]:
    """Each data file the metadata names, with the length it needs; InvalidSourceError for a path
    that leaves the checkpoint directory."""
    need: dict[str, int] = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = str(info.relative_path)
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise InvalidSourceError("DCP metadata names a file outside the checkpoint", object=rel,
                                     expected="a file in the directory", found=rel)
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    return need


class _DcpBatchReader:
    """Loads tensors through ``dcp.load`` (a partial load), a batch at a time (:class:`BatchReader`)."""

    def __init__(self, path: str, tensors: dict[str, tuple[str, tuple[int, ...], str, Any]]) -> None:
        self.path, self.tensors = path, tensors
        sizes = {k: int(np.prod(shape, dtype=np.int64)) * DTYPES[dt] for k, (_, shape, dt, _) in tensors.items()}
        self.batches = BatchReader(sizes, self._load, BATCH_BYTES)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self.batches.read(key, box)

    def _load(self, keys: list[str]) -> dict[str, np.ndarray]:
        state = {self.tensors[k][0]: torch.empty(self.tensors[k][1], dtype=self.tensors[k][3]) for k in keys}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
                load(state, storage_reader=FileSystemReader(self.path), planner=DefaultLoadPlanner(allow_partial_load=True))
        except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
            raise _typed(e, "load the tensors", keys[0], self.path) from None
        return {k: to_numpy(state[self.tensors[k][0]]) for k in keys}
