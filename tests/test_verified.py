"""Retention never deletes on unread bytes (FORMAT.md 10.4, 14.7; issue 24 item 1).

A step is deleted by retention only while a newer kept step has been verified byte for byte; the
verification record that makes this cheap is trusted only while everything it binds still
matches. Real files, memory and S3 (tests/test_s3.py runs the ``repo_url`` tests again there);
each check beside its broken control.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from ckptfmt import Box, LocalShard, Repository, save
from ckptfmt.repository import _gc, _verified
from ckptfmt.repository._verified import record_key, unverified
from ckptfmt.errors import ChecksumMismatchError
from ckptfmt.layout import manifest_key
from ckptfmt.manager import CheckpointManager
from ckptfmt.storage import DelegatingStorage, open_storage


def shards(value: int) -> list[LocalShard]:
    x = (np.arange(16 * 4, dtype=np.float32) + value).reshape(16, 4)
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


def flip(r: Repository, step: int) -> None:
    """One bit of the first chunk's data of ``step``'s first shard, the size unchanged, written
    through the store (as any process that can write the repository could)."""
    t = r.manifest(step).tensors["x"]
    key = t.object_key(0)
    data = bytearray(r.storage.read(key))
    data[int(t.chunks.offset[int(t.chunk_start[0])]) + 5] ^= 0x10
    r.storage.write(key, bytes(data))


class FrozenStamps(DelegatingStorage):
    """Broken: a store whose stamps never change, so a record outlives a write."""

    def stamps(self, objects: Any) -> list[str] | None:
        return ["same"] * len(objects)


class CountingReads(DelegatingStorage):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reads = 0

    def read_range(self, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> Any:
        self.reads += 1
        return super().read_range(key, start, stop, tensor=tensor)

    def open_positional(self, key: str, *, tensor: str | None = None) -> Any:
        self.reads += 1
        return super().open_positional(key, tensor=tensor)


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    p = subprocess.run([sys.executable, "-m", "ckptfmt", *args, "--json"], capture_output=True, text=True, timeout=300)
    return p.returncode, json.loads(p.stdout)


def test_cli_gc_keeps_the_only_good_step_when_the_newest_has_a_flipped_bit(tmp_path):
    for broken in (False, True):
        url = str(tmp_path / f"r{int(broken)}")
        for s in (1, 2):
            save(url, s, shards(s))
        flip(Repository(url), 2)
        if not broken:
            rc, out = _cli("gc", url, "--keep-last", "1")
            assert rc == 0 and out["report"]["removed_steps"] == []
            assert any("step 2 is not restorable (fails verification: ChecksumMismatchError" in p
                       for p in out["report"]["problems"])
        else:  # broken control: retention that reads nothing deletes the only good step
            class ReadsNothing(_gc.GcChecks):
                def unverified(self, repo, step, **kw):
                    return None

            assert _gc.collect(Repository(url), keep_last=1, grace_s=None, keep_every=None,
                               checks=ReadsNothing()).removed_steps == [1]
        rc, out = _cli("verify", url, "--all")
        assert rc != 0 and [s["step"] for s in out["steps"] if s["ok"]] == ([] if broken else [1])


def test_the_record_binds_the_manifest_and_every_object_and_is_paid_once(repo_url):
    r = Repository(repo_url)
    for s in (1, 2, 3, 4):
        save(r, s, shards(s))
    assert r.gc(keep_last=3).removed_steps == [1]
    m4 = r.manifest(4)
    raw = r.storage.read(record_key(m4.save_id))
    assert raw.endswith(b"}\n") and b", " not in raw and b": " not in raw  # canonical JSON (FORMAT.md 10.4, 5.1)
    doc = json.loads(raw)
    assert set(doc) == {"format", "step", "save_id", "manifest_sha256", "stamps_sha256", "verified_unix", "bytes"}
    assert (doc["format"], doc["step"], doc["save_id"]) == ("ckptfmt.verified", 4, m4.save_id)
    assert doc["manifest_sha256"] == hashlib.sha256(r.storage.read(manifest_key(4))).hexdigest()
    assert doc["bytes"] == r.verify(4)
    counting = CountingReads(open_storage(repo_url))
    assert Repository(repo_url, storage=counting).gc(keep_last=2).removed_steps == [2]
    assert counting.reads == 0  # step 4's record licensed it (step 3 stays older): no shard was read
    # A deletion that would leave no step older than step 4 reads it once more, record or not.
    counting = CountingReads(open_storage(repo_url))
    assert Repository(repo_url, storage=counting).gc(keep_last=1).removed_steps == [3] and counting.reads > 0
    # Control: without the record the first kind of decision reads every shard of the step too.
    r.storage.delete(record_key(m4.save_id))
    save(r, 5, shards(5))
    counting = CountingReads(open_storage(repo_url))
    assert Repository(repo_url, storage=counting).gc(keep_last=2).removed_steps == [] and counting.reads == 0
    save(r, 6, shards(6))
    counting = CountingReads(open_storage(repo_url))
    assert Repository(repo_url, storage=counting).gc(keep_last=2).removed_steps == [4] and counting.reads > 0


@pytest.mark.parametrize("stamps", ["bound", "frozen (control)"])
def test_a_stale_record_never_deletes_the_only_good_step(repo_url, stamps):
    r = Repository(repo_url)
    for s in (1, 2, 3):
        save(r, s, shards(s))
    st = open_storage(repo_url) if stamps == "bound" else FrozenStamps(open_storage(repo_url))
    assert Repository(repo_url, storage=st).gc(keep_last=2).removed_steps == [1]  # verifies 3, records it
    flip(r, 3)                                                                     # after the record
    if stamps != "bound":
        assert unverified(Repository(repo_url, storage=st), 3) is None            # broken: still trusted
    report = Repository(repo_url, storage=st).gc(keep_last=1)
    if stamps == "bound":
        assert report.removed_steps == [] and r.steps() == [2, 3]
        assert any("step 3 is not restorable (fails verification" in p for p in report.problems)
        r.verify(2)
    else:  # the frozen stamps kept the stale record trusted; only the fresh read (10.4) saved step 2
        assert report.removed_steps == [] and r.steps() == [2, 3]
        assert any("record matches, but a fresh read fails" in p for p in report.problems), report.problems
        with pytest.raises(ChecksumMismatchError):
            r.verify(3)


def _hostile(r: Repository, step: int, how: str) -> None:
    m = r.manifest(step)
    good = json.loads(r.storage.read(record_key(m.save_id)))
    doc = dict(good)
    if how == "garbage":
        r.storage.write(record_key(m.save_id), b"\x00{not json")
        return
    if how == "oversized":
        doc["pad"] = "x" * 5000
    elif how == "other manifest":
        doc["manifest_sha256"] = "0" * 64
    elif how == "extra field":
        doc["trusted"] = True
    elif how == "future":
        doc["verified_unix"] = 1e12
    elif how == "other step":
        doc["step"] = step + 1
    r.storage.write(record_key(m.save_id), json.dumps(doc).encode())


@pytest.mark.parametrize("how", ["garbage", "oversized", "other manifest", "extra field", "future", "other step",
                                 "consistent forgery (control)"])
def test_a_hostile_record_never_causes_a_deletion(repo_url, how):
    r = Repository(repo_url)
    for s in (1, 2):
        save(r, s, shards(s))
    flip(r, 2)
    # The record a verifier would write for step 2's bytes as they are now (forged: they are bad).
    m = r.manifest(2)
    want = _verified._bindings(m, r.storage.read(manifest_key(2)), r.storage.stamps(_verified._objects(m)))
    r.storage.write(record_key(m.save_id), json.dumps(dict(want, verified_unix=0.0, bytes=1)).encode())
    if how != "consistent forgery (control)":
        _hostile(r, 2, how)
        assert r.gc(keep_last=1).removed_steps == [] and r.steps() == [1, 2]
        r.verify(1)
        assert unverified(r, 2) is not None
    else:  # not authenticated: whoever can write the repository can forge one (FORMAT.md 10.4) ...
        report = r.gc(keep_last=1)  # ... but a deletion that would leave no older step reads it again
        assert report.removed_steps == [] and r.steps() == [1, 2]
        assert any("record matches, but a fresh read fails" in p for p in report.problems), report.problems
        save(r, 3, shards(3))  # where an older step stays (keep_last=2 keeps step 2), the forgery licenses
        st3 = r.manifest(3)
        flip(r, 3)
        want = _verified._bindings(st3, r.storage.read(manifest_key(3)), r.storage.stamps(_verified._objects(st3)))
        r.storage.write(record_key(st3.save_id), json.dumps(dict(want, verified_unix=0.0, bytes=1)).encode())
        assert r.gc(keep_last=2).removed_steps == [1]


class SizeMtimeStamps(DelegatingStorage):
    """A store whose stamp is an object's size and modification time (no change time, no
    generation): bytes that change under the same size and mtime keep the stamp, as a medium that
    decays does under any store's stamp."""

    def stamps(self, objects: Any) -> list[str] | None:
        import os

        root = self.inner.root
        return [f"{os.stat(root + k).st_size}:{os.stat(root + k).st_mtime_ns}" for k, _ in objects]


