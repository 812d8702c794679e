"""Faults of kind ``"gc"``: a hostile or unlucky repository, then ``gc`` (FORMAT.md 4.4, 4.5, 10).

Each action edits a fresh copy of the base repository (steps 1 and 2) and returns a
:class:`GcAttempt`: where gc runs, with which retention, what must survive it (objects outside
the repository, foreign objects, objects a manifest still names), what it must remove (a real
abandoned save, as the control that gc did run), and which foreign names it must report.
:func:`judge` runs gc and fills the outcome row:

* **typed**: gc raised exactly the expected error (``Fault.expect``), or nothing when none is;
* **exposed**: gc destroyed something it must not (a protected object, or an object that a
  step still listed after gc references);
* **prior intact**: the newest good step is listed, verifies and restores bit for bit;
* **gc clean**: gc removed what it should and reported the foreign objects by name.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfmt.repository._verified import RECORD_NAME
from ckptfmt_tools.faults._peak import peak_meter
from ckptfmt_tools.faults._scene import Scene

__all__ = ["GcAttempt", "judge", "symlink_escape", "not_a_repository", "retention_newest_truncated",
           "retention_newest_data_missing", "stray_objects", "shared_save_id", "oversized_manifest"]

_OLD = time.time() - 86400.0  # a day ago: older than any grace period gc runs with here
_ABANDONED = "000000000003-20200101T000000-0000dead"


@dataclass
class GcAttempt:
    where: str
    url: str | None = None                  # gc this URL instead of the scene's repository
    keep_last: int | None = None
    grace_s: float = 0.0
    protected: tuple[Path, ...] = ()        # must survive gc unchanged
    collected: tuple[Path, ...] = ()        # must be gone after gc
    foreign: tuple[str, ...] = ()           # must be listed in GcReport.foreign
    prior: int = 2                          # must stay listed and restorable
    latest: int | None = 2                  # what latest() must return after gc (None: not checked)
    notes: list[str] = field(default_factory=list)
    operation: Any = None                   # run this instead of gc (a delete racing a save, say)
    prior_data: int | None = None           # the step whose data ``prior`` holds (None: ``prior``)


def _age(path: Path) -> None:
    """Set the mtime of ``path`` and of everything below it a day back, links themselves included."""
    for root, dirs, files in os.walk(path, topdown=False):
        for n in dirs + files:
            os.utime(os.path.join(root, n), (_OLD, _OLD), follow_symlinks=False)
    os.utime(path, (_OLD, _OLD), follow_symlinks=False)


def _files(path: Path, n: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"data-{i}.bin").write_bytes(os.urandom(4096))
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "nested.bin").write_bytes(b"keep me")
    return path


def _abandoned(s: Scene) -> Path:
    """A real abandoned save: a stale lease and one object, a day old. gc must collect it."""
    d = s.root / "saves" / _ABANDONED
    (d / "t" / "000000" / "c").mkdir(parents=True)
    (d / "t" / "000000" / "c" / "0").write_bytes(b"partial shard")
    (d / "LEASE").write_text(json.dumps({"heartbeat_unix": 0.0, "save_id": _ABANDONED, "step": 3, "world": 2}))
    _age(d)
    return d


def _save_dir(s: Scene, step: int) -> Path:
    return s.root / "saves" / s.manifest_doc(step)["save_id"]


def symlink_escape(s: Scene) -> GcAttempt:
    targets = [_files(s.root.parent / f"outside-{i}") for i in range(3)]
    for t in targets:
        _age(t)
    evil = s.root / "saves" / "evil"
    named = s.root / "saves" / "000000000004-20200101T000000-0000beef"  # a link with a save id's name
    evil.symlink_to(targets[0], target_is_directory=True)
    named.symlink_to(targets[1], target_is_directory=True)
    stale = _abandoned(s)
    (stale / "t" / "link").symlink_to(targets[2], target_is_directory=True)
    for link in (evil, named, stale / "t" / "link"):
        os.utime(link, (_OLD, _OLD), follow_symlinks=False)
    return GcAttempt("saves/evil and saves/<a save id> -> folders outside the repository (files a day old); an "
                     "abandoned save holds a link to a third", protected=(*targets, evil, named),
                     collected=(stale,), foreign=("saves/evil (symbolic link)", f"saves/{named.name} (symbolic link)"))


def not_a_repository(s: Scene) -> GcAttempt:
    home = s.root.parent / "home"
    _files(home / "saves" / "photos")                                           # written a second ago
    old = _files(home / "saves" / "000000000001-20200101T000000-00c0ffee", 1)  # a save-id name, a day old
    _age(old)
    return GcAttempt("gc of a home folder holding saves/photos/... and an old saves/<save-id-like>/ (no "
                     "ckptfmt.json, no manifests)", url=str(home), protected=(home,))


def _step3_from_step2(s: Scene, edit: Any) -> None:
    doc = s.manifest_doc(2)
    doc["step"] = 3
    edit(doc)
    s.write_manifest_doc(3, doc)


def retention_newest_truncated(s: Scene) -> GcAttempt:
    _step3_from_step2(s, lambda d: None)
    p = s.manifest_path(3)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return GcAttempt("gc --keep-last 1 while the newest step (3) has a truncated manifest", keep_last=1,
                     protected=(_save_dir(s, 2), p), collected=(s.manifest_path(1), _save_dir(s, 1)), latest=3)


def retention_newest_data_missing(s: Scene) -> GcAttempt:
    fake = "000000000003-19700101T000000-00000000"

    def edit(doc: dict[str, Any]) -> None:
        old = doc["save_id"]
        text = json.dumps(doc).replace(old, fake)
        doc.clear()
        doc.update(json.loads(text))

    _step3_from_step2(s, edit)
    return GcAttempt("gc --keep-last 1 while the newest step (3) is a valid manifest whose objects are missing",
                     keep_last=1, protected=(_save_dir(s, 2), s.manifest_path(3)),
                     collected=(s.manifest_path(1), _save_dir(s, 1)), latest=3)


def stray_objects(s: Scene) -> GcAttempt:
    ds = s.root / "saves" / ".DS_Store"
    ds.write_bytes(b"\x00\x00\x00\x01Bud1")
    photos = _files(s.root / "saves" / "photos", 1)
    _age(photos)
    notes = s.root / "manifests" / "notes.txt"
    notes.write_text("kept by hand")
    huge = s.root / "manifests" / "99999999999999999999.json"
    shutil.copyfile(s.manifest_path(2), huge)
    kept = _save_dir(s, 1)
    m1 = s.manifest_path(1)
    data = m1.read_bytes()
    m1.write_bytes(data[: len(data) // 2])
    stale = _abandoned(s)
    return GcAttempt("saves/.DS_Store, saves/photos/, manifests/notes.txt, manifests/99999999999999999999.json "
                     "(beyond 2^63-1), step 1's manifest truncated, and an abandoned save",
                     protected=(ds, photos, notes, huge, kept), collected=(stale,),
                     foreign=("saves/.DS_Store", "saves/photos", "manifests/notes.txt",
                              "manifests/99999999999999999999.json"))


def shared_save_id(s: Scene) -> GcAttempt:
    copy = s.root / "manifests" / f"{9:020d}.json"
    shutil.copyfile(s.manifest_path(1), copy)
    kept = _save_dir(s, 1)
    s.manifest_path(1).unlink()
    return GcAttempt("step 1's manifest copied to step 9's name, the original deleted; gc --keep-last 1",
                     keep_last=1, protected=(kept, copy), latest=9)


def oversized_manifest(s: Scene) -> GcAttempt:
    from ckptfmt.manifest import MAX_MANIFEST_BYTES

    cap = s.max_manifest_bytes or MAX_MANIFEST_BYTES
    kept = _save_dir(s, 1)
    p = s.manifest_path(1)
    with open(p, "r+b") as f:  # sparse: the real manifest, then zeros up to the cap + 1
        f.truncate(cap + 1)
    stale = _abandoned(s)
    return GcAttempt(f"step 1's manifest grown to {cap + 1} bytes (cap + 1, sparse); an abandoned save",
                     protected=(kept, p), collected=(stale,))


# ----------------------------------------------------------------------------- judging


def _tree(path: Path) -> dict[str, tuple[str, int | str]]:
    """What lies at ``path``, judged with lstat: {relative path: (kind, size or link target)}.
    A save's verification record (FORMAT.md 10.4) is not part of what must survive unchanged."""
    out: dict[str, tuple[str, int | str]] = {}
    if not os.path.lexists(path):
        return out
    if os.path.islink(path):
        return {".": ("link", os.readlink(path))}
    if path.is_file():
        return {".": ("file", path.stat().st_size)}
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, path)
            if rel == RECORD_NAME:
                continue
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isfile(full):
                out[rel] = ("file", os.path.getsize(full))
            else:
                out[rel] = ("dir", 0)
    return out


