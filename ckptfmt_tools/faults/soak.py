"""Crash-consistency soak: many saves, each SIGKILLed at a random moment.

``python -m ckptfmt_tools.faults.soak --runs 200 [--workdir D] [--seed S] [--json]``

Each run starts a new save of a new step in fresh writer processes (one writer, or every third
run two writers with a TcpCoordinator), waits until the save has begun, and SIGKILLs the
writers at a random time drawn across the measured duration of a save, counted from the
writer's own clock stamp of the start of ``save()`` (for two writers: one
random rank, and the survivor must fail on its own with a typed error). After each kill:

* no listed step is partial: every newly listed step verifies;
* the newest listed step restores bit for bit;
* every ten runs, and at the end, ``gc(grace_s=0)`` leaves no private objects and removes
  nothing committed.

``incremental=True`` (``--incremental``): one tensor is frozen, so saves reference the previous
step's objects (FORMAT.md 8.4), and a retention gc (``keep_last=3``) runs in a thread while each
killed save runs: no listed step may ever fail to verify or restore. The one exception is the residual of FORMAT.md 10.3: a leader killed after
  its lease says ``committing`` and before its manifest create leaves a save that gc must keep
  (``uncertain``), since a paused leader could still commit it, and it keeps the saves that
  save's lease pins (``refs``), since the manifest it could still create references them. Those
  are counted (``undecided_commits``), not violations.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["SoakReport", "soak", "main"]


@dataclass
class SoakReport:
    runs: int = 0
    committed: int = 0          # saves that committed before the kill landed
    killed_mid_save: int = 0    # saves killed before they returned
    survivor_errors: dict[str, int] = field(default_factory=dict)  # typed errors of surviving ranks
    listed: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    gc_runs: int = 0
    objects_collected: int = 0
    undecided_commits: int = 0  # saves killed between the commit fence and the manifest create
    save_seconds: float = 0.0   # calibrated duration of one save
    referencing_steps: int = 0  # committed steps that reference an earlier save's objects (8.4)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "runs": self.runs, "committed_before_kill": self.committed,
                "killed_mid_save": self.killed_mid_save, "survivor_errors": self.survivor_errors,
                "listed_steps": len(self.listed), "violations": self.violations, "gc_runs": self.gc_runs,
                "objects_collected": self.objects_collected, "undecided_commits": self.undecided_commits, "save_seconds": round(self.save_seconds, 4),
                "referencing_steps": self.referencing_steps,
                "seconds": round(self.seconds, 2)}


class _Lines:
    """Lines of a process's stdout, collected by a thread (so waits can time out)."""

    def __init__(self, proc: Any) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: Any) -> None:
        for line in proc.stdout:
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, event: str, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                return None
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            self.lines.append(doc)
            if doc.get("event") == event or (event == "result" and "ok" in doc):
                return doc

    def drain(self, timeout_s: float) -> None:
        while self.wait_for("__never__", timeout_s) is not None:
            pass


def _check_listed(repo: Any, seed: int, seen: set[int], report: SoakReport, incremental: bool = False) -> None:
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.faults import _data
    from ckptfmt_tools.faults._checks import restore_into, same

    listed = repo.steps()
    for step in listed:
        if step in seen:
            continue
        seen.add(step)
        try:
            repo.verify(step)
        except CheckpointError as exc:
            report.violations.append(f"step {step} is listed but partial: {type(exc).__name__}: {exc}"[:300])
    if listed:
        newest = listed[-1]
        arrays = {k: v * 0 for k, v in _data.truth(seed, newest, incremental).items()}
        state: dict[str, Any] = {}
        if any(v.startswith(f"newest step {newest} ") for v in report.violations):
            report.listed = listed
            return
        try:
            restore_into(repo.open(newest), arrays, state)
            want = _data.truth(seed, newest, incremental)
            if not all(same(arrays[k], want[k]) for k in want) or not same(state, _data.global_state(seed, newest)):
                report.violations.append(f"newest step {newest} restored wrong values")
        except CheckpointError as exc:
            report.violations.append(f"newest step {newest} does not restore: {type(exc).__name__}"[:300])
    report.listed = listed


