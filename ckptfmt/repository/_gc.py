"""Garbage collection and retention (FORMAT.md 4.4, 4.5, 10).

Order of work in :func:`collect` (10.3):

0. Recognise the repository: the marker ``ckptfmt.json``, or a valid committed manifest. Otherwise
   raise NotARepositoryError before anything is deleted.
1. Retention (``keep_last``): count restorable steps from the newest down (10.4), the newest
   one counted verified byte for byte (:mod:`ckptfmt.repository._verified`; read again, its record
   ignored, when the deletion would leave no older step), and un-commit the older ones,
   manifest first (and their verification records). Their save ids become candidates below.
2. List the names under ``saves/`` without following links (file driver: ``lstat``). Links,
   non-directories and names outside the writer's save-id form are foreign: reported, never
   touched.
3. Read the candidates' leases (bounded, with generations); drop the saves in progress, and keep
   the saves that a live lease pins (``refs``: an incremental save may reference them, 8.4).
4. Only then list ``manifests/`` and read every manifest (one-byte probe, then at most the cap);
   note every save id each one names or mentions.
5. For each candidate left: point-read its step's manifest slot, and claim it: a conditional
   rewrite of its lease to ``collected`` (8.3: this is what a paused leader's commit loses to),
   or, for a save without a lease, a ``collected`` lease created only if absent.
6. The last look (:mod:`ckptfmt.repository._gcfence`): list ``saves/`` again and read every lease, then
   list and scan ``manifests/`` again; a claimed save that either pins or names is kept (it
   stays claimed). Only then delete the others' objects, each lease last, never following links.

What cannot be decided is kept and reported (``uncertain``, ``problems``); nothing here raises
for bad content in the repository.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptfmt import layout
from ckptfmt.repository._gcfence import StoredLease as _StoredLease
from ckptfmt.repository._gcfence import SaveNames, claim, lease_pins, list_saves, pinned_by_leases, remove_save
from ckptfmt.repository._gcfence import stored_lease as _stored_lease
from ckptfmt.repository._recognise import recognise
from ckptfmt.repository._retention import Retention
from ckptfmt.repository._verified import forget, unverified
from ckptfmt.errors import CheckpointError, StorageError
from ckptfmt.layout import (MANIFESTS, SAVES, lease_key, manifest_key, parse_writer_save_id, save_prefix,
                            step_of_manifest_key)
from ckptfmt.storage import NO_VALUE

if TYPE_CHECKING:  # the package's face imports this module
    from ckptfmt.repository import Repository

__all__ = ["GcReport", "GcChecks", "collect", "last_look", "referenced_elsewhere", "pinned_by_a_save", "pinned_by_leases",
           "unrestorable", "remove_unreferenced", "DEFAULT_LEASE_GRACE_S"]

DEFAULT_LEASE_GRACE_S = 600.0  # FORMAT.md 10.2
LEASE_MAX_BYTES = layout.LEASE_MAX_BYTES
MAX_LISTED_FOREIGN = 1000      # the report names this many foreign objects, and counts the rest
SCAN_PIECE = 8 << 20           # gc reads manifests in pieces of this many bytes
_OVERLAP = 256                 # longer than any "save_id" member or save id, so none falls between pieces

#: A manifest's "save_id" member, found in its text without parsing it.
_DECLARED = re.compile(rb'"save_id"\s*:\s*"(' + layout.SAVE_ID_RE.pattern.strip("^$").encode() + rb')"')


@dataclass
class GcReport:
    """What gc did, and what it left alone and why.

    ``removed_steps``: committed steps removed by retention. ``removed_saves``: uncommitted saves
    removed. ``in_progress``: saves kept because they may still be running. ``uncertain``: saves
    kept because gc could not decide (a damaged manifest of their step, a lease that says
    ``committing`` past the grace period while the step's manifest slot is empty, an unreadable
    lease). ``foreign``: keys under ``saves/`` and ``manifests/`` that are not part of the format
    (links, stray files, names outside the save-id form, manifest names that are not steps):
    reported, never followed or deleted. ``problems``: one line per thing gc skipped, and why.
    ``pinned``: uncommitted (or retired) saves kept because a save in progress may reference
    them (FORMAT.md 8.4, 10.3). ``damaged_steps``: committed steps whose manifest gc found damaged
    (kept: ``ckptfmt verify --step N`` says what, ``ckptfmt delete N`` removes one). ``dry_run``:
    nothing was deleted or claimed; the removed lists say what a run would remove (without the
    claim and the last look, which a real run does, so a run may keep some of them). Retention's
    check of the step it keeps may still leave that step's verification record (FORMAT.md 10.4).
    """

    removed_steps: list[int] = field(default_factory=list)
    removed_saves: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    objects_removed: int = 0
    uncertain: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    damaged_steps: list[int] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"removed_steps": self.removed_steps, "removed_saves": self.removed_saves,
                "in_progress": self.in_progress, "objects_removed": self.objects_removed,
                "uncertain": self.uncertain, "foreign": self.foreign, "problems": self.problems,
                "pinned": self.pinned, "damaged_steps": self.damaged_steps, "dry_run": self.dry_run}


def _mentions(data: bytes, candidates: set[str]) -> set[str]:
    """The candidate save ids that occur anywhere in ``data`` (FORMAT.md 10.2)."""
    writer = {c for c in candidates if parse_writer_save_id(c) is not None}
    found = {c for c in candidates - writer if c.encode() in data}
    if len(writer) <= 32:  # memchr-speed substring searches
        return found | {c for c in writer if c.encode() in data}
    return found | layout.writer_save_ids_in(data, writer)


@dataclass(frozen=True)
class _Scan:
    """What one manifest names, read in pieces and never past the cap (FORMAT.md 10.2)."""

    status: str                              # "ok" | "absent" | "over_cap" | "unreadable"
    declared: frozenset[str] = frozenset()   # every save id its "save_id" members name
    mentions: frozenset[str] = frozenset()   # the watched save ids that occur anywhere in it
    why: str = ""


def _scan_manifest(repo: Repository, step: int, watch: set[str], checks: GcChecks | None = None) -> _Scan:
    # Pieces of SCAN_PIECE bytes with an overlap: memory stays small whatever the manifest's size
    # (a whole read of a 256 MiB object costs tensorstore three copies).
    st, cap, key = repo.storage, repo.max_manifest_bytes, manifest_key(step)
    checks = checks or GcChecks()
    declared: set[str] = set()
    mentions: set[str] = set()
    try:
        if st.larger_than(key, cap):
            return _Scan("over_cap", why=f"larger than the {cap}-byte cap; not read")
        off, tail = 0, b""
        while True:
            want = min(SCAN_PIECE, cap + 1 - off)
            piece = st.read_upto(key, off, want)
            if piece is None:
                return _Scan("absent") if off == 0 else _Scan("unreadable", why="unreadable: removed while read")
            buf = tail + piece
            named, mentioned = checks.save_ids_in(buf, watch - mentions)
            declared |= named
            mentions |= mentioned
            off += len(piece)
            if off > cap:  # grew since the probe
                return _Scan("over_cap", why=f"larger than the {cap}-byte cap; not read")
            if len(piece) < want:
                break
            tail = buf[-_OVERLAP:]
    except CheckpointError as e:
        return _Scan("unreadable", why=f"unreadable: {e}")
    return _Scan("ok", frozenset(declared), frozenset(mentions))


def _listed_steps(repo: Repository) -> tuple[list[int], list[str]]:
    """(valid steps, foreign keys) under ``manifests/``."""
    steps, foreign = [], []
    for k in repo.storage.list(MANIFESTS):
        s = step_of_manifest_key(k)
        (foreign.append(k) if s is None else steps.append(s))
    return sorted(steps), foreign


def referenced_elsewhere(repo: Repository, save_id: str, *, but: int | None, checks: GcChecks | None = None) -> bool:
    """Whether a committed manifest other than step ``but``'s names or mentions ``save_id`` (read
    with ``checks``, default :class:`GcChecks`). A manifest that cannot be read is assumed to
    (FORMAT.md 4.4)."""
    steps, _ = _listed_steps(repo)
    for s in steps:
        if s == but:
            continue
        scan = _scan_manifest(repo, s, {save_id}, checks)
        if scan.status == "unreadable" or save_id in scan.declared or save_id in scan.mentions:
            return True
    return False


def pinned_by_a_save(repo: Repository, save_id: str) -> bool:
    """Whether the lease of a save not yet collected pins ``save_id`` (FORMAT.md 4.4, 10.1): an
    incremental save in progress may reference its objects. A lease or listing that cannot be
    read is assumed to pin it."""
    pins = lease_pins(repo.storage, but=save_id)
    return pins is None or save_id in pins


def _free(repo: Repository, save_id: str, *, but: int | None) -> bool:
    """Leases first, then manifests (FORMAT.md 4.4): no live lease pins ``save_id`` and no
    committed manifest (other than step ``but``'s) names or mentions it."""
    return not pinned_by_a_save(repo, save_id) and not referenced_elsewhere(repo, save_id, but=but)


def remove_unreferenced(repo: Repository, save_id: str, *, but: int) -> bool:
    """After step ``but`` was un-committed: remove ``save_id``'s objects unless something may
    still reference them (FORMAT.md 4.4, 10.3): leases, then manifests; the claim; leases and
    manifests again; then the objects, the lease last. True when they were removed."""
    if not _free(repo, save_id, but=but) or claim(repo.storage, save_id) is not None:
        return False
    if not _free(repo, save_id, but=but):
        return False  # pinned or named since the claim: kept, and stays claimed
    remove_save(repo.storage, save_id)
    return True


def unrestorable(repo: Repository, step: int) -> str | None:
    """Why ``step`` cannot be restored, or None (FORMAT.md 10.4: the manifest validates, and every
    object it references exists with its recorded size). Reads no data: retention also asks
    :func:`ckptfmt.repository._verified.unverified` of the newest step it counts."""
    try:
        m = repo.manifest(step)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e.message}"
    # A pack holds many rows: each object is checked once (FORMAT.md 5.15).
    objects = list(dict.fromkeys((t.object_key(i), t.object_nbytes(i)) for t in m.tensors.values()
                                 for i in range(len(t.shards))))
    objects += [(se.key, int(se.nbytes)) for se in m.state.values()]
    try:
        faults = repo.storage.size_faults(objects)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e.message}"
    return "; ".join(faults[:3]) if faults else None


