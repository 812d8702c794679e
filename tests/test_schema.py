"""spec/manifest.schema.json agrees with the manifests ckptfmt writes and with its parser.

* The schema is a valid JSON Schema (draft 2020-12).
* It accepts the golden example and every manifest the code writes for a spread of layouts
  (0-d, empty, uneven, replicated, several boxes per writer, every dtype, per-rank state).
* Broken controls: each mutation below is rejected by the schema AND by
  :func:`ckptfmt.parse_manifest`, so that the two never drift apart silently.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable

import jsonschema
import ml_dtypes
import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "spec" / "manifest.schema.json").read_text())
GOLDEN = ROOT / "spec" / "examples" / "repo" / "manifests" / "00000000000000000007.json"
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
_names = itertools.count()


def _schema_errors(doc: Any) -> list[str]:
    return [e.message for e in VALIDATOR.iter_errors(doc)]


def _save(shards: list[LocalShard], **kw: Any) -> dict[str, Any]:
    url = f"memory://schema-{next(_names)}"
    m = ckptfmt.save(url, kw.pop("step", 3), shards, **kw)
    data = ckptfmt.Repository(url).storage.read(f"manifests/{m.step:020d}.json")
    assert data is not None
    return json.loads(data)


def _whole(key: str, a: np.ndarray, **kw: Any) -> LocalShard:
    return LocalShard(key, a.shape, a.dtype, Box.full(a.shape), a, **kw)


def _split_rows(key: str, a: np.ndarray, parts: int) -> list[LocalShard]:
    """torch.chunk-style row split held by one writer as several boxes (trailing boxes may be empty)."""
    n = a.shape[0]
    step = -(-n // parts)
    out = []
    for i in range(parts):
        lo, hi = min(i * step, n), min((i + 1) * step, n)
        out.append(LocalShard(key, a.shape, a.dtype, Box((lo,) + (0,) * (a.ndim - 1), (hi - lo,) + a.shape[1:]),
                              a[lo:hi]))
    return out


DTYPE_ARRAYS = {
    "bool": np.array([True, False, True]),
    "int8": np.arange(-3, 3, dtype=np.int8), "uint8": np.arange(6, dtype=np.uint8),
    "int16": np.arange(6, dtype=np.int16), "uint16": np.arange(6, dtype=np.uint16),
    "int32": np.arange(6, dtype=np.int32), "uint32": np.arange(6, dtype=np.uint32),
    "int64": np.arange(6, dtype=np.int64), "uint64": np.arange(6, dtype=np.uint64),
    "float16": np.linspace(0, 1, 6, dtype=np.float16), "float32": np.linspace(0, 1, 6, dtype=np.float32),
    "float64": np.linspace(0, 1, 6), "complex64": np.arange(6).astype(np.complex64),
    "complex128": np.arange(6).astype(np.complex128),
    "bfloat16": np.linspace(0, 1, 6).astype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.linspace(0, 1, 6).astype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.linspace(0, 1, 6).astype(ml_dtypes.float8_e5m2),
}


def _layouts() -> dict[str, Callable[[], dict[str, Any]]]:
    rows = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    return {
        "golden": lambda: json.loads(GOLDEN.read_bytes()),
        "scalar_and_state": lambda: _save([_whole("count", np.array(5, np.int64))],
                                          state={"epoch": 2, "rng": np.arange(3, dtype=np.uint32)},
                                          rank_state={"cursor": 17}, metadata={"run": "x", "n": [1, 2]}),
        "empty_tensor": lambda: _save([_whole("empty", np.zeros((0, 3), np.float32))]),
        "uneven_rows_with_empty_tail": lambda: _save(_split_rows("w", rows, 8)),
        "columns_small_chunks": lambda: _save(
            [LocalShard("w", rows.shape, rows.dtype, Box((0, c), (10, 1)), rows[:, c:c + 1]) for c in range(4)],
            options=ckptfmt.SaveOptions(chunk_target_bytes=8)),
        "two_d_blocks": lambda: _save(
            [LocalShard("w", rows.shape, rows.dtype, Box((r, c), (5, 2)), rows[r:r + 5, c:c + 2])
             for r in (0, 5) for c in (0, 2)], options=ckptfmt.SaveOptions(chunk_target_bytes=12)),
        "every_dtype": lambda: _save([_whole(f"dtypes/{k}", v) for k, v in DTYPE_ARRAYS.items()
                                  if not k.startswith("complex")]),
    "complex": lambda: _save([_whole(f"dtypes/{k}", v) for k, v in DTYPE_ARRAYS.items() if k.startswith("complex")]),
        "golden_1_2_derived": lambda: json.loads((ROOT / "spec" / "examples" / "repo-1.2" / "manifests" /
                                                  GOLDEN.name).read_bytes()),
        "derived_blocks_and_uneven_rows": lambda: _save(
            [LocalShard("w", rows.shape, rows.dtype, Box((r, c), (5, 2)), rows[r:r + 5, c:c + 2])
             for r in (0, 5) for c in (0, 2)] + _split_rows("u", rows, 8),
            options=ckptfmt.SaveOptions(chunk_target_bytes=12, manifest_columns="derived")),
        "large_step_pytree_and_fqn_keys": lambda: _save(
            [_whole("opt_state/0/mu/dense/kernel", rows), _whole("layers.0.attn.q_proj.weight", rows)],
            step=(1 << 63) - 1),
    }


LAYOUTS = _layouts()
def _params(names: list[str]) -> list[Any]:
    return list(names)


_written: dict[str, dict[str, Any]] = {}


def _written_manifest(layout: str) -> dict[str, Any]:
    if layout not in _written:
        _written[layout] = LAYOUTS[layout]()
    return _written[layout]


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("layout", _params(sorted(LAYOUTS)))
def test_schema_accepts_what_the_code_writes(layout: str) -> None:
    doc = _written_manifest(layout)
    assert _schema_errors(doc) == []
    ckptfmt.parse_manifest(json.dumps(doc).encode())  # and the code's own parser agrees


# ------------------------------------------------------------------ broken controls

def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_bytes())


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if isinstance(d, list) else d[p]
        if isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value
    return f


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def f(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        del d[last]
    return f


W = "tensors.params/w"
S = "state.global"
BROKEN: dict[str, Callable[[dict[str, Any]], None]] = {
    # missing fields
    **{f"missing_{f}": _del(f) for f in ("format", "format_version", "save_id", "step", "created_unix",
                                        "writers", "versions", "metadata", "tensors", "state")},
    "missing_tensor_shape": _del(f"{W}.shape"),
    "missing_tensor_array": _del(f"{W}.array"),
    "missing_shards_nbytes": _del(f"{W}.shards.nbytes"),
    # the derived form (FORMAT.md 5.14): both tables at once, and only with its extension
    "derived_shards_explicit_chunks": lambda d: [_del(f"{W}.shards.{c}")(d) for c in ("offset", "key", "nbytes")],
    "explicit_shards_derived_chunks": lambda d: [_del(f"{W}.chunks.{c}")(d) for c in ("offset", "nbytes")],
    "missing_chunks_crc32c": _del(f"{W}.chunks.crc32c"),
    "missing_state_crc32c": _del(f"{S}.crc32c"),
    # wrong types
    "step_is_string": _set("step", "7"),
    "step_is_bool": _set("step", True),
    "step_negative": _set("step", -1),
    "step_too_large": _set("step", 1 << 63),
    "writers_zero": _set("writers", 0),
    "created_unix_string": _set("created_unix", "2026-01-01"),
    "versions_not_strings": _set("versions.numpy", 2),
    "metadata_list": _set("metadata", [1, 2]),
    "tensors_list": _set("tensors", []),
    "shape_negative": _set(f"{W}.shape", [-5, 3]),
    "shape_string": _set(f"{W}.shape", "5,3"),
    "shard_writer_string": _set(f"{W}.shards.writer", ["0", "1"]),
    "chunk_crc_too_large": _set(f"{W}.chunks.crc32c.0", 1 << 32),
    "chunk_crc_negative": _set(f"{W}.chunks.crc32c.0", -1),
    "index_crc_float": _set(f"{W}.shards.index_crc32c.0", 1.5),
    "state_nbytes_string": _set(f"{S}.nbytes", "54"),
    "state_scope_unknown": _set(f"{S}.scope", "node"),
    "rank_scope_without_rank": _set(f"{S}.scope", "rank"),
    # versions and unknown encodings
    "format_version_2": _set("format_version", 2),
    "format_version_string": _set("format_version", "1"),
    "format_other": _set("format", "safetensors"),
    "codec_zstd": _set(f"{W}.array.codec", "zstd"),
    "dtype_unknown": _set(f"{W}.dtype", "float128"),
    "dtype_numpy_spelling": _set(f"{W}.dtype", "<f4"),
    "shard_shape_zero": _set(f"{W}.array.shard_shape", [0, 3]),
    # key safety
    "save_id_with_slash": _set("save_id", "a/b"),
    "save_id_dotdot": _set("save_id", ".."),
    "array_path_dotdot": _set(f"{W}.array.path", "saves/000000000007-20260101T000000-0badcafe/t/../../../etc"),
    "array_path_absolute": _set(f"{W}.array.path", "/etc/passwd"),
    "array_path_url": _set(f"{W}.array.path", "s3://bucket/saves/x/t/000002"),
    "state_key_absolute": _set(f"{S}.key", "/etc/passwd"),
    "state_key_backslash": _set(f"{S}.key",
                                "saves/000000000007-20260101T000000-0badcafe/state\\..\\..\\x"),
    "state_key_control_char": _set(f"{S}.key",
                                   "saves/000000000007-20260101T000000-0badcafe/state/g\nlobal.msgpack"),
    "shard_key_dotdot": _set(f"{W}.shards.key.0", "../../../../x"),
    # unknown members (FORMAT.md 11.1: new data goes under "extensions")
    "unknown_top_level_member": _set("compression", "zstd"),
    "unknown_tensor_member": _set(f"{W}.byte_order", "big"),
    "unknown_array_member": _set(f"{W}.array.compressor", {"id": "zstd"}),
}


@pytest.mark.parametrize("name", _params(sorted(BROKEN)))
def test_broken_control_is_rejected_by_schema_and_parser(name: str) -> None:
    doc = _golden()
    assert _schema_errors(doc) == []  # the control starts from a valid manifest
    BROKEN[name](doc)
    assert _schema_errors(doc), f"schema accepted broken control {name}"
    with pytest.raises(ckptfmt.InvalidManifestError):
        ckptfmt.parse_manifest(json.dumps(doc).encode())


GOLDEN_1_2 = ROOT / "spec" / "examples" / "repo-1.2" / "manifests" / GOLDEN.name


def _zstd_codec(d: dict[str, Any]) -> None:
    """params/w in the derived form with codec zstd, its extension declared: only the codec is wrong."""
    d["must_understand"] = sorted(d["must_understand"] + ["ckptfmt.zstd"])
    d["extensions"]["ckptfmt.zstd"] = {}
    d["tensors"]["params/w"]["array"]["codec"] = "zstd"


def _explicit_shards(d: dict[str, Any]) -> None:
    """params/b's shard table written out, its chunk table left derived: some but not all five."""
    t = d["tensors"]["params/b"]
    t["shards"].update(offset=[[0], [2]], key=["c/0", "c/1"], nbytes=[44, 44])


