"""The manifest: frozen dataclasses <-> JSON, and every validation rule of format v1.

A manifest is self-contained: a reader needs nothing else to locate and verify every
byte of a checkpoint. Tables are columnar (numpy arrays) so 10^5..10^6 shards stay cheap.
The tensor and state entries, and the exact checks of one entry, are in
:mod:`ckptfmt.manifest._entries`; the fast path over many tensors in :mod:`ckptfmt.manifest._fast`.

Subpackage ``ckptfmt.manifest``. The manifest: its frozen dataclasses <-> JSON, every validation
rule of the format, its caps, the fast validation path and the references and derived-column
extensions (FORMAT.md 5). Pure: no storage, no I/O. Its modules: ``_caps``, ``_derived``, ``_entries``, ``_fast``,
``_packs``, ``_refs``, ``_stream``. May import: floor, shard. The floor: the top-level modules listed in ``ckptfmt/__init__.py``
(tests/test_layering.py holds the rules and enforces them). The lengths a shard's parts may take,
which the checks and the derived columns compare with, are :func:`ckptfmt.shard.shard_sizes`'s.
Subpackages that may import it: reader, repository, session, interop, manager.
"""
from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ckptfmt.gcpause import paused_gc
from ckptfmt.errors import CheckpointError, InvalidManifestError, ManifestTooLargeError, UnsupportedVersionError
from ckptfmt.manifest._caps import MAX_CHUNK_ROWS as MAX_CHUNK_ROWS
from ckptfmt.manifest._caps import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from ckptfmt.manifest._caps import MAX_NESTING as MAX_NESTING
from ckptfmt.manifest._caps import MAX_OFFSET_ELEMENTS as MAX_OFFSET_ELEMENTS
from ckptfmt.manifest._caps import MAX_SHARD_ROWS as MAX_SHARD_ROWS
from ckptfmt.manifest._caps import MAX_STRUCTURAL_BYTES as MAX_STRUCTURAL_BYTES
from ckptfmt.manifest._caps import MAX_TENSORS as MAX_TENSORS
from ckptfmt.manifest._caps import (CountCaps, check_nesting, check_offset_elements, check_rows, count_structural,
                                    offset_elements, row_counts)
from ckptfmt.manifest._entries import (MAX_KEY_LEN, MAX_OBJECT_KEY_LEN, MAX_TENSOR_BYTES, _U32, _fail, _int,
                                       _members, _typed)
from ckptfmt.manifest._entries import ArraySpec as ArraySpec
from ckptfmt.manifest._entries import ChunkTable as ChunkTable
from ckptfmt.manifest._entries import ShardTable as ShardTable
from ckptfmt.manifest._entries import StateEntry as StateEntry
from ckptfmt.manifest._entries import TensorEntry as TensorEntry
from ckptfmt.manifest._entries import _make_entry as _make_entry
from ckptfmt.manifest._entries import _tensor as _tensor
from ckptfmt.manifest._entries import _tensors_exact as _tensors_exact
from ckptfmt.manifest._entries import check_object_key as check_object_key
from ckptfmt.manifest._derived import derived_columns
from ckptfmt.manifest._fast import Fallback, check_encodable, count_literals, encode_tensors, tensors_fast
from ckptfmt.manifest._refs import KNOWN_EXTENSIONS as KNOWN_EXTENSIONS
from ckptfmt.manifest._refs import REFERENCES as REFERENCES
from ckptfmt.manifest._refs import ZSTD as ZSTD
from ckptfmt.manifest._refs import DERIVED as DERIVED
from ckptfmt.manifest._refs import apply_references, referenced_saves
from ckptfmt.manifest._packs import PACKS as PACKS
from ckptfmt.manifest._packs import apply_packs, packs_payload, take_pack_columns
from ckptfmt.manifest._stream import Split, split_document
from ckptfmt.manifest._entries import PackedRows as PackedRows
from ckptfmt.layout import MARKER_BYTES as MARKER_BYTES
from ckptfmt.layout import MARKER_KEY as MARKER_KEY
from ckptfmt.layout import MAX_STEP as MAX_STEP
from ckptfmt.layout import SAVE_ID_RE as SAVE_ID_RE
from ckptfmt.layout import manifest_key as manifest_key
from ckptfmt.layout import arrays_prefix, is_save_id, state_key, state_name, state_prefix
from ckptfmt.layout import step_of_manifest_key as step_of_manifest_key

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FORMAT_REVISION", "KNOWN_EXTENSIONS", "REFERENCES", "ZSTD", "DERIVED", "PACKS",
           "PackedRows", "packs_payload",
           "MAX_MANIFEST_BYTES", "MAX_NESTING", "check_nesting", "ArraySpec",
           "ShardTable", "ChunkTable", "TensorEntry", "StateEntry", "Manifest", "parse_manifest", "check_object_key",
           "manifest_key", "step_of_manifest_key", "MARKER_KEY", "MARKER_BYTES", "MAX_TENSORS"]

