"""The drill's supervisor: train, kill, detect, replace, restore, step, judge. Imports no framework.

Timeline (wall clock, ``time.time()`` in every process of this one machine):

1. The training job starts: ``processes`` ranks of ``jax.distributed`` on CPU, each with
   ``devices_per_process`` devices, saving asynchronously every ``cadence`` steps.
2. A chaos thread watches rank 0's step log and SIGKILLs the victim rank when the log reaches the
   kill step (drawn with the seed from the kill window, never a save step, so the step after the
   last committed one is always in the log). The clock starts here.
3. The supervisor polls its processes every ``monitor_interval_s`` (as torchrun's agent does).
   When it sees the victim's exit, that is detection. The job is over: the surviving ranks are torn
   down. Then the supervisor waits ``capacity_delay_s`` for replacement capacity.
4. The replacement starts on the new topology, restores the latest committed step, compares the
   reconstructed state hashes with the saved ones, runs exactly one step, then runs the rejected
   control (a copy of the step with one shard object deleted, restored into its live state).
5. The control: a fresh job on the original topology restores the same step and runs one step.
6. The continuation receipt compares both against the original run's log: the same batch ids,
   and the loss within the training module's documented tolerance.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
import time
from typing import Any

from ._config import DrillConfig
from ckptfmt.coord import free_port

from ._procs import Proc, kill_all, launch, read_json, wait_all
from ._tiers import judge_tiers, local_dir, run_tiers

__all__ = ["run_drill", "DrillFailed"]


class DrillFailed(RuntimeError):
    """The drill could not run to the end (a job failed or timed out); carries the partial receipt."""

    def __init__(self, message: str, receipt: dict[str, Any]) -> None:
        super().__init__(message)
        self.receipt = receipt


def _env(devices: int) -> dict[str, str]:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            "OMP_NUM_THREADS": "1"}


def _model_args(cfg: DrillConfig) -> list[str]:
    return ["--d-in", str(cfg.d_in), "--hidden", str(cfg.hidden)]


def _read_log(path: str) -> tuple[dict[int, dict[str, Any]], list[int]]:
    steps: dict[int, dict[str, Any]] = {}
    saves: list[int] = []
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a line being written
                rec = json.loads(line)
                if "step" in rec:
                    steps[int(rec["step"])] = rec
                elif "save_started" in rec:
                    saves.append(int(rec["save_started"]))
    except FileNotFoundError:
        pass
    return steps, saves


def _plan_kill(cfg: DrillConfig) -> tuple[int, int]:
    rng = random.Random(cfg.seed)
    lo, hi = cfg.window()
    # Never a save step: the step after the latest committed one is then always in the log.
    candidates = [s for s in range(lo, hi + 1) if cfg.cadence == 1 or s % cfg.cadence != 0]
    return rng.choice(candidates), rng.randrange(cfg.processes)


class _Chaos(threading.Thread):
    """Kill the victim once rank 0's log shows the kill step."""

    def __init__(self, log: str, victim: Proc, kill_step: int, stop: threading.Event) -> None:
        super().__init__(name="drill-chaos", daemon=True)
        self.log, self.victim, self.kill_step, self.stop = log, victim, kill_step, stop
        self.t_kill: float | None = None
        self.step_at_kill: int | None = None
        self._pos = 0
        self._last = 0

    def _poll_log(self) -> None:
        try:
            with open(self.log) as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind("\n")
        if end < 0:
            return
        self._pos += len(chunk[:end + 1].encode())
        for line in chunk[:end].splitlines():
            rec = json.loads(line)
            if "step" in rec:
                self._last = int(rec["step"])

    def run(self) -> None:
        while not self.stop.is_set():
            self._poll_log()
            if self._last >= self.kill_step:
                import signal

                os.kill(self.victim.pid, signal.SIGKILL)
                self.t_kill = time.time()
                self.step_at_kill = self._last
                return
            time.sleep(0.005)


