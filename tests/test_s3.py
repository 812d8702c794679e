"""S3 conformance against a real local server (moto_server on 127.0.0.1).

Part 1 checks, at the kvstore level, the guarantees the commit protocol relies on
(spec: docs/OBJECT_STORAGE.md): conditional create, read-after-write, prefix listing.
Part 2 runs the library's save / restore / fault / gc checks on an s3:// repository.
Every fault test has a broken control.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import ckptfmt
from ckptfmt import Box, LocalShard
from ckptfmt.storage._kvurl import kvstore_spec
from ckptfmt.errors import (ChecksumMismatchError, CheckpointError, MissingShardError, SizeMismatchError,
                            StepAlreadyCommittedError, StepNotFoundError, StorageError)
from ckptfmt.manifest import MARKER_BYTES
from ckptfmt.storage import open_storage
from s3server import FaultProxy, S3Env, s3_env, s3_server  # noqa: F401  (pytest fixtures)

NO_VALUE = b"\x02"  # tensorstore's "no value" generation: write only if absent


def _kv(env: S3Env, prefix: str = "repo", endpoint: str | None = None) -> ts.KvStore:
    opts = {"endpoint": endpoint} if endpoint else None
    return ts.KvStore.open(kvstore_spec(env.url(prefix), opts), context=ts.Context()).result()


# =================================================================== part 1: kvstore level
def test_conditional_create_second_write_loses(s3_env):
    kv = _kv(s3_env)
    first = kv.write("manifests/00000000000000000001.json", b"A", if_equal=NO_VALUE).result()
    second = kv.write("manifests/00000000000000000001.json", b"B", if_equal=NO_VALUE).result()
    assert first.generation and second.generation == b""
    assert kv.read("manifests/00000000000000000001.json").result().value == b"A"
    # Broken control: an unconditional write does overwrite.
    assert kv.write("manifests/00000000000000000001.json", b"C").result().generation
    assert kv.read("manifests/00000000000000000001.json").result().value == b"C"


def test_conditional_create_is_enforced_by_the_server(s3_env):
    # tensorstore checks for the object (HEAD) before its PUT. Hide the object from that
    # check, as when another saver's PUT lands between our check and our PUT: the server
    # itself must refuse the PUT (If-None-Match: * -> 412), and tensorstore reports a lost race.
    kv = _kv(s3_env)
    assert kv.write("m/1.json", b"A", if_equal=NO_VALUE).result().generation
    with FaultProxy(s3_env.endpoint, hide="") as proxy:
        raced = _kv(s3_env, endpoint=proxy.endpoint)
        assert raced.write("m/1.json", b"B", if_equal=NO_VALUE).result().generation == b""
    assert kv.read("m/1.json").result().value == b"A"
    # Broken control: a store that ignores If-None-Match lets the second save overwrite.
    with FaultProxy(s3_env.endpoint, hide="", drop_conditions=True) as proxy:
        raced = _kv(s3_env, endpoint=proxy.endpoint)
        assert raced.write("m/1.json", b"B", if_equal=NO_VALUE).result().generation != b""
    assert kv.read("m/1.json").result().value == b"B"


def test_concurrent_conditional_creates_have_one_winner(s3_env):
    keys = [f"manifests/{i:020d}.json" for i in range(8)]
    stores = [_kv(s3_env), _kv(s3_env)]
    won: dict[int, list[str]] = {0: [], 1: []}
    start = threading.Barrier(2)

    def racer(who: int) -> None:
        start.wait()
        futs = [(k, stores[who].write(k, str(who).encode(), if_equal=NO_VALUE)) for k in keys]
        won[who] = [k for k, f in futs if f.result().generation]

    threads = [threading.Thread(target=racer, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(won[0] + won[1]) == keys  # every key exactly one winner
    for who in (0, 1):
        for k in won[who]:
            assert stores[1 - who].read(k).result().value == str(who).encode()


def test_read_and_list_after_write_and_delete(s3_env):
    kv, other = _kv(s3_env), _kv(s3_env)  # a second client sees what the first wrote, at once
    kv.write("saves/a/LEASE", b"lease").result()
    assert other.read("saves/a/LEASE").result().value == b"lease"
    assert other.list().result() == [b"saves/a/LEASE"]
    kv.write("saves/a/LEASE", None).result()
    assert other.read("saves/a/LEASE").result().state == "missing"
    assert other.list().result() == []


def test_prefix_list_returns_only_that_prefix(s3_env):
    kv = _kv(s3_env)
    for key in ("manifests/00000000000000000001.json", "manifests/00000000000000000002.json",
                "manifests-old/x", "manifests0", "manifestsz", "saves/s/LEASE", "manifest"):
        kv.write(key, b"x").result()
    _kv(s3_env, "repo-other").write("manifests/00000000000000000009.json", b"x").result()
    got = kv.list(ts.KvStore.KeyRange("manifests/", "manifests0")).result()
    assert sorted(got) == [b"manifests/00000000000000000001.json", b"manifests/00000000000000000002.json"]
    # Control: the unrestricted list does see the neighbours.
    assert len(kv.list().result()) == 7


def test_delete_range_removes_one_save_only(s3_env):
    kv = _kv(s3_env)
    for key in ("saves/a/t/000000/c/0", "saves/a/LEASE", "saves/ab/LEASE", "manifests/1.json"):
        kv.write(key, b"x").result()
    kv.delete_range(ts.KvStore.KeyRange("saves/a/", "saves/a0")).result()
    assert sorted(kv.list().result()) == [b"manifests/1.json", b"saves/ab/LEASE"]


def test_store_without_conditional_create_fails_closed(s3_env):
    # A store that rejects If-None-Match (501) makes the commit primitive raise StorageError:
    # the save fails, nothing is published. Control: the same call through no proxy succeeds.
    with FaultProxy(s3_env.endpoint, reject_conditions=True) as proxy:
        store = open_storage(s3_env.url(), {"kvstore": {"endpoint": proxy.endpoint}})
        with pytest.raises(StorageError):
            store.create_if_absent("manifests/00000000000000000001.json", b"{}")
    assert s3_env.keys() == []
    store = open_storage(s3_env.url())
    assert store.create_if_absent("manifests/00000000000000000001.json", b"{}") is True
    assert store.create_if_absent("manifests/00000000000000000001.json", b"{}") is False
    assert store.list("manifests/") == ["manifests/00000000000000000001.json"]


# =================================================================== part 2: the library on s3://
REPO_ROOT = Path(__file__).resolve().parents[1]
StaleShardError = getattr(ckptfmt, "StaleShardError", ChecksumMismatchError)


# The shared repository conformance suite (tests/test_repository.py, run there on file and
# memory) runs here again on S3: every test_* of that module, renamed test_conformance_*, with
# this module's repo_url fixture in place of conftest's.
@pytest.fixture
def repo_url(s3_env: S3Env) -> str:
    return s3_env.url("conformance")


def _inherit_conformance_suite() -> None:
    import test_repository

    for name, fn in vars(test_repository).items():
        if name.startswith("test_") and callable(fn):
            globals()["test_conformance_" + name[len("test_"):]] = fn


_inherit_conformance_suite()


def _inherit_gc_suite() -> None:
    """The storage-neutral gc checks of tests/test_gc.py, the races of tests/test_gc_races.py and
    the verification records of tests/test_verified.py (those taking ``repo_url``), on S3."""
    import inspect

    import test_gc
    import test_gc_races
    import test_verified

    for prefix, module in (("test_gc_", test_gc), ("test_gc_race_", test_gc_races),
                           ("test_verified_", test_verified)):
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn) and "repo_url" in inspect.signature(fn).parameters:
                globals()[prefix + name[len("test_"):]] = fn


_inherit_gc_suite()


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"params/dense/kernel": rng.standard_normal((64, 48), dtype=np.float32),
            "params/dense/bias": rng.integers(-9, 9, (64,), dtype=np.int32),
            "opt/count": np.array(7, dtype=np.int64)}


def _shards(arrays: dict[str, np.ndarray], rank: int = 0, world: int = 1, blocks: int = 4) -> list[LocalShard]:
    """Row blocks of every tensor; block b belongs to rank b % world. Scalars: replicated on every rank."""
    out = []
    for key, a in arrays.items():
        if a.ndim == 0:
            out.append(LocalShard(key, (), a.dtype.name, Box((), ()), a, replica_id=rank))
            continue
        rows = a.shape[0] // blocks
        for b in range(rank, blocks, world):
            box = Box((b * rows,) + (0,) * (a.ndim - 1), (rows,) + a.shape[1:])
            out.append(LocalShard(key, a.shape, a.dtype.name, box, a[box.slices()]))
    return out


def _save(url: str, step: int, arrays: dict[str, np.ndarray], **kw):
    return ckptfmt.save(url, step, _shards(arrays), **kw)


def _shard_objects(manifest, key: str) -> list[str]:
    t = manifest.tensors[key]
    return [f"repo/{t.object_key(i)}" for i in range(len(t.shards))]


def _restore_all(url: str, step: int | None = None) -> dict[str, np.ndarray]:
    ck = ckptfmt.Repository(url).open(step)
    return {k: ck.read(k) for k in ck.keys()}


def _child_env() -> dict[str, str]:
    env = dict(os.environ)  # carries the AWS_* of the s3_env fixture
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def test_save_then_restore_with_resharding(s3_env):
    arrays = _arrays()
    m = _save(s3_env.url(), 3, arrays, state={"step": 3, "cursor": {"epoch": 1, "sample": 4096}})
    repo = ckptfmt.Repository(s3_env.url())
    assert repo.steps() == [3] and repo.latest() == 3 and m.save_id in s3_env.keys("repo/saves/")[0]
    ck = repo.open()
    k = "params/dense/kernel"
    # Boxes that cut across the saved row blocks, as a restore onto another topology does.
    boxes = [Box((0, 0), (64, 24)), Box((0, 24), (64, 24)), Box((10, 5), (37, 30))]
    got = ck.read_boxes([(k, b) for b in boxes])
    for b, g in zip(boxes, got):
        np.testing.assert_array_equal(g, arrays[k][b.slices()])
    for key, a in arrays.items():
        np.testing.assert_array_equal(ck.read(key), a)
    assert ck.state() == {"step": 3, "cursor": {"epoch": 1, "sample": 4096}}
    assert repo.verify(3) > 0


@pytest.mark.parametrize("fault", ["missing", "truncated", "grown", "stale"])
def test_damaged_object_raises_typed_error(s3_env, fault):
    """One shard object damaged (the unpacked layout: an object per shard, FORMAT.md 6.2); a
    damaged pack is the next test."""
    url, k = s3_env.url(), "params/dense/kernel"
    arrays_layout = ckptfmt.SaveOptions(layout="arrays")
    old = _save(url, 1, _arrays(seed=1), options=arrays_layout)
    new = _save(url, 2, _arrays(seed=2), options=arrays_layout)
    target = _shard_objects(new, k)[1]
    c, bucket = s3_env.client, s3_env.bucket
    # Broken control: before the damage, everything reads and verifies.
    assert ckptfmt.Repository(url).verify(2) > 0
    if fault == "missing":
        c.delete_object(Bucket=bucket, Key=target)
        expected: type[CheckpointError] = MissingShardError
    elif fault == "truncated":
        body = c.get_object(Bucket=bucket, Key=target)["Body"].read()
        c.put_object(Bucket=bucket, Key=target, Body=body[:-100])
        expected = SizeMismatchError
    elif fault == "grown":  # found by a one-byte read at nbytes, not by reading the object to its end
        body = c.get_object(Bucket=bucket, Key=target)["Body"].read()
        c.put_object(Bucket=bucket, Key=target, Body=body + b"\x01" * 4096)
        expected = SizeMismatchError
    else:  # the same shard from the previous step: valid on its own, wrong for this manifest
        c.copy_object(Bucket=bucket, Key=target, CopySource={"Bucket": bucket, "Key": _shard_objects(old, k)[1]})
        expected = StaleShardError
    ck = ckptfmt.Repository(url).open(2)
    with pytest.raises(expected) as info:
        ck.read(k)
    assert info.value.key == k and info.value.object is not None
    with pytest.raises(expected):
        ckptfmt.Repository(url).verify(2)
    # The damage stays local: other tensors and the other step still read.
    np.testing.assert_array_equal(ck.read("params/dense/bias"), _arrays(seed=2)["params/dense/bias"])
    np.testing.assert_array_equal(_restore_all(url, 1)[k], _arrays(seed=1)[k])


def test_a_grown_object_costs_no_more_than_its_recorded_size(s3_env):
    """A shard grown by 128 MiB is rejected by a one-element read and by verify with a peak RSS far
    below 128 MiB; the broken control (its index read to the end of the object, as an unbounded
    reader reads it) shows that the measurement sees an unbounded read."""
    from test_reader import measure

    url, k, grow = s3_env.url(), "params/dense/kernel", 128 << 20
    m = _save(url, 1, _arrays())
    target = _shard_objects(m, k)[1]
    body = s3_env.client.get_object(Bucket=s3_env.bucket, Key=target)["Body"].read()
    s3_env.client.put_object(Bucket=s3_env.bucket, Key=target, Body=body + b"\x01" * grow)
    repo = ckptfmt.Repository(url)
    for name, fn in [("read", lambda: repo.open(1).read(k, Box((20, 3), (1, 1)))), ("verify", lambda: repo.verify(1))]:
        got = measure(fn)
        assert got["result"] == "SizeMismatchError" and got["grew"] < 32 << 20, (name, got)
    key, n = target[len("repo/"):], int(m.tensors[k].shards.nbytes[1])
    control = measure(lambda: repo.storage.read_range(key, n - 64, None).result())
    assert control["result"] == "no error" and control["grew"] > grow // 2, control


# A writer that blocks inside the save (its last tensor's data is produced lazily and never
# arrives) so the parent can SIGKILL it mid-save.
HANGING_WRITER = r"""
import sys, time, numpy as np, ckptfmt
from ckptfmt import Box, LocalShard
url, step = sys.argv[1], int(sys.argv[2])
a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
def never():
    print("BLOCKED", flush=True)
    time.sleep(300)