FORMAT_NAME = "ckptfmt"
FORMAT_VERSION = 1
#: The document revision this reader implements (FORMAT.md header, "Document revision"; tests/test_schema.py
#: checks they agree): format version 1 with the
#: extensions of revision 1.1 (``ckptfmt.references``, ``ckptfmt.zstd``), 1.2 (``ckptfmt.derived``) and 1.3
#: (``ckptfmt.packs``).
FORMAT_REVISION = "1.3.1"


@dataclass(frozen=True, eq=False)
class Manifest:
    save_id: str
    step: int
    created_unix: float
    writers: int
    tensors: Mapping[str, TensorEntry]
    state: Mapping[str, StateEntry] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    must_understand: tuple[str, ...] = ()
    extensions: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored object (shards and state) the manifest references."""
        return int(sum(int(t.shards.nbytes.sum()) for t in self.tensors.values()) + sum(s.nbytes for s in self.state.values()))

    @property
    def referenced_nbytes(self) -> int:
        """Bytes of the shard objects this checkpoint references in earlier saves (ckptfmt.references)."""
        return int(sum(t.referenced_nbytes for t in self.tensors.values() if t.objects or t.packed is not None))

    @property
    def written_nbytes(self) -> int:
        """Bytes of the objects this checkpoint's own save wrote (its shards and state)."""
        return self.nbytes - self.referenced_nbytes

    @property
    def referenced_saves(self) -> frozenset[str]:
        """The earlier save ids whose objects this checkpoint references."""
        packed = {e["key"].split("/")[1] for e in self.extensions[PACKS]["objects"]} if PACKS in self.extensions else set()
        return referenced_saves(self.extensions) | frozenset(packed - {self.save_id})

    def _head(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version,
            "must_understand": list(self.must_understand), "extensions": dict(self.extensions),
            "save_id": self.save_id, "step": self.step, "created_unix": self.created_unix,
            "writers": self.writers, "versions": dict(self.versions), "metadata": dict(self.metadata),
            "state": {k: self.state[k].to_json() for k in sorted(self.state)},
        }

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON document; tensor entries in the derived form (FORMAT.md 5.14)
        wherever the manifest lists ckptfmt.derived and the entry allows it."""
        if DERIVED not in self.must_understand:
            return self._head() | {"tensors": {k: self.tensors[k].to_json() for k in sorted(self.tensors)}}
        cols: dict[Any, Any] = {}
        for t in self.tensors.values():
            if t.geometry not in cols:
                cols[t.geometry] = derived_columns(t.geometry)
        return self._head() | {"tensors": {k: self.tensors[k].to_json(cols[self.tensors[k].geometry])
                                           for k in sorted(self.tensors)}}

    def to_bytes(self) -> bytes:
        """Canonical encoding: UTF-8 JSON, sorted keys, compact separators, trailing newline.

        Byte for byte ``json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"),
        ensure_ascii=False, allow_nan=False) + "\n"``; the tensors member is encoded by
        :func:`encode_tensors`, which reuses the text of repeated columns, and written a member at
        a time (the bytes are built once: no whole text beside them)."""
        with paused_gc():
            try:
                text = json.dumps(self._head() | {"tensors": {}}, sort_keys=True, separators=(",", ":"),
                                  ensure_ascii=False, allow_nan=False)
                # Only "versions" (strings) and "writers" (an int) sort after "tensors", so the last
                # '"tensors":{}' is the top-level member (metadata may hold one of its own).
                before, sep, after = text.rpartition('"tensors":{}')
                assert sep, "the tensors member is missing from the encoded head"
                out = io.BytesIO()
                out.write(before.encode())
                out.write(b'"tensors":{')
                comma = b""
                for member in encode_tensors(self.tensors, DERIVED in self.must_understand):
                    out.write(comma)
                    out.write(member.encode())
                    comma = b","
                out.write(b"}")
                out.write(after.encode())
                out.write(b"\n")
                return out.getvalue()
            except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as e:  # NaN, a lone surrogate, a non-JSON value
                raise InvalidManifestError("manifest cannot be encoded as canonical JSON",
                                           found=f"{type(e).__name__}: {str(e)[:200]}") from None

    def validate(self) -> "Manifest":
        """Re-check every rule of format v1 on this manifest. Returns self; raises InvalidManifestError.

        (The commit itself parses the exact bytes it publishes with :func:`parse_manifest`.)"""
        with paused_gc():
            try:
                _from_doc(self.to_json())
            except CheckpointError:
                raise
            except (TypeError, ValueError, KeyError, OverflowError, AttributeError, IndexError, RecursionError) as e:
                raise InvalidManifestError("manifest is malformed", found=f"{type(e).__name__}: {str(e)[:200]}") from None
        return self


# ----------------------------------------------------------------------------- parsing


def parse_manifest(data: bytes, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Parse and fully validate manifest bytes.

    Raises ManifestTooLargeError past ``max_bytes``, UnsupportedVersionError for an unknown
    version or a must_understand extension, DuplicateShardError for overlapping shards and
    InvalidManifestError for every other rule. Never raises anything else.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        _fail("manifest must be bytes", found=type(data).__name__)
    if len(data) > max_bytes:
        raise ManifestTooLargeError("manifest exceeds the size cap", expected=f"<= {max_bytes} bytes", found=len(data))
    data = bytes(data)
    caps = CountCaps.for_size_cap(max_bytes)
    structural = count_structural(data)
    if structural > caps.structural:  # before json.loads builds anything
        raise ManifestTooLargeError("manifest holds too many JSON values", found=structural,
                                    expected=f"<= {caps.structural} structural bytes ({{ [ ,)")
    with paused_gc():
        return _parse(data, caps.after_counting(structural))


def _float_counter() -> tuple[list[int], Callable[[str], float]]:
    """A ``parse_float`` hook that counts the float literals it decodes (in ``count[0]``) and
    refuses one out of float range."""
    count = [0]

    def _float(text: str) -> float:
        count[0] += 1
        value = float(text)
        if not math.isfinite(value):  # 1e400: JSON allows the literal, the canonical encoding cannot hold it
            raise InvalidManifestError("manifest holds a number out of float range", expected="a finite number",
                                       found=text[:40])
        return value
    return count, _float


def _parse(data: bytes, caps: CountCaps) -> Manifest:
    """A large document in pieces where that applies and accepts (the JSON of every tensor is
    never held at once), else whole (which names the error of a broken one). A small one whole:
    its JSON is small, and finding the pieces costs a few milliseconds per megabyte."""
    streamed = _parse_in_pieces(data, caps) if len(data) >= _PIECES_FROM else None
    return streamed if streamed is not None else _parse_whole(data, caps)


def _parse_whole(data: bytes, caps: CountCaps) -> Manifest:
    floats, _float = _float_counter()
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates,
                         parse_float=_float)
    except InvalidManifestError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidManifestError("manifest is not valid UTF-8 JSON", expected="JSON object", found=str(e)[:200]) from None
    if b"\\" in data:  # only \u escapes can smuggle in a lone surrogate (strict UTF-8 decoding rejects raw ones)
        check_encodable(doc)
    # Every float literal is counted above; every boolean literal is a "true" or "false" in the text.
    try:
        return _from_doc(doc, literals=(floats[0], data.count(b"true") + data.count(b"false")), caps=caps)
    except (InvalidManifestError, UnsupportedVersionError):
        raise
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError, IndexError, RecursionError) as e:
        raise InvalidManifestError("manifest is malformed", found=f"{type(e).__name__}: {str(e)[:200]}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidManifestError("manifest repeats a JSON member", expected="unique members", found=dup[:200])
    return d


def _reject_constant(c: str) -> Any:
    raise InvalidManifestError("manifest holds a non-finite number", found=c)


_TOP = {"format", "format_version", "must_understand", "extensions", "save_id", "step", "created_unix",
        "writers", "versions", "metadata", "tensors", "state"}


@dataclass(frozen=True)
class _Head:
    """The checked members of a manifest other than its tensors and state."""

    version: int
    mu: tuple[str, ...]
    save_id: str
    step: int
    created: float
    writers: int
    versions: dict[str, str]
    metadata: dict[str, Any]
    extensions: dict[str, Any]

    @property
    def prefix(self) -> str:
        return arrays_prefix(self.save_id)


def _head(doc: Any) -> _Head:
    """Every check of the manifest's members but its tensors and state, in order."""
    _typed(doc, dict, "manifest")
    if doc.get("format") != FORMAT_NAME:
        _fail("not a ckptfmt manifest", expected=FORMAT_NAME, found=repr(doc.get("format"))[:80])
    version = doc.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise UnsupportedVersionError("unsupported format version", expected=FORMAT_VERSION, found=repr(version)[:80])
    mu = _typed(doc.get("must_understand", []), list, "must_understand")
    unknown = [m for m in mu if type(m) is not str or m not in KNOWN_EXTENSIONS]
    if unknown:
        raise UnsupportedVersionError(f"manifest requires extensions this reader (revision {FORMAT_REVISION}) "
                                      "does not understand", expected=sorted(KNOWN_EXTENSIONS),
                                      found=[str(u)[:80] for u in unknown])
    if len(set(mu)) != len(mu):
        _fail("must_understand repeats an extension", expected="distinct names", found=mu[:10])
    _members(doc, _TOP, "the manifest")  # after the version checks: a newer manifest is "unsupported"
    missing = sorted(_TOP - {"must_understand", "extensions"} - set(doc))
    if missing:
        _fail("manifest lacks required fields", expected=sorted(_TOP), found=f"missing {missing}")
    save_id = _typed(doc["save_id"], str, "save_id")
    if not is_save_id(save_id):
        _fail("save_id has invalid characters", expected=SAVE_ID_RE.pattern, found=save_id[:80])
    step = _int(doc["step"], 0, MAX_STEP, "step")
    created = _typed(doc["created_unix"], (int, float), "created_unix")
    writers = _int(doc["writers"], 1, 1 << 31, "writers")
    versions = _typed(doc["versions"], dict, "versions")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        _fail("versions must map names to version strings")
    metadata = _typed(doc["metadata"], dict, "metadata")
    extensions = _typed(doc.get("extensions", {}), dict, "extensions")
    _check_declared(mu, extensions)
    return _Head(version, tuple(mu), save_id, step, float(created), writers, versions, metadata, extensions)


