"""Scenarios run by each torch rank (see worker.py). Each returns a JSON-able result dict.

Global tensor values are a pure function of (key, shape, dtype), so every rank and every world
size can rebuild the expected global tensor and check its own local block bit for bit.
"""
from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from bridges import torch as bt

# key -> (shape, dtype)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((10, 6), torch.float32),
    "b": ((5, 7), torch.bfloat16),
    "c": ((12,), torch.int64),
    "d": ((6, 9), torch.float32),
    "e": ((7, 5), torch.float32),
    "f": ((4, 4), torch.float64),
    "g": ((3, 3), torch.float32),
    "h": ((9, 4, 3), torch.float16),
    "k": ((4,), torch.bool),
    "s": ((), torch.float32),
}

BIG = (64, 48)
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
# world -> key -> (mesh shape, placements) or None for a plain tensor.
LAYOUTS: dict[int, dict[str, Any]] = {
    8: {"a": ((8,), [S0]),          # 2,2,2,2,2,0,0,0: three empty shards
        "b": ((8,), [S1]),          # 7 columns over 8 ranks
        "c": ((8,), [R]),
        "d": ((2, 4), [S0, S1]),    # columns 3,3,3,0
        "e": ((2, 4), [R, S0]),     # rows 2,2,2,1; replicated over dp
        "f": ((2, 4), [S1, R]),
        "g": None, "s": None,
        "h": ((2, 4), [S2, S0]),    # dim2 2,1; dim0 3,3,3,0
        "k": ((8,), [S0])},
    4: {"a": ((4,), [S1]), "b": ((2, 2), [S0, R]), "c": ((4,), [S0]), "d": ((4,), [R]),
        "e": ((2, 2), [S1, S0]), "f": None, "g": ((4,), [S0]), "s": None,
        "h": ((4,), [S0]), "k": ((2, 2), [R, S0])},
    2: {"a": ((2,), [S0]), "b": ((2,), [S1]), "c": ((2,), [R]), "d": ((2,), [S1]),
        "e": ((2,), [S0]), "f": ((2,), [S0]), "g": None, "s": None, "h": ((2,), [S2]),
        "k": ((2,), [S0])},
}
_MESHES: dict[tuple[int, ...], Any] = {}


def mesh(shape: tuple[int, ...]) -> Any:
    if shape not in _MESHES:
        names = ("dp", "tp")[: len(shape)] if len(shape) <= 2 else None
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def global_value(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def place(t: torch.Tensor, layout: Any) -> torch.Tensor:
    if layout is None:
        return t.clone()
    shape, placements = layout
    return distribute_tensor(t, mesh(shape), placements)


def bits(t: torch.Tensor) -> bytes:
    return np.ascontiguousarray(bt.to_numpy(t)).tobytes()


def same_bits(got: torch.Tensor, want_global: torch.Tensor) -> bool:
    """``got``'s local block equals ``want_global`` at the same box, bit for bit."""
    box, _, _ = bt.local_box(got)
    if box is None:
        return True
    local = got.to_local() if isinstance(got, DTensor) else got
    want = want_global[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))]
    return tuple(local.shape) == tuple(want.shape) and local.dtype == want.dtype and bits(local) == bits(want)


# ------------------------------------------------------------------ a small model + optimizer


def tiny_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Linear(10, 3))


def shard_net(net: torch.nn.Module, world: int) -> None:
    """Parameters become DTensors: Shard(0) on a 1-D mesh (uneven where 10 or 3 rows meet world)."""
    m = mesh((world,))
    for mod in net.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, m, [S0])))


