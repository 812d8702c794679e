"""Collectors racing incremental saves, forced deterministically (FORMAT.md 4.4, 8.4, 10.3; issue 24
items 2 and 3).

Each test pauses real calls of a real storage (a :class:`DelegatingStorage` that runs a step of the
other actor at one exact call) and runs the same interleaving twice: with the protocol, the step
that referenced the collected save restores; with the broken control (the check order before
1.2.1, or one part of the fence taken out), it loses its objects. Runs on file and memory here and
on S3 in tests/test_s3.py (every test taking ``repo_url``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest

from ckptfmt import Box, LocalShard, Repository, save
from ckptfmt.repository import _gc
from ckptfmt.errors import MissingShardError
from ckptfmt.layout import lease_key, manifest_key, save_prefix
from ckptfmt.storage import DelegatingStorage, open_storage

WAIT_S = 120.0


def shards(value: int = 1) -> list[LocalShard]:
    x = (np.arange(8 * 4, dtype=np.float32) + value).reshape(8, 4)
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


class Hooked(DelegatingStorage):
    """Runs ``fn`` once, before (or after) the first call of ``name`` whose argument ``match``
    accepts: the other actor's steps happen exactly there."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.hooks: list[tuple[str, str, Callable[[Any], bool], Callable[[], None]]] = []

    def at(self, name: str, match: Callable[[Any], bool], fn: Callable[[], None], when: str = "before") -> None:
        self.hooks.append((name, when, match, fn))

    def _fire(self, name: str, arg: Any, when: str) -> None:
        for h in list(self.hooks):
            if h[0] == name and h[1] == when and h[2](arg):
                self.hooks.remove(h)
                h[3]()

    def list(self, prefix: str = "") -> list[str]:
        self._fire("list", prefix, "before")
        return super().list(prefix)

    def scan_children(self, prefix: str, **kw: Any) -> Any:
        self._fire("scan_children", prefix, "before")
        out = super().scan_children(prefix, **kw)
        self._fire("scan_children", prefix, "after")
        return out

    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        self._fire("write_if", key, "before")
        return super().write_if(key, data, if_equal)


def nth(n: int, pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    seen = [0]

    def match(arg: Any) -> bool:
        if pred(arg):
            seen[0] += 1
        return seen[0] == n and pred(arg)
    return match


class PausedSave:
    """A real incremental save in a thread, paused right before its commit (its lease pins the
    previous step, which it has re-read and references): ``finish()`` lets it commit."""

    class _Storage(DelegatingStorage):
        def __init__(self, inner: Any, step: int) -> None:
            super().__init__(inner)
            self.step, self.reached, self.go = step, threading.Event(), threading.Event()

        def create_if_absent(self, key: str, data: bytes) -> bool:
            if key == manifest_key(self.step):
                self.reached.set()
                assert self.go.wait(WAIT_S)
            return super().create_if_absent(key, data)

    def __init__(self, url: str, step: int, value: int = 1) -> None:
        self.storage = self._Storage(open_storage(url), step)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(Repository(url, storage=self.storage), step, value))
        self.thread.start()
        assert self.storage.reached.wait(WAIT_S), "the save did not reach its commit"

    def _run(self, repo: Repository, step: int, value: int) -> None:
        try:
            save(repo, step, shards(value))
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def finish(self) -> None:
        self.storage.go.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and self.error is None, self.error


def _restores(url: str, step: int) -> bool:
    try:
        r = Repository(url)
        np.testing.assert_array_equal(r.open(step).read("x"), shards(1)[0].data)
        r.verify(step)
        return True
    except MissingShardError:
        return False


def _delete_in_the_old_order(r: Repository, step: int) -> None:
    """Repository.delete before 1.2.1: manifests first, then leases, and no claim."""
    sid = r.manifest(step).save_id
    r.storage.delete(manifest_key(step))
    if not _gc.referenced_elsewhere(r, sid, but=step) and not _gc.pinned_by_a_save(r, sid):
        r.storage.delete_prefix(save_prefix(sid))


# ------------------------------------------------------------ item 2: delete racing a save


@pytest.mark.parametrize("order", ["1.2.1", "old (control)"])
def test_delete_racing_a_save_that_pinned_the_step(repo_url, order):
    """Save 2 pins and references step 1; delete(1) runs; save 2 commits (and drops its lease)
    between delete's two checks."""
    save(repo_url, 1, shards(1))
    sid1 = Repository(repo_url).manifest(1).save_id
    s2 = PausedSave(repo_url, 2)
    st = Hooked(open_storage(repo_url))
    st.at("scan_children", lambda p: p == "saves/", s2.finish)  # the lease read: the save commits first
    r = Repository(repo_url, storage=st)
    (r.delete if order == "1.2.1" else lambda s: _delete_in_the_old_order(r, s))(1)
    assert not st.hooks, "the interleaving did not happen"
    assert sid1 in Repository(repo_url).manifest(2).referenced_saves
    assert Repository(repo_url).steps() == [2]
    assert _restores(repo_url, 2) == (order == "1.2.1")


def test_delete_with_no_save_racing_removes_the_objects(repo_url):
    """Control: with nothing pinning or naming it, delete removes the save, claim and all."""
    for s in (1, 2):
        save(repo_url, s, shards(s))
    r = Repository(repo_url)
    sid1 = r.manifest(1).save_id
    r.delete(1)
    assert r.steps() == [2] and not r.storage.list(save_prefix(sid1))
    r.verify(2)


# ------------------------------------------------------------- item 3: gc and a second actor


def _no_last_look(repo: Any, names: Any, claimed: set[str], retired: Any, report: Any) -> None:
    """Broken: gc before 1.2.1 deleted what it claimed without looking again."""
    for sid in claimed:
        repo.storage.delete_prefix(save_prefix(sid))
        report.removed_saves.append(sid)