def _gc(repo: Any, root: Path, report: SoakReport) -> None:
    from ckptfmt_tools.faults._checks import describe_leftovers, inventory

    before = inventory(root)
    rep = repo.gc(grace_s=0)
    after = inventory(root)
    report.gc_runs += 1
    report.objects_collected += rep.objects_removed
    lost = (before.committed & before.save_files) - after.save_files
    if lost:
        report.violations.append(f"gc removed committed objects: {sorted(lost)[:3]}")
    leases = {sid: _lease(root / "saves" / sid / "LEASE") for sid in rep.uncertain}
    undecided = {sid: lease for sid, lease in leases.items() if lease is not None and lease.state == "committing"}
    report.undecided_commits = len(undecided)
    # An undecided save could still commit, and its manifest would reference the saves its lease
    # pins (FORMAT.md 10.1, 10.3 step 2): those stay too, but only those its lease names.
    kept = set(undecided) | {r for lease in undecided.values() for r in lease.refs}
    after.save_files = {k for k in after.save_files if k.split("/")[1] not in kept}
    # A lease of a save that a listed manifest names or references stays (FORMAT.md 8.3, 10.3,
    # revision 1.2.1): one left behind by a writer killed after its commit, or a claim whose save
    # the last look kept. gc never deletes a lease conditionally (on S3 that could remove a claim).
    named = after.committed_ids | after.referenced_ids
    after.save_files = {k for k in after.save_files if not (k.endswith("/LEASE") and k.split("/")[1] in named)}
    for what in describe_leftovers(after):
        msg = f"gc left {what}"
        if msg not in report.violations:
            report.violations.append(msg)


def _retention_thread(repo: Any, report: SoakReport, run: int) -> threading.Thread:
    """Retention and collection while a save runs (it may reference what retention deletes)."""
    def go() -> None:
        try:
            repo.gc(keep_last=3)
        except Exception as e:  # gc reports what it cannot decide; it must not raise here
            report.violations.append(f"run {run}: gc during a save raised {type(e).__name__}: {e}"[:300])
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _lease(path: Path) -> Any:
    """The lease at ``path``, read by the library's own parser; None when it cannot be read."""
    from ckptfmt.layout import parse_lease

    try:
        return parse_lease(path.read_bytes())
    except OSError:
        return None


