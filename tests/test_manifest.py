"""Manifest validation: each rule has a broken control next to an accepted good manifest."""
import copy
import json

import numpy as np
import pytest

from ckptfmt import (Box, SaveOptions, DuplicateShardError, InvalidManifestError, LocalShard, ManifestTooLargeError,
                     UnsupportedVersionError, parse_manifest, save)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("m") / "repo")
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    shards = [LocalShard("w", x.shape, x.dtype, Box((r * 3, 0), (min(3, 10 - r * 3), 4)), x[r * 3:r * 3 + 3]) for r in range(4)]
    shards.append(LocalShard("s", (), np.int32, Box((), ()), np.asarray(7, np.int32)))
    m = save(d, 1, shards, state={"k": 1}, options=SaveOptions(layout="arrays"))  # packed: tests/test_packs.py
    return json.loads(m.to_bytes())


def enc(doc):
    return json.dumps(doc).encode()


def test_good_manifest_parses(good):
    m = parse_manifest(enc(good))
    assert m.step == 1 and set(m.tensors) == {"w", "s"}
    assert parse_manifest(m.to_bytes()).to_bytes() == m.to_bytes()  # canonical round trip


def mutate(good, fn):
    d = copy.deepcopy(good)
    fn(d)
    return enc(d)


W = lambda d: d["tensors"]["w"]  # noqa: E731