class GcChecks:
    """The checks gc decides with, each the module's own function: that the URL holds a
    repository (:meth:`recognise`, FORMAT.md 4.5), what a manifest names (:meth:`save_ids_in`,
    10.2), retention's :meth:`unrestorable` and :meth:`unverified` (10.4), and step 6's
    :meth:`last_look` (10.3). :func:`collect` takes one (``checks``; this one by default). A fault
    test's broken control passes a subclass with one check replaced by a weaker one, and shows
    what it loses."""

    def recognise(self, repo: Repository, steps: list[int], done: str) -> None:
        """:func:`ckptfmt.repository._recognise.recognise`: NotARepositoryError (saying ``done``)
        unless the URL holds a repository."""
        recognise(repo, steps, done)

    def save_ids_in(self, data: bytes, watch: set[str]) -> tuple[set[str], set[str]]:
        """In ``data`` (a piece of a manifest's text): the save ids its ``"save_id"`` members name,
        and those of ``watch`` that occur anywhere in it (FORMAT.md 10.2)."""
        return {m.group(1).decode("ascii") for m in _DECLARED.finditer(data)}, _mentions(data, watch)

    def unrestorable(self, repo: Repository, step: int) -> str | None:
        """:func:`unrestorable`: why ``step`` cannot be restored, or None."""
        return unrestorable(repo, step)

    def unverified(self, repo: Repository, step: int, *, fresh: bool = False, read: set[int] | None = None) -> str | None:
        """:func:`ckptfmt.repository._verified.unverified`: why ``step`` is not verified byte for byte, or None."""
        return unverified(repo, step, fresh=fresh, read=read)

    def last_look(self, repo: Repository, names: SaveNames, claimed: set[str], retired: dict[str, int],
                  report: GcReport) -> None:
        """:func:`last_look`: delete the claimed saves that nothing pins or names, keep the others."""
        last_look(repo, names, claimed, retired, report, checks=self)


