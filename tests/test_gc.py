"""gc against a hostile or unlucky repository (FORMAT.md 4.2-4.5, 10; issue 12 part A).

Real file system (links, mtimes, sparse files) and the memory kvstore; every check has a control
that shows the same gc does collect, or does count, what it should.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckptfmt import (Box, InvalidManifestError, LocalShard, NotARepositoryError, Repository, StepNotFoundError,
                     save)
from ckptfmt.manifest import MARKER_BYTES, MARKER_KEY, manifest_key
from ckptfmt.repository import _gc

OLD = time.time() - 86400
STALE_ID = "000000000009-20200101T000000-0000dead"


def shards(step, n=8):
    x = (np.arange(n * 4, dtype=np.float32) + step).reshape(n, 4)
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


def age(path: Path) -> None:
    """mtime a day back for ``path`` and everything below it, links themselves (not their targets)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for n in dirs + files:
            os.utime(os.path.join(root, n), (OLD, OLD), follow_symlinks=False)
    os.utime(path, (OLD, OLD), follow_symlinks=False)


def files(path: Path, n: int = 3) -> Path:
    (path / "sub").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"f{i}").write_bytes(b"precious" * 100)
    (path / "sub" / "g").write_bytes(b"precious")
    return path


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def stale_save(root: Path, sid: str = STALE_ID, *, lease: bool = True) -> Path:
    d = root / "saves" / sid
    (d / "t" / "000000" / "c").mkdir(parents=True)
    (d / "t" / "000000" / "c" / "0").write_bytes(b"partial")
    if lease:
        (d / "LEASE").write_text(json.dumps({"heartbeat_unix": 0.0, "save_id": sid, "step": 9, "world": 1}))
    age(d)
    return d


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    for s in (1, 2):
        save(str(root), s, shards(s))
    return root


# ------------------------------------------------------------------- item 1: symbolic links


def test_gc_never_follows_a_link_under_saves(repo, tmp_path):
    outside = files(tmp_path / "data")
    age(outside)
    before = tree(outside)
    (repo / "saves" / "evil").symlink_to(outside, target_is_directory=True)
    (repo / "saves" / "000000000004-20200101T000000-0000beef").symlink_to(outside, target_is_directory=True)
    stale = stale_save(repo)                                    # control: a real stale save
    (stale / "t" / "link").symlink_to(outside, target_is_directory=True)
    age(stale)
    report = Repository(str(repo)).gc(grace_s=0)
    assert tree(outside) == before                             # nothing outside was touched
    assert (repo / "saves" / "evil").is_symlink()              # the foreign link itself stays too
    assert "saves/evil (symbolic link)" in report.foreign
    assert "saves/000000000004-20200101T000000-0000beef (symbolic link)" in report.foreign
    assert report.removed_saves == [STALE_ID] and not stale.exists()  # its inner link went, not the target
    for s in (1, 2):
        Repository(str(repo)).verify(s)


def test_a_leaseless_save_is_aged_by_lstat_not_through_its_link(repo, tmp_path):
    fresh = files(tmp_path / "fresh")                           # written just now
    d = repo / "saves" / STALE_ID
    d.mkdir()
    (d / "link").symlink_to(fresh, target_is_directory=True)
    age(d)                                                      # the link itself is a day old
    report = Repository(str(repo)).gc(grace_s=600)
    assert report.removed_saves == [STALE_ID] and tree(fresh) == ["f0", "f1", "f2", "sub", "sub/g"]
    # Control: a leaseless save with a file written just now is in progress.
    young = repo / "saves" / "000000000009-20200101T000000-0000beef"
    young.mkdir()
    (young / "x").write_bytes(b"just written")
    report = Repository(str(repo)).gc(grace_s=600)
    assert report.in_progress == [young.name] and young.exists()


def test_saves_folder_that_is_a_link_is_not_collected(repo, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(repo / "saves"), elsewhere)
    stale_save(elsewhere.parent, STALE_ID)  # tmp_path/saves/<id>: a stale save, as a collector would see it
    (repo / "saves").symlink_to(tmp_path / "saves", target_is_directory=True)
    report = Repository(str(repo)).gc(grace_s=0)
    assert report.foreign == ["saves/"] and report.problems and (tmp_path / "saves" / STALE_ID).exists()


