"""ckptfmt's safetensors side (the core, no framework): the defensive header parser against the
reference ``safetensors`` package, reading boxes in place, hostile headers rejected before any
allocation, our export's checksums (and what a third-party file without them gives), the index,
import and export round trips, s3://, and the memory bound of a streaming export and import.
Every fault test has a broken control."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import ckptfmt  # noqa: E402
import ckptfmt.dtypes  # noqa: E402
from ckptfmt import Box, LocalShard, Repository  # noqa: E402
from ckptfmt.interop._safetensors import MAX_HEADER_BYTES, parse_header  # noqa: E402
from ckptfmt.errors import (ChecksumMismatchError, InvalidDataError, InvalidSourceError,  # noqa: E402
                            MissingShardError, SizeMismatchError, StepNotFoundError)
from ckptfmt.interop import (SafetensorsSource, export_safetensors, import_safetensors, open_source,  # noqa: E402
                             parse_size)
from s3server import s3_env, s3_server  # noqa: E402,F401  (pytest fixtures)

ROOT = Path(__file__).resolve().parent.parent


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((7, 5, 3)).astype(np.float32), "b": np.arange(10, dtype=np.int64),
            "empty": np.zeros((0, 4), np.float16), "scalar": np.array(3.5, np.float64),
            "flags": np.array([True, False, True]), "bf": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
            "f8": rng.standard_normal((3, 2)).astype(ml_dtypes.float8_e4m3fn), "u16": np.arange(6, dtype=np.uint16),
            "layers.10.w": rng.standard_normal((2, 3)).astype(np.float32),
            "layers.2.w": rng.standard_normal((2, 3)).astype(np.float32)}


def _write(path: Path, tensors: dict[str, np.ndarray], **meta: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file(tensors, str(path), metadata=meta or None)
    return path


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _rewrite_header(path: Path, edit) -> None:
    """Replace the JSON header by ``edit(header dict)``, keeping the data section as it is."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + n])
    body = json.dumps(edit(doc)).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])


# ------------------------------------------------------------------ reading the reference's files


def test_reads_what_the_reference_writes_and_boxes_read_only_their_bytes(tmp_path):
    t = _tensors()
    f = _write(tmp_path / "m" / "model.safetensors", t, format="pt")
    src = open_source(str(tmp_path / "m"))
    assert isinstance(src, SafetensorsSource) and not src.checksummed and src.step == 0
    assert src.keys() == sorted(t) and src.state() is None and src.rank_state(0, world=4, policy="drop") is None
    for k, v in t.items():
        assert _same(src.read(k), v), k
    big = np.arange(6 * 10 * 4, dtype=np.float32).reshape(6, 10, 4)
    g = _write(tmp_path / "one.safetensors", {"x": big})
    one = open_source(str(g))
    rng = np.random.default_rng(3)
    for _ in range(40):  # random boxes: the bytes of the box's runs only, the right values
        lo = [int(rng.integers(0, n)) for n in big.shape]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, big.shape)]
        box = Box(tuple(lo), tuple(h - a for a, h in zip(lo, hi)))
        before = one.stats.bytes_read
        got = one.read("x", box)
        assert _same(got, big[box.slices()])
        assert one.stats.bytes_read - before == got.nbytes  # no file carries checksums: exactly the box
    with pytest.raises(ckptfmt.ShapeMismatchError):
        one.read("x", Box((5, 0, 0), (2, 10, 4)))
    assert f.exists()


def test_header_parser_matches_the_reference_on_every_dtype(tmp_path):
    t = {k: v for k, v in _tensors(1).items() if k != "f8"}  # the reference's numpy loader has no float8
    f = _write(tmp_path / "x.safetensors", t)
    ref = safetensors_numpy.load_file(str(f))
    src = SafetensorsSource(str(f))
    for k in t:
        assert _same(src.read(k), ref[k]), k
    assert parse_size("5GB") == 5 * 10**9 and parse_size("100KB") == 10**5 and parse_size("2MiB") == 2 << 20
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


# ------------------------------------------------------------------ hostile headers


