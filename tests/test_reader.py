"""The reader against a hostile or unlucky store: what it reads is bounded by the manifest, and
what it cannot read safely it refuses with a typed error. Every case has its control: the same
read of the undamaged object succeeds."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard, Repository, SaveOptions, shard
from ckptfmt.errors import AllocationError, ChecksumMismatchError, InvalidDataError, InvalidManifestError, SizeMismatchError, StorageError
from ckptfmt.reader import BlockChecks, Checkpoint

X = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)


def _save(url: str) -> ckptfmt.Manifest:
    shards = [LocalShard("x", X.shape, X.dtype, Box((32 * r, 0), (32, 32)), X[32 * r:32 * r + 32]) for r in range(2)]
    return ckptfmt.save(url, 1, shards, state={"epoch": 3}, options=SaveOptions(layout="arrays", chunk_target_bytes=1024))


def _repo(where: str, tmp_path: Path) -> tuple[Repository, str]:
    url = f"memory://reader-{tmp_path.name}" if where == "memory" else str(tmp_path / "repo")
    _save(url)
    return Repository(url, options={"positional_reads": where != "tensorstore"}), url


OPS = {
    "read-one-element": lambda repo: repo.open(1).read("x", Box((40, 3), (1, 1))),
    "read-whole": lambda repo: repo.open(1).read("x"),
    "verify": lambda repo: repo.verify(1),
    "state": lambda repo: repo.open(1).state(),
}


def _target(repo: Repository, op: str) -> tuple[str, int]:
    m = repo.manifest(1)
    if op == "state":
        return m.state["global"].key, m.state["global"].nbytes
    t = m.tensors["x"]
    return t.object_key(1), int(t.shards.nbytes[1])


# ------------------------------------------------------------------ reads bounded by nbytes (item 6)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("where", ["positional", "tensorstore", "memory"])
def test_a_grown_object_is_rejected(tmp_path, where, op):
    repo, url = _repo(where, tmp_path)
    OPS[op](repo)  # the control: the object as written reads and verifies
    key, n = _target(repo, op)
    if where == "memory":
        repo.storage.write(key, repo.storage.read(key) + bytes(1 << 20))
    else:
        os.truncate(os.path.join(url, key), n + (1 << 30))  # sparse
    with pytest.raises(SizeMismatchError) as info:
        OPS[op](repo)
    assert info.value.object == key and info.value.expected == n


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(fn) -> dict:
    """Run ``fn``; its outcome (the error's class name, or "no error") and by how much the resident
    set grew at its peak (sampled every 2 ms: a missed peak can only make a bound look looser)."""
    peak, done = [_rss()], []

    def sample() -> None:
        while not done:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    before = _rss()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        fn()
        result = "no error"
    except Exception as e:  # noqa: BLE001 - the caller checks the class
        result = type(e).__name__
    done.append(1)
    th.join()
    return {"result": result, "grew": max(peak[0], _rss()) - before}


@pytest.mark.parametrize("where", ["positional", "tensorstore"])
def test_a_grown_object_costs_no_more_than_its_recorded_size(tmp_path, where):
    """Peak RSS while rejecting a shard or state object grown by 256 MiB (sparse) stays far below
    256 MiB; the broken control (the grown shard's index read to the end of the object, as an
    unbounded reader reads it) shows that the measurement sees an unbounded read. (memory:// hands
    out its stored bytes without a copy, so only file and S3 (tests/test_s3.py) can show a cost.)"""
    grow = 256 << 20
    repo, url = _repo(where, tmp_path)
    for op in ("verify", "state"):
        key, n = _target(repo, op)
        os.truncate(os.path.join(url, key), n + grow)
    for op in sorted(OPS):
        got = measure(lambda: OPS[op](repo))
        assert got["result"] == "SizeMismatchError" and got["grew"] < 32 << 20, (op, got)
    key, n = _target(repo, "verify")
    control = measure(lambda: repo.storage.read_range(key, n - 64, None).result())
    assert control["result"] == "no error" and control["grew"] > grow // 2, control


# ------------------------------------------------------------------ special files (item 7)


def _within(fn, timeout_s: float = 30.0):
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - classified by the caller
            box["exc"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    return th, box


def _unblock(path: str) -> None:
    """Let a reader blocked opening the FIFO at ``path`` go (it then reads end-of-file)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _make_special(path: str, kind: str) -> None:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    else:
        os.mkdir(path)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("where", ["positional", "tensorstore"])
def test_a_special_file_at_an_object_key_is_an_error_not_a_hang(tmp_path, where, op, kind):
    repo, url = _repo(where, tmp_path)
    OPS[op](repo)  # the control: the regular file reads
    key, _ = _target(repo, op)
    path = os.path.join(url, key)
    _make_special(path, kind)
    th, box = _within(lambda: OPS[op](repo))
    if th.is_alive():
        _unblock(path)
        th.join(10)
        pytest.fail(f"{op} blocked on a {kind} at {key}")
    exc = box.get("exc")
    assert isinstance(exc, StorageError), repr(exc)
    assert exc.object == key and exc.expected == "a regular file"


def test_control_a_fifo_blocks_a_reader_that_opens_it(tmp_path):
    """What the check prevents: tensorstore's file driver, handed the FIFO's key, waits for a writer."""
    repo, url = _repo("tensorstore", tmp_path)
    key, _ = _target(repo, "read-whole")
    path = os.path.join(url, key)
    _make_special(path, "fifo")
    th, _ = _within(lambda: repo.storage.kv.read(key).result(), timeout_s=2.0)
    blocked = th.is_alive()
    _unblock(path)
    th.join(10)
    assert blocked and not th.is_alive()


def test_cli_verify_reports_a_fifo(tmp_path):
    repo, url = _repo("positional", tmp_path)
    cmd = [sys.executable, "-m", "ckptfmt", "verify", url, "--json"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the control
    key, _ = _target(repo, "verify")
    _make_special(os.path.join(url, key), "fifo")
    try:
        bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        _unblock(os.path.join(url, key))
    assert bad.returncode == 1 and "StorageError" in bad.stdout and "FIFO" in bad.stdout, bad.stdout + bad.stderr


# ------------------------------------------------------------------ index entries vs the chunk table (item 10)


def _edit_manifest(url: str, edit) -> None:
    path = Path(url, "manifests", f"{1:020d}.json")
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")


READS = {  # every path that reads an index: whole shard (one vectored read), chunk by chunk, kvstore, verify
    "positional-whole": ("positional", lambda repo: repo.open(1).read("x", Box((0, 0), (32, 32)))),
    "positional-chunks": ("positional", lambda repo: repo.open(1).read("x", Box((0, 0), (16, 4)))),
    "tensorstore": ("tensorstore", lambda repo: repo.open(1).read("x", Box((0, 0), (16, 4)))),
    "verify": ("positional", lambda repo: repo.verify(1)),
}


def test_chunk_rows_that_share_bytes_are_rejected(tmp_path):
    """Issue 12's manifest-only edit: chunk row 1 given row 0's offset and crc32c. Every crc32c still
    matches, and the reader returned row 0's data twice; the manifest is now invalid."""
    repo, url = _repo("positional", tmp_path)
    assert np.array_equal(repo.open(1).read("x"), X)  # the control

    def edit(doc):
        ch = doc["tensors"]["x"]["chunks"]
        ch["offset"][1], ch["crc32c"][1] = ch["offset"][0], ch["crc32c"][0]

    _edit_manifest(url, edit)
    with pytest.raises(InvalidManifestError, match="share bytes"):
        repo.open(1)


class _NoEntryCheck(BlockChecks):
    """A broken control: the index's entries are not compared with the chunk table."""

    def entries(self, *args, **kwargs) -> None:
        return None


class _NoChunkCheck(BlockChecks):
    """A broken control: no chunk is checked (its length, crc32c and bool bytes)."""

    def chunk(self, *args, **kwargs) -> None:
        return None


def _with_checks(repo: Repository, checks: BlockChecks) -> Repository:
    """``repo``'s storage, read with ``checks`` instead of the real ones."""
    return Repository(repo.url, storage=repo.storage, checks=checks)


def _swap_rows(doc):  # rows 0 and 1 of shard 0 name each other's bytes: a valid manifest
    ch = doc["tensors"]["x"]["chunks"]
    for col in ("offset", "crc32c"):
        ch[col][0], ch[col][1] = ch[col][1], ch[col][0]


@pytest.mark.parametrize("read", sorted(READS))
def test_a_chunk_table_that_differs_from_the_index_is_rejected(tmp_path, read):
    where, fn = READS[read]
    repo, url = _repo(where, tmp_path)
    fn(repo)  # the control: as written, every path reads
    _edit_manifest(url, _swap_rows)
    with pytest.raises(ChecksumMismatchError, match="chunk table") as info:
        fn(repo)
    assert info.value.key == "x" and "index entry (0, 0)" in info.value.object
    # Broken control: without the entry check every crc32c passes and the rows come back swapped.
    repo = _with_checks(repo, _NoEntryCheck())
    if read != "verify":
        got = fn(repo)
        assert not np.array_equal(got, X[:got.shape[0], :got.shape[1]])
    else:
        fn(repo)


def _swap_index_entries(url: str) -> None:
    """Swap index entries 0 and 1 of shard 0 and recompute the index crc32c in the object and the
    manifest, as an attacker who controls the repository would."""
    from ckptfmt.checksum import crc32c

    m = Repository(url).manifest(1)
    t = m.tensors["x"]
    path = Path(url, t.object_key(0))
    raw = bytearray(path.read_bytes())
    start = len(raw) - shard.shard_sizes(t.geometry).index
    raw[start:start + 16], raw[start + 16:start + 32] = raw[start + 16:start + 32], raw[start:start + 16]
    crc = crc32c(bytes(raw[start:-4]))
    raw[-4:] = crc.to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    _edit_manifest(url, lambda doc: doc["tensors"]["x"]["shards"]["index_crc32c"].__setitem__(0, crc))


def _tensorstore_read(url: str, box: Box) -> np.ndarray:
    import tensorstore as ts

    t = Repository(url).manifest(1).tensors["x"]
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(url, t.array.path) + "/"},
                   "fill_missing_data_reads": False}, open=True).result()
    return arr[box.slices()].read().result()


