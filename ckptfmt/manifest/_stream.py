"""Where the manifest's JSON text can be cut so that the json module decodes it piece by piece:
the top-level object's members one at a time, and the "tensors" member's entries in batches, so
that the decoded JSON of every tensor is never held at once (FORMAT.md 5.10 bounds the text; a
document of 100,000 tensors decodes to about 2 KB per tensor).

Only for a text with no backslash: then every '"' opens or closes a string, and the structural
characters outside strings ("{", "[", "]", "}", ",") are found by counting quotes, with numpy, a
block at a time. The split only says where to cut; the pieces are decoded by the json module
itself. A text whose pieces all decode (each member alone to one member, each batch to exactly
as many entries as it was cut into) is a valid JSON object holding exactly those members, so a
caller that also refuses a member repeated across pieces accepts nothing that ``json.loads``
rejects; anything else is ``None`` here, and the caller decodes the text whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Split", "split_document"]

_BLOCK = 1 << 20             # bytes scanned at once (the scan's own memory is a few times this)
_WS = b" \t\n\r"             # JSON's whitespace
_KIND = np.zeros(256, np.int8)  # byte -> 1 for "{" and "[", -1 for "}" and "]", 2 for ","
_KIND[[ord("{"), ord("[")]], _KIND[[ord("}"), ord("]")]], _KIND[ord(",")] = 1, -1, 2


@dataclass(frozen=True)
class Split:
    """Byte spans of one manifest text: ``members``, every top-level member (``[start, stop)``,
    without the commas between them), in order; ``tensors``, the index in ``members`` of the
    "tensors" member; ``value``, that member's value's "{" and "}" positions; ``cuts``, the
    value's "{", the commas between its entries and its "}" (entry ``i`` is
    ``[cuts[i] + 1, cuts[i + 1])``), or only "{" for an empty value."""

    members: list[tuple[int, int]]
    tensors: int
    value: tuple[int, int]
    cuts: np.ndarray

    @property
    def entries(self) -> int:
        return len(self.cuts) - 1

    def skeleton(self, data: bytes) -> bytes:
        """The "tensors" member with an empty value: what its entries are cut out of."""
        s, e = self.members[self.tensors]  # type: ignore[index]
        o, c = self.value
        return data[s:o + 1] + data[c:e]

    def batches(self, size: int) -> list[tuple[int, int, int]]:
        """``(start, stop, count)``: consecutive runs of ``count`` entries (their commas included)."""
        return [(int(self.cuts[i]) + 1, int(self.cuts[min(i + size, self.entries)]), min(size, self.entries - i))
                for i in range(0, self.entries, size)]


def split_document(data: bytes) -> Split | None:
    """The spans of ``data``'s top-level object; None for a text this split does not serve (a
    backslash anywhere, a top-level value that is not one object, brackets that do not balance)."""
    if b"\\" in data:
        return None
    n, quotes, depth = len(data), 0, 0
    picks: dict[str, list[np.ndarray]] = {k: [] for k in ("top_comma", "top_open", "top_close", "open2", "close1", "comma2")}
    kinds: list[np.ndarray] = []
    for off in range(0, n, _BLOCK):
        b = np.frombuffer(data, np.uint8, min(_BLOCK, n - off), off)
        q = np.flatnonzero(b == 34)  # '"'
        s = np.flatnonzero((b == 44) | (b == 123) | (b == 125) | (b == 91) | (b == 93))
        s = s[((np.searchsorted(q, s) + quotes) & 1) == 0]  # outside strings: an even count of quotes before
        c = b[s]
        k = _KIND[c]
        opens, closes, commas = k == 1, k == -1, k == 2
        d = np.cumsum(np.where(commas, 0, k), dtype=np.int64) + depth  # depth after each character
        if d.size and d.min() < 0:
            return None
        pos = s + off
        picks["top_comma"].append(pos[commas & (d == 1)])
        picks["top_open"].append(pos[opens & (d == 1)])
        picks["top_close"].append(pos[closes & (d == 0)])
        picks["open2"].append(pos[opens & (d == 2)])
        picks["close1"].append(pos[closes & (d == 1)])
        picks["comma2"].append(pos[commas & (d == 2)])
        kinds.append(c[opens & (d == 2)])
        quotes += len(q)
        depth = int(d[-1]) if d.size else depth
    at = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in picks.items()}
    open_kind = np.concatenate(kinds) if kinds else np.zeros(0, np.uint8)
    if depth != 0 or quotes & 1 or len(at["top_open"]) != 1 or len(at["top_close"]) != 1:
        return None
    o, c = int(at["top_open"][0]), int(at["top_close"][0])
    if data[o] != 123 or data[:o].strip(_WS) or data[c + 1:].strip(_WS):
        return None
    cuts = [o] + [int(p) for p in at["top_comma"]] + [c]
    members = [(cuts[i] + 1, cuts[i + 1]) for i in range(len(cuts) - 1)]
    tensors = None
    for i, (s, e) in enumerate(members):
        q1 = data.find(b'"', s, e)
        q2 = data.find(b'"', q1 + 1, e) if q1 >= 0 else -1
        if q2 >= 0 and data[q1 + 1:q2] == b"tensors":
            if tensors is not None:
                return None  # a repeated member: the whole text names it
            tensors = i
    if tensors is None:
        return None
    s, e = members[tensors]
    j = int(np.searchsorted(at["open2"], s))
    if j >= len(at["open2"]) or at["open2"][j] >= e or open_kind[j] != 123:
        return None  # no value, or one that is not an object
    vo = int(at["open2"][j])
    k = int(np.searchsorted(at["close1"], vo))
    if k >= len(at["close1"]) or at["close1"][k] >= e:
        return None
    vc = int(at["close1"][k])
    inner = at["comma2"][np.searchsorted(at["comma2"], vo):np.searchsorted(at["comma2"], vc)]
    if not len(inner) and not data[vo + 1:vc].strip(_WS):
        cuts = np.array([vo], np.int64)  # no entry
    else:
        cuts = np.concatenate([[vo], inner, [vc]]).astype(np.int64)
    return Split(members, tensors, (vo, vc), cuts)
