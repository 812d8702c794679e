"""Start a torch job of the drill (a zygote forking the gloo ranks) and collect its result: the
replacement, or (drill --tiers --replacement torch) a tier scenario's restore on the training topology."""
from __future__ import annotations

import os
from typing import Any

from ._config import DrillConfig
from ._procs import launch, read_json, wait_all

__all__ = ["run_torch_replacement", "run_torch_tier_job"]


def _run(cfg: DrillConfig, work: str, name: str, url: str, world: int, extra_argv: list[str]) -> tuple[dict[str, Any], float]:
    out = os.path.join(work, f"{name}-result.json")
    argv = ["-m", "ckptfmt_tools.drill._torch_job", "--url", url, "--out", out, "--world", str(world),
            "--timeout", str(cfg.timeout_s), *extra_argv]
    proc = launch(name, argv, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, logdir=work)
    errors = wait_all([proc], cfg.timeout_s, result_path=out)
    if errors:
        raise RuntimeError(f"the torch job {name} failed:\n" + "\n---\n".join(errors))
    return read_json(out), proc.t_launch


def run_torch_replacement(cfg: DrillConfig, work: str, url: str, rejected_control: str,
                          victim: int) -> tuple[dict[str, Any], float]:
    res, t_launch = _run(cfg, work, "replacement-torch", url, cfg.replacement_devices,
                         ["--rejected-control", rejected_control, "--victim", str(victim)])
    return res, t_launch


def run_torch_tier_job(cfg: DrillConfig, work: str, url: str, name: str, local: str,
                       nproc: int = 0) -> tuple[dict[str, Any], float]:
    """One gloo rank per training process (``nproc`` ranks for an elastic restart: ``local`` then
    names each rank's tier with ``{rank}``), restoring through ``bridges.torch.CheckpointManager``
    with the local tier ``local`` (the JAX job's)."""
    return _run(cfg, work, name, url, nproc or cfg.processes, ["--local", local, "--local-every", str(cfg.cadence)])