def rot(r: Repository, step: int) -> None:
    """One byte of ``step``'s first chunk changed in place: the same size, the mtime put back."""
    import os

    t = r.manifest(step).tensors["x"]
    path = os.path.join(r.url, t.object_key(0))
    st = os.stat(path)
    with open(path, "r+b") as f:
        at = int(t.chunks.offset[int(t.chunk_start[0])]) + 5
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("rotted", [True, False])
def test_rot_under_an_unchanged_stamp_never_leaves_only_the_rotted_step(tmp_path, rotted):
    """Issue 47 item 13. Step 3 is verified and recorded by a first gc; then one of its bytes rots
    under an unchanged stamp. ``gc(keep_last=1)`` would delete step 2, the last older step: it
    reads step 3 again first, ignoring the record, finds the rot, keeps step 2 and reports it.
    The control: without the rot the same gc deletes step 2 as before."""
    url = str(tmp_path / "r")
    for s in (1, 2, 3):
        save(url, s, shards(s))
    repo = Repository(url, storage=SizeMtimeStamps(open_storage(url)))
    assert repo.gc(keep_last=2).removed_steps == [1]            # verifies step 3, records it
    if rotted:
        rot(repo, 3)
    assert unverified(repo, 3) is None                          # the record still matches (unchanged stamp)
    report = repo.gc(keep_last=1)
    if rotted:
        assert report.removed_steps == [] and repo.steps() == [2, 3], report
        assert any("step 3 is not restorable" in p and "fresh read fails: ChecksumMismatchError" in p
                   for p in report.problems), report.problems
        Repository(url).verify(2)
        with pytest.raises(ChecksumMismatchError):
            Repository(url).verify(3)
    else:
        assert report.removed_steps == [2] and repo.steps() == [3] and report.problems == [], report


