"""Resharding round trips: N writers -> M readers, exact, on the file and memory kvstores."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt import Box, LocalShard, Repository, save, shard
from _layouts import grid_boxes, save_threads


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "rows": rng.standard_normal((64, 24)).astype(np.float32),
        "cols": rng.integers(0, 1 << 30, (16, 40)).astype(np.int64),
        "grid": rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16),
        "uneven": rng.standard_normal((10, 3)).astype(np.float64),   # torch.chunk over 8: 2,2,2,2,2,0,0,0
        "replicated": rng.standard_normal((5, 7)).astype(np.float16),
        "partial": rng.standard_normal((12, 4)).astype(np.float32),
        "scalar": np.asarray(3.25, np.float32),
        "empty": np.zeros((0, 5), np.int32),
        "flags": rng.integers(0, 2, (9,)).astype(bool),
    }


KINDS = {"rows": "rows", "cols": "cols", "grid": "grid", "uneven": "rows", "replicated": "replicated",
         "partial": "partial", "scalar": "replicated", "empty": "rows", "flags": "rows"}


@pytest.fixture
def saved8(repo_url):
    arrays = _arrays()
    res = save_threads(repo_url, 7, arrays, KINDS, 8)
    assert all(not isinstance(r, Exception) for r in res), res
    return repo_url, arrays, res[0]


def test_replicated_written_once(saved8):
    url, arrays, m = saved8
    keys = sorted(m.tensors)
    # One copy each, written by the holder whose turn it is (FORMAT.md 8.1): the tensor's position
    # in key order plus the cell, modulo the candidates.
    assert list(m.tensors["replicated"].shards.writer) == [keys.index("replicated") % 8]
    i = keys.index("partial")  # 4 row blocks, block c held by ranks c (replica 0) and c + 4 (replica 1)
    assert list(m.tensors["partial"].shards.writer) == [c + 4 * ((i + c) % 2) for c in range(4)]
    assert list(m.tensors["rows"].shards.writer) == list(range(8))
    assert m.writers == 8


@pytest.mark.parametrize("readers", [4, 2, 1])
@pytest.mark.parametrize("mesh", ["rows", "cols", "grid"])
def test_reshard_exact(saved8, readers, mesh):
    url, arrays, _ = saved8
    ck = Repository(url).open(7)
    for key, arr in arrays.items():
        if arr.ndim == 0:
            boxes = [Box((), ())]
        elif mesh == "rows" or arr.ndim == 1:
            boxes = grid_boxes(arr.shape, [readers])
        elif mesh == "cols":
            boxes = grid_boxes(arr.shape, [1, readers])
        else:
            boxes = grid_boxes(arr.shape, [max(1, readers // 2), 2 if readers > 1 else 1])
        got = ck.read_boxes([(key, b) for b in boxes])
        for b, g in zip(boxes, got):
            sl = b.slices()
            want = arr[sl] if sl else arr
            assert g.dtype == arr.dtype and g.shape == want.shape
            assert g.tobytes() == np.ascontiguousarray(want).tobytes(), (key, b)


def test_subbox_reads_only_needed_chunks(tmp_path):
    x = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    url = str(tmp_path / "r")
    # 8 writers by rows -> 8 shards of 128 rows; small chunk target -> 16 inner chunks per shard
    res = save_threads(url, 1, {"x": x}, "rows", 8, options=__import__("ckptfmt").SaveOptions(chunk_target_bytes=8 << 10))
    assert not any(isinstance(r, Exception) for r in res)
    ck = Repository(url).open()
    box = Box((128, 0), (128, 256))  # exactly one writer's slice (1/8)
    got = ck.read("x", box)
    assert np.array_equal(got, x[128:256])
    assert ck.stats.bytes_read <= 1.1 * box.size * 4, ck.stats.bytes_read


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_save_layout_any_restore_layout(data):
    """Property: any regular save layout, any restore boxes -> bit-identical reads."""
    nd = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    save_mesh = data.draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd))
    arr = np.arange(int(np.prod(shape)) if shape else 1, dtype=np.int32).reshape(shape) * 7 + 1
    boxes = grid_boxes(shape, save_mesh) if nd else [Box((), ())]
    url = f"memory://prop-{__import__('uuid').uuid4().hex}"
    target = data.draw(st.integers(4, 64))
    shards = [LocalShard("a", shape, arr.dtype, b, arr[b.slices()] if nd else arr) for b in boxes]
    save(url, 0, shards, options=__import__("ckptfmt").SaveOptions(chunk_target_bytes=target))
    ck = Repository(url).open()
    reqs = []
    for _ in range(data.draw(st.integers(1, 4))):
        off = tuple(data.draw(st.integers(0, n)) for n in shape)
        shp = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, off))
        reqs.append(Box(off, shp))
    for b, g in zip(reqs, ck.read_boxes([("a", b) for b in reqs])):
        want = arr[b.slices()] if nd else arr
        assert np.array_equal(g, want)


@pytest.mark.parametrize("where", ["none", "middle-chunk-data", "chunk-trailer", "index"])
@pytest.mark.parametrize("path", ["whole-object", "per-chunk", "tensorstore"])
def test_every_file_read_path_verifies_every_byte(tmp_path, where, path):
    """A whole shard read into its outputs takes one vectored read (one request per object); a
    partial one reads chunk by chunk; with positional_reads=False the same file repository is
    read through tensorstore's kvstore. All reject a flipped byte anywhere, and accept the clean
    object (the control)."""
    from ckptfmt import ChecksumMismatchError, SaveOptions

    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    url = str(tmp_path / "r")  # 2 shards of 32 rows, 4 chunks of 8 rows each
    res = save_threads(url, 1, {"x": x}, "rows", 2, options=SaveOptions(chunk_target_bytes=256))
    assert not any(isinstance(r, Exception) for r in res)
    ck = Repository(url).open()
    t = ck.tensor("x")
    chunks = int(t.chunk_start[1])  # stored chunks of shard 0
    assert chunks >= 4
    obj = tmp_path / "r" / t.object_key(0)
    raw = bytearray(obj.read_bytes())
    cn, s0 = shard.shard_sizes(t.geometry).chunk, t.shard_start(0)  # shard 0's bytes start at s0 of its pack
    at = {"none": None, "middle-chunk-data": s0 + (chunks // 2) * cn + 5, "chunk-trailer": s0 + 2 * cn - 2,
          "index": shard.shard_bytes(t, 0).index[0] + 3}[where]
    if at is not None:
        raw[at] ^= 0x10
        obj.write_bytes(bytes(raw))
    box = Box((0, 0), (32, 8)) if path != "per-chunk" else Box((0, 0), (32, 4))
    repo = Repository(url, options={"positional_reads": path != "tensorstore"})
    assert (not repo.storage.positional_reads) == (path == "tensorstore")
    ck = repo.open()
    if at is None:
        got = ck.read("x", box)
        assert np.array_equal(got, x[box.slices()])
        assert (ck.stats.requests == 1) == (path != "per-chunk"), ck.stats.requests
    else:
        with pytest.raises(ChecksumMismatchError):
            ck.read("x", box)


def test_restored_arrays_are_private_to_the_process(tmp_path):
    """Large outputs live in their own anonymous mappings: a fork()ed child (a data-loader worker)
    that writes into one must not change the parent's array. The control: the child sees its
    own write."""
    import os

    x = np.arange(2 << 20, dtype=np.float32).reshape(1024, 2048)  # 8 MiB: past the own-mapping threshold
    url = str(tmp_path / "r")
    assert not any(isinstance(r, Exception) for r in save_threads(url, 1, {"x": x}, "rows", 2))
    got = Repository(url).open().read("x")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: write, report what it sees, leave without running any cleanup
        got[0, 0] = -1.0
        os.write(w, b"1" if got[0, 0] == -1.0 else b"0")
        os._exit(0)
    os.close(w)
    seen = os.read(r, 1)
    os.waitpid(pid, 0)
    assert seen == b"1"  # the control: the write happened in the child
    assert got[0, 0] == 0.0 and np.array_equal(got, x)  # and stayed there


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_awkward_lengths_save_in_few_chunks_and_restore_exactly(tmp_path, codec):
    """Issue 47 item 5: tensors whose length is a prime (4 MiB + 28 B of float32, 4 MiB + 15 B of
    uint8, 2^24 + 43 B of uint8) and one split over two writers into prime-length halves save
    with one chunk per shard and a manifest of a few hundred bytes, restore bit for bit (whole, and
    boxes that cut through a chunk and across the writers' boundary), and verify. The control:
    the divisor rule alone made one chunk per element (1,048,583 / 4,194,319 chunks and a 21.6 MB
    manifest for the first; 16,777,259 chunks, over the 2^24 chunk-row cap, for the third)."""
    from ckptfmt import SaveOptions

    p, q, r = 1_048_583, 4_194_319, 16_777_259  # primes
    arrays = {"f32": (np.arange(p, dtype=np.float32) * 0.5 - 7).astype(np.float32),
              "u8": (np.arange(q) * 7 % 251).astype(np.uint8),
              "big": (np.arange(r) % 253).astype(np.uint8)}
    split = np.arange(2 * p, dtype=np.float32)  # two writers: shards of p rows each
    url = str(tmp_path / "r")
    opts = SaveOptions(codec=codec, codec_level=1)
    save(url, 0, [LocalShard(k, a.shape, a.dtype, Box((0,), a.shape), a) for k, a in arrays.items()], options=opts)
    res = save_threads(url, 1, {"split": split}, "rows", 2, options=opts)
    assert not any(isinstance(x, Exception) for x in res), res
    for step, keys in ((0, arrays), (1, {"split": split})):
        ck = Repository(url).open(step)
        assert (tmp_path / "r" / "manifests" / f"{step:020d}.json").stat().st_size < 4096
        for k, a in keys.items():
            t = ck.tensor(k)
            assert int(t.chunk_start[-1]) == len(t.shards.key) == (2 if k == "split" else 1), k
            assert t.geometry.chunk_shape == t.geometry.shard_shape == (len(a) // len(t.shards.key),), k
            n = len(a)
            boxes = [Box((0,), (n,)), Box((n // 3,), (n // 3,)), Box((n // 2 - 5,), (10,)), Box((n - 1,), (1,))]
            for b, g in zip(boxes, ck.read_boxes([(k, b) for b in boxes])):
                assert g.dtype == a.dtype and g.tobytes() == a[b.slices()].tobytes(), (k, b)
        checked = ck.verify()  # the stored bytes: all the data when raw, less when compressed
        assert checked >= sum(a.nbytes for a in keys.values()) if codec == "raw" else checked > 0