def net_and_optim(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = tiny_net(seed)
    shard_net(net, world)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    return net, opt


def fake_step(net: torch.nn.Module, opt: torch.optim.Optimizer, world: int) -> None:
    for name, p in net.named_parameters():
        g = global_value("grad/" + name, tuple(p.shape), torch.float32)
        p.grad = distribute_tensor(g, mesh((world,)), [S0])
    opt.step()


def train_state(net: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    return get_state_dict(net, opt)


def full_np(sd: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Every tensor of a nested state dict as a full numpy array (collective for DTensors)."""
    out: dict[str, np.ndarray] = {}
    for k, v in sd.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(full_np(v, key))
        elif isinstance(v, torch.Tensor):
            full = v.full_tensor() if isinstance(v, DTensor) else v
            out[key] = bt.to_numpy(full).copy()
    return out


# ------------------------------------------------------------------ scenarios


def save_world(args: dict[str, Any]) -> dict[str, Any]:
    """World 8: save DTensors of every layout, plain tensors, a sharded AdamW state, extras."""
    world, rank = dist.get_world_size(), dist.get_rank()
    state = {"t": {k: place(global_value(k, s, dt), LAYOUTS[world][k]) for k, (s, dt) in TENSORS.items()}}
    net, opt = net_and_optim(seed=1, world=world)
    fake_step(net, opt, world)
    msd, osd = train_state(net, opt)
    state["net"], state["optim"] = msd, osd
    torch.manual_seed(1000 + rank)
    torch.rand(3)
    # BIG (64, 48) columns split 8 ways: loaded transposed as (48, 64) Shard(0) at world 4.
    state["big"] = place(global_value("big", BIG, torch.float32), ((world,), [S1]))
    t0 = time.perf_counter()
    bt.save(args["url"], state, step=7, extra={"epoch": 3}, rank_state={"sampler": {"cursor": 100 + rank}})
    took = time.perf_counter() - t0
    expect = full_np({"net": msd, "optim": osd})
    if rank == 0:
        np.savez(Path(args["workdir"]) / "train_state.npz", **{k.replace("/", "|"): v for k, v in expect.items()})
    drawn = torch.rand(3)
    # Same world: per-rank state (sampler cursor, RNG) comes back to the rank that saved it.
    target = {"t": {k: place(torch.zeros(s, dtype=dt), LAYOUTS[world][k]) for k, (s, dt) in TENSORS.items()}}
    loaded = bt.load(args["url"], target, strict=False)
    bt.set_rng_state(loaded.rng)
    return {"save_s": took, "rng_restored": torch.equal(torch.rand(3), drawn),
            "rank_state": loaded.rank_state, "ok": all(same_bits(loaded["t"][k], global_value(k, s, dt))
                                                       for k, (s, dt) in TENSORS.items()),
            "unexpected": loaded.unexpected_keys}


def load_world(args: dict[str, Any]) -> dict[str, Any]:
    """Any world: load with different placements; check every local block bit for bit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    target = {"t": {k: place(torch.zeros(s, dtype=dt), LAYOUTS[world][k]) for k, (s, dt) in TENSORS.items()}}
    net, opt = net_and_optim(seed=2, world=world)
    msd, osd = train_state(net, opt)  # initializes AdamW state (zeros) so it can be a target
    target["net"], target["optim"] = msd, osd
    target["big"] = place(torch.zeros(BIG), ((world,), [S0]))
    before = full_np({"net": msd})
    # The bridge contract's default: per-rank state saved by another world raises, naming the
    # policies, before anything is read; "drop" (below) is the control.
    from ckptfmt.errors import TopologyChangedError
    try:
        bt.load(args["url"], target)
        without_policy, without_policy_message = "loaded", ""
    except TopologyChangedError as e:
        without_policy, without_policy_message = type(e).__name__, str(e)
    listing = _rank0_listing_fails(args)
    t0 = time.perf_counter()
    loaded = bt.load(args["url"], target, rank_state_policy="drop")
    took = time.perf_counter() - t0
    # the target was not touched
    untouched = all(np.array_equal(before[k], v) for k, v in full_np({"net": msd}).items())
    ok = {k: same_bits(loaded["t"][k], global_value(k, s, dt)) for k, (s, dt) in TENSORS.items()}
    ok["big"] = same_bits(loaded["big"], global_value("big", BIG, torch.float32))
    placements_kept = all(
        (isinstance(loaded["t"][k], DTensor) == isinstance(target["t"][k], DTensor))
        and (not isinstance(target["t"][k], DTensor)
             or (loaded["t"][k].placements == target["t"][k].placements
                 and loaded["t"][k].device_mesh == target["t"][k].device_mesh))
        for k in TENSORS)
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(net, opt, model_state_dict=loaded["net"], optim_state_dict=loaded["optim"])
    got = full_np(dict(zip(("net", "optim"), train_state(net, opt))))
    want = dict(np.load(Path(args["workdir"]) / "train_state.npz"))
    train_ok = sorted(k.replace("/", "|") for k in got) == sorted(want) and all(
        got[k].tobytes() == want[k.replace("/", "|")].tobytes() for k in got)
    local_bytes = sum(_local_nbytes(v) for v in _leaves(target))
    # A transposed load onto Shard(0) reads only this rank's columns of the stored (64, 48).
    from bridges.mapping import Mapping, Rule
    tmap = Mapping((Rule("big", "bigT", {2: (1, 0)}),))
    tgt = place(torch.zeros(BIG[::-1]), ((world,), [S0]))
    lt = bt.load(args["url"], {"bigT": tgt}, mapping=tmap, strict=False, rank_state_policy="drop")
    transposed = {"ok": same_bits(lt["bigT"], global_value("big", BIG, torch.float32).T.contiguous()),
                  "bytes_read": lt.bytes_read, "local_bytes": _local_nbytes(tgt),
                  "total_bytes": BIG[0] * BIG[1] * 4}
    return {"transposed": transposed, "ok": ok, "placements_kept": placements_kept, "untouched": untouched, "train_ok": train_ok,
            "load_s": took, "bytes_read": loaded.bytes_read, "local_bytes": local_bytes,
            "extra": loaded.extra, "rank_state": loaded.rank_state, "has_rng": loaded.rng is not None,
            "lr": opt.param_groups[0]["lr"], "step": loaded.step, "without_policy": without_policy,
            "without_policy_message": without_policy_message, "listing": listing}


def plain_save(args: dict[str, Any]) -> dict[str, Any]:
    """The torch user's plain save (issue 26): {"w": Shard(0), "b": Replicate}, no rank_state
    (step 1); step 2 the same with a rank_state (the control: the caller asked for per-rank state)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    m = mesh((world,))
    state = {"w": distribute_tensor(global_value("w", (8, 3), torch.float32), m, [S0]),
             "b": distribute_tensor(global_value("b", (3,), torch.float32), m, [R])}
    torch.manual_seed(50 + rank)
    bt.save(args["url"], state, step=1)
    drawn = torch.rand(2)
    bt.save(args["url"], state, step=2, rank_state={"cursor": 10 + rank})
    same = bt.load(args["url"], state, step=1)  # same world: the RNG states the bridge saved come back
    bt.set_rng_state(same.rng)
    return {"rng_restored": torch.equal(torch.rand(2), drawn)}


def plain_load(args: dict[str, Any]) -> dict[str, Any]:
    """Another world size, no policy: step 1 (no per-rank state asked for) loads; step 2 raises."""
    from ckptfmt.errors import TopologyChangedError
    world = dist.get_world_size()
    m = mesh((world,))
    target = {"w": distribute_tensor(torch.zeros(8, 3), m, [S0]), "b": distribute_tensor(torch.zeros(3), m, [R])}
    got = bt.load(args["url"], target, step=1)
    out: dict[str, Any] = {"ok": same_bits(got["w"], global_value("w", (8, 3), torch.float32))
                           and same_bits(got["b"], global_value("b", (3,), torch.float32)),
                           "rng": got.rng is not None, "rank_state": got.rank_state,
                           "load_rank_state": bt.load_rank_state(args["url"], step=1),
                           "asked_rng": bt.load(args["url"], target, step=1, rank_state_policy="rank0").rng is not None}
    try:
        bt.load(args["url"], target, step=2)
        out["step2"] = "loaded"
    except TopologyChangedError as e:
        out["step2"] = type(e).__name__
    out["step2_drop"] = bt.load(args["url"], target, step=2, rank_state_policy="drop").rank_state
    return out


def _rank0_listing_fails(args: dict[str, Any]) -> dict[str, Any]:
    """load(step=None) where rank 0's listing of the repository fails (its path is a regular file,
    so listing manifests/ is a StorageError): every rank raises that error class at once, no rank
    waits for the coordinator's timeout (300 s). The other ranks list nothing: rank 0 decides."""
    from ckptfmt.errors import CheckpointError

    rank = dist.get_rank()
    bad = Path(args["workdir"]) / "not-a-repository"
    if rank == 0:
        bad.write_text("a regular file where rank 0 looks for the repository")
    dist.barrier()
    url = str(bad) if rank == 0 else args["url"]
    t0 = time.perf_counter()
    try:
        bt.load(url, {"x": torch.zeros(1)}, rank_state_policy="drop")
        return {"error": None}
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)[:300], "seconds": time.perf_counter() - t0}


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _local_nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


