"""The drill's rejected control: a copy of a committed step with one shard object deleted.

The copy is made object by object through the repository's own storage layer, so it works for
every URL the core accepts; the original repository is never modified.
"""
from __future__ import annotations

from typing import Any

from ckptfmt.manifest import manifest_key
from ckptfmt.repository import Repository

__all__ = ["copy_without_one_shard", "uncommitted_saves"]


def copy_without_one_shard(src: str, dst: str, step: int, *, prefer_writer: int = 0) -> dict[str, Any]:
    """Copy committed ``step`` of ``src`` to ``dst``, then delete one shard object of the copy.

    The deleted object is a shard of the largest tensor, written by ``prefer_writer`` when that
    writer wrote one (the drill passes the rank it killed). Returns what was removed.
    """
    a, b = Repository(src), Repository(dst)
    m = a.manifest(step)
    keys = [manifest_key(step)] + a.storage.list(f"saves/{m.save_id}/")
    for k in keys:
        data = a.storage.read(k)
        if data is not None:
            b.storage.write(k, data)
    t = max(m.tensors.values(), key=lambda e: (e.nbytes, e.key))
    writers = [int(w) for w in t.shards.writer]
    s = writers.index(prefer_writer) if prefer_writer in writers else 0
    obj = t.object_key(s)
    b.storage.delete(obj)
    return {"tensor": t.key, "object": obj, "writer": writers[s], "shard_nbytes": int(t.shards.nbytes[s]),
            "objects_copied": len(keys)}


def uncommitted_saves(url: str) -> list[str]:
    """Save ids with objects in the repository that no committed manifest references."""
    repo = Repository(url)
    committed = {repo.manifest(s).save_id for s in repo.steps()}
    found = {k.split("/")[1] for k in repo.storage.list("saves/") if k.count("/") >= 2}
    return sorted(found - committed)
