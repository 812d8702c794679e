"""What ``ckptfmt diff`` and ``ckptfmt show`` compute (plain dicts) and how they are drawn.

``diff`` reads two manifests, and with ``values`` both steps' tensors, one tensor at a time. Without
``values`` the manifests decide what they can (see :func:`_by_manifest`): unchanged when the newer
step references the older step's objects for all of a tensor (FORMAT.md 8.4) or every chunk's
crc32c is the same, changed when shape, dtype or a raw chunk's crc32c differ, else "unknown".
``show`` reads exactly the boxes of one slice through the reader (only the chunks it overlaps,
FORMAT.md 9) and reports the bytes it read.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ckptfmt._types import Box
from ckptfmt.errors import ShapeMismatchError
from ckptfmt_tools.cli._render import plural, safe, size

__all__ = ["diff_steps", "diff_view", "parse_slice", "show_tensor", "show_view"]


def _by_manifest(ta: Any, tb: Any, save_a: str) -> str:
    """"none" when the manifests alone prove the bytes equal (every shard referenced from step A's
    save, or the same shard geometry and codec with the same crc32c for every chunk); "bytes" when
    they prove them different (same geometry, raw chunks, a crc32c differs); else "unknown"."""
    if len(tb.shards) and len(tb.objects) == len(tb.shards) and all(
            p.startswith(f"saves/{save_a}/") for p in tb.objects.values()):
        return "none"
    same_geometry = (tuple(ta.array.chunk_shape) == tuple(tb.array.chunk_shape)
                     and tuple(ta.array.shard_shape) == tuple(tb.array.shard_shape)
                     and ta.array.codec == tb.array.codec and np.array_equal(ta.shards.offset, tb.shards.offset))
    if not same_geometry:
        return "unknown"
    if np.array_equal(ta.chunks.crc32c, tb.chunks.crc32c):
        return "none"
    return "bytes" if ta.array.codec == "raw" else "unknown"


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> tuple[bool, float | None]:
    """(equal, max |a - b| over the elements both hold as numbers; None when there are none)."""
    equal = bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    x, y = a.astype(np.float64), b.astype(np.float64)
    both = ~(np.isnan(x) | np.isnan(y))
    diff = np.abs(x[both] - y[both])
    return equal, (float(diff.max()) if diff.size else None)


def _tensor_row(key: str, ta: Any, tb: Any, save_a: str) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "shape": [list(ta.shape), list(tb.shape)], "dtype": [ta.dtype, tb.dtype],
                           "written_bytes": int(tb.shards.nbytes.sum()) - tb.referenced_nbytes,
                           "referenced_bytes": tb.referenced_nbytes, "max_abs_diff": None}
    if tuple(ta.shape) != tuple(tb.shape) or ta.dtype != tb.dtype:
        row["change"] = "shape" if tuple(ta.shape) != tuple(tb.shape) else "dtype"
    else:
        row["change"] = _by_manifest(ta, tb, save_a)
    return row


def diff_steps(repo: Any, a: int, b: int, *, values: bool) -> dict[str, Any]:
    """Tensors added, removed and changed from step ``a`` to step ``b``; bytes ``b`` wrote and
    referenced. With ``values``, every common tensor of equal shape is read from both steps (verified)
    and compared exactly, with its max abs difference. Raises the reader's CheckpointError."""
    ma, mb = repo.manifest(a), repo.manifest(b)
    rows = [_tensor_row(k, ma.tensors[k], mb.tensors[k], ma.save_id) for k in sorted(set(ma.tensors) & set(mb.tensors))]
    if values:
        ca, cb = repo.open(a), repo.open(b)
        for r in rows:
            if r["change"] in ("none", "bytes", "unknown"):
                equal, r["max_abs_diff"] = _max_abs_diff(ca.read(r["key"]), cb.read(r["key"]))
                r["change"] = "none" if equal else "values"
    changed = [r for r in rows if r["change"] != "none"]

    def brief(m: Any, k: str) -> dict[str, Any]:
        t = m.tensors[k]
        return {"key": k, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes}

    return {"a": a, "b": b, "save_ids": [ma.save_id, mb.save_id], "values_compared": values,
            "added": [brief(mb, k) for k in sorted(set(mb.tensors) - set(ma.tensors))],
            "removed": [brief(ma, k) for k in sorted(set(ma.tensors) - set(mb.tensors))],
            "changed": changed, "unchanged": len(rows) - len(changed),
            "written_bytes": mb.written_nbytes, "referenced_bytes": mb.referenced_nbytes,
            "referenced_from_a": ma.save_id in mb.referenced_saves}


