"""The core checkpoint manager (ckptfmt.manager) in one process: cadence, back-pressure, retention,
resume with fallback, close, SIGTERM, metrics. The 2-process JAX and torch loops are in
test_manager_mp.py."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from ckptfmt import Box, Repository, SaveOptions
from ckptfmt.errors import (ChecksumMismatchError, IncompleteSaveError, KeyMismatchError, StepAlreadyCommittedError,
                            StepNotFoundError)
from ckptfmt.manager import METADATA_KEY, CheckpointManager, Retention, SaveFailurePolicy

from manager_common import TwoRankManager, eval_loss, flip_one_shard


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 4), step, np.float32), "b": np.arange(4, dtype=np.int64) + step}


def test_cadence_by_steps_and_force(tmp_path):
    with CheckpointManager(str(tmp_path / "r"), save_every_steps=5, async_save=False) as m:
        assert [s for s in range(1, 16) if m.should_save(s)] == [5, 10, 15]
        started = [s for s in range(1, 13) if m.save(s, _state(s))]
        assert started == [5, 10]
        assert m.save(12, _state(12), force=True)
        assert not m.save(12, _state(12), force=True)  # a step is never saved twice by one manager
        assert not m.should_save(12)
    assert Repository(str(tmp_path / "r")).steps() == [5, 10, 12]


def test_cadence_by_seconds(tmp_path):
    with CheckpointManager(str(tmp_path / "a"), save_every_seconds=3600) as m:
        assert not m.should_save(1)
    with CheckpointManager(str(tmp_path / "b"), save_every_seconds=0.001) as m:
        time.sleep(0.01)
        assert m.should_save(1) and m.save(1, _state(1))
    with pytest.raises(ValueError):
        CheckpointManager(str(tmp_path / "c"), save_every_seconds=0)


def test_async_back_pressure_and_metrics_file(tmp_path):
    url, log = str(tmp_path / "r"), tmp_path / "metrics.jsonl"
    big = {"w": np.ones((256, 1024), np.float32)}  # 1 MiB at 4 MiB/s: each save takes about 0.25 s
    with CheckpointManager(url, save_every_steps=1, metrics_file=str(log),
                           options=SaveOptions(max_write_bytes_per_s=4 << 20)) as m:
        assert m.save(1, big) and m.save(2, big)  # the second waits for the first
        rec = m.wait()
    h = m.history
    assert [r.step for r in h] == [1, 2] and all(r.committed for r in h) and rec == h[-1]
    assert h[0].waited_s == 0.0 and h[1].waited_s > 0 and h[1].blocked_s >= h[1].waited_s
    assert h[0].bytes == Repository(url).manifest(1).nbytes > (1 << 20)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["event"], x["step"]) for x in lines] == [("save", 1), ("save", 2)]
    assert {"blocked_s", "waited_s", "write_s", "bytes", "committed"} <= set(lines[0])


def test_async_error_surfaces_at_the_next_call(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, async_save=False) as m:
        m.save(3, _state(3), force=True)
    m = CheckpointManager(url, failure_policy=SaveFailurePolicy.fail_fast())
    assert m.save(3, _state(3), force=True)  # started; it fails in the background
    with pytest.raises(StepAlreadyCommittedError):
        m.wait()
    assert not m.history[-1].committed and "StepAlreadyCommitted" in m.history[-1].error
    m.close()
    # The default policy records it (never retried: another save committed the step) and goes on;
    # close() raises, since the last save did not commit.
    m = CheckpointManager(url)
    assert m.save(3, _state(3), force=True)
    rec = m.wait()
    assert rec is not None and not rec.committed and rec.attempts == 1 and "StepAlreadyCommitted" in rec.error
    with pytest.raises(StepAlreadyCommittedError):
        m.close()


def test_keep_best_and_newest(tmp_path, caplog):
    url, log = str(tmp_path / "r"), tmp_path / "m.jsonl"
    caplog.set_level(logging.INFO, logger="ckptfmt.manager")
    with CheckpointManager(url, save_every_steps=5, keep_best=2, best_metric="eval_loss", keep_last=1,
                           metrics_file=str(log)) as m:
        for s in range(1, 41):
            m.save(s, _state(s), metrics={"eval_loss": eval_loss(s)})
    repo = Repository(url)
    saved = list(range(5, 41, 5))
    best = sorted(saved, key=eval_loss)[:2]
    assert 40 not in best  # the newest is kept on its own rule, not as one of the best
    assert repo.steps() == sorted(best + [40])
    assert repo.manifest(40).metadata[METADATA_KEY]["metrics"] == {"eval_loss": eval_loss(40)}
    deleted = [json.loads(x) for x in log.read_text().splitlines() if '"delete"' in x]
    assert sorted(d["step"] for d in deleted) == sorted(set(saved) - set(best) - {40})
    assert all("eval_loss=" in d["reason"] for d in deleted)
    assert any("retention: deleted step" in r.message for r in caplog.records)
    # Broken control: the same run without a policy deletes nothing.
    url2 = str(tmp_path / "all")
    with CheckpointManager(url2, save_every_steps=5) as m:
        for s in range(1, 41):
            m.save(s, _state(s), metrics={"eval_loss": eval_loss(s)})
    assert Repository(url2).steps() == saved


def test_keep_last_and_keep_every(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, save_every_steps=2, keep_last=2, keep_every=8, async_save=False) as m:
        for s in range(1, 21):
            m.save(s, _state(s))
    assert Repository(url).steps() == [8, 16, 18, 20]


def test_retention_plan_rules():
    r = Retention(keep_best=2, best_metric="acc", best_mode="max")
    metrics = {1: 0.5, 2: float("nan"), 3: 0.9, 4: None, 5: 0.7, 6: 0.1}
    plan = {d.step: d.reason for d in r.plan(metrics, lambda s: None if metrics[s] != metrics[s] else metrics[s],
                                               protected=[1]).delete}
    assert sorted(plan) == [2, 4]  # 3 and 5 are best, 6 is newest, 1 is being read
    assert "acc=not recorded" in plan[2]
    assert Retention().plan([1, 2, 3], lambda s: 0.0).delete == ()  # no policy: keep everything
    with pytest.raises(ValueError):
        Retention(keep_best=1)
    with pytest.raises(ValueError):
        Retention(keep_last=0)


def test_non_finite_metric_is_recorded_by_name_and_never_best(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, keep_best=1, best_metric="loss", async_save=False) as m:
        m.save(1, _state(1), metrics={"loss": 0.5}, force=True)
        m.save(2, _state(2), metrics={"loss": float("nan")}, force=True)
        m.save(3, _state(3), metrics={"loss": 0.9}, force=True)
    repo = Repository(url)
    assert repo.steps() == [1, 3]  # 1 is best, 3 is newest; nan never ranks
    with pytest.raises(TypeError):
        CheckpointManager(str(tmp_path / "x")).save(1, _state(1), metrics={"loss": "low"}, force=True)


def test_retention_never_deletes_a_step_being_read(tmp_path):
    """A save (and its retention) that runs while this process reads step 1 leaves step 1 alone."""
    url = str(tmp_path / "r")

    class SavesWhileReading(CheckpointManager):
        def _restore_verb(self, target, step, rank_state_policy=None):
            out = super()._restore_verb(target, step, rank_state_policy)
            self.save(3, _state(3), force=True)
            self.wait()
            return out

    with CheckpointManager(url, async_save=False) as m:
        m.save(1, _state(1), force=True)
        m.save(2, _state(2), force=True)
    with SavesWhileReading(url, keep_last=1) as m:
        got = m.restore(step=1)
        assert got.step == 1 and np.array_equal(got.state["w"], _state(1)["w"])
        assert Repository(url).steps() == [1, 3]  # 2 deleted, 1 kept while it was read
    # Broken control: the same retention with no read in progress deletes step 1 too.
    with CheckpointManager(url, keep_last=1) as m:
        m.save(4, _state(4), force=True)
    assert Repository(url).steps() == [4]


def test_restore_falls_back_over_a_damaged_step(tmp_path, caplog):
    url = str(tmp_path / "r")
    with CheckpointManager(url, save_every_steps=5) as m:
        for s in range(1, 16):
            m.save(s, _state(s), extra={"at": s})
    # Control: nothing damaged, the newest step restores and nothing is skipped.
    with CheckpointManager(url) as m:
        got = m.restore(_state(0))
    assert got.step == 15 and got.skipped == () and got.extra == {"at": 15}
    flip_one_shard(url, 15)
    caplog.set_level(logging.WARNING, logger="ckptfmt.manager")
    with CheckpointManager(url) as m:
        got = m.restore(_state(0))
        assert got.step == 10 and np.array_equal(got.state["b"], _state(10)["b"])
        assert [k.step for k in got.skipped] == [15] and got.skipped[0].error == "ChecksumMismatchError"
        assert any("skipped step 15" in r.message for r in caplog.records)
        with pytest.raises(ChecksumMismatchError):  # an explicit step never falls back
            m.restore(_state(0), step=15)
    with CheckpointManager(url, fallback=False) as m, pytest.raises(ChecksumMismatchError):
        m.restore(_state(0))
    # A target that does not match is not damage: no fallback.
    with CheckpointManager(url) as m, pytest.raises(KeyMismatchError):
        m.restore({"nope": None})


def test_restore_missing_step_never_starts_fresh(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url) as m:
        assert m.latest_step() is None
        with pytest.raises(StepNotFoundError):
            m.restore()
        m.save(5, _state(5), force=True)
        with pytest.raises(StepNotFoundError):
            m.restore(step=6)
        assert m.restore(step=5).step == m.latest_step() == 5  # control


def test_close_is_bounded_and_never_shows_a_partial_step(tmp_path):
    url = str(tmp_path / "r")
    big = {"w": np.ones((256, 1024), np.float32)}  # 1 MiB at 1 MiB/s: about 1 s
    m = CheckpointManager(url, close_timeout_s=0.05, options=SaveOptions(max_write_bytes_per_s=1 << 20))
    m.save(1, big, force=True)
    t0 = time.monotonic()
    with pytest.raises(IncompleteSaveError):
        m.close()
    assert time.monotonic() - t0 < 30  # bounded (the bound is the point, not the speed)
    assert Repository(url).steps() == []
    deadline = time.monotonic() + 60  # the save lives on in this process and commits whole
    while Repository(url).steps() != [1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Repository(url).verify(1) > 0
    # Control: a close with time to spare commits and returns.
    with CheckpointManager(str(tmp_path / "ok")) as m2:
        m2.save(1, _state(1), force=True)
    assert Repository(str(tmp_path / "ok")).steps() == [1]


def test_sigterm_sets_preemption_only(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(str(tmp_path / "r")) as m:
        assert not m.reached_preemption(1)  # control
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one is no different
        assert m.reached_preemption(2) and m.reached_preemption(3)
        assert m.save(2, _state(2), force=True)
    assert signal.getsignal(signal.SIGTERM) == before
    assert Repository(str(tmp_path / "r")).steps() == [2]


# ------------------------------------------------------------ two ranks in one process (threads)


class _TwoRanks(TwoRankManager):
    """Rank ``rank`` of 2, blocking saves. Each rank holds and reads rows [4r, 4r+4) of the 8 x 4
    tensor "w", so damage can be seen by one rank only."""

    def __init__(self, url, rank, addrs, **kw):
        super().__init__(url, rank, addrs, async_save=False, **kw)

    def _save_verb(self, step, state, *, extra, metadata, rank_state, blocking, retry=None):
        from ckptfmt import Box, LocalShard, save

        w = state["w"][4 * self._r:4 * self._r + 4]
        shard = LocalShard("w", (8, 4), w.dtype, Box((4 * self._r, 0), (4, 4)), w)
        manifest = save(self.repository, step, [shard], metadata=metadata, coordinator=self._save_coord)
        return lambda: manifest

    def _restore_verb(self, target, step, rank_state_policy=None):
        if target == "wrong" and self._r == 1:
            raise KeyMismatchError("this rank's target does not match", key="w")
        ckpt = self.repository.open(step)
        return {"w": ckpt.read("w", Box((4 * self._r, 0), (4, 4)))}, None, {}


def _two_ranks(url, body, **kw):
    from ckptfmt.coord import free_port

    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    out, errors = [None, None], [None, None]

    def run(rank):
        try:
            with _TwoRanks(url, rank, addrs, **kw) as m:
                out[rank] = body(m)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errors


def test_two_ranks_agree_on_cadence_preemption_and_fallback(tmp_path):
    url = str(tmp_path / "r")

    def train(m):
        seen = []
        for s in range(1, 9):
            if s in ((2, 5) if m.rank == 0 else (3, 6)):
                time.sleep(0.6)  # rank 0's clock says "due" at 2 and 5, rank 1's would at 3 and 6
            seen.append((s, m.should_save(s), m.reached_preemption(s)))
            if seen[-1][1] or s == 8:
                m.save(s, {"w": np.full((8, 4), s, np.float32)}, force=True)
            if s == 3 and m.rank == 1:
                m._sigterm.set()  # what its SIGTERM handler does (handlers are main-thread only)
        return seen

    out, errors = _two_ranks(url, train, save_every_seconds=0.5)
    assert errors == [None, None], errors
    assert out[0] == out[1]  # the same decisions on both ranks, from rank 0's clock and any rank's flag
    assert [s for s, _, p in out[0] if p] == [4, 5, 6, 7, 8]  # control: not before the flag
    due = [s for s, d, _ in out[0] if d]
    assert {2, 5} <= set(due) and Repository(url).steps() == sorted(set(due) | {8})

    flip_one_shard(url, 8, writer=1)  # only rank 1 reads the damaged rows
    out, errors = _two_ranks(url, lambda m: m.restore("all"))
    assert errors == [None, None], errors
    prev = Repository(url).steps()[-2]
    assert [(r.step, [k.step for k in r.skipped]) for r in out] == [(prev, [8]), (prev, [8])]
    assert out[0].skipped[0].error == "ChecksumMismatchError" and out[1].state["w"][0, 0] == prev

    # Rank 0 now sees damage too, while rank 1's target is wrong: a fallback would not cure rank 1,
    # so no rank falls back (each raises its own error) and none waits for the other.
    flip_one_shard(url, 8, writer=0)
    out, errors = _two_ranks(url, lambda m: m.restore("wrong"))
    assert type(errors[0]) is ChecksumMismatchError and type(errors[1]) is KeyMismatchError, errors


def test_steps_metrics_best_and_restore_best(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, save_every_steps=1, async_save=False, best_metric="loss") as m:
        for step, loss in ((1, 0.5), (2, 0.25), (3, float("nan")), (4, 0.75)):
            m.save(step, _state(step), metrics={"loss": loss, "acc": step})
        m.save(5, _state(5))  # no metrics: never the best
        assert m.all_steps() == [1, 2, 3, 4, 5]
        assert m.metrics(2) == {"loss": 0.25, "acc": 2} and m.metrics(5) == {}
        assert np.isnan(m.metrics(3)["loss"])
        assert m.best_step() == 2 and m.best_step("acc", "max") == 4 and m.best_step("absent") is None
        got = m.restore(best=True)
        assert got.step == 2 and np.array_equal(got.state["w"], _state(2)["w"])
        assert m.restore().step == 5  # control: without best, the newest step
        with pytest.raises(StepNotFoundError):
            m.metrics(9)
        with pytest.raises(ValueError):
            m.restore(best=True, step=1)
        with pytest.raises(ValueError):
            m.best_step("loss", "median")
    with CheckpointManager(url, async_save=False) as m:  # no best_metric: restore(best=True) is a usage error
        with pytest.raises(ValueError):
            m.restore(best=True)
        with pytest.raises(ValueError):
            m.best_step()


def test_forced_save_keeps_the_metrics_seen_at_its_step(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, save_every_steps=10, async_save=False, best_metric="loss") as m:
        assert not m.save(3, _state(3), metrics={"loss": 0.1})  # the cadence skips step 3
        assert m.save(3, _state(3), force=True)                 # the preemption save: keeps them
        assert not m.save(4, _state(4), metrics={"loss": 0.2})
        assert m.save(5, _state(5), force=True)  # control: another step's metrics are not carried over
        assert m.save(10, _state(10), metrics={"loss": 0.3})
        assert m.metrics(3) == {"loss": 0.1} and m.metrics(5) == {} and m.best_step() == 3


def test_a_commit_is_in_the_history_before_its_retention_runs(tmp_path):
    """The manager publishes a committed save (history, metrics file) before the retention that
    follows it, which verifies the newest step byte for byte and may take a while; the deletion
    it makes comes after the save that caused it. Control: with no retention nothing is deleted
    and the saves alone are logged, in order."""
    url, log = str(tmp_path / "r"), tmp_path / "m.jsonl"
    with CheckpointManager(url, keep_last=1, metrics_file=str(log)) as m:
        for s in (1, 2, 3):
            m.save(s, _state(s), force=True)
    events = [(x["event"], x["step"]) for x in map(json.loads, log.read_text().splitlines())]
    assert events == [("save", 1), ("save", 2), ("delete", 1), ("save", 3), ("delete", 2)]
    log2 = tmp_path / "m2.jsonl"
    with CheckpointManager(str(tmp_path / "r2"), metrics_file=str(log2)) as m:
        for s in (1, 2, 3):
            m.save(s, _state(s), force=True)
    assert [(x["event"], x["step"]) for x in map(json.loads, log2.read_text().splitlines())] == [
        ("save", 1), ("save", 2), ("save", 3)]
