"""Derived columns: format revision 1.2, extension ckptfmt.derived (FORMAT.md 5.14).

A manifest in the derived form leaves out the five columns a tensor's geometry determines. Real
saves on a real file system through tensorstore, one in each form, with the same save id:

* the derived manifest holds no shard offset, key or size and no chunk offset or size, and parses
  to the very tables of the explicit one; the objects on disk are byte for byte the same; every
  tensor (edge shards with unstored inner chunks, 0-d, empty, bfloat16, bool) reads back bit for
  bit, whole and as a sub-box;
* each broken derived manifest below is rejected with the same error on the fast path as on the
  exact per-tensor path, naming the tensor, next to its intact control; a property test pins the
  two paths together on derived manifests;
* a truncated shard object is still caught (its size is now derived, not written), next to its
  intact control;
* "auto" switches at 65,536 shard rows; a small default save stays a revision 1.0 manifest.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import Box, CheckpointError, LocalShard, Repository, SaveOptions, parse_manifest
from ckptfmt import manifest as mf
from ckptfmt.manifest._refs import DERIVED_MIN_ROWS, wants_derived
from ckptfmt.layout import arrays_prefix
from manifest_common import mutate, same_tables

SAVE_ID = "000000000003-20260101T000000-00dec0de"
STEP = 3


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    out = {f"b/{i}": rng.standard_normal((8, 4)).astype(np.float32) for i in range(4)}
    out["edge"] = rng.standard_normal((40, 33)).astype(np.float32)  # shards of 32 and 8 rows
    out["half"] = rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16)
    out["mask"] = rng.standard_normal((7,)) > 0
    out["s"] = np.asarray(2.5, np.float32)
    out["e"] = np.zeros((0, 3), np.int32)
    return out


def shards(v: dict[str, np.ndarray]) -> list[LocalShard]:
    out = []
    for k, x in v.items():
        if k.startswith("b/"):
            out += [LocalShard(k, x.shape, x.dtype, Box((2 * r, 0), (2, 4)), x[2 * r:2 * r + 2]) for r in range(4)]
        elif k == "edge":
            out += [LocalShard(k, x.shape, x.dtype, Box((0, 0), (32, 33)), x[:32]),
                    LocalShard(k, x.shape, x.dtype, Box((32, 0), (8, 33)), x[32:])]
        else:
            out.append(LocalShard(k, x.shape, x.dtype, Box.full(x.shape), x))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, ckptfmt.Manifest]]:
    out = {}
    for form in ("derived", "explicit"):
        url = str(tmp_path_factory.mktemp(form) / "repo")
        opts = SaveOptions(layout="arrays", save_id=SAVE_ID, created_unix=1767225600.0, chunk_target_bytes=256, manifest_columns=form)
        out[form] = (url, ckptfmt.save(url, STEP, shards(values()), options=opts))
    return out


def _doc(url: str) -> dict:
    return json.loads((Path(url) / f"manifests/{STEP:020d}.json").read_bytes())


def test_derived_manifest_leaves_out_the_five_columns(saved) -> None:
    d, e = _doc(saved["derived"][0]), _doc(saved["explicit"][0])
    assert d["must_understand"] == [mf.DERIVED] and d["extensions"] == {mf.DERIVED: {}}
    assert e["must_understand"] == [] and e["extensions"] == {}  # control: the explicit form, a 1.0 manifest
    for k in values():
        assert set(d["tensors"][k]["shards"]) == {"writer", "index_crc32c"}, k
        assert set(d["tensors"][k]["chunks"]) == {"crc32c"}, k
        assert set(e["tensors"][k]["shards"]) == {"offset", "key", "nbytes", "writer", "index_crc32c"}, k
    assert len(json.dumps(d)) < len(json.dumps(e))
    # The edge tensor's second shard stores only its inner chunks inside the tensor (5.7).
    t = saved["explicit"][1].tensors["edge"]
    counts = np.diff(t.chunk_start)
    assert counts[0] > counts[1] > 0


def test_both_forms_parse_to_the_same_tables_over_the_same_bytes(saved) -> None:
    (ud, md), (ue, me) = saved["derived"], saved["explicit"]
    same_tables(md.tensors, me.tensors)
    same_tables(Repository(ud).manifest(STEP).tensors, me.tensors)
    files = {}
    for form, url in (("derived", ud), ("explicit", ue)):
        root = Path(url) / "saves" / SAVE_ID
        files[form] = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert files["derived"] == files["explicit"] and len(files["derived"]) > 10
    # the canonical encoding is plain json.dumps of to_json, in the derived form too
    assert md.to_bytes() == (json.dumps(md.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                        allow_nan=False) + "\n").encode()
    assert md.to_bytes() == (Path(ud) / f"manifests/{STEP:020d}.json").read_bytes()
    assert md.validate() is md


def test_derived_checkpoint_reads_back_bit_for_bit(saved) -> None:
    url, m = saved["derived"]
    repo = Repository(url)
    assert repo.verify(STEP) == m.nbytes == saved["explicit"][1].nbytes
    ck = repo.open(STEP)
    for k, v in values().items():
        got = ck.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape and got.tobytes() == v.tobytes(), k
    assert ck.read("edge", Box((30, 3), (10, 20))).tobytes() == values()["edge"][30:40, 3:23].tobytes()


def test_truncated_shard_object_is_caught_in_the_derived_form(saved, tmp_path: Path) -> None:
    import shutil

    url = str(tmp_path / "repo")
    shutil.copytree(saved["derived"][0], url)
    m = Repository(url).manifest(STEP)
    obj = Path(url) / m.tensors["edge"].object_key(1)
    assert Repository(url).open(STEP).read("edge").tobytes() == values()["edge"].tobytes()  # control
    data = obj.read_bytes()
    obj.write_bytes(data[:-1])
    with pytest.raises(CheckpointError) as e:
        Repository(url).open(STEP).read("edge")
    assert "edge" in str(e.value) and m.tensors["edge"].object_key(1) in str(e.value)
    with pytest.raises(CheckpointError):
        Repository(url).verify(STEP)


# ------------------------------------------------------------------ broken derived manifests, both paths


def exact(doc: dict) -> dict:
    mu = doc.get("must_understand", [])
    return mf._tensors_exact(doc["tensors"], arrays_prefix(doc["save_id"]), doc["writers"],
                             ("raw", "zstd") if mf.ZSTD in mu else ("raw",), mf.DERIVED in mu)


def T(d: dict, k: str = "b/2") -> dict:
    return d["tensors"][k]


def _undeclare(d: dict) -> None:
    d["must_understand"].remove(mf.DERIVED)
    del d["extensions"][mf.DERIVED]


def _zstd(d: dict) -> None:
    d["must_understand"] = sorted(d["must_understand"] + [mf.ZSTD])
    d["extensions"][mf.ZSTD] = {}
    T(d)["array"]["codec"] = "zstd"


def _huge_grid(d: dict) -> None:  # 2^39 shards claimed by 4 rows: refused before anything is sized by it
    T(d)["shape"] = [1 << 40, 4]


def _huge_inner(d: dict) -> None:  # one shard of 2^30 inner chunks, 1 crc32c: refused before the chunk columns are built
    T(d).update(shape=[1 << 30, 4])
    T(d)["array"].update(shard_shape=[1 << 30, 4], chunk_shape=[1, 4])
    T(d)["shards"].update(writer=[0], index_crc32c=[0])
    T(d)["chunks"].update(crc32c=[0])


BROKEN = {
    "not_declared": (_undeclare, "without the extension ckptfmt.derived"),
    "payload_missing": (lambda d: d["extensions"].pop(mf.DERIVED), "must be both listed"),
    "payload_not_empty": (lambda d: d["extensions"].update({mf.DERIVED: {"v": 1}}), "takes an empty object"),
    "one_column_back": (lambda d: T(d)["shards"].update(key=["c/0/0", "c/1/0", "c/2/0", "c/3/0"]), "some of the derivable"),
    "chunk_column_back": (lambda d: T(d)["chunks"].update(nbytes=[36] * 4), "some of the derivable"),
    "short_writer": (lambda d: T(d)["shards"]["writer"].pop(), "shards.writer has the wrong length"),
    "short_index_crc": (lambda d: T(d)["shards"]["index_crc32c"].pop(), "wrong length"),
    "long_chunk_crc": (lambda d: T(d)["chunks"]["crc32c"].append(0), "chunks.crc32c has the wrong length"),
    "scalar_without_writer": (lambda d: T(d, "s")["shards"].update(writer=[]), "shards.writer has the wrong length"),
    "empty_with_a_crc": (lambda d: T(d, "e")["chunks"]["crc32c"].append(0), "chunks.crc32c has the wrong length"),
    "zstd_in_derived_form": (_zstd, "only a tensor with codec 'raw'"),
    "huge_grid": (_huge_grid, "shards.writer has the wrong length"),
    "huge_inner_grid": (_huge_inner, "chunks.crc32c has the wrong length"),
    "writer_range": (lambda d: T(d)["shards"]["writer"].__setitem__(0, 1), "shards.writer"),
    "crc_as_string": (lambda d: T(d)["chunks"]["crc32c"].__setitem__(0, "5"), "chunks.crc32c must hold integers"),
}


@pytest.fixture(scope="module")
def good(saved) -> dict:
    return _doc(saved["derived"][0])


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_derived_manifest_rejected_by_both_paths(good, name) -> None:
    parse_manifest(json.dumps(good).encode())  # the control: the untouched manifest is accepted
    d = copy.deepcopy(good)
    edit, words = BROKEN[name]
    edit(d)
    data = json.dumps(d).encode()
    with pytest.raises(CheckpointError) as got:
        parse_manifest(data)
    assert words in str(got.value)
    if name.startswith("payload"):
        return  # a manifest-level rule: no tensor is involved
    with pytest.raises(CheckpointError) as want:
        exact(d)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    key = "s" if "scalar" in name else "e" if "empty" in name else "b/0" if name == "not_declared" else "b/2"
    assert getattr(got.value, "key", None) == key


def test_mixed_forms_in_one_manifest_are_accepted(good, saved) -> None:
    """5.14: a writer may keep the explicit columns for some tensors of a derived manifest."""
    d = copy.deepcopy(good)
    e = _doc(saved["explicit"][0])
    d["tensors"]["b/1"] = e["tensors"]["b/1"]
    same_tables(parse_manifest(json.dumps(d).encode()).tensors, saved["explicit"][1].tensors)
    same_tables(exact(d), saved["explicit"][1].tensors)


_COLUMNS = [("shards", "writer"), ("shards", "index_crc32c"), ("chunks", "crc32c"), ("shape",),
            ("array", "shard_shape"), ("array", "chunk_shape"), ("array", "codec"), ("dtype",)]
_VALUES = st.one_of(st.integers(-3, 2 ** 33), st.sampled_from([0, 1, 2, 4, 8, 2 ** 32 - 1, 2 ** 32, 2 ** 64, -1]),
                    st.booleans(), st.sampled_from([1.0, 4.0]), st.sampled_from(["5", None, [], [0, 0], {}, "raw", "zstd"]))


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_fast_path_equals_the_exact_path_on_derived_manifests(good, data) -> None:
    """Random edits of the columns a derived entry still holds (and of its geometry): the fast
    path accepts only what the exact path accepts, with equal tables, else raises its error."""
    d = copy.deepcopy(good)
    for _ in range(data.draw(st.integers(0, 2), label="edits")):
        mutate(d, data, _COLUMNS, _VALUES)
    try:
        want, err = exact(d), None
    except CheckpointError as e:
        want, err = None, e
    if err is None:
        same_tables(parse_manifest(json.dumps(d).encode()).tensors, want)
    else:
        with pytest.raises(CheckpointError) as got:
            parse_manifest(json.dumps(d).encode())
        assert type(got.value) is type(err) and str(got.value) == str(err)


def test_fast_path_shares_the_layout_of_a_geometry(good) -> None:
    ts = parse_manifest(json.dumps(good).encode()).tensors
    assert ts["b/2"].shards.offset is ts["b/1"].shards.offset  # the by-geometry path ran


# ------------------------------------------------------------------ when a save uses the derived form


def test_auto_switches_at_the_row_threshold(tmp_path: Path) -> None:
    assert DERIVED_MIN_ROWS == 65536
    assert not wants_derived("auto", DERIVED_MIN_ROWS - 1) and wants_derived("auto", DERIVED_MIN_ROWS)
    assert wants_derived("derived", 1) and not wants_derived("explicit", 10 ** 9)
    # the default save of a small checkpoint stays a revision 1.0 manifest (readable by 1.0 readers)
    url = str(tmp_path / "small")
    m = ckptfmt.save(url, 0, shards({"s": values()["s"]}), options=SaveOptions(layout="arrays"))
    assert m.must_understand == () and "key" in _doc_at(url, 0)["tensors"]["s"]["shards"]
    # an unknown value is a usage error raised before anything is written
    bad = str(tmp_path / "bad")
    with pytest.raises(ValueError, match="manifest_columns"):
        ckptfmt.save(bad, 0, shards({"s": values()["s"]}), options=SaveOptions(manifest_columns="compact"))
    assert not (Path(bad) / "saves").exists() or not any((Path(bad) / "saves").iterdir())


def _doc_at(url: str, step: int) -> dict:
    return json.loads((Path(url) / f"manifests/{step:020d}.json").read_bytes())


@pytest.mark.parametrize("case", ["zstd", "state only", "empty tensor only"])
def test_the_extension_is_listed_only_when_an_entry_is_derived(tmp_path: Path, case: str) -> None:
    """Issue 24: with manifest_columns="derived", a save whose entries all keep their columns (codec
    zstd; no tensor with shard rows) does not list ckptfmt.derived, so a 1.1 reader reads it."""
    url = str(tmp_path / "r")
    v = values()
    opts = SaveOptions(layout="arrays", manifest_columns="derived", chunk_target_bytes=256)
    given = {"zstd": (shards(v), {}), "state only": ([], {"step": 1}), "empty tensor only": (shards({"e": v["e"]}), {})}
    parts, state = given[case]
    m = ckptfmt.save(url, 0, parts, state=state or None,
                     options=SaveOptions(layout="arrays", manifest_columns="derived", chunk_target_bytes=256,
                                         codec="zstd" if case == "zstd" else "raw"))
    doc = _doc_at(url, 0)
    assert mf.DERIVED not in m.must_understand and mf.DERIVED not in doc["must_understand"]
    assert mf.DERIVED not in doc["extensions"]
    assert all("key" in e["shards"] and "offset" in e["chunks"] for e in doc["tensors"].values())
    assert Repository(url).verify(0) == m.nbytes
    # Control: the same save with one raw tensor that has shard rows lists it, and that entry is derived.
    m1 = ckptfmt.save(url, 1, parts + shards({"b/0": v["b/0"]}), state=state or None, options=opts)
    assert mf.DERIVED in m1.must_understand and set(_doc_at(url, 1)["tensors"]["b/0"]["shards"]) == {"writer", "index_crc32c"}


def test_incremental_save_references_rows_of_a_derived_table(tmp_path: Path) -> None:
    """Row numbers of ckptfmt.references index the derived table (5.14); the later step reads back."""
    url = str(tmp_path / "inc")
    v = values()
    opts = SaveOptions(layout="arrays", manifest_columns="derived", chunk_target_bytes=256)
    ckptfmt.save(url, 1, shards(v), options=opts)
    v2 = v | {"b/0": v["b/0"] + 1}
    m2 = ckptfmt.save(url, 2, shards(v2), options=opts)
    assert set(m2.must_understand) == {mf.DERIVED, mf.REFERENCES} and set(m2.tensors["edge"].objects) == {0, 1}
    doc = _doc_at(url, 2)
    assert set(doc["tensors"]["edge"]["shards"]) == {"writer", "index_crc32c"}
    repo = Repository(url)
    assert repo.verify(2) == m2.nbytes
    ck = repo.open(2)
    for k, x in v2.items():
        assert ck.read(k).tobytes() == x.tobytes(), k



@pytest.mark.parametrize("table, column, cap_of", [("shards", "writer", "shard_rows"), ("chunks", "crc32c", "chunk_rows")])
def test_count_caps_count_the_rows_of_derived_entries(good, table, column, cap_of) -> None:
    """FORMAT.md 5.10 with 5.14: a derived entry's rows are counted by the columns it holds, before
    any table is derived. At a 1 MiB size cap, one row over is ManifestTooLargeError; the control,
    exactly at the cap, passes the count and fails on the entry instead."""
    from ckptfmt import ManifestTooLargeError
    from ckptfmt.manifest import CountCaps

    cap = getattr(CountCaps.for_size_cap(1 << 20), cap_of)
    others = sum(len(t[table][column]) for k, t in good["tensors"].items() if k != "b/2")

    def doc(rows: int) -> bytes:
        d = copy.deepcopy(good)
        T(d)[table][column] = [0] * (rows - others)
        return json.dumps(d).encode()

    with pytest.raises(CheckpointError) as at_cap:
        parse_manifest(doc(cap), max_bytes=1 << 20)
    assert not isinstance(at_cap.value, ManifestTooLargeError) and "wrong length" in str(at_cap.value)
    with pytest.raises(ManifestTooLargeError, match=f"too many {table[:-1]} rows"):
        parse_manifest(doc(cap + 1), max_bytes=1 << 20)


# ------------------------------------------------------------------ issue 24 item 7: what a derived entry expands to


def _one_tensor(shape: list[int], shard_shape: list[int], *, extra: int = 0) -> dict:
    """A derived manifest of one uint8 tensor with one chunk per shard (and ``extra`` more 1-d
    tensors of one shard each), every checksum 0: only the column lengths matter here."""
    prefix = arrays_prefix(SAVE_ID)
    rows = int(np.prod([-(-n // s) for n, s in zip(shape, shard_shape)]))

    def entry(i: int, shp: list[int], ss: list[int], n: int) -> dict:
        return {"shape": shp, "dtype": "uint8", "sharding": None,
                "array": {"path": f"{prefix}{i:06d}", "shard_shape": list(ss), "chunk_shape": list(ss), "codec": "raw"},
                "shards": {"writer": [0] * n, "index_crc32c": [0] * n}, "chunks": {"crc32c": [0] * n}}

    tensors = {"t": entry(0, shape, shard_shape, rows)} | {f"x/{i}": entry(i + 1, [1], [1], 1) for i in range(extra)}
    return {"format": "ckptfmt", "format_version": 1, "must_understand": [mf.DERIVED], "extensions": {mf.DERIVED: {}},
            "save_id": SAVE_ID, "step": STEP, "created_unix": 0.0, "writers": 1, "versions": {}, "metadata": {},
            "state": {}, "tensors": tensors}


_PARSE_AND_MEASURE = """
import json, resource, sys
from ckptfmt import CheckpointError, parse_manifest
out = []
for path in sys.argv[1:]:
    try:
        parse_manifest(open(path, "rb").read())
        out.append({"error": None})
    except CheckpointError as e:
        out.append({"error": type(e).__name__, "message": str(e), "key": e.key, "found": e.found})