@pytest.mark.parametrize("read", sorted(READS))
def test_index_entries_swapped_with_both_crcs_recomputed_are_rejected(tmp_path, read):
    """Issue 12: two index entries swapped and the index crc32c recomputed in the object and the
    manifest. tensorstore follows the index, ckptfmt followed the chunk table: different values, no
    error. ckptfmt now compares the entries with the chunk table."""
    where, fn = READS[read]
    repo, url = _repo(where, tmp_path)
    box = Box((0, 0), (16, 4))
    assert np.array_equal(_tensorstore_read(url, box), X[box.slices()])  # the control
    _swap_index_entries(url)
    assert not np.array_equal(_tensorstore_read(url, box), X[box.slices()])  # zarr readers now see swapped rows
    with pytest.raises(ChecksumMismatchError, match="chunk table"):
        fn(repo)
    # Broken control: without the entry check, ckptfmt returns other values than tensorstore.
    repo = _with_checks(repo, _NoEntryCheck())
    if read != "verify":
        got = fn(repo)
        assert not np.array_equal(got[:16, :4], _tensorstore_read(url, box))
    else:
        fn(repo)


# ------------------------------------------------------------------ bool bytes (item 11)


def _bool_repo(tmp_path: Path, where: str) -> tuple[Repository, str, np.ndarray]:
    url = str(tmp_path / "bools")
    b = (np.arange(64) % 3 == 0).reshape(8, 8)
    ckptfmt.save(url, 1, [LocalShard("b", b.shape, b.dtype, Box((4 * r, 0), (4, 8)), b[4 * r:4 * r + 4]) for r in range(2)],
                 options=SaveOptions(layout="arrays", chunk_target_bytes=16))
    return Repository(url, options={"positional_reads": where != "tensorstore"}), url, b


