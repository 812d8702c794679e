"""The worked example of spec/FORMAT.md (section 12) pins the format byte for byte.

* Regenerating spec/examples/repo with spec/examples/make_example.py gives the committed files,
  byte for byte, and no others.
* A reader written only from FORMAT.md (``spec_read`` below: numpy, json and crc32c, no ckptfmt)
  reconstructs every tensor of the committed example, and agrees with ckptfmt's reader.
* Broken controls: a flipped data byte, a flipped index byte, a truncated shard and a stale
  shard from another save are each rejected, by both readers.
* The revision 1.1 example (spec/examples/repo-1.1, FORMAT.md 5.13) regenerates byte for byte;
  ckptfmt reads both its steps; the spec-only reader, which reads revision 1.0 only, reads step 1
  and rejects step 2 (it references step 1's objects) with a clear error.
* The revision 1.2 example (spec/examples/repo-1.2, FORMAT.md 5.14) regenerates byte for byte and
  holds the section 12 objects byte for byte; the spec-only reader of revision 1.0 rejects it by
  name, and the same reader taught 5.14 from the text alone (``_derive``) reconstructs every tensor.
"""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
from itertools import product
from pathlib import Path

import crc32c as _crc32c
import ml_dtypes
import numpy as np
import pytest

import ckptfmt
from ckptfmt.state import decode_state

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "spec" / "examples"
GOLDEN = EXAMPLES / "repo"
GOLDEN_V11 = EXAMPLES / "repo-1.1"
GOLDEN_V12 = EXAMPLES / "repo-1.2"
STEP = 7


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_example", EXAMPLES / "make_example.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


make_example = _load_generator()


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden") / "repo"
    make_example.generate(out)
    return out


def test_regenerated_example_is_byte_identical(regenerated: Path) -> None:
    want, got = _files(GOLDEN), _files(regenerated)
    assert sorted(got) == sorted(want), "the example's object keys changed"
    for key in want:
        assert got[key] == want[key], f"{key} differs from the committed golden file"


def test_example_sizes_match_the_spec_arithmetic() -> None:
    # FORMAT.md 12: chunk = prod(chunk_shape) * itemsize + 4; index = 16 * prod(inner) + 4.
    files = _files(GOLDEN)
    sid = make_example.SAVE_ID
    t = f"saves/{sid}/t"
    assert len(files[f"{t}/000000/c"]) == (1 * 4 + 4) + (16 * 1 + 4) == 28       # 0-d int32
    assert len(files[f"{t}/000001/c/0"]) == (2 * 2 + 4) + (16 * 1 + 4) == 28     # bfloat16 [2]
    assert len(files[f"{t}/000001/c/1"]) == 28                                    # padded edge chunk
    assert len(files[f"{t}/000002/c/0/0"]) == 3 * (3 * 4 + 4) + (16 * 3 + 4) == 100
    assert len(files[f"{t}/000002/c/1/0"]) == 2 * (3 * 4 + 4) + (16 * 3 + 4) == 84  # 1 chunk not stored
    assert files[f"{t}/000002/c/1/0"][64:80] == b"\xff" * 16                       # 2^64-1, 2^64-1


# ------------------------------------------------------------------ a reader written from FORMAT.md only