def _retention(repo: Repository, steps: list[int], keep_last: int, keep_every: int | None, report: GcReport,
               dry_run: bool = False, checks: GcChecks | None = None) -> dict[str, int]:
    """Un-commit the steps that retention deletes, manifest first; their save ids. ``dry_run``:
    report them, delete nothing."""
    checks = checks or GcChecks()
    read: set[int] = set()  # the steps this decision read in full: a fresh read needs no second one
    plan = Retention(keep_last=keep_last, keep_every=keep_every or None).plan(
        steps, unrestorable=lambda s: checks.unrestorable(repo, s),
        unverified=lambda s: checks.unverified(repo, s, read=read),
        reread=lambda s: None if s in read else checks.unverified(repo, s, fresh=True, read=read))
    report.problems.extend(plan.notes)
    retired: dict[str, int] = {}
    for s in plan.steps:
        try:
            sid = repo.manifest(s).save_id  # only a valid manifest names its objects reliably
        except CheckpointError:
            sid = None
        if dry_run:
            report.removed_steps.append(s)
            if sid is not None:
                retired[sid] = s
            continue
        try:
            repo.storage.delete(manifest_key(s))
        except CheckpointError as e:
            report.problems.append(f"step {s}: could not delete its manifest ({e.message})")
            continue
        report.removed_steps.append(s)
        if sid is not None:
            forget(repo.storage, sid)
            retired[sid] = s
        else:
            report.problems.append(f"step {s}: its manifest was damaged; its objects are left to collection")
    return retired


