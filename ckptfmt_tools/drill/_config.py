"""The drill's inputs: one frozen value, built from the command line, stored in the receipt."""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DrillConfig", "parser", "from_args", "default_mesh"]


def default_mesh(devices: int) -> str:
    """The ``data x model`` mesh used for ``devices`` devices: model parallel 2 when it divides."""
    if devices >= 4 and devices % 2 == 0:
        return f"{devices // 2}x2"
    return f"{devices}x1"


@dataclass(frozen=True)
class DrillConfig:
    processes: int = 2                 # processes of the training job
    devices_per_process: int = 4       # CPU devices of each training process
    replacement_devices: int = 4       # devices of the replacement job (one process)
    replacement: str = "jax"           # "jax" or "torch"
    train_mesh: str = ""               # data x model; "" = default_mesh(processes * devices_per_process)
    replacement_mesh: str = ""         # "" = default_mesh(replacement_devices)
    cadence: int = 5                   # steps between asynchronous saves
    step_time_s: float = 0.05          # minimum wall time of one training step (pacing)
    kill_window: tuple[int, int] = (0, 0)  # steps [lo, hi] the kill is drawn from; (0, 0) = automatic
    capacity_delay_s: float = 0.0      # extra wait before the replacement starts (a scheduler)
    monitor_interval_s: float = 0.1    # how often the supervisor polls its processes
    storage: str = ""                  # repository URL; "" = <out>/repo
    out: str = ""                      # output directory; "" = a new temporary directory
    seed: int = 0
    d_in: int = 256                    # model input width
    hidden: int = 2048                 # model hidden width (sets the checkpoint size)
    timeout_s: float = 240.0           # per job; every wait ends
    control: bool = True               # run the 8 -> 8 control restore
    tiers: bool = False                # local tier with peer replicas, and its four failures (drill --tiers)
    cold_cache: bool = False           # --tiers: drop the page cache before each failure's restore job (root)
    tier_pairs: int = 0                # --tiers: then this many (own local copy, persistent) restore pairs
    local_parent: str = ""             # --tiers: the local tiers go in a new directory here ("" = <out>)
    elastic: bool = False              # --tiers: lost hosts, no spare: restart on fewer processes (FORMAT.md 8.5)

    def elastic_mesh(self, nproc: int) -> str:
        """The mesh of an elastic restart on ``nproc`` processes: model parallel over every device."""
        return f"1x{nproc * self.devices_per_process}"

    @property
    def train_devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def mesh(self) -> str:
        return self.train_mesh or default_mesh(self.train_devices)

    @property
    def new_mesh(self) -> str:
        return self.replacement_mesh or default_mesh(self.replacement_devices)

    def window(self) -> tuple[int, int]:
        if self.kill_window != (0, 0):
            return self.kill_window
        return (2 * self.cadence + 1, 4 * self.cadence - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(kill_window=list(self.window()), train_mesh=self.mesh, replacement_mesh=self.new_mesh)
        return d

    def check(self) -> None:
        lo, hi = self.window()
        if self.cadence < 1:
            raise ValueError("--cadence must be >= 1")
        if self.tier_pairs < 0 or (self.tier_pairs and not self.tiers):
            raise ValueError("--tier-pairs takes a count >= 0, with --tiers")
        if self.elastic and not self.tiers:
            raise ValueError("--elastic goes with --tiers")
        if self.elastic and self.processes < 3:
            raise ValueError("--elastic needs --processes >= 3 (one host lost, then two, and a job left)")
        if self.elastic:
            for n in (self.processes - 1, self.processes - 2):
                if self.hidden % (n * self.devices_per_process):
                    raise ValueError(f"--elastic: --hidden {self.hidden} must split over {n * self.devices_per_process} "
                                     f"devices (the restart on {n} processes, mesh {self.elastic_mesh(n)})")
        if self.local_parent and not self.tiers:
            raise ValueError("--local-dir goes with --tiers")
        if self.local_parent and not os.path.isdir(self.local_parent):
            raise ValueError(f"--local-dir {self.local_parent}: not a directory")
        if not 1 <= lo <= hi:
            raise ValueError(f"--kill-window must satisfy 1 <= lo <= hi, got {lo}:{hi}")
        if lo <= self.cadence:
            raise ValueError(f"the kill window starts at step {lo}, before the first save (step {self.cadence})")
        if self.cadence > 1 and all(s % self.cadence == 0 for s in range(lo, hi + 1)):
            raise ValueError("the kill window holds only save steps")
        for name, mesh, n in (("train", self.mesh, self.train_devices),
                              ("replacement", self.new_mesh, self.replacement_devices)):
            d, m = (int(x) for x in mesh.split("x"))
            if d * m != n:
                raise ValueError(f"{name} mesh {mesh} does not cover {n} devices")
        if self.d_in % 8 or self.hidden % 8:
            raise ValueError("--d-in and --hidden must be multiples of 8 (they are sharded over the mesh)")
        if self.replacement not in ("jax", "torch"):
            raise ValueError("--replacement must be jax or torch")
        if self.tiers and lo <= 2 * self.cadence:
            raise ValueError(f"with --tiers the persistent tier saves every {2 * self.cadence} steps; the kill "
                             f"window must start after step {2 * self.cadence}, got {lo}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ckptfmt drill",
        description="The restore gate: train a real multi-process JAX job that saves asynchronously, "
                    "SIGKILL one process at a random step, bring up a replacement on a new topology, "
                    "restore the latest committed step, run exactly one step, and check it against the "
                    "uninterrupted run. Prints the phase table and the guide's table; writes a JSON receipt.")
    d = DrillConfig()
    ap.add_argument("--processes", type=int, default=d.processes, help="processes of the training job (%(default)s)")
    ap.add_argument("--devices-per-process", type=int, default=d.devices_per_process,
                    help="CPU devices per training process (%(default)s)")
    ap.add_argument("--replacement-devices", type=int, default=d.replacement_devices,
                    help="devices of the replacement (%(default)s; torch: ranks)")
    ap.add_argument("--replacement", choices=["jax", "torch"], default=d.replacement,
                    help="framework of the replacement job (%(default)s)")
    ap.add_argument("--train-mesh", default="", help="data x model mesh of the training job (default: N/2 x 2)")
    ap.add_argument("--replacement-mesh", default="", help="data x model mesh of the replacement")
    ap.add_argument("--cadence", type=int, default=d.cadence, help="steps between asynchronous saves (%(default)s)")
    ap.add_argument("--step-time", type=float, default=d.step_time_s,
                    help="minimum seconds per training step (%(default)s)")
    ap.add_argument("--kill-window", default="", metavar="LO:HI",
                    help="steps the kill is drawn from (default: 2*cadence+1 : 4*cadence-1)")
    ap.add_argument("--capacity-delay", type=float, default=d.capacity_delay_s,
                    help="seconds to wait for replacement capacity, like a scheduler (%(default)s)")
    ap.add_argument("--monitor-interval", type=float, default=d.monitor_interval_s,
                    help="seconds between the supervisor's liveness polls (%(default)s)")
    ap.add_argument("--storage", default="", help="repository URL (default: <out>/repo); must hold no step")
    ap.add_argument("--out", default="", help="output directory (default: a new temporary directory)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the kill step and victim (%(default)s)")
    ap.add_argument("--d-in", type=int, default=d.d_in, help="model input width (%(default)s)")
    ap.add_argument("--hidden", type=int, default=d.hidden,
                    help="model hidden width; sets the checkpoint size (%(default)s)")
    ap.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds allowed per job (%(default)s)")
    ap.add_argument("--no-control", action="store_true", help="skip the same-topology control restore")
    ap.add_argument("--tiers", action="store_true",
                    help="keep a local tier with peer replicas (persistent every 2 x cadence) and run its four "
                         "failures: killed process, lost host, every local copy lost, corrupt local copy")
    ap.add_argument("--cold-cache", action="store_true",
                    help="--tiers: drop the page cache before each tier failure's restore job (root), as for a "
                         "replacement whose host never read the persistent tier (/dev/shm stays: it is memory)")
    ap.add_argument("--tier-pairs", type=int, default=0,
                    help="--tiers: then N pairs of replacement jobs, one restoring from the own local copies and one "
                         "from the persistent tier, back to back in alternating order; prints their paired recovery "
                         "times (%(default)s)")
    ap.add_argument("--local-dir", default="",
                    help="--tiers: keep the local tiers in a new directory under this one, removed at the end "
                         "(for example /dev/shm, host memory, as a production local tier; default: the output "
                         "directory, on the same file system as the default persistent tier)")
    ap.add_argument("--elastic", action="store_true",
                    help="--tiers: instead of the four same-topology failures, the killed process's host is lost and "
                         "the job restarts on one process fewer with no spare (mesh 1 x devices), then with two hosts "
                         "lost on two fewer (the boxes only they held from the persistent tier); --tier-pairs then pair "
                         "the elastic recovery through the tiers with one from the persistent tier alone "
                         "(--replacement torch: the restarts are torch gloo ranks)")
    ap.add_argument("--json", action="store_true", help="print the receipt as JSON instead of tables")
    return ap


def from_args(ns: argparse.Namespace) -> DrillConfig:
    window = (0, 0)
    if ns.kill_window:
        lo, _, hi = ns.kill_window.partition(":")
        window = (int(lo), int(hi or lo))
    cfg = DrillConfig(processes=ns.processes, devices_per_process=ns.devices_per_process,
                      replacement_devices=ns.replacement_devices, replacement=ns.replacement,
                      train_mesh=ns.train_mesh, replacement_mesh=ns.replacement_mesh, cadence=ns.cadence,
                      step_time_s=ns.step_time, kill_window=window, capacity_delay_s=ns.capacity_delay,
                      monitor_interval_s=ns.monitor_interval, storage=ns.storage, out=ns.out, seed=ns.seed,
                      d_in=ns.d_in, hidden=ns.hidden,
                      timeout_s=ns.timeout, control=not ns.no_control, tiers=ns.tiers,
                      cold_cache=ns.cold_cache, tier_pairs=ns.tier_pairs,
                      local_parent=ns.local_dir, elastic=ns.elastic)
    cfg.check()
    return cfg