shards = [LocalShard("a", (64, 48), "float32", Box((r, 0), (16, 48)), a[r:r + 16]) for r in (0, 16, 32, 48)]
shards.append(LocalShard("z", (8,), "float32", Box((0,), (8,)), never))
# An object per shard (FORMAT.md 6.2): shard PUTs land while the last tensor blocks (a packed
# save on an object store puts each pack once it is whole, so a killed writer leaves less).
ckptfmt.save(url, step, shards, options=ckptfmt.SaveOptions(heartbeat_s=3600, layout="arrays"))
print("COMMITTED", flush=True)
"""


@pytest.mark.parametrize("fault", ["missing", "truncated", "grown", "flip"])
def test_a_damaged_pack_raises_typed_errors_and_other_steps_read(s3_env, fault):
    """FORMAT.md 5.15 on S3: the pack that holds a tensor's shard is missing, truncated, grown or
    has a flipped byte inside that shard's range: every read of the step that needs it raises a
    typed error naming the pack, and the previous step still reads (control: before the damage,
    the step reads and verifies)."""
    url, k = s3_env.url(), "params/dense/kernel"
    _save(url, 1, _arrays(seed=1))
    new = _save(url, 2, _arrays(seed=2))
    t = new.tensors[k]
    target = f"repo/{t.object_key(0)}"
    assert "/p/" in target
    c, bucket = s3_env.client, s3_env.bucket
    assert ckptfmt.Repository(url).verify(2) > 0
    body = c.get_object(Bucket=bucket, Key=target)["Body"].read()
    expected: type[CheckpointError]
    if fault == "missing":
        c.delete_object(Bucket=bucket, Key=target)
        expected = MissingShardError
    elif fault == "truncated":
        c.put_object(Bucket=bucket, Key=target, Body=body[:-100])
        expected = SizeMismatchError
    elif fault == "grown":
        c.put_object(Bucket=bucket, Key=target, Body=body + b"\x01" * 4096)
        expected = SizeMismatchError
    else:
        b = bytearray(body)
        b[t.shard_start(0) + 8] ^= 0x01
        c.put_object(Bucket=bucket, Key=target, Body=bytes(b))
        expected = ChecksumMismatchError
    with pytest.raises(expected) as info:
        ckptfmt.Repository(url).open(2).read(k)
    assert info.value.key == k and t.object_key(0) in str(info.value.object)
    with pytest.raises(expected):
        ckptfmt.Repository(url).verify(2)
    np.testing.assert_array_equal(_restore_all(url, 1)[k], _arrays(seed=1)[k])


def test_killed_writer_leaves_no_step_and_gc_collects_after_grace(s3_env):
    url = s3_env.url()
    arrays = _arrays()
    _save(url, 1, arrays)
    proc = subprocess.Popen([sys.executable, "-c", HANGING_WRITER, url, "2"], env=_child_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "BLOCKED"
        deadline = time.monotonic() + 10  # let the first tensor's shard PUTs land
        while time.monotonic() < deadline and not [k for k in s3_env.keys("repo/saves/000000000002") if "/c/" in k]:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    leftovers = s3_env.keys("repo/saves/000000000002")
    assert any(k.endswith("/LEASE") for k in leftovers) and any("/c/" in k for k in leftovers)
    repo = ckptfmt.Repository(url)
    assert repo.steps() == [1] and repo.latest() == 1
    with pytest.raises(StepNotFoundError):
        repo.open(2)
    # Inside the grace period the lease protects the (apparently live) save.
    report = repo.gc(grace_s=600)
    assert report.removed_saves == [] and len(report.in_progress) == 1
    assert s3_env.keys("repo/saves/000000000002") == leftovers
    # After it, the leftovers go and the committed step stays intact.
    time.sleep(1.1)
    report = repo.gc(grace_s=1.0)
    assert len(report.removed_saves) == 1 and report.removed_saves[0].startswith("000000000002-")
    assert s3_env.keys("repo/saves/000000000002") == []
    assert repo.verify(1) > 0
    np.testing.assert_array_equal(_restore_all(url, 1)["params/dense/kernel"], arrays["params/dense/kernel"])


def test_gc_retention_and_abandoned_saves(s3_env):
    url = s3_env.url()
    for step in range(1, 6):
        _save(url, step, _arrays(seed=step))
    c, bucket = s3_env.client, s3_env.bucket
    # An abandoned save (stale lease) and a live one (fresh lease), each with one object.
    for sid, beat in (("000000000009-20200101T000000-0000dead", 0.0), ("000000000010-20990101T000000-0000beef", time.time())):
        c.put_object(Bucket=bucket, Key=f"repo/saves/{sid}/LEASE",
                     Body=json.dumps({"save_id": sid, "step": int(sid[:12]), "world": 1, "heartbeat_unix": beat}))
        c.put_object(Bucket=bucket, Key=f"repo/saves/{sid}/t/000000/c/0", Body=b"partial")
    repo = ckptfmt.Repository(url)
    kept_ids = {repo.manifest(s).save_id for s in (4, 5)}
    # opt/count never changes: steps 2-5 reference step 1's object of it (FORMAT.md 8.4), so
    # retention removes step 1's manifest and keeps its save while steps 4 and 5 reference it.
    referenced = repo.manifest(4).referenced_saves | repo.manifest(5).referenced_saves
    assert referenced == {repo.manifest(1).save_id}
    report = repo.gc(grace_s=600, keep_last=2)
    assert sorted(report.removed_steps) == [1, 2, 3]
    assert report.removed_saves == ["000000000009-20200101T000000-0000dead"]
    assert report.in_progress == ["000000000010-20990101T000000-0000beef"]
    assert repo.steps() == [4, 5]
    save_dirs = {k.split("/")[2] for k in s3_env.keys("repo/saves/")}
    assert save_dirs == kept_ids | referenced | {"000000000010-20990101T000000-0000beef"}
    assert s3_env.keys("repo/manifests/") == [f"repo/manifests/{s:020d}.json" for s in (4, 5)]
    for s in (4, 5):
        assert repo.verify(s) > 0


def test_two_saves_of_one_step_exactly_one_wins(s3_env):
    url = s3_env.url()
    first = _save(url, 4, _arrays(seed=1))
    # The second save does not see the first manifest before its commit (as when both run at
    # once); only the server's conditional create can stop it.
    with FaultProxy(s3_env.endpoint, hide="/manifests/") as proxy:
        with pytest.raises(StepAlreadyCommittedError):
            ckptfmt.save(ckptfmt.Repository(url, options={"kvstore": {"endpoint": proxy.endpoint}}), 4,
                         _shards(_arrays(seed=2)))
    repo = ckptfmt.Repository(url)
    assert repo.manifest(4).save_id == first.save_id
    np.testing.assert_array_equal(_restore_all(url, 4)["params/dense/kernel"], _arrays(seed=1)["params/dense/kernel"])
    # Broken control: on a store that ignores If-None-Match the second save overwrites.
    with FaultProxy(s3_env.endpoint, hide="/manifests/", drop_conditions=True) as proxy:
        second = ckptfmt.save(ckptfmt.Repository(url, options={"kvstore": {"endpoint": proxy.endpoint}}), 4,
                              _shards(_arrays(seed=2)))
    assert repo.manifest(4).save_id == second.save_id != first.save_id


def test_concurrent_saves_of_one_step_exactly_one_wins(s3_env):
    url, results = s3_env.url(), {}

    def saver(seed: int) -> None:
        try:
            results[seed] = _save(url, 6, _arrays(seed=seed)).save_id
        except CheckpointError as e:
            results[seed] = e

    threads = [threading.Thread(target=saver, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [s for s, r in results.items() if isinstance(r, str)]
    losers = [r for r in results.values() if not isinstance(r, str)]
    assert len(winners) == 1 and len(losers) == 1 and isinstance(losers[0], StepAlreadyCommittedError)
    repo = ckptfmt.Repository(url)
    assert repo.manifest(6).save_id == results[winners[0]]
    np.testing.assert_array_equal(_restore_all(url, 6)["params/dense/kernel"], _arrays(seed=winners[0])["params/dense/kernel"])


# One simulated host: rank r of 2, holding every other row block of every tensor.
HOST = r"""
import sys, json, numpy as np, ckptfmt
sys.path.insert(0, sys.argv[4])
from test_s3 import _arrays, _shards
url, address, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
with ckptfmt.TcpCoordinator(address, rank, 2, timeout_s=60) as coord:
    m = ckptfmt.save(url, 7, _shards(_arrays(seed=7), rank=rank, world=2), coordinator=coord,
                     rank_state={"host": rank})
