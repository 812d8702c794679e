"""Metadata at scale: a manifest of many small shards, written, loaded, validated and planned.

The layout is ``tensors x 64`` row shards of one inner chunk each (the shape of
a large model saved by 64 writers), for several shard-entry counts; the manifest takes the form
a default save writes (from 65,536 shard rows on, the derived form of FORMAT.md 5.14). Next to it,
torch DCP's ``Metadata`` for the same layout (one chunk entry and one storage
entry per shard), pickled and unpickled, which is what DCP writes and loads.
Each phase is timed once per size (these are deterministic CPU work).
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import time

import numpy as np

SHARDS = 64
_ROWS_PER_SHARD, _COLS = 16, 256


def _manifest(tensors: int):
    """The manifest a save of this layout commits: in the derived form (FORMAT.md 5.14) exactly when
    ``SaveOptions(manifest_columns="auto")``, the default, would write it so."""
    from ckptfmt.manifest._refs import DERIVED, wants_derived
    from ckptfmt.manifest import ArraySpec, ChunkTable, Manifest, ShardTable, TensorEntry
    from ckptfmt.plan import TensorGeometry, cell_key
    from ckptfmt.shard import raw_shard_nbytes, shard_sizes

    save_id = "000000000001-20260101T000000-0badcafe"
    shape = (SHARDS * _ROWS_PER_SHARD, _COLS)
    geom = TensorGeometry(shape, (_ROWS_PER_SHARD, _COLS), (_ROWS_PER_SHARD, _COLS), 4)
    offset = np.stack([np.arange(SHARDS, dtype=np.int64) * _ROWS_PER_SHARD, np.zeros(SHARDS, np.int64)], axis=1)
    keys = tuple(cell_key((s, 0)) for s in range(SHARDS))
    rng = np.random.default_rng(0)
    entries = {}
    for i in range(tensors):
        key = f"model/layers_{i // 8}/block/param_{i % 8}"
        entries[key] = TensorEntry(
            key=key,
            shape=shape,
            dtype="float32",
            sharding=None,
            array=ArraySpec(f"saves/{save_id}/t/{i:06d}", geom.shard_shape, geom.chunk_shape, "raw"),
            shards=ShardTable(
                offset=offset,
                writer=np.arange(SHARDS, dtype=np.int64),
                key=keys,
                nbytes=np.full(SHARDS, raw_shard_nbytes(geom, 1), np.int64),  # one chunk a shard
                index_crc32c=rng.integers(0, 1 << 32, SHARDS, dtype=np.uint32),
            ),
            chunks=ChunkTable(
                offset=np.zeros(SHARDS, np.int64),
                nbytes=np.full(SHARDS, shard_sizes(geom).chunk, np.int64),
                crc32c=rng.integers(0, 1 << 32, SHARDS, dtype=np.uint32),
            ),
        )
    ext = {"must_understand": (DERIVED,), "extensions": {DERIVED: {}}} if wants_derived("auto", tensors * SHARDS) else {}
    return Manifest(save_id=save_id, step=1, created_unix=time.time(), writers=SHARDS, tensors=entries, **ext)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def ckptfmt_phases(tensors: int, tmp: str) -> dict:
    from ckptfmt.manifest import parse_manifest
    import msgpack

    from ckptfmt import Box
    from ckptfmt._boxcols import pack_boxes
    from ckptfmt.plan import plan_reads, plan_save_packed

    m, build_s = _timed(lambda: _manifest(tensors))
    path = os.path.join(tmp, "manifest.json")

    def write() -> int:
        data = m.to_bytes()
        with open(path, "wb") as f:
            f.write(data)
        return len(data)

    nbytes, write_s = _timed(write)

    def load():
        with open(path, "rb") as f:
            return parse_manifest(f.read())

    loaded, load_s = _timed(load)
    _, validate_s = _timed(loaded.validate)
    # Save-side plan, as the save protocol's freeze step runs it on every rank: each of the 64
    # writers packs its own boxes into columns (in parallel, on its own rank: timed apart, one
    # rank's share), all 64 messages arrive as msgpack bytes, and every rank decodes them and plans.
    # (One rank's Box objects at a time, as each rank holds only its own.)
    first = next(iter(loaded.tensors.values()))
    inventory = {k: (t.shape, t.dtype, 4) for k, t in loaded.tensors.items()}
    known = sorted(inventory)
    wires, pack_s = [], 0.0
    for r in range(SHARDS):
        mine = {k: [(Box((r * _ROWS_PER_SHARD, 0), (_ROWS_PER_SHARD, _COLS)), 0, True)] for k in known}
        wire, dt = _timed(lambda: msgpack.packb({"boxes": pack_boxes(mine, known)}, use_bin_type=True))
        wires.append(wire)
        pack_s += dt
    del mine
    _, plan_save_s = _timed(lambda: plan_save_packed(
        inventory, [msgpack.unpackb(w, raw=False, strict_map_key=False)["boxes"] for w in wires]))

    # Read-side plan: one reader of 4 asks for its quarter of every tensor (resharding 64 -> 4).
    quarter = Box((0, 0), (first.shape[0] // 4, first.shape[1]))

    def plan_read():
        return sum(len(plan_reads(t.geometry, t.shards.offset, t.chunk_start, [quarter])) for t in loaded.tensors.values())

    items, plan_read_s = _timed(plan_read)
    return {
        "tensors": tensors, "shards": SHARDS, "entries": tensors * SHARDS, "bytes": nbytes, "build_s": build_s,
        "form": "derived" if m.must_understand else "explicit",
        "write_s": write_s, "load_s": load_s, "validate_s": validate_s, "plan_save_s": plan_save_s, "pack_one_rank_s": pack_s / SHARDS,
        "plan_read_s": plan_read_s, "plan_s": max(plan_save_s, plan_read_s), "read_items": items,
    }


def dcp_phases(tensors: int, tmp: str) -> dict:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    def build():
        sd, storage = {}, {}
        shape = torch.Size((SHARDS * _ROWS_PER_SHARD, _COLS))
        sizes = torch.Size((_ROWS_PER_SHARD, _COLS))
        nb = _ROWS_PER_SHARD * _COLS * 4
        for i in range(tensors):
            key = f"model.layers_{i // 8}.block.param_{i % 8}"
            chunks = [ChunkStorageMetadata(offsets=torch.Size((s * _ROWS_PER_SHARD, 0)), sizes=sizes) for s in range(SHARDS)]
            sd[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=shape, chunks=chunks)
            for s, c in enumerate(chunks):
                storage[MetadataIndex(key, c.offsets, s)] = _StorageInfo(relative_path=f"__{s}_0.distcp", offset=i * nb, length=nb)
        return Metadata(state_dict_metadata=sd, storage_data=storage)

    md, build_s = _timed(build)
    path = os.path.join(tmp, ".metadata")

    def dump() -> int:
        with open(path, "wb") as f:
            pickle.dump(md, f)
        return os.path.getsize(path)

    nbytes, dump_s = _timed(dump)

    def load():
        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 -- our own file, written a line above; this is DCP's format

    _, load_s = _timed(load)
    return {"tensors": tensors, "shards": SHARDS, "entries": tensors * SHARDS, "bytes": nbytes, "build_s": build_s, "dump_s": dump_s, "load_s": load_s}


def run(params: dict) -> dict:
    """Child task: time every phase at each requested entry count."""
    notes = []
    out: dict = {"ckptfmt": [], "dcp": [], "notes": notes}
    with tempfile.TemporaryDirectory(prefix="ckptfmt-md-") as tmp:
        for entries in params["entries"]:
            tensors = max(1, math.ceil(entries / SHARDS))
            out["ckptfmt"].append(ckptfmt_phases(tensors, tmp))
            if params.get("peers", True) and entries <= params.get("dcp_max_entries", 100_000):
                try:
                    out["dcp"].append(dcp_phases(tensors, tmp))
                except ImportError as e:
                    notes.append(f"DCP metadata skipped: {e}")
                    params["peers"] = False
    if any(e > params.get("dcp_max_entries", 100_000) for e in params["entries"]) and params.get("peers", True):
        notes.append(
            f"DCP metadata timed up to {params.get('dcp_max_entries', 100_000):,} entries only; "
            "at 640k entries it measured 10.3 s dump and 14.2 s load on this machine class (REFERENCE.md)"
        )
    return out
