"""A committed step as zarr v3 arrays again: the reference map of FORMAT.md 14.4 (revision 1.3).

A packed save (FORMAT.md 5.15) stores its shards back to back in pack objects, which no zarr
reader can open; but each shard in a pack is a zarr ``sharding_indexed`` shard byte for byte. The
reference map names, for every array, its ``zarr.json`` (inline) and each shard key's
``[url, start, nbytes]``: fsspec's ``ReferenceFileSystem`` (version 1 of its JSON form) serves it,
and zarr-python opens each array through it. An unpacked save maps the same way (each shard at 0
of its own object). Pure: reads the manifest only; the bytes are never read here, and zarr, not
the manifest, then decides what is present, so use ``verify`` first (FORMAT.md 14.4).
"""
from __future__ import annotations

import json
import os
from typing import Any

from ckptfmt.layout import zarr_array_metadata
from ckptfmt.manifest import Manifest

__all__ = ["zarr_references"]


def _object_url(url: str, key: str) -> str:
    """The URL fsspec opens for repository ``url``'s object ``key``: an absolute path for a local
    repository, ``<url>/<key>`` for an object store (``s3://``, ``gs://``)."""
    if "://" in url and not url.startswith("file://"):
        return f"{url.rstrip('/')}/{key}"
    root = url[len("file://"):] if url.startswith("file://") else os.path.abspath(os.path.expanduser(url))
    return os.path.join(root, key)


def zarr_references(manifest: Manifest, url: str) -> dict[str, Any]:
    """The reference map (fsspec ``ReferenceFileSystem``, JSON version 1) of every array of the
    step ``manifest`` describes, in the repository at ``url``: ``<array.path>/zarr.json`` and each
    shard ``<array.path>/<key>`` as ``[object url, start, nbytes]``; plus a root group ``zarr.json``
    whose attribute ``ckptfmt.arrays`` maps each key path to its array path. Open an array with
    ``zarr.open_array(zarr.storage.FsspecStore(fsspec.filesystem("reference", fo=refs,
    asynchronous=True), read_only=True), path=array_path)``."""
    refs: dict[str, Any] = {}
    arrays: dict[str, str] = {}
    for k in sorted(manifest.tensors):
        t = manifest.tensors[k]
        path = t.array.path
        arrays[k] = path
        md = {"zarr_format": 3, "node_type": "array",
              **zarr_array_metadata(t.shape, t.dtype, t.array.shard_shape, t.array.chunk_shape, t.array.codec)}
        refs[f"{path}/zarr.json"] = json.dumps(md, sort_keys=True)
        for s in range(len(t.shards)):
            refs[f"{path}/{t.shards.key[s]}"] = [_object_url(url, t.object_key(s)), t.shard_start(s), int(t.shards.nbytes[s])]
    refs["zarr.json"] = json.dumps({"zarr_format": 3, "node_type": "group",
                                    "attributes": {"ckptfmt.arrays": arrays, "ckptfmt.step": manifest.step,
                                                   "ckptfmt.save_id": manifest.save_id}}, sort_keys=True)
    return {"version": 1, "refs": refs}
