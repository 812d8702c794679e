"""The extension ``ckptfmt.references`` (FORMAT.md 5.13, revision 1.1): shard rows whose object
belongs to an earlier committed save of the same repository. Also the names of the other
extensions, and when a save uses ``ckptfmt.derived`` (5.14).

The payload, under ``extensions["ckptfmt.references"]``::

    {"tensors": {"<key path>": [{"save_id": "<earlier save id>",
                                 "path": "saves/<earlier save id>/t/<i:06d>",
                                 "shards": [<shard row>, ...]}, ...]}}

Each group names one array of one earlier save and the rows of the tensor's shard table whose
object is ``path + "/" + shards.key[row]`` there. Everything else about those rows (size, index
crc32c, chunk table) is in the tensor's own tables and is checked exactly as for the manifest's
own objects. Pure: parsing and building only, no I/O.
"""
from __future__ import annotations

from typing import Any, Mapping

from ckptfmt.manifest._derived import DerivedColumns, derived_columns
from ckptfmt.manifest._entries import TensorEntry, _fail, _typed, check_object_key, replace_entry
from ckptfmt.layout import arrays_prefix, is_save_id
from ckptfmt.manifest._packs import PACKS

__all__ = ["REFERENCES", "ZSTD", "DERIVED", "KNOWN_EXTENSIONS", "MANIFEST_COLUMNS", "DERIVED_MIN_ROWS", "wants_derived", "any_in_derived_form", "apply_references", "references_payload", "referenced_saves"]

REFERENCES = "ckptfmt.references"
ZSTD = "ckptfmt.zstd"
#: Revision 1.2 (FORMAT.md 5.14): tensor entries may leave out the columns their geometry determines.
DERIVED = "ckptfmt.derived"
#: The extensions this reader implements (FORMAT.md 11.2): those of revisions 1.1, 1.2 and 1.3.
KNOWN_EXTENSIONS: frozenset[str] = frozenset({REFERENCES, ZSTD, DERIVED, PACKS})
#: ``SaveOptions.manifest_columns``: "auto" writes the derived form from this many shard rows on
#: (below it the explicit columns cost under ~0.2 s to parse, and old readers keep reading).
MANIFEST_COLUMNS = ("auto", "explicit", "derived")
DERIVED_MIN_ROWS = 1 << 16


def wants_derived(option: str, shard_rows: int) -> bool:
    """Whether a save writes its manifest in the derived form (FORMAT.md 5.14)."""
    if option not in MANIFEST_COLUMNS:
        raise ValueError(f"SaveOptions.manifest_columns must be one of {MANIFEST_COLUMNS}, got {option!r}")
    return option == "derived" or (option == "auto" and shard_rows >= DERIVED_MIN_ROWS)


def any_in_derived_form(tensors: Mapping[str, TensorEntry]) -> bool:
    """Whether a manifest that lists ckptfmt.derived would write some entry with shard rows in the
    derived form (codec "raw", exactly the columns its geometry determines; FORMAT.md 5.14). A save
    lists the extension only then: a manifest that leaves nothing out stays readable by revision 1.1."""
    cols: dict[Any, DerivedColumns] = {}
    for t in tensors.values():
        if t.array.codec != "raw" or not len(t.shards):
            continue
        if t.geometry not in cols:
            cols[t.geometry] = derived_columns(t.geometry)
        if cols[t.geometry].matches(t):
            return True
    return False

_GROUP = frozenset({"save_id", "path", "shards"})


def apply_references(payload: Any, tensors: dict[str, TensorEntry], save_id: str) -> dict[str, TensorEntry]:
    """The tensor entries with their referenced rows set (:attr:`TensorEntry.objects`), after
    checking the payload: only known members; each group names a valid earlier save id (not the
    manifest's own), an array path under ``saves/<that id>/t/`` that no other group or tensor
    uses, and rows of that tensor, ascending, each referenced once. InvalidManifestError otherwise."""
    _typed(payload, dict, REFERENCES)
    if set(payload) != {"tensors"}:
        _fail(f"{REFERENCES} must hold exactly the member 'tensors'", object=REFERENCES, expected=["tensors"],
              found=sorted(map(str, payload))[:10])
    doc = _typed(payload["tensors"], dict, f"{REFERENCES}.tensors")
    used_paths = {t.array.path for t in tensors.values()}
    out = dict(tensors)
    for key, groups in doc.items():
        t = tensors.get(key)
        if t is None:
            _fail(f"{REFERENCES} names a tensor the manifest does not hold", key=str(key)[:200], object=REFERENCES,
                  expected="a key path of the manifest", found="missing")
        _typed(groups, list, f"{REFERENCES} groups", key)
        if not groups:
            _fail(f"{REFERENCES} lists a tensor with no group", key=key, object=REFERENCES, expected=">= 1 group", found=0)
        rows: dict[int, str] = {}
        for g in groups:
            _typed(g, dict, f"{REFERENCES} group", key)
            if set(g) != _GROUP:
                _fail(f"a {REFERENCES} group has the wrong members", key=key, object=REFERENCES,
                      expected=sorted(_GROUP), found=sorted(map(str, g))[:10])
            sid = g["save_id"]
            if type(sid) is not str or not is_save_id(sid) or sid == save_id:
                _fail(f"a {REFERENCES} group must name an earlier save, not this one", key=key, object=REFERENCES,
                      expected=f"a save id other than {save_id}", found=repr(sid)[:80])
            path = check_object_key(g["path"], prefix=arrays_prefix(sid), key=key)
            if path in used_paths:
                _fail("two tensors or groups name one array", key=key, object=path, expected="each array once",
                      found="named twice")
            used_paths.add(path)
            shards = _typed(g["shards"], list, f"{REFERENCES} shards", key)
            if not shards or any(type(j) is not int for j in shards) or shards != sorted(set(shards)):
                _fail(f"{REFERENCES} shards must be distinct ascending integers", key=key, object=path,
                      expected="ascending shard rows", found=repr(shards)[:80])
            if shards[0] < 0 or shards[-1] >= len(t.shards):
                _fail(f"{REFERENCES} names a shard row the tensor does not have", key=key, object=path,
                      expected=f"rows in [0, {len(t.shards)})", found=[shards[0], shards[-1]])
            for j in shards:
                if j in rows:
                    _fail("a shard row is referenced twice", key=key, object=path, expected="each row once", found=j)
                rows[j] = path
        out[key] = replace_entry(t, objects=rows)
    return out


def references_payload(refs: Mapping[str, Mapping[int, tuple[str, str]]]) -> dict[str, Any]:
    """The canonical payload for ``refs``: key path -> {shard row: (save id, array path)}. Groups
    sorted by (save id, path), rows ascending; tensors without references are left out."""
    tensors: dict[str, Any] = {}
    for key in sorted(refs):
        groups: dict[tuple[str, str], list[int]] = {}
        for row, where in refs[key].items():
            groups.setdefault(where, []).append(int(row))
        if groups:
            tensors[key] = [{"save_id": sid, "path": path, "shards": sorted(rows)}
                            for (sid, path), rows in sorted(groups.items())]
    return {"tensors": tensors}


def referenced_saves(extensions: Mapping[str, Any]) -> frozenset[str]:
    """The earlier save ids a (validated) manifest's references name."""
    payload = extensions.get(REFERENCES)
    if not isinstance(payload, Mapping):
        return frozenset()
    return frozenset(g["save_id"] for groups in payload.get("tensors", {}).values() for g in groups)