# VmHWM, this process's own peak (ru_maxrss starts from the parent's RSS at fork on Linux)
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")]
print(json.dumps({"results": out, "maxrss_kib": hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_hostile_derived_expansion_is_refused_before_anything_is_derived(tmp_path: Path) -> None:
    """Issue 24 item 7: 6.3 MB of derived columns (one rank-63 tensor of 2^20 shards) cost 3.5 GB
    and 34 s to parse. At the default caps, in a fresh process: a rank-31 tensor of 5 x 2^18 shards
    (40.6 million offset elements, 7.9 MB) is ManifestTooLargeError naming it, and the issue's
    rank-63 one is refused for its rank, both before anything is derived: the process's peak RSS
    stays far below what deriving either would take (about 2 GB and 3.5 GB)."""
    hostile = _one_tensor([5] + [2] * 18 + [1] * 12, [1] * 31)
    rows = len(hostile["tensors"]["t"]["shards"]["writer"])
    assert rows * 31 > mf.MAX_OFFSET_ELEMENTS
    files = []
    for name, doc in (("hostile", hostile), ("issue", _one_tensor([2] * 20 + [1] * 43, [1] * 63))):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    p = subprocess.run([sys.executable, "-c", _PARSE_AND_MEASURE, *map(str, files)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    over, issue = got["results"]
    assert over["error"] == "ManifestTooLargeError" and "offset tables would hold too many elements" in over["message"]
    assert over["key"] == "t" and over["found"] == rows * 31
    assert issue["error"] == "InvalidManifestError" and "too many dimensions" in issue["message"] and issue["key"] == "t"
    assert got["maxrss_kib"] < 1 << 20  # 1 GiB: the interpreter, ckptfmt and the decoded JSON


def test_offset_element_cap_boundary_and_a_large_derived_manifest_parses() -> None:
    """The cap, at a 1 MiB size cap (2^17 elements): exactly at it parses, one tensor more is refused;
    the tables derived equal those the explicit checks accept for the same manifest written out
    (the control that a legitimately large derived manifest is still read, and read right)."""
    from ckptfmt import ManifestTooLargeError
    from ckptfmt.manifest import CountCaps

    cap = CountCaps.for_size_cap(1 << 20).offset_elements
    assert cap == 1 << 17
    shape = [2] * 12 + [3, 1, 1, 1]  # 16 dimensions
    ss = [1] * 12 + [2, 1, 1, 1]     # 2^13 shard rows x 16 = 2^17; edge shards along dimension 12
    doc = _one_tensor(shape, ss)
    n = len(doc["tensors"]["t"]["shards"]["writer"])
    assert n * 16 == cap
    m = parse_manifest(json.dumps(doc).encode(), max_bytes=1 << 20)
    over = json.dumps(_one_tensor(shape, ss, extra=1)).encode()
    with pytest.raises(ManifestTooLargeError, match="too many elements") as e:
        parse_manifest(over, max_bytes=1 << 20)
    assert e.value.found == cap + 1
    parse_manifest(over)  # the default caps hold it
    explicit = dataclasses.replace(m, must_understand=(), extensions={}).to_json()
    assert "key" in explicit["tensors"]["t"]["shards"]
    same_tables(parse_manifest(json.dumps(explicit).encode()).tensors, m.tensors)
    same_tables(exact(explicit), m.tensors)
    t = m.tensors["t"]
    assert t.shards.offset.shape == (n, 16) and t.shards.key[1] == "c/" + "0/" * 12 + "1/0/0/0"
    assert list(t.chunk_start[:3]) == [0, 1, 2] and int(t.shards.nbytes[1]) == int(t.shards.nbytes[0])


@pytest.mark.parametrize("form", ["derived", "explicit"])
def test_reader_refuses_the_ranks_the_writer_refuses(form) -> None:
    """Issue 24 item 11: FORMAT.md 5.10's rank limit is 31, what tensorstore's zarr3 sharding can
    write (tests/test_session.py checks the writer); 32 is refused, 31 (the control) parses."""
    d31 = _one_tensor([2] + [1] * 30, [1] * 31)
    if form == "explicit":
        m = parse_manifest(json.dumps(d31).encode())
        d31 = dataclasses.replace(m, must_understand=(), extensions={}).to_json()
    d32 = copy.deepcopy(d31)
    t = d32["tensors"]["t"]
    for v in (t["shape"], t["array"]["shard_shape"], t["array"]["chunk_shape"]):
        v.append(1)
    if form == "explicit":  # one more dimension of length 1: the same shards, one more 0 in each box
        t["shards"]["offset"] = [o + [0] for o in t["shards"]["offset"]]
        t["shards"]["key"] = [k + "/0" for k in t["shards"]["key"]]
    assert len(parse_manifest(json.dumps(d31).encode()).tensors["t"].shape) == 31
    with pytest.raises(mf.InvalidManifestError, match="too many dimensions") as e:
        parse_manifest(json.dumps(d32).encode())
    assert e.value.key == "t" and e.value.expected == "<= 31"