def _train(cfg: DrillConfig, work: str, url: str, kill_step: int, victim_rank: int,
           dropout: float, tier_root: str) -> dict[str, Any]:
    # drill --tiers: a local tier every cadence steps, the persistent tier every 2 * cadence.
    tiers = ["--local", local_dir(tier_root), "--local-every", str(cfg.cadence)] if cfg.tiers else []
    cadence = 2 * cfg.cadence if cfg.tiers else cfg.cadence
    log = os.path.join(work, "train-steps.jsonl")
    port = free_port()
    lo, hi = cfg.window()
    max_steps = hi + 4 * cfg.cadence
    procs = []
    for r in range(cfg.processes):
        argv = ["-m", "ckptfmt_tools.drill._job", "train", "--devices", str(cfg.devices_per_process), "--mesh", cfg.mesh,
                "--url", url, "--out", os.path.join(work, "train-result.json"), "--log", log,
                "--nproc", str(cfg.processes), "--rank", str(r), "--port", str(port), "--cadence", str(cadence),
                "--max-steps", str(max_steps), "--step-time", str(cfg.step_time_s), "--dropout", str(dropout),
                *_model_args(cfg), *tiers]
        procs.append(launch(f"train-rank{r}", argv, env=_env(cfg.devices_per_process), logdir=work))
    victim = procs[victim_rank]
    stop = threading.Event()
    chaos = _Chaos(log, victim, kill_step, stop)
    chaos.start()
    deadline = time.monotonic() + cfg.timeout_s
    t_detect = None
    try:
        while True:
            rcs = [p.poll() for p in procs]
            if chaos.t_kill is not None and rcs[victim_rank] is not None:
                t_detect = time.time()
                break
            if chaos.t_kill is None and any(rc is not None for rc in rcs):
                stop.set()
                bad = [p for p in procs if p.popen.returncode is not None]
                raise RuntimeError("the training job ended before the kill:\n"
                                   + "\n".join(f"{p.name} rc={p.popen.returncode}\n{p.tail()}" for p in bad))
            if time.monotonic() > deadline:
                stop.set()
                raise RuntimeError(f"the training job did not reach step {kill_step} within {cfg.timeout_s:.0f} s:\n"
                                   + procs[0].tail())
            time.sleep(cfg.monitor_interval_s)
        # The job is over: tear down the surviving ranks (a scheduler ends the whole job).
        survivors = []
        for p in procs:
            if p is victim:
                continue
            rc = p.poll()
            survivors.append({"rank": procs.index(p), "exited_on_its_own": rc is not None, "rc": rc})
        kill_all(procs)
        t_torn = time.time()
    finally:
        stop.set()
        kill_all(procs)
    steps, saves_started = _read_log(log)
    return {"kill_step": kill_step, "step_at_kill": chaos.step_at_kill, "victim_rank": victim_rank,
            "victim_pid": victim.pid, "victim_rc": victim.popen.returncode, "t_kill": chaos.t_kill,
            "t_detect": t_detect, "t_torn_down": t_torn, "survivors": survivors, "t_train_launch": procs[0].t_launch,
            "steps_logged": max(steps) if steps else 0, "saves_started": saves_started, "log": log,
            "reference": {str(k): {"loss": v["loss"], "ids": v["ids"]} for k, v in sorted(steps.items())}}


def _restore_job(name: str, cfg: DrillConfig, work: str, url: str, *, nproc: int, devices: int, mesh: str,
                 dropout: float, rejected_control: str = "", victim: int = 0, local: str = "") -> tuple[dict[str, Any], float]:
    port = free_port() if nproc > 1 else 0
    out = os.path.join(work, f"{name}-result.json")
    procs = []
    for r in range(nproc):
        argv = ["-m", "ckptfmt_tools.drill._job", "restore", "--devices", str(devices), "--mesh", mesh, "--url", url,
                "--out", out, "--nproc", str(nproc), "--rank", str(r), "--port", str(port),
                "--dropout", str(dropout), "--victim", str(victim), *_model_args(cfg)]
        if rejected_control:
            argv += ["--rejected-control", rejected_control]
        if local:
            argv += ["--local", local, "--local-every", str(cfg.cadence)]
        procs.append(launch(f"{name}-rank{r}" if nproc > 1 else name, argv, env=_env(devices), logdir=work))
    errors = wait_all(procs, cfg.timeout_s, result_path=out)
    if errors:
        raise RuntimeError(f"the {name} job failed:\n" + "\n---\n".join(errors))
    res = read_json(out)
    res["exit_notes"] = {p.name: p.extra["after_result"] for p in procs if "after_result" in p.extra}
    return res, procs[0].t_launch


def _torch_job(cfg: DrillConfig, work: str, url: str, rejected_control: str,
               victim: int) -> tuple[dict[str, Any], float]:
    from ._torch_launch import run_torch_replacement

    return run_torch_replacement(cfg, work, url, rejected_control, victim)


def _control_url(url: str, work: str) -> str:
    if "://" not in url or url.startswith("file://"):
        return os.path.join(work, "control-missing-shard")
    return url.rstrip("/") + "-control-missing-shard"


def _environment() -> dict[str, Any]:
    import platform
    import sys

    from ckptfmt import __version__

    return {"ckptfmt": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "argv": sys.argv}


