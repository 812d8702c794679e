"""Repository conformance, run on the file and memory kvstores."""
import threading

import numpy as np
import pytest

from ckptfmt import (Box, LocalShard, Repository, StepAlreadyCommittedError, StepMismatchError, StepNotFoundError,
                     TopologyChangedError, save)


def shards(step, n=12):
    x = (np.arange(n * 4, dtype=np.float32) + step).reshape(n, 4)
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)], x


def test_empty_repository(repo_url):
    repo = Repository(repo_url)
    assert repo.steps() == [] and repo.latest() is None
    with pytest.raises(StepNotFoundError):
        repo.open()
    with pytest.raises(StepNotFoundError):
        repo.manifest(3)


def test_steps_latest_delete(repo_url):
    repo = Repository(repo_url)
    for s in (5, 1, 30):
        save(repo, s, shards(s)[0])
    assert repo.steps() == [1, 5, 30] and repo.latest() == 30
    repo.delete(30)
    assert repo.steps() == [1, 5] and repo.latest() == 5
    assert np.array_equal(repo.open().read("x"), shards(5)[1])
    assert not [k for k in repo.storage.list("saves/") if k.startswith("saves/000000000030")]


def test_same_step_twice_is_rejected(repo_url):
    repo = Repository(repo_url)
    save(repo, 2, shards(2)[0])
    with pytest.raises(StepAlreadyCommittedError):
        save(repo, 2, shards(99)[0])
    assert np.array_equal(repo.open(2).read("x"), shards(2)[1])  # the first commit is untouched


def test_concurrent_saves_of_one_step_exactly_one_wins(repo_url):
    repo = Repository(repo_url)
    results = []

    def run(seed):
        try:
            results.append(save(repo_url, 4, shards(seed)[0]))
        except StepAlreadyCommittedError as e:
            results.append(e)

    ts = [threading.Thread(target=run, args=(s,)) for s in (100, 200, 300)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wins = [r for r in results if not isinstance(r, Exception)]
    assert len(wins) == 1 and len(results) == 3
    got = repo.open(4).read("x")
    assert any(np.array_equal(got, shards(s)[1]) for s in (100, 200, 300))
    repo.gc(grace_s=0)
    assert len({k.split("/")[1] for k in repo.storage.list("saves/")}) == 1  # losers' objects are gone
    repo.verify(4)


def test_retention(repo_url):
    repo = Repository(repo_url)
    for s in range(1, 7):
        save(repo, s, shards(s)[0])
    rep = repo.gc(keep_last=2, keep_every=3, grace_s=0)
    assert repo.steps() == [3, 5, 6] and sorted(rep.removed_steps) == [1, 2, 4]
    for s in repo.steps():
        repo.verify(s)


def test_step_must_be_valid(repo_url):
    with pytest.raises(StepMismatchError):
        save(repo_url, -1, shards(0)[0])
    save(repo_url, 0, shards(0)[0])  # control


def test_state_and_rank_state_policy(repo_url):
    repo = Repository(repo_url)
    save(repo, 1, shards(1)[0], state={"cursor": {"pos": 128, "epoch": 0}}, rank_state={"np_rng": [1, 2, 3]})
    ck = repo.open()
    assert ck.state() == {"cursor": {"pos": 128, "epoch": 0}}
    assert ck.rank_state(0, world=1) == {"np_rng": [1, 2, 3]}
    with pytest.raises(TopologyChangedError):
        ck.rank_state(0, world=4)
    assert ck.rank_state(3, world=4, policy="drop") is None
    assert ck.rank_state(3, world=4, policy="rank0") == {"np_rng": [1, 2, 3]}


def test_rank_state_without_per_rank_state_is_none_on_any_world(repo_url):
    """FORMAT.md 7.4 (issue 47 item 14.2): only per-rank state that was saved needs a policy on
    another world size; a checkpoint with none returns None for any world. Control: one with
    per-rank state still raises TopologyChangedError, and names the saved and restoring worlds."""
    repo = Repository(repo_url)
    save(repo, 1, shards(1)[0], state={"cursor": 1})
    ck = repo.open(1)
    assert ck.rank_state(0, world=2) is None
    assert ck.rank_state(3, world=4, policy="rank0") is None and ck.rank_state(0, world=1) is None
    save(repo, 2, shards(1)[0], state={"cursor": 2}, rank_state={"rng": 7})
    with pytest.raises(TopologyChangedError) as e:
        repo.open(2).rank_state(0, world=2)
    assert (e.value.expected, e.value.found) == ("world 1", "world 2")
    assert repo.open(2).rank_state(0, world=1) == {"rng": 7}


def test_wrong_shard_dtype_or_shape_fails_closed(repo_url):
    from ckptfmt import IncompleteSaveError
    x = np.ones((4, 4), np.float64)
    with pytest.raises(IncompleteSaveError, match="dtype"):
        save(repo_url, 1, [LocalShard("x", x.shape, np.float32, Box((0, 0), x.shape), x)])
    with pytest.raises(IncompleteSaveError, match="shape"):
        save(repo_url, 1, [LocalShard("x", (4, 4), x.dtype, Box((0, 0), (4, 4)), x[:2])])
    assert Repository(repo_url).steps() == []
    save(repo_url, 1, [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)])  # control
    assert Repository(repo_url).steps() == [1]