def _from_doc(doc: Any, literals: tuple[int, int] | None = None, caps: CountCaps = CountCaps()) -> Manifest:
    """Build and check a manifest from its parsed JSON. ``literals``: the document's float count
    and an upper bound of its boolean count, which lets the fast path skip type checks when
    neither occurs inside a tensor entry's tables."""
    h = _head(doc)
    tensors_doc = _typed(doc["tensors"], dict, "tensors")
    if len(tensors_doc) > caps.tensors:
        raise ManifestTooLargeError("manifest holds too many tensors", expected=f"<= {caps.tensors}", found=len(tensors_doc))
    # The free-form members are the only ones that can nest deeply (the rest is at most 6 levels).
    check_nesting(h.metadata, 2, "metadata")
    check_nesting(h.extensions, 2, "extensions")
    _check_sharding_nesting(tensors_doc)
    if caps.count_rows:  # else the structural count already keeps every column below the row caps
        check_rows(tensors_doc, caps)
    if DERIVED in h.mu:  # only a derived entry expands: an explicit entry's offsets are values of the text
        check_offset_elements(tensors_doc, caps)
    clean = False
    if literals is not None:
        f0, b0 = count_literals([v for m, v in doc.items() if m != "tensors"])
        f1, b1 = _sharding_literals(tensors_doc)
        clean = literals == (f0 + f1, b0 + b1)
    # Revision 1.3 (FORMAT.md 5.15): a packed entry's two extra shard columns are checked apart,
    # once every entry is built; without the extension they stay and are unknown members.
    pack_columns = take_pack_columns(tensors_doc) if PACKS in h.mu else {}
    return _manifest(h, _tensors(tensors_doc, h, clean), pack_columns, doc["state"])