BROKEN = {
    "not_json": (lambda g: b"{not json", InvalidManifestError),
    "not_utf8": (lambda g: b"\xff\xfe", InvalidManifestError),
    "array_top": (lambda g: b"[]", InvalidManifestError),
    "future_version": (lambda g: mutate(g, lambda d: d.update(format_version=2)), UnsupportedVersionError),
    "bool_version": (lambda g: mutate(g, lambda d: d.update(format_version=True)), UnsupportedVersionError),
    "must_understand": (lambda g: mutate(g, lambda d: d.update(must_understand=["zstd"])), UnsupportedVersionError),
    "wrong_format": (lambda g: mutate(g, lambda d: d.update(format="orbax")), InvalidManifestError),
    "missing_field": (lambda g: mutate(g, lambda d: d.pop("tensors")), InvalidManifestError),
    "negative_step": (lambda g: mutate(g, lambda d: d.update(step=-1)), InvalidManifestError),
    "float_step": (lambda g: mutate(g, lambda d: d.update(step=1.5)), InvalidManifestError),
    "bad_save_id": (lambda g: mutate(g, lambda d: d.update(save_id="../x")), InvalidManifestError),
    "nan": (lambda g: enc(g).replace(b'"created_unix":', b'"created_unix":NaN,"x":'), InvalidManifestError),
    "unknown_dtype": (lambda g: mutate(g, lambda d: W(d).update(dtype="object")), InvalidManifestError),
    "huge_shape_overflow": (lambda g: mutate(g, lambda d: W(d).update(shape=[2 ** 61, 2 ** 61])), InvalidManifestError),
    "dotdot_path": (lambda g: mutate(g, lambda d: W(d)["array"].update(path=f"saves/{d['save_id']}/t/../../../etc")), InvalidManifestError),
    "absolute_path": (lambda g: mutate(g, lambda d: W(d)["array"].update(path="/etc/passwd")), InvalidManifestError),
    "url_path": (lambda g: mutate(g, lambda d: W(d)["array"].update(path="s3://other/bucket")), InvalidManifestError),
    "other_save_path": (lambda g: mutate(g, lambda d: W(d)["array"].update(path="saves/other/t/000001")), InvalidManifestError),
    "state_escape": (lambda g: mutate(g, lambda d: d["state"]["global"].update(key="../../x")), InvalidManifestError),
    "shard_key_escape": (lambda g: mutate(g, lambda d: W(d)["shards"]["key"].__setitem__(0, "../../c/0/0")), InvalidManifestError),
    "gap": (lambda g: mutate(g, lambda d: [W(d)["shards"][f].pop() for f in ("offset", "writer", "key", "nbytes", "index_crc32c")]), InvalidManifestError),
    "duplicate_box": (lambda g: mutate(g, lambda d: W(d)["shards"]["offset"].__setitem__(1, [0, 0])), DuplicateShardError),
    "extra_shard": (lambda g: mutate(g, lambda d: [W(d)["shards"][f].append(W(d)["shards"][f][0]) for f in ("offset", "writer", "key", "nbytes", "index_crc32c")]), DuplicateShardError),
    "off_grid": (lambda g: mutate(g, lambda d: W(d)["shards"]["offset"].__setitem__(1, [4, 0])), InvalidManifestError),
    "out_of_bounds": (lambda g: mutate(g, lambda d: W(d)["shards"]["offset"].__setitem__(3, [12, 0])), InvalidManifestError),
    "writer_out_of_range": (lambda g: mutate(g, lambda d: W(d)["shards"]["writer"].__setitem__(0, 5)), InvalidManifestError),
    "chunk_past_data": (lambda g: mutate(g, lambda d: W(d)["chunks"]["offset"].__setitem__(0, 10 ** 6)), InvalidManifestError),
    "chunk_count": (lambda g: mutate(g, lambda d: W(d)["chunks"]["crc32c"].pop()), InvalidManifestError),
    "crc_range": (lambda g: mutate(g, lambda d: W(d)["chunks"]["crc32c"].__setitem__(0, 2 ** 32)), InvalidManifestError),
    "bool_in_ints": (lambda g: mutate(g, lambda d: W(d)["shards"]["writer"].__setitem__(0, True)), InvalidManifestError),
    "chunk_not_divisor": (lambda g: mutate(g, lambda d: W(d)["array"].update(chunk_shape=[2, 4])), InvalidManifestError),
    "codec": (lambda g: mutate(g, lambda d: W(d)["array"].update(codec="zstd")), UnsupportedVersionError),
    "chunk_range_overflow": (lambda g: mutate(g, lambda d: W(d)["chunks"]["offset"].__setitem__(0, 2 ** 62)), InvalidManifestError),
    "future_version_with_new_member": (lambda g: mutate(g, lambda d: d.update(format_version=2, new_thing=1)), UnsupportedVersionError),
    "two_tensors_one_array": (lambda g: mutate(g, lambda d: d["tensors"]["s"]["array"].update(path=W(d)["array"]["path"])), InvalidManifestError),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_manifest_rejected(good, name):
    make, err = BROKEN[name]
    parse_manifest(enc(good))  # the control: the unmutated manifest is accepted
    with pytest.raises(err):
        parse_manifest(make(good))


def test_size_cap(good):
    data = enc(good)
    assert parse_manifest(data, max_bytes=len(data)).step == 1
    with pytest.raises(ManifestTooLargeError):
        parse_manifest(data, max_bytes=len(data) - 1)


def _with_tensor(good, key, entry):
    d = copy.deepcopy(good)
    entry["array"]["path"] = f"saves/{d['save_id']}/t/{len(d['tensors']):06d}"
    d["tensors"][key] = entry
    return enc(d)


def _empty(shape, dtype="float32"):
    nd = len(shape)
    return {"shape": shape, "dtype": dtype, "sharding": None,
            "array": {"path": "", "shard_shape": [1] * nd, "chunk_shape": [1] * nd, "codec": "raw"},
            "shards": {"offset": [], "writer": [], "key": [], "nbytes": [], "index_crc32c": []},
            "chunks": {"offset": [], "nbytes": [], "crc32c": []}}


@pytest.mark.parametrize("shape, ok", [
    ([0, 4], True), ([0, 2 ** 30, 2 ** 30], True),           # the controls: 2^60 elements x 4 bytes = 2^62
    ([0, 2 ** 62, 2 ** 62], False), ([0, 2 ** 31, 2 ** 30], False),
])
def test_empty_tensor_dimensions_are_bounded_like_any_other(good, shape, ok):
    """Issue 12: [0, 2^62, 2^62] passed validation (its product is 0), and reads raised a plain
    ValueError. The bound applies to the product of max(shape[d], 1)."""
    data = _with_tensor(good, "e", _empty(shape))
    if ok:
        assert parse_manifest(data).tensors["e"].shape == tuple(shape)
    else:
        with pytest.raises(InvalidManifestError, match="too large"):
            parse_manifest(data)


@pytest.mark.parametrize("where", ["metadata", "extensions", "sharding"])
def test_nesting_deeper_than_64_levels_is_rejected(good, where):
    """The top-level object is level 1; metadata and extensions are level 2, a sharding level 4."""
    base = {"metadata": 2, "extensions": 2, "sharding": 4}[where]

    def put(levels):  # a dict at level ``base`` whose deepest list lies at ``levels`` (as text: no recursion here)
        d = copy.deepcopy(good)
        if where == "sharding":
            W(d)["sharding"] = "@"
        else:
            d[where] = "@"
        n = levels - base
        return enc(d).replace(b'"@"', b'{"x":' + b"[" * n + b"]" * n + b"}")

    assert parse_manifest(put(64))  # the control: level 64 is allowed
    for levels in (65, 900, 5000):  # 5,000: past Python's own parser, which must not leak RecursionError
        with pytest.raises(InvalidManifestError):
            parse_manifest(put(levels))


@pytest.mark.parametrize("what", ["tensors", "shard rows", "chunk rows"])
def test_count_caps_are_checked_before_entries_are_built(good, what):
    """FORMAT.md 5.10, at a 1 MiB size cap (every count cap scaled by 1/256: 4,096 tensors, 32,768
    shard rows, 65,536 chunk rows). One over the cap is ManifestTooLargeError before any tensor
    entry is checked; the control, exactly at the cap, passes the count and fails on the entries."""
    from ckptfmt.manifest import CountCaps

    caps = CountCaps.for_size_cap(1 << 20)
    assert (caps.tensors, caps.shard_rows, caps.chunk_rows) == (4096, 32768, 65536)

    def doc(n):
        d = copy.deepcopy(good)
        if what == "tensors":
            d["tensors"] = {f"k{i}": 0 for i in range(n)}  # not even entries: the count comes first
        elif what == "shard rows":
            W(d)["shards"]["key"] = ["c/0/0"] * (n - 1)  # "s" has 1 shard, "w" these
        else:
            W(d)["chunks"]["offset"] = [0] * (n - 1)  # "s" has 1 chunk
        return enc(d)

    n = {"tensors": caps.tensors, "shard rows": caps.shard_rows, "chunk rows": caps.chunk_rows}[what]
    with pytest.raises(InvalidManifestError) as at_cap:
        parse_manifest(doc(n), max_bytes=1 << 20)
    assert not isinstance(at_cap.value, ManifestTooLargeError)
    with pytest.raises(ManifestTooLargeError, match=f"too many {what.split()[0]}"):
        parse_manifest(doc(n + 1), max_bytes=1 << 20)


def test_a_save_id_with_a_trailing_line_feed_is_rejected(good):
    """Issue 24: the save-id pattern ends in ``$``, which also matches before a final line feed; the
    whole id must match. An empty manifest, so that no object key carries the id (where rule 5 of
    FORMAT.md 5.9, control characters, would reject it anyway)."""
    def empty(sid):
        return mutate(good, lambda d: d.update(tensors={}, state={}, save_id=sid))

    assert parse_manifest(empty(good["save_id"])).save_id == good["save_id"]  # control
    assert parse_manifest(empty("my-run")).save_id == "my-run"
    for bad in (good["save_id"] + "\n", "my-run\n"):
        with pytest.raises(InvalidManifestError, match="save_id"):
            parse_manifest(empty(bad))


def test_version_checks_come_before_every_other_rule(good):
    """FORMAT.md 5.12 ordering 2 (issue 24): a manifest of a later revision that also has a member
    this revision does not define, and a tensor this revision would call broken, is unsupported,
    not malformed."""
    def later(d):
        d.update(must_understand=["org.example.v2"], extensions={"org.example.v2": {}}, new_member=1)
        W(d)["shards"]["offset"][1] = [0, 0]  # a duplicate box to this reader

    with pytest.raises(UnsupportedVersionError):
        parse_manifest(mutate(good, later))
    # Control: without the extension the same manifest is malformed (and not "unsupported").
    with pytest.raises(InvalidManifestError) as e:
        parse_manifest(mutate(good, lambda d: (later(d), d.update(must_understand=[], extensions={}))))
    assert not isinstance(e.value, UnsupportedVersionError)


@pytest.mark.parametrize("ch", ["\x00", "\x01", "\t", "\n", "\x1f", "\x7f"])
def test_an_object_key_with_a_control_character_is_rejected(ch):
    """FORMAT.md 5.9 rule 5: C0 controls and DEL. The neighbours (space, '~', non-ASCII) are the
    control: accepted."""
    from ckptfmt.manifest._entries import check_object_key

    for ok in ("saves/a/t/000000/c/0", "saves/a b/~x", "saves/é\x80/\u2028"):
        assert check_object_key(ok) == ok
    with pytest.raises(InvalidManifestError, match="control character"):
        check_object_key(f"saves/a{ch}b/c/0", key="x")