def diff_view(console: Console, url: str, doc: dict[str, Any]) -> None:
    t = Table(title=f"{safe(url)}: step {doc['a']} -> step {doc['b']} ({len(doc['added'])} added, "
                    f"{len(doc['removed'])} removed, {len(doc['changed'])} changed, {doc['unchanged']} unchanged; "
                    f"step {doc['b']} wrote {size(doc['written_bytes'])} and references "
                    f"{size(doc['referenced_bytes'])} of earlier saves)")
    for col, kw in (("", {}), ("key path", {"overflow": "fold"}), ("shape", {}), ("dtype", {}),
                    ("change", {}), ("max abs diff", {"justify": "right"}), ("written", {"justify": "right"}),
                    ("referenced", {"justify": "right"})):
        t.add_column(col, **kw)
    for r in doc["added"]:
        t.add_row("[green]+[/]", safe(r["key"]), str(tuple(r["shape"])), safe(r["dtype"]), "added", "-", "-", "-")
    for r in doc["removed"]:
        t.add_row("[red]-[/]", safe(r["key"]), str(tuple(r["shape"])), safe(r["dtype"]), "removed", "-", "-", "-")
    for r in doc["changed"]:
        shape = " -> ".join(str(tuple(s)) for s in r["shape"]) if r["shape"][0] != r["shape"][1] else str(tuple(r["shape"][1]))
        dtype = " -> ".join(r["dtype"]) if r["dtype"][0] != r["dtype"][1] else r["dtype"][1]
        what = {"unknown": "rechunked or compressed: use --values", "bytes": "bytes (crc32c)"}.get(r["change"], r["change"])
        mad = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.6g}"
        t.add_row("[yellow]~[/]", safe(r["key"]), safe(shape), safe(dtype), what, mad,
                  size(r["written_bytes"]), size(r["referenced_bytes"]))
    if not (doc["added"] or doc["removed"] or doc["changed"]):
        console.print(f"steps {doc['a']} and {doc['b']} of {safe(url)} hold the same tensors: no change "
                      f"({plural(doc['unchanged'], 'tensor')}{', values compared' if doc['values_compared'] else ''})")
        return
    console.print(t)


def parse_slice(text: str | None, shape: tuple[int, ...], key: str) -> tuple[Box, tuple[int, ...]]:
    """``"0:4,:"`` -> (the box it covers, the dimensions an integer index drops). Dimensions left
    out are whole; negative bounds count from the end; no steps. ShapeMismatchError (naming the key)
    for a slice that does not fit the tensor."""
    parts = [p.strip() for p in text.split(",")] if text not in (None, "") else []
    if len(parts) > len(shape):
        raise ShapeMismatchError("the slice has more dimensions than the tensor", key=key, object=text,
                                 expected=f"at most {len(shape)} comma-separated ranges", found=len(parts))
    offset, extent, drop = [], [], []
    for d, n in enumerate(shape):
        p = parts[d] if d < len(parts) else ":"
        try:
            if ":" in p:
                lo_s, _, rest = p.partition(":")
                if ":" in rest:
                    raise ValueError("steps are not supported")
                lo = int(lo_s) if lo_s else 0
                hi = int(rest) if rest else n
                lo, hi = (lo + n if lo < 0 else lo), (hi + n if hi < 0 else hi)
            else:
                lo = int(p) + (n if p.startswith("-") else 0)
                hi = lo + 1
                drop.append(d)
        except ValueError as exc:
            raise ShapeMismatchError(f"dimension {d} of the slice is not START:STOP or an index ({exc})", key=key,
                                     object=text, expected="e.g. 0:4,: or 3", found=p) from None
        if not 0 <= lo < hi <= n:
            raise ShapeMismatchError(f"dimension {d} of the slice is empty or outside the tensor", key=key,
                                     object=text, expected=f"0 <= start < stop <= {n}", found=f"{lo}:{hi}")
        offset.append(lo)
        extent.append(hi - lo)
    return Box(tuple(offset), tuple(extent)), tuple(drop)