print(json.dumps({"rank": rank, "save_id": m.save_id, "writers": m.writers}), flush=True)
"""


def test_two_hosts_share_one_bucket(s3_env):
    from ckptfmt.coord import free_port

    url, address = s3_env.url(), f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", HOST, url, address, str(r), str(REPO_ROOT / "tests")],
                              env=_child_env(), cwd=str(REPO_ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["save_id"] == outs[1]["save_id"] and outs[0]["writers"] == 2
    ck = ckptfmt.Repository(url).open()
    assert ck.step == 7 and ck.saved_world == 2
    k = "params/dense/kernel"
    want = _arrays(seed=7)
    # Each host wrote its own shard objects.
    assert sorted(set(ck.manifest.tensors[k].shards.writer)) == [0, 1]
    # Restore as 3 "hosts" splitting columns instead of rows.
    cols = [Box((0, 0), (64, 16)), Box((0, 16), (64, 16)), Box((0, 32), (64, 16))]
    np.testing.assert_array_equal(np.concatenate(ck.read_boxes([(k, b) for b in cols]), axis=1), want[k])
    assert ck.rank_state(1) == {"host": 1}


def test_cli_lists_and_verifies_an_s3_repository(s3_env):
    url = s3_env.url()
    _save(url, 5, _arrays())
    for cmd in (["ls", url, "--json"], ["verify", url, "--json"]):
        out = subprocess.run([sys.executable, "-m", "ckptfmt", *cmd], env=_child_env(), cwd=str(REPO_ROOT),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        doc = json.loads(out.stdout)
        assert doc["ok"] is True and doc["url"] == url
    # Broken control: a bucket that does not exist fails with a typed error, not a traceback.
    out = subprocess.run([sys.executable, "-m", "ckptfmt", "ls", "s3://no-such-bucket-ckptfmt/x", "--json"],
                         env=_child_env(), cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and json.loads(out.stdout)["ok"] is False


# gc must never remove a committed checkpoint (docs/OBJECT_STORAGE.md, "gc and a lagging list").
GC_PATCH = ("core gc trusts the manifests/ LIST; on a lagging store it needs the point read of "
            "manifests/<step>.json proposed with issue 8")


def test_gc_keeps_a_save_that_commits_while_gc_runs(s3_env):
    url = s3_env.url()
    _save(url, 1, _arrays(seed=1))
    repo = ckptfmt.Repository(url)
    real_list, committed = repo.storage.list, {}

    def list_then_commit(prefix: str = "") -> list[str]:
        if prefix == "saves/" and not committed:  # a save of step 2 commits just as gc lists saves/
            committed["m"] = _save(url, 2, _arrays(seed=2))
        return real_list(prefix)

    repo.storage.list = list_then_commit  # type: ignore[method-assign]
    report = repo.gc(grace_s=600)
    assert committed["m"].save_id not in report.removed_saves
    assert ckptfmt.Repository(url).verify(2) > 0


def test_gc_with_a_lagging_list_keeps_committed_saves(s3_env):
    url = s3_env.url()
    _save(url, 3, _arrays())  # committed a moment ago; its lease is gone
    # gc on a store whose LIST does not show the new manifest yet.
    with FaultProxy(s3_env.endpoint, unlisted="/manifests/") as proxy:
        lagging = ckptfmt.Repository(url, options={"kvstore": {"endpoint": proxy.endpoint}})
        assert lagging.steps() == []  # control: the lag is real
        lagging.gc(grace_s=600)
    assert ckptfmt.Repository(url).verify(3) > 0


def test_cli_gc_without_grace_keeps_a_live_save(s3_env):
    sid = "000000000001-20990101T000000-00000001"
    # The save's leader created the repository marker before its lease (FORMAT.md 4.5).
    s3_env.client.put_object(Bucket=s3_env.bucket, Key="repo/ckptfmt.json", Body=MARKER_BYTES)
    s3_env.client.put_object(Bucket=s3_env.bucket, Key=f"repo/saves/{sid}/LEASE",
                             Body=json.dumps({"save_id": sid, "step": 1, "world": 1, "heartbeat_unix": time.time()}))
    out = subprocess.run([sys.executable, "-m", "ckptfmt", "gc", s3_env.url(), "--json"], env=_child_env(),
                         cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["report"]["in_progress"] == [sid]


# ================================================ the commit fence on S3 (FORMAT.md 8.3, issue 12)


def test_gc_claim_is_atomic_where_a_conditional_delete_is_not(s3_env):
    """The leader's switch to "committing" lands between gc's HEAD and its write. gc's claim (a PUT
    with If-Match) then loses, enforced by the server. Broken control: tensorstore's conditional
    DELETE is a HEAD and then an unconditional DELETE, and it deletes the committing lease."""
    kv, key = _kv(s3_env), "saves/x/LEASE"
    writing, committing = b'{"state":"writing"}', b'{"state":"committing"}'

    def race(gc_write: bytes | None) -> tuple[bytes, ts.KvStore.ReadResult]:
        kv.write(key, None).result()
        gen = kv.write(key, writing, if_equal=NO_VALUE).result().generation
        fired: list[bool] = []

        def leader_switches(method: str, path: str) -> None:
            if method in ("PUT", "DELETE") and path.endswith("/" + key) and not fired:
                fired.append(True)  # the leader's own conditional PUT, right now
                s3_env.client.put_object(Bucket=s3_env.bucket, Key=f"repo/{key}", Body=committing,
                                         IfMatch=gen[1:].decode())

        with FaultProxy(s3_env.endpoint, before=leader_switches) as proxy:
            won = _kv(s3_env, endpoint=proxy.endpoint).write(key, gc_write, if_equal=gen).result().generation
        assert fired
        return won, kv.read(key).result()

    won, after = race(b'{"state":"collected"}')
    assert won == b"" and after.value == committing        # the claim lost; the leader may commit
    won, after = race(None)
    assert won != b"" and after.state == "missing"          # control: the delete "won" anyway


def _fence_s3(s3_env, freeze: str, gc_grace_s: float | None):
    from ckptfmt_tools.faults._fence import describe, frozen_commit

    url = s3_env.url()
    _save(url, 1, _arrays(seed=1))
    run = frozen_commit(url, 2, 5, freeze=freeze, gc_grace_s=gc_grace_s)
    assert run.froze and not run.hung and len(run.results) == 1, describe(run)
    return ckptfmt.Repository(url), run, describe(run)


@pytest.mark.multiprocess
def test_frozen_leader_on_s3_loses_to_gc_and_fails_closed(s3_env):
    repo, run, why = _fence_s3(s3_env, "before_fence", 1.0)
    assert run.results[0]["error"] == "IncompleteSaveError" and len(run.report.removed_saves) == 1, why
    assert repo.steps() == [1] and s3_env.keys("repo/saves/000000000002") == []
    assert repo.verify(1) > 0


@pytest.mark.multiprocess
def test_leader_frozen_after_the_fence_on_s3_is_kept_and_commits(s3_env):
    repo, run, why = _fence_s3(s3_env, "before_create", 1.0)
    assert run.report.removed_saves == [] and len(run.report.uncertain) == 1, why
    assert run.results[0]["ok"] and repo.steps() == [1, 2] and repo.verify(2) > 0, why


@pytest.mark.multiprocess
def test_frozen_leader_on_s3_without_gc_commits(s3_env):
    repo, run, why = _fence_s3(s3_env, "before_fence", None)  # control: the pause alone is harmless
    assert run.results[0]["ok"] and repo.steps() == [1, 2] and repo.verify(2) > 0, why