def _set_byte(url: str, value: int) -> None:
    """Byte 5 of shard 1's first chunk becomes ``value``, with the chunk crc32c recomputed in its
    trailer and in the manifest: only the format's bool rule stands in the way."""
    from ckptfmt.checksum import crc32c

    t = Repository(url).manifest(1).tensors["b"]
    c = int(t.chunk_start[1])
    off, n = int(t.chunks.offset[c]), int(t.chunks.nbytes[c])
    path = Path(url, t.object_key(1))
    raw = bytearray(path.read_bytes())
    raw[off + 5] = value
    crc = crc32c(bytes(raw[off:off + n - 4]))
    raw[off + n - 4:off + n] = crc.to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    _edit_manifest(url, lambda doc: doc["tensors"]["b"]["chunks"]["crc32c"].__setitem__(c, crc))


@pytest.mark.parametrize("read", ["positional-whole", "positional-chunks", "tensorstore", "verify"])
def test_a_bool_byte_other_than_0_or_1_is_rejected(tmp_path, read):
    where = "tensorstore" if read == "tensorstore" else "positional"
    repo, url, b = _bool_repo(tmp_path, where)
    fn = {"verify": lambda: repo.verify(1), "positional-chunks": lambda: repo.open(1).read("b", Box((4, 0), (4, 4)))}.get(
        read, lambda: repo.open(1).read("b"))
    _set_byte(url, 1 if not b[4:].reshape(-1)[5] else 0)  # the control: a valid byte, crc32c recomputed
    fn()
    _set_byte(url, 2)
    with pytest.raises(InvalidDataError) as info:
        fn()
    assert info.value.key == "b" and info.value.found == "0x02"
    # Broken control: without the chunk checks, the byte 2 reaches the caller as a bool that
    # compares equal to True but is not the bytes the format stores.
    repo = _with_checks(repo, _NoChunkCheck())  # fn reads ``repo`` when called
    if read != "verify":
        got = fn()
        assert 2 in np.frombuffer(np.ascontiguousarray(got).tobytes(), np.uint8)