def run_drill(cfg: DrillConfig, *, progress: Any = None) -> dict[str, Any]:
    """Run the whole drill and return the receipt (also written to ``<out>/receipt.json``).

    Raises DrillFailed (with the partial receipt) when a job fails or a wait times out; a receipt
    whose checks fail is returned normally with ``"pass": false``.
    """
    from . import _judge

    say = progress or (lambda msg: None)
    work = os.path.abspath(cfg.out) if cfg.out else tempfile.mkdtemp(prefix="ckptfmt-drill-")
    os.makedirs(work, exist_ok=True)
    url = cfg.storage or os.path.join(work, "repo")
    from ckptfmt import Repository

    if Repository(url).steps():
        raise ValueError(f"the storage URL {url} already holds committed steps; give an empty one")
    kill_step, victim = _plan_kill(cfg)
    dropout = 0.0 if cfg.replacement == "torch" else 0.1
    # --tiers: the local tiers (and the drill's scratch copies of them) live under tier_root: the
    # output directory, or a new directory under --local-dir that the drill removes at the end.
    tier_root = tempfile.mkdtemp(prefix="ckptfmt-drill-local-", dir=cfg.local_parent) if cfg.local_parent else work
    receipt: dict[str, Any] = {"drill": "ckptfmt drill", "version": 1, "work_dir": work,
                               "inputs": {**cfg.to_json(), "storage": url, "kill_step": kill_step,
                                          "victim_rank": victim, "dropout": dropout,
                                          "local_tier_dir": local_dir(tier_root) if cfg.tiers else None,
                                          "environment": _environment()}}
    try:
        say(f"training: {cfg.processes} processes x {cfg.devices_per_process} devices (mesh {cfg.mesh}), "
            + (f"local tier every {cfg.cadence} steps, persistent every {2 * cfg.cadence}; " if cfg.tiers else
               f"async save every {cfg.cadence} steps; ") + f"SIGKILL of rank {victim} at step {kill_step}")
        train = _train(cfg, work, url, kill_step, victim, dropout, tier_root)
        receipt["train"] = train
        say(f"killed rank {victim} at step {train['step_at_kill']}; detected after "
            f"{train['t_detect'] - train['t_kill']:.3f} s")
        t_cap = time.time()
        if cfg.capacity_delay_s > 0:
            time.sleep(cfg.capacity_delay_s)
        t_cap_end = time.time()
        ctrl_url = _control_url(url, work)
        say(f"replacement: {cfg.replacement_devices} torch gloo ranks" if cfg.replacement == "torch"
            else f"replacement: jax, {cfg.replacement_devices} devices (mesh {cfg.new_mesh})")
        if cfg.replacement == "torch":
            repl, t_launch = _torch_job(cfg, work, url, ctrl_url, victim)
        else:
            repl, t_launch = _restore_job("replacement", cfg, work, url, nproc=1, devices=cfg.replacement_devices,
                                          mesh=cfg.new_mesh, dropout=dropout, rejected_control=ctrl_url,
                                          victim=victim)
        repl["t_launch"] = t_launch
        receipt["replacement"] = repl
        receipt["capacity_wait"] = {"t_start": t_cap, "t_end": t_cap_end}
        if cfg.control:
            say(f"control: {cfg.processes} x {cfg.devices_per_process} devices (mesh {cfg.mesh}) "
                "restores the same step")
            ctrl, t_launch = _restore_job("control", cfg, work, url, nproc=cfg.processes,
                                          devices=cfg.devices_per_process, mesh=cfg.mesh, dropout=dropout)
            ctrl["t_launch"] = t_launch
            receipt["control"] = ctrl
        if cfg.tiers:
            def tier_job(name: str, local: str, nproc: int = 0) -> tuple[dict[str, Any], float]:
                if cfg.replacement == "torch":  # one gloo rank per (surviving) training process, the torch manager
                    from ._torch_launch import run_torch_tier_job

                    return run_torch_tier_job(cfg, work, url, name, local, nproc)
                # elastic (nproc given): fewer processes, no spare, model parallel over their devices
                return _restore_job(name, cfg, work, url, nproc=nproc or cfg.processes, devices=cfg.devices_per_process,
                                    mesh=cfg.elastic_mesh(nproc) if nproc else cfg.mesh, dropout=dropout, local=local)

            receipt["tiers"] = run_tiers(cfg, work, url, victim, tier_job, say, tier_root=tier_root)
    except Exception as exc:
        receipt["error"] = f"{type(exc).__name__}: {exc}"
        _write_receipt(work, receipt)
        raise DrillFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, receipt) from exc
    finally:
        if tier_root != work:  # host memory or a local disk the user named: leave nothing behind
            shutil.rmtree(tier_root, ignore_errors=True)
    receipt.update(_judge.judge(receipt))
    if cfg.tiers:
        receipt["tiers_verdict"] = judge_tiers(receipt["tiers"], receipt["train"]["reference"], receipt["train"])
        receipt["pass"] = bool(receipt["pass"] and receipt["tiers_verdict"]["ok"])
    _write_receipt(work, receipt)
    return receipt


def _write_receipt(work: str, receipt: dict[str, Any]) -> None:
    path = os.path.join(work, "receipt.json")
    receipt["receipt_path"] = path
    with open(path + ".tmp", "w") as f:
        json.dump(receipt, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