# The ckptfmt.derived rules of FORMAT.md 5.14 (issue 24), from the 1.2 golden example.
BROKEN_DERIVED: dict[str, Callable[[dict[str, Any]], None]] = {
    "listed_without_payload": lambda d: d["extensions"].pop("ckptfmt.derived"),
    "payload_without_listing": _set("must_understand", []),
    "derived_entries_without_extension": lambda d: d.update(must_understand=[], extensions={}),
    "payload_not_empty": lambda d: d["extensions"].update({"ckptfmt.derived": {"columns": 5}}),
    "derived_entry_with_codec_zstd": _zstd_codec,
    "some_but_not_all_five_columns": _explicit_shards,
}


@pytest.mark.parametrize("name", sorted(BROKEN_DERIVED))
def test_broken_derived_manifest_is_rejected_by_schema_and_parser(name: str) -> None:
    doc = json.loads(GOLDEN_1_2.read_bytes())
    assert _schema_errors(doc) == []  # the control: the 1.2 golden example
    ckptfmt.parse_manifest(json.dumps(doc).encode())
    BROKEN_DERIVED[name](doc)
    assert _schema_errors(doc), f"schema accepted broken control {name}"
    with pytest.raises(ckptfmt.InvalidManifestError):
        ckptfmt.parse_manifest(json.dumps(doc).encode())