def test_delete_removes_the_record_even_when_the_objects_stay(repo_url):
    r = Repository(repo_url)
    save(r, 1, shards(1))
    save(r, 2, shards(1))                     # references step 1's objects
    sid1, sid2 = r.manifest(1).save_id, r.manifest(2).save_id
    assert sid1 in r.manifest(2).referenced_saves
    assert unverified(r, 1) is None and unverified(r, 2) is None
    r.delete(1)
    assert r.storage.read(record_key(sid1)) is None       # the record went with its step
    assert r.storage.list(f"saves/{sid1}/p/")              # ... while step 2 keeps the objects (its pack)
    assert r.storage.read(record_key(sid2)) is not None   # control: step 2's record stays
    r.verify(2)


@pytest.mark.parametrize("stamps", ["bound", "frozen (control)"])
def test_the_manager_notices_a_flip_after_its_step_was_verified(tmp_path, stamps):
    url = str(tmp_path / "r")
    for s in (1, 2):
        save(url, s, shards(s))
    repo = Repository(url) if stamps == "bound" else Repository(url, storage=FrozenStamps(open_storage(url)))
    assert unverified(repo, 2) is None                     # verified once, and recorded
    flip(repo, 2)
    with CheckpointManager(url, keep_last=1, async_save=False) as m:
        m.repository = repo
        m._retain()                                        # the next retention decision
    steps = Repository(url).steps()
    assert steps == ([1, 2] if stamps == "bound" else [2])
    if stamps == "bound":
        Repository(url).verify(1)


def big_shards(value: int) -> list[LocalShard]:
    """1 MiB: read through O_DIRECT into the repository's kept buffers."""
    x = (np.arange(512 * 512, dtype=np.float32) + value).reshape(512, 512)
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