from torchproc.accept import accept_load  # noqa: E402,F401  (JAX -> torch acceptance, 4 ranks)
from torchproc.hf_side import hf_tp  # noqa: E402,F401  (JAX -> Hugging Face with tensor parallelism, 4 ranks)


# ------------------------------------------------------------------ DCP plug-in

DCP_LOAD_LAYOUT = {"a": ((2, 2), [S0, S1]), "b": ((4,), [S0]), "c": None, "d": ((2, 2), [S1, R]),
                   "e": ((4,), [R]), "f": ((4,), [S1]), "g": ((4,), [S1]), "s": None,
                   "h": ((2, 2), [S0, S2]), "k": ((4,), [S0])}


def dcp_world(args: dict[str, Any]) -> dict[str, Any]:
    """World 4: save with bridges.torch, load through dcp.load + CkptfmtStorageReader with other
    placements (DCP's planner reshards), then a corrupted copy must fail the DCP load."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from bridges.dcp import CkptfmtStorageReader

    coord = coordinator_checks()
    world, rank = dist.get_world_size(), dist.get_rank()
    url = args["url"]
    state = {"t": {k: place(global_value(k, s, dt), LAYOUTS[4][k]) for k, (s, dt) in TENSORS.items()}}
    bt.save(url, state, step=1, save_rng=False)
    target = {"t": {k: place(torch.zeros(s, dtype=dt), DCP_LOAD_LAYOUT[k]) for k, (s, dt) in TENSORS.items()}}
    reader = CkptfmtStorageReader(url)
    dcp.load(target, storage_reader=reader)
    ok = {k: same_bits(target["t"][k], global_value(k, s, dt)) for k, (s, dt) in TENSORS.items()}

    bad_url = args["url"] + "-corrupt"
    if rank == 0:
        shutil.copytree(url, bad_url)
        import ckptfmt
        man = ckptfmt.Repository(bad_url).manifest(1)
        e = man.tensors["t/d"]
        obj = Path(bad_url) / e.object_key(0)
        raw = bytearray(obj.read_bytes())
        raw[e.shard_start(0)] ^= 0x01  # its first byte, in its pack or its own object
        obj.write_bytes(bytes(raw))
    dist.barrier()
    fresh = {"t": {"d": place(torch.zeros(TENSORS["d"][0]), DCP_LOAD_LAYOUT["d"])}}
    try:
        dcp.load(fresh, storage_reader=CkptfmtStorageReader(bad_url))
        corrupt = "no error"
    except BaseException as exc:  # DCP wraps rank errors in CheckpointException(BaseException)
        # DCP keeps each rank's original exception in .failures; name those, not a traceback excerpt
        inner = sorted({type(f[0] if isinstance(f, tuple) else getattr(f, "exception", f)).__name__
                        for f in getattr(exc, "failures", {}).values()})
        corrupt = type(exc).__name__ + f" (rank errors: {', '.join(inner)}): " + str(exc)[:2000]
    return {"ok": ok, "bytes_read": reader.bytes_read, "corrupt": corrupt, "coord": coord}


def coordinator_checks() -> dict[str, Any]:
    """TorchCoordinator over the c10d store: collectives, a name mismatch, a missing rank."""
    from bridges.torch._coord import TorchCoordinator
    from ckptfmt.errors import CheckpointError, CoordinatorLostError, CoordinatorTimeoutError

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    c = TorchCoordinator()
    for i in range(4):  # exercises the deletion of keys two operations back
        got = c.allgather(f"g{i}", bytes([rank, i]))
        assert got == [bytes([r, i]) for r in range(world)], got
    out["broadcast"] = c.broadcast("b", b"from-2" if rank == 2 else None, root=2).decode()
    c.barrier("end")
    m = TorchCoordinator()
    try:
        m.allgather(f"name{rank % 2}", b"x", timeout_s=20)
        out["mismatch"] = "no error"
    except CheckpointError as e:
        out["mismatch"] = type(e).__name__
    try:
        m.barrier("after")
        out["after_error"] = "usable"
    except CoordinatorLostError:
        out["after_error"] = "unusable"
    t = TorchCoordinator()
    if rank != world - 1:
        try:
            t.allgather("late", b"x", timeout_s=2)
            out["timeout"] = "no error"
        except CoordinatorTimeoutError as e:
            out["timeout"] = str(e.found)
    dist.barrier()
    return out


# ------------------------------------------------------------------ figures (bench_load.py)

def _bench_state(world: int, n: int, rows: int, cols: int, zeros: bool = False) -> dict[str, Any]:
    m = mesh((world,))
    out = {}
    for i in range(n):
        full = torch.zeros(rows, cols) if zeros else global_value(f"bench{i}", (rows, cols), torch.float32)
        out[f"w{i:02d}"] = distribute_tensor(full, m, [S0])
    return {"model": out}


def bench_save(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state = _bench_state(dist.get_world_size(), args["n"], args["rows"], args["cols"])
    dist.barrier()
    t0 = time.perf_counter()
    bt.save(args["ours"], state, step=1, save_rng=False)
    t1 = time.perf_counter()
    dcp.save(state, checkpoint_id=args["dcp"])
    dist.barrier()
    return {"ours_save_s": t1 - t0, "dcp_save_s": time.perf_counter() - t1}


def bench_load(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from bridges.dcp import CkptfmtStorageReader

    world = dist.get_world_size()
    runs: dict[str, list[float]] = {"ours": [], "dcp_own_format": [], "dcp_with_ckptfmt_reader": []}
    res: dict[str, Any] = {}
    for _ in range(args["repeats"]):
        for name in runs:
            target = _bench_state(world, args["n"], args["rows"], args["cols"], zeros=True)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                loaded = bt.load(args["ours"], target, rank_state_policy="drop")
                res["bytes_read"] = loaded.bytes_read
            elif name == "dcp_own_format":
                dcp.load(target, checkpoint_id=args["dcp"])
            else:
                reader = CkptfmtStorageReader(args["ours"])
                dcp.load(target, storage_reader=reader)
                res["bytes_read_via_dcp"] = reader.bytes_read
            dist.barrier()
            runs[name].append(time.perf_counter() - t0)
    res["local_bytes"] = sum(_local_nbytes(v) for v in target["model"].values())
    res["median_s"] = {k: float(np.median(v)) for k, v in runs.items()}
    res["runs_s"] = runs
    return res


# ------------------------------------------------------------------ DCP writer (issue 26)


class _Loader:
    """A data loader's position as a DCP ``Stateful``."""

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "epoch": 2, "seen": [1, 2, 3]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cursor = int(sd["cursor"])


