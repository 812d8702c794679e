"""Peer runs: Orbax ``StandardCheckpointer`` and torch DCP, each in its default format.

Each function here is a child task (see :mod:`ckptfmt_tools.bench.child`). Orbax runs
in one JAX process with N CPU devices. DCP runs as N gloo ranks: a launcher
process imports torch once, then forks one process per rank, so that start-up
does not dominate the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

from ckptfmt.coord import free_port

from .child import Meter, rss_bytes, sync_after, tree_stats
from .layout import StateLayout, check_rows, rows_data

PEERS = ("orbax", "dcp")
_PEER_MODULES = {"orbax": "orbax.checkpoint", "dcp": "torch.distributed.checkpoint"}


def peer_available(name: str) -> str | None:
    """None if the peer can run here, else why not."""
    mod = _PEER_MODULES[name]
    try:
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    except (ImportError, ValueError) as e:
        return f"{mod} cannot be imported: {e}"
    return None


# --------------------------------------------------------------------------- Orbax


def orbax_save(params: dict) -> dict:
    """Child task: StandardCheckpointer save from N devices, timed through wait_until_finished."""
    import jax
    import orbax.checkpoint as ocp

    from .jaxstate import make_state

    layout, path = StateLayout.from_json(params["layout"]), params["path"]
    shutil.rmtree(path, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    rss_base = rss_bytes()
    state = make_state(layout, params["devices"])
    with Meter("save") as m:
        ckptr.save(path, state)
        ckptr.wait_until_finished()
    sync_s = sync_after()  # not part of the row: shows whether the save left data unflushed
    out = {"phase": m.result | {"rss_base": rss_base, "state_bytes": layout.nbytes, "sync_after_s": sync_s},
           "disk": tree_stats(path)}
    if params.get("steady"):  # the same state again, in the same process: the steady-state save
        again = path.rstrip("/") + "-steady"
        shutil.rmtree(again, ignore_errors=True)
        os.sync()
        with Meter("save_steady") as m2:
            ckptr.save(again, state)
            ckptr.wait_until_finished()
        out["steady"] = m2.result | {"state_bytes": layout.nbytes, "sync_after_s": sync_after()}
        shutil.rmtree(again, ignore_errors=True)
    ckptr.close()
    del state
    jax.clear_caches()
    return out


def orbax_restore(params: dict) -> dict:
    """Child task: StandardCheckpointer restore onto N devices with explicit target shardings."""
    import jax
    import orbax.checkpoint as ocp

    from .jaxstate import abstract_state, check_state

    layout, path, devices = StateLayout.from_json(params["layout"]), params["path"], params["devices"]
    rss_base = rss_bytes()
    target = abstract_state(layout, devices)
    ckptr = ocp.StandardCheckpointer()
    with Meter("restore") as m:
        state = ckptr.restore(path, target)
        jax.block_until_ready(jax.tree.leaves(state))
    checked = check_state(layout, state, devices) if params.get("check", True) else 0
    ckptr.close()
    return {
        "phase": m.result
        | {"rss_base": rss_base, "bytes_restored": layout.nbytes, "bytes_read_per_reader": m.result["ts_bytes_read"] or m.result["io_rchar"], "bytes_checked": checked}
    }


# --------------------------------------------------------------------------- torch DCP


class RankFailed(RuntimeError):
    """One or more DCP ranks raised; ``error_type`` names the first rank's exception class."""

    def __init__(self, message: str, *, error_type: str):
        super().__init__(message)
        self.error_type = error_type


