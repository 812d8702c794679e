"""One conformance suite for every storage backend (file, memory, S3 on a local moto server, and a
DelegatingStorage wrapped around the file backend): what the save, restore and gc protocols rely
on. Every rejection below has its accepted control next to it."""
from __future__ import annotations

import os
import threading
import uuid

import pytest

from ckptfmt import Repository
from ckptfmt.storage._kvstore import classify
from ckptfmt.errors import MissingShardError, SizeMismatchError, StorageError
from ckptfmt.storage import NO_VALUE, DelegatingStorage, Storage, open_storage
from s3server import s3_env, s3_server  # noqa: F401  (pytest fixtures)

BACKENDS = ["file", "memory", "s3", "delegating"]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> Storage:
    if request.param == "s3":
        env = request.getfixturevalue("s3_env")
        return open_storage(env.url(f"conf-{uuid.uuid4().hex[:8]}"))
    if request.param == "memory":
        return open_storage(f"memory://conf-{uuid.uuid4().hex}")
    st = open_storage(str(tmp_path / "repo"))
    return DelegatingStorage(st) if request.param == "delegating" else st


def test_write_read_and_missing(store):
    store.write("a/x", b"hello")
    store.write_many([("a/y", b"1"), ("b/z", b"22")])
    assert store.read("a/x") == b"hello" and store.read("b/z") == b"22"
    assert store.read("a/none") is None
    (value, gen), (absent, no_gen) = store.read_with_generation(["a/x", "a/none"])
    assert value == b"hello" and gen and absent is None


def test_write_object_from_buffers(store):
    """The save's one write path: an object from a list of buffers (bytes, a memoryview, a numpy
    view), its stored length returned, replaced whole by a later write, durable after sync."""
    import numpy as np

    chunk = np.arange(6, dtype=np.uint8).reshape(2, 3)[:, 1:]  # a strided source: copied by the caller
    n = store.write_object("saves/s/t/0/c/0", [b"ab", memoryview(b"cd"), np.ascontiguousarray(chunk).reshape(-1)],
                           tensor="w")
    store.sync("saves/s/")
    assert n == 8 and store.read("saves/s/t/0/c/0") == b"abcd" + bytes([1, 2, 4, 5])
    assert store.write_object("saves/s/t/0/c/0", [b"xyz"]) == 3  # control: it replaces, never appends
    store.sync("saves/s/")
    assert store.read("saves/s/t/0/c/0") == b"xyz" and store.list("saves/s/") == ["saves/s/t/0/c/0"]


def test_bounded_whole_reads(store):
    store.write("k", b"0123456789")
    assert store.read("k", max_bytes=4) == b"01234"          # at most max_bytes + 1
    assert store.read("k", max_bytes=100) == b"0123456789"   # control: shorter than the bound
    assert store.larger_than("k", 9) is True and store.larger_than("k", 10) is False
    assert store.larger_than("none", 3) is None
    got = store.read_each_with_generation(["k", "none"], 4)
    assert got[0][0] == b"01234" and got[1][0] is None


def test_read_upto(store):
    store.write("k", b"0123456789")
    assert store.read_upto("k", 2, 3) == b"234"
    assert store.read_upto("k", 8, 5) == b"89"     # the rest is shorter than n
    assert store.read_upto("k", 12, 5) == b""      # it ends before start
    assert store.read_upto("none", 0, 5) is None


def test_conditional_create_is_the_commit_primitive(store):
    assert store.create_if_absent("manifests/1.json", b"A")
    assert not store.create_if_absent("manifests/1.json", b"B")
    assert store.read("manifests/1.json") == b"A"
    store.write("manifests/1.json", b"C")  # control: a plain write does overwrite
    assert store.read("manifests/1.json") == b"C"


def test_concurrent_conditional_creates_have_one_winner(store):
    won, start = [], threading.Barrier(4)

    def racer(i: int) -> None:
        start.wait()
        if store.create_if_absent("race", str(i).encode()):
            won.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and store.read("race") == str(won[0]).encode()