def collect(repo: Repository, *, grace_s: float | None, keep_last: int | None, keep_every: int | None,
            dry_run: bool = False, checks: GcChecks | None = None) -> GcReport:
    """Retention, then removal of abandoned saves (see the module docstring for the order), deciding
    with ``checks`` (default :class:`GcChecks`: this module's own checks).

    Raises NotARepositoryError (deleting nothing) when the URL holds no repository, and
    StorageError when ``manifests/`` or ``saves/`` cannot be listed at all. Everything else that
    goes wrong is skipped and reported in the GcReport.
    """
    grace_s = DEFAULT_LEASE_GRACE_S if grace_s is None else float(grace_s)
    st = repo.storage
    report = GcReport(dry_run=dry_run)
    checks = checks or GcChecks()
    foreign: list[str] = []
    steps, _ = _listed_steps(repo)
    checks.recognise(repo, steps, "gc deleted nothing")
    retired: dict[str, int] = {}
    if keep_last is not None and keep_last >= 1:
        if st.plain_dir(MANIFESTS):
            retired = _retention(repo, steps, keep_last, keep_every, report, dry_run, checks)
        else:
            report.problems.append("manifests/ is a symbolic link or not a folder: retention skipped")
    names = list_saves(st, retired, report, foreign)
    if names is None:
        return report
    now = time.time()
    live = _read_leases(st, names, retired, report, now, grace_s)
    committed = _scan_committed(repo, names, live, foreign, checks)
    report.damaged_steps = sorted(s for s in committed.damaged if s not in report.removed_steps)
    report.in_progress += sorted(live.fresh - committed.referenced)
    pinned = set(live.pins)
    if live.unreadable:  # an unreadable lease may pin any save: collect none of them this run
        pinned |= live.pending
        report.problems.append(f"{live.unreadable} lease(s) could not be read and may pin any save; "
                               "no save was collected")
    held = (live.pending - committed.referenced) & pinned
    if dry_run:  # what step 5 would claim, without the claim (a write) and without step 6's last look
        would = _collect_pending(repo, names, replace(live, pending=live.pending - pinned), committed, retired,
                                 report, now, grace_s, checks, dry_run=True)
        report.removed_saves = sorted(sid for sid in would if sid not in retired)
        report.objects_removed = sum(names.candidates[sid].objects for sid in would)
        report.pinned = sorted(held)
        return _finish(report, foreign)
    _tidy_committed(st, committed.referenced, report, now, grace_s)
    claimed = _collect_pending(repo, names, replace(live, pending=live.pending - pinned), committed, retired,
                               report, now, grace_s, checks)
    # A lease this run claimed can no longer commit, so its pins are released (FORMAT.md 10.3):
    # the saves only such leases pinned are decided now, not left to the next run.
    freed = set() if live.unreadable else held - live.custom_pins - pinned_by_leases(
        lease for sid, lease in live.leases.items() if sid not in claimed)
    if freed:
        claimed |= _collect_pending(repo, names, replace(live, pending=freed), committed, retired, report, now, grace_s,
                                    checks)
    report.pinned = sorted(held - freed)
    checks.last_look(repo, names, claimed, retired, report)
    return _finish(report, foreign)


