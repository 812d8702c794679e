"""The one retention planner (ckptfmt.repository._retention) that Repository.gc and the checkpoint manager
share: it counts only restorable steps and never deletes the newest restorable one."""
from __future__ import annotations

import os

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfmt import Repository
from ckptfmt.repository._retention import Retention
from ckptfmt.manager import CheckpointManager


def _state(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((8, 4), step, np.float32)}


def test_a_damaged_newest_step_is_not_counted():
    damaged = {10: "MissingShardError: object is missing"}
    plan = Retention(keep_last=1).plan([1, 2, 3, 10], unrestorable=damaged.get)
    assert plan.steps == [1, 2]  # 3 (the newest restorable) and 10 (newer) are kept
    assert any("step 10 is not restorable" in n for n in plan.notes)
    # Broken control: counting every step, as if all were restorable, keeps only the damaged one.
    assert Retention(keep_last=1).plan([1, 2, 3, 10]).steps == [1, 2, 3]


def test_keep_best_ranks_restorable_steps_only():
    metrics = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.9}
    r = Retention(keep_best=1, best_metric="loss")
    assert r.plan(metrics, metrics.get, unrestorable={1: "truncated"}.get).steps == [1, 3]  # 2 is the best restorable
    assert r.plan(metrics, metrics.get).steps == [2, 3]  # control: 1 is the best when it restores


def test_too_few_restorable_steps_delete_nothing():
    bad = {3: "x", 4: "y"}
    plan = Retention(keep_last=3, keep_every=2).plan([1, 2, 3, 4], unrestorable=bad.get)
    assert plan.steps == [] and any("fewer than --keep-last 3" in n for n in plan.notes)
    assert Retention(keep_every=2).plan([1, 2, 3], unrestorable=lambda s: "gone").steps == []
    assert Retention(keep_every=2).plan([1, 2, 3]).steps == [1]  # control


@given(st.sets(st.integers(0, 40), min_size=1, max_size=12), st.sets(st.integers(0, 40), max_size=6),
       st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(1, 5)),
       st.one_of(st.none(), st.integers(1, 3)), st.sets(st.integers(0, 40), max_size=3))
@settings(max_examples=300, deadline=None)
def test_planner_invariants(steps, damaged, keep_last, keep_every, keep_best, protected):
    r = Retention(keep_last, keep_every, keep_best, "m" if keep_best else None)
    asked: list[int] = []

    def why(s: int) -> str | None:
        asked.append(s)
        return "damaged" if s in damaged else None

    plan = r.plan(steps, lambda s: float(s % 7), protected, unrestorable=why)
    gone = set(plan.steps)
    ok = sorted(s for s in steps if s not in damaged)
    assert len(asked) == len(set(asked))                          # each step judged at most once
    assert gone <= set(steps) and not gone & set(protected) and max(steps) not in gone
    if ok:
        assert ok[-1] not in gone                                  # the newest restorable step stays
    else:
        assert not gone
    if keep_last is not None and gone:                             # the newest keep_last restorable stay
        assert not set(ok[-keep_last:]) & gone and len(ok) >= keep_last
        assert all(s < min(ok[-keep_last:]) for s in gone)
    if keep_every is not None:
        assert not any(s % keep_every == 0 for s in gone)
    if not r.active:
        assert not gone


def _damage_newest(url: str, step: int) -> None:
    """Commit ``step`` from another writer, then lose one of its shard objects."""
    repo = Repository(url)
    CheckpointManager(url, async_save=False).save(step, _state(step), force=True)
    t = repo.manifest(step).tensors["w"]
    os.unlink(os.path.join(url, t.object_key(0)))


def test_manager_keeps_older_steps_when_the_newest_is_damaged(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, async_save=False) as m:
        m.save(1, _state(1), force=True)
        m.save(2, _state(2), force=True)
    _damage_newest(url, 10)
    with CheckpointManager(url, keep_last=1, async_save=False) as m:
        m.save(3, _state(3), force=True)
    assert Repository(url).steps() == [3, 10]  # 3 is the newest restorable step
    Repository(url).verify(3)


def test_control_manager_counting_every_step_deletes_the_good_ones(tmp_path):
    url = str(tmp_path / "r")
    with CheckpointManager(url, async_save=False) as m:
        m.save(1, _state(1), force=True)
    _damage_newest(url, 10)

    class Blind(CheckpointManager):  # the manager's old rule: every committed step counts
        def _unrestorable(self, step: int) -> str | None:
            return None

        def _unverified(self, step: int) -> str | None:
            return None

    with Blind(url, keep_last=1, async_save=False) as m:
        m.save(3, _state(3), force=True)
    assert Repository(url).steps() == [10]  # nothing restorable is left


def test_a_step_is_deleted_only_while_a_newer_kept_step_verifies():
    flipped = {3: "ChecksumMismatchError: chunk crc32c differs"}
    asked: list[int] = []

    def verify(s: int) -> str | None:
        asked.append(s)
        return flipped.get(s)

    plan = Retention(keep_last=1).plan([1, 2, 3], unverified=verify)
    assert plan.steps == [1] and asked == [3, 2]  # 3 fails, so 2 is counted, and verifies
    assert any("step 3 is not restorable (fails verification" in n for n in plan.notes)
    assert Retention(keep_last=1).plan([1, 3], unverified=verify).steps == []  # 1 is the newest verified
    assert Retention(keep_last=1).plan([1, 3]).steps == [1]  # broken control: nothing read, 1 goes
    asked.clear()
    assert Retention(keep_last=3).plan([1, 2, 3], unverified=verify).steps == [] and asked == []  # no deletion, no read


@given(st.sets(st.integers(0, 40), min_size=1, max_size=12), st.sets(st.integers(0, 40), max_size=6),
       st.sets(st.integers(0, 40), max_size=6), st.one_of(st.none(), st.integers(1, 4)),
       st.one_of(st.none(), st.integers(1, 5)), st.one_of(st.none(), st.integers(1, 3)))
@settings(max_examples=300, deadline=None)
def test_every_deleted_step_is_older_than_a_kept_verified_step(steps, damaged, flipped, keep_last, keep_every,
                                                               keep_best):
    r = Retention(keep_last, keep_every, keep_best, "m" if keep_best else None)
    verified: list[int] = []

    def verify(s: int) -> str | None:
        if s in flipped:
            return "flipped"
        verified.append(s)
        return None

    plan = r.plan(steps, lambda s: float(s % 7), unrestorable=lambda s: "damaged" if s in damaged else None,
                  unverified=verify)
    gone = set(plan.steps)
    kept_good = [s for s in verified if s in steps and s not in gone and s not in damaged]
    if gone:
        assert kept_good and all(s < max(kept_good) for s in gone)
    good = sorted(s for s in steps if s not in damaged and s not in flipped)
    if good:
        assert good[-1] not in gone  # the newest step that restores and verifies survives