def soak(root: str | Path, runs: int = 50, *, seed: int = 7, rng_seed: int = 0, publish_first: bool = False,
         multi_writer_every: int = 3, on_run: Callable[[int, SoakReport], None] | None = None,
         incremental: bool = False) -> SoakReport:
    """Run the soak in repository ``root`` (created fresh). ``publish_first`` is the broken control."""
    from ckptfmt import Repository
    from ckptfmt_tools.faults._procs import start_writers

    t_start = time.perf_counter()
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    rng = random.Random(rng_seed)
    report = SoakReport()
    repo = Repository(str(root))
    seen: set[int] = set()

    # Calibrate: one save that is not killed (it is also the first committed step).
    cal = start_writers(str(root), [1], 1, seed, announce=True, publish_first=publish_first, incremental=incremental)
    lines = _Lines(cal.procs[0])
    res = lines.wait_for("result", 60)
    cal.procs[0].wait(30)
    if not res or not res.get("ok"):
        raise RuntimeError(f"calibration save failed: {res}")
    report.save_seconds = float(res.get("seconds", 0.1))
    _check_listed(repo, seed, seen, report, incremental)

    scale = 1.0  # the kill window's factor, steered towards as many kills mid-save as after the commit
    for i in range(runs):
        step = i + 2
        world = 2 if (multi_writer_every and not publish_first and i % multi_writer_every == multi_writer_every - 1) else 1
        run = start_writers(str(root), [step], world, seed, announce=True, publish_first=publish_first,
                            timeout_s=3, incremental=incremental)
        readers = [_Lines(p) for p in run.procs]
        started = readers[0].wait_for("start", 60)
        if started is None:
            report.violations.append(f"run {i}: writer never started")
        # The kill time is drawn relative to the writer's own clock stamp of the start of ``save()``,
        # not to when this process read the line: on a loaded machine that read can lag by more
        # than a whole save, and every kill would land after the commit.
        # The window follows the machine: a save can take longer than the calibration did (a
        # loaded machine: every kill would land mid-save) or shorter (a calibration save that ran
        # while the machine was busy: every kill would land after the commit). After each run
        # that committed the window shrinks by a fifth, after each that did not it grows by a
        # quarter (between 1/8 and 8 times the calibrated save), so that both keep happening.
        kill_at = (float(started["t"]) if started and "t" in started else time.time()) \
            + rng.uniform(0.0, (2.5 if incremental else 1.3) * scale * report.save_seconds)  # gc shares the CPU then
        time.sleep(max(0.0, kill_at - time.time()))
        collector = _retention_thread(repo, report, i) if incremental else None
        victims = list(range(world)) if world == 1 else [rng.randrange(world)]
        for r in victims:
            try:
                os.kill(run.procs[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for r, p in enumerate(run.procs):
            try:
                p.wait(30)
            except Exception:
                p.kill()
                p.wait()
                report.violations.append(f"run {i}: rank {r} hung after its peer was killed")
            readers[r].drain(0.5)
        if collector is not None:
            collector.join(60)
        results = [d for rd in readers for d in rd.lines if "ok" in d]
        if any(d.get("ok") for d in results):
            report.committed += 1
            scale = max(0.125, scale * 0.8)
        else:
            report.killed_mid_save += 1
            scale = min(8.0, scale * 1.25)
        for r, p in enumerate(run.procs):
            if r in victims:
                continue
            for d in readers[r].lines:
                if "ok" in d and not d["ok"]:
                    report.survivor_errors[d["error"]] = report.survivor_errors.get(d["error"], 0) + 1
                    if d.get("untyped"):
                        report.violations.append(f"run {i}: surviving rank {r} raised untyped {d['error']}")
        report.runs += 1
        _check_listed(repo, seed, seen, report, incremental)
        if results and any(d.get("ok") for d in results) and step in repo.steps():
            try:
                report.referencing_steps += bool(repo.manifest(step).referenced_saves)
            except Exception:
                pass  # already checked by _check_listed
        if (i + 1) % 10 == 0:
            _gc(repo, root, report)
        if on_run is not None:
            on_run(i, report)
    _gc(repo, root, report)
    seen.clear()
    _check_listed(repo, seed, seen, report, incremental)  # every listed step verifies, after gc too
    report.seconds = time.perf_counter() - t_start
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.faults.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=int(os.environ.get("CKPTFMT_SOAK_RUNS", "200")))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--incremental", action="store_true", help="frozen tensors, and retention gc during saves")
    args = ap.parse_args(argv)
    tmp = None
    workdir = args.workdir or (tmp := tempfile.mkdtemp(prefix="ckptfmt-soak-"))
    try:
        def progress(i: int, rep: SoakReport) -> None:
            if not args.json and (i + 1) % 10 == 0:
                print(f"{i + 1}/{args.runs} runs, {len(rep.listed)} steps listed, "
                      f"{len(rep.violations)} violations", file=sys.stderr, flush=True)

        rep = soak(Path(workdir) / "repo", args.runs, rng_seed=args.seed, on_run=progress,
                   incremental=args.incremental)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="crash-consistency soak")
        t.add_column("measure")
        t.add_column("value", overflow="fold")
        for k, v in rep.to_json().items():
            t.add_row(k.replace("_", " "), json.dumps(v) if isinstance(v, (dict, list)) else str(v))
        Console().print(t)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