def _hostile_cases(good: dict) -> dict:
    a = good["a"]
    b0, b1 = a["data_offsets"]
    return {
        "offsets past the end": lambda d: {**d, "a": {**a, "data_offsets": [b0, b1 + 4]}},
        "offsets that overlap": lambda d: {**d, "b": {**d["b"], "data_offsets": [b0, b0 + 80]}},
        "a gap before a tensor": lambda d: {k: v for k, v in d.items() if k != "flags"},
        "span disagrees with shape x dtype": lambda d: {**d, "a": {**a, "shape": [7, 5, 4]}},
        "dtype of another size": lambda d: {**d, "a": {**a, "dtype": "F64"}},
        "a dtype the format does not store": lambda d: {**d, "a": {**a, "dtype": "F4"}},
        "a huge shape (1 TiB) with lying offsets": lambda d: {**d, "a": {**a, "shape": [1 << 20, 1 << 18]}},
        "negative offset": lambda d: {**d, "a": {**a, "data_offsets": [-4, b1]}},
        "boolean dimension": lambda d: {**d, "a": {**a, "shape": [True, 5, 3]}},
        "an extra member": lambda d: {**d, "a": {**a, "extra": 1}},
        "metadata not str -> str": lambda d: {**d, "__metadata__": {"x": 1}},
    }


@pytest.mark.parametrize("case", list(_hostile_cases({"a": {"data_offsets": [0, 1]}})))
def test_hostile_header_is_rejected_before_any_allocation(tmp_path, case):
    """Each lie is an InvalidSourceError at open, with at most the header read and almost nothing
    allocated (a 1 TiB claim included); the broken control: the same file unedited reads."""
    t = _tensors(2)
    good = _write(tmp_path / "good.safetensors", t)
    raw = good.read_bytes()
    doc = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw)
    _rewrite_header(bad, _hostile_cases(doc)[case])
    SafetensorsSource(str(good))  # the storage layer's first-use costs are not the header's
    tracemalloc.start()
    try:
        with pytest.raises(InvalidSourceError) as info:
            SafetensorsSource(str(bad))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), (case, peak)
    print(f"{case}: {info.value}")
    src = SafetensorsSource(str(good))  # control
    assert all(_same(src.read(k), v) for k, v in t.items())


def test_hostile_lengths_and_json(tmp_path):
    t = {"a": np.ones(4, np.float32)}
    good = _write(tmp_path / "g.safetensors", t)
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    cases = {
        "header length over the cap": (MAX_HEADER_BYTES + 1).to_bytes(8, "little") + raw[8:],
        "header length past the file": (len(raw)).to_bytes(8, "little") + raw[8:],
        "not JSON": raw[:8] + b"{" + b"x" * (n - 1) + raw[8 + n:],
        "duplicate names": None,
        "shorter than 8 bytes": raw[:5],
        "truncated data": raw[:-2],
    }
    body = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}'
    cases["duplicate names"] = len(body).to_bytes(8, "little") + body + raw[8 + n:]
    for what, data in cases.items():
        p = tmp_path / f"{what}.safetensors"
        p.write_bytes(data)
        with pytest.raises((InvalidSourceError, SizeMismatchError)):
            SafetensorsSource(str(p))
    assert _same(SafetensorsSource(str(good)).read("a"), t["a"])  # control
    with pytest.raises(InvalidSourceError, match="not strict JSON"):
        parse_header(b'{"a": NaN}', 100, "x")


# ------------------------------------------------------------------ checksums, flips, the index


@pytest.fixture
def exported(tmp_path):
    """A committed step (two tensors larger than one checksum block) exported by us."""
    rng = np.random.default_rng(5)
    t = {"big": rng.standard_normal((600, 1024)).astype(np.float32), "small": np.arange(12, dtype=np.int32),
         "flags": np.array([True, False])}
    repo = str(tmp_path / "repo")
    ckptfmt.save(repo, 7, [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in t.items()])
    out = tmp_path / "out"
    export_safetensors(repo, str(out), max_shard_size="1MB")
    return t, repo, out


def _data_offset(f: Path, name: str) -> int:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


def _flip(f: Path, at: int) -> None:
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x10]))


