"""Broken controls: deliberately weakened checks that must make the fault outcomes FAIL.

A fault test that passes only proves something if the same test fails when the guarantee
is taken away. These are the ways the tests take it away:

* :class:`NaiveCheckpoint` - a reader the way Orbax and torch DCP read: it trusts the manifest
  JSON, reads each tensor through tensorstore's zarr3 driver with default options (a missing
  chunk reads as the fill value), and decodes msgpack state with no limits or checksum.
* :func:`publish_partial` - a broken committer: after a failed save it publishes a manifest for
  the unfinished step anyway (as a commit without acknowledgements would).
* the writer weakenings ``no_conditional_create`` and ``no_commit_fence``, applied through the
  storage wrapper :class:`ckptfmt_tools.faults._storage.FaultyStorage`.
* :class:`NoChecksums` - the reader's block checks with the chunk and index checks (crc32c,
  length, entries) replaced by no-ops, passed as ``Context.checks``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckptfmt.reader import BlockChecks

__all__ = ["NaiveCheckpoint", "NoChecksums", "naive_reader", "publish_partial"]


class NaiveCheckpoint:
    """Reads a ckptfmt repository without any of ckptfmt's checks (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, step: int) -> None:
        self.root = str(root)
        self.doc = json.loads(Path(self.root, "manifests", f"{step:020d}.json").read_bytes())

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)  # no check: "../", absolute paths and schemes pass through

    def read(self, key: str, box: Any = None) -> Any:
        import tensorstore as ts

        t = self.doc["tensors"][key]
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": self._path(t["array"]["path"]) + "/"}},
                      open=True).result()
        full = arr.read().result()
        return full if box is None else full[box.slices()]

    def read_boxes(self, requests: list[tuple[str, Any]]) -> list[Any]:
        return [self.read(k, b) for k, b in requests]

    def _state(self, name: str) -> Any:
        import msgpack

        from ckptfmt.state import _ext_hook

        with open(self._path(self.doc["state"][name]["key"]), "rb") as f:
            return msgpack.unpackb(f.read(), raw=False, ext_hook=_ext_hook, strict_map_key=False)

    def state(self) -> Any:
        return self._state("global")

    def rank_state(self, rank: int) -> Any:
        return self._state(f"rank/{rank}")


class NoChecksums(BlockChecks):
    """ckptfmt's own block checks with the chunk and index checks turned off."""

    def chunk(self, *args: Any, **kwargs: Any) -> None:
        return None

    def index(self, *args: Any, **kwargs: Any) -> None:
        return None


def naive_reader(repo: Any, step: int) -> NaiveCheckpoint:
    """A ``Context.reader``: open ``step`` of ``repo`` with :class:`NaiveCheckpoint`."""
    return NaiveCheckpoint(repo.url, step)


def publish_partial(scene: Any, step: int = 3, template_step: int = 2) -> None:
    """Publish a manifest for ``step`` pointing at the unfinished save's objects."""
    saves = sorted(p.name for p in (scene.root / "saves").iterdir() if p.name.startswith(f"{step:012d}-"))
    doc_text = scene.manifest_path(template_step).read_text()
    old_id = json.loads(doc_text)["save_id"]
    new_id = saves[-1] if saves else f"{step:012d}-19700101T000000-00000000"
    doc = json.loads(doc_text.replace(old_id, new_id))
    doc["step"] = step
    scene.write_manifest_doc(step, doc)
