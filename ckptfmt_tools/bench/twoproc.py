"""Two processes (``--two-process``): ckptfmt saves the bench state from 2 processes x 4 JAX CPU
devices (``jax.distributed``), to set against DCP's 8 gloo ranks.

The child task :func:`save` starts both processes (``python -m ckptfmt_tools.bench.twoproc``),
each builds its half of the row-sharded state, and both time one ``bridges.jax.save`` between
two barriers. The phase's wall time is the slower process's; RSS is summed over processes, as
for DCP; ``bytes_per_process`` counts what each process wrote (from the manifest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .child import Meter, rss_bytes, sync_after, tree_stats
from .jaxstate import xla_env
from .layout import StateLayout
from .ours import clear_repository, local_path

PROCESSES = 2


def save(params: dict) -> dict:
    """Child task: one 2-process save of the state (``params``: layout, url, devices in all)."""
    from ckptfmt.coord import free_port

    devices = int(params["devices"])
    if devices % PROCESSES:
        raise ValueError(f"{devices} devices do not split over {PROCESSES} processes")
    clear_repository(params["url"])
    os.sync()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ckptfmt-2proc-") as tmp:
        env = dict(os.environ) | xla_env(devices // PROCESSES)
        outs = [Path(tmp, f"{r}.json") for r in range(PROCESSES)]
        Path(tmp, "params.json").write_text(json.dumps(params))
        procs = [subprocess.Popen([sys.executable, "-m", "ckptfmt_tools.bench.twoproc", str(r), str(port),
                                   str(Path(tmp, "params.json")), str(outs[r])], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(PROCESSES)]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=params.get("timeout_s", 1800))[0])
        finally:
            for p in procs:
                p.kill()
        if any(p.returncode for p in procs) or not all(o.exists() for o in outs):
            raise RuntimeError("two-process save failed:\n" + "\n".join(x[-2000:] for x in logs))
        ranks = [json.loads(o.read_text()) for o in outs]
    layout = StateLayout.from_json(params["layout"])
    phase = {"wall_s": max(r["wall_s"] for r in ranks), "rss_before": sum(r["rss_before"] for r in ranks),
             "rss_peak": sum(r["rss_peak"] for r in ranks), "rss_base": sum(r["rss_base"] for r in ranks),
             "state_bytes": layout.nbytes, "processes": PROCESSES, "sync_after_s": sync_after(),
             "bytes_per_process": ranks[0]["bytes_per_process"], "api": "bridges.jax.save, 2 processes (jax.distributed)"}
    phase |= {k: v for k, v in ranks[0].items() if k.startswith("save_t_")}
    path = local_path(params["url"])
    out = {"phase": phase, "disk": tree_stats(path) if path else {}}
    clear_repository(params["url"])
    return out


def _rank_main(rank: int, port: int, params_path: str, out_path: str) -> None:
    params = json.loads(Path(params_path).read_text())
    import jax

    from ckptfmt_tools.jaxjoin import join as join_jax
    join_jax(port, PROCESSES, rank, timeout=120)
    from jax.experimental.multihost_utils import sync_global_devices

    import bridges.jax as bj
    from ckptfmt import SaveOptions

    from .jaxstate import make_state

    layout = StateLayout.from_json(params["layout"])
    rss_base = rss_bytes()
    state = make_state(layout, int(params["devices"]))  # rows over every process's devices
    timings: dict[str, float] = {}
    sync_global_devices("bench/start")
    with Meter("save") as m:
        manifest = bj.save(params["url"], state, step=1, options=SaveOptions(timings=timings, timeout_s=600))
    per = [0] * PROCESSES
    for t in manifest.tensors.values():
        for w, n in zip(t.shards.writer, t.shards.nbytes):
            per[int(w)] += int(n)
    sync_global_devices("bench/end")
    Path(out_path).write_text(json.dumps(m.result | {"rss_base": rss_base, "bytes_per_process": per}
                                         | {f"save_t_{k}_s": v for k, v in timings.items()}))


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