def _finish(report: GcReport, foreign: list[str]) -> GcReport:
    foreign.sort()
    if len(foreign) > MAX_LISTED_FOREIGN:
        report.problems.append(f"{len(foreign) - MAX_LISTED_FOREIGN} more foreign object(s) not listed")
    report.foreign = foreign[:MAX_LISTED_FOREIGN]
    report.in_progress.sort()
    report.uncertain.sort()
    return report


@dataclass(frozen=True)
class _Liveness:
    """Step 3: the candidates' leases, and which saves may be in progress (``fresh``: unless a
    manifest turns out to name them) or are left to decide (``pending``)."""

    leases: dict[str, _StoredLease]
    pending: set[str]
    fresh: set[str]
    unreadable: int = 0  # leases that could not be read (their refs are unknown)
    pins: frozenset[str] = frozenset()  # the save ids live leases pin (FORMAT.md 10.1)
    custom_pins: frozenset[str] = frozenset()  # those that saves outside the writer form pin (never claimed)


def _read_leases(st: Any, names: SaveNames, retired: dict[str, int], report: GcReport, now: float,
                 grace_s: float) -> _Liveness:
    """Leases first (FORMAT.md 10.3 step 2): drop the saves in progress."""
    leases: dict[str, _StoredLease] = {}
    read = [sid for sid, e in names.candidates.items() if e.marker == "file"]
    unreadable = 0
    for sid, e in names.candidates.items():
        if e.marker not in (None, "file"):
            report.problems.append(f"{SAVES}{sid}/LEASE is a {e.marker}, not a file: not read, the save counts as leaseless")
    for sid, got in zip(read, st.read_each_with_generation([lease_key(sid) for sid in read], LEASE_MAX_BYTES)):
        if isinstance(got, StorageError):
            unreadable += 1
            report.uncertain.append(sid)
            report.problems.append(f"{SAVES}{sid}: lease unreadable ({got.found}); kept")
            continue
        if got[0] is not None:
            leases[sid] = _stored_lease(got[0], got[1])
    pending: set[str] = set()
    fresh: set[str] = set()
    for sid, e in names.candidates.items():
        if sid in report.uncertain:
            continue
        if e.error is not None:
            report.uncertain.append(sid)
            report.problems.append(f"{SAVES}{sid}: could not be walked ({e.error}); kept")
            continue
        lease = leases.get(sid)
        if lease is not None and lease.state == "writing" and now - lease.heartbeat_unix < grace_s:
            fresh.add(sid)
        elif (lease is None and sid not in retired and e.newest_mtime is not None
              and now - e.newest_mtime < grace_s):
            fresh.add(sid)  # no lease, but written to within the grace period
        else:
            pending.add(sid)
    custom, bad = _custom_pins(st, names)  # saves outside the writer form may pin too
    return _Liveness(leases, pending, fresh, unreadable + bad, frozenset(custom | pinned_by_leases(leases.values())),
                     frozenset(custom))