def test_delete_of_a_step_whose_save_is_a_link_removes_only_the_link(repo, tmp_path):
    r = Repository(str(repo))
    sid = r.manifest(1).save_id
    copy = tmp_path / "copy"
    shutil.move(str(repo / "saves" / sid), copy)
    (repo / "saves" / sid).symlink_to(copy, target_is_directory=True)
    r.delete(1)
    assert not os.path.lexists(repo / "saves" / sid) and (copy / "p").is_dir()
    assert r.steps() == [2]


# ----------------------------------------------------------- item 2: is this a repository?


def test_gc_refuses_a_folder_that_is_not_a_repository(tmp_path):
    home = tmp_path / "home"
    files(home / "saves" / "photos")
    old = files(home / "saves" / STALE_ID, 1)
    age(old)
    before = tree(home)
    with pytest.raises(NotARepositoryError):
        Repository(str(home)).gc(grace_s=0)
    assert tree(home) == before
    # Control: the same folder with the marker is a repository: the stale save goes, photos stays.
    (home / MARKER_KEY).write_bytes(MARKER_BYTES)
    report = Repository(str(home)).gc(grace_s=0)
    assert report.removed_saves == [STALE_ID] and report.foreign == ["saves/photos"]
    assert (home / "saves" / "photos" / "f0").exists()


def test_first_save_writes_the_marker_once(repo_url):
    r = Repository(repo_url)
    save(r, 1, shards(1))
    value, gen = r.storage.read_with_generation([MARKER_KEY])[0]
    assert value == MARKER_BYTES
    save(r, 2, shards(2))
    assert r.storage.read_with_generation([MARKER_KEY])[0] == (value, gen)  # never rewritten


def test_a_repository_without_marker_is_recognised_by_a_valid_manifest(repo, tmp_path):
    (repo / MARKER_KEY).unlink()                                # written before revision 1.0.2
    stale = stale_save(repo)
    assert Repository(str(repo)).gc(grace_s=0).removed_saves == [STALE_ID] and not stale.exists()
    # Control: a damaged manifest alone does not make a repository.
    other = tmp_path / "other"
    (other / "manifests").mkdir(parents=True)
    (other / "manifests" / f"{1:020d}.json").write_text("{not json")
    stale = stale_save(other)
    with pytest.raises(NotARepositoryError):
        Repository(str(other)).gc(grace_s=0)
    assert stale.exists()


def test_only_names_of_the_save_id_form_are_collected(repo):
    photos = files(repo / "saves" / "photos")
    age(photos)
    stale = stale_save(repo, lease=False)
    report = Repository(str(repo)).gc(grace_s=0)
    assert report.removed_saves == [STALE_ID] and not stale.exists()
    assert report.foreign == ["saves/photos"] and tree(photos) == ["f0", "f1", "f2", "sub", "sub/g"]


# ------------------------------------------------------------------ item 3: retention


