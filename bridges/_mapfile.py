"""A mapping as a JSON document (``ckptfmt export --mapping FILE``), and back.

The document (docs/INTEROP.md, "Mapping files")::

    {"mapping": 1,
     "source_sep": "/", "target_sep": ".",
     "rules": [
       {"source": "model/layers/attn/q/kernel",
        "target": "model.layers.{i}.self_attn.q_proj.weight",
        "transforms": [{"op": "Select", "axis": 0, "index": "i", "size": 2},
                       {"op": "Merge", "axis": 1, "sizes": [8, 8]},
                       {"op": "Transpose", "axes": [1, 0]}]},
       {"source": ["h/attn/q/kernel", "h/attn/k/kernel", "h/attn/v/kernel"],
        "target": "transformer.h.{i}.attn.c_attn.weight",
        "transforms": [{"op": "Select", "axis": 0, "index": "i"}, {"op": "Concat", "axis": 1}]},
       {"source": "w", "target": "w.weight", "permute": {"2": [1, 0]}}],
     "ignore": ["optimizer/*"], "keep": []}

Every member is checked: an unknown member, op or transform field, or a value of the wrong type
is a ValueError naming the rule, so a typo never silently maps nothing. Transforms are the
frozen dataclasses of :mod:`bridges.mapping`; their fields are the dataclass fields.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ._joins import Concat, Part, Stack
from ._reshape import Merge, Unmerge
from ._rules import Mapping, Rule
from ._transforms import Cast, Reorder, Scale, Select, Transform, Transpose

__all__ = ["mapping_to_json", "mapping_from_json", "load_mapping_file", "MAPPING_VERSION"]

MAPPING_VERSION = 1
_OPS: dict[str, type] = {c.__name__: c for c in (Select, Merge, Unmerge, Transpose, Reorder, Concat, Part,
                                                   Stack, Scale, Cast)}
_MAX_FILE_BYTES = 16 << 20


def _plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _transform_to_json(op: Transform) -> dict[str, Any]:
    name = type(op).__name__
    if name not in _OPS:
        raise ValueError(f"transform {op!r} has no JSON form")
    out: dict[str, Any] = {"op": name}
    for f in dataclasses.fields(op):
        v = getattr(op, f.name)
        if f.default is not dataclasses.MISSING and v == f.default:
            continue
        out[f.name] = _plain(v)
    return out


def mapping_to_json(m: Mapping) -> dict[str, Any]:
    """The JSON document of ``m`` (every rule, transform, glob and separator)."""
    rules = []
    for r in m.rules:
        doc: dict[str, Any] = {"source": r.source if isinstance(r.source, str) else list(r.source), "target": r.target}
        if r.permute is not None:
            doc["permute"] = {str(n): list(a) for n, a in r.permute.items()}
        if r.transforms:
            doc["transforms"] = [_transform_to_json(op) for op in r.transforms]
        rules.append(doc)
    return {"mapping": MAPPING_VERSION, "source_sep": m.source_sep, "target_sep": m.target_sep, "rules": rules,
            "ignore": list(m.ignore), "keep": list(m.keep)}


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _transform_from_json(doc: Any, where: str) -> Transform:
    if not isinstance(doc, dict) or not isinstance(doc.get("op"), str):
        raise ValueError(f"{where}: a transform is an object with an 'op' (one of {sorted(_OPS)})")
    cls = _OPS.get(doc["op"])
    if cls is None:
        raise ValueError(f"{where}: unknown op {doc['op']!r}; known: {sorted(_OPS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    flags = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, bool)}
    extra = sorted(set(doc) - fields - {"op"})
    if extra:
        raise ValueError(f"{where}: {doc['op']} has no field(s) {extra}; its fields: {sorted(fields)}")
    kwargs = {}
    for k, v in doc.items():
        if k == "op":
            continue
        if isinstance(v, dict) or (isinstance(v, bool) != (k in flags)):
            raise ValueError(f"{where}: {doc['op']}.{k} has the wrong type: {v!r}")
        kwargs[k] = _tuples(v)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {doc['op']}({kwargs}) is not valid: {e}") from None


def mapping_from_json(doc: Any) -> Mapping:
    """A :class:`Mapping` from its JSON document (see the module docstring). ValueError naming the
    rule for anything malformed."""
    if not isinstance(doc, dict):
        raise ValueError("a mapping document is a JSON object")
    allowed = {"mapping", "source_sep", "target_sep", "rules", "ignore", "keep"}
    extra = sorted(set(doc) - allowed)
    if extra:
        raise ValueError(f"unknown member(s) {extra} of a mapping document; known: {sorted(allowed)}")
    if doc.get("mapping", MAPPING_VERSION) != MAPPING_VERSION:
        raise ValueError(f"mapping document version {doc.get('mapping')!r}; this reader knows {MAPPING_VERSION}")
    rules = []
    for i, r in enumerate(doc.get("rules", [])):
        where = f"rule {i}"
        if not isinstance(r, dict) or set(r) - {"source", "target", "transforms", "permute"} or "target" not in r:
            raise ValueError(f"{where}: a rule is an object with source, target and transforms or permute")
        src = r.get("source")
        if not (isinstance(src, str) or (isinstance(src, list) and src and all(isinstance(s, str) for s in src))):
            raise ValueError(f"{where}: source must be a string or a list of strings")
        if not isinstance(r["target"], str):
            raise ValueError(f"{where}: target must be a string")
        ops = r.get("transforms", [])
        if not isinstance(ops, list):
            raise ValueError(f"{where}: transforms must be a list")
        perm = r.get("permute")
        if perm is not None:
            if not isinstance(perm, dict):
                raise ValueError(f"{where}: permute maps ndim (a string) to axes")
            try:
                perm = {int(n): tuple(int(a) for a in axes) for n, axes in perm.items()}
            except (TypeError, ValueError):
                raise ValueError(f"{where}: permute maps ndim to a list of axes") from None
        try:
            rules.append(Rule(src if isinstance(src, str) else tuple(src), r["target"], perm,
                              tuple(_transform_from_json(op, f"{where} transform {j}") for j, op in enumerate(ops))))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    for name in ("ignore", "keep"):
        if not isinstance(doc.get(name, []), list) or not all(isinstance(g, str) for g in doc.get(name, [])):
            raise ValueError(f"{name} must be a list of glob strings")
    seps = [doc.get("source_sep", "/"), doc.get("target_sep", "/")]
    if not all(isinstance(s, str) and s for s in seps):
        raise ValueError("source_sep and target_sep must be non-empty strings")
    return Mapping(tuple(rules), tuple(doc.get("ignore", [])), tuple(doc.get("keep", [])), seps[0], seps[1])


def load_mapping_file(path: str | os.PathLike) -> Mapping:
    """Read a mapping document from a JSON file (at most 16 MiB). ValueError when malformed."""
    with open(path, "rb") as fh:
        data = fh.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"{path}: a mapping file is at most {_MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    return mapping_from_json(doc)