def _check_sharding_nesting(tensors_doc: dict[str, Any]) -> None:
    for k, t in tensors_doc.items():
        if type(t) is dict and type(sd := t.get("sharding")) is dict:
            check_nesting(sd, 4, "sharding", key=k)


def _sharding_literals(tensors_doc: dict[str, Any]) -> tuple[int, int]:
    return count_literals([t.get("sharding") for t in tensors_doc.values() if type(t) is dict])


def _tensors(tensors_doc: dict[str, Any], h: _Head, clean: bool) -> dict[str, TensorEntry]:
    """The checked entries of ``tensors_doc``: through the fast path, else the exact checks."""
    codecs = ("raw", "zstd") if ZSTD in h.mu else ("raw",)
    derived = DERIVED in h.mu
    try:
        return tensors_fast(tensors_doc, h.prefix, h.writers, exact=functools.partial(_tensor, codecs=codecs, derived=derived),
                            make=_make_entry, max_key_len=MAX_KEY_LEN, max_object_key_len=MAX_OBJECT_KEY_LEN,
                            no_float_or_bool=clean, derived=derived)
    except Fallback:  # something is off: the exact checks find it and name it
        return _tensors_exact(tensors_doc, h.prefix, h.writers, codecs, derived)


def _manifest(h: _Head, tensors: dict[str, TensorEntry], pack_columns: Mapping[str, tuple[Any, Any]],
              state_doc: Any) -> Manifest:
    """The manifest of checked entries, once the extensions that span tensors are checked and applied."""
    if REFERENCES in h.mu:
        tensors = apply_references(h.extensions[REFERENCES], tensors, h.save_id)
    if PACKS in h.mu:
        referenced = frozenset(k for k, t in tensors.items() if t.objects)
        tensors = apply_packs(h.extensions[PACKS], pack_columns, tensors, h.save_id, referenced)
    state = _state_entries(_typed(state_doc, dict, "state"), h.save_id, h.writers)
    return Manifest(save_id=h.save_id, step=h.step, created_unix=h.created, writers=h.writers, tensors=tensors,
                    state=state, versions=h.versions, metadata=h.metadata, format_version=h.version,
                    must_understand=h.mu, extensions=h.extensions)