def test_the_derived_extension_may_be_listed_over_explicit_entries() -> None:
    """A reader accepts ckptfmt.derived over entries that all keep their columns (a writer SHOULD NOT
    write that, 5.14, but it is valid); the schema accepts it too."""
    doc = _golden()
    doc["must_understand"], doc["extensions"] = ["ckptfmt.derived"], {"ckptfmt.derived": {}}
    assert _schema_errors(doc) == []
    assert ckptfmt.parse_manifest(json.dumps(doc).encode()).must_understand == ("ckptfmt.derived",)


def test_unknown_format_version_is_an_unsupported_version_error() -> None:
    doc = _golden()
    doc["format_version"] = 2
    with pytest.raises(ckptfmt.UnsupportedVersionError):
        ckptfmt.parse_manifest(json.dumps(doc).encode())
    doc = _golden()
    doc["must_understand"] = ["org.example.zstd"]
    doc["extensions"] = {"org.example.zstd": {}}
    assert _schema_errors(doc) == []  # structurally fine; a v1 reader must still refuse it
    with pytest.raises(ckptfmt.UnsupportedVersionError):
        ckptfmt.parse_manifest(json.dumps(doc).encode())


def test_optional_extension_fields_default_to_empty() -> None:
    doc = _golden()
    del doc["must_understand"], doc["extensions"]
    assert _schema_errors(doc) == []
    m = ckptfmt.parse_manifest(json.dumps(doc).encode())
    assert m.must_understand == () and dict(m.extensions) == {}