def test_write_if_generations(store):
    g1 = store.write_if("LEASE", b"v1", NO_VALUE)
    assert g1 and not store.write_if("LEASE", b"again", NO_VALUE)        # only if absent
    g2 = store.write_if("LEASE", b"v2", g1)
    assert g2 and g2 != g1 and store.read("LEASE") == b"v2"
    assert not store.write_if("LEASE", b"stale", g1)                      # a stale generation loses
    assert store.read_with_generation(["LEASE"])[0] == (b"v2", g2)
    assert not store.write_if("LEASE", None, g1) and store.read("LEASE") == b"v2"
    assert store.write_if("LEASE", None, g2) and store.read("LEASE") is None  # conditional delete


def test_delete_and_delete_prefix(store):
    for k in ("saves/a/t/0", "saves/a/LEASE", "saves/ab/t/0", "saves/b/x", "top"):
        store.write(k, b"x")
    store.delete("top")
    store.delete("never-there")  # deleting an absent key is not an error
    store.delete_prefix("saves/a/")
    assert store.list("saves/") == ["saves/ab/t/0", "saves/b/x"]  # "saves/ab/" is not under "saves/a/"
    with pytest.raises(StorageError):
        store.delete_prefix("saves/b")                            # not a folder prefix
    with pytest.raises(StorageError):
        store.delete_prefix("/")
    assert store.read("saves/b/x") == b"x"


def test_list_is_sorted_and_bounded_by_its_prefix(store):
    for k in ("m/2", "m/10", "m/1", "mm/1", "n"):
        store.write(k, b"")
    assert store.list("m/") == ["m/1", "m/10", "m/2"]
    assert store.list() == ["m/1", "m/10", "m/2", "mm/1", "n"]
    assert store.list("none/") == []


def test_ranged_reads_of_objects_a_manifest_names(store):
    store.write("obj", b"0123456789")
    assert store.read_range("obj", 2, 6).result() == b"2345"
    assert store.read_range("obj", 6, None).result() == b"6789"
    with pytest.raises(SizeMismatchError):
        store.read_range("obj", 8, 12).result()                   # past the end
    with pytest.raises(MissingShardError):
        store.read_range("none", 0, 4, tensor="w").result()


@pytest.mark.parametrize("size, error", [(10, None), (11, SizeMismatchError), (9, SizeMismatchError)])
def test_size_check_with_the_ranges_catches_any_other_length(store, size, error):
    store.write("obj", b"x" * size)

    def check() -> bytes:  # what a reader does: the size check and its ranges, which end at nbytes
        probe = store.size_check("obj", 10, tensor="w")
        data = store.read_range("obj", 0, 10, tensor="w")
        probe.result()
        return data.result()

    if error is None:
        assert check() == b"x" * 10
    else:
        with pytest.raises(error):
            check()
    with pytest.raises(MissingShardError):
        store.size_check("none", 10).result()


def test_size_faults(store):
    store.write("ok", b"x" * 4)
    store.write("short", b"x" * 3)
    store.write("long", b"x" * 5)
    faults = store.size_faults([("ok", 4), ("short", 4), ("long", 4), ("none", 4)])
    assert [f.split(":")[0] for f in faults] == ["short", "long", "none"]
    assert store.size_faults([("ok", 4)]) == []


