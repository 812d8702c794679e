"""The save protocol's own safety rules: leases are never resurrected, failures reach every rank."""
import threading
import time

import numpy as np
import pytest

from ckptfmt import (Box, CheckpointError, CoordinatorTimeoutError, LocalShard, Repository, SaveOptions, StepMismatchError,
                     TcpCoordinator, TopologyChangedError, save)
from ckptfmt.coord import free_port
from ckptfmt.session import _Heartbeat, lease_key


def _x():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    return x, [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


def test_heartbeat_never_resurrects_a_collected_lease(repo_url):
    repo = Repository(repo_url)
    hb = _Heartbeat(repo.storage, lease_key("s1"), {"save_id": "s1"}, every_s=3600).start()
    hb.beat()                                   # control: refreshing our own lease works
    assert hb.holds() and not hb.lost
    gen = repo.storage.read_with_generation([lease_key("s1")])[0][1]
    assert repo.storage.write_if(lease_key("s1"), None, gen)   # gc collects it (conditional delete)
    hb.beat()
    assert hb.lost and not hb.holds()
    assert repo.storage.read(lease_key("s1")) is None          # not brought back
    hb.stop()


def test_gc_keeps_a_lease_refreshed_since_it_was_read(repo_url):
    repo = Repository(repo_url)
    hb = _Heartbeat(repo.storage, lease_key("s2"), {"save_id": "s2"}, every_s=3600).start()
    old_gen = repo.storage.read_with_generation([lease_key("s2")])[0][1]
    hb.beat()                                   # the writer refreshes between gc's read and delete
    assert not repo.storage.write_if(lease_key("s2"), None, old_gen)  # gc's conditional delete loses
    assert hb.holds()
    hb.stop()


def test_failed_begin_stops_the_heartbeat_and_cleans_up(tmp_path):
    url = str(tmp_path / "repo")
    x, shards = _x()
    c0 = TcpCoordinator(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=2)  # rank 1 never comes
    with pytest.raises(CoordinatorTimeoutError):
        save(url, 1, shards, coordinator=c0, options=SaveOptions(timeout_s=2))
    c0.close()
    time.sleep(0.2)
    assert not [t for t in threading.enumerate() if t.name == "ckptfmt-lease" and t.is_alive()]
    assert Repository(url).storage.list("saves/") == []        # nothing left behind, not even a lease
    save(url, 1, shards)                                        # control: the same save alone commits
    assert Repository(url).steps() == [1]


def test_bad_input_on_one_rank_fails_every_rank_promptly(tmp_path):
    """Rank 1 passes something that is not a LocalShard: rank 0 learns it in the freeze, not by timeout."""
    url = str(tmp_path / "repo")
    x, shards = _x()
    addr = f"127.0.0.1:{free_port()}"
    errors = {}

    def run(rank, payload):
        try:
            with TcpCoordinator(addr, rank, 2, timeout_s=120) as c:
                save(url, 1, payload, coordinator=c)
        except Exception as e:
            errors[rank] = e

    ts = [threading.Thread(target=run, args=(0, shards)), threading.Thread(target=run, args=(1, ["not a shard"]))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert isinstance(errors.get(0), StepMismatchError) and "rank 1" in str(errors[0])
    assert isinstance(errors.get(1), StepMismatchError)
    assert Repository(url).steps() == []


def test_data_less_replica_listed_first_is_fine(repo_url):
    x, _ = _x()
    full = Box((0, 0), x.shape)
    save(repo_url, 1, [LocalShard("x", x.shape, x.dtype, full, None, replica_id=1),
                       LocalShard("x", x.shape, x.dtype, full, x, replica_id=0)])
    assert np.array_equal(Repository(repo_url).open().read("x"), x)


def test_bool_bytes_are_normalized_in_tensors_and_state(repo_url):
    odd = np.array([0, 2, 1, 255], np.uint8).view(bool)   # reinterpreted bytes: "true" stored as 2 and 255
    save(repo_url, 1, [LocalShard("m", odd.shape, odd.dtype, Box((0,), odd.shape), odd)], state={"mask": odd})
    ck = Repository(repo_url).open()
    assert ck.read("m").view(np.uint8).tolist() == [0, 1, 1, 1]
    assert ck.state()["mask"].tolist() == [False, True, True, True]


def test_metadata_and_step_rejected_before_anything_is_written(repo_url):
    from ckptfmt import InvalidManifestError
    x, shards = _x()
    with pytest.raises(InvalidManifestError):
        save(repo_url, 1, shards, metadata={1: "int key"})
    with pytest.raises(InvalidManifestError):
        save(repo_url, 1, shards, metadata={"v": float("nan")})
    with pytest.raises(StepMismatchError):
        save(repo_url, 2 ** 63, shards)
    assert Repository(repo_url).storage.list("saves/") == []
    save(repo_url, 1, shards, metadata={"run": "a", "lr": 0.1, "tags": ["x"]})  # control
    assert Repository(repo_url).manifest(1).metadata["tags"] == ["x"]


def _block(shape, box=None, dtype=np.uint8):
    box = box or Box.full(shape)
    return LocalShard("odd/t", shape, dtype, box, np.zeros(box.shape, dtype))


@pytest.mark.parametrize("shard, error, words", [
    # Issue 24 item 11: a rank-64 tensor raised ValueError from the planner, ranks 32-63 failed in tensorstore.
    (lambda: _block((2,) + (1,) * 31), "ShapeMismatchError", "more dimensions than the format stores"),
    (lambda: _block((2,) + (1,) * 63), "ShapeMismatchError", "more dimensions than the format stores"),
    # A dimension of 2^63 raised OverflowError; 2^62 x 4 bytes ValueError ("array is too big").
    (lambda: _block((1 << 63,), Box((0,), (1,))), "ShapeMismatchError", "dimension of the tensor is out of range"),
    (lambda: _block((1 << 62, 4), Box((0, 0), (1, 4))), "ShapeMismatchError", "tensor too large"),
    (lambda: _block((4,), Box((1 << 63,), (1,))), "StepMismatchError", "lies outside its tensor"),
    (lambda: _block((4, 4), Box((0,), (4,))), "StepMismatchError", "wrong rank"),
])
def test_blocks_no_manifest_can_record_are_rejected_before_anything_is_written(repo_url, shard, error, words):
    """FORMAT.md 5.10: at most 31 dimensions (tensorstore's zarr3 sharding), each in [0, 2^62], at
    most 2^62 bytes, and a box inside its tensor: a typed error naming the tensor, nothing written."""
    with pytest.raises(CheckpointError) as got:
        save(repo_url, 1, [shard()])
    assert type(got.value).__name__ == error and words in str(got.value) and got.value.key == "odd/t"
    assert Repository(repo_url).storage.list("saves/") == []
    # the control: a tensor of 31 dimensions, the most allowed, saves and reads back
    x = np.arange(2, dtype=np.uint8).reshape((2,) + (1,) * 30)
    save(repo_url, 1, [LocalShard("odd/t", x.shape, x.dtype, Box.full(x.shape), x)])
    assert Repository(repo_url).open(1).read("odd/t").tobytes() == x.tobytes()


def _nested(levels: int) -> dict:
    """metadata whose innermost object lies at manifest level ``levels`` (metadata itself is level 2)."""
    md: dict = {}
    inner = md
    for _ in range(levels - 2):
        inner["a"] = {}
        inner = inner["a"]
    return md


@pytest.mark.parametrize("levels", [65, 989, 5000])
def test_metadata_deeper_than_readers_parse_is_rejected_before_anything_is_written(repo_url, levels):
    """Issue 12: 5,000 levels raised RecursionError; 989 committed a manifest no reader could parse."""
    from ckptfmt import InvalidManifestError
    x, shards = _x()
    with pytest.raises(InvalidManifestError, match="too deeply"):
        save(repo_url, 1, shards, metadata=_nested(levels))
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(InvalidManifestError, match="too deeply"):
        save(repo_url, 1, shards, metadata=cyclic)
    assert Repository(repo_url).storage.list("saves/") == []
    save(repo_url, 1, shards, metadata=_nested(64))  # the control: level 64, the deepest allowed
    assert Repository(repo_url).manifest(1).metadata == _nested(64)


def test_unknown_rank_state_policy_is_rejected(repo_url):
    x, shards = _x()
    save(repo_url, 1, shards, rank_state={"r": 0})
    ck = Repository(repo_url).open()
    # A usage error (ValueError naming the accepted policies), not a topology fault, on any world.
    for world in (1, 2):
        with pytest.raises(ValueError, match="'drop', 'rank0', 'same-rank'") as e:
            ck.rank_state(0, world=world, policy="bogus")
        assert not isinstance(e.value, TopologyChangedError)
    assert ck.rank_state(0, world=1, policy="same-rank") == {"r": 0}  # control
    with pytest.raises(TopologyChangedError):  # control: a real topology change without a policy
        ck.rank_state(0, world=2)


# ------------------------------------------------ the commit fence (FORMAT.md 8.3, issue 12 item 4)


def _claim(repo, key, gen):
    """What gc does to a lease it judged stale: a conditional rewrite to "collected"."""
    import json
    return repo.storage.write_if(key, json.dumps({"state": "collected", "heartbeat_unix": 0}).encode(), gen)


def test_commit_fence_and_gc_claim_exclude_each_other(repo_url):
    import json
    repo = Repository(repo_url)
    # gc claims first: the leader's switch to "committing" fails, so it never creates its manifest.
    hb = _Heartbeat(repo.storage, lease_key("s3"), {"save_id": "s3"}, every_s=3600).start()
    gen = repo.storage.read_with_generation([lease_key("s3")])[0][1]
    assert _claim(repo, lease_key("s3"), gen)
    assert hb.begin_commit() is False and hb.lost
    hb.stop()
    # The leader switches first: gc's claim on the generation it read fails, and the lease stays.
    hb = _Heartbeat(repo.storage, lease_key("s4"), {"save_id": "s4"}, every_s=3600).start()
    gen = repo.storage.read_with_generation([lease_key("s4")])[0][1]
    assert hb.begin_commit() is True
    assert not _claim(repo, lease_key("s4"), gen)
    hb.beat()                                    # a heartbeat after the switch must not undo it
    value, after = repo.storage.read_with_generation([lease_key("s4")])[0]
    assert json.loads(value)["state"] == "committing" and after == hb.generation
    hb.stop()


def _fence_run(tmp_path, freeze, gc_grace_s):
    from ckptfmt_tools.faults._fence import describe, frozen_commit
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    url = str(tmp_path / "repo")
    assert all(r["ok"] for r in wait_writers(start_writers(url, [1], 1, 5), 60).results)
    run = frozen_commit(url, 2, 5, freeze=freeze, gc_grace_s=gc_grace_s)
    assert run.froze and not run.hung and len(run.results) == 1, describe(run)
    return Repository(url), run, describe(run)


@pytest.mark.multiprocess
def test_frozen_leader_loses_to_gc_and_fails_closed(tmp_path):
    """SIGSTOP right before the fence; gc collects the stale save; after SIGCONT the save fails."""
    repo, run, why = _fence_run(tmp_path, "before_fence", 1.0)
    assert run.results[0]["error"] == "IncompleteSaveError" and len(run.report.removed_saves) == 1, why
    assert repo.steps() == [1] and not [k for k in repo.storage.list("saves/") if k.startswith("saves/000000000002")]
    repo.verify(1)


@pytest.mark.multiprocess
def test_leader_frozen_after_the_fence_is_kept_and_commits(tmp_path):
    """SIGSTOP after the switch to "committing", right before the create: gc keeps the save."""
    repo, run, why = _fence_run(tmp_path, "before_create", 1.0)
    assert run.report.removed_saves == [] and len(run.report.uncertain) == 1, why
    assert run.results[0]["ok"] and repo.steps() == [1, 2], why
    repo.verify(2)


@pytest.mark.multiprocess
def test_frozen_leader_without_gc_commits(tmp_path):
    """Control: the same frozen writer, no gc: the pause alone changes nothing."""
    repo, run, why = _fence_run(tmp_path, "before_fence", None)
    assert run.results[0]["ok"] and repo.steps() == [1, 2], why
    repo.verify(2)


def test_a_save_plans_anew_when_the_boxes_change_and_reuses_the_plan_when_they_do_not(repo_url):
    """The save plan is cached by its inputs (inventory, every rank's boxes, chunk target): a save
    with other boxes for the same key gets its own plan (its manifest's shard boxes), and a save
    with the first boxes again gets the first plan's layout (the control)."""
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)

    def split(rows: int, step: int) -> list[LocalShard]:
        return [LocalShard("w", x.shape, x.dtype, Box((r, 0), (rows, 6)), x[r:r + rows] + step)
                for r in range(0, 8, rows)]

    shards_of = {1: 4, 2: 2, 3: 4, 4: 4}
    for step, rows in shards_of.items():
        save(repo_url, step, split(rows, step), options=SaveOptions(reuse="off"))
    repo = Repository(repo_url)
    for step, rows in shards_of.items():
        t = repo.manifest(step).tensors["w"]
        assert t.shards.offset.tolist() == [[r, 0] for r in range(0, 8, rows)], (step, t.shards.offset.tolist())
        np.testing.assert_array_equal(repo.open(step).read_boxes([("w", Box((0, 0), (8, 6)))])[0], x + step)


def _watch_commit(url, refs):
    """A repository whose manifest write first records how many of ``refs`` (weak references to
    the blocks' arrays) are still alive: what the commit of a save holds."""
    import gc

    from ckptfmt.storage import DelegatingStorage, open_storage

    alive: list[int] = []

    class AtCommit(DelegatingStorage):
        def create_if_absent(self, key, data):
            if key.startswith("manifests/"):
                gc.collect()
                alive.append(sum(r() is not None for r in refs))
            return self.inner.create_if_absent(key, data)

    return Repository(url, storage=AtCommit(open_storage(url))), alive


def test_a_save_lets_go_of_the_blocks_it_wrote_before_its_commit(tmp_path):
    """The commit holds none of the blocks a save was handed through an iterator: they are let go
    of once written and verified (a state of 100,000 tensors does not keep them all through the
    commit's build, parse and write). Control: a caller that keeps its list keeps every block alive
    at the commit, which the check sees."""
    import weakref

    def blocks(refs):
        for i in range(6):
            a = np.arange(8, dtype=np.float32) + i
            refs.append(weakref.ref(a))
            yield LocalShard(f"t{i}", (8,), np.float32, Box((0,), (8,)), a)

    refs: list = []
    repo, alive = _watch_commit(str(tmp_path / "a"), refs)
    save(repo, 1, blocks(refs))
    assert alive == [0], alive
    assert Repository(str(tmp_path / "a")).open(1).read_boxes([("t3", Box((0,), (8,)))])[0].tolist() == list(range(3, 11))

    refs = []
    repo, alive = _watch_commit(str(tmp_path / "b"), refs)
    kept = list(blocks(refs))  # the caller's own list: the control
    save(repo, 1, kept)
    assert alive == [6], alive