def test_export_is_checksummed_and_a_flipped_byte_is_caught(exported, tmp_path):
    """Our export's files: every block checked; a flipped data byte raises on the direct read (only
    a box that touches its block) and on import, where no step is committed. The third-party
    case: the same flip in a file without checksums reads back flipped, with no error (safetensors
    has none), and the import records that nothing but sizes was verified."""
    t, repo, out = exported
    src = open_source(str(out))
    assert src.checksummed and src.origin["step"] == 7 and src.step == 7
    assert all(_same(src.read(k), v) for k, v in t.items())
    with pytest.raises(StepNotFoundError):
        open_source(str(out), 3)
    f = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["big"]
    at = _data_offset(f, "big") + 2 * (1 << 20) + 123  # in block 2 of "big"
    _flip(f, at)
    src = open_source(str(out))
    assert _same(src.read("big", Box((0, 0), (100, 1024))), t["big"][:100])  # rows 0-99: blocks 0 and 1 only
    with pytest.raises(ChecksumMismatchError) as info:
        src.read("big")
    assert info.value.key == "big" and "block 2" in str(info.value.expected)
    url = str(tmp_path / "imported")
    with pytest.raises(ChecksumMismatchError):
        import_safetensors(str(out), url)
    assert Repository(url).steps() == []
    # Third party: the reference writer, no checksums.
    plain = _write(tmp_path / "plain" / "model.safetensors", t)
    _flip(plain, _data_offset(plain, "big") + 123)
    src = open_source(str(plain.parent))
    assert not src.checksummed
    got = src.read("big")
    assert not _same(got, t["big"]) and np.count_nonzero(got != t["big"]) == 1
    rep = import_safetensors(str(plain.parent), str(tmp_path / "third"))
    assert rep.provenance["source_checksums"].startswith("none")


def test_flipped_header_dtype_and_invalid_bools(exported, tmp_path):
    """A header edit that keeps every size (F32 -> I32) fails our table checksum at open; a bool byte
    other than 0/1 is InvalidDataError; the controls read."""
    t, repo, out = exported
    f = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["small"]
    _rewrite_header(f, lambda d: {**d, "small": {**d["small"], "dtype": "F32"}})
    with pytest.raises(ChecksumMismatchError, match="tensor table"):
        open_source(str(out))
    g = _write(tmp_path / "bools.safetensors", {"flags": np.array([True, False, True])})
    assert _same(SafetensorsSource(str(g)).read("flags"), np.array([True, False, True]))  # control
    _flip(g, g.stat().st_size - 1)  # 0x01 -> 0x11
    with pytest.raises(InvalidDataError):
        SafetensorsSource(str(g)).read("flags")


def test_index_must_agree_with_its_files(tmp_path):
    t = _tensors(3)
    d = tmp_path / "sharded"
    names = sorted(t)
    files = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for fname, keys in files.items():
        _write(d / fname, {k: t[k] for k in keys})
    wm = {k: f for f, ks in files.items() for k in ks}
    index = d / "model.safetensors.index.json"

    def put(weight_map):
        index.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))

    put(wm)
    src = open_source(str(d))
    assert all(_same(src.read(k), v) for k, v in t.items())  # control
    for bad, err in ((dict(wm, ghost="model-00001-of-00002.safetensors"), InvalidSourceError),
                     ({k: v for k, v in wm.items() if k != names[0]}, InvalidSourceError),
                     (dict(wm, **{names[0]: "../../etc/passwd"}), InvalidSourceError),
                     (dict(wm, **{names[0]: "model-00003-of-00003.safetensors"}), MissingShardError)):
        put(bad)
        with pytest.raises(err):
            open_source(str(d))
    put(wm)
    os.truncate(d / "model-00002-of-00002.safetensors", (d / "model-00002-of-00002.safetensors").stat().st_size - 1)
    with pytest.raises((SizeMismatchError, InvalidSourceError)):
        open_source(str(d))


# ------------------------------------------------------------------ round trips