def _dcp_train_state(world: int, seed: int, steps: int) -> tuple[Any, Any, Any]:
    net, opt = net_and_optim(seed=seed, world=world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        fake_step(net, opt, world)
        sched.step()
    return net, opt, sched


def dcp_writer_save(args: dict[str, Any]) -> dict[str, Any]:
    """Save model, AdamW, an LR scheduler and a Stateful loader through dcp.save (step 1) and
    dcp.async_save (step 2) with CkptfmtStorageWriter; an unencodable value must commit nothing."""
    import torch.distributed.checkpoint as dcp

    from bridges.dcp import CkptfmtStorageWriter
    world, rank = dist.get_world_size(), dist.get_rank()
    net, opt, sched = _dcp_train_state(world, seed=1, steps=2)
    msd, osd = train_state(net, opt)
    state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "loader": _Loader(37)}
    dcp.save(state, storage_writer=CkptfmtStorageWriter(args["url"], step=1))
    fake_step(net, opt, world)
    sched.step()
    msd, osd = train_state(net, opt)
    state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "loader": _Loader(38)}
    dcp.async_save(state, storage_writer=CkptfmtStorageWriter(args["url"], step=2)).result()
    expect = full_np({"model": msd, "optim": osd})
    if rank == 0:
        np.savez(Path(args["workdir"]) / "dcp_state.npz", **{k.replace("/", "|"): v for k, v in expect.items()})
    try:
        dcp.save({"model": msd, "bad": {"fn": object()}}, storage_writer=CkptfmtStorageWriter(args["url"], step=3))
        bad = "saved"
    except BaseException as exc:  # DCP wraps rank errors in CheckpointException(BaseException)
        inner = [f[0] if isinstance(f, tuple) else getattr(f, "exception", f)
                 for f in getattr(exc, "failures", {}).values()]
        bad = type(exc).__name__ + ": " + " | ".join(f"{type(e).__name__}: {e}" for e in inner)[:1500]
    import ckptfmt
    return {"steps": ckptfmt.Repository(args["url"]).steps(), "bad": bad,
            "lr": opt.param_groups[0]["lr"], "sched": sched.state_dict()}


