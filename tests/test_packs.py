"""Pack objects (FORMAT.md 5.15, revision 1.3): each writer's shards back to back in a few objects.

What is checked, each fault with its control:
* a save writes O(writers) objects, not O(tensors x shards), and reads back bit for bit, on local
  files (written in place) and on an object store (memory://, gathered then written whole);
* ``pack_bytes`` splits a writer's shards over several packs, and a shard larger than it has one
  of its own;
* every rule of 5.15 that a manifest can break is refused with a typed error naming the object,
  and the untouched manifest is accepted;
* an incremental save references a shard inside the previous step's pack, and deleting that step
  keeps the pack the newer step reads (its save id is in the newer manifest);
* zarr-python reads every array of a packed save through the reference map (14.4).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ckptfmt import (Box, CheckpointError, InvalidManifestError, LocalShard, Repository, SaveOptions, parse_manifest,
                     save)
from ckptfmt.interop import zarr_references
from _layouts import save_threads

WORLD = 4


def _arrays(n: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"layer{i}/w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(n)}
    out["step"] = np.asarray(5, np.int64)
    out["empty"] = np.zeros((0, 3), np.float32)
    return out


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _objects_of_save(root: str, save_id: str) -> list[str]:
    return [f for f in _files(root) if f.startswith(f"saves/{save_id}/")]


def _read_all(url: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    ck = Repository(url).open(step)
    for k, a in arrays.items():
        got = ck.read(k)
        assert got.dtype == a.dtype and np.array_equal(got, a), k


def test_a_packed_save_writes_a_few_objects_per_writer_and_reads_back(tmp_path):
    arrays = _arrays()
    packed, arrays_url = str(tmp_path / "packed"), str(tmp_path / "arrays")
    for url, layout in ((packed, "packed"), (arrays_url, "arrays")):
        res = save_threads(url, 1, arrays, "rows", WORLD, options=SaveOptions(layout=layout, chunk_target_bytes=2048))
        assert not any(isinstance(r, Exception) for r in res), res
        _read_all(url, 1, arrays)
        assert Repository(url).verify(1) > 0
    mp, ma = Repository(packed).manifest(1), Repository(arrays_url).manifest(1)
    objs_p, objs_a = _objects_of_save(packed, mp.save_id), _objects_of_save(arrays_url, ma.save_id)
    # One pack per writer plus the global state; the control: one object per shard plus each zarr.json.
    assert sum("/p/" in f for f in objs_p) == WORLD and len(objs_p) <= 2 * WORLD + 10, objs_p
    assert len(objs_a) > 10 * WORLD
    assert "ckptfmt.packs" in mp.must_understand and "ckptfmt.packs" not in ma.must_understand
    # The same shard bytes, wherever they start.
    for k, t in mp.tensors.items():
        ta = ma.tensors[k]
        for s in range(len(t.shards)):
            with open(os.path.join(packed, t.object_key(s)), "rb") as f:
                f.seek(t.shard_start(s))
                got = f.read(int(t.shards.nbytes[s]))
            with open(os.path.join(arrays_url, ta.object_key(s)), "rb") as f:
                assert got == f.read(), (k, s)


def test_pack_bytes_splits_a_writers_shards(tmp_path):
    arrays = _arrays(6)  # 8 KiB each, one shard each
    url = str(tmp_path / "r")
    # (direct_writes off: no gaps to align O_DIRECT runs, so the split is exact)
    m = save(Repository(url, options={"direct_writes": False}), 1, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()],
             options=SaveOptions(pack_bytes=20_000))
    keys = [o["key"] for o in m.extensions["ckptfmt.packs"]["objects"]]
    assert len(keys) == 3 and all(o["nbytes"] <= 20_000 for o in m.extensions["ckptfmt.packs"]["objects"])
    _read_all(url, 1, arrays)
    one = str(tmp_path / "one")  # a shard larger than pack_bytes: a pack of its own
    m = save(one, 1, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()],
             options=SaveOptions(pack_bytes=100))
    assert len(m.extensions["ckptfmt.packs"]["objects"]) == 7  # 6 layers and the 0-d step
    _read_all(one, 1, arrays)


def test_a_packed_save_on_an_object_store_reads_back():
    arrays = _arrays(4)
    url = "memory://packs-object-store"
    res = save_threads(url, 1, arrays, "rows", 2, options=SaveOptions(chunk_target_bytes=2048))
    assert not any(isinstance(r, Exception) for r in res), res
    repo = Repository(url)
    m = repo.manifest(1)
    assert len(m.extensions["ckptfmt.packs"]["objects"]) == 2
    _read_all(url, 1, arrays)
    assert repo.verify(1) > 0


@pytest.fixture(scope="module")
def packed_doc(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("doc") / "r")
    arrays = _arrays(3)
    res = save_threads(url, 1, arrays, "rows", 2, options=SaveOptions(chunk_target_bytes=2048))
    assert not any(isinstance(r, Exception) for r in res), res
    with open(os.path.join(url, "manifests", f"{1:020d}.json"), "rb") as f:
        return f.read()


def _w(d):
    return d["tensors"]["layer1/w"]["shards"]


def _objs(d):
    return d["extensions"]["ckptfmt.packs"]["objects"]


def _overlap(d):
    w = _w(d)
    w["object"][1], w["start"][1] = w["object"][0], w["start"][0]


def _other_in_pack(d):
    w, v = _w(d), d["tensors"]["layer2/w"]["shards"]
    w["object"][0], w["start"][0] = v["object"][0], v["start"][0]


def _past_end(d):
    _w(d)["start"][0] = _objs(d)[_w(d)["object"][0]]["nbytes"]


def _unused(d):
    _objs(d).append({"key": f"saves/{d['save_id']}/p/00009-000000", "nbytes": 10})


def _dup_key(d):
    _objs(d).append(dict(_objs(d)[0]))


def _only_start(d):
    del _w(d)["object"]


def _bad_index(d):
    _w(d)["object"][0] = len(_objs(d))


def _key_escapes(d):
    _objs(d)[0]["key"] = "saves/../outside"


def _zero_nbytes(d):
    _objs(d)[0]["nbytes"] = 0


def _extra_member(d):
    d["extensions"]["ckptfmt.packs"]["more"] = 1


def _not_listed(d):
    d["must_understand"] = []


@pytest.mark.parametrize("breaks", [_overlap, _other_in_pack, _past_end, _unused, _dup_key, _only_start, _bad_index,
                                    _key_escapes, _zero_nbytes, _extra_member, _not_listed])
def test_every_rule_of_5_15_is_checked(packed_doc, breaks):
    parse_manifest(packed_doc)  # the control: the manifest as written is accepted
    d = json.loads(packed_doc)
    breaks(d)
    with pytest.raises(InvalidManifestError):
        parse_manifest(json.dumps(d).encode())


def test_pack_columns_without_the_extension_are_unknown_members(packed_doc):
    d = json.loads(packed_doc)
    d["must_understand"], d["extensions"] = [], {}
    with pytest.raises(InvalidManifestError, match="member"):
        parse_manifest(json.dumps(d).encode())
    for t in d["tensors"].values():  # the control: the same manifest with the columns taken out
        t["shards"].pop("object", None), t["shards"].pop("start", None)
    parse_manifest(json.dumps(d).encode())


def test_an_incremental_save_references_the_previous_pack_and_deletion_keeps_it(tmp_path):
    url = str(tmp_path / "r")
    base = _arrays(4)
    shards = lambda a: [LocalShard(k, v.shape, v.dtype, Box((0,) * v.ndim, v.shape), v) for k, v in a.items()]  # noqa: E731
    m1 = save(url, 1, shards(base))
    changed = dict(base)
    changed["layer0/w"] = base["layer0/w"] + 1
    m2 = save(url, 2, shards(changed))
    refs = [m2.tensors[k].object_key(0) for k in ("layer1/w", "layer2/w")]
    assert all(r.startswith(f"saves/{m1.save_id}/p/") for r in refs)
    assert m2.tensors["layer0/w"].object_key(0).startswith(f"saves/{m2.save_id}/p/")
    assert m1.save_id in m2.referenced_saves and m2.referenced_nbytes > 0
    repo = Repository(url)
    repo.delete(1)
    assert repo.steps() == [2]
    assert os.path.exists(os.path.join(url, refs[0]))  # the pack step 2 reads is kept
    _read_all(url, 2, changed)
    assert repo.verify(2) > 0
    with pytest.raises(CheckpointError):  # the control: without that pack, step 2 is unreadable
        os.remove(os.path.join(url, refs[0]))
        Repository(url).open(2).read("layer1/w")


def test_zarr_python_reads_a_packed_save_through_the_reference_map(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    zarr = pytest.importorskip("zarr")
    arrays = {k: v for k, v in _arrays(3).items()}
    url = str(tmp_path / "r")
    res = save_threads(url, 1, arrays, "rows", 2, options=SaveOptions(chunk_target_bytes=2048))
    assert not any(isinstance(r, Exception) for r in res), res
    m = Repository(url).manifest(1)
    refs = zarr_references(m, url)
    store = zarr.storage.FsspecStore(fsspec.filesystem("reference", fo=refs, asynchronous=True), read_only=True)
    for k, a in arrays.items():
        got = zarr.open_array(store, path=m.tensors[k].array.path, mode="r")[...]
        assert np.array_equal(got, a), k
    # The control: a map that points one shard at the wrong start gives other values (zarr's own
    # crc32c codec refuses them), so the comparison above can fail.
    key = next(k for k in refs["refs"] if k.endswith("/c/0/0") and "t/000001" in k)
    bad = json.loads(json.dumps(refs))
    bad["refs"][key][1] += 4
    store = zarr.storage.FsspecStore(fsspec.filesystem("reference", fo=bad, asynchronous=True), read_only=True)
    with pytest.raises(Exception):
        got = zarr.open_array(store, path=key.rsplit("/c/", 1)[0], mode="r")[...]
        assert np.array_equal(got, arrays[sorted(arrays)[1]])


@pytest.mark.parametrize("columns", ["explicit", "derived"])
def test_packed_entries_encode_canonically_in_both_forms(tmp_path, columns):
    """The fast encoder writes the two columns where json.dumps puts them ("object" after "nbytes",
    "start" after "offset"), in the explicit and in the derived form (FORMAT.md 5.14: neither
    column is derivable); the bytes parse back to the same rows, and read back."""
    arrays = _arrays(3)
    url = str(tmp_path / "r")
    res = save_threads(url, 1, arrays, "rows", 2, options=SaveOptions(chunk_target_bytes=2048, manifest_columns=columns))
    assert not any(isinstance(r, Exception) for r in res), res
    m = Repository(url).manifest(1)
    text = m.to_bytes()
    assert text == (json.dumps(m.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    back = parse_manifest(text)
    for k, t in m.tensors.items():
        if len(t.shards):
            assert np.array_equal(back.tensors[k].packed.object, t.packed.object)
            assert np.array_equal(back.tensors[k].packed.start, t.packed.start)
    doc = json.loads(text)
    assert ("ckptfmt.derived" in doc["must_understand"]) == (columns == "derived")
    assert set(doc["tensors"]["layer0/w"]["shards"]) >= {"object", "start"}
    _read_all(url, 1, arrays)


@pytest.mark.parametrize("blocked", [True, False])
def test_a_pack_that_cannot_be_created_fails_the_save_closed(tmp_path, blocked):
    """A directory where a writer's pack lock file goes (its O_EXCL create fails): the save fails
    with a typed error naming the pack, no step is listed and the save's objects are removed.
    Control: the same save without the obstacle commits and reads back."""
    from ckptfmt import layout

    url = str(tmp_path / "r")
    arrays = _arrays(3)
    sid = "000000000002-20261130T000000-0000cafe"
    pack = layout.pack_key(sid, 0, 0)
    if blocked:
        (tmp_path / "r" / (pack + ".__lock")).mkdir(parents=True)
        with pytest.raises(CheckpointError) as e:
            save(url, 2, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()],
                 options=SaveOptions(save_id=sid))
        assert pack in str(e.value)
        assert Repository(url).steps() == []
        assert not [f for f in _files(str(tmp_path / "r")) if f.startswith(f"saves/{sid}/") and "/p/" not in f]
    else:
        save(url, 2, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()],
             options=SaveOptions(save_id=sid))
        assert Repository(url).steps() == [2] and os.path.isfile(os.path.join(url, pack))
        _read_all(url, 2, arrays)


def test_direct_runs_leave_aligned_gaps_that_nothing_reads(tmp_path):
    """With direct writes (the default), each writer task's run of shards starts at a multiple of
    4 KiB of its pack and its last block is padded (FORMAT.md 5.15 lets a writer leave gaps);
    the rows stay disjoint and inside the pack, and everything reads back and verifies. Control:
    without direct writes the shards lie back to back."""
    arrays = _arrays(8)
    sizes = {}
    for direct in (True, False):
        url = str(tmp_path / f"d{direct}")
        repo = Repository(url, options={"direct_writes": direct})
        m = save(repo, 1, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()])
        _read_all(url, 1, arrays)
        assert Repository(url).verify(1) > 0
        rows = sorted((t.shard_start(s), int(t.shards.nbytes[s])) for t in m.tensors.values() for s in range(len(t.shards)))
        sizes[direct] = m.extensions["ckptfmt.packs"]["objects"][0]["nbytes"]
        if not direct:
            assert all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))  # back to back
    assert sizes[True] >= sizes[False]


def test_the_cli_writes_the_reference_map(tmp_path):
    """``ckptfmt zarr-refs`` prints the map zarr_references builds; a wrong path exits 1 (the control)."""
    import subprocess
    import sys

    arrays = _arrays(2)
    url = str(tmp_path / "r")
    save(url, 1, [LocalShard(k, a.shape, a.dtype, Box((0,) * a.ndim, a.shape), a) for k, a in arrays.items()])
    out = subprocess.run([sys.executable, "-m", "ckptfmt", "zarr-refs", url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == json.loads(json.dumps(zarr_references(Repository(url).manifest(1), url)))
    bad = subprocess.run([sys.executable, "-m", "ckptfmt", "zarr-refs", str(tmp_path / "nope")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1
