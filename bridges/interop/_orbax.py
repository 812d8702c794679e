"""Import an Orbax checkpoint (``StandardCheckpointer`` / ``PyTreeCheckpointer``; OCDBT on or off),
read through Orbax itself, as one committed ckptfmt step in the JAX profile.

Call order: :func:`import_orbax` finds the item directory (a ``CheckpointManager`` root with
``step`` picks ``<root>/<step>/<item>``), asks Orbax for the tree's metadata (shapes, dtypes) ->
lists one tensor per array leaf, its key path rendered as ``bridges.jax.save`` renders it (so
``bridges.jax.restore`` with the same pytree as target needs no mapping) -> ``import_tensors``
streams the save: leaves are restored by Orbax a batch at a time (``partial_restore``, as numpy
arrays: no device memory), each batch of at most :data:`BATCH_BYTES` (or one larger leaf), and
dropped once written. Scalar leaves go into the JAX profile's global state (``bridge.leaves``).

What is verified: what Orbax checks (OCDBT and zarr3 keep a crc32c on each shard's index, never on
chunk data; Orbax 0.12 refuses a missing chunk instead of filling zeros). ckptfmt adds no check on
the source bytes; it checks each leaf's shape and dtype against Orbax's metadata, and from then on
the imported step is verified like any other. Any Orbax failure (a truncated or missing file, an
unreadable tree) becomes a typed CheckpointError naming the leaf and the path; nothing is
committed.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from bridges._requires import require

# This module is the Orbax import, and needs jax and Orbax: bridges.interop imports it when an import runs.
require("bridges.interop.import_orbax", "jax", "jax", "orbax.checkpoint")  # before the framework imports

import jax
import orbax.checkpoint as ocp

from ckptfmt import Box
from ckptfmt.dtypes import DTYPES, dtype_name
from ckptfmt.errors import CheckpointError, InvalidSourceError, MissingShardError, SizeMismatchError
from ckptfmt.interop import ImportReport, ImportTensor, import_tensors
from ckptfmt.interop import BatchReader

from bridges.jax._restore import BRIDGE_VERSION
from bridges.jax._tree import flatten_with_keys

__all__ = ["import_orbax", "BATCH_BYTES", "MAX_LEAF_BYTES"]

#: Leaves restored by Orbax at once (a larger leaf alone).
BATCH_BYTES = 64 << 20
#: The largest array leaf imported by default. Orbax restores a leaf whole (an unsharded leaf is
#: one stored chunk, which tensorstore decodes whole for any read), so host memory follows the
#: leaf's declared size, not its bytes on disk: a 35 KB directory can declare a 1 GiB leaf of
#: zeros. A larger leaf is refused before anything is read unless the caller raises the cap
#: (``max_leaf_bytes=``, ``ckptfmt import --max-leaf-bytes``), accepting that cost. The host memory
#: an import holds for one leaf is up to about twice its declared size (tensorstore decodes into a
#: buffer of its own, then Orbax hands over a numpy copy: a 512 MiB leaf peaked near 870 MB), so the
#: cap bounds an import's memory to about 2 x ``max_leaf_bytes`` plus one batch; set it from the
#: memory the import may use.
MAX_LEAF_BYTES = 512 << 20


def _typed(e: BaseException, what: str, key: str | None, path: str) -> CheckpointError:
    msg = f"{type(e).__name__}: {e}"[:600]
    if isinstance(e, FileNotFoundError) or "NOT_FOUND" in msg:
        return MissingShardError(f"Orbax could not {what}: an object is missing", key=key, object=path, found=msg)
    if "OUT_OF_RANGE" in msg or "truncat" in msg.lower() or "Unexpected end" in msg:
        return SizeMismatchError(f"Orbax could not {what}: an object is shorter than recorded", key=key,
                                 object=path, found=msg)
    return InvalidSourceError(f"Orbax could not {what}", key=key, object=path, found=msg)


def _item_dir(src: str, step: int | None) -> str:
    path = os.path.abspath(os.fspath(src))
    if step is not None:
        path = os.path.join(path, str(step))
    if not os.path.isdir(path):
        raise InvalidSourceError("no Orbax checkpoint directory", object=path, expected="a directory", found="missing")
    if ".orbax-checkpoint-tmp" in os.path.basename(path):
        raise InvalidSourceError("an unfinished Orbax save (temporary directory)", object=path,
                                 expected="a finalized checkpoint", found=os.path.basename(path))
    if not os.path.exists(os.path.join(path, "_METADATA")):
        items = [n for n in sorted(os.listdir(path)) if os.path.exists(os.path.join(path, n, "_METADATA"))]
        if len(items) != 1:
            raise InvalidSourceError("not an Orbax item directory (no _METADATA)", object=path,
                                     expected="one item with _METADATA", found=items or "none")
        path = os.path.join(path, items[0])
    return path


def import_orbax(src: str, url: str, *, step: int | None = None, prefix: str = "",
                 progress: Callable[[int, int], None] | None = None,
                 max_leaf_bytes: int | None = None, max_tensors: int | None = None) -> ImportReport:
    """Import the Orbax checkpoint at ``src`` (``step``: a ``CheckpointManager`` root's step) as step
    ``step`` (default 0) of ``url``; key paths are ``prefix`` + the pytree path rendered with ``/``.

    Fails closed: InvalidSourceError (not an Orbax checkpoint, an unfinished save, a tree Orbax
    cannot read, an array leaf declaring more than ``max_leaf_bytes`` (None: :data:`MAX_LEAF_BYTES`): checked from the metadata
    before any leaf is read), MissingShardError / SizeMismatchError (a missing or truncated file,
    as Orbax reports it), StepAlreadyCommittedError; nothing committed. Host memory is bounded by
    about one batch of :data:`BATCH_BYTES` or the largest leaf, whichever is larger.
    """
    path = _item_dir(src, step)
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        meta = checkpointer.metadata(path)
        tree = meta.item_metadata.tree
    except Exception as e:  # Orbax raises untyped errors (even AttributeError) for damaged trees
        raise _typed(e, "read the checkpoint's metadata", None, path) from None
    flat, _ = flatten_with_keys(tree)
    leaves: dict[str, Any] = {}
    arrays: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, m in flat:
        if m is None:
            continue
        if type(m).__name__ == "ArrayMetadata":
            arrays[key] = (tuple(int(n) for n in m.shape), dtype_name(np.dtype(m.dtype), key=key))
        else:
            leaves[key] = m
    _check_leaf_sizes(arrays, MAX_LEAF_BYTES if max_leaf_bytes is None else int(max_leaf_bytes), path)
    paths = {key: p for (key, _), (p, _) in zip(flat, jax.tree_util.tree_flatten_with_path(tree)[0])}
    reader = _OrbaxBatchReader(checkpointer, path, tree, paths, arrays)
    scalars = reader.scalars(sorted(leaves)) if leaves else {}
    tensors = [ImportTensor(prefix + k, shape, dt, (lambda box, k=k: reader.read(k, box)))
               for k, (shape, dt) in sorted(arrays.items())]
    provenance = {"format": "orbax", "source": path, "orbax_version": getattr(ocp, "__version__", "unknown"),
                  "ocdbt": os.path.exists(os.path.join(path, "manifest.ocdbt")),
                  "item_handlers": str(getattr(meta, "item_handlers", "")),
                  "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors), "scalar_leaves": sorted(scalars),
                  "source_checksums": "Orbax's own (crc32c on shard indexes with OCDBT/zarr3; none on chunk data); "
                                      "shapes and dtypes checked against Orbax's metadata"}
    state = {"bridge": {"name": "jax", "version": BRIDGE_VERSION, "prng_impls": {},
                        "leaves": {prefix + k: v for k, v in scalars.items()}}, "extra": None}
    return import_tensors(url, 0 if step is None else int(step), tensors, provenance=provenance, progress=progress,
                          state=state, max_tensors=max_tensors)


def _check_leaf_sizes(arrays: dict[str, tuple[tuple[int, ...], str]], cap: int, path: str) -> None:
    """Refuse, before anything is read, an array leaf whose declared size exceeds ``cap``."""
    for key, (shape, dt) in sorted(arrays.items()):
        n = DTYPES[dt]
        for dim in shape:  # exact integers: a declared shape cannot overflow the check
            n *= int(dim)
        if n > cap:
            raise InvalidSourceError(
                f"an Orbax leaf declares {n:,} bytes, over the import cap of {cap:,}: Orbax restores a leaf whole, "
                "so the import would need that much host memory; pass max_leaf_bytes= (ckptfmt import "
                "--max-leaf-bytes) to import it anyway", key=key, object=path,
                expected=f"<= {cap} bytes per leaf", found=f"{shape} {dt} = {n} bytes")


class _OrbaxBatchReader:
    """Restores leaves through Orbax (``partial_restore``), a batch at a time (:class:`BatchReader`)."""

    def __init__(self, checkpointer: ocp.PyTreeCheckpointer, path: str, tree: Any, paths: dict[str, Any],
                 arrays: dict[str, tuple[tuple[int, ...], str]]) -> None:
        self.checkpointer, self.path, self.tree, self.paths, self.arrays = checkpointer, path, tree, paths, arrays
        sizes = {k: int(np.prod(shape, dtype=np.int64)) * DTYPES[dt] for k, (shape, dt) in arrays.items()}
        self.batches = BatchReader(sizes, self._arrays, BATCH_BYTES)

    def read(self, key: str, box: Box) -> np.ndarray:
        return self.batches.read(key, box)

    def _restore(self, keys: list[str], as_numpy: bool) -> dict[str, Any]:
        want = {self.paths[k]: k for k in keys}
        item = jax.tree_util.tree_map_with_path(lambda p, m: 0 if p in want else None, self.tree)
        args = jax.tree_util.tree_map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray) if as_numpy else ocp.RestoreArgs(), self.tree)
        try:
            got = self.checkpointer.restore(self.path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
        except Exception as e:
            raise _typed(e, "restore the leaves", keys[0] if len(keys) == 1 else f"{keys[0]} (and {len(keys) - 1} more)",
                         self.path) from None
        out = {want[p]: v for p, v in jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: x is None)[0]
               if p in want and v is not None}
        lost = [k for k in keys if k not in out]
        if lost:
            raise InvalidSourceError("Orbax returned no value for a leaf", key=lost[0], object=self.path,
                                     expected="a restored array", found="nothing")
        return out

    def _arrays(self, keys: list[str]) -> dict[str, np.ndarray]:
        try:
            got = self._restore(keys, as_numpy=True)
        except CheckpointError:
            if len(keys) == 1:
                raise
            for k in keys:  # name the leaf that fails, not its batch
                self._restore([k], as_numpy=True)
            raise
        out = {}
        for k, v in got.items():
            arr = np.asarray(v)
            shape, dt = self.arrays[k]
            if tuple(arr.shape) != shape or dtype_name(arr.dtype) != dt:
                raise InvalidSourceError("Orbax restored a leaf unlike its metadata", key=k, object=self.path,
                                         expected=(shape, dt), found=(tuple(arr.shape), arr.dtype.name))
            out[k] = arr
        return out

    def scalars(self, keys: list[str]) -> dict[str, Any]:
        got = self._restore(keys, as_numpy=False)
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in got.items()}
