"""Acceptance of the checkpoint managers with real processes (issue 16).

JAX: three 2-process jax.distributed jobs (4 CPU devices each) run at once, each training with
bridges.jax.CheckpointManager(save_every_steps=5), async:
  best  keep_best=2 by eval_loss, keep_last=1; at step 40 the repository is listed; then SIGTERM
        to rank 1 only at a random later step;
  term  SIGTERM (twice) to both ranks at a random step;
  kill  SIGTERM to both after step 5 committed, every later save crawls, and SIGKILL to both once
        the preemption save is in flight (a grace period that ran out).
Then one process of 4 devices resumes from them: the continuation receipt (ckptfmt_tools.receipt.judge)
against the uninterrupted "best" run, the killed run, a copy of "term" with one shard flipped
(fallback, fallback=False, and the explicit damaged step as the broken control), and a missing step.
torch: the same scenarios with 2 gloo ranks (tests/torchproc/manager_job.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptfmt import Repository
from ckptfmt.coord import free_port
from manager_common import eval_loss, flip_one_shard

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("CKPTFMT_TEST_SEED", time.time_ns() % 100_000))
pytestmark = pytest.mark.multiprocess


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))


@dataclass
class Job:
    """A training job the driver watches: which ranks get SIGTERM at which step, and whether to SIGKILL."""

    name: str
    url: Path
    log: Path
    term_ranks: tuple[int, ...]
    term_at: int
    term_times: int = 1
    kill_on_save: bool = False
    termed_after: int | None = None
    killed: bool = False

    def last(self) -> tuple[int, bool]:
        step, saving = 0, False
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                if line.endswith("}"):
                    rec = json.loads(line)
                    step = rec.get("step", step)
                    saving = saving or "preempt_save_started" in rec
        return step, saving

    def pid(self, rank: int) -> int:
        return int((self.log.parent / f"{self.name}-{rank}.pid").read_text())

    def poke(self) -> None:
        step, saving = self.last()
        if self.termed_after is None and step >= self.term_at:
            for _ in range(self.term_times):
                for r in self.term_ranks:
                    _signal(self.pid(r), signal.SIGTERM)
                time.sleep(0.01)
            self.termed_after = step
        if self.kill_on_save and saving and not self.killed:
            for r in range(2):
                _signal(self.pid(r), signal.SIGKILL)
            self.killed = True

    def rcs(self) -> list[int | None]:
        out = []
        for r in range(2):
            p = self.log.parent / f"{self.name}-{r}.rc"
            out.append(int(p.read_text()) if p.exists() else None)
        return out

    def outputs(self) -> list[dict]:
        assert self.rcs() == [0, 0], f"{self.name}: exit codes {self.rcs()} (seed {SEED})\n" + "\n".join(
            _tail(self.log.parent / f"{self.name}-{r}.err") for r in range(2))
        return [json.loads((self.log.parent / f"{self.name}-{r}.json").read_text()) for r in range(2)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _drive(zygote: list[str], jobs: list[Job], timeout_s: float) -> float:
    """Run the zygote that forks every job's ranks; watch the logs and send the signals. Returns seconds."""
    t0 = time.monotonic()
    with open(jobs[0].log.parent / "zygote.log", "w") as log:
        proc = subprocess.Popen(zygote, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while proc.poll() is None:
            for j in jobs:
                j.poke()
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"jobs still running after {timeout_s:.0f} s (seed {SEED})")
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, _tail(jobs[0].log.parent / "zygote.log")
    return time.monotonic() - t0


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "<none>"


# ------------------------------------------------------------------------------ the runs

SCRIPTS = {"jax": ROOT / "tests" / "jaxproc" / "manager_job.py", "torch": ROOT / "tests" / "torchproc" / "manager_job.py"}
NEEDS = {"jax": ("jax", "flax", "optax"), "torch": ("torch",)}


def _acceptance(framework: str, work: Path) -> dict:
    """Run the three training jobs at once (one zygote forks their ranks), then the resume process."""
    rng = random.Random(f"{SEED}-{framework}")
    jobs = [Job("best", work / "best", work / "best.jsonl", (1,), rng.randint(41, 46)),
            Job("term", work / "term", work / "term.jsonl", (0, 1), rng.randint(7, 27), term_times=2),
            Job("kill", work / "kill", work / "kill.jsonl", (0, 1), 6, kill_on_save=True)]
    script = str(SCRIPTS[framework])
    spec = []
    for j in jobs:
        port = free_port()
        extra = {"best": ["--keep-best", "--record-at", "40"], "term": [], "kill": ["--slow-after", "5"]}[j.name]
        # Later jobs start once the first logged a step (JAX: its compiled programs are in the cache).
        after = {"wait_for": str(jobs[0].log)} if j is not jobs[0] and framework == "jax" else {}
        spec += [{"name": f"{j.name}-{r}", "argv": ["train", "--url", str(j.url), "--out", str(work / f"{j.name}-{r}.json"),
                                                    "--log", str(j.log), "--port", str(port), "--rank", str(r), *extra],
                  **after} for r in range(2)]
    (work / "spec.json").write_text(json.dumps(spec))
    train_s = _drive([sys.executable, script, "zygote", str(work / "spec.json")], jobs, 240)
    out = {"jobs": {j.name: j for j in jobs}, "train_s": train_s, "work": work,
           "best": jobs[0].outputs(), "term": jobs[1].outputs()}
    out["reference"] = {r["step"]: r for r in map(json.loads, (work / "best.jsonl").read_text().splitlines())
                        if "step" in r}
    # Resume from them in one process (JAX: 4 devices; torch: one rank).
    term_step = out["term"][0]["preempted_at"]
    damaged = work / "term-damaged"
    shutil.copytree(jobs[1].url, damaged)
    out["flipped"] = flip_one_shard(str(damaged), term_step, writer=1)
    missing = max(Repository(str(jobs[1].url)).steps()) + 1000
    tasks = [{"name": "receipt", "url": str(jobs[1].url)},
             {"name": "killed", "url": str(jobs[2].url)},
             {"name": "fallback", "url": str(damaged)},
             {"name": "no_fallback", "url": str(damaged), "fallback": False},
             {"name": "damaged_explicit", "url": str(damaged), "step": term_step},
             {"name": "missing", "url": str(jobs[1].url), "step": missing},
             {"name": "sigterm", "url": str(work / "sigterm")}]
    (work / "tasks.json").write_text(json.dumps(tasks))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, script, "resume", "--tasks", str(work / "tasks.json"),
                        "--out", str(work / "resume.json")], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    out["resume_s"] = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out["resume"] = json.loads((work / "resume.json").read_text())
    lag = {j.name: (j.termed_after, (out.get(j.name) or [{}])[0].get("preempted_at")) for j in jobs[:2]}
    print(f"\nmanager acceptance ({framework}): seed {SEED}, training jobs {train_s:.1f} s, "
          f"resume {out['resume_s']:.1f} s; (SIGTERM after step, preempted at) {lag}")
    return out


