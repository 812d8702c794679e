"""The manifest's caps on size, counts and nesting (FORMAT.md 5.1, 5.10): what a reader checks
before it parses, and before it builds an entry, so that a manifest costs at most what its caps
allow, never what its author wanted."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt.errors import InvalidManifestError, ManifestTooLargeError
from ckptfmt.layout import MAX_NDIM

__all__ = ["MAX_MANIFEST_BYTES", "MAX_NESTING", "MAX_STRUCTURAL_BYTES", "MAX_TENSORS", "MAX_SHARD_ROWS",
           "MAX_CHUNK_ROWS", "MAX_OFFSET_ELEMENTS", "CountCaps", "count_structural", "check_nesting", "row_counts",
           "check_rows", "offset_elements", "check_offset_elements"]

MAX_MANIFEST_BYTES = 256 << 20
#: Nesting of arrays and objects in a manifest: the top-level object is level 1.
MAX_NESTING = 64
#: Count caps: what parsing builds stays within a small multiple of the size cap.
MAX_STRUCTURAL_BYTES = 1 << 25  # "{", "[" and "," in the text: one per JSON value but the root
MAX_TENSORS = 1 << 20
MAX_SHARD_ROWS = 1 << 23
MAX_CHUNK_ROWS = 1 << 24
#: Shard offset elements, summed over every tensor (rows x rank): what a derived entry expands to
#: (FORMAT.md 5.14). An explicit manifest within the structural cap never exceeds it.
MAX_OFFSET_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class CountCaps:
    """The count caps of FORMAT.md 5.10. A reader with a lower size cap lowers them in proportion."""

    structural: int = MAX_STRUCTURAL_BYTES
    tensors: int = MAX_TENSORS
    shard_rows: int = MAX_SHARD_ROWS
    chunk_rows: int = MAX_CHUNK_ROWS
    offset_elements: int = MAX_OFFSET_ELEMENTS
    count_rows: bool = True  # False: the document's structural bytes already bound every column below the row caps

    @classmethod
    def for_size_cap(cls, max_bytes: int) -> "CountCaps":
        if max_bytes >= MAX_MANIFEST_BYTES:
            return cls()
        return cls(*(cap * max(0, max_bytes) // MAX_MANIFEST_BYTES for cap in
                     (MAX_STRUCTURAL_BYTES, MAX_TENSORS, MAX_SHARD_ROWS, MAX_CHUNK_ROWS,
                                                                 MAX_OFFSET_ELEMENTS)))

    def after_counting(self, structural: int) -> "CountCaps":
        # Every array element follows a "[" or a ",": no column can be longer than the structural count.
        return dataclasses.replace(self, count_rows=structural > min(self.shard_rows, self.chunk_rows))


def count_structural(data: bytes) -> int:
    """The manifest's structural bytes (FORMAT.md 5.10): how many of its bytes are "{", "[" or ",".
    Every JSON value but the top-level object follows one, so this bounds what parsing builds; it
    is counted before parsing, in numpy blocks (about 3x faster than bytes.count, no full copy)."""
    a = np.frombuffer(data, np.uint8)
    n = 0
    for i in range(0, len(a), 1 << 22):
        block = a[i:i + (1 << 22)]
        n += int(np.count_nonzero(block == 0x7B)) + int(np.count_nonzero(block == 0x5B)) + int(np.count_nonzero(block == 0x2C))
    return n


def check_nesting(value: Any, level: int, what: str, *, key: str | None = None) -> None:
    """InvalidManifestError if ``value``, at nesting ``level`` of the manifest (the top-level object
    is level 1), holds an array or object deeper than level MAX_NESTING. Iterative: no recursion."""
    stack = [(value, level)]
    while stack:
        v, d = stack.pop()
        if d > MAX_NESTING:
            raise InvalidManifestError(f"{what} nests arrays and objects too deeply", key=key, object=what,
                                       expected=f"<= {MAX_NESTING} levels (the manifest's top-level object is level 1)",
                                       found=f"more than {MAX_NESTING} levels")
        for c in (v.values() if type(v) is dict else v):
            if type(c) is dict or type(c) is list:
                stack.append((c, d + 1))


def row_counts(tensors_doc: dict[str, Any]) -> tuple[int, int]:
    """Shard and chunk rows of the tensor entries, each counted by a column it holds."""
    shard_rows = chunk_rows = 0
    for t in tensors_doc.values():
        sh, ch = (t.get("shards"), t.get("chunks")) if type(t) is dict else (None, None)
        # An entry in the derived form (FORMAT.md 5.14) is counted by the columns it still holds:
        # its derived tables are checked against their lengths before they are built.
        rows = sh.get("key", sh.get("writer")) if type(sh) is dict else None
        if type(rows) is list:
            shard_rows += len(rows)
        rows = ch.get("offset", ch.get("crc32c")) if type(ch) is dict else None
        if type(rows) is list:
            chunk_rows += len(rows)
    return shard_rows, chunk_rows


def check_rows(tensors_doc: dict[str, Any], caps: CountCaps) -> None:
    """ManifestTooLargeError, before any table is built, past the shard or chunk row caps."""
    shard_rows, chunk_rows = row_counts(tensors_doc)
    for what, rows, cap in (("shard", shard_rows, caps.shard_rows), ("chunk", chunk_rows, caps.chunk_rows)):
        if rows > cap:
            raise ManifestTooLargeError(f"manifest holds too many {what} rows", expected=f"<= {cap}", found=rows)


def offset_elements(tensors_doc: dict[str, Any]) -> tuple[int, int, str | None]:
    """Shard offset elements (rows x rank) summed over the entries, the largest count and its key;
    the rows of a derived entry counted by its writer column (its derived table has exactly that many)."""
    elements, top, largest = 0, 0, None
    for k, t in tensors_doc.items():
        if type(t) is not dict or type(sh := t.get("shards")) is not dict or type(shape := t.get("shape")) is not list:
            continue
        rows = sh.get("key", sh.get("writer"))
        if type(rows) is list and len(shape) <= MAX_NDIM:  # a deeper shape is refused before anything is built
            n = len(rows) * len(shape)
            elements += n
            if n > top:
                top, largest = n, k
    return elements, top, largest


def check_offset_elements(tensors_doc: dict[str, Any], caps: CountCaps) -> None:
    """ManifestTooLargeError, before any table is derived, when the shard offset tables would hold
    more than the cap of elements (FORMAT.md 5.10): rows x rank summed over every tensor."""
    elements, _, largest = offset_elements(tensors_doc)
    if elements > caps.offset_elements:
        raise ManifestTooLargeError("manifest's shard offset tables would hold too many elements (shard rows x rank, "
                                    "summed over the tensors; the key named holds the most)", key=largest,
                                    expected=f"<= {caps.offset_elements}", found=elements)
