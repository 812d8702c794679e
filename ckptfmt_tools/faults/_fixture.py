"""Run one fault against a fresh copy of a real two-writer save, and judge the outcome.

The base repository is saved once per table run by two writer processes (TcpCoordinator):
step 1 and step 2 of the state in :mod:`ckptfmt_tools.faults._data`. Every fault gets its own copy.

Terminal-outcome checks, for every fault:

* **typed**: every error raised is a CheckpointError subclass listed for that fault (no
  untyped exception, no success);
* **exposed**: live buffers and a live state dict, restored into from the damaged step, must be
  unchanged; and no read API (``read``, ``state``, ``rank_state``) may hand back values that
  differ from the truth without raising. For save faults: no partial step may be listed;
* **prior intact**: the last good step is still listed, verifies, and restores bit for bit;
* **gc clean**: after ``gc(grace_s=0)`` no private objects remain under ``saves/``, every object
  that a committed manifest references is still there, and the prior step still restores;
* **hang**: every operation finishes within its timeout.
"""
from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from ckptfmt_tools.faults._peak import peak_meter
from ckptfmt_tools.faults import _data
from ckptfmt_tools.faults._catalogue import CATALOGUE, Fault, SaveAttempt, by_name
from ckptfmt_tools.faults._checks import describe_leftovers, inventory, prior_intact, restore_into, same, snapshot
from ckptfmt_tools.faults._scene import Scene

if TYPE_CHECKING:
    from ckptfmt.reader import BlockChecks
    from ckptfmt.repository import GcChecks

__all__ = ["Outcome", "Context", "build_base", "run_fault", "run_all", "OutcomeTable"]

SEED = 1234


@dataclass
class Context:
    """Knobs of a table run."""

    save_timeout_s: float = 20.0
    check_timeout_s: float = 60.0
    force_fsize_fallback: bool = False  # test the ENOSPC fallback even where mounting works
    reader: Callable[[Any, int], Any] | None = None  # (repo, step) -> checkpoint; None: repo.open
    max_manifest_bytes: int | None = None  # a smaller manifest cap (tests); None: the core's default
    grown_bytes: int = 4 << 30  # shard-grown's growth (tests use less: a naive reader reads it all)
    # Broken controls (tests only): each weakens one guarantee, and the outcome must then FAIL.
    after_save: Callable[[Scene], None] | None = None  # runs after a save fault, before the checks
    enospc_fill: bool = True         # False: the tmpfs is not filled, so the save has room
    writer_weaken: str | None = None  # passed to writer processes (see _writer.WEAKEN, _aliased.WEAKEN)
    restore_clean: bool = False       # "coop"/"tier": the same run with nothing injected
    restore_weaken: str | None = None  # "coop": "receiver_trusts" (see _restorejudge)
    checks: BlockChecks | None = None  # the scene's repositories read with these BlockChecks (_controls.NoChecksums)
    gc_checks: GcChecks | None = None  # "gc": the checks gc decides with (a weakened GcChecks; None: gc's own)


@dataclass
class Outcome:
    fault: str
    where: str
    expected: list[str]
    raised: list[str] = field(default_factory=list)
    message: str = ""
    typed: bool = False
    exposed: bool = True
    prior_intact: bool = False
    gc_clean: bool = False
    hung: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peers: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.typed and not self.exposed and self.prior_intact and self.gc_clean and not self.hung

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "where": self.where, "expected": self.expected, "raised": self.raised,
                "message": self.message, "typed": self.typed, "state_exposed": self.exposed,
                "prior_intact": self.prior_intact, "gc_clean": self.gc_clean, "hung": self.hung,
                "passed": self.passed, "notes": self.notes, "seconds": round(self.seconds, 3),
                **({"peers": self.peers} if self.peers else {})}


@dataclass
class OutcomeTable:
    outcomes: list[Outcome]
    base_seconds: float = 0.0
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    def to_json(self) -> dict[str, Any]:
        return {"all_passed": self.all_passed, "environment": self.environment,
                "base_seconds": round(self.base_seconds, 3), "outcomes": [o.to_json() for o in self.outcomes]}


# ------------------------------------------------------------------------------- base


def build_base(root: Path, seed: int = SEED, ctx: Context | None = None) -> Path:
    """Save steps 1 and 2 with two writer processes; return the repository path."""
    from ckptfmt_tools.faults._procs import start_writers, wait_writers

    ctx = ctx or Context()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    run = wait_writers(start_writers(str(root), [1, 2], 2, seed, timeout_s=ctx.save_timeout_s),
                       ctx.save_timeout_s * 3 + 10)
    bad = [r for r in run.results if not r.get("ok")]
    if run.hung or bad or len(run.results) != 4:
        raise RuntimeError(f"the base save failed: results={run.results} hung={run.hung} "
                           f"stderr={[e[-800:] for e in run.stderr]}")
    return root