def _leases_only(repo: Any, names: Any, claimed: set[str], retired: Any, report: Any) -> None:
    """Broken: a last look at the leases only ("re-read the leases after the scan")."""
    pins = _gc.lease_pins(repo.storage) or set()
    _no_last_look(repo, names, claimed - pins, retired, report)


def _gc_run(repo: Repository, variant: str, broken: Callable[..., None]) -> _gc.GcReport:
    """gc as a user runs it; in a broken control, gc given checks whose last look is ``broken``."""
    if variant == "1.2.1":
        return repo.gc(grace_s=0)

    class Weaker(_gc.GcChecks):
        def last_look(self, *a: Any) -> None:
            broken(*a)

    return _gc.collect(repo, grace_s=0, keep_last=None, keep_every=None, checks=Weaker())


@pytest.mark.parametrize("variant", ["1.2.1", "no last look (control)"])
def test_gc_that_read_the_leases_before_the_save_began(repo_url, variant):
    """The issue's interleaving: gc reads the leases; save 2 begins and pins step 1; another actor
    deletes step 1 (keeping its objects: save 2's lease pins them); gc scans the manifests and
    finds step 1 named by none; save 2 commits after gc is done."""
    save(repo_url, 1, shards(1))
    sid1 = Repository(repo_url).manifest(1).save_id
    pending: list[PausedSave] = []

    def save_begins_and_step_1_is_deleted() -> None:
        pending.append(PausedSave(repo_url, 2))
        Repository(repo_url).delete(1)
        assert Repository(repo_url).storage.list(save_prefix(sid1)), "delete kept what the lease pins"

    st = Hooked(open_storage(repo_url))
    st.at("list", nth(2, lambda p: p == "manifests/"), save_begins_and_step_1_is_deleted)  # gc's scan
    report = _gc_run(Repository(repo_url, storage=st), variant, _no_last_look)
    pending[0].finish()
    assert Repository(repo_url).steps() == [2] and sid1 in Repository(repo_url).manifest(2).referenced_saves
    assert _restores(repo_url, 2) == (variant == "1.2.1")
    if variant == "1.2.1":
        assert sid1 in report.pinned and sid1 not in report.removed_saves
        # Once save 2 has committed, step 2 names the objects: a later gc keeps them too.
        assert sid1 not in Repository(repo_url).gc(grace_s=0).removed_saves and _restores(repo_url, 2)


@pytest.mark.parametrize("variant", ["1.2.1", "leases only (control)"])
def test_gc_with_a_whole_lease_lifetime_between_its_two_lease_reads(repo_url, variant):
    """Save 2 pins step 1 after gc's first lease read; another actor deletes step 1; gc scans;
    save 2 commits and drops its lease before gc's last lease read: only the manifests, read
    again after the leases, show that step 2 references step 1's objects."""
    save(repo_url, 1, shards(1))
    sid1 = Repository(repo_url).manifest(1).save_id
    pending: list[PausedSave] = []

    def save_begins_and_step_1_is_deleted() -> None:
        pending.append(PausedSave(repo_url, 2))
        Repository(repo_url).delete(1)

    st = Hooked(open_storage(repo_url))
    st.at("list", nth(2, lambda p: p == "manifests/"), save_begins_and_step_1_is_deleted)
    st.at("write_if", lambda k: k == lease_key(sid1), lambda: pending[0].finish())  # gc's claim of step 1
    _gc_run(Repository(repo_url, storage=st), variant, _leases_only)
    assert not st.hooks, "the interleaving did not happen"
    assert sid1 in Repository(repo_url).manifest(2).referenced_saves
    assert _restores(repo_url, 2) == (variant == "1.2.1")


@pytest.mark.parametrize("variant", ["1.2.1", "no claim check in the save (control)"])
def test_gc_against_a_chain_of_saves_and_deletes(repo_url, variant, monkeypatch):
    """Leases, manifests, leases, manifests is not enough alone: save 2 pins step 1 and commits
    after gc's scan; after gc's last lease listing, save 3 pins step 2 (and so step 1's objects)
    and step 2 is deleted; gc's last scan sees neither step. Save 3 must then find step 1's save
    claimed and write those shards itself."""
    save(repo_url, 1, shards(1))
    sid1 = Repository(repo_url).manifest(1).save_id
    if variant != "1.2.1":
        monkeypatch.setattr("ckptfmt.session.excluded", lambda st, ids: frozenset())
    pending: dict[int, PausedSave] = {}

    def save_2_begins_and_step_1_is_deleted() -> None:
        pending[2] = PausedSave(repo_url, 2)
        Repository(repo_url).delete(1)

    def save_3_begins_and_step_2_is_deleted() -> None:
        pending[3] = PausedSave(repo_url, 3)
        Repository(repo_url).delete(2)

    st = Hooked(open_storage(repo_url))
    st.at("list", nth(2, lambda p: p == "manifests/"), save_2_begins_and_step_1_is_deleted)
    st.at("write_if", lambda k: k == lease_key(sid1), lambda: pending[2].finish())
    st.at("scan_children", nth(2, lambda p: p == "saves/"), save_3_begins_and_step_2_is_deleted, when="after")
    report = Repository(repo_url, storage=st).gc(grace_s=0)
    pending[3].finish()
    assert not st.hooks, "the interleaving did not happen"
    assert sid1 in report.removed_saves  # nothing names or pins it any more by the last look
    assert Repository(repo_url).steps() == [3]
    assert _restores(repo_url, 3) == (variant == "1.2.1")
    if variant == "1.2.1":
        assert sid1 not in Repository(repo_url).manifest(3).referenced_saves