def _custom_pins(st: Any, names: SaveNames) -> tuple[set[str], int]:
    """What the leases of saves outside the writer form pin (gc never claims those), and how
    many of those leases could not be read."""
    read = [sid for sid, e in names.custom.items() if e.marker == "file"]
    got = st.read_each_with_generation([lease_key(sid) for sid in read], LEASE_MAX_BYTES) if read else []
    pins = pinned_by_leases(_stored_lease(g[0], g[1]) for g in got if not isinstance(g, StorageError) and g[0] is not None)
    return pins, sum(isinstance(g, StorageError) for g in got)


@dataclass(frozen=True)
class _Committed:
    """Step 4: the watched save ids committed manifests name or mention, the steps whose manifest
    is damaged (and why), and the manifests that could not be read at all."""

    referenced: set[str]
    damaged: dict[int, str]
    blind: list[str]


def _scan_committed(repo: Repository, names: SaveNames, live: _Liveness, foreign: list[str],
                    checks: GcChecks) -> _Committed:
    """Only after the leases, the manifests: every save id they name or mention is committed."""
    steps, foreign_manifests = _listed_steps(repo)
    foreign += foreign_manifests
    referenced: set[str] = set()
    damaged: dict[int, str] = {}
    blind: list[str] = []
    watch = set(names.candidates) | set(names.custom)
    for s in steps:
        scan = _scan_manifest(repo, s, (live.pending | set(names.custom)) - referenced, checks)
        if scan.status == "unreadable":
            blind.append(f"step {s}: {scan.why}")
        elif scan.status == "over_cap" or (scan.status == "ok" and not scan.declared):
            damaged[s] = scan.why or "names no save_id"
        referenced |= (scan.declared & watch) | scan.mentions
    for sid in sorted(names.custom):
        if sid not in referenced:
            foreign.append(f"{SAVES}{sid}")
    return _Committed(referenced, damaged, blind)


def _tidy_committed(st: Any, referenced: set[str], report: GcReport, now: float, grace_s: float) -> None:
    """Committed saves: remove the stale lock files their writers left behind. A lease left
    behind stays (it is harmless, FORMAT.md 8.3): a conditional delete is a HEAD and a DELETE on
    S3, which would remove a claim written between the two (10.3)."""
    for sid in sorted(referenced):
        report.objects_removed += st.remove_stale_locks(save_prefix(sid), now - grace_s)


def _collect_pending(repo: Repository, names: SaveNames, live: _Liveness, committed: _Committed, retired: dict[str, int],
                     report: GcReport, now: float, grace_s: float, checks: GcChecks, dry_run: bool = False) -> set[str]:
    """Step 5: decide each save left, and claim it. Returns the saves whose lease this run holds
    as ``collected`` (claimed here, or found so); step 6 deletes them."""
    claimed: set[str] = set()
    for sid in sorted(live.pending - committed.referenced):
        if names.candidates[sid].marker not in (None, "file"):
            report.uncertain.append(sid)
            report.problems.append(f"{SAVES}{sid}: its LEASE is not a file and cannot be claimed; kept")
            continue
        why = _decide(repo, sid, live.leases.get(sid), retired, committed.damaged, committed.blind, now, grace_s,
                      checks, dry_run)
        if why == "in progress":
            report.in_progress.append(sid)
        elif why == "committed":
            continue
        elif why is not None:
            report.uncertain.append(sid)
            report.problems.append(f"{SAVES}{sid}: {why}; kept")
        else:
            claimed.add(sid)
    return claimed