def dcp_writer_load(args: dict[str, Any]) -> dict[str, Any]:
    """Another world size: dcp.load with CkptfmtStorageReader restores tensors, param groups, the
    scheduler and the Stateful loader of step 2; bridges.torch.load reads the same step."""
    import torch.distributed.checkpoint as dcp

    from bridges.dcp import CkptfmtStorageReader
    world = dist.get_world_size()
    net, opt, sched = _dcp_train_state(world, seed=2, steps=1)  # other values, same structure
    msd, osd = train_state(net, opt)
    loader = _Loader(0)
    state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "loader": loader}
    dcp.load(state, storage_reader=CkptfmtStorageReader(args["url"], step=2))
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    got = full_np(dict(zip(("model", "optim"), train_state(net, opt))))
    want = dict(np.load(Path(args["workdir"]) / "dcp_state.npz"))
    tensors_ok = sorted(k.replace("/", "|") for k in got) == sorted(want) and all(
        got[k].tobytes() == want[k.replace("/", "|")].tobytes() for k in got)
    msd2, osd2 = train_state(*_dcp_train_state(world, seed=3, steps=1)[:2])
    loaded = bt.load(args["url"], {"model": msd2, "optim": osd2}, step=2, strict=False)
    return {"tensors_ok": tensors_ok, "lr": opt.param_groups[0]["lr"],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "sched": sched.state_dict(), "cursor": loader.cursor,
            "bt_lr": loaded["optim"]["param_groups"][0]["lr"]}