def flip_big(r: Repository, step: int) -> None:
    t = r.manifest(step).tensors["x"]
    key = t.object_key(0)
    data = bytearray(r.storage.read(key))
    data[int(t.chunks.offset[int(t.chunk_start[0])]) + 4096 + 5] ^= 0x10
    r.storage.write(key, bytes(data))


@pytest.mark.parametrize("flipped", [True, False])
def test_kept_read_buffers_never_pass_a_flipped_bit(tmp_path, flipped):
    """A repository keeps its verify buffers between verifications; a buffer that held the good
    bytes of an object must never let the same object pass once one of its bits is flipped (the
    control: the unflipped object verifies again through the same, reused buffer)."""
    r = Repository(str(tmp_path / "r"))
    save(r, 1, big_shards(1))
    assert r.verify(1) > 0
    kept = r._read_buffers.kept_bytes
    assert kept >= 1 << 20  # the buffer stayed for the next verification
    if flipped:
        flip_big(r, 1)
        with pytest.raises(ChecksumMismatchError) as e:
            r.verify(1)
        assert e.value.key == "x"
    else:
        assert r.verify(1) > 0
    assert r._read_buffers.kept_bytes == kept  # the same buffer taken and given back, none added


def test_read_buffers_keep_at_most_their_cap():
    from ckptfmt.reader._verifylocal import ReadBuffers

    b = ReadBuffers(keep_bytes=3 << 20)
    one, two = b.take(2 << 20), b.take(2 << 20)
    assert one.ctypes.data % 4096 == 0 and one.size >= 2 << 20  # page aligned, for O_DIRECT
    b.give(one)
    b.give(two)  # over the cap: dropped
    assert b.kept_bytes == one.size
    again = b.take(1 << 20)  # the smallest kept buffer that fits: the one kept
    assert again.ctypes.data == one.ctypes.data and b.kept_bytes == 0
    assert b.take(1 << 20).ctypes.data != one.ctypes.data  # nothing kept: a new one


def test_read_buffers_of_many_sizes_are_taken_by_position():
    """Buffers of different sizes in the free list (a regression: taking one compared arrays)."""
    from ckptfmt.reader._verifylocal import ReadBuffers

    b = ReadBuffers()
    bufs = [b.take(n) for n in (56, 152, 4096, 56)]
    for x in bufs:
        b.give(x)
    got = b.take(100)
    assert got.size >= 100 and any(got.ctypes.data == x.ctypes.data for x in bufs)
    assert b.kept_bytes == sum(x.size for x in bufs) - got.size


def _verify_threads() -> set[int]:
    import threading

    return {t.native_id for t in threading.enumerate() if t.name.startswith("ckptfmt-verify")}


def test_verifications_share_the_process_verify_threads_and_a_fault_still_surfaces(tmp_path):
    """Verify threads are started once per process and kept (a manager verifies after every save;
    starting 16 threads each time took CPU from training). A verification that fails raises its
    fault with the shared threads, and the next one (the control: good bytes) still passes on the
    same threads."""
    from ckptfmt.reader._verifylocal import VERIFY_THREADS

    r = Repository(str(tmp_path / "r"))
    for step in (1, 2):  # different bytes: step 2 does not reuse step 1's objects
        save(r, step, [LocalShard(f"x{i}", (256, 256), np.float32, Box((0, 0), (256, 256)),
                                  np.full((256, 256), i + 100 * step, np.float32)) for i in range(20)])
    assert r.verify(1) > 0
    threads = _verify_threads()
    assert 1 <= len(threads) <= VERIFY_THREADS  # alive after the verification returned
    t = r.manifest(2).tensors["x7"]
    data = bytearray(r.storage.read(t.object_key(0)))
    data[t.shard_start(0) + int(t.chunks.offset[int(t.chunk_start[0])]) + 100] ^= 0x01
    r.storage.write(t.object_key(0), bytes(data))
    with pytest.raises(ChecksumMismatchError) as e:
        r.verify(2)
    assert e.value.key == "x7"
    assert r.verify(1) > 0
    after = _verify_threads()  # the same threads kept (the pool may have grown to its cap)
    assert threads <= after and len(after) <= VERIFY_THREADS
