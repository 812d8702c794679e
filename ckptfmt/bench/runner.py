"""``run_bench``: every system saves and restores the same state, each run in a fresh process.

Order within one repetition: raw limit, ckptfmt, then each peer; for each,
one save and then one restore per target topology, with the page cache
dropped before each read where the OS allows it. Systems are interleaved per
repetition so that slow drift of a shared disk hits all of them alike.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .child import ChildFailed, drop_page_cache, run_child
from .jaxstate import xla_env
from .layout import StateLayout
from .ours import local_path
from .peers import PEERS, peer_available
from .safety import corrupt

SYSTEMS = ("raw", "ckptfmt") + PEERS


@dataclass(frozen=True)
class BenchOptions:
    """What ``ckptfmt bench`` runs. Sizes in bytes; topologies in devices or ranks."""

    size: int = 1 << 30
    tensors: int = 16
    save_devices: int = 8
    restore_devices: tuple[int, ...] = (8, 4)
    repetitions: int = 3
    storage: str | None = None  # repository URL or path for ckptfmt; default: <output_dir>/data
    output_dir: str = "bench-out"
    peers: tuple[str, ...] = PEERS
    raw: bool = True
    ckptfmt_api: str = "auto"  # "bridge" (bridges.jax), "core-jax", "core-numpy" (no JAX); auto: the first available
    check: bool = True  # compare every restored block with the generator (outside the timed window)
    drop_cache: bool = True
    safety: bool = True  # after the timed runs: flip 64 bytes of tensor data per system, restore, see who notices
    metadata: bool = True
    metadata_entries: tuple[int, ...] = (1_000, 10_000, 100_000, 640_000)
    dcp_metadata_max_entries: int = 100_000
    tailstep: bool = True
    tailstep_steps: int = 200
    tailstep_every: int = 20
    plot: bool = True
    keep_data: bool = False
    child_timeout_s: float = 1800.0


@dataclass
class BenchResult:
    """Everything one bench run measured; ``to_json()`` is what the JSON file holds."""

    options: dict[str, Any]
    layout: dict[str, Any]
    cache: str
    runs: dict[str, dict[str, list[dict]]]
    summary: dict[str, dict[str, dict]]
    ratios: dict[str, Any]
    targets: list[dict[str, Any]]
    notes: list[str]
    skipped: dict[str, str]
    errors: dict[str, str]
    metadata: dict[str, Any] | None = None
    tailstep: dict[str, Any] | None = None
    safety: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    table: str = ""
    json_path: str | None = None
    plot_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def _environment() -> dict[str, Any]:
    import platform

    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import psutil

        env["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    return env


def _tasks(system: str, common: dict, urls: dict, paths: dict, options: BenchOptions):
    """(params, save (task, params, env), restore(m) -> (task, params, env)) of one system."""
    n = options.save_devices
    if system == "ckptfmt":
        p = common | {"url": urls["ckptfmt"], "api": options.ckptfmt_api}
        return p, ("ckptfmt.bench.ours:save", p | {"devices": n}, xla_env(n)), lambda m: (
            "ckptfmt.bench.ours:restore", p | {"devices": m}, xla_env(m))
    if system == "orbax":
        p = common | {"path": paths["orbax"]}
        return p, ("ckptfmt.bench.peers:orbax_save", p | {"devices": n}, xla_env(n)), lambda m: (
            "ckptfmt.bench.peers:orbax_restore", p | {"devices": m}, xla_env(m))
    p = common | {"path": paths["dcp"]}
    return p, ("ckptfmt.bench.peers:dcp_run", p | {"world": n, "mode": "save"}, None), lambda m: (
        "ckptfmt.bench.peers:dcp_run", p | {"world": m, "mode": "load"}, None)


def run_bench(options: BenchOptions = BenchOptions(), *, log: Callable[[str], None] | None = _say) -> BenchResult:
    """Run the whole benchmark and write ``bench.json`` (and ``bench.png``) into ``options.output_dir``.

    A peer that is not installed is skipped and named in ``skipped``. A run that
    fails is recorded in ``errors`` and the rest of the bench goes on; the
    result is still written.
    """
    from . import report

    log = log or (lambda _m: None)
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    topologies = (options.save_devices,) + tuple(options.restore_devices)
    layout = StateLayout.for_size(options.size, options.tensors, topologies)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}

    storage = options.storage or str((out / "data").resolve())
    local_root = local_path(storage)
    if storage.startswith("memory://"):
        raise ValueError("memory:// cannot be benchmarked: each run is a fresh process with its own memory store")
    if local_root is None:
        local_root = tempfile.mkdtemp(prefix="ckptfmt-bench-local-")
        notes.append(f"raw limit and peers ran in {local_root} (local disk): they cannot write to {storage}")
    urls = {"ckptfmt": _join(storage, "ckptfmt")}
    paths = {s: os.path.join(local_root, s) for s in ("raw",) + PEERS}

    systems = []
    if options.raw:
        systems.append("raw")
    systems.append("ckptfmt")
    for p in options.peers:
        if p not in PEERS:
            raise ValueError(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
        why = peer_available(p)
        if why:
            skipped[p] = why
            log(f"skipping {p}: {why}")
        else:
            systems.append(p)

    cache = "cold"
    if options.drop_cache and not drop_page_cache():
        cache = "warm"
        notes.append("page cache could not be dropped (needs root on Linux): every read is warm")
    elif not options.drop_cache:
        cache = "warm"
    runs: dict[str, dict[str, list[dict]]] = {s: {} for s in systems}
    common = {"layout": layout.to_json(), "check": options.check}
    tmo = options.child_timeout_s
    log(f"state: {layout.tensors} x {layout.rows}x{layout.cols} float32 = {layout.nbytes / 2**20:.0f} MiB; systems: {', '.join(systems)}")

    def record(system: str, phase: str, fn: Callable[[], dict]) -> bool:
        if system in errors:
            return False
        try:
            r = fn()
        except ChildFailed as e:
            errors[system] = f"{phase}: {e}"
            log(f"{system} {phase} FAILED: {str(e).splitlines()[0]}")
            return False
        ph = r["phase"] | {k: v for k, v in r.get("disk", {}).items()}
        ph["process_wall_s"] = r.get("process_wall_s")
        runs[system].setdefault(phase, []).append(ph)
        log(f"{system:8s} {phase:12s} {ph['wall_s']:8.3f} s  peak RSS {ph['rss_peak'] / 2**20:8.0f} MiB")
        return True

    def before_read() -> None:
        if cache == "cold":
            drop_page_cache()

    for rep in range(options.repetitions):
        log(f"repetition {rep + 1}/{options.repetitions}")
        for system in systems:
            n = options.save_devices
            if system == "raw":
                os.sync()
                if record("raw", "save", lambda: run_child("ckptfmt.bench.raw:write", common | {"writers": n, "path": paths["raw"]}, timeout_s=tmo)):
                    before_read()
                    record("raw", "restore", lambda: run_child("ckptfmt.bench.raw:read", {"path": paths["raw"], "readers": n}, timeout_s=tmo))
                continue
            p, (save_task, save_params, save_env), restore_spec = _tasks(system, common, urls, paths, options)
            save = lambda: run_child(save_task, save_params, env=save_env, timeout_s=tmo)  # noqa: E731
            restore = lambda m: run_child(*restore_spec(m)[:2], env=restore_spec(m)[2], timeout_s=tmo)  # noqa: E731
            os.sync()  # earlier runs' dirty pages must not be flushed on this save's clock
            if not record(system, "save", save):
                continue
            for m in options.restore_devices:
                before_read()
                record(system, f"restore_{n}to{m}", lambda m=m: restore(m))
            if system == "ckptfmt":
                before_read()
                record(system, f"slice_1of{n}", lambda: run_child("ckptfmt.bench.ours:read_slice", p | {"parts": n}, timeout_s=tmo))

    safety: dict[str, Any] = {}
    if options.safety:
        n = options.save_devices
        m = next((d for d in options.restore_devices if d != n), n)
        for system in [s_ for s_ in systems if s_ != "raw" and s_ not in errors]:
            where = local_path(urls["ckptfmt"]) if system == "ckptfmt" else paths[system]
            if where is None:
                continue
            try:
                flip = corrupt(where, system)
            except Exception as e:  # a probe that cannot run must not sink the results
                safety[system] = {"outcome": "not run", "detail": f"{type(e).__name__}: {e}"[:300]}
                continue
            before_read()
            task, params, env = _tasks(system, common, urls, paths, options)[2](m)
            try:
                safety[system] = flip | run_child("ckptfmt.bench.safety:probe", {"task": task, "inner": params}, env=env, timeout_s=tmo)
            except ChildFailed as e:
                safety[system] = flip | {"outcome": "probe failed", "detail": str(e).splitlines()[0]}
            log(f"{system:8s} 64-byte flip in {flip['object']}: {safety[system]['outcome']} {safety[system].get('error_type', '')}")

    metadata = tailstep = None
    if options.metadata:
        log("metadata at scale")
        try:
            metadata = run_child(
                "ckptfmt.bench.metadata_scale:run",
                {"entries": list(options.metadata_entries), "dcp_max_entries": options.dcp_metadata_max_entries, "peers": "dcp" in systems},
                timeout_s=tmo,
            )
        except ChildFailed as e:
            errors["metadata"] = str(e)
            log(f"metadata FAILED: {str(e).splitlines()[0]}")
    if options.tailstep and importlib.util.find_spec("jax") is None:
        notes.append("tail-step slowdown skipped: jax is not installed")
    elif options.tailstep:
        log("tail-step slowdown")
        try:
            tailstep = run_child(
                "ckptfmt.bench.tailstep:run",
                {"steps": options.tailstep_steps, "every": options.tailstep_every, "url": _join(storage, "tailstep")},
                env=xla_env(1),
                timeout_s=tmo,
            )
        except ChildFailed as e:
            errors["tailstep"] = str(e)
            log(f"tailstep FAILED: {str(e).splitlines()[0]}")

    if not options.keep_data:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)
        from .ours import _clear

        for url in (urls["ckptfmt"], _join(storage, "tailstep")):
            try:
                _clear(url)
            except Exception as e:  # cleanup must not hide the results
                notes.append(f"could not remove {url}: {e}")

    result = BenchResult(
        options=asdict(options),
        layout=layout.to_json(),
        cache=cache,
        runs=runs,
        summary={},
        ratios={},
        targets=[],
        notes=notes,
        skipped=skipped,
        errors=errors,
        metadata=metadata,
        tailstep=tailstep,
        safety=safety,
        environment=_environment(),
    )
    report.finish(result, out, make_plot=options.plot)
    log(f"wrote {result.json_path}" + (f" and {result.plot_path}" if result.plot_path else ""))
    return result