# ------------------------------------------------------------------ outputs that cannot be allocated (item 13)


def _declare(url: str, elements: int) -> None:
    """Rewrite the manifest so that tensor "v" (one shard of one chunk, float64) declares ``elements``."""
    def edit(doc):
        t = doc["tensors"]["v"]
        t["shape"] = t["array"]["shard_shape"] = t["array"]["chunk_shape"] = [elements]
        t["shards"]["nbytes"] = [elements * 8 + 4 + 20]
        t["chunks"]["nbytes"] = [elements * 8 + 4]

    _edit_manifest(url, edit)


def _grow_as_declared(url: str) -> None:
    """Make shard 0 of "v" as long as the manifest says (sparse), with a valid index at its end."""
    from ckptfmt.checksum import crc32c

    t = Repository(url).manifest(1).tensors["v"]
    n, cn = int(t.shards.nbytes[0]), int(t.chunks.nbytes[0])
    entries = (0).to_bytes(8, "little") + cn.to_bytes(8, "little")
    crc = crc32c(entries)
    with open(os.path.join(url, t.object_key(0)), "r+b") as f:
        f.truncate(n)
        f.seek(n - 20)
        f.write(entries + crc.to_bytes(4, "little"))
    _edit_manifest(url, lambda doc: doc["tensors"]["v"]["shards"]["index_crc32c"].__setitem__(0, crc))


def _one_vector(url: str) -> np.ndarray:
    v = np.arange(8, dtype=np.float64)
    ckptfmt.save(url, 1, [LocalShard("v", v.shape, v.dtype, Box((0,), (8,)), v)], options=SaveOptions(layout="arrays"))
    return v


