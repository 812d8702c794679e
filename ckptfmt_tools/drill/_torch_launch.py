"""Start the torch replacement (a zygote forking the gloo ranks) and collect its result."""
from __future__ import annotations

import os
from typing import Any

from ._config import DrillConfig
from ._procs import launch, read_json, wait_all

__all__ = ["run_torch_replacement"]


def run_torch_replacement(cfg: DrillConfig, work: str, url: str, rejected_control: str,
                          victim: int) -> tuple[dict[str, Any], float]:
    out = os.path.join(work, "replacement-result.json")
    argv = ["-m", "ckptfmt_tools.drill._torch_job", "--url", url, "--out", out, "--world", str(cfg.replacement_devices),
            "--rejected-control", rejected_control, "--victim", str(victim), "--timeout", str(cfg.timeout_s)]
    proc = launch("replacement-torch", argv, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, logdir=work)
    errors = wait_all([proc], cfg.timeout_s, result_path=out)
    if errors:
        raise RuntimeError("the torch replacement failed:\n" + "\n---\n".join(errors))
    return read_json(out), proc.t_launch
