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
before anything is written; ``json.dumps`` would raise too, or silently keep only one.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptfmt.errors import InvalidStateError

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

    Raises InvalidStateError for a key JSON cannot render or two keys that render alike.
    ``value`` is not modified.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            text = _key(k, path)
            if text in out:
                raise InvalidStateError(f"two keys under {path or '<root>'!r} are both stored as {text!r}",
                                        key=f"{path}/{text}" if path else text, found=repr(k))
            out[text] = json_keys(v, f"{path}/{text}" if path else text)
        return out
    if isinstance(value, (list, tuple)):
        return [json_keys(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(value)]
    return value