#: Tensor entries decoded at once by :func:`_parse_in_pieces` (an empty tensor's entry is about 2 KB of JSON objects).
_BATCH = 2048
#: Manifests from this size on are parsed in pieces (a few batches of entries: below it the whole JSON
#: is a few tens of megabytes at most).
_PIECES_FROM = 4 << 20


class _NotInPieces(Exception):
    """The piecewise parse does not vouch for this manifest: parse it whole."""


def _parse_in_pieces(data: bytes, caps: CountCaps, batch: int = _BATCH) -> Manifest | None:
    """The manifest decoded a top-level member at a time and its tensor entries a batch at a time
    (:mod:`ckptfmt.manifest._stream`), each batch checked and built before the next is decoded, so
    that the JSON of every tensor is never held at once. Every check of :func:`_from_doc` runs,
    on running totals where it spans tensors. It only ever accepts: None where the split does not
    apply or anything at all is wrong, and the caller then parses the document whole, which
    accepts or raises the precise error (tests/test_manifest_stream.py holds both to the same
    answers)."""
    split = split_document(data)
    if split is None:
        return None
    floats, _float = _float_counter()
    decode = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_float=_float, parse_constant=_reject_constant).decode
    try:
        return _from_pieces(data, split, decode, floats, caps, batch)
    except Exception:  # any broken rule, or a text the split cut wrongly: the whole parse names it
        return None


def _one_member(decode: Callable[[str], Any], piece: bytes) -> tuple[str, Any]:
    d = decode("{" + piece.decode("utf-8") + "}")
    if len(d) != 1:
        raise _NotInPieces
    return next(iter(d.items()))