def test_a_declared_tensor_larger_than_memory_is_refused_before_allocating(tmp_path):
    """Issue 12: a manifest declaring a 256 GiB tensor made the reader allocate it first (an untyped
    MemoryError). What a read needs at once (its outputs, a chunk) is checked against the host's
    memory before it is allocated, and the error names the tensor."""
    url = str(tmp_path / "r")
    v = _one_vector(url)
    assert np.array_equal(Repository(url).open(1).read("v"), v)  # the control
    _declare(url, 1 << 35)  # 2^35 float64 = 256 GiB, one shard of one chunk
    _grow_as_declared(url)  # a sparse object as long as declared, with a valid index
    ck = Repository(url).open(1)
    for fn in (lambda: ck.read("v"), lambda: ck.verify()):
        with pytest.raises(AllocationError) as info:
            fn()
        assert info.value.key == "v"
    # Only what a read needs at once counts: one element allocates 8 bytes for the output, but its
    # chunk (the whole 256 GiB) must be read and checked whole.
    with pytest.raises(AllocationError, match="one chunk"):
        ck.read("v", Box((0,), (1,)))


_ALLOC_CHILD = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from test_reader import _declare, _one_vector
from ckptfmt import Box, Repository
url = sys.argv[2]
_one_vector(url)
_declare(url, 1 << 28)  # 2 GiB: below this host's memory, above the address-space limit set here
ck = Repository(url).open(1)
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
out = {}
for name, box in (("whole", None), ("one element", Box((0,), (1,)))):
    try:
        ck.read("v", box)
        out[name] = "no error"
    except Exception as e:
        out[name] = [type(e).__name__, getattr(e, "key", None)]
