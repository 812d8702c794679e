"""One fault run's repository on local disk, with the byte-level edits faults are made of."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ckptfmt.reader import BlockChecks

__all__ = ["Scene", "TARGET_TENSOR", "TARGET_SHARD", "flip"]

#: The tensor and shard (written by rank 1) that shard-level faults hit.
TARGET_TENSOR = "params/dense/kernel"
TARGET_SHARD = 1


def flip(path: Path, offset: int, nbytes: int, *, single_bit: bool = False) -> str:
    """Flip one bit (bit 4 of the byte at ``offset``) or invert ``nbytes`` bytes; return where."""
    data = bytearray(path.read_bytes())
    if offset < 0 or offset + (1 if single_bit else nbytes) > len(data):
        raise ValueError(f"flip at {offset}+{nbytes} is outside {path.name} ({len(data)} bytes)")
    if single_bit:
        data[offset] ^= 0x10
        where = f"bit 4 of byte {offset}"
    else:
        for i in range(offset, offset + nbytes):
            data[i] ^= 0xFF
        where = f"bytes [{offset}, {offset + nbytes})"
    path.write_bytes(bytes(data))
    return where


@dataclass
class Scene:
    """A file repository at ``root`` holding the base checkpoints (steps 1 and 2)."""

    root: Path
    seed: int
    max_manifest_bytes: int | None = None  # None: the core's default cap
    grown_bytes: int = 4 << 30  # how far shard-grown grows its object (sparse)
    checks: BlockChecks | None = None  # the BlockChecks every repository of the scene reads with; None: the real ones

    @property
    def url(self) -> str:
        return str(self.root)

    def repo(self):
        from ckptfmt import Repository

        if self.max_manifest_bytes is None:
            return Repository(self.url, checks=self.checks)
        return Repository(self.url, max_manifest_bytes=self.max_manifest_bytes, checks=self.checks)

    def manifest_path(self, step: int) -> Path:
        return self.root / "manifests" / f"{step:020d}.json"

    def manifest_doc(self, step: int) -> dict[str, Any]:
        return json.loads(self.manifest_path(step).read_bytes())

    def write_manifest_doc(self, step: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"
        self.manifest_path(step).write_text(data)

    def edit_manifest(self, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
        doc = self.manifest_doc(step)
        edit(doc)
        self.write_manifest_doc(step, doc)

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def shard_path(self, step: int, tensor: str = TARGET_TENSOR, shard: int = TARGET_SHARD) -> Path:
        from ckptfmt.manifest import parse_manifest  # the parsed key: the manifest may be in the derived form

        return self.root / parse_manifest(self.manifest_path(step).read_bytes()).tensors[tensor].object_key(shard)

    def shard_layout(self, step: int, tensor: str = TARGET_TENSOR, shard: int = TARGET_SHARD) -> dict[str, int]:
        """Byte layout of one shard (object offsets, in a pack or not): its start, first chunk's data
        offset, index start, total size."""
        from ckptfmt.manifest import parse_manifest
        from ckptfmt.shard import shard_bytes

        m = parse_manifest(self.manifest_path(step).read_bytes())
        t = m.tensors[tensor]
        first = int(t.chunk_start[shard])
        sb = shard_bytes(t, shard)
        (c0, c1), (i0, i1), (t0, _) = sb.chunk(first), sb.index, sb.index_trailer
        return {"chunk0_offset": c0, "chunk0_nbytes": c1 - c0, "index_start": i0, "index_nbytes": i1 - i0,
                "index_trailer_start": t0, "nbytes": sb.nbytes, "start": sb.start}

    def state_path(self, step: int, name: str = "global") -> Path:
        return self.root / self.manifest_doc(step)["state"][name]["key"]

    def replace_state(self, step: int, data: bytes | None, *, sparse_size: int | None = None,
                      name: str = "global") -> str:
        """Replace a state object and update its size and crc32c in the manifest, as an attacker
        who controls the whole repository would (so that only the state loader stands in the way)."""
        from ckptfmt.checksum import crc32c

        path = self.state_path(step, name)
        if sparse_size is not None:  # a large file of which only the header is written
            with open(path, "wb") as f:
                f.write(data or b"")
                f.truncate(sparse_size)
            crc = 0
            with open(path, "rb") as f:
                import crc32c as _c

                for block in iter(lambda: f.read(8 << 20), b""):
                    crc = _c.crc32c(block, crc)
            size = sparse_size
        else:
            assert data is not None
            path.write_bytes(data)
            crc, size = crc32c(data), len(data)

        def edit(doc: dict[str, Any]) -> None:
            doc["state"][name]["nbytes"] = size
            doc["state"][name]["crc32c"] = crc

        self.edit_manifest(step, edit)
        return self.rel(path)