def last_look(repo: Repository, names: SaveNames, claimed: set[str], retired: dict[str, int], report: GcReport,
              checks: GcChecks | None = None) -> None:
    """Step 6, the last look (FORMAT.md 10.3): after every claim, every lease, then every manifest
    (read with ``checks``, default :class:`GcChecks`); a claimed save that one pins or names is
    kept (and stays claimed), the others are deleted (``report`` says which). ``retired``: the
    save ids retention un-committed, by step."""
    if not claimed:
        return
    pins = lease_pins(repo.storage)
    named: set[str] = set()
    blind = None if pins is not None else "a lease could not be read"
    if blind is None:
        for s in _listed_steps(repo)[0]:
            scan = _scan_manifest(repo, s, claimed - pins - named, checks)
            if scan.status == "unreadable":
                blind = f"step {s}: {scan.why}"
                break
            named |= (scan.declared & claimed) | scan.mentions
    for sid in sorted(claimed):
        if blind is not None or sid in pins or sid in named:
            report.pinned.append(sid)
            report.problems.append(f"{SAVES}{sid}: claimed, then " + (f"the last look failed ({blind})" if blind else
                                   "pinned by a lease" if sid in pins else "named by a manifest") + "; kept")
            continue
        try:
            remove_save(repo.storage, sid)
        except CheckpointError as e:
            report.problems.append(f"{SAVES}{sid}: could not be deleted ({e.found}); will retry next run")
            continue
        report.objects_removed += names.candidates[sid].objects
        if sid not in retired:
            report.removed_saves.append(sid)
    report.pinned.sort()


def _decide(repo: Repository, sid: str, lease: _StoredLease | None, retired: dict[str, int],
            damaged: dict[int, str], blind: list[str], now: float, grace_s: float, checks: GcChecks,
            dry_run: bool = False) -> str | None:
    """None to collect ``sid`` (its lease, if any, is claimed here unless ``dry_run``); otherwise
    "in progress", "committed", or why it is kept."""
    st = repo.storage
    if blind:
        return f"a committed manifest could not be read ({blind[0]}), so any save may be referenced"
    m = parse_writer_save_id(sid)
    step = retired[sid] if sid in retired else m.step if m else None
    if lease is not None and lease.state == "committing" and lease.step is not None:
        step = lease.step
    if step is not None and step in damaged and sid not in retired:
        return f"the manifest of step {step} is damaged ({damaged[step]}) and may be this save's"
    slot = _Scan("absent")
    if step is not None:  # the point read: a save that committed a moment ago, on a lagging list
        slot = _scan_manifest(repo, step, {sid}, checks)
        if slot.status in ("unreadable", "over_cap"):
            return f"the manifest of step {step} cannot be judged ({slot.why})"
        if sid in slot.declared or sid in slot.mentions:
            return "committed"
    if lease is not None and lease.state == "committing":
        if slot.status == "absent":
            fresh = now - lease.heartbeat_unix < grace_s
            return "in progress" if fresh else (
                f"its lease says committing since {lease.heartbeat_unix:.0f} and the manifest slot of step "
                f"{step} is empty: its writer may still commit")
        if not slot.declared:
            return f"the manifest of step {step} names no save id and may be this save's"
    if lease is not None and lease.state == "writing" and now - lease.heartbeat_unix < grace_s:
        return "in progress"
    if dry_run:
        return None
    # The claim (FORMAT.md 8.3, 10.3): a conditional rewrite, never a conditional delete; a save
    # without a lease gets a "collected" one, created only if absent.
    why = claim(st, sid, lease.generation if lease is not None else NO_VALUE)
    if why == "its lease changed since it was judged":
        return "in progress"  # refreshed or switched to committing since it was read
    return why