# -------------------------------------------------------------------------- helpers


def _within(timeout_s: float, fn: Callable[[], Any]) -> tuple[bool, Any, BaseException | None]:
    """Run ``fn`` in a thread; (finished, value, exception). A hang is reported, not waited out."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - everything is classified by the caller
            box["exc"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("exc")


def _classify(exc: BaseException | None, expect: tuple[type, ...], out: Outcome, what: str) -> None:
    from ckptfmt.errors import CheckpointError

    if exc is None:
        out.raised.append(f"{what}: no error")
        out.typed = False
        return
    name = type(exc).__name__
    out.raised.append(name if what == "restore" else f"{what}: {name}")
    if not out.message:
        out.message = str(exc)[:300]
    if not (isinstance(exc, CheckpointError) and isinstance(exc, expect)):
        out.typed = False
        out.notes.append(f"{what} raised {name}" + ("" if isinstance(exc, CheckpointError) else " (untyped)")
                         + f": {str(exc)[:200]}")


def _truth_state(seed: int, step: int) -> dict[str, Any]:
    return _data.global_state(seed, step)


def _open(ctx: Context, repo: Any, step: int) -> Any:
    return ctx.reader(repo, step) if ctx.reader else repo.open(step)


def _probe_reads(ckpt: Any, seed: int, step: int, world: int) -> list[str]:
    """Every read API that returned values different from the truth without raising."""
    wrong = []
    truth = _data.truth(seed, step)
    for key, want in truth.items():
        try:
            got = ckpt.read(key)
        except Exception:  # raising is fine here; untyped errors are judged by the restore check
            continue
        if not same(got, want):
            wrong.append(f"read({key!r})")
    probes: list[tuple[str, Callable[[], Any], Any]] = [("state()", ckpt.state, _truth_state(seed, step))]
    probes += [(f"rank_state({r})", (lambda r=r: ckpt.rank_state(r)), _data.rank_state(seed, step, r))
               for r in range(world)]
    for name, fn, want in probes:
        try:
            got = fn()
        except Exception:
            continue
        if not same(got, want):
            wrong.append(name)
    return wrong


def _gc_check(scene: Scene, out: Outcome, prior: int, ctx: Context) -> None:
    from ckptfmt.errors import CheckpointError

    before = inventory(scene.root)
    ok, report, exc = _within(ctx.check_timeout_s, lambda: scene.repo().gc(grace_s=0))
    if not ok:
        out.hung = True
        out.notes.append("gc() did not finish")
        return
    if exc is not None:
        out.notes.append(f"gc() raised {type(exc).__name__}: {str(exc)[:200]}")
        out.gc_clean = False
        if not isinstance(exc, CheckpointError):
            out.typed = False
        return
    after = inventory(scene.root)
    removed = getattr(report, "objects_removed", None)
    if removed:
        out.notes.append(f"gc removed {removed} private objects of {len(report.removed_saves)} unfinished save(s)")
    lost = sorted((before.committed & before.save_files) - after.save_files)
    left = sorted(after.private())
    clean = not lost and not left and before.manifest_files == after.manifest_files
    if lost:
        out.notes.append(f"gc removed committed objects: {lost[:3]}")
    if left:
        out.notes += [f"gc left {w}" for w in describe_leftovers(after)]
    if before.manifest_files != after.manifest_files:
        out.notes.append("gc changed the manifests")
    ok_prior, why = prior_intact(scene.repo(), prior, _data.truth(scene.seed, prior),
                                 _truth_state(scene.seed, prior))
    if not ok_prior:
        out.notes.append(f"after gc: {why}")
    out.gc_clean = clean and ok_prior


def _short(where: str) -> str:
    return re.sub(r"saves/\d{12}-\d{8}T\d{6}-[0-9a-f]{8}", "saves/<id>", where)


# ------------------------------------------------------------------------ one fault


def _disk_fault(fault: Fault, scene: Scene, ctx: Context, out: Outcome) -> None:
    seed, target, prior = scene.seed, 2, 1
    out.where = _short(fault.action(scene))
    repo = scene.repo()
    # Live state: what a training job holds before restoring (here: step 1's values).
    live = {k: v.copy() for k, v in _data.truth(seed, prior).items()}
    live_state: dict[str, Any] = _truth_state(seed, prior)
    before = snapshot(live, live_state)
    peak_grown = peak_meter()
    out.typed = True

    def attempt() -> None:
        restore_into(_open(ctx, repo, target), live, live_state)

    done, _, exc = _within(ctx.check_timeout_s, attempt)
    if not done:
        out.hung = True
        out.raised.append("HANG")
        return
    _classify(exc, fault.expect, out, "restore")
    done, _, vexc = _within(ctx.check_timeout_s, lambda: repo.verify(target))
    if not done:
        out.hung = True
        return
    _classify(vexc, fault.expect, out, "verify")
    grown = peak_grown()
    if grown > 64:
        out.notes.append(f"peak RSS grew by {grown} MiB while rejecting the fault")
    changed = not (all(same(live[k], before[0][k]) for k in live) and same(live_state, before[1]))
    wrong: list[str] = []
    done, ckpt, _ = _within(ctx.check_timeout_s, lambda: _open(ctx, repo, target))
    if done and ckpt is not None:
        finished, probed, _ = _within(ctx.check_timeout_s, lambda: _probe_reads(ckpt, seed, target, 2))
        wrong = probed or []
        if not finished:
            out.hung = True
            out.notes.append("a read probe did not finish")
    out.exposed = changed or bool(wrong)
    if changed:
        out.notes.append("live state changed")
    if wrong:
        out.notes.append(f"wrong values returned without an error by {', '.join(wrong)}")
    if (scene.root.parent / "PWNED").exists():
        out.exposed = True
        out.notes.append("a pickle inside the checkpoint was executed")
    ok, why = prior_intact(repo, prior, _data.truth(seed, prior), _truth_state(seed, prior))
    out.prior_intact = ok
    if not ok:
        out.notes.append(why)
    _gc_check(scene, out, prior, ctx)


def _save_fault(fault: Fault, scene: Scene, ctx: Context, out: Outcome) -> None:
    import ckptfmt.errors as E
    from ckptfmt.errors import CheckpointError

    seed, target, prior = scene.seed, 3, 2
    attempt: SaveAttempt = fault.action(scene, ctx)
    try:
        if ctx.after_save is not None:
            ctx.after_save(scene)
        out.where = _short(attempt.where)
        out.notes += attempt.notes
        out.hung = attempt.hung
        out.typed = bool(attempt.results)
        errors = [r for r in attempt.results if not r.get("ok")]
        if not errors:
            out.typed = False
            out.raised.append("no error")
        for r in errors:
            cls = getattr(E, str(r.get("error")), None)
            name = str(r.get("error"))
            label = f"rank {r['rank']}: {name}" if "rank" in r and len(errors) > 1 else name
            out.raised.append(label)
            if not out.message:
                out.message = str(r.get("message", ""))[:300]
            if r.get("untyped") or not (isinstance(cls, type) and issubclass(cls, CheckpointError)
                                        and issubclass(cls, fault.expect)):
                out.typed = False
        names = fault.names if attempt.names is None else attempt.names
        if names and errors and not any(n in f"{r.get('error')} {r.get('message')} {r.get('found')}"
                                        for r in errors for n in names):
            out.typed = False
            out.notes.append(f"no error names the fault (one of {list(names)})")
        repo = scene.repo()
        listed = repo.steps()
        exposed = []
        if target in listed:
            # Listed after a failed save is only acceptable when the commit really landed (its
            # confirmation was lost) and the step is complete.
            owner = seed if attempt.winner_seed is None else attempt.winner_seed
            ok, why = prior_intact(repo, target, _data.truth(owner, target), _data.global_state(owner, target))
            if not ok:
                exposed.append(f"step {target} is listed but not a complete save: {why}")
            elif attempt.winner_seed is None:
                out.notes.append(f"step {target} committed although the save raised (confirmation lost); "
                                 "it is complete")
        elif attempt.winner_seed is not None:
            exposed.append(f"the winning save of step {target} is not listed")
        # Live state: a job resuming from the newest listed step must get a complete, verified one.
        live = {k: np.zeros_like(v) for k, v in _data.truth(seed, prior).items()}
        live_state: dict[str, Any] = {}
        try:
            restore_into(repo.open(), live, live_state)
            newest = repo.latest()
            want_seed = attempt.winner_seed if newest == target and attempt.winner_seed is not None else seed
            if not all(same(live[k], v) for k, v in _data.truth(want_seed, newest).items()):
                exposed.append(f"restoring the newest step ({newest}) gave wrong values")
        except CheckpointError as exc:
            exposed.append(f"restoring the newest listed step failed: {type(exc).__name__}")
        out.exposed = bool(exposed)
        out.notes += exposed
        ok, why = prior_intact(repo, prior, _data.truth(seed, prior), _truth_state(seed, prior))
        out.prior_intact = ok
        if not ok:
            out.notes.append(why)
        _gc_check(scene, out, prior, ctx)
    finally:
        if attempt.cleanup is not None:
            attempt.cleanup()


def _reuse_fault(fault: Fault, scene: Scene, ctx: Context, out: Outcome) -> None:
    """A ``"reuse"`` fault: the saves must not raise, and every step restores the values it had
    when it was saved (see :mod:`ckptfmt_tools.faults._aliased`)."""
    seed, prior = scene.seed, 2
    attempt = fault.action(scene, ctx)
    out.where, out.hung = _short(attempt.where), attempt.hung
    out.notes += attempt.notes
    err = attempt.error
    out.raised.append("no error" if err is None else str(err.get("error")))
    if err is not None:
        out.message = str(err.get("message", ""))[:300]
    out.typed = err is None and not attempt.notes and len(attempt.steps) == 3
    stale = [s["step"] for s in attempt.steps if not s["same"]]
    unverified = [s["step"] for s in attempt.steps if not s["verified"]]
    out.exposed = bool(stale or unverified)
    if stale:
        out.notes.append(f"step(s) {stale} restored other values than were saved (a stale reference)")
    if unverified:
        out.notes.append(f"step(s) {unverified} do not verify")
    for s in attempt.steps:
        out.notes.append(f"step {s['step']}: {s['referenced']} bytes referenced")
    ok, why = prior_intact(scene.repo(), prior, _data.truth(seed, prior), _truth_state(seed, prior))
    out.prior_intact = ok
    if not ok:
        out.notes.append(why)
    _gc_check(scene, out, prior, ctx)


def run_fault(fault: Fault | str, base: Path, workdir: Path, ctx: Context | None = None,
              seed: int = SEED) -> Outcome:
    """Copy ``base`` into ``workdir/<fault>/repo``, inject the fault, and judge the outcome."""
    fault = by_name(fault) if isinstance(fault, str) else fault
    ctx = ctx or Context()
    t0 = time.perf_counter()
    out = Outcome(fault.name, fault.where, [e.__name__ for e in fault.expect])
    run_dir = Path(workdir) / fault.name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    scene = Scene(run_dir / "repo", seed, ctx.max_manifest_bytes, ctx.grown_bytes, ctx.checks)
    if fault.kind not in ("coop", "tier"):  # those build their own repositories
        shutil.copytree(base, scene.root)
    try:
        if fault.kind == "disk":
            _disk_fault(fault, scene, ctx, out)
        elif fault.kind == "gc":
            from ckptfmt_tools.faults._gcfaults import judge

            judge(fault, scene, ctx, out, _within)
        elif fault.kind == "reuse":
            _reuse_fault(fault, scene, ctx, out)
        elif fault.kind in ("coop", "tier"):
            from ckptfmt_tools.faults._restorejudge import judge as judge_restore

            judge_restore(fault, run_dir, ctx, out, _within)
        else:
            _save_fault(fault, scene, ctx, out)
    except Exception as exc:  # a fixture failure is a failed row, with the reason
        out.typed = False
        out.notes.append(f"fixture error: {type(exc).__name__}: {str(exc)[:300]}")
    out.seconds = time.perf_counter() - t0
    return out


def run_all(names: Iterable[str] | None = None, workdir: str | Path | None = None, *, peers: bool = False,
            ctx: Context | None = None, on_outcome: Callable[[Outcome], None] | None = None,
            seed: int = SEED) -> OutcomeTable:
    """Run every fault (or ``names``) once; return the table. Keeps ``workdir`` if given."""
    import platform

    faults = [by_name(n) for n in names] if names else list(CATALOGUE)
    ctx = ctx or Context()
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="ckptfmt-faults-")
        workdir = tmp
    workdir = Path(workdir)
    try:
        t0 = time.perf_counter()
        base = build_base(workdir / "_base" / "repo", seed, ctx)
        table = OutcomeTable([], base_seconds=time.perf_counter() - t0,
                             environment={"python": platform.python_version(), "platform": platform.platform(),
                                          "writers": 2, "seed": seed})
        for fault in faults:
            o = run_fault(fault, base, workdir, ctx, seed)
            if peers:
                from ckptfmt_tools.faults._peers import peer_outcome

                o.peers = peer_outcome(fault.name, workdir / fault.name)
            table.outcomes.append(o)
            if on_outcome is not None:
                on_outcome(o)
        return table
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