def judge(fault: Any, scene: Scene, ctx: Any, out: Any, run_within: Any) -> None:
    """Run gc for a ``"gc"`` fault and judge it (see the module docstring)."""
    from ckptfmt import GcReport, Repository
    from ckptfmt_tools.faults import _data
    from ckptfmt_tools.faults._checks import inventory, prior_intact

    attempt: GcAttempt = fault.action(scene)
    out.where = attempt.where
    out.notes += attempt.notes
    url = attempt.url or scene.url
    kw = {} if scene.max_manifest_bytes is None else {"max_manifest_bytes": scene.max_manifest_bytes}
    before = {p: _tree(p) for p in attempt.protected}
    inv_before = inventory(scene.root)
    peak_grown = peak_meter()
    done, report, exc = run_within(ctx.check_timeout_s, attempt.operation or (lambda: Repository(url, **kw).gc(
        grace_s=attempt.grace_s, keep_last=attempt.keep_last, checks=ctx.gc_checks)))
    grown = peak_grown()
    if not done:
        out.hung = True
        out.raised.append("HANG")
        return
    out.raised.append(type(exc).__name__ if exc is not None else "no error")
    if exc is not None:
        out.message = str(exc)[:300]
    out.typed = (isinstance(exc, fault.expect) if fault.expect else exc is None)
    if not out.typed:
        out.notes.append(f"gc raised {type(exc).__name__}: {str(exc)[:200]}" if exc is not None
                         else f"gc returned instead of raising {[e.__name__ for e in fault.expect]}")
    if grown > 64:
        out.typed = False
        out.notes.append(f"peak RSS grew by {grown} MiB during gc")
    # exposed: something gc had to leave alone is gone or changed
    damage = [f"{p.name}: {sorted(set(b) - set(_tree(p)))[:3] or 'changed'}" for p, b in before.items() if _tree(p) != b]
    inv_after = inventory(scene.root)
    lost = sorted((inv_after.committed & inv_before.save_files) - inv_after.save_files)
    out.exposed = bool(damage or lost)
    out.notes += [f"gc destroyed a protected object: {d}" for d in damage]
    if lost:
        out.notes.append(f"gc removed objects that a listed step references: {lost[:3]}")
    # prior intact, and latest() still what it should be
    repo = scene.repo()
    data_step = attempt.prior if attempt.prior_data is None else attempt.prior_data
    ok, why = prior_intact(repo, attempt.prior, _data.truth(scene.seed, data_step),
                           _data.global_state(scene.seed, data_step))
    if ok and attempt.latest is not None and repo.latest() != attempt.latest:
        ok, why = False, f"latest() is {repo.latest()}, expected {attempt.latest}"
    out.prior_intact = ok
    if not ok:
        out.notes.append(why)
    # gc clean: what had to go is gone, and the foreign objects are named
    left = [str(p.relative_to(scene.root.parent)) for p in attempt.collected if os.path.lexists(p)]
    listed = report.foreign if isinstance(report, GcReport) else []
    unnamed = [n for n in attempt.foreign if n not in listed]
    out.gc_clean = not left and not unnamed
    if left:
        out.notes.append(f"gc left {left}")
    if unnamed:
        out.notes.append(f"gc did not report the foreign objects {unnamed}")
    if isinstance(report, GcReport) and report.problems:
        out.notes.append(f"gc reported {len(report.problems)} problem(s), first: {report.problems[0][:160]}")