print(json.dumps(out))
"""


def test_an_allocation_that_fails_is_a_typed_error_naming_the_tensor(tmp_path):
    """Below the host's memory an allocation can still fail (an address-space limit, a busy host):
    that failure is an AllocationError naming the tensor, not a MemoryError. The control: a small
    read under the same limit gets past allocation (to the object's real size)."""
    out = subprocess.run([sys.executable, "-c", _ALLOC_CHILD, str(Path(__file__).parent), str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"whole": ["AllocationError", "v"], "one element": ["SizeMismatchError", "v"]}, got


@pytest.mark.parametrize("where", ["positional", "tensorstore"])
def test_verify_of_shards_larger_than_the_window_checks_every_byte(tmp_path, where):
    """verify reads a shard larger than its window as its index and then its chunks (never the whole
    object at once), and still finds every fault."""
    url = str(tmp_path / "repo")
    _save(url)
    repo = Repository(url, options={"positional_reads": where != "tensorstore", "read_window_bytes": 2048})
    assert repo.verify(1) > 0  # the control
    t = repo.manifest(1).tensors["x"]
    path = Path(url, t.object_key(1))
    clean = path.read_bytes()
    for damage, err in [(lambda b: b[:1500] + bytes([b[1500] ^ 1]) + b[1501:], ChecksumMismatchError),
                        (lambda b: b + b"\0", SizeMismatchError), (lambda b: b[:-1], SizeMismatchError)]:
        path.write_bytes(damage(clean))
        with pytest.raises(err):
            repo.verify(1)
    path.write_bytes(clean)
    _swap_index_entries(url)
    with pytest.raises(ChecksumMismatchError, match="chunk table"):
        repo.verify(1)


# ------------------------------------------------------------------ links leave the repository (issue 24 item 13)

LINKED = {  # what is replaced by a link into another repository holding the very same bytes
    "save directory": lambda m: f"saves/{m.save_id}/",
    "tensor directory": lambda m: m.tensors["x"].array.path + "/",
    "shard directory": lambda m: m.tensors["x"].object_key(1).rsplit("/", 1)[0] + "/",
    "shard object": lambda m: m.tensors["x"].object_key(1),
    "state object": lambda m: m.state["global"].key,
}


def _link_into(other: str, url: str, rel: str) -> None:
    """Replace ``url/rel`` by a link to the same path in the repository ``other``."""
    path = os.path.join(url, rel.rstrip("/"))
    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    os.symlink(os.path.join(other, rel.rstrip("/")), path, target_is_directory=rel.endswith("/"))


@pytest.mark.parametrize("linked", sorted(LINKED))
@pytest.mark.parametrize("where", ["positional", "tensorstore"])
def test_a_link_into_another_repository_is_not_read(tmp_path, where, linked):
    """A reader does not leave the repository (FORMAT.md 4.2, 9 step 4): ``saves/<id>`` (or a
    directory or object below it) that links to a copy in another repository, byte for byte the
    same, is refused with a StorageError naming the tensor and the object; the control, the same
    repository with its own directory, reads. Checked once per directory per open."""
    repo, url = _repo(where, tmp_path)
    m = repo.manifest(1)
    other = str(tmp_path / "other")
    shutil.copytree(url, other, symlinks=True)
    for op in sorted(OPS):  # control: the repository's own copy, and the other repository, read
        OPS[op](repo)
        OPS[op](Repository(other))
    rel = LINKED[linked](m)
    _link_into(other, url, rel)
    shard_keys = {m.tensors["x"].object_key(s) for s in range(len(m.tensors["x"].shards))}
    touched = {k for k in shard_keys | {m.state["global"].key} if k.startswith(rel)}
    assert touched
    refused = 0
    for op in sorted(OPS):
        keys = {"read-one-element": {_target(repo, op)[0]}, "read-whole": shard_keys, "state": {m.state["global"].key},
                "verify": shard_keys | {m.state["global"].key}}[op]
        if not keys & touched:
            OPS[op](repo)  # an object that no link is on the way to still reads
            continue
        with pytest.raises(StorageError) as e:
            OPS[op](repo)
        assert e.value.object in touched and e.value.key in ("x", "global"), (op, e.value)
        assert "symbolic link" in str(e.value.found) and "does not leave the repository" in e.value.message
        refused += 1
    assert refused
    # What the check prevents: the store itself follows the link and hands out the other bytes.
    key = sorted(touched)[0]
    assert repo.storage.kv.read(key).result().value == Path(other, key).read_bytes()


def test_a_manifest_that_is_a_link_is_not_read(tmp_path):
    repo, url = _repo("positional", tmp_path)
    other = str(tmp_path / "other")
    shutil.copytree(url, other)
    _link_into(other, url, f"manifests/{1:020d}.json")
    with pytest.raises(StorageError) as e:
        Repository(url).manifest(1)
    assert e.value.object == f"manifests/{1:020d}.json" and e.value.found == "a symbolic link"
    assert Repository(other).manifest(1).step == 1  # control: the real file


def test_a_save_does_not_reference_objects_reached_through_a_link(tmp_path):
    """The byte proof of an incremental save (FORMAT.md 8.4) reads the earlier objects as a reader
    does, so it never references one that a reader would refuse: a later step behind a linked
    ``saves/<id>`` writes its own objects. Control: with the real directory it references them."""
    url = str(tmp_path / "repo")
    m1 = _save(url)
    again = [LocalShard("x", X.shape, X.dtype, Box((32 * r, 0), (32, 32)), X[32 * r:32 * r + 32].copy()) for r in range(2)]
    m2 = ckptfmt.save(url, 2, again, options=SaveOptions(layout="arrays", chunk_target_bytes=1024))
    assert set(m2.tensors["x"].objects) == {0, 1}  # control: referenced
    other = str(tmp_path / "other")
    shutil.copytree(url, other)
    _link_into(other, url, f"saves/{m1.save_id}/")
    m3 = ckptfmt.save(url, 3, again, options=SaveOptions(layout="arrays", chunk_target_bytes=1024))
    assert not m3.referenced_saves and not m3.tensors["x"].objects
    assert Repository(url).open(3).read("x").tobytes() == X.tobytes()
    with pytest.raises(StorageError):
        Repository(url).open(2).read("x")  # step 2 references step 1's objects, now behind the link


# ------------------------------------------------------------------ mapped reads (FORMAT.md 14.8)


def _mapped_file(a: np.ndarray) -> str | None:
    """The file whose mapping holds ``a``'s data (/proc/self/maps), or None (anonymous memory)."""
    addr = a.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


def _whole_chunk_repo(tmp_path: Path) -> str:
    url = str(tmp_path / "mapped")
    shards = [LocalShard("x", X.shape, X.dtype, Box((32 * r, 0), (32, 32)), X[32 * r:32 * r + 32]) for r in range(2)]
    ckptfmt.save(url, 1, shards, state={}, options=SaveOptions(layout="arrays", chunk_target_bytes=1 << 62))  # one chunk per shard
    return url


def test_mapped_reads_hand_out_verified_copy_on_write_mappings(tmp_path):
    url = _whole_chunk_repo(tmp_path)
    mapped = Repository(url, options={"mapped_reads": True})
    top, bottom = mapped.open(1).read_boxes([("x", Box((0, 0), (32, 32))), ("x", Box((32, 0), (32, 32)))])
    assert np.array_equal(top, X[:32]) and np.array_equal(bottom, X[32:])
    m = mapped.manifest(1).tensors["x"]
    assert [_mapped_file(top), _mapped_file(bottom)] == [os.path.join(url, m.array.path, k) for k in m.shards.key[:2]]
    top[0, 0] = -1.0  # copy-on-write: the object keeps its bytes
    assert np.array_equal(Repository(url).open(1).read("x"), X) and Repository(url).verify(1) is not None
    # Controls: without the option, and for a box that is not one whole shard, the reader copies.
    plain = Repository(url).open(1).read_boxes([("x", Box((0, 0), (32, 32)))])[0]
    part = mapped.open(1).read_boxes([("x", Box((0, 0), (8, 32)))])[0]
    whole = mapped.open(1).read("x")  # one output fed by two shards
    assert _mapped_file(plain) is None and _mapped_file(part) is None and _mapped_file(whole) is None
    assert np.array_equal(part, X[:8]) and np.array_equal(whole, X)


def test_a_mapped_read_of_a_corrupt_object_hands_out_nothing(tmp_path):
    url = _whole_chunk_repo(tmp_path)
    mapped = Repository(url, options={"mapped_reads": True})
    t = mapped.manifest(1).tensors["x"]
    path = os.path.join(url, t.array.path, t.shards.key[1])
    mapped.open(1).read_boxes([("x", Box((32, 0), (32, 32)))])  # the control: intact, mapped
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError) as e:
        mapped.open(1).read_boxes([("x", Box((32, 0), (32, 32)))])
    assert e.value.key == "x" and t.shards.key[1] in str(e.value.object)


def test_a_manifests_folder_that_is_a_link_is_refused_at_listing(tmp_path):
    """FORMAT.md 4.2, 9 step 1 (issue 47 item 14.3): a repository whose ``manifests/`` is a link
    (to another repository's, byte for byte the same) is refused when its steps are listed, with
    a StorageError naming the link, not listed and then refused step by step. Control: the other
    repository, whose ``manifests/`` is a real folder, lists its step."""
    repo, url = _repo("positional", tmp_path)
    other = str(tmp_path / "other")
    shutil.copytree(url, other)
    _link_into(other, url, "manifests/")
    for listing in (Repository(url).steps, Repository(url).latest, Repository(url).foreign_manifests):
        with pytest.raises(StorageError) as e:
            listing()
        assert e.value.object == "manifests/" and e.value.found == "manifests/ a symbolic link"
    assert Repository(other).steps() == [1]  # control


@pytest.mark.parametrize("swapped", ["object", "directory"])
def test_a_link_swapped_in_after_the_check_is_refused_by_the_open(tmp_path, swapped):
    """FORMAT.md 9 step 4 (issue 47 item 14.4): the open itself does not follow a link (openat with
    O_NOFOLLOW per component), so an object, or a directory on its way, replaced by a link to an
    identical copy after :meth:`check_no_links` passed is still refused, for positional opens and
    whole reads alike. Control: the same calls on the regular file read its bytes."""
    repo, url = _repo("positional", tmp_path)
    m = repo.manifest(1)
    st = repo.storage
    key = m.tensors["x"].object_key(0)
    checked: set[str] = set()
    st.check_no_links(key, checked)
    f = st.open_positional(key, tensor="x")  # control: the regular file opens
    assert f.size == m.tensors["x"].shards.nbytes[0]
    f.close()
    assert st.read(key) == Path(url, key).read_bytes()
    other = str(tmp_path / "other")
    shutil.copytree(url, other)
    rel = key if swapped == "object" else key[:key.rfind("/") + 1]
    _link_into(other, url, rel)  # after the check: the set still says every directory is plain
    for op in (lambda: st.open_positional(key, tensor="x"), lambda: st.read(key)):
        with pytest.raises(StorageError) as e:
            op()
        assert e.value.object == key and "symbolic link" in str(e.value.found)


def test_a_checkpoint_is_freed_when_its_last_reference_goes(tmp_path):
    """The local read and verify objects a Checkpoint holds take its storage, manifest, stats,
    checks and caches, never the checkpoint itself: after a read and a verify, dropping the
    checkpoint frees it (and its manifest) at once, without waiting for the cycle collector."""
    url = str(tmp_path / "r")
    v = _one_vector(url)
    ck = Repository(url).open(1)
    assert np.array_equal(ck.read("v"), v) and ck.verify() > 0
    gone = weakref.ref(ck)
    was = gc.isenabled()
    gc.disable()
    try:
        del ck
        assert gone() is None
    finally:
        if was:
            gc.enable()


# ------------------------------------------------------------------ reading into the caller's arrays (issue 50)


@pytest.mark.parametrize("where", ["positional", "tensorstore", "mapped"])
def test_read_boxes_into_views_of_one_output_checks_every_byte(tmp_path, where):
    """``read_boxes(out=...)`` fills views of one larger array (a column cut: not contiguous), each
    checked as a fresh read is; a flipped byte raises; an output of another shape is refused."""
    url = _whole_chunk_repo(tmp_path) if where == "mapped" else _repo(where, tmp_path)[1]
    repo = Repository(url, options={"mapped_reads": True} if where == "mapped" else
                      {"positional_reads": where != "tensorstore"})
    whole = np.full((64, 32), -1.0, dtype=np.float32)
    reqs = [("x", Box((0, 0), (32, 32))), ("x", Box((32, 0), (32, 16))), ("x", Box((32, 16), (32, 16)))]
    views = [whole[:32], whole[32:, :16], whole[32:, 16:]]
    got = repo.open(1).read_boxes(reqs, out=views)
    assert all(g is v for g, v in zip(got, views)) and np.array_equal(whole, X)
    with pytest.raises(ckptfmt.errors.InvalidStateError):  # an output that is not the request's shape
        repo.open(1).read_boxes(reqs[:1], out=[whole[:16]])
    t = repo.manifest(1).tensors["x"]
    path = os.path.join(url, t.array.path, t.shards.key[1])
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError):
        repo.open(1).read_boxes(reqs[1:], out=views[1:])