_DTYPES = {"bool": np.dtype("?"), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
_MISSING = (1 << 64) - 1


class SpecError(Exception):
    pass


#: What ``spec_read`` reads: format version 1, revision 1.0, which defines no extension (11.2).
SPEC_READER_VERSIONS = {"format_version": 1, "revision": "1.0", "extensions": ()}


def _crc(b: bytes) -> int:
    return _crc32c.crc32c(b)


def _derive(t: dict, itemsize: int) -> tuple[dict, dict]:
    """The shard and chunk tables of an entry in the derived form, computed from FORMAT.md 5.14's
    text alone (no ckptfmt code): grid cells in C order, chunks back to back from byte 0."""
    shape, a = t["shape"], t["array"]
    ss, cs = a["shard_shape"], a["chunk_shape"]
    chunk_nbytes = math.prod(cs) * itemsize + 4
    index_nbytes = 16 * math.prod(s // c for s, c in zip(ss, cs)) + 4
    sh = {"offset": [], "key": [], "nbytes": []} | t["shards"]
    ch = {"offset": [], "nbytes": []} | t["chunks"]
    for cell in product(*(range(-(-n // s)) for n, s in zip(shape, ss))):
        off = [c * s for c, s in zip(cell, ss)]
        clipped = [min(s, n - o) for s, n, o in zip(ss, shape, off)]
        stored = math.prod(-(-c // k) for c, k in zip(clipped, cs))
        sh["offset"].append(off)
        sh["key"].append("c" + "".join(f"/{c}" for c in cell))
        sh["nbytes"].append(stored * chunk_nbytes + index_nbytes)
        ch["offset"] += [r * chunk_nbytes for r in range(stored)]
        ch["nbytes"] += [chunk_nbytes] * stored
    return sh, ch


def spec_read(root: Path, step: int, revision: str = "1.0") -> tuple[dict[str, np.ndarray], dict[str, bytes]]:
    """Reconstruct every tensor and return every state object's bytes, following FORMAT.md 9 only.
    Reads format version 1 of revision 1.0 (``SPEC_READER_VERSIONS``): a manifest that needs an
    extension (11.2; revision 1.1's ``ckptfmt.references``) raises SpecError naming it. With
    ``revision="1.2"`` it also implements 5.14 (``ckptfmt.derived``), through ``_derive``."""
    m = json.loads((root / f"manifests/{step:020d}.json").read_bytes())
    if m["format"] != "ckptfmt" or m["format_version"] != SPEC_READER_VERSIONS["format_version"]:
        raise SpecError(f"unsupported format {m['format']!r} version {m['format_version']!r}; this reader reads "
                        "format version 1 only")
    known = SPEC_READER_VERSIONS["extensions"] + {"1.2": ("ckptfmt.derived",),
                                                  "1.3": ("ckptfmt.derived", "ckptfmt.packs")}.get(revision, ())
    objects = m.get("extensions", {}).get("ckptfmt.packs", {}).get("objects", [])
    needs = [x for x in m.get("must_understand", []) if x not in known]
    if needs:
        raise SpecError(f"manifest requires extensions {needs} that this reader (format version 1, revision "
                        f"{revision}) does not implement")
    out: dict[str, np.ndarray] = {}
    for key, t in m["tensors"].items():
        dt = _DTYPES.get(t["dtype"]) or np.dtype(t["dtype"]).newbyteorder("<")
        shape, a = t["shape"], t["array"]
        shard, chunk = a["shard_shape"], a["chunk_shape"]
        inner = [s // c for s, c in zip(shard, chunk)]
        n_inner = math.prod(inner)
        arr = np.zeros(shape, dtype=dt)
        sh, ch = t["shards"], t["chunks"]
        if "ckptfmt.derived" in m.get("must_understand", []) and "key" not in sh:
            sh, ch = _derive(t, dt.itemsize)
        row = 0  # next row of the chunk table
        for j, off in enumerate(sh["offset"]):
            if "object" in sh:  # revision 1.3 (5.15): the shard's bytes at start in its pack object
                o = objects[sh["object"][j]]
                path, start = root / o["key"], sh["start"][j]
                if not path.exists():
                    raise SpecError(f"missing {path}")
                whole = path.read_bytes()
                if len(whole) != o["nbytes"] or start + sh["nbytes"][j] > len(whole):
                    raise SpecError(f"size of {path}")
                obj = whole[start:start + sh["nbytes"][j]]
            else:
                path = root / a["path"] / sh["key"][j]
                if not path.exists():
                    raise SpecError(f"missing {path}")
                obj = path.read_bytes()
                if len(obj) != sh["nbytes"][j]:
                    raise SpecError(f"size of {path}")
            index = obj[len(obj) - (16 * n_inner + 4):]
            table, trailer = index[:-4], int.from_bytes(index[-4:], "little")
            if not (_crc(table) == trailer == sh["index_crc32c"][j]):
                raise SpecError(f"index checksum of {path}")
            entries = np.frombuffer(table, "<u8").reshape(n_inner, 2)
            for flat, k in enumerate(product(*(range(n) for n in inner))):
                lo = [o + i * c for o, i, c in zip(off, k, chunk)]
                o, n = (int(x) for x in entries[flat])
                if any(x >= s for x, s in zip(lo, shape)):  # wholly outside the tensor: not stored
                    if (o, n) != (_MISSING, _MISSING):
                        raise SpecError("outside chunk is stored")
                    continue
                if (o, n) != (ch["offset"][row], ch["nbytes"][row]):
                    raise SpecError("index disagrees with the manifest")
                data, crc = obj[o:o + n - 4], int.from_bytes(obj[o + n - 4:o + n], "little")
                if not (_crc(data) == crc == ch["crc32c"][row]):
                    raise SpecError(f"chunk checksum in {path}")
                block = np.frombuffer(data, dtype=dt).reshape(chunk)
                hi = [min(x + c, s) for x, c, s in zip(lo, chunk, shape)]
                arr[tuple(slice(x, y) for x, y in zip(lo, hi))] = block[tuple(slice(0, y - x) for x, y in zip(lo, hi))]
                row += 1
        if row != len(ch["offset"]):
            raise SpecError("chunk table length")
        out[key] = arr
    states = {}
    for name, s in m["state"].items():
        b = (root / s["key"]).read_bytes()
        if len(b) != s["nbytes"] or _crc(b) != s["crc32c"]:
            raise SpecError(f"state {name}")
        states[name] = b
    return out, states


def _assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_spec_reader_reconstructs_the_example() -> None:
    tensors, states = spec_read(GOLDEN, STEP)
    want = make_example.tensors()
    assert sorted(tensors) == sorted(want)
    for k in want:
        _assert_same(tensors[k], want[k])
    state = decode_state(states["global"])
    assert state["epoch"] == 1 and state["data_cursor"] == 640
    np.testing.assert_array_equal(state["rng_key"], np.array([0, 42], np.uint32))


def test_ckptfmt_reader_agrees_on_the_example() -> None:
    repo = ckptfmt.Repository(str(GOLDEN))
    assert repo.steps() == [STEP]
    assert repo.verify(STEP) > 0
    ck = repo.open(STEP)
    want = make_example.tensors()
    for k in want:
        _assert_same(ck.read(k), want[k])
    # a sub-box that straddles both writers' shards
    _assert_same(ck.read("params/w", ckptfmt.Box((2, 1), (2, 2))), want["params/w"][2:4, 1:3])
    assert ck.state()["data_cursor"] == 640


# ------------------------------------------------------------------ broken controls


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "repo"
    shutil.copytree(GOLDEN, root)
    return root, root / "saves" / make_example.SAVE_ID / "t" / "000002" / "c" / "0" / "0"


def _flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("fault", ["data", "index", "truncate", "stale"])
def test_both_readers_reject_a_damaged_example(tmp_path: Path, fault: str) -> None:
    root, shard = _copy(tmp_path)
    if fault == "data":
        _flip(shard, 20)                      # inside chunk 1 of c/0/0
        expected = ckptfmt.ChecksumMismatchError
    elif fault == "index":
        _flip(shard, 100 - 52 + 8)            # an index entry's nbytes field
        expected = ckptfmt.ChecksumMismatchError
    elif fault == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1])
        expected = ckptfmt.SizeMismatchError
    else:
        # a self-consistent shard object from a different save: same size, valid zarr checksums
        other = bytearray(shard.read_bytes())
        other[0:12] = np.array([9, 9, 9], "<f4").tobytes()
        other[12:16] = _crc(bytes(other[0:12])).to_bytes(4, "little")
        shard.write_bytes(bytes(other))
        expected = ckptfmt.ChecksumMismatchError
    with pytest.raises(SpecError):
        spec_read(root, STEP)
    with pytest.raises(expected):
        ckptfmt.Repository(str(root)).open(STEP).read("params/w")
    with pytest.raises(ckptfmt.CheckpointError):
        ckptfmt.Repository(str(root)).verify(STEP)


# ------------------------------------------------------------------ revision 1.1: references to earlier saves


def test_regenerated_v11_example_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "repo-1.1"
    make_example.generate_v11(out)
    want, got = _files(GOLDEN_V11), _files(out)
    assert sorted(got) == sorted(want), "the 1.1 example's object keys changed"
    for key in want:
        assert got[key] == want[key], f"{key} differs from the committed 1.1 golden file"


def test_v10_spec_reader_rejects_a_v11_manifest_clearly() -> None:
    # Broken control first: step 1 of the same repository is a 1.0 manifest, which it reads.
    tensors, _ = spec_read(GOLDEN_V11, 1)
    for k, v in make_example.v11_tensors(1).items():
        _assert_same(tensors[k], v)
    with pytest.raises(SpecError, match=r"requires extensions \['ckptfmt.references'\].*revision 1.0"):
        spec_read(GOLDEN_V11, 2)


def test_ckptfmt_reads_and_verifies_the_v11_example() -> None:
    repo = ckptfmt.Repository(str(GOLDEN_V11))
    assert repo.steps() == [1, 2]
    m1, m2 = repo.manifest(1), repo.manifest(2)
    assert m1.must_understand == () and m2.must_understand == ("ckptfmt.references",)
    # step 2 wrote the adapter only; the base is step 1's object, verified as step 2's own
    assert m2.referenced_saves == {m1.save_id}
    assert m2.tensors["base/w"].object_key(0) == m1.tensors["base/w"].object_key(0)
    assert m2.referenced_nbytes == int(m1.tensors["base/w"].shards.nbytes.sum())
    for step in (1, 2):
        assert repo.verify(step) == repo.manifest(step).nbytes
        ck = repo.open(step)
        for k, v in make_example.v11_tensors(step).items():
            _assert_same(ck.read(k), v)


# ------------------------------------------------------------------ revision 1.2: derived columns


def test_regenerated_v12_example_is_byte_identical_and_holds_the_v10_objects(tmp_path: Path) -> None:
    out = tmp_path / "repo-1.2"
    make_example.generate(out, manifest_columns="derived")
    want, got = _files(GOLDEN_V12), _files(out)
    assert sorted(got) == sorted(want), "the 1.2 example's object keys changed"
    for key in want:
        assert got[key] == want[key], f"{key} differs from the committed 1.2 golden file"
    # Only the manifest differs from the section 12 example: 5.14 changes no object byte.
    v10 = _files(GOLDEN)
    manifest = f"manifests/{STEP:020d}.json"
    assert sorted(v10) == sorted(want)
    assert [k for k in want if want[k] != v10[k]] == [manifest]
    doc = json.loads(want[manifest])
    assert doc["must_understand"] == ["ckptfmt.derived"] and doc["extensions"] == {"ckptfmt.derived": {}}
    for t in doc["tensors"].values():
        assert set(t["shards"]) == {"writer", "index_crc32c"} and set(t["chunks"]) == {"crc32c"}


def test_spec_readers_of_1_0_and_1_2_on_the_v12_example() -> None:
    # The 1.0 reader rejects it by name, before reading anything; its control reads the 1.0 example.
    spec_read(GOLDEN, STEP)
    with pytest.raises(SpecError, match=r"requires extensions \['ckptfmt.derived'\].*revision 1.0"):
        spec_read(GOLDEN_V12, STEP)
    # Taught 5.14 from the text alone, the same reader reconstructs every tensor and state object,
    # with every checksum and index comparison of section 9 against the derived rows.
    tensors, states = spec_read(GOLDEN_V12, STEP, revision="1.2")
    want_t, want_s = spec_read(GOLDEN, STEP)
    for k, v in make_example.tensors().items():
        _assert_same(tensors[k], v)
        _assert_same(tensors[k], want_t[k])
    assert states == want_s


def test_ckptfmt_reads_the_v12_example_with_the_v10_tables() -> None:
    m12, m10 = ckptfmt.Repository(str(GOLDEN_V12)).manifest(STEP), ckptfmt.Repository(str(GOLDEN)).manifest(STEP)
    assert m12.must_understand == ("ckptfmt.derived",) and m10.must_understand == ()
    for k, t in m10.tensors.items():
        d = m12.tensors[k]
        assert d.shards.key == t.shards.key and d.array == t.array
        for a, b in ((d.shards.offset, t.shards.offset), (d.shards.nbytes, t.shards.nbytes), (d.shards.writer, t.shards.writer),
                     (d.shards.index_crc32c, t.shards.index_crc32c), (d.chunks.offset, t.chunks.offset),
                     (d.chunks.nbytes, t.chunks.nbytes), (d.chunks.crc32c, t.chunks.crc32c)):
            assert np.array_equal(a, b), k
    repo = ckptfmt.Repository(str(GOLDEN_V12))
    assert repo.verify(STEP) == m12.nbytes == m10.nbytes
    ck = repo.open(STEP)
    for k, v in make_example.tensors().items():
        _assert_same(ck.read(k), v)


# ------------------------------------------------------------------ revision 1.2.7 (issue 47 item 14.9)
GOLDEN_ZSTD = EXAMPLES / "repo-zstd"
GOLDEN_VERIFIED = EXAMPLES / "verified"
GOLDEN_PROFILES = EXAMPLES / "profiles"


def test_regenerated_zstd_example_is_byte_identical_and_reads_back(tmp_path: Path) -> None:
    """The section 12 example with codec zstd (FORMAT.md 6.3): byte for byte, each chunk a zstd
    frame whose crc32c trailer covers the encoded bytes; ckptfmt reads the same values."""
    out = tmp_path / "repo"
    make_example.generate(out, codec="zstd")
    want, got = _files(GOLDEN_ZSTD), _files(out)
    assert sorted(got) == sorted(want) and all(got[k] == want[k] for k in want)
    m = json.loads(want[f"manifests/{STEP:020d}.json"])
    assert m["must_understand"] == ["ckptfmt.zstd"] and m["extensions"] == {"ckptfmt.zstd": {}}
    t = m["tensors"]["params/w"]
    shard = want[t["array"]["path"] + "/" + t["shards"]["key"][0]]
    for off, n, crc in zip(t["chunks"]["offset"][:3], t["chunks"]["nbytes"][:3], t["chunks"]["crc32c"][:3]):
        enc = shard[off:off + n - 4]
        assert enc[:4] == b"\x28\xb5\x2f\xfd" and _crc(enc) == crc == int.from_bytes(shard[off + n - 4:off + n], "little")
    ck = ckptfmt.Repository(str(GOLDEN_ZSTD)).open(STEP)
    for key, value in make_example.tensors().items():
        assert ck.read(key).tobytes() == value.tobytes(), key


def _spec_stamp_list(manifest: dict, stamps: list[str]) -> bytes:
    """FORMAT.md 10.4's stamp list from the text alone: shard objects by sorted key path, rows in
    order, then state objects by sorted name; ``<key>\\t<stamp>\\n`` each."""
    keys = [t["array"]["path"] + "/" + k for _, t in sorted(manifest["tensors"].items()) for k in t["shards"]["key"]]
    keys += [e["key"] for _, e in sorted(manifest["state"].items())]
    return "".join(f"{k}\t{s}\n" for k, s in zip(keys, stamps, strict=True)).encode("utf-8")


def test_regenerated_verification_record_is_byte_identical_and_follows_the_text(tmp_path: Path) -> None:
    """FORMAT.md 10.4: the record of step 7 with fixed POSIX stamps regenerates byte for byte; a
    digest computed from the text alone (stamp list order, separators, canonical JSON) equals it."""
    out = tmp_path / "verified"
    make_example.generate_verified(out, GOLDEN)
    assert _files(out) == _files(GOLDEN_VERIFIED)
    import hashlib
    raw = (GOLDEN_VERIFIED / "VERIFIED").read_bytes()
    doc = json.loads(raw)
    assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    mbytes = (GOLDEN / f"manifests/{STEP:020d}.json").read_bytes()
    manifest = json.loads(mbytes)
    lines = (GOLDEN_VERIFIED / "stamps.txt").read_bytes()
    stamps = [ln.split("\t")[1] for ln in lines.decode().splitlines()]
    assert all(len(s.split(":")) == 5 and all(p.isdigit() for p in s.split(":")) for s in stamps)
    assert _spec_stamp_list(manifest, stamps) == lines
    want_bytes = sum(sum(t["shards"]["nbytes"]) for t in manifest["tensors"].values()) + \
        sum(e["nbytes"] for e in manifest["state"].values())
    assert doc == {"format": "ckptfmt.verified", "step": STEP, "save_id": manifest["save_id"],
                   "manifest_sha256": hashlib.sha256(mbytes).hexdigest(),
                   "stamps_sha256": hashlib.sha256(lines).hexdigest(),
                   "verified_unix": make_example.VERIFIED_UNIX, "bytes": want_bytes}


def test_the_stamp_list_does_not_depend_on_the_manifests_member_order() -> None:
    """FORMAT.md 10.4, 5.1: the same manifest with its members in reverse order (valid, not
    canonical) gives the same stamp list. Control: the reversed text really is another order."""
    from ckptfmt.repository import _verified

    def reverse(v):
        return {k: reverse(v[k]) for k in reversed(list(v))} if isinstance(v, dict) else v

    mbytes = (GOLDEN / f"manifests/{STEP:020d}.json").read_bytes()
    doc = json.loads(mbytes)
    doc["state"]["rank/1"] = {"key": f"saves/{doc['save_id']}/state/rank-00001.msgpack", "nbytes": 1,
                              "crc32c": 0, "scope": "rank", "rank": 1}
    doc["state"]["rank/0"] = dict(doc["state"]["rank/1"], key=f"saves/{doc['save_id']}/state/rank-00000.msgpack", rank=0)
    canonical = json.dumps(doc, sort_keys=True).encode()
    reordered = json.dumps(reverse(doc)).encode()
    assert list(json.loads(reordered)["tensors"]) != sorted(doc["tensors"])  # the control
    a, b = ckptfmt.parse_manifest(canonical), ckptfmt.parse_manifest(reordered)
    assert _verified._objects(a) == _verified._objects(b)
    stamps = [str(i) for i in range(len(_verified._objects(a)))]
    assert _verified.stamp_lines(_verified._objects(b), stamps) == _spec_stamp_list(doc, stamps)


def test_regenerated_profile_state_objects_are_byte_identical(tmp_path: Path) -> None:
    """FORMAT.md 13.1, 13.3, 8.5: the PyTorch profile's global and per-rank state objects as
    bridges.torch.save writes them, and a local-tier step's global state, byte for byte; each
    root has the members of its row of 13.1."""
    pytest.importorskip("torch")
    out = tmp_path / "profiles"
    make_example.generate_profiles(out)
    assert _files(out) == _files(GOLDEN_PROFILES)
    g = decode_state((GOLDEN_PROFILES / "torch-global.msgpack").read_bytes())
    assert set(g) == {"torch", "extra"} and set(g["torch"]) == {"objects", "rank_state"} and g["torch"]["rank_state"] is True
    r = decode_state((GOLDEN_PROFILES / "torch-rank-00000.msgpack").read_bytes())
    assert r == {"torch": {"rng": None}, "extra": {"cursor": 640}}
    tier = decode_state((GOLDEN_PROFILES / "tier-global.msgpack").read_bytes())
    assert set(tier) == {"global", "tiers"} and tier["global"] == g
    assert set(tier["tiers"]) == {"token", "host", "hosts", "boxes", "run"} and len(tier["tiers"]["boxes"][0]) == 7


# ------------------------------------------------------------------ revision 1.3: pack objects

GOLDEN_PACKED = EXAMPLES / "repo-packed"


def test_regenerated_packed_example_is_byte_identical_and_holds_the_same_shard_bytes(tmp_path: Path) -> None:
    """FORMAT.md 5.15: the section 12 example saved packed regenerates byte for byte; each writer's
    shards lie in one pack object, and every shard's bytes there equal the shard object of the
    unpacked example (only where a shard starts changes)."""
    out = tmp_path / "repo-packed"
    make_example.generate(out, layout="packed")
    assert _files(out) == _files(GOLDEN_PACKED)
    m = json.loads((GOLDEN_PACKED / f"manifests/{STEP:020d}.json").read_bytes())
    assert m["must_understand"] == ["ckptfmt.packs"]
    objects = m["extensions"]["ckptfmt.packs"]["objects"]
    assert [o["key"].rsplit("/", 1)[1] for o in objects] == ["00000-000000", "00001-000000"]
    saved = [p for p in _files(GOLDEN_PACKED) if "/t/" in p]
    assert saved == []  # no zarr.json and no shard object of its own (FORMAT.md 6.1)
    for key, t in m["tensors"].items():
        for j, k in enumerate(t["shards"]["key"]):
            o = objects[t["shards"]["object"][j]]
            got = (GOLDEN_PACKED / o["key"]).read_bytes()[t["shards"]["start"][j]:][:t["shards"]["nbytes"][j]]
            assert got == (GOLDEN / t["array"]["path"] / k).read_bytes(), (key, k)


def test_spec_readers_of_1_2_and_1_3_on_the_packed_example() -> None:
    """A reader of revision 1.2 rejects the packed example through must_understand, naming the
    extension (the control); the same reader extended by 5.15 alone reconstructs it."""
    with pytest.raises(SpecError, match="ckptfmt.packs"):
        spec_read(GOLDEN_PACKED, STEP, revision="1.2")
    tensors, states = spec_read(GOLDEN_PACKED, STEP, revision="1.3")
    want = make_example.tensors()
    for k in want:
        _assert_same(tensors[k], want[k])
    assert decode_state(states["global"])["data_cursor"] == 640
    repo = ckptfmt.Repository(str(GOLDEN_PACKED))
    assert repo.verify(STEP) > 0
    _assert_same(repo.open(STEP).read("params/w", ckptfmt.Box((2, 1), (2, 2))), want["params/w"][2:4, 1:3])


@pytest.mark.parametrize("fault", ["data", "truncate", "grow", "missing"])
def test_both_readers_reject_a_damaged_pack(tmp_path: Path, fault: str) -> None:
    """A flipped byte, a truncated, a grown or a missing pack object: both readers refuse it."""
    root = tmp_path / "repo"
    shutil.copytree(GOLDEN_PACKED, root)
    m = json.loads((root / f"manifests/{STEP:020d}.json").read_bytes())
    w = m["tensors"]["params/w"]["shards"]
    pack = root / m["extensions"]["ckptfmt.packs"]["objects"][w["object"][0]]["key"]
    spec_read(root, STEP, revision="1.3")  # the control: the copy reads before it is damaged
    if fault == "data":
        _flip(pack, w["start"][0] + 20)
        expected = ckptfmt.ChecksumMismatchError
    elif fault == "truncate":
        pack.write_bytes(pack.read_bytes()[:-1])
        expected = ckptfmt.SizeMismatchError
    elif fault == "grow":
        pack.write_bytes(pack.read_bytes() + b"\0")
        expected = ckptfmt.SizeMismatchError
    else:
        pack.unlink()
        expected = ckptfmt.MissingShardError
    with pytest.raises(SpecError):
        spec_read(root, STEP, revision="1.3")
    with pytest.raises(expected):
        ckptfmt.Repository(str(root)).open(STEP).read("params/w")
    with pytest.raises(ckptfmt.CheckpointError):
        ckptfmt.Repository(str(root)).verify(STEP)