def _from_pieces(data: bytes, split: Split, decode: Callable[[str], Any], floats: list[int], caps: CountCaps,
                 size: int) -> Manifest:
    doc: dict[str, Any] = {}
    for i, (s, e) in enumerate(split.members):
        k, v = _one_member(decode, split.skeleton(data) if i == split.tensors else data[s:e])
        if k in doc or (i == split.tensors) != (k == "tensors") or (k == "tensors" and (type(v) is not dict or v)):
            raise _NotInPieces
        doc[k] = v
    h = _head(doc)
    if split.entries > caps.tensors:
        raise _NotInPieces
    check_nesting(h.metadata, 2, "metadata")
    check_nesting(h.extensions, 2, "extensions")
    tensors: dict[str, TensorEntry] = {}
    pack_columns: dict[str, tuple[Any, Any]] = {}
    shard_rows = chunk_rows = elements = 0
    for s, e, count in split.batches(size):
        raw = data[s:e]
        before = floats[0]
        batch = decode("{" + raw.decode("utf-8") + "}")
        if len(batch) != count or any(k in tensors for k in batch):
            raise _NotInPieces  # a batch cut wrongly, or a tensor key repeated across batches
        _check_sharding_nesting(batch)
        if caps.count_rows:
            rows = row_counts(batch)
            shard_rows, chunk_rows = shard_rows + rows[0], chunk_rows + rows[1]
            if shard_rows > caps.shard_rows or chunk_rows > caps.chunk_rows:
                raise _NotInPieces
        if DERIVED in h.mu:
            elements += offset_elements(batch)[0]
            if elements > caps.offset_elements:
                raise _NotInPieces
        # No float and no boolean in the batch's entries but in their shardings: every float was
        # counted as it was decoded, and every boolean is a "true" or "false" of the batch's text.
        clean = (floats[0] - before, raw.count(b"true") + raw.count(b"false")) == _sharding_literals(batch)
        del raw
        if PACKS in h.mu:
            pack_columns.update(take_pack_columns(batch))
        tensors.update(_tensors(batch, h, clean))
        del batch
    if len({t.array.path for t in tensors.values()}) != len(tensors):  # two tensors of different batches on one array
        raise _NotInPieces
    return _manifest(h, tensors, pack_columns, doc["state"])


def _check_declared(mu: list[str], extensions: dict[str, Any]) -> None:
    """The extensions of revision 1.1 change how a checkpoint is read: their payload and their
    must_understand entry come together (FORMAT.md 11.2), so that a 1.0 reader rejects it."""
    for name in sorted(KNOWN_EXTENSIONS):
        if (name in mu) != (name in extensions):
            _fail(f"extension {name} must be both listed in must_understand and present in extensions",
                  object=name, expected="both or neither",
                  found="only in must_understand" if name in mu else "only in extensions")
    for name in (ZSTD, DERIVED):
        if name in mu and extensions[name] != {}:
            _fail(f"{name} takes an empty object", object=name, expected={}, found=repr(extensions[name])[:80])


def _state_entries(state_doc: dict[str, Any], save_id: str, writers: int) -> dict[str, StateEntry]:
    """The checked state entries (FORMAT.md 5.8): names, scopes, ranks and keys agree."""
    state: dict[str, StateEntry] = {}
    for name, s in state_doc.items():
        _typed(s, dict, "state entry", name)
        scope = s.get("scope")
        if scope not in ("global", "rank"):
            _fail("state scope must be 'global' or 'rank'", key=name, found=repr(scope)[:40])
        _members(s, {"key", "nbytes", "crc32c", "scope"} | ({"rank"} if scope == "rank" else set()), "a state entry", name)
        rank = _int(s.get("rank"), 0, writers - 1, "state rank", name) if scope == "rank" else None
        want_name, want_key = state_name(rank), state_key(save_id, rank)
        if name != want_name:
            _fail("state entry name does not match its scope", key=name, expected=want_name, found=name)
        skey = check_object_key(s.get("key"), prefix=state_prefix(save_id), key=name)
        if skey != want_key:
            _fail("state object key does not match its entry", key=name, object=skey, expected=want_key, found=skey)
        state[name] = StateEntry(name, skey, _int(s.get("nbytes"), 0, MAX_TENSOR_BYTES, "state nbytes", name),
                                 _int(s.get("crc32c"), 0, _U32 - 1, "state crc32c", name), scope, rank)
    return state