@pytest.fixture(scope="module", params=["jax", "torch"])
def runs(request, tmp_path_factory) -> dict:
    fw = request.param
    missing = [m for m in NEEDS[fw] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {missing}")
    return _acceptance(fw, tmp_path_factory.mktemp(f"manager-{fw}"))


def _receipt(saved_step: int, digests: dict, reference: dict, restored: dict) -> dict:
    from ckptfmt_tools.receipt import judge

    saved = {"step": saved_step, "digests": digests, "batch_ids_k1": reference[saved_step + 1]["ids"],
             "loss_k1": reference[saved_step + 1]["loss"], "loss_k2": reference[saved_step + 2]["loss"]}
    return judge(saved, restored)


def test_sigterm_to_both_saves_one_boundary_and_resumes_exactly(runs):
    ranks = runs["term"]
    k = ranks[0]["preempted_at"]
    assert k is not None and k == ranks[1]["preempted_at"] >= runs["jobs"]["term"].termed_after, ranks
    assert all(k in r["started"] for r in ranks)  # both ranks saved step k
    assert ranks[0]["latest_after_close"] == k == Repository(str(runs["jobs"]["term"].url)).latest()
    got = runs["resume"]["receipt"]
    assert got["step"] == k and got["skipped"] == []
    verdict = _receipt(k, ranks[0]["digests"], runs["reference"], got)
    assert verdict["ok"], verdict


def test_sigterm_to_one_process_saves_on_both(runs):
    ranks = runs["best"]
    k = ranks[0]["preempted_at"]
    assert k is not None and k == ranks[1]["preempted_at"] > 40, ranks
    assert all(k in r["started"] for r in ranks)
    assert Repository(str(runs["jobs"]["best"].url)).latest() == k


def test_keep_best_two_and_newest(runs):
    best = sorted(range(5, 41, 5), key=eval_loss)[:2]
    assert runs["best"][0]["steps_at_record"] == sorted(best + [40])
    k = runs["best"][0]["preempted_at"]
    saved = list(range(5, k + 1, 5)) + ([k] if k % 5 else [])
    # Ties go to the newer step (the manager's rule): k may tie with an earlier best (e.g. 43 and 30).
    best_two = sorted(saved, key=lambda s: (eval_loss(s), -s))[:2]
    assert Repository(str(runs["jobs"]["best"].url)).steps() == sorted(set(best_two + [k]))


def test_sigkill_during_preemption_save_leaves_the_previous_step(runs):
    job = runs["jobs"]["kill"]
    assert job.killed and job.rcs() == [-9, -9]
    steps = Repository(str(job.url)).steps()
    preempted = [json.loads(x)["preempt_save_started"] for x in job.log.read_text().splitlines() if "preempt_save" in x]
    assert len(preempted) == 1 and steps and 5 <= steps[-1] < preempted[0]  # the step being saved never shows
    for s in steps:
        assert Repository(str(job.url)).verify(s) > 0  # nothing partial is listed
    got = runs["resume"]["killed"]
    assert got["step"] == steps[-1] and got["skipped"] == []
    assert got["batch_ids_k1"] == runs["reference"][steps[-1] + 1]["ids"]


def test_damaged_newest_falls_back_and_reports(runs):
    k = runs["term"][0]["preempted_at"]
    prev = max(s for s in range(5, k, 5))
    got = runs["resume"]["fallback"]
    assert got["step"] == prev and got["skipped"] == [[k, "ChecksumMismatchError"]], got
    ref = runs["reference"]
    assert got["batch_ids_k1"] == ref[prev + 1]["ids"]
    assert abs(got["loss_k1"] - ref[prev + 1]["loss"]) <= 1e-6 * abs(ref[prev + 1]["loss"])
    assert runs["resume"]["no_fallback"]["error"] == "ChecksumMismatchError"
    # Broken control: the flipped step itself is rejected; the undamaged original restored it (receipt).
    assert runs["resume"]["damaged_explicit"]["error"] == "ChecksumMismatchError"
    assert runs["resume"]["receipt"]["step"] == k


def test_missing_step_raises(runs):
    assert runs["resume"]["missing"]["error"] == "StepNotFoundError"


def test_single_process_sigterm(runs):
    """Without a process group the manager's own SIGTERM flag decides (control: not before it)."""
    assert runs["resume"]["sigterm"] == {"before": False, "after": True}
