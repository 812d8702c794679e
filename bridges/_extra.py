"""The caller's ``extra`` / per-rank values: dict keys the way ``json.dumps`` writes them.

The format's state is msgpack with string dict keys. A Hugging Face config dict (``id2label``
has int keys) or any value ``json.dumps`` accepts is stored with its keys rendered as JSON
renders them, so what comes back equals ``json.loads(json.dumps(x))`` for JSON values:

=============  =====================  ==========================================
key            stored (and returned)  note
=============  =====================  ==========================================
``"a"``        ``"a"``                unchanged
``1``          ``"1"``                ints (and int subclasses) in decimal
``1.5``        ``"1.5"``              ``repr``; ``nan`` -> ``"NaN"``, ``inf`` -> ``"Infinity"``
``True``       ``"true"``             ``False`` -> ``"false"``
``None``       ``"null"``
=============  =====================  ==========================================

Tuples come back as lists. Values are otherwise stored as they are (msgpack also takes bytes and
numpy arrays, which JSON does not). Two keys of one dict that render alike (``1`` and ``"1"``),
or a key of another type (a numpy integer, a tuple), raise InvalidStateError naming the key path
before anything is written; ``json.dumps`` would raise too, or silently keep only one. A dict or
list that contains itself raises ReferenceCycleError (an InvalidStateError) naming the key path
where the cycle closes, as ``json.dumps`` raises ValueError("Circular reference detected").
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptfmt.errors import InvalidStateError, ReferenceCycleError

__all__ = ["json_keys"]


def _key(k: Any, path: str) -> str:
    if isinstance(k, str):
        return str.__str__(k)
    if k is None:
        return "null"
    if isinstance(k, bool):
        return "true" if k else "false"
    if isinstance(k, int):
        return int.__repr__(k)
    if isinstance(k, float):
        if math.isnan(k):
            return "NaN"
        if math.isinf(k):
            return "Infinity" if k > 0 else "-Infinity"
        return float.__repr__(k)
    raise InvalidStateError(f"dict key {k!r} under {path or '<root>'!r} has type {type(k).__name__}; "
                            "JSON keys are str, int, float, bool or None", key=path or "<root>",
                            found=type(k).__name__)


def json_keys(value: Any, path: str = "") -> Any:
    """A copy of ``value`` whose dict keys (at any depth) are rendered as JSON renders them.

    Raises InvalidStateError for a key JSON cannot render or two keys that render alike, and
    ReferenceCycleError (naming the key path where the cycle closes) for a dict or list that
    contains itself. ``value`` is not modified.
    """
    return _rendered(value, path, set())


def _rendered(value: Any, path: str, within: set[int]) -> Any:
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    if id(value) in within:
        where = path or "<root>"
        raise ReferenceCycleError(f"{where!r} contains itself (a reference cycle closes here)", key=where,
                                  expected="a tree of values", found=f"a {type(value).__name__} seen above")
    within.add(id(value))
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            text = _key(k, path)
            if text in out:
                raise InvalidStateError(f"two keys under {path or '<root>'!r} are both stored as {text!r}",
                                        key=f"{path}/{text}" if path else text, found=repr(k))
            out[text] = _rendered(v, f"{path}/{text}" if path else text, within)
    else:
        out = [_rendered(v, f"{path}/{i}" if path else str(i), within)  # type: ignore[assignment]
               for i, v in enumerate(value)]
    within.discard(id(value))
    return out
