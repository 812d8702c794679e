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
is an :class:`InvalidMappingError` (a ValueError) naming the rule, so a typo never silently maps
nothing. Transforms are the frozen dataclasses of :mod:`bridges.mapping`; their fields are the
dataclass fields.

Caps (bridges/MAPPING.md, "Mapping files: caps"): a document costs what its caps allow, never
what it declares. They are checked on the parsed document before any transform is built, and
every integer a transform declares is checked before anything is enumerated from it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from ckptfmt.errors import CheckpointError

from bridges.mapping._joins import Concat, Part, Stack
from bridges.mapping._quant import Dequantize
from bridges.mapping._reshape import Merge, Unmerge
from bridges.mapping._rules import Mapping, Rule
from bridges.mapping._transforms import Cast, Reorder, Scale, Shift, Transform, Transpose
from bridges.mapping._joins import Select

__all__ = ["mapping_to_json", "mapping_from_json", "load_mapping_file", "load_names_file", "InvalidMappingError",
           "MAPPING_VERSION", "MAX_NAMES_BYTES",
           "MAX_FILE_BYTES", "MAX_NESTING", "MAX_RULES", "MAX_SOURCES", "MAX_TRANSFORMS", "MAX_PATTERN_CHARS",
           "MAX_PLACEHOLDERS", "MAX_GLOBS", "MAX_AXES", "MAX_STACKED", "MAX_DIM"]

MAPPING_VERSION = 1
_OPS: dict[str, type] = {c.__name__: c for c in (Select, Merge, Unmerge, Transpose, Reorder, Concat, Part,
                                                   Stack, Scale, Shift, Cast, Dequantize)}
#: Caps of a mapping document (bridges/MAPPING.md, "Mapping files: caps").
MAX_FILE_BYTES = 16 << 20
MAX_NESTING = 8             # levels of arrays and objects; the document is level 1 (a field's list is level 6)
MAX_RULES = 1 << 14
MAX_SOURCES = 1024          # source patterns of one rule (a Concat's inputs)
MAX_TRANSFORMS = 64         # transforms of one rule
MAX_PATTERN_CHARS = 4096    # a source or target pattern, or a glob (a manifest's key cap)
MAX_PLACEHOLDERS = 8        # placeholders in one pattern
MAX_GLOBS = 4096            # ignore and keep globs, each
MAX_AXES = 64               # an axis number (|axis| < 64), and the length of axes/sizes lists: a manifest's rank cap
MAX_STACKED = 1 << 20       # Select/Stack size and index, Part index: the stacked length (a manifest's tensor cap)
MAX_DIM = 1 << 62           # any other size (a manifest's dimension cap)
_PLACEHOLDER_OPEN = "{"
MAX_NAMES_BYTES = 1 << 20   # a names file (ckptfmt export --names): a preset's name table, a few KB


class InvalidMappingError(CheckpointError, ValueError):
    """A mapping document is malformed or over a cap (bridges/MAPPING.md): which rule, which member,
    the cap against the value found. Raised before anything is enumerated or written."""


def _bad(where: str, what: str, expected: Any = None, found: Any = None) -> InvalidMappingError:
    return InvalidMappingError(f"{where}: {what}", object=where, expected=expected, found=found)


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
    for r, tier in zip(m.rules, m.tiers):
        doc: dict[str, Any] = {"source": r.source if isinstance(r.source, str) else list(r.source), "target": r.target}
        if r.permute is not None:
            doc["permute"] = {str(n): list(a) for n, a in r.permute.items()}
        if r.transforms:
            doc["transforms"] = [_transform_to_json(op) for op in r.transforms]
        if r.also:
            doc["also"] = True
        if tier:
            doc["tier"] = tier
        rules.append(doc)
    return {"mapping": MAPPING_VERSION, "source_sep": m.source_sep, "target_sep": m.target_sep, "rules": rules,
            "ignore": list(m.ignore), "keep": list(m.keep)}


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _int_in(lo: int, hi: int) -> Any:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _ints(lo: int, hi: int, least: int, most: int | None) -> Any:
    one = _int_in(lo, hi)
    return lambda v: (isinstance(v, list) and least <= len(v) and (most is None or len(v) <= most)
                      and all(one(x) for x in v))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: What each transform field may hold: (test, description). "?" after a kind: null allowed.