def test_scan_children(store):
    store.write("saves/s1/LEASE", b"{}")
    store.write("saves/s1/t/0", b"x")
    store.write("saves/s2/t/0", b"x")
    store.write("saves/stray", b"x")
    got = {e.name: e for e in store.scan_children("saves/", marker="LEASE")}
    assert sorted(got) == ["s1", "s2", "stray"]
    assert (got["s1"].kind, got["s1"].objects, got["s1"].marker) == ("dir", 2, "file")
    assert (got["s2"].kind, got["s2"].marker) == ("dir", None) and got["stray"].kind == "file"
    assert store.scan_children("saves/")[0].marker is None  # the store looks for nothing unless told
    assert store.scan_children("nothing/") == [] and store.plain_dir("nothing/")
    shallow = {e.name: e for e in store.scan_children("saves/", marker="LEASE", deep=False)}
    assert {n: (e.kind, e.marker, e.error) for n, e in shallow.items()} == {
        "s1": ("dir", "file", None), "s2": ("dir", None, None), "stray": ("file", None, None)}


def test_shallow_scan_judges_markers_without_following_links(tmp_path):
    """``deep=False`` reads a folder's marker and nothing else below it: no object count, no age;
    a marker that is a link is reported as one (a lease pins nothing through a link), a folder
    that is a link is never entered. The deep scan is the control: same kinds and markers."""
    st = open_storage(str(tmp_path / "repo"))
    st.write("saves/a/LEASE", b"{}")
    st.write("saves/a/t/0/c/0", b"x")
    st.write("saves/b/t/0", b"x")
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "LEASE").write_bytes(b"{}")
    os.makedirs(tmp_path / "repo" / "saves" / "c")
    os.symlink(outside / "d" / "LEASE", tmp_path / "repo" / "saves" / "c" / "LEASE")
    os.symlink(outside / "d", tmp_path / "repo" / "saves" / "lnk")
    deep = {e.name: e for e in st.scan_children("saves/", marker="LEASE")}
    shallow = {e.name: e for e in st.scan_children("saves/", marker="LEASE", deep=False)}
    assert {n: (e.kind, e.marker) for n, e in shallow.items()} == {n: (e.kind, e.marker) for n, e in deep.items()} == {
        "a": ("dir", "file"), "b": ("dir", None), "c": ("dir", "link"), "lnk": ("link", None)}
    assert deep["a"].objects == 2 and deep["a"].newest_mtime is not None  # control: the deep scan counts
    assert shallow["a"].objects == 0 and shallow["a"].newest_mtime is None


def test_positional_reads_only_where_offered(store):
    store.write("obj", b"0123456789")
    if not store.positional_reads:
        with pytest.raises(StorageError):
            store.open_positional("obj")
        return
    buf, tail = bytearray(4), bytearray(2)
    with store.open_positional("obj", tensor="w") as f:
        assert f.size == 10
        f.read_into([buf, tail], 2)
        with pytest.raises(SizeMismatchError):
            f.read_into([bytearray(4)], 8)
    assert bytes(buf + tail) == b"234567"
    with pytest.raises(MissingShardError):
        store.open_positional("none")


def test_special_files_are_refused_without_blocking(tmp_path):
    st = open_storage(str(tmp_path / "repo"))
    st.write("ok", b"x")
    os.mkfifo(tmp_path / "repo" / "fifo")
    for call in (lambda: st.read("fifo"), lambda: st.larger_than("fifo", 0), lambda: st.size_check("fifo", 1),
                 lambda: st.open_positional("fifo"), lambda: st.read_with_generation(["fifo"])):
        with pytest.raises(StorageError, match="regular file"):
            call()
    assert st.size_faults([("fifo", 1)]) == ["fifo: not a file bytes, expected 1"]
    assert st.read("ok") == b"x"  # control


