"""The shard encoder (ckptfmt.shard.encode) and the local-file write (LocalFileStorage.write_object)
against their slow twin, tensorstore's zarr3 codec: a save writes the bytes tensorstore writes for
the same arrays, and faults surface as typed errors."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt import Box, LocalShard, Repository, SaveOptions, layout, save
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.storage import DelegatingStorage

_DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.bool_, ml_dtypes.bfloat16, np.complex64]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _save_both(tmp: Path, shards: list[LocalShard], chunk_bytes: int) -> tuple[dict, dict]:
    """The shard objects of a save, and those tensorstore writes for the same global arrays."""
    root = tmp / "fast"
    m = save(Repository(str(root)), 3, shards, state={"k": 1}, options=SaveOptions(layout="arrays", 
        save_id="000000000003-20261130T000000-00000000", created_unix=1.0, chunk_target_bytes=chunk_bytes))
    twin = Repository(str(tmp / "slow")).storage
    for key, t in m.tensors.items():
        a = np.zeros(t.shape, numpy_dtype(t.dtype))
        for s in (s for s in shards if s.key == key):
            a[s.box.slices()] = s.materialize()
        if a.dtype == np.bool_:  # the format stores 0x00/0x01 only
            a = np.not_equal(a.view(np.uint8), 0)
        meta = layout.zarr_array_metadata(t.shape, t.dtype, t.array.shard_shape, t.array.chunk_shape)
        twin.open_array(t.array.path, meta, create=True).result().write(a).result()
    fast, slow = _tree(root), _tree(tmp / "slow")
    return ({k: v for k, v in fast.items() if "/c" in k and not k.endswith("zarr.json")},
            {k: v for k, v in slow.items() if "/c" in k and not k.endswith("zarr.json")})


@st.composite
def _cases(draw):
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=nd, max_size=nd)))
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:  # bool sources holding bytes other than 0/1 are normalised on both paths
        x = raw.view(np.bool_).reshape(shape)
    elif dtype.kind in "fc":
        x = rng.standard_normal(shape).astype(dtype) if dtype != ml_dtypes.bfloat16 else \
            rng.standard_normal(shape).astype(np.float32).astype(dtype)
    else:
        x = raw.view(dtype).reshape(shape)
    if nd >= 2 and draw(st.booleans()):  # a non-contiguous source (the writer copies it)
        x = np.asfortranarray(x)
    # Split dimension 0 into blocks of one size (a regular grid, uneven tail allowed).
    shards = []
    if nd and draw(st.booleans()):
        step = draw(st.integers(1, shape[0]))
        for r0 in range(0, shape[0], step):
            r1 = min(r0 + step, shape[0])
            box = Box((r0,) + (0,) * (nd - 1), (r1 - r0,) + shape[1:])
            shards.append(LocalShard("t/x", shape, dtype, box, x[r0:r1]))
    else:
        shards.append(LocalShard("t/x", shape, dtype, Box.full(shape), x))
    # A second tensor whose data is lazy (a callable), as the JAX bridge hands over device copies.
    y = np.arange(24, dtype=np.float32).reshape(4, 6)
    shards.append(LocalShard("t/y", y.shape, y.dtype, Box((0, 0), (2, 6)), lambda: y[:2]))
    shards.append(LocalShard("t/y", y.shape, y.dtype, Box((2, 0), (2, 6)), lambda: y[2:]))
    # Small inner chunks: several per shard, edge chunks cut by the array's end, and chunks
    # that are not one contiguous region of the source (split along a later dimension).
    chunk_bytes = draw(st.sampled_from([1, 8, 24, 64, 4 << 20]))
    return shards, chunk_bytes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_vectored_writes_equal_the_tensorstore_bytes(case):
    shards, chunk_bytes = case
    with tempfile.TemporaryDirectory() as tmp:
        fast, slow = _save_both(Path(tmp), shards, chunk_bytes)
    assert fast.keys() == slow.keys()
    assert not [k for k in fast if k.endswith(".__lock")]
    for k in fast:
        assert fast[k] == slow[k], k


def test_vectored_writes_restore_and_detect_a_flip(tmp_path):
    """Broken control beside the property: a flipped byte in a shard the fast path wrote is caught."""
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    url = str(tmp_path / "r")
    save(url, 1, [LocalShard("x", x.shape, x.dtype, Box((r, 0), (16, 64)), x[r:r + 16]) for r in range(0, 64, 16)],
         options=SaveOptions(layout="arrays", chunk_target_bytes=1024))
    ckpt = Repository(url).open(1)
    np.testing.assert_array_equal(ckpt.read_boxes([("x", Box.full(x.shape))])[0], x)  # control
    shard = next(p for p in (tmp_path / "r").rglob("c/1/0"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    from ckptfmt import ChecksumMismatchError
    with pytest.raises(ChecksumMismatchError):
        Repository(url).open(1).read_boxes([("x", Box.full(x.shape))])


def test_delegating_storage_keeps_the_local_write(tmp_path):
    """A DelegatingStorage forwards write_object and sync to the local-file backend (its durable
    write, not the default's one write of the joined bytes); a memory store takes the default."""
    inner = Repository(str(tmp_path / "r")).storage
    wrapped = DelegatingStorage(inner)
    assert wrapped.write_object("saves/x/t/0/c/0", [b"ab", memoryview(b"cd")]) == 4
    wrapped.sync("saves/x/")
    assert (tmp_path / "r" / "saves/x/t/0/c/0").read_bytes() == b"abcd"
    assert not list((tmp_path / "r").rglob("*.__lock"))
    mem = Repository("memory://vw-test").storage
    assert mem.write_object("saves/x/o", [b"ab", b"cd"]) == 4 and mem.read("saves/x/o") == b"abcd"


_EFBIG_CHILD = r"""
import resource, sys
import numpy as np
from ckptfmt import Box, CheckpointError, LocalShard, save
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
x = np.ones((256, 256), np.float32)
try:
    save(sys.argv[1], 1, [LocalShard("x", x.shape, x.dtype, Box.full(x.shape), x)])
except CheckpointError as e:
    print(type(e).__name__, e); sys.exit(3)
print("ok")
"""


@pytest.mark.parametrize("limit,code", [(4096, 3), (1 << 30, 0)])  # the write limit, and its control
def test_a_failed_write_is_a_typed_error_and_leaves_no_lock_file(tmp_path, limit, code):
    url = str(tmp_path / "r")
    r = subprocess.run([sys.executable, "-c", _EFBIG_CHILD, url, str(limit)], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stdout + r.stderr
    if code:
        assert "IncompleteSaveError" in r.stdout and "StorageError: write failed (file too large)" in r.stdout
    assert not list((tmp_path / "r").rglob("*.__lock"))
    assert (Repository(url).steps() == [1]) is (code == 0)


_POOL_CHILD = r"""
import resource, sys
import numpy as np
from ckptfmt import Box, CheckpointError, LocalShard, save
def shards(step):  # new values at every step: nothing is referenced, every shard is written
    x = np.full((256, 256), step, np.float32)
    return [LocalShard("x", x.shape, x.dtype, Box((r, 0), (64, 256)), x[r:r + 64]) for r in range(0, 256, 64)]
save(sys.argv[1], 1, shards(1))                     # the process's writer threads now exist
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), hard))
try:
    save(sys.argv[1], 2, shards(2))                 # fails on those threads, under the write limit
    print("step 2 saved")
except CheckpointError as e:
    print("step 2 failed:", type(e).__name__)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
save(sys.argv[1], 3, shards(3))                     # the same threads, after the failure
print("step 3 saved")
"""


@pytest.mark.parametrize("limit", [4096, 1 << 30])  # step 2 fails on the writer threads; control: it does not
def test_the_writer_threads_outlive_a_failed_save(tmp_path, limit):
    """The process-wide writer threads (ckptfmt.storage._durable.writer_pool): a save that fails on them
    leaves them usable for the next save, with no lock file left behind."""
    url = str(tmp_path / "r")
    r = subprocess.run([sys.executable, "-c", _POOL_CHILD, url, str(limit)], capture_output=True, text=True,
                       timeout=120)
    failed = limit == 4096
    assert r.returncode == 0 and "step 3 saved" in r.stdout, r.stdout + r.stderr
    assert ("step 2 failed: IncompleteSaveError" in r.stdout) is failed, r.stdout
    assert Repository(url).steps() == ([1, 3] if failed else [1, 2, 3])
    assert not list((tmp_path / "r").rglob("*.__lock"))


@pytest.mark.parametrize("blocked", [True, False])  # an object that cannot be created, and its control
def test_small_objects_written_in_groups_fail_closed(tmp_path, blocked):
    """32 small shard objects on 4 writer threads go out as 4 groups of 8 (the one write scheduler).
    An object that cannot be created, in the middle of a group, fails the save with a typed error
    naming it; the step is not committed, none of its objects stay, and the step before it still
    restores. Control: the same save without the obstacle commits every object."""
    from ckptfmt import CheckpointError, layout

    repo = Repository(str(tmp_path / "r"), options={"write_threads": 4})
    rows = 32

    def shards(v: float) -> list[LocalShard]:
        x = np.full((rows, 64), v, np.float32)
        return [LocalShard("x", x.shape, x.dtype, Box((r, 0), (1, 64)), x[r:r + 1]) for r in range(rows)]

    save(repo, 1, shards(1.0))
    sid = "000000000002-20261130T000000-0000cafe"
    keys = [layout.shard_key(layout.array_path(sid, 0), (r, 0)) for r in range(rows)]
    if blocked:  # a directory where object 9's lock file goes: its O_EXCL create fails
        (tmp_path / "r" / (keys[9] + ".__lock")).mkdir(parents=True)
    opts = SaveOptions(layout="arrays", save_id=sid, chunk_target_bytes=256)
    if blocked:
        with pytest.raises(CheckpointError) as e:
            save(repo, 2, shards(2.0), options=opts)
        assert keys[9] in str(e.value)
        assert repo.steps() == [1]
        assert not (tmp_path / "r" / "saves" / sid).exists()
    else:
        save(repo, 2, shards(2.0), options=opts)
        assert repo.steps() == [1, 2]
        assert all((tmp_path / "r" / k).is_file() for k in keys)
        assert np.array_equal(repo.open(2).read("x"), np.full((rows, 64), 2.0, np.float32))
    assert np.array_equal(repo.open(1).read("x"), np.full((rows, 64), 1.0, np.float32))


def test_the_gone_vectored_writes_option_warns(tmp_path):
    """Revision 1.2.2 removed the option ``vectored_writes`` (one write path on every store): passing
    it warns that it is ignored rather than being silently dropped. Control: no option, no warning."""
    import warnings

    from ckptfmt.storage import open_storage

    with pytest.warns(DeprecationWarning, match="vectored_writes"):
        open_storage(str(tmp_path / "a"), options={"vectored_writes": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_storage(str(tmp_path / "b"))


def test_sync_modes_write_the_same_bytes_and_an_unknown_mode_is_refused(tmp_path):
    """Repository option sync_mode (FORMAT.md 8.3, 14.2): "fsync" (each object and directory) and
    "syncfs" (sync_file_range of each object, one syncfs; Linux) leave the same bytes under the
    final names and no lock file; the default is "syncfs" where Linux has it. A mode the store
    does not know is refused, as a bad option (InvalidOptionError), before the store opens
    (control: the two known modes are accepted)."""
    from ckptfmt.errors import InvalidOptionError
    from ckptfmt.storage._durable import filesystem_sync_available

    modes = ["fsync"] + (["syncfs"] if filesystem_sync_available() else [])
    for mode in modes + [None]:
        root = tmp_path / str(mode)
        store = Repository(str(root), options={} if mode is None else {"sync_mode": mode}).storage
        assert store.write_object("saves/x/t/0/c/0/0", [b"ab", memoryview(b"cd")]) == 4
        assert store.write_object("saves/x/t/0/c/1/0", [b"ef"]) == 2
        store.sync("saves/x/")
        store.sync("saves/y/")  # a sync with nothing written under it
        assert (root / "saves/x/t/0/c/0/0").read_bytes() == b"abcd" and (root / "saves/x/t/0/c/1/0").read_bytes() == b"ef"
        assert not list(root.rglob("*.__lock"))
    assert Repository(str(tmp_path / "d")).storage._syncfs is filesystem_sync_available()
    with pytest.raises(InvalidOptionError, match="sync_mode") as e:
        Repository(str(tmp_path / "bad"), options={"sync_mode": "fdatasync"}).storage
    assert "fdatasync" in str(e.value) and not (tmp_path / "bad").exists()


# ------------------------------------------------------------------ O_DIRECT writes (FORMAT.md 14.2)


@pytest.mark.parametrize("sizes", [[1], [4096], [3 * (4 << 20) + 17, 4, 5000], [(4 << 20) - 3, 3, 4096 * 3 + 1]])
def test_direct_writes_store_the_same_bytes_as_buffered_ones(tmp_path, sizes):
    from ckptfmt.storage import _durable

    rng = np.random.default_rng(len(sizes))
    bufs = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    want = b"".join(b.tobytes() for b in bufs)
    for direct in (True, False):  # the buffered write is the control
        p = tmp_path / f"obj-{direct}"
        assert _durable.write_file(str(p), iter(bufs), fsync="fsync", direct=direct) == len(want)
        assert p.read_bytes() == want and not (tmp_path / f"obj-{direct}.__lock").exists()


def test_direct_writes_on_disk_and_on_tmpfs(tmp_path):
    """The test directory's file system takes O_DIRECT (else every save here would write buffered);
    on /dev/shm the write is right whether tmpfs takes O_DIRECT (Linux 6.6 and later) or refuses it
    (the buffered path then runs)."""
    from ckptfmt.storage import _durable

    fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        on_disk = _durable.set_direct(fd, True)
    finally:
        os.close(fd)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        fd = os.open(os.path.join(shm, "probe"), os.O_WRONLY | os.O_CREAT)
        try:
            _durable.set_direct(fd, True)
        finally:
            os.close(fd)
        data = np.arange(10_000, dtype=np.uint8)
        _durable.write_file(os.path.join(shm, "obj"), [data], fsync="fsync", direct=True)
        with open(os.path.join(shm, "obj"), "rb") as f:
            assert f.read() == data.tobytes()
    finally:
        shutil.rmtree(shm)
    assert on_disk or os.uname().sysname != "Linux", "the test directory's file system refused O_DIRECT"
