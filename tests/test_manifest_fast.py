"""The manifest codec's fast paths agree with the exact, one-tensor-at-a-time checks.

Parsing: tensors that share a geometry are compared by value against a layout derived from the
first of them, and the remaining columns are checked for all tensors at once. Each broken
manifest below breaks a *later* tensor of a shared geometry (so the by-value comparison is what
sees it) and must be rejected with the very error the exact path raises; each valid but unusual
manifest must be accepted with the same tables. Encoding: ``Manifest.to_bytes`` must equal
plain ``json.dumps`` of ``to_json``.
"""
import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np
import pytest

from ckptfmt import Box, CheckpointError, LocalShard, SaveOptions, parse_manifest, save
from ckptfmt import manifest as mf
from ckptfmt.layout import arrays_prefix
from manifest_common import mutate, same_tables

WRITERS = 4


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fast") / "repo")
    shards = []
    for i in range(4):  # four tensors of one geometry: 4 row shards of one chunk each
        x = np.arange(32, dtype=np.float32).reshape(8, 4) + i
        shards += [LocalShard(f"b/{i}", x.shape, x.dtype, Box((2 * r, 0), (2, 4)), x[2 * r:2 * r + 2]) for r in range(WRITERS)]
    y = np.arange(12, dtype=np.int32)  # another geometry, and a 0-d tensor (always the exact path)
    shards += [LocalShard("c", y.shape, y.dtype, Box((6 * r,), (6,)), y[6 * r:6 * r + 6]) for r in range(2)]
    shards.append(LocalShard("s", (), np.float32, Box((), ()), np.asarray(1.5, np.float32)))
    # Two 0-d tensors and two empty ones of one geometry each: the later one of each by value.
    shards.append(LocalShard("s2", (), np.float32, Box((), ()), np.asarray(2.5, np.float32)))
    shards += [LocalShard(f"e/{i}", (0, 3), np.int32, Box((0, 0), (0, 3)), np.zeros((0, 3), np.int32)) for i in range(2)]
    m = save(d, 3, shards, metadata={"note": "true or false", "lr": 0.5, "nested": {"tensors": {}}},
             options=SaveOptions(layout="arrays"))  # the tensor parsers; packed entries: tests/test_packs.py
    return json.loads(m.to_bytes())


def exact(doc):
    """The reference: every tensor through the exact per-tensor checks."""
    return mf._tensors_exact(doc["tensors"], arrays_prefix(doc["save_id"]), doc["writers"])


def T(d, i=2):
    return d["tensors"][f"b/{i}"]


def _swap_shards(d):
    t = T(d)
    for f in ("offset", "writer", "key", "nbytes", "index_crc32c"):
        t["shards"][f][0], t["shards"][f][1] = t["shards"][f][1], t["shards"][f][0]
    for f in ("offset", "nbytes", "crc32c"):
        t["chunks"][f][0], t["chunks"][f][1] = t["chunks"][f][1], t["chunks"][f][0]


def _gap_before_chunk(d):
    t = T(d)
    t["shards"]["nbytes"][1] += 64
    t["chunks"]["offset"][1] += 64


VALID = {
    "as_written": lambda d: None,
    "shards_out_of_order": _swap_shards,
    "gap_before_a_chunk": _gap_before_chunk,
    "bool_in_metadata": lambda d: d["metadata"].update(flag=True),
    "sharding_dict": lambda d: T(d).update(sharding={"mesh": {"x": 4}, "spec": [["x"], None]}),
}

