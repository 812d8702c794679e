"""The extension ``ckptfmt.packs`` (FORMAT.md 5.15, revision 1.3): shards stored back to back in a
few objects per writer, and the manifest's object table that says where each row lies.

The payload, under ``extensions["ckptfmt.packs"]``::

    {"objects": [{"key": "saves/<save id>/p/<r:05d>-<n:06d>", "nbytes": <object length>}, ...]}

and each packed tensor entry's shard table holds two more columns, ``object`` (a position in the
object table) and ``start`` (the object offset of the shard's first byte). Pure: parsing and
building only, no I/O.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ckptfmt.layout import MAX_TENSOR_BYTES, is_save_id
from ckptfmt.manifest._entries import PackedRows, TensorEntry, _fail, _int_array, _typed, check_object_key, replace_entry

__all__ = ["PACKS", "PACK_COLUMNS", "take_pack_columns", "apply_packs", "packs_payload"]

PACKS = "ckptfmt.packs"
#: The two shard columns of a packed tensor entry.
PACK_COLUMNS = ("object", "start")
_ENTRY = {"key", "nbytes"}


def take_pack_columns(tensors_doc: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The ``object`` and ``start`` columns of every tensor entry that holds one of them, taken out
    of its shard table (a copy of the table replaces it in ``tensors_doc``, which is the parser's
    own document), so that the tensor parsers see the columns of revision 1.2 only."""
    out: dict[str, tuple[Any, Any]] = {}
    for k, t in tensors_doc.items():
        if type(t) is dict and type(sh := t.get("shards")) is dict and ("object" in sh or "start" in sh):
            rest = {c: v for c, v in sh.items() if c not in PACK_COLUMNS}
            out[k] = (sh.get("object"), sh.get("start"))
            t["shards"] = rest  # type: ignore[index]
    return out


def apply_packs(payload: Any, columns: Mapping[str, tuple[Any, Any]], tensors: dict[str, TensorEntry],
                save_id: str, referenced: frozenset[str]) -> dict[str, TensorEntry]:
    """The tensor entries with their packed rows set (:attr:`TensorEntry.packed`), after checking
    the payload and the columns by every rule of FORMAT.md 5.15: the object table's members, keys
    and sizes; both columns or neither; each row inside its object; no two rows of one object
    sharing a byte; every object named by a row; no packed tensor in ``ckptfmt.references``
    (``referenced``: the key paths its payload names). InvalidManifestError otherwise."""
    _typed(payload, dict, PACKS)
    if set(payload) != {"objects"}:
        _fail(f"{PACKS} must hold exactly the member 'objects'", object=PACKS, expected=["objects"],
              found=sorted(map(str, payload))[:10])
    table = _typed(payload["objects"], list, f"{PACKS}.objects")
    if not table:
        _fail(f"{PACKS} lists no object", object=PACKS, expected=">= 1 object", found=0)
    keys: list[str] = []
    sizes: list[int] = []
    for e in table:
        _typed(e, dict, f"{PACKS} object")
        if set(e) != _ENTRY:
            _fail(f"a {PACKS} object has the wrong members", object=PACKS, expected=sorted(_ENTRY),
                  found=sorted(map(str, e))[:10])
        key = check_object_key(e["key"], prefix="saves/")
        sid = key.split("/")[1]
        if not is_save_id(sid):
            _fail(f"a {PACKS} object lies under no save id", object=key, expected="saves/<save id>/...", found=sid[:80])
        n = e["nbytes"]
        if type(n) is not int or not 1 <= n <= MAX_TENSOR_BYTES:
            _fail(f"a {PACKS} object's nbytes is out of range", object=key, expected=f"[1, {MAX_TENSOR_BYTES}]",
                  found=repr(n)[:40])
        keys.append(key)
        sizes.append(n)
    if len(set(keys)) != len(keys):
        _fail(f"{PACKS} lists an object twice", object=PACKS, expected="distinct keys",
              found=next(k for k in keys if keys.count(k) > 1))
    size_arr = np.asarray(sizes, np.int64)
    shared_keys, shared_sizes = tuple(keys), tuple(sizes)
    out = dict(tensors)
    all_obj, all_lo, all_hi, all_key = [], [], [], []
    for k, (obj_doc, start_doc) in columns.items():
        t = tensors.get(k)
        if t is None:  # the tensor parsers already refused every entry not in tensors
            continue
        if obj_doc is None or start_doc is None:
            _fail("a packed tensor entry must hold both shards.object and shards.start (FORMAT.md 5.15)", key=k,
                  expected="both or neither", found="only " + ("start" if obj_doc is None else "object"))
        if k in referenced:
            _fail(f"a packed tensor entry is named in ckptfmt.references (FORMAT.md 5.15)", key=k,
                  expected="packed rows or reference groups", found="both")
        n = len(t.shards)
        obj = _int_array(obj_doc, n, 0, len(keys) - 1, "shards.object", k)
        start = _int_array(start_doc, n, 0, MAX_TENSOR_BYTES, "shards.start", k)
        hi = start + t.shards.nbytes  # both <= 2^62: no overflow
        if n and np.any(hi > size_arr[obj]):
            j = int(np.flatnonzero(hi > size_arr[obj])[0])
            _fail("a packed shard runs past the end of its object", key=k, object=keys[int(obj[j])],
                  expected=f"start + nbytes <= {sizes[int(obj[j])]}", found=f"row {j}: {int(start[j])} + {int(t.shards.nbytes[j])}")
        for a in (obj, start):
            a.flags.writeable = False
        out[k] = replace_entry(t, packed=PackedRows(shared_keys, shared_sizes, obj, start))
        all_obj.append(obj)
        all_lo.append(start)
        all_hi.append(hi)
        all_key.append(np.full(n, len(all_key), np.int64))
    _check_disjoint(all_obj, all_lo, all_hi, all_key, list(columns), keys)
    return out


def _check_disjoint(objs: list[np.ndarray], los: list[np.ndarray], his: list[np.ndarray], who: list[np.ndarray],
                    names: list[str], keys: list[str]) -> None:
    """Rows of one object never share a byte, and every object is named by a row (FORMAT.md 5.15
    rules 4 and 5): one sort of every packed row by (object, start)."""
    obj = np.concatenate(objs) if objs else np.zeros(0, np.int64)
    used = np.zeros(len(keys), bool)
    used[obj] = True
    if not used.all():
        _fail(f"{PACKS} lists an object that no shard row names", object=keys[int(np.flatnonzero(~used)[0])],
              expected="every object named by a row", found="unused")
    if not obj.size:
        return
    lo, hi, owner = np.concatenate(los), np.concatenate(his), np.concatenate(who)
    order = np.lexsort((lo, obj))
    o, l, h = obj[order], lo[order], hi[order]
    clash = np.flatnonzero((o[1:] == o[:-1]) & (l[1:] < h[:-1]))
    if clash.size:
        a, b = order[clash[0]], order[clash[0] + 1]
        _fail("two packed shard rows share bytes of one object", key=names[int(owner[a])], object=keys[int(o[clash[0]])],
              expected="disjoint byte ranges", found=f"[{int(lo[a])}, {int(hi[a])}) and [{int(lo[b])}, {int(hi[b])}) "
                                                     f"({names[int(owner[b])]})")


def packs_payload(keys: Sequence[str], sizes: Sequence[int]) -> dict[str, Any]:
    """The payload for an object table of ``keys`` with their lengths, in that order."""
    return {"objects": [{"key": k, "nbytes": int(n)} for k, n in zip(keys, sizes)]}