def _stats(x: np.ndarray) -> dict[str, Any]:
    f = x.astype(np.float64)
    nan = int(np.isnan(f).sum())
    finite = f[~np.isnan(f)]
    return {"count": int(x.size), "nan_count": nan,
            "min": float(finite.min()) if finite.size else None, "max": float(finite.max()) if finite.size else None,
            "mean": float(finite.mean()) if finite.size else None}


def _json_values(x: np.ndarray) -> Any:
    """Values as JSON: integers and bools as they are, floats as numbers with NaN and infinities
    as null (JSON has no such numbers; the statistics count the NaNs)."""
    if x.dtype.kind in "biu":
        return x.tolist()
    f = x.astype(np.float64)
    return np.where(np.isfinite(f), f, None).tolist()


def show_tensor(repo: Any, step: int | None, key: str, slice_text: str | None, *,
                values: bool) -> tuple[dict[str, Any], np.ndarray]:
    """One slice of one tensor: (its document, the values read). The document holds the statistics
    (NaNs left out of min, max and mean), with ``values`` the values as JSON, and ``bytes_read``: what
    the reader fetched for it (only the chunks the slice overlaps). Raises the reader's
    CheckpointError, or ShapeMismatchError for a slice that does not fit."""
    ckpt = repo.open(step)
    t = ckpt.tensor(key)
    box, drop = parse_slice(slice_text, tuple(t.shape), key)
    before = ckpt.stats.bytes_read
    x = ckpt.read(key, box)
    got = np.squeeze(x, axis=drop) if drop else x
    doc: dict[str, Any] = {"step": ckpt.step, "key": key, "dtype": t.dtype, "shape": list(t.shape),
                           "slice": {"text": slice_text or ":", "offset": list(box.offset), "shape": list(box.shape)},
                           "bytes_read": int(ckpt.stats.bytes_read - before), "slice_bytes": int(x.nbytes),
                           "stored_bytes": int(t.shards.nbytes.sum()), "stats": _stats(x)}
    if values:
        doc["values"] = _json_values(got)
    return doc, got


def show_view(console: Console, url: str, doc: dict[str, Any], got: np.ndarray) -> None:
    s = doc["stats"]

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.6g}"

    console.print(f"{safe(doc['key'])} [{safe(doc['slice']['text'])}] of step {doc['step']} in {safe(url)}: "
                  f"{safe(doc['dtype'])} {tuple(doc['shape'])}, slice {tuple(doc['slice']['shape'])}")
    console.print(f"min {num(s['min'])}  max {num(s['max'])}  mean {num(s['mean'])}  "
                  f"NaN {s['nan_count']} of {plural(s['count'], 'element')}")
    console.print(f"read {size(doc['bytes_read'])} of the tensor's {size(doc['stored_bytes'])} stored "
                  f"(the slice holds {size(doc['slice_bytes'])})")
    if "values" in doc:
        for line in np.array2string(got, threshold=200, max_line_width=console.width or 120).splitlines():
            console.print(safe(line))