# Rules the parser enforces that a JSON Schema cannot express: the parser rejects them.
SEMANTIC: dict[str, Callable[[dict[str, Any]], None]] = {
    "gap_missing_shard": lambda d: [d["tensors"]["params/w"]["shards"][c].pop() for c in
                                    ("offset", "writer", "key", "nbytes", "index_crc32c")],
    "overlap_duplicate_offset": _set(f"{W}.shards.offset.1", [0, 0]),
    "shard_out_of_bounds": _set(f"{W}.shards.offset.1", [6, 0]),
    "shard_off_grid": _set(f"{W}.shards.offset.1", [2, 0]),
    "shard_key_mismatch": _set(f"{W}.shards.key.1", "c/0/0"),
    "column_length_mismatch": lambda d: d["tensors"]["params/w"]["shards"]["writer"].append(0),
    "chunk_count_mismatch": lambda d: [d["tensors"]["params/w"]["chunks"][c].pop() for c in
                                       ("offset", "nbytes", "crc32c")],
    "chunk_past_data_section": _set(f"{W}.chunks.offset.4", 60),
    "chunk_nbytes_wrong": _set(f"{W}.chunks.nbytes.0", 15),
    "writer_out_of_range": _set(f"{W}.shards.writer.1", 2),
    "shape_overflow": _set(f"{W}.shape", [1 << 61, 1 << 61]),
    "integer_written_as_float": _set("step", 7.0),
    "chunk_shape_not_divisor": _set(f"{W}.array.chunk_shape", [2, 3]),
    "array_path_other_save": _set(f"{W}.array.path", "saves/other-save/t/000002"),
    "nan_created": lambda d: d.__setitem__("created_unix", float("nan")),
}