BROKEN = {
    "float_writer": lambda d: T(d)["shards"]["writer"].__setitem__(1, 1.0),
    "bool_writer": lambda d: T(d)["shards"]["writer"].__setitem__(0, False),
    "bool_chunk_offset": lambda d: T(d)["chunks"]["offset"].__setitem__(0, False),
    "float_chunk_nbytes": lambda d: T(d)["chunks"]["nbytes"].__setitem__(0, float(T(d)["chunks"]["nbytes"][0])),
    "float_shard_offset": lambda d: T(d)["shards"]["offset"].__setitem__(1, [2.0, 0]),
    "float_shard_nbytes": lambda d: T(d)["shards"]["nbytes"].__setitem__(0, float(T(d)["shards"]["nbytes"][0])),
    "float_shape": lambda d: T(d).update(shape=[8.0, 4]),
    "bool_writer_with_bool_metadata": lambda d: (d["metadata"].update(flag=True), T(d)["shards"]["writer"].__setitem__(1, True)),
    "string_crc": lambda d: T(d)["chunks"]["crc32c"].__setitem__(0, "5"),
    "crc_range": lambda d: T(d)["shards"]["index_crc32c"].__setitem__(0, 2 ** 32),
    "negative_crc": lambda d: T(d)["chunks"]["crc32c"].__setitem__(0, -1),
    "writer_range": lambda d: T(d)["shards"]["writer"].__setitem__(0, WRITERS),
    "negative_writer": lambda d: T(d)["shards"]["writer"].__setitem__(0, -1),
    "huge_int": lambda d: T(d)["shards"]["writer"].__setitem__(0, 2 ** 70),
    "short_column": lambda d: T(d)["chunks"]["crc32c"].pop(),
    "shard_nbytes": lambda d: T(d)["shards"]["nbytes"].__setitem__(0, T(d)["shards"]["nbytes"][0] - 4),
    "chunk_offset": lambda d: T(d)["chunks"]["offset"].__setitem__(0, 8),
    "shard_key": lambda d: T(d)["shards"]["key"].__setitem__(0, "c/9/0"),
    "duplicate_offset": lambda d: T(d)["shards"]["offset"].__setitem__(1, [0, 0]),
    "shared_path": lambda d: T(d)["array"].update(path=T(d, 1)["array"]["path"]),
    "sharding_list": lambda d: T(d).update(sharding=["x"]),
    "unknown_member": lambda d: T(d)["shards"].update(extra=[]),
    "null_column": lambda d: T(d)["shards"].update(writer=None),
    "nested_column": lambda d: T(d)["chunks"]["crc32c"].__setitem__(0, [1]),
    "scalar_crc_range": lambda d: d["tensors"]["s2"]["chunks"]["crc32c"].__setitem__(0, 2 ** 32),
    "scalar_bool_writer": lambda d: d["tensors"]["s2"]["shards"]["writer"].__setitem__(0, False),
    "scalar_two_shards": lambda d: [d["tensors"]["s2"]["shards"][f].append(d["tensors"]["s2"]["shards"][f][0])
                                    for f in ("offset", "writer", "key", "nbytes", "index_crc32c")],
    "empty_with_a_shard": lambda d: [d["tensors"]["e/1"]["shards"][f].append(d["tensors"]["s"]["shards"][f][0])
                                     for f in ("writer", "key", "nbytes", "index_crc32c")],
    "empty_with_a_chunk": lambda d: d["tensors"]["e/1"]["chunks"]["crc32c"].append(0),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_fast_parse_accepts_like_exact(good, name):
    d = copy.deepcopy(good)
    VALID[name](d)
    got = parse_manifest(json.dumps(d).encode())
    same_tables(got.tensors, exact(d))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_fast_parse_rejects_like_exact(good, name):
    parse_manifest(json.dumps(good).encode())  # the control: the untouched manifest is accepted
    d = copy.deepcopy(good)
    BROKEN[name](d)
    with pytest.raises(CheckpointError) as want:
        exact(d)
    with pytest.raises(CheckpointError) as got:
        parse_manifest(json.dumps(d).encode())
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_validate_rejects_a_bool_the_fast_path_would_compare_by_value(good):
    m = parse_manifest(json.dumps(good).encode())
    assert m.validate() is m
    t = m.tensors["b/2"]
    bad = mf.TensorEntry(t.key, t.shape, t.dtype, t.sharding, t.array, t.shards,
                         mf.ChunkTable(t.chunks.offset.astype(bool), t.chunks.nbytes, t.chunks.crc32c))
    broken = mf.Manifest(m.save_id, m.step, m.created_unix, m.writers, dict(m.tensors) | {"b/2": bad}, m.state,
                         m.versions, m.metadata)
    with pytest.raises(CheckpointError, match="integers"):
        broken.validate()


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """Four tensors of one geometry whose shards hold four chunks each (offsets 0, 36, 72, 108)."""
    from ckptfmt import SaveOptions

    d = str(tmp_path_factory.mktemp("multi") / "repo")
    shards = []
    for i in range(4):
        x = np.arange(64, dtype=np.float32).reshape(16, 4) + i
        shards += [LocalShard(f"m/{i}", x.shape, x.dtype, Box((8 * r, 0), (8, 4)), x[8 * r:8 * r + 8]) for r in range(2)]
    m = save(d, 1, shards, options=SaveOptions(layout="arrays", chunk_target_bytes=32))
    assert len(m.tensors["m/0"].chunks.offset) == 8
    return json.loads(m.to_bytes())


def _chunk_rows(d, i, edit):
    ch = d["tensors"][f"m/{i}"]["chunks"]
    edit(ch["offset"], ch["crc32c"])


def _overlap(off, crc):  # issue 12: chunk row 1 given row 0's offset and crc32c
    off[1], crc[1] = off[0], crc[0]


def _reorder(off, crc):  # rows 0 and 1 name each other's bytes: disjoint, so valid
    off[0], off[1], crc[0], crc[1] = off[1], off[0], crc[1], crc[0]


@pytest.mark.parametrize("i", [0, 2])  # the first tensor of its geometry (exact checks) and a later one (by value)
def test_chunks_sharing_bytes_rejected_like_exact(multi, i):
    parse_manifest(json.dumps(multi).encode())  # the control
    d = copy.deepcopy(multi)
    _chunk_rows(d, i, _overlap)
    with pytest.raises(CheckpointError) as want:
        exact(d)
    with pytest.raises(CheckpointError) as got:
        parse_manifest(json.dumps(d).encode())
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert "share bytes" in str(got.value) and got.value.key == f"m/{i}"


@pytest.mark.parametrize("i", [0, 2])
def test_chunks_out_of_order_accepted_like_exact(multi, i):
    d = copy.deepcopy(multi)
    _chunk_rows(d, i, _reorder)
    same_tables(parse_manifest(json.dumps(d).encode()).tensors, exact(d))


def test_to_bytes_is_plain_json_dumps(good):
    d = copy.deepcopy(good)
    d["tensors"]["b/1"]["sharding"] = {"spec": ["é", None], "mesh": {"z": 2, "a": 2}}
    d["tensors"]["ключ/∑"] = d["tensors"].pop("b/3")
    m = parse_manifest(json.dumps(d).encode())
    plain = (json.dumps(m.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode()
    assert m.to_bytes() == plain
    assert b'"nested":{"tensors":{}}' in plain  # a "tensors" member inside metadata stays where it is
    assert parse_manifest(plain).to_bytes() == plain


@pytest.mark.parametrize("key", ["b/2", "s"])  # the fast path, and the exact path (0-d)
def test_parsed_tables_are_read_only(good, key):
    t = parse_manifest(json.dumps(good).encode()).tensors[key]
    for table in (t.shards.writer, t.shards.offset, t.chunks.crc32c):
        with pytest.raises(ValueError):
            table[...] = 0


@pytest.mark.parametrize("text, found", [
    (b'"created_unix":1e400', "number out of float range"),
    (b'"note":"\\ud800"', "lone surrogate"),
])
def test_values_the_canonical_encoding_cannot_hold_are_rejected(good, text, found):
    data = json.dumps(good).encode()
    assert parse_manifest(data).to_bytes()  # the control
    if text.startswith(b'"created_unix"'):
        bad = data.replace(b'"created_unix": ' + json.dumps(good["created_unix"]).encode(), text)
    else:
        bad = data.replace(b'"note": "true or false"', text)
    assert bad != data
    with pytest.raises(CheckpointError, match=found):
        parse_manifest(bad)


def test_tensors_of_one_geometry_take_the_fast_path(good):
    """Tensors after the first of a geometry share its layout's arrays (the by-value path ran);
    a non-canonical one does not (it went through the exact checks). 0-d and empty tensors too:
    a manifest of a million of them must not cost a million exact checks."""
    ts = parse_manifest(json.dumps(good).encode()).tensors
    assert ts["b/2"].shards.offset is ts["b/1"].shards.offset
    assert ts["s2"].shards.offset is ts["s"].shards.offset and ts["e/1"].shards.offset is ts["e/0"].shards.offset
    d = copy.deepcopy(good)
    _swap_shards(d)
    ts = parse_manifest(json.dumps(d).encode()).tensors
    assert ts["b/2"].shards.offset is not ts["b/1"].shards.offset and ts["b/3"].shards.offset is ts["b/1"].shards.offset


@given(st.binary(max_size=3000) | st.text(alphabet="{[,:]}\"ab\\ é", max_size=3000).map(str.encode),
       st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_structural_count_equals_plain_byte_counts(data, repeat):
    """The numpy block count (FORMAT.md 5.10) against its slow twin, across block boundaries."""
    from ckptfmt.manifest._caps import count_structural

    data = data * (1 + repeat * 1500)  # up to ~18 MB: several 4 MiB blocks
    assert count_structural(data) == data.count(b"{") + data.count(b"[") + data.count(b",")


def test_structural_cap_is_checked_before_parsing(good):
    """FORMAT.md 5.10: more "{", "[" and "," bytes than the cap (2^25, scaled to a lower size cap)
    is refused before json.loads builds anything; the control sits exactly at the cap."""
    from ckptfmt import ManifestTooLargeError
    from ckptfmt.manifest._caps import count_structural

    base = json.dumps(good).encode()
    cap = 1 << 20  # a 1 MiB size cap: 2^25 / 256 = 131,072 structural bytes
    room = (1 << 25) * cap // mf.MAX_MANIFEST_BYTES - count_structural(base)
    at_cap = base.replace(b'"note": "true or false"', b'"note": "' + b"," * room + b'"')  # inside a string: counted too
    assert count_structural(at_cap) == 131072 and parse_manifest(at_cap, max_bytes=cap)
    over = at_cap.replace(b'"lr": 0.5', b'"lr": [0.5]')
    with pytest.raises(ManifestTooLargeError, match="too many JSON values"):
        parse_manifest(over, max_bytes=cap)


# ---------------------------------------------------------------- the fast path pinned to its slow twin
_COLUMNS = [("shards", "writer"), ("shards", "offset"), ("shards", "nbytes"), ("shards", "index_crc32c"),
            ("shards", "key"), ("chunks", "offset"), ("chunks", "nbytes"), ("chunks", "crc32c"), ("shape",),
            ("array", "shard_shape"), ("array", "chunk_shape"), ("array", "path"), ("dtype",), ("sharding",)]
_VALUES = st.one_of(
    st.integers(-3, 2 ** 33), st.sampled_from([0, 1, 2, 3, 4, 36, 40, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 2 ** 64, -1]),
    st.booleans(), st.floats(allow_nan=False, allow_infinity=False, width=32), st.sampled_from([1.0, 4.0, 36.0]),
    st.sampled_from(["5", "c/0/0", "c/1/0", None, [], [0, 0], {}, "saves/x/t/000009"]))


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_fast_path_equals_the_exact_path(good, data):
    """Forced through both paths on the same (possibly broken) tensors: the fast path accepts only
    what the exact path accepts, with equal tables; and parse_manifest (which skips the fast path's
    type checks when its literal count vouches that no float or boolean lies in a tensor entry)
    accepts with the exact path's tables or raises the exact path's error, the same type and the
    same words."""
    from ckptfmt.manifest._fast import Fallback, tensors_fast

    d = copy.deepcopy(good)
    if data.draw(st.booleans(), label="clean text"):  # no "true"/"false" in the text: parse_manifest's
        del d["metadata"]["note"]                      # literal count then lets the fast path skip its type checks
    edits = data.draw(st.integers(0, 2), label="edits")
    for _ in range(edits):
        mutate(d, data, _COLUMNS, _VALUES)
    try:
        fast = tensors_fast(d["tensors"], arrays_prefix(d["save_id"]), d["writers"], exact=mf._tensor,
                            make=mf._make_entry, max_key_len=mf.MAX_KEY_LEN, max_object_key_len=mf.MAX_OBJECT_KEY_LEN)
    except Fallback:
        fast = None
    try:
        want, err = exact(d), None
    except CheckpointError as e:
        want, err = None, e
    if edits == 0:
        assert fast is not None  # the valid manifest takes the fast path
    if fast is not None:
        assert err is None, err
        same_tables(fast, want)
    data_bytes = json.dumps(d).encode()
    if err is None:
        same_tables(parse_manifest(data_bytes).tensors, want)
    else:
        with pytest.raises(CheckpointError) as got:
            parse_manifest(data_bytes)
        assert type(got.value) is type(err) and str(got.value) == str(err)