# ------------------------------------------------------------------ FSDP2 + TP (issue 26)


def _fsdp_tp_net(dp: int, tp: int, seed: int) -> tuple[torch.nn.Module, Any]:
    """A 2-layer MLP, tensor-parallel (colwise, rowwise) on "tp" and FSDP2 on "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 10))
    m = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(net, m["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=m["dp"])
    return net, m


def fsdp_tp_save(args: dict[str, Any]) -> dict[str, Any]:
    """(2, 2) mesh: save the FSDP2 + TP state dict (model and AdamW moments) with bridges.torch."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    net, _ = _fsdp_tp_net(2, 2, seed=5)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(net, opt)
    placements = sorted({str(v.placements) for v in msd.values() if isinstance(v, DTensor)})
    full = {f"model/{k}": v.full_tensor().numpy().copy() for k, v in msd.items()}
    full.update({f"optim/state/{k}/{n}": t.full_tensor().numpy().copy()
                 for k, st in osd["state"].items() for n, t in st.items() if isinstance(t, DTensor)})
    bt.save(args["url"], {"model": msd, "optim": osd}, step=1)
    # Step 2: the same with a caller's rank_state (the control of a restore at another world size).
    bt.save(args["url"], {"model": msd}, step=2, rank_state={"cursor": dist.get_rank()})
    if dist.get_rank() == 0:
        np.savez(Path(args["workdir"]) / "fsdp_tp.npz", **{k.replace("/", "|"): v for k, v in full.items()})
    return {"placements": placements}


def fsdp_tp_load(args: dict[str, Any]) -> dict[str, Any]:
    """Load the (2, 2) FSDP2 + TP save onto args["layout"]: "fsdp_tp" (the same kind of net on
    (dp, tp) = args["mesh"]), "shard0" (every tensor Shard(0) on a 1-D mesh) or "plain"."""
    want = {k.replace("|", "/"): v for k, v in np.load(args["expect"]).items()}
    world = dist.get_world_size()
    if args["layout"] == "fsdp_tp":
        from torch.distributed.checkpoint.state_dict import get_state_dict
        net, _ = _fsdp_tp_net(*args["mesh"], seed=9)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net(torch.randn(4, 6)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(net, opt)
        target = {"model": msd, "optim": {"state": osd["state"]}}
    else:
        m = mesh((world,))
        def mk(a: np.ndarray) -> torch.Tensor:
            z = torch.zeros(a.shape, dtype=torch.float32)
            return distribute_tensor(z, m, [S0]) if args["layout"] == "shard0" else z
        target: dict[str, Any] = {"model": {}, "optim": {"state": {}}}
        for k, a in want.items():
            parts = k.split("/")
            if parts[0] == "model":
                target["model"][parts[1]] = mk(a)
            else:
                target["optim"]["state"].setdefault(parts[2], {})[parts[3]] = mk(a)
    got = bt.load(args["url"], target, step=1, strict=False)
    flat: dict[str, Any] = {f"model/{k}": v for k, v in got["model"].items()}
    flat.update({f"optim/state/{k}/{n}": t for k, st in got["optim"]["state"].items() for n, t in st.items()})
    ok = {}
    for k, a in want.items():
        t = flat[k]
        full = t.full_tensor() if isinstance(t, DTensor) else t
        ok[k] = full.numpy().tobytes() == a.tobytes()
    return {"ok": ok, "bytes_read": got.bytes_read,
            "placements": sorted({str(v.placements) for v in flat.values() if isinstance(v, DTensor)})}