def test_import_export_round_trip_with_the_reference(tmp_path):
    """reference file -> import -> export (3 files, bfloat16 cast of the floats) -> the reference
    reader: the same bytes (floats: the same values cast); the step's provenance says where from."""
    t = _tensors(4)
    src = _write(tmp_path / "src" / "model.safetensors", t, format="pt")
    url = str(tmp_path / "repo")
    rep = import_safetensors(str(src.parent), url, step=5, prefix="model/")
    m = Repository(url).manifest(5)
    assert m.metadata["import"]["format"] == "safetensors" and m.metadata["import"]["tensors"] == len(t)
    assert rep.nbytes == sum(v.nbytes for v in t.values())
    ck = Repository(url).open(5)
    assert all(_same(ck.read("model/" + k), v) for k, v in t.items())
    out = tmp_path / "out"
    r = export_safetensors(url, str(out), max_shard_size=100, dtype="bfloat16")
    assert len(r.files) >= 3 and r.step == 5
    got = {}
    for f in r.files:
        got.update(safetensors_numpy.load_file(str(out / f)))
    for k, v in t.items():
        floating = ckptfmt.dtypes.dtype_name(v.dtype).startswith(("float", "bfloat"))
        want = v.astype(ml_dtypes.bfloat16) if floating else v
        assert _same(got["model/" + k], want), k
    with pytest.raises(FileExistsError):
        export_safetensors(url, str(out))


def test_export_reads_are_verified_and_a_corrupt_step_leaves_nothing(exported, tmp_path):
    """A flipped byte in the checkpoint's stored chunk: the export raises ChecksumMismatchError and
    leaves no file and no index; control: the intact step exported (the fixture)."""
    t, repo, out = exported
    m = Repository(repo).manifest(7)
    e = m.tensors["big"]
    obj = Path(repo) / e.object_key(0)
    _flip(obj, 1000)
    bad = tmp_path / "bad"
    with pytest.raises(ckptfmt.ChecksumMismatchError):
        export_safetensors(repo, str(bad))
    assert not [p for p in bad.iterdir() if p.name.endswith((".safetensors", ".json"))]


# ------------------------------------------------------------------ object storage


def test_sharded_directory_on_s3(tmp_path, s3_env):
    """A sharded directory (index + 3 files) on S3: opened and read in place (ranges), imported."""
    t = _tensors(6)
    names = sorted(t)
    d = tmp_path / "hf"
    files = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for fname, keys in files.items():
        _write(d / fname, {k: t[k] for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}))
    for p in d.iterdir():
        s3_env.client.upload_file(str(p), s3_env.bucket, f"hf/{p.name}")
    src = open_source(s3_env.url("hf"))
    assert isinstance(src, SafetensorsSource) and src.keys() == sorted(t)
    assert _same(src.read("a", Box((2, 1, 0), (3, 2, 3))), t["a"][2:5, 1:3])
    url = str(tmp_path / "repo")
    import_safetensors(s3_env.url("hf"), url)
    ck = Repository(url).open()
    assert all(_same(ck.read(k), v) for k, v in t.items())


# ------------------------------------------------------------------ memory bound