def _dcp_rank(rank: int, world: int, port: int, params: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    layout, path, mode = StateLayout.from_json(params["layout"]), params["path"], params["mode"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    r0, r1 = layout.rows_of(rank, world)
    rss_base = rss_bytes()
    if mode == "save":
        local = {k: torch.from_numpy(rows_data(layout, i, r0, r1)) for i, k in enumerate(layout.keys())}
    else:
        local = {k: torch.empty((r1 - r0, layout.cols), dtype=torch.float32) for k in layout.keys()}
    sd = {k: DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(layout.shape), stride=(layout.cols, 1)) for k, t in local.items()}
    dist.barrier()
    with Meter(mode) as m:
        if mode == "save":
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        else:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        dist.barrier()
    steady = None
    if mode == "save" and params.get("steady"):  # the same state again, in the same processes
        if rank == 0:
            os.sync()
        dist.barrier()
        with Meter("save_steady") as m2:
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(path.rstrip("/") + "-steady", sync_files=True))
            dist.barrier()
        steady = m2.result
    checked = 0
    if mode == "load" and params.get("check", True):
        for i, k in enumerate(layout.keys()):
            check_rows(layout, i, r0, r1, sd[k].to_local().numpy())
            checked += local[k].nbytes
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(m.result | {"rss_base": rss_base, "bytes_checked": checked, "steady": steady}, f)


def dcp_run(params: dict) -> dict:
    """Child task: fork ``world`` gloo ranks that save (``mode=save``) or load (``mode=load``)."""
    import torch  # noqa: F401  -- imported once, before the fork, so ranks start fast
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401

    world, mode, path = params["world"], params["mode"], params["path"]
    layout = StateLayout.from_json(params["layout"])
    if mode == "save":
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path.rstrip("/") + "-steady", ignore_errors=True)
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="ckptfmt-dcp-")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # rank process: never return into the launcher
            code = 0
            try:
                _dcp_rank(rank, world, port, params, os.path.join(tmp, f"{rank}.json"))
            except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
                import traceback

                traceback.print_exc()
                with open(os.path.join(tmp, f"{rank}.err.json"), "w") as f:
                    json.dump({"type": type(e).__name__, "message": str(e)[:500], "assertion": isinstance(e, AssertionError)}, f)
                code = 1
            os._exit(code)
        pids.append(pid)
    failed = [r for r, pid in enumerate(pids) if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    if failed:
        errs = [json.load(open(p)) for r in failed if os.path.exists(p := os.path.join(tmp, f"{r}.err.json"))]
        shutil.rmtree(tmp, ignore_errors=True)
        if any(e["assertion"] for e in errs):
            raise AssertionError(next(e["message"] for e in errs if e["assertion"]))
        first = errs[0] if errs else {"type": "exit", "message": "no error report"}
        raise RankFailed(f"DCP {mode}: ranks {failed} failed: {first['type']}: {first['message']}", error_type=first["type"])
    ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    shutil.rmtree(tmp, ignore_errors=True)
    phase = {
        "wall_s": max(r["wall_s"] for r in ranks),
        "rss_before": sum(r["rss_before"] for r in ranks),
        "rss_peak": sum(r["rss_peak"] for r in ranks),
        "rss_base": sum(r["rss_base"] for r in ranks),
        "rss_peak_exact": all(r["rss_peak_exact"] for r in ranks),
        "io_rchar": sum(r["io_rchar"] for r in ranks),
        "bytes_checked": sum(r["bytes_checked"] for r in ranks),
        "bytes_read_per_reader": max(r["io_rchar"] for r in ranks),
        "ranks": world,
    }
    if mode == "save":
        phase["state_bytes"] = layout.nbytes
        phase["sync_after_s"] = sync_after()
        out = {"phase": phase, "disk": tree_stats(path)}
        if all(r.get("steady") for r in ranks):
            st = [r["steady"] for r in ranks]
            out["steady"] = {"wall_s": max(r["wall_s"] for r in st), "rss_before": sum(r["rss_before"] for r in st),
                             "rss_peak": sum(r["rss_peak"] for r in st), "ranks": world, "state_bytes": layout.nbytes}
            shutil.rmtree(path.rstrip("/") + "-steady", ignore_errors=True)
        return out
    phase["bytes_restored"] = layout.nbytes
    return {"phase": phase}