@pytest.mark.parametrize("name", sorted(SEMANTIC))
def test_semantic_rule_is_enforced_by_the_parser(name: str) -> None:
    doc = _golden()
    SEMANTIC[name](doc)
    with pytest.raises(ckptfmt.InvalidManifestError):
        ckptfmt.parse_manifest(json.dumps(doc).encode())


def test_manifest_size_cap() -> None:
    data = GOLDEN.read_bytes()
    with pytest.raises(ckptfmt.ManifestTooLargeError):
        ckptfmt.parse_manifest(data, max_bytes=len(data) - 1)
    ckptfmt.parse_manifest(data, max_bytes=len(data))


def test_golden_manifest_is_canonical() -> None:
    # FORMAT.md 5.1: sorted keys, compact separators, UTF-8, one trailing newline.
    data = GOLDEN.read_bytes()
    doc = json.loads(data)
    assert data == (json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    assert ckptfmt.parse_manifest(data).to_bytes() == data


def test_duplicate_json_member_is_rejected() -> None:
    # FORMAT.md 5.1: two parsers must never disagree on which duplicate wins.
    data = GOLDEN.read_bytes().replace(b'"step":7', b'"step":7,"step":8')
    assert data.count(b'"step"') == 2
    with pytest.raises(ckptfmt.InvalidManifestError):
        ckptfmt.parse_manifest(data)


def test_sharding_description_is_recorded() -> None:
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    sh = ckptfmt.TensorSharding(framework="jax", mesh_shape=(2,), axis_names=("data",),
                                partition=(("data",), None), replicated_axes=())
    doc = _save([LocalShard("w", a.shape, a.dtype, Box((r, 0), (2, 2)), a[r:r + 2], sharding=sh) for r in (0, 2)])
    assert _schema_errors(doc) == []
    assert doc["tensors"]["w"]["sharding"] == sh.to_json()


# Issue 47 item 14.5: a pattern's "$" must mean the end of the string under Python's re too,
# where it also matches before a final line feed (FORMAT.md 2).
WHOLE_STRING = [
    ("save_id", SCHEMA["$defs"]["save_id"], "id", "id\n"),
    ("state name", {"type": "object", "propertyNames": SCHEMA["properties"]["state"]["propertyNames"]},
     {"rank/1": 0}, {"rank/1\n": 0}),
]


@pytest.mark.parametrize("name,schema,good,bad", WHOLE_STRING, ids=[w[0] for w in WHOLE_STRING])
def test_a_trailing_line_feed_is_rejected_by_the_schema(name: str, schema: Any, good: Any, bad: Any) -> None:
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid(good)        # control
    assert not v.is_valid(bad)


def test_a_save_id_with_a_trailing_line_feed_is_rejected_by_schema_and_parser() -> None:
    """The whole manifest, its keys renamed consistently, so that only the line feed is wrong."""
    doc = _golden()
    assert _schema_errors(doc) == []
    text = json.dumps(doc).replace(doc["save_id"], "abc")
    ckptfmt.parse_manifest(text.encode())  # control: a valid id, keys renamed with it
    assert _schema_errors(json.loads(text)) == []
    bad = json.loads(text)
    bad["save_id"] = "abc\n"
    assert _schema_errors(bad)
    with pytest.raises(ckptfmt.InvalidManifestError):
        ckptfmt.parse_manifest(json.dumps(bad).encode())


def test_every_current_revision_is_the_documents() -> None:
    """Issue 47 item 14.10: FORMAT.md's header, the schema's title and the reader's
    FORMAT_REVISION (what ``ckptfmt --version`` prints) name one revision."""
    import re

    from ckptfmt.manifest import FORMAT_REVISION
    (rev,) = re.findall(r"^\*\*Document revision:\*\* (\S+)$", (ROOT / "spec" / "FORMAT.md").read_text(), re.M)
    assert SCHEMA["title"].endswith(f"(document revision {rev})")
    assert FORMAT_REVISION == rev