@pytest.mark.parametrize("where", ["positional", "tensorstore"])
def test_read_chunks_into_buffers_checks_what_it_read(tmp_path, where):
    """``read_chunks(into=...)`` reads each stored chunk into the caller's buffer (straight from
    the file, or copied from a store's read) and checks it there: the same bytes as a fresh read
    (the control); a flipped byte raises; a buffer of another length is refused before anything
    is read."""
    repo, url = _repo(where, tmp_path)
    ckpt = repo.open(1)
    refs = ckpt.chunk_refs([("x", Box((0, 0), (64, 32)))])
    fresh = ckpt.read_chunks(refs)
    body = np.zeros(sum(ckpt.chunk_nbytes(r) for r in refs), dtype=np.uint8)
    bufs, at = [], 0
    for r in refs:
        bufs.append(body[at:at + ckpt.chunk_nbytes(r)])
        at += ckpt.chunk_nbytes(r)
    got = ckpt.read_chunks(refs, into=bufs)
    assert all(np.shares_memory(g, body) and np.array_equal(g, f) for g, f in zip(got, fresh))
    with pytest.raises(ckptfmt.errors.InvalidStateError):
        ckpt.read_chunks(refs[:1], into=[bufs[0][:-1]])
    t = repo.manifest(1).tensors["x"]
    with open(os.path.join(url, t.array.path, t.shards.key[0]), "r+b") as f:
        f.write(bytes([f.read(1)[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError):
        Repository(url, options={"positional_reads": where != "tensorstore"}).open(1).read_chunks(refs, into=bufs)