def test_links_are_never_followed_by_deletes(tmp_path):
    st = open_storage(str(tmp_path / "repo"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    st.write("saves/real/x", b"x")
    os.symlink(outside, tmp_path / "repo" / "saves" / "evil")
    st.delete_prefix("saves/evil/")
    assert (outside / "keep").read_bytes() == b"k" and not (tmp_path / "repo" / "saves" / "evil").exists()
    assert [e.kind for e in st.scan_children("saves/")] == ["dir"]
    st.delete_prefix("saves/real/")  # control: a real folder goes
    assert st.list("saves/") == []


def test_file_without_positional_reads_keeps_its_safety_checks(tmp_path):
    st = open_storage(str(tmp_path / "repo"), {"positional_reads": False})
    assert not st.positional_reads
    os.makedirs(tmp_path / "repo")
    os.mkfifo(tmp_path / "repo" / "fifo")
    with pytest.raises(StorageError, match="regular file"):
        st.read("fifo")


def test_repository_takes_any_storage(tmp_path):
    """The seam for fault injection: a wrapper that changes one call, no patching."""

    class NoCreate(DelegatingStorage):
        def create_if_absent(self, key: str, data: bytes) -> bool:
            raise StorageError("injected", object=key)

    import numpy as np
    from ckptfmt import Box, LocalShard, save

    url = str(tmp_path / "repo")
    x = np.arange(4, dtype=np.float32)
    shard = [LocalShard("x", x.shape, x.dtype, Box((0,), (4,)), x)]
    repo = Repository(url, storage=NoCreate(open_storage(url)))
    with pytest.raises(StorageError):
        save(repo, 1, shard)
    assert Repository(url).steps() == []
    save(Repository(url, storage=DelegatingStorage(open_storage(url))), 1, shard)  # control
    assert Repository(url).steps() == [1]
    with pytest.raises(ValueError):
        Repository(url, options={}, storage=open_storage(url))


@pytest.mark.parametrize("text, kind", [
    ("OUT_OF_RANGE: Requested byte range [4, 8) is not valid for value of size 2", "out_of_range"),
    ("OUT_OF_RANGE: Failed to write 37976 bytes to file 3: File too large [os_error_code='27']", "too_large"),
    ("UNKNOWN: Error writing local file: No space left on device [os_error_code='28']", "no_space"),
    ("PERMISSION_DENIED: Error opening file: Permission denied", "permission"),
    ("NOT_FOUND: Error opening file", "not_found"),
    ("UNAVAILABLE: connection refused", "unreachable"),
    ("ABORTED: All 6 retry attempts failed: CURL error Could not resolve hostname", "unreachable"),
    ("DATA_LOSS: Digest mismatch", "other"),
])
def test_tensorstore_errors_are_classified_in_one_place(text, kind):
    assert classify(ValueError(text)) == kind
    # Issue 52: the message says what to do next for the kinds a user can act on; control: "other" adds nothing.
    from ckptfmt.storage._kverrors import storage_error

    message = storage_error("list failed", ValueError(text), object="manifests/").message
    assert (": " in message) == (kind in ("no_space", "too_large", "permission", "unreachable")), message


_READ_PEAK = r"""
import json, os, sys
from ckptfmt.storage import open_storage
from ckptfmt.storage._kvstore import KvStoreStorage
root, via = sys.argv[1], sys.argv[2]
store = open_storage(root)
def status(field):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = status("VmRSS")
data = (KvStoreStorage.read if via == "kvstore" else type(store).read)(store, "big", max_bytes=64 << 20)
print(json.dumps({"n": len(data), "rise": status("VmHWM") - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_a_local_whole_read_holds_the_object_once(tmp_path):
    """A manifest at its size cap costs the cap in memory once (a hostile input costs at most its
    cap): the local store reads a whole object into the returned bytes. Control: the kvstore read
    of the same 48 MiB peaks near 3x its size, which this measurement sees."""
    import json
    import subprocess
    import sys

    size = 48 << 20
    (tmp_path / "big").write_bytes(os.urandom(size))
    rise = {}
    for via in ("local", "kvstore"):
        out = subprocess.run([sys.executable, "-c", _READ_PEAK, str(tmp_path), via], capture_output=True, text=True,
                             timeout=120, check=True)
        got = json.loads(out.stdout)
        assert got["n"] == size
        rise[via] = got["rise"]
    assert rise["local"] < 1.4 * size, rise
    assert rise["kvstore"] > 2 * size, rise  # the broken control: the 3x buffer this read avoids