def test_gc_removes_stale_lock_files_of_a_committed_save(tmp_path):
    """A writer killed while deleting its lease leaves the file driver's hidden LEASE.__lock behind."""
    import os
    url = str(tmp_path / "repo")
    m = save(url, 1, shards(1)[0])
    lock = tmp_path / "repo" / "saves" / m.save_id / "LEASE.__lock"
    lock.write_bytes(b"")
    repo = Repository(url)
    repo.gc(grace_s=3600)                 # control: a fresh lock may belong to a live write
    assert lock.exists()
    os.utime(lock, (1, 1))                # now it is old
    repo.gc(grace_s=3600)
    assert not lock.exists()
    repo.verify(1)


def test_a_manifest_parsed_before_is_served_only_for_the_same_bytes(tmp_path):
    """Repository keeps parsed manifests (a manager's save and retention read the same ones up to
    six times). The cache is checked against the bytes read now: a step deleted and committed
    again by another save is not answered with the manifest parsed before."""
    repo = Repository(str(tmp_path))
    save(repo, 5, shards(5)[0], metadata={"v": 1})
    first = repo.manifest(5)
    assert repo.manifest(5) is first  # control: served from the cache while the bytes are the same
    other = Repository(str(tmp_path))  # another process's view
    other.delete(5)
    with pytest.raises(StepNotFoundError):
        repo.manifest(5)
    save(other, 5, shards(6)[0], metadata={"v": 2})
    again = repo.manifest(5)
    assert again is not first and again.metadata["v"] == 2 and again.save_id != first.save_id
    assert np.array_equal(repo.open(5).read("x"), shards(6)[1])


def test_the_manifest_cache_is_bounded(tmp_path):
    from ckptfmt.manifest import parse_manifest
    from ckptfmt.repository import MANIFEST_CACHE_ENTRIES

    repo = Repository(str(tmp_path))  # its own repository ("memory://" is shared within the process)
    for s in range(MANIFEST_CACHE_ENTRIES + 4):
        save(repo, s, shards(s)[0])
        repo.manifest(s)
    assert len(repo._parsed) == MANIFEST_CACHE_ENTRIES  # the newest used are kept
    assert min(repo._parsed) == f"manifests/{4:020d}.json"
    big = repo.storage.read(f"manifests/{0:020d}.json")
    repo.remember_manifest("manifests/x.json", big + b" " * (64 << 20), parse_manifest(big))  # over the byte cap
    assert "manifests/x.json" not in repo._parsed and len(repo._parsed) == MANIFEST_CACHE_ENTRIES


def test_the_manifest_and_its_bytes_come_from_one_read(tmp_path):
    """A verification record binds the digest of the manifest's bytes (FORMAT.md 10.4): the bytes
    ``manifest_with_bytes`` returns are those on disk, and its manifest is the one ``manifest``
    serves (parsed once)."""
    repo = Repository(str(tmp_path))
    save(repo, 3, shards(3)[0])
    m, data = repo.manifest_with_bytes(3)
    assert data == (tmp_path / "manifests" / f"{3:020d}.json").read_bytes()
    assert repo.manifest(3) is m