def _damage(r: Repository, step: int, how: str) -> None:
    if how == "truncated":
        data = r.storage.read(manifest_key(step))
        r.storage.write(manifest_key(step), data[: len(data) // 2])
    else:  # one shard object of the step is missing
        t = r.manifest(step).tensors["x"]
        r.storage.delete(t.object_key(0))


@pytest.mark.parametrize("how", ["truncated", "data-missing"])
def test_retention_counts_only_restorable_steps(repo_url, how, monkeypatch):
    r = Repository(repo_url)
    for s in (1, 2, 3):
        save(r, s, shards(s))
    _damage(r, 3, how)
    report = r.gc(keep_last=1, grace_s=0)
    assert report.removed_steps == [1] and r.steps() == [2, 3]
    assert any("step 3 is not restorable" in p for p in report.problems)
    np.testing.assert_array_equal(r.open(2).read("x"), shards(2)[0].data)
    r.verify(2)


class _Trusting(_gc.GcChecks):
    """Broken: every manifest is trusted, and nothing is read."""

    def unrestorable(self, repo, step):
        return None

    def unverified(self, repo, step, **kw):
        return None


def test_retention_control_trusting_manifests_leaves_nothing_restorable(repo_url):
    r = Repository(repo_url)
    for s in (1, 2, 3):
        save(r, s, shards(s))
    _damage(r, 3, "truncated")
    report = _gc.collect(r, keep_last=1, grace_s=0, keep_every=None, checks=_Trusting())
    assert report.removed_steps == [1, 2] and r.steps() == [3]
    with pytest.raises(InvalidManifestError):
        r.verify(3)  # ... and no step is left that restores


def test_retention_removes_nothing_when_too_few_steps_restore(repo_url):
    r = Repository(repo_url)
    for s in (1, 2, 3):
        save(r, s, shards(s))
    for s in (2, 3):
        _damage(r, s, "data-missing")
    report = r.gc(keep_last=2, grace_s=0)
    assert report.removed_steps == [] and r.steps() == [1, 2, 3]
    assert any("fewer than --keep-last 2" in p for p in report.problems)
    assert r.gc(keep_last=1, grace_s=0).removed_steps == []  # step 1 is the newest restorable one
    r.verify(1)


# -------------------------------------------------------- item 5: one save id, two manifests


def test_a_copied_manifest_is_rejected_and_keeps_its_save_alive(repo_url):
    r = Repository(repo_url)
    for s in (1, 2):
        save(r, s, shards(s))
    sid = r.manifest(1).save_id
    r.storage.write(manifest_key(5), r.storage.read(manifest_key(1)))
    assert r.steps() == [1, 2, 5] and r.latest() == 5
    for read in (lambda: r.manifest(5), lambda: r.open(5), lambda: r.open()):
        with pytest.raises(InvalidManifestError, match="different step"):
            read()
    r.delete(1)                                                  # the copy still mentions its save id
    assert r.steps() == [2, 5] and r.storage.list(f"saves/{sid}/")
    r.gc(grace_s=0, keep_last=1)
    assert r.storage.list(f"saves/{sid}/")
    # Control: without the copy the save is unreferenced, and gc collects it.
    r.storage.delete(manifest_key(5))
    assert sid in r.gc(grace_s=0).removed_saves and not r.storage.list(f"saves/{sid}/")
    r.verify(2)


def test_delete_keeps_objects_that_a_damaged_manifest_mentions(repo_url):
    r = Repository(repo_url)
    save(r, 1, shards(1))
    sid = r.manifest(1).save_id
    data = r.storage.read(manifest_key(1))
    r.storage.write(manifest_key(7), data[: len(data) // 2])     # a damaged copy that still names it
    r.delete(1)
    assert r.storage.list(f"saves/{sid}/")
    r.delete(7)                                                  # a damaged manifest does not block delete
    assert r.steps() == [] and r.storage.list(f"saves/{sid}/")  # ... and its objects wait for gc
    with pytest.raises(StepNotFoundError):
        r.delete(7)


# ------------------------------------------------------------------ item 9: never stuck


def test_gc_is_not_stuck_by_stray_objects_or_a_damaged_manifest(repo_url):
    r = Repository(repo_url)
    for s in (1, 2):
        save(r, s, shards(s))
    r.storage.write("saves/.DS_Store", b"Bud1")
    r.storage.write(manifest_key(1), b"{not json")
    r.storage.write(f"saves/{STALE_ID}/LEASE", json.dumps({"heartbeat_unix": 0.0, "save_id": STALE_ID}).encode())
    r.storage.write(f"saves/{STALE_ID}/t/000000/c/0", b"partial")
    for _ in range(2):  # and again: nothing that stays in the repository makes gc fail
        report = r.gc(grace_s=0)
        assert report.foreign == ["saves/.DS_Store"]
    assert not r.storage.list(f"saves/{STALE_ID}/") and r.storage.read("saves/.DS_Store") == b"Bud1"
    r.delete(1)                                                  # the damaged step can be deleted
    assert r.steps() == [2]
    r.verify(2)


# ---------------------------------------------------------------- item 12: stray manifest names


def test_names_that_are_not_steps_are_never_listed(repo_url):
    r = Repository(repo_url)
    save(r, 2, shards(2))
    m2 = r.storage.read(manifest_key(2))
    r.storage.write("manifests/99999999999999999999.json", m2)  # above 2^63 - 1
    r.storage.write("manifests/2.json", m2)
    assert r.steps() == [2] and r.latest() == 2
    np.testing.assert_array_equal(r.open().read("x"), shards(2)[0].data)
    assert r.foreign_manifests() == ["manifests/2.json", "manifests/99999999999999999999.json"]
    r.gc(grace_s=0)
    assert r.storage.read("manifests/99999999999999999999.json") == m2  # reported, never deleted
    # Control: 2^63 - 1 itself is a valid step name.
    r.storage.write(manifest_key((1 << 63) - 1), m2)
    assert r.steps() == [2, (1 << 63) - 1]


# ---------------------------------------------------------------- lease states (FORMAT.md 10.2)


def _lease(r: Repository, sid: str, step: int, state: str, beat: float) -> None:
    r.storage.write(f"saves/{sid}/LEASE", json.dumps({"heartbeat_unix": beat, "save_id": sid, "step": step,
                                                      "world": 1, "state": state}).encode())
    r.storage.write(f"saves/{sid}/t/000000/c/0", b"partial")


def test_gc_judges_each_lease_state(repo_url):
    r = Repository(repo_url)
    save(r, 1, shards(1))
    now = time.time()
    ids = {name: f"{step:012d}-20200101T000000-{i:08x}" for i, (name, step) in enumerate(
        [("committing-fresh", 5), ("committing-stale", 6), ("committing-lost", 1), ("collected", 7),
         ("writing-stale", 8), ("writing-fresh", 9)])}
    _lease(r, ids["committing-fresh"], 5, "committing", now)
    _lease(r, ids["committing-stale"], 6, "committing", 0.0)  # slot 6 empty: its writer may still commit
    _lease(r, ids["committing-lost"], 1, "committing", 0.0)   # slot 1 holds another save's manifest
    _lease(r, ids["collected"], 7, "collected", now)          # claimed by an earlier, interrupted gc
    _lease(r, ids["writing-stale"], 8, "writing", 0.0)
    _lease(r, ids["writing-fresh"], 9, "writing", now)
    report = r.gc(grace_s=60)
    assert sorted(report.removed_saves) == sorted([ids["committing-lost"], ids["collected"], ids["writing-stale"]])
    assert report.in_progress == sorted([ids["committing-fresh"], ids["writing-fresh"]])
    assert report.uncertain == [ids["committing-stale"]]
    assert any("may still commit" in p for p in report.problems)
    for name in ("committing-fresh", "committing-stale", "writing-fresh"):
        assert r.storage.read(f"saves/{ids[name]}/t/000000/c/0") == b"partial"
    r.verify(1)


# ----------------------------------------------------- item 6 (gc part): bounded manifest reads

_RSS = r"""
import json, resource, sys
from ckptfmt import Repository
rep = Repository(sys.argv[1]).gc(grace_s=0)
# VmHWM, this process's own peak: ru_maxrss starts from the parent's RSS at fork on Linux, so a child
# of a large process (a pytest -n worker after heavy tests) would report the parent's peak.
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")]
kib = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rss_mib": kib / 1024, "report": rep.to_json()}))
"""


def test_gc_never_reads_an_oversized_manifest(repo):
    sid = Repository(str(repo)).manifest(1).save_id
    with open(repo / "manifests" / f"{1:020d}.json", "r+b") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB, 16 x the 256 MiB cap
    out = subprocess.run([sys.executable, "-c", _RSS, str(repo)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["rss_mib"] < 768, doc   # reading the manifest would take 4 GiB (the cap alone 256 MiB)
    assert doc["report"]["uncertain"] == [sid]                  # its save is kept: the manifest may be its
    assert (repo / "saves" / sid).is_dir()


def test_manifests_are_scanned_in_pieces_without_missing_a_save_id(repo_url, monkeypatch):
    r = Repository(repo_url)
    for s in (1, 2):
        save(r, s, shards(s))
    ids = {s: r.manifest(s).save_id for s in (1, 2)}
    whole = {s: _gc._scan_manifest(r, s, set(ids.values())) for s in (1, 2)}
    for piece in (37, 64, 101):  # ids fall across piece boundaries at many offsets
        monkeypatch.setattr(_gc, "SCAN_PIECE", piece)
        for s in (1, 2):
            got = _gc._scan_manifest(r, s, set(ids.values()))
            assert got == whole[s] and got.declared == {ids[s]} and got.mentions == {ids[s]}
    monkeypatch.setattr(_gc, "SCAN_PIECE", 64)  # control: a manifest over a (small) cap is not read
    r.max_manifest_bytes = 100
    assert _gc._scan_manifest(r, 1, set(ids.values())).status == "over_cap"