_KINDS: dict[str, tuple[Any, str]] = {
    "axis": (_int_in(1 - MAX_AXES, MAX_AXES - 1), f"an integer axis, |axis| < {MAX_AXES}"),
    "index": (lambda v: _int_in(0, MAX_STACKED - 1)(v) or (isinstance(v, str) and _NAME.fullmatch(v) is not None),
              f"an integer index 0 <= index < {MAX_STACKED}, or a placeholder name"),
    "name": (lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None, "a placeholder name"),
    "stacked": (_int_in(1, MAX_STACKED), f"an integer 1 <= size <= {MAX_STACKED}"),
    "merge": (lambda v: _int_in(2, MAX_AXES)(v) or _ints(1, MAX_DIM, 2, MAX_AXES)(v),
              f"a count 2..{MAX_AXES}, or 2..{MAX_AXES} sizes of 1..{MAX_DIM}"),
    "dims": (_ints(1, MAX_DIM, 2, MAX_AXES), f"2..{MAX_AXES} sizes of 1..{MAX_DIM}"),
    "axes": (_ints(0, MAX_AXES - 1, 0, MAX_AXES), f"at most {MAX_AXES} axes, each < {MAX_AXES}"),
    "perm": (_ints(0, MAX_DIM, 0, None), "a list of indices"),
    "concat": (_ints(0, MAX_DIM, 1, MAX_SOURCES), f"1..{MAX_SOURCES} sizes of 0..{MAX_DIM}"),
    "part": (_int_in(0, MAX_SOURCES - 1), f"an integer 0 <= index < {MAX_SOURCES}"),
    "parts": (lambda v: _int_in(1, MAX_SOURCES)(v) or _ints(0, MAX_DIM, 1, MAX_SOURCES)(v),
              f"a count 1..{MAX_SOURCES}, or 1..{MAX_SOURCES} sizes"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dtype": (lambda v: isinstance(v, str) and 0 < len(v) <= 64, "a dtype name"),
    "block": (_ints(1, MAX_DIM, 1, MAX_AXES), f"1..{MAX_AXES} block sizes of 1..{MAX_DIM}"),
}
_FIELDS: dict[str, dict[str, str]] = {
    "Select": {"axis": "axis", "index": "index", "size": "stacked?"},
    "Merge": {"axis": "axis", "sizes": "merge"}, "Unmerge": {"axis": "axis", "sizes": "dims"},
    "Transpose": {"axes": "axes"}, "Reorder": {"axis": "axis", "perm": "perm"},
    "Concat": {"axis": "axis", "sizes": "concat?"}, "Part": {"axis": "axis", "index": "part", "parts": "parts"},
    "Stack": {"axis": "axis", "over": "name", "size": "stacked?"},
    "Scale": {"factor": "number", "divide": "bool", "allow_inexact_inverse": "bool"},
    "Shift": {"offset": "number", "allow_inexact_inverse": "bool"},
    "Cast": {"dtype": "dtype", "source_dtype": "dtype?"},
    "Dequantize": {"block": "block", "dtype": "dtype"},
}


def _transform_from_json(doc: Any, where: str) -> Transform:
    if not isinstance(doc, dict) or not isinstance(doc.get("op"), str):
        raise _bad(where, f"a transform is an object with an 'op' (one of {sorted(_OPS)})")
    cls = _OPS.get(doc["op"])
    if cls is None:
        raise _bad(where, f"unknown op {doc['op'][:64]!r}; known: {sorted(_OPS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(doc) - fields - {"op"})
    if extra:
        raise _bad(where, f"{doc['op']} has no field(s) {extra[:8]}; its fields: {sorted(fields)}")
    kwargs = {}
    for k, v in doc.items():
        if k == "op":
            continue
        kind = _FIELDS[doc["op"]][k]
        test, what = _KINDS[kind.rstrip("?")]
        if not ((v is None and kind.endswith("?")) or test(v)):
            shown = v if not isinstance(v, list) else (v[:8] + ["..."] if len(v) > 8 else v)
            raise _bad(where, f"{doc['op']}.{k} has the wrong type or is over its cap", expected=what,
                       found=f"{shown!r}"[:200] + (f" ({len(v)} entries)" if isinstance(v, list) else ""))
        kwargs[k] = _tuples(v)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise _bad(where, f"{doc['op']} is not valid: {str(e)[:200]}") from None


def _check_nesting(doc: Any) -> None:
    """InvalidMappingError when the document nests arrays and objects deeper than MAX_NESTING."""
    stack = [(doc, 1)]
    while stack:
        value, level = stack.pop()
        if level > MAX_NESTING:
            raise _bad("the mapping document", "nests arrays and objects too deeply",
                       expected=f"<= {MAX_NESTING} levels", found=f"more than {MAX_NESTING}")
        for c in (value.values() if isinstance(value, dict) else value):
            if isinstance(c, (dict, list)):
                stack.append((c, level + 1))


def _check_pattern(p: Any, where: str, what: str) -> None:
    if not isinstance(p, str):
        raise _bad(where, f"{what} must be a string", found=type(p).__name__)
    if len(p) > MAX_PATTERN_CHARS:
        raise _bad(where, f"{what} is too long", expected=f"<= {MAX_PATTERN_CHARS} characters", found=len(p))
    n = p.count(_PLACEHOLDER_OPEN)
    if n > MAX_PLACEHOLDERS:
        raise _bad(where, f"{what} has too many placeholders", expected=f"<= {MAX_PLACEHOLDERS}", found=n)


def _check_counts(doc: dict[str, Any]) -> None:
    """The count caps, on the parsed document, before anything is built from it."""
    rules = doc.get("rules", [])
    if not isinstance(rules, list):
        raise _bad("the mapping document", "rules must be a list", found=type(rules).__name__)
    if len(rules) > MAX_RULES:
        raise _bad("the mapping document", "has too many rules", expected=f"<= {MAX_RULES}", found=len(rules))
    for name in ("ignore", "keep"):
        globs = doc.get(name, [])
        if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
            raise _bad("the mapping document", f"{name} must be a list of glob strings")
        if len(globs) > MAX_GLOBS:
            raise _bad("the mapping document", f"has too many {name} globs", expected=f"<= {MAX_GLOBS}",
                       found=len(globs))
        for g in globs:
            _check_pattern(g, f"{name} glob", "a glob")
    for i, r in enumerate(rules):
        if not isinstance(r, dict):
            continue
        where = f"rule {i}"
        src, ops, perm = r.get("source"), r.get("transforms", []), r.get("permute")
        if isinstance(src, list) and len(src) > MAX_SOURCES:
            raise _bad(where, "has too many sources", expected=f"<= {MAX_SOURCES}", found=len(src))
        for p in (src if isinstance(src, list) else [src]):
            _check_pattern(p, where, "source")
        _check_pattern(r.get("target"), where, "target")
        if isinstance(ops, list) and len(ops) > MAX_TRANSFORMS:
            raise _bad(where, "has too many transforms", expected=f"<= {MAX_TRANSFORMS}", found=len(ops))
        if isinstance(perm, dict) and (len(perm) > MAX_AXES or any(not isinstance(a, list) or len(a) > MAX_AXES
                                                                   for a in perm.values())):
            raise _bad(where, "permute has too many entries or axes", expected=f"<= {MAX_AXES} each",
                       found=len(perm))


def mapping_from_json(doc: Any) -> Mapping:
    """A :class:`Mapping` from its JSON document (see the module docstring). InvalidMappingError
    (a ValueError) naming the rule for anything malformed or over a cap, before any rule is built."""
    if not isinstance(doc, dict):
        raise _bad("the mapping document", "a mapping document is a JSON object", found=type(doc).__name__)
    allowed = {"mapping", "source_sep", "target_sep", "rules", "ignore", "keep"}
    extra = sorted(set(doc) - allowed)
    if extra:
        raise _bad("the mapping document", f"unknown member(s) {extra[:8]} of a mapping document; known: {sorted(allowed)}")
    if doc.get("mapping", MAPPING_VERSION) != MAPPING_VERSION:
        raise _bad("the mapping document", f"mapping document version {doc.get('mapping')!r}; this reader knows "
                   f"{MAPPING_VERSION}")
    _check_nesting(doc)
    _check_counts(doc)
    rules, tiers = [], []
    for i, r in enumerate(doc.get("rules", [])):
        where = f"rule {i}"
        if not isinstance(r, dict) or set(r) - {"source", "target", "transforms", "permute", "also", "tier"} \
                or "target" not in r:
            raise _bad(where, "a rule is an object with source, target and transforms or permute (and also, tier)")
        if not isinstance(r.get("also", False), bool) or not _int_in(0, MAX_RULES)(r.get("tier", 0)):
            raise _bad(where, "also must be true or false, tier an integer", expected=f"0 <= tier <= {MAX_RULES}",
                       found=f"{r.get('also')!r}, {r.get('tier')!r}"[:200])
        tiers.append(r.get("tier", 0))
        src = r.get("source")
        if not (isinstance(src, str) or (isinstance(src, list) and src and all(isinstance(s, str) for s in src))):
            raise _bad(where, "source must be a string or a list of strings")
        ops = r.get("transforms", [])
        if not isinstance(ops, list):
            raise _bad(where, "transforms must be a list")
        perm = r.get("permute")
        if perm is not None:
            if not isinstance(perm, dict):
                raise _bad(where, "permute maps ndim (a string) to axes")
            if not all(_int_in(0, MAX_AXES)(_digits(n)) and _ints(0, MAX_AXES - 1, 0, MAX_AXES)(a)
                       for n, a in perm.items()):
                raise _bad(where, "permute maps ndim to a list of axes", expected=f"ndim and axes < {MAX_AXES}")
            perm = {int(n): tuple(axes) for n, axes in perm.items()}
        try:
            rules.append(Rule(src if isinstance(src, str) else tuple(src), r["target"], perm,
                              tuple(_transform_from_json(op, f"{where} transform {j}") for j, op in enumerate(ops)),
                              also=r.get("also", False)))
        except InvalidMappingError:
            raise
        except ValueError as e:
            raise _bad(where, str(e)[:300]) from None
    seps = [doc.get("source_sep", "/"), doc.get("target_sep", "/")]
    if not all(isinstance(s, str) and 0 < len(s) <= 16 for s in seps):
        raise _bad("the mapping document", "source_sep and target_sep must be non-empty strings (at most 16 characters)")
    return Mapping(tuple(rules), tuple(doc.get("ignore", [])), tuple(doc.get("keep", [])), seps[0], seps[1],
                   tuple(tiers))


def _digits(n: str) -> int | None:
    return int(n) if isinstance(n, str) and n.isdigit() and len(n) <= 3 else None


def _json_file(path: str | os.PathLike, cap: int, what: str) -> Any:
    """The JSON document of ``path``, a file of at most ``cap`` bytes (a mapping or names file);
    InvalidMappingError when it is larger or not JSON, OSError when it cannot be read."""
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise _bad(str(path), f"a {what} file is too large", expected=f"<= {cap} B", found=f"more than {cap} B")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise _bad(str(path), "not JSON: nested too deeply to parse", expected=f"<= {MAX_NESTING} levels") from None
    except ValueError as e:
        raise _bad(str(path), f"not JSON: {str(e)[:200]}") from None


def load_mapping_file(path: str | os.PathLike) -> Mapping:
    """Read a mapping document from a JSON file of at most MAX_FILE_BYTES. InvalidMappingError (a
    ValueError) when malformed or over a cap; OSError when it cannot be read."""
    return mapping_from_json(_json_file(path, MAX_FILE_BYTES, "mapping"))


def load_names_file(path: str | os.PathLike) -> dict[str, str]:
    """A preset's ``names=`` from a JSON file (``ckptfmt export --names``): one object of name key ->
    path, at most MAX_NAMES_BYTES. InvalidMappingError (a ValueError) when it is not that, naming
    the member; the preset itself rejects a name key it lacks (ValueError)."""
    doc = _json_file(path, MAX_NAMES_BYTES, "names")
    if not isinstance(doc, dict):
        raise _bad(str(path), "a names file is one JSON object of name key -> path", found=type(doc).__name__)
    for k, v in doc.items():
        if not isinstance(v, str) or not v:
            raise _bad(str(path), f"names[{k[:64]!r}] must be a non-empty path string", found=f"{v!r}"[:200])
        _check_pattern(v, f"{path}: names[{k[:64]!r}]", "a path")
    return dict(doc)