@pytest.mark.multiprocess
def test_streaming_export_and_import_stay_within_the_memory_bound(tmp_path):
    """A 192 MiB step of 16 MiB tensors: export, then import of the export, each in a fresh process.
    Peak RSS rise stays under the bound (largest tensor + 256 MiB) and under the step's own size
    (streaming, not holding it): both printed. (2 GiB: tests/interop/rss_check.py; docs/INTEROP.md.)"""
    script = ROOT / "tests" / "interop" / "rss_check.py"
    r = subprocess.run([sys.executable, str(script), str(tmp_path), "192", "16", "--no-raw"], capture_output=True,
                       text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    for phase in ("export", "import"):
        rise = doc[phase]["rss_rise"]
        print(f"{phase}: {doc[phase]['bytes'] / 2**20:.0f} MiB in {doc[phase]['seconds']:.2f} s, "
              f"peak RSS rise {rise / 2**20:.0f} MiB (bound {(doc['largest'] + (256 << 20)) / 2**20:.0f} MiB)")
        assert rise <= doc["largest"] + (256 << 20) and rise < doc["size"], doc


# ------------------------------------------------------------------ issue 24: caps, names, empty sources, links


def _raw_file(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def _traced_peak(fn) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001  (the caller asserts on it)
        err = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, peak


def test_header_and_index_holding_too_many_json_values_are_refused_before_decoding(tmp_path):
    """Issue 24 item 8: a 100 MB header of empty arrays cost 2.6 GB before its error, a 64 MiB
    index of {} 1.7 GB and an empty commit. FORMAT.md 5.10's structural cap, scaled to each size
    cap, is counted before decoding: one value over is refused with a peak far below what decoding
    would build (about 1 GB); the controls, a real header and index, open."""
    from ckptfmt.interop._safetensors import HEADER_STRUCTURAL, INDEX_STRUCTURAL

    header = b'{"a":[' + b",".join([b"[]"] * (HEADER_STRUCTURAL // 2 + 1)) + b"]}"  # "[" and "," per element
    f = _raw_file(tmp_path / "values" / "model.safetensors", header)
    err, peak = _traced_peak(lambda: SafetensorsSource(str(f)))
    assert isinstance(err, InvalidSourceError) and "too many JSON values" in str(err), err
    assert err.found == HEADER_STRUCTURAL + 3 and peak < 3 * len(header) + (32 << 20), peak  # {, [ and 2 per element
    d = tmp_path / "index"
    _write(d / "model-00001-of-00001.safetensors", {"w": np.ones(3, np.float32)})
    index = d / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map":{},"metadata":{"x":[' + b",".join([b"{}"] * (INDEX_STRUCTURAL // 2)) + b"]}}")
    err, peak = _traced_peak(lambda: SafetensorsSource(str(d)))
    assert isinstance(err, InvalidSourceError) and "index holds too many JSON values" in str(err), err
    assert peak < 3 * index.stat().st_size + (32 << 20), peak
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    assert _same(SafetensorsSource(str(d)).read("w"), np.ones(3, np.float32))  # the control


def test_index_nesting_and_tensor_caps(tmp_path):
    """FORMAT.md 5.10's nesting (64 levels) and tensor (2^20) caps on an index; the controls: 64
    levels, and the tensor cap through parse_header's own budget (at it: accepted)."""
    from ckptfmt.interop._safetensors import MAX_TENSORS, parse_index

    def nested(levels: int) -> bytes:  # the index object is level 1
        return b'{"weight_map":{"w":"m.safetensors"},"metadata":' + b'{"a":' * (levels - 2) + b"{}" + b"}" * (levels - 1)

    parse_index(nested(64), "i")  # the control
    with pytest.raises(InvalidSourceError, match="nests arrays and objects too deeply"):
        parse_index(nested(65), "i")
    many = b'{"weight_map":{' + b",".join(b'"t%d":"m.safetensors"' % i for i in range(MAX_TENSORS + 1)) + b"}}"
    with pytest.raises(InvalidSourceError, match="names too many tensors") as e:
        parse_index(many, "i")
    assert e.value.found == MAX_TENSORS + 1
    body = json.dumps({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(3)}).encode()
    assert len(parse_header(body, 8 + len(body), "f", max_tensors=3).tensors) == 3  # the control
    with pytest.raises(InvalidSourceError, match="too many tensors"):
        parse_header(body, 8 + len(body), "f", max_tensors=2)
    # Over the cap, refused from its data_offsets members before any JSON is decoded: the peak stays
    # a small fraction of the header (decoding it would cost several times its size).
    entry = b'"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    big = b"{" + b",".join(entry % i for i in range(MAX_TENSORS + 1)) + b"}"
    err, peak = _traced_peak(lambda: parse_header(big, 8 + len(big), "f"))
    assert isinstance(err, InvalidSourceError) and "too many tensors" in str(err), err
    assert peak < (8 << 20), peak


def test_lone_surrogate_names_are_refused_before_anything_is_written(tmp_path):
    """Issue 24 item 11: a tensor name "\\ud800" raised UnicodeEncodeError. In a header and in an
    index it is InvalidSourceError at open, and an import commits nothing; the control, a valid
    escape ("\\u00e9"), imports."""
    data = np.ones(2, np.float32).tobytes()

    def header(name: str) -> bytes:
        return ('{"%s":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' % name).encode()

    bad = _raw_file(tmp_path / "bad" / "model.safetensors", header("w\\ud800"), data)
    with pytest.raises(InvalidSourceError, match="lone surrogate") as e:
        SafetensorsSource(str(bad))
    assert "\\ud800" in e.value.key
    url = str(tmp_path / "repo")
    with pytest.raises(InvalidSourceError, match="lone surrogate"):
        import_safetensors(str(bad.parent), url)
    assert not Path(url).exists() or Repository(url).steps() == []
    d = tmp_path / "idx"
    _raw_file(d / "m.safetensors", header("w"), data)
    (d / "model.safetensors.index.json").write_text('{"weight_map":{"w\\udfff":"m.safetensors"}}')
    with pytest.raises(InvalidSourceError, match="lone surrogate"):
        SafetensorsSource(str(d))
    good = _raw_file(tmp_path / "good" / "model.safetensors", header("w\\u00e9"), data)
    report = import_safetensors(str(good.parent), url)  # the control
    assert report.tensors == 1 and Repository(url).open(0).keys() == ["w\u00e9"]


def test_a_source_without_tensors_is_an_error_not_an_empty_step(tmp_path):
    """Issue 24 item 8: an index of no tensors committed an empty step. A file or an index with no
    tensors is InvalidSourceError and nothing is committed; the control imports one tensor."""
    empty = _raw_file(tmp_path / "file" / "model.safetensors", b"{}")
    d = tmp_path / "index"
    _write(d / "m.safetensors", {"w": np.ones(2, np.float32)})
    (d / "model.safetensors.index.json").write_text('{"weight_map":{}}')
    url = str(tmp_path / "repo")
    for src in (empty.parent, d):
        with pytest.raises(InvalidSourceError, match="no tensors"):
            import_safetensors(str(src), url)
        assert not Path(url).exists() or Repository(url).steps() == []
    (d / "model.safetensors.index.json").write_text('{"weight_map":{"w":"m.safetensors"}}')
    assert import_safetensors(str(d), url).tensors == 1  # the control
    assert Repository(url).steps() == [0]


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_the_importer_never_follows_a_link(tmp_path, where):
    """Issue 24 item 13 (docs/INTEROP.md): a model.safetensors, or a shard file named by the index,
    that is a symbolic link (out of the source directory, or inside it) is InvalidSourceError
    naming the file, at open and at import, and nothing is written; the control: the same bytes as
    a plain file import."""
    t = {"w": np.arange(6, dtype=np.float32)}
    target = _write((tmp_path / "elsewhere" if where == "outside" else tmp_path / "src" / "real") / "x.safetensors", t)
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "model.safetensors").symlink_to(target)
    url = str(tmp_path / "repo")
    for fn in (lambda: SafetensorsSource(str(src / "model.safetensors")), lambda: import_safetensors(str(src), url)):
        with pytest.raises(InvalidSourceError, match="symbolic link") as e:
            fn()
        assert e.value.object == "model.safetensors"
    assert not Path(url).exists() or Repository(url).steps() == []
    sharded = tmp_path / "sharded"
    _write(sharded / "a.safetensors", {"v": np.ones(2, np.int32)})
    (sharded / "b.safetensors").symlink_to(target)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"v": "a.safetensors", "w": "b.safetensors"}}))
    with pytest.raises(InvalidSourceError, match="symbolic link") as e:
        SafetensorsSource(str(sharded))
    assert e.value.object == "b.safetensors"
    (sharded / "b.safetensors").unlink()
    (sharded / "b.safetensors").write_bytes(target.read_bytes())
    assert _same(SafetensorsSource(str(sharded)).read("w"), t["w"])  # the controls: plain files
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").write_bytes(target.read_bytes())
    assert import_safetensors(str(src), url).tensors == 1


def test_import_over_the_tensor_cap_is_refused_before_anything_is_read(tmp_path):
    """Issue 24 item 8: a 5.8 MB header of 100k empty tensors imported for 170-309 s and 1.5 GB (the
    save's cost per tensor). An import takes at most MAX_IMPORT_TENSORS (2^17) unless asked: over
    the cap it is InvalidSourceError naming the count and the option, nothing read or committed;
    the control: the same file under a cap that fits it imports every tensor."""
    from ckptfmt.interop._stimport import MAX_IMPORT_TENSORS

    assert MAX_IMPORT_TENSORS == 1 << 17
    src = _write(tmp_path / "m.safetensors", {f"t{i}": np.full(2, i, np.float32) for i in range(5)})
    url = str(tmp_path / "repo")
    with pytest.raises(InvalidSourceError, match="over the import cap") as e:
        import_safetensors(str(src), url, max_tensors=4)
    assert e.value.found == 5 and "--max-tensors" in str(e.value)
    assert not Path(url, "manifests").exists() or Repository(url).steps() == []
    report = import_safetensors(str(src), url, max_tensors=5)  # the control
    assert report.tensors == 5 and _same(Repository(url).open().read("t4"), np.full(2, 4, np.float32))
