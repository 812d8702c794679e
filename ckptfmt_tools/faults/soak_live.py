"""Natural-timing soak of collectors against incremental saves (issue 24 item 2; FORMAT.md 4.4,
8.4, 10.3, 10.4).

``python -m ckptfmt_tools.faults.soak_live --rounds 6 --seconds 40 [--seed S] [--json]``

Each round runs, for ``seconds``, in a fresh repository:

* two writer processes saving incremental steps (a frozen tensor the next save references,
  FORMAT.md 8.4), one the even steps and one the odd, each SIGKILLed every 1 to 4 s (one of the
  two at random) and started again above the newest listed step;
* two gc policies, each in its own thread and repository handle: ``keep_last=3``, and
  ``keep_last=2, keep_every=4``, both with a short grace period (the writers heartbeat often);
* a deleter of random non-newest steps (``Repository.delete``);
* a live checker that restores a random listed step and compares every value; a step that fails
  to restore while it is still listed under the same save id is a failure (one deleted while read
  is not).

At the end of a round the writers are killed, ``gc(grace_s=0)`` runs, and every listed step must
verify and restore. Nothing here is timed; the counts are reported (rounds, kills, commits,
restores checked, failures) and any failure fails the soak.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LiveSoakReport", "live_soak", "main"]

GRACE_S = 5.0      # gc's grace period here; the writers refresh their leases every HEARTBEAT_S
HEARTBEAT_S = 0.5
_SEED = 11         # the data seed (ckptfmt_tools.faults._data)


@dataclass
class LiveSoakReport:
    rounds: int = 0
    kills: int = 0
    commits: int = 0
    restores_checked: int = 0
    vanished_while_read: int = 0   # deleted by a collector while the checker read it (not a failure)
    deletes: int = 0
    gc_runs: int = 0
    referencing_steps: int = 0     # listed steps at a round's end that reference an earlier save
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "rounds": self.rounds, "kills": self.kills, "commits": self.commits,
                "restores_checked": self.restores_checked, "vanished_while_read": self.vanished_while_read,
                "deletes": self.deletes, "gc_runs": self.gc_runs, "referencing_steps": self.referencing_steps,
                "failures": self.failures[:50], "failure_count": len(self.failures), "seconds": round(self.seconds, 1)}


class _Writer:
    """One writer process of one parity, restarted after each kill; counts its commits."""

    def __init__(self, url: str, parity: int, report: LiveSoakReport, lock: threading.Lock) -> None:
        self.url, self.parity, self.report, self.lock = url, parity, report, lock
        self.proc: Any = None
        self.pump: threading.Thread | None = None

    def start(self, above: int) -> None:
        from ckptfmt_tools.faults._procs import start_writers

        first = above + 1 + ((above + 1 + self.parity) % 2)
        steps = [first + 2 * k for k in range(2000)]  # more than a writer saves between two kills
        self.proc = start_writers(self.url, steps, 1, _SEED, incremental=True, heartbeat_s=HEARTBEAT_S,
                                  timeout_s=30).procs[0]
        self.pump = threading.Thread(target=self._count, args=(self.proc,), daemon=True)
        self.pump.start()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # never let a full pipe block it

    def _count(self, proc: Any) -> None:
        for line in proc.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("ok") is True:
                with self.lock:
                    self.report.commits += 1
            elif doc.get("untyped"):
                with self.lock:
                    self.report.failures.append(f"writer raised untyped {doc.get('error')}: {doc.get('message')}"[:300])

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        if self.pump is not None:
            self.pump.join(5)


def _restore_check(repo: Any, step: int) -> str | None:
    """None when ``step`` restores bit for bit, "vanished" when it stopped being listed (same
    save id) while read, else the failure."""
    from ckptfmt.errors import CheckpointError
    from ckptfmt_tools.faults import _data
    from ckptfmt_tools.faults._checks import restore_into, same

    try:
        sid = repo.manifest(step).save_id
    except CheckpointError:
        return "vanished"
    arrays = {k: v * 0 for k, v in _data.truth(_SEED, step, True).items()}
    state: dict[str, Any] = {}
    try:
        restore_into(repo.open(step), arrays, state)
    except CheckpointError as exc:
        try:
            still = repo.manifest(step).save_id == sid
        except CheckpointError:
            still = False
        return f"step {step} is listed and does not restore: {type(exc).__name__}: {exc}"[:300] if still else "vanished"
    want = _data.truth(_SEED, step, True)
    if not all(same(arrays[k], want[k]) for k in want) or not same(state, _data.global_state(_SEED, step)):
        return f"step {step} restored wrong values"
    return None


def _actors(url: str, report: LiveSoakReport, lock: threading.Lock, stop: threading.Event,
            rng: random.Random) -> list[threading.Thread]:
    """The two gc policies, the deleter and the live checker, each with its own repository."""
    from ckptfmt import Repository
    from ckptfmt.errors import CheckpointError

    def guarded(name: str, body: Any, pause: tuple[float, float]) -> Any:
        def loop() -> None:
            repo, r = Repository(url), random.Random(rng.random())
            while not stop.is_set():
                try:
                    body(repo, r)
                except CheckpointError as exc:
                    if name != "deleter" or "not committed" not in str(exc):
                        with lock:
                            report.failures.append(f"{name} raised {type(exc).__name__}: {exc}"[:300])
                except Exception as exc:  # noqa: BLE001 - any other error is a finding
                    with lock:
                        report.failures.append(f"{name} raised untyped {type(exc).__name__}: {exc}"[:300])
                stop.wait(r.uniform(*pause))
        return threading.Thread(target=loop, name=f"soak-{name}", daemon=True)

    def gc(keep_last: int, keep_every: int | None) -> Any:
        def body(repo: Any, r: random.Random) -> None:
            if not repo.steps():
                return  # not a repository until the first commit
            repo.gc(keep_last=keep_last, keep_every=keep_every, grace_s=GRACE_S)
            with lock:
                report.gc_runs += 1
        return body

    def delete(repo: Any, r: random.Random) -> None:
        steps = repo.steps()
        if len(steps) >= 2:
            repo.delete(r.choice(steps[:-1]))
            with lock:
                report.deletes += 1

    def check(repo: Any, r: random.Random) -> None:
        steps = repo.steps()
        if not steps:
            return
        why = _restore_check(repo, r.choice(steps[-4:]) if r.random() < 0.7 else r.choice(steps))
        with lock:
            if why is None:
                report.restores_checked += 1
            elif why == "vanished":
                report.vanished_while_read += 1
            else:
                report.failures.append(why)

    return [guarded("gc keep_last=3", gc(3, None), (0.2, 0.6)), guarded("gc keep_last=2 keep_every=4", gc(2, 4), (0.2, 0.6)),
            guarded("deleter", delete, (0.3, 1.0)), guarded("checker", check, (0.0, 0.1))]


def _round(root: Path, seconds: float, rng: random.Random, report: LiveSoakReport) -> None:
    from ckptfmt import Repository

    if root.exists():
        shutil.rmtree(root)
    url = str(root)
    lock, stop = threading.Lock(), threading.Event()
    writers = [_Writer(url, p, report, lock) for p in (0, 1)]
    for w in writers:
        w.start(0)
    actors = _actors(url, report, lock, stop, rng)
    for a in actors:
        a.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(rng.uniform(1.0, 4.0), max(0.0, end - time.monotonic())))
        if time.monotonic() >= end:
            break
        w = rng.choice(writers)
        w.kill()
        with lock:
            report.kills += 1
        w.start(max(Repository(url).steps(), default=0))
    for w in writers:
        w.kill()
    stop.set()
    for a in actors:
        a.join(120)
    _final(Repository(url), report)
    report.rounds += 1


def _final(repo: Any, report: LiveSoakReport) -> None:
    """Writers dead: gc without grace, then every listed step verifies and restores."""
    from ckptfmt.errors import CheckpointError

    repo.gc(grace_s=0)
    for step in repo.steps():
        try:
            repo.verify(step)
            report.referencing_steps += bool(repo.manifest(step).referenced_saves)
        except CheckpointError as exc:
            report.failures.append(f"after the round, step {step} does not verify: {type(exc).__name__}: {exc}"[:300])
            continue
        why = _restore_check(repo, step)
        if why is not None:
            report.failures.append(f"after the round: {why}")
        else:
            report.restores_checked += 1


def live_soak(workdir: str | Path, rounds: int = 6, seconds: float = 40.0, *, seed: int = 0) -> LiveSoakReport:
    """Run ``rounds`` rounds of ``seconds`` each under ``workdir`` (see the module docstring)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    report = LiveSoakReport()
    for i in range(rounds):
        _round(Path(workdir) / f"round-{i}", seconds, rng, report)
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ckptfmt_tools.faults.soak_live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = None
    workdir = args.workdir or (tmp := tempfile.mkdtemp(prefix="ckptfmt-live-soak-"))
    try:
        rep = live_soak(workdir, args.rounds, args.seconds, seed=args.seed)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(rep.to_json(), indent=None if args.json else 2))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
