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
from .layout import check_rows, rows_data
from .states import Recipe, check_box, mesh_shape, rank_box, state_from_json

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

    from .jaxstate import state_arrays

    layout, path = state_from_json(params["layout"]), params["path"]
    shutil.rmtree(path, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    rss_base = rss_bytes()
    state = state_arrays(layout, params["devices"])
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

    from .jaxstate import state_check, state_target

    layout, path, devices = state_from_json(params["layout"]), params["path"], params["devices"]
    rss_base = rss_bytes()
    target = state_target(layout, devices)
    ckptr = ocp.StandardCheckpointer()
    with Meter("restore") as m:
        state = ckptr.restore(path, target)
        jax.block_until_ready(jax.tree.leaves(state))
    checked = state_check(layout, state, devices) if params.get("check", True) else 0
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
    layout, path, mode = state_from_json(params["layout"]), params["path"], params["mode"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rss_base = rss_bytes()
    if isinstance(layout, Recipe):
        sd = _dcp_recipe_state(layout, rank, world, mode == "save")
    else:
        mesh = init_device_mesh("cpu", (world,))
        r0, r1 = layout.rows_of(rank, world)
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
    if mode == "load" and params.get("check", True) and isinstance(layout, Recipe):
        checked = _dcp_recipe_check(layout, sd, rank, world)
    elif mode == "load" and params.get("check", True):
        for i, k in enumerate(layout.keys()):
            check_rows(layout, i, r0, r1, sd[k].to_local().numpy())
            checked += local[k].nbytes
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(m.result | {"rss_base": rss_base, "bytes_checked": checked, "steady": steady}, f)


_TORCH_BITS = {"bfloat16": ("int16", "bfloat16"), "float32": ("float32", "float32"), "int32": ("int32", "int32")}


def _dcp_recipe_state(recipe: Recipe, rank: int, world: int, fill: bool) -> dict:
    """This rank's state dict of a recipe: a DTensor per leaf on the (data, model) mesh, with the
    JAX partition's placements (a dimension split over mesh axis k is ``Shard(dim)`` at k), the
    generator's values (``fill``) or empty tensors to load into; the scalar count a plain tensor."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", mesh_shape(world), mesh_dim_names=("data", "model"))
    sd = {}
    for i, leaf in enumerate(recipe.leaves):
        offset, shape, _first = rank_box(leaf, world, rank)
        view_as, dtype = _TORCH_BITS[leaf.dtype]
        if fill:
            from .states import box_bits

            local = torch.from_numpy(box_bits(i, leaf, offset, shape).view(np.dtype(view_as))).view(getattr(torch, dtype))
        else:
            local = torch.empty(shape, dtype=getattr(torch, dtype))
        if not leaf.shape:
            sd[leaf.key] = local
            continue
        placements = [Replicate(), Replicate()]
        for dim, axis in enumerate(leaf.spec):
            if axis:
                placements[("data", "model").index(axis)] = Shard(dim)
        stride = tuple(int(np.prod(leaf.shape[d + 1:])) for d in range(len(leaf.shape)))
        sd[leaf.key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(leaf.shape), stride=stride)
    return sd


def _dcp_recipe_check(recipe: Recipe, sd: dict, rank: int, world: int) -> int:
    """Check this rank's loaded boxes bit for bit; return the bytes of the boxes it is the first
    replica of (summed over ranks: the state's bytes)."""
    import numpy as np
    import torch

    checked = 0
    for i, leaf in enumerate(recipe.leaves):
        offset, shape, first = rank_box(leaf, world, rank)
        t = sd[leaf.key]
        local = t.to_local() if hasattr(t, "to_local") else t
        if tuple(local.shape) != shape:
            raise AssertionError(f"{leaf.key}: rank {rank} holds {tuple(local.shape)}, wanted {shape}")
        view_as = _TORCH_BITS[leaf.dtype][0]
        got = local.contiguous().view(getattr(torch, view_as)).numpy().view({"int16": np.uint16}.get(view_as, np.uint32))
        n = check_box(i, leaf, offset, got)
        checked += n if first else 0
    return checked


def dcp_run(params: dict) -> dict:
    """Child task: fork ``world`` gloo ranks that save (``mode=save``) or load (``mode=load``)."""
    import torch  # noqa: F401  -- imported once, before the fork, so ranks start fast
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401

    world, mode, path = params["world"], params["mode"], params["path"]
    layout = state_from_json(params["layout"])
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
