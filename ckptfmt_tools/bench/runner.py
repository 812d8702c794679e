"""``run_bench``: every system saves and restores the same state, each run in a fresh process.

Within one repetition every system (raw limit, ckptfmt, each peer) runs one
save and then one restore per target topology, with the page cache dropped
before each read where the OS allows it. Systems are interleaved per
repetition, and the order rotates from one repetition to the next, so that
slow drift of a shared disk, and whatever one system leaves the disk doing
for the next, hit all of them alike.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .child import ChildFailed, drop_page_cache, run_child
from .jaxstate import xla_env
from .layout import StateLayout
from .ours import clear_repository, local_path
from . import rotate
from .peers import PEERS, peer_available
from .safety import corrupt
from .states import STATES, Recipe, recipe

SYSTEMS = ("raw", "ckptfmt") + PEERS
TWO_PROCESS = "ckptfmt_2proc"  # ckptfmt saving from 2 processes (--two-process)


@dataclass(frozen=True)
class BenchOptions:
    """What ``ckptfmt bench`` runs. Sizes in bytes; topologies in devices or ranks."""

    size: int = 1 << 30
    tensors: int = 16
    state: str = "tensors16"  # or a recipe of ckptfmt_tools/bench/states.py: "llama" (size, layers), "moe" (leaves)
    layers: int = 32  # the llama recipe's layers
    leaves: int = 20_000  # the moe recipe's leaf count (about)
    save_devices: int = 8
    restore_devices: tuple[int, ...] = (8, 4)
    repetitions: int = 5
    storage: str | None = None  # repository URL or path for ckptfmt; default: <output_dir>/data
    output_dir: str = "bench-out"
    peers: tuple[str, ...] = PEERS
    raw: bool = True
    steady: bool = True  # each save child saves a second time in the same process (the steady-state save)
    two_process: bool = False  # also save ckptfmt from 2 processes x save_devices/2 devices (jax.distributed)
    sizes: tuple[int, ...] = ()  # scaling: ckptfmt's save and restore once at each of these state sizes
    raw_threads: int = 32  # thread pool of the raw limit (as wide as ckptfmt's reader)
    ckptfmt_api: str = "auto"  # "bridge" (bridges.jax), "core-jax", "core-numpy" (no JAX); auto: the first available
    check: bool = True  # compare every restored block with the generator (outside the timed window)
    drop_cache: bool = True
    safety: bool = True  # after the timed runs: flip 64 bytes of tensor data per system, restore, see who notices
    metadata: bool = True
    metadata_entries: tuple[int, ...] = (1_000, 10_000, 100_000, 640_000)
    dcp_metadata_max_entries: int = 100_000
    tailstep: bool = True
    tailstep_steps: int = 200
    tailstep_every: int | None = None  # the 16-tensor state: 10; a recipe: from the measured save time
    tailstep_saves: int = 10  # a recipe's cadence: saves per system
    plot: bool = True
    keep_data: bool = False
    rotate: bool = False  # the rotated harness (ckptfmt_tools/bench/rotate.py) instead of the interleaved repetitions
    save_cache: str = "drop"  # --rotate: before each save the page cache is "sync"ed or synced and "drop"ped
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
    cadence: list[dict[str, Any]] | None = None  # a recipe's cadence, every system (tailstep_state.py)
    safety: dict[str, Any] = field(default_factory=dict)
    scaling: list[dict[str, Any]] | None = None
    rotated: dict[str, Any] | None = None
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


def _tasks(system: str, common: dict, urls: dict, paths: dict, options: BenchOptions) -> tuple[dict, tuple, Callable]:
    """(params, save (task, params, env), restore(m) -> (task, params, env)) of one system."""
    n = options.save_devices
    if system == "ckptfmt":
        p = common | {"url": urls["ckptfmt"], "api": options.ckptfmt_api}
        return p, ("ckptfmt_tools.bench.ours:save", p | {"devices": n}, xla_env(n)), lambda m: (
            "ckptfmt_tools.bench.ours:restore", p | {"devices": m}, xla_env(m))
    if system == "orbax":
        p = common | {"path": paths["orbax"]}
        return p, ("ckptfmt_tools.bench.peers:orbax_save", p | {"devices": n}, xla_env(n)), lambda m: (
            "ckptfmt_tools.bench.peers:orbax_restore", p | {"devices": m}, xla_env(m))
    p = common | {"path": paths["dcp"]}
    return p, ("ckptfmt_tools.bench.peers:dcp_run", p | {"world": n, "mode": "save"}, None), lambda m: (
        "ckptfmt_tools.bench.peers:dcp_run", p | {"world": m, "mode": "load"}, None)


class _Session:
    """The state of one bench run: where things go, what ran, what failed."""

    def __init__(self, options: BenchOptions, log: Callable[[str], None]):
        self.o, self.log = options, log
        topologies = (options.save_devices,) + tuple(options.restore_devices)
        if options.state == "tensors16":
            self.layout: StateLayout | Recipe = StateLayout.for_size(options.size, options.tensors, topologies)
            self.raw_layout = self.layout
        else:
            self.layout = self.recipe(options, topologies)
            # The raw limit writes the same bytes in 16 files per writer: a bound on bytes, not leaves.
            self.raw_layout = StateLayout.for_size(self.layout.nbytes, 16, topologies)
        self.notes: list[str] = []
        self.skipped: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.out = Path(options.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.storage = options.storage or str((self.out / "data").resolve())
        if self.storage.startswith("memory://"):
            raise ValueError("memory:// cannot be benchmarked: each run is a fresh process with its own memory store")
        local_root, self.scratch = local_path(self.storage), None
        if local_root is None:
            local_root = self.scratch = tempfile.mkdtemp(prefix="ckptfmt-bench-local-")
            self.notes.append(f"raw limit and peers ran on local disk ({local_root}): they cannot write to {self.storage}")
        self.urls = {"ckptfmt": _join(self.storage, "ckptfmt"), "tailstep": _join(self.storage, "tailstep")}
        self.paths = {s: os.path.join(local_root, s) for s in ("raw",) + PEERS}
        self.systems = (["raw"] if options.raw else []) + ["ckptfmt"]
        for p in options.peers:
            if p not in PEERS:
                raise ValueError(f"unknown peer {p!r}; known: {', '.join(PEERS)}")
            why = peer_available(p)
            if why:
                self.skipped[p] = why
                log(f"skipping {p}: {why}")
            else:
                self.systems.append(p)
        self.cache = "cold" if options.drop_cache and drop_page_cache() else "warm"
        if options.drop_cache and self.cache == "warm":
            self.notes.append("page cache could not be dropped (needs root on Linux): every read is warm")
        self.runs: dict[str, dict[str, list[dict]]] = {s: {} for s in self.systems}
        if options.two_process:
            self.runs[TWO_PROCESS] = {}
        self.common = {"layout": self.layout.to_json(), "check": options.check, "steady": options.steady}

    @staticmethod
    def recipe(options: BenchOptions, topologies: tuple[int, ...]) -> Recipe:
        """The state recipe of ``options``; ValueError for what a recipe cannot run."""
        if options.state not in STATES:
            raise ValueError(f"unknown state {options.state!r}; known: {', '.join(STATES)}")
        if options.ckptfmt_api not in ("auto", "bridge"):
            raise ValueError(f"--state {options.state} runs ckptfmt through bridges.jax only, not {options.ckptfmt_api!r}")
        if options.two_process or options.sizes:
            raise ValueError("--two-process and --sizes measure the 16-tensor state only")
        r = recipe(options.state, size=options.size, layers=options.layers, leaves=options.leaves)
        r.check_topologies(topologies)
        return r

    def raw_params(self) -> dict:
        """The raw limit's write task params: the same bytes as the state, by ``writers`` writers."""
        return self.common | {"layout": self.raw_layout.to_json(), "writers": self.o.save_devices,
                              "path": self.paths["raw"], "threads": self.o.raw_threads}

    def tasks(self, system: str, *, steady: bool) -> tuple[dict, tuple, Callable]:
        """:func:`_tasks` of one system, with or without its steady-state save."""
        return _tasks(system, self.common | {"steady": steady}, self.urls, self.paths, self.o)

    def child(self, task: str, params: dict, env: dict | None = None) -> dict:
        return run_child(task, params, env=env, timeout_s=self.o.child_timeout_s)

    def before_read(self) -> None:
        if self.cache == "cold":
            drop_page_cache()

    def record(self, system: str, phase: str, fn: Callable[[], dict], **tags: int) -> bool:
        """Run one measured phase; keep its numbers (with ``tags``: the repetition and the restore's
        place after the save), or the system's first error (then skip the rest of it)."""
        if system in self.errors:
            return False
        try:
            r = fn()
        except ChildFailed as e:
            self.errors[system] = f"{phase}: {e}"
            self.log(f"{system} {phase} FAILED: {str(e).splitlines()[0]}")
            return False
        ph = r["phase"] | dict(r.get("disk", {})) | {"process_wall_s": r.get("process_wall_s")} | tags
        self.runs[system].setdefault(phase, []).append(ph)
        self.log(f"{system:8s} {phase:12s} {ph['wall_s']:8.3f} s  peak RSS {ph['rss_peak'] / 2**20:8.0f} MiB")
        if r.get("steady"):  # the second save in the same process
            st = r["steady"]
            self.runs[system].setdefault(phase + "_steady", []).append(st)
            self.log(f"{system:8s} {phase + '_steady':12s} {st['wall_s']:8.3f} s  peak RSS {st['rss_peak'] / 2**20:8.0f} MiB")
        return True

    def repetition(self, rep: int = 0) -> None:
        n = self.o.save_devices
        k = rep % len(self.systems)
        for system in self.systems[k:] + self.systems[:k]:
            # Remove this system's previous checkpoint here, not in the child: freeing 1 GiB of
            # blocks must not be committed by the file system's journal on the save's clock.
            self.clear(system)
            os.sync()  # earlier runs' dirty pages must not be flushed on this save's clock
            if system == "raw":
                if self.record("raw", "save", lambda: self.child("ckptfmt_tools.bench.raw:write", self.raw_params())):
                    self.before_read()
                    self.record("raw", "restore", lambda: self.child("ckptfmt_tools.bench.raw:read", {"path": self.paths["raw"], "readers": n, "threads": self.o.raw_threads}))
                continue
            p, save, restore = _tasks(system, self.common, self.urls, self.paths, self.o)
            if not self.record(system, "save", lambda: self.child(*save)):
                continue
            # The topologies take turns going first, as the systems do: a restore right after the
            # save and one after another restore are not on the same footing on a virtual disk.
            tops = tuple(self.o.restore_devices)
            j = rep % len(tops) if tops else 0
            for place, m in enumerate(tops[j:] + tops[:j], 1):
                self.before_read()
                self.record(system, f"restore_{n}to{m}", lambda m=m: self.child(*restore(m)), rep=rep, place=place)
            if system == "ckptfmt" and isinstance(self.layout, StateLayout):  # the slice reader reads rows
                self.before_read()
                self.record(system, f"slice_1of{n}", lambda: self.child("ckptfmt_tools.bench.ours:read_slice", p | {"parts": n}))
                if self.o.two_process:
                    os.sync()
                    self.record(TWO_PROCESS, "save", lambda: self.child(
                        "ckptfmt_tools.bench.twoproc:save", p | {"devices": n, "url": self.urls["ckptfmt"].rstrip("/") + "-2proc"}))

    def safety(self, *, resave: bool = False) -> dict[str, Any]:
        """Flip bytes in each system's last checkpoint and restore it (see :mod:`ckptfmt_tools.bench.safety`).
        ``resave``: the rotated harness removed every checkpoint, so each system first saves again
        (a fresh process, untimed)."""
        out: dict[str, Any] = {}
        n = self.o.save_devices
        m = next((d for d in self.o.restore_devices if d != n), n)
        for system in [s for s in self.systems if s != "raw" and s not in self.errors]:
            where = local_path(self.urls["ckptfmt"]) if system == "ckptfmt" else self.paths[system]
            if where is None:
                continue
            try:
                if resave:
                    self.clear(system)
                    self.child(*self.tasks(system, steady=False)[1])
                flip = corrupt(where, system)
            except Exception as e:  # a probe that cannot run must not sink the results
                out[system] = {"outcome": "not run", "detail": f"{type(e).__name__}: {e}"[:300]}
                continue
            self.before_read()
            task, params, env = _tasks(system, self.common, self.urls, self.paths, self.o)[2](m)
            try:
                out[system] = flip | self.child("ckptfmt_tools.bench.safety:probe", {"task": task, "inner": params}, env)
            except ChildFailed as e:
                out[system] = flip | {"outcome": "probe failed", "detail": str(e).splitlines()[0]}
            self.log(f"{system:8s} 64-byte flip in {flip['object']}: {out[system]['outcome']} {out[system].get('error_type', '')}")
        return out

    def optional(self, name: str, task: str, params: dict, env: dict | None = None) -> dict | None:
        self.log(name)
        try:
            return self.child(task, params, env)
        except ChildFailed as e:
            self.errors[name] = str(e)
            self.log(f"{name} FAILED: {str(e).splitlines()[0]}")
            return None

    def clear_url(self, url: str) -> None:
        try:
            clear_repository(url)
        except Exception as e:  # the save itself will report a storage that cannot be written
            self.notes.append(f"could not clear {url}: {e}")

    def clear(self, system: str) -> None:
        """Remove one system's checkpoint (before its next save)."""
        if system in self.paths:
            shutil.rmtree(self.paths[system], ignore_errors=True)
        if system in self.urls:
            try:
                clear_repository(self.urls[system])
            except Exception as e:  # the save itself will report a storage that cannot be written
                self.notes.append(f"could not clear {self.urls[system]}: {e}")

    def cleanup(self) -> None:
        for path in self.paths.values():
            shutil.rmtree(path, ignore_errors=True)
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        for url in self.urls.values():
            try:
                clear_repository(url)
            except Exception as e:  # cleanup must not hide the results
                self.notes.append(f"could not remove {url}: {e}")


def _cadence(s: _Session) -> list[dict[str, Any]]:
    """A recipe's training cadence for ckptfmt and every peer (:mod:`.tailstep_state`), the interval
    chosen from the slowest median save of the rotated harness unless ``tailstep_every`` is given."""
    from . import tailstep_state

    medians = [statistics.median(r["wall_s"] for r in s.runs[x]["save"])
               for x in s.systems if x != "raw" and s.runs.get(x, {}).get("save")]
    systems = tuple(x for x in s.systems if x in tailstep_state.SYSTEMS)
    s.log(f"cadence on the state: {', '.join(systems)}")
    rows = tailstep_state.compare(
        systems, s.layout.to_json(), devices=s.o.save_devices, save_s=max(medians) if medians else None,
        every=s.o.tailstep_every, saves=s.o.tailstep_saves, storage=os.path.join(os.path.dirname(s.paths["raw"]), "cadence"),
        url=s.urls["tailstep"], log=lambda line: s.log("cadence " + line), timeout_s=s.o.child_timeout_s)
    for r in rows:
        if "error" in r:
            s.errors[f"cadence {r['system']}"] = r["error"]
    return rows


def run_bench(options: BenchOptions = BenchOptions(), *, log: Callable[[str], None] | None = _say) -> BenchResult:
    """Run the whole benchmark; write ``bench.json``, ``bench.md`` and ``bench.png`` into ``options.output_dir``.

    A peer that is not installed is skipped and named in ``skipped``. A run that
    fails is recorded in ``errors`` (that system's remaining phases are skipped)
    and the rest of the bench goes on; the result is still written. Raises
    ValueError only for options it cannot run (an unknown peer, ``memory://``).
    """
    from . import report

    if options.save_cache not in rotate.SAVE_CACHE_MODES:
        raise ValueError(f"save_cache must be one of {rotate.SAVE_CACHE_MODES}, not {options.save_cache!r}")
    s = _Session(options, log or (lambda _m: None))
    L = s.layout
    what = L.describe if isinstance(L, Recipe) else f"{L.tensors} x {L.rows}x{L.cols} float32"
    s.log(f"state: {what} = {L.nbytes / 2**20:.0f} MiB; systems: {', '.join(s.systems)}; reads {s.cache}")
    # A recipe is judged as --rotate judges: paired per-repetition ratios, the order rotated.
    rotated = options.rotate or isinstance(L, Recipe)
    if rotated and not options.rotate:
        s.notes.append(f"--state {options.state} runs the rotated harness (as --rotate)")
    for rep in range(options.repetitions):
        s.log(f"repetition {rep + 1}/{options.repetitions}" + (" (rotated)" if rotated else ""))
        if rotated:
            rotate.repetition(s, rep)
        else:
            s.repetition(rep)
    safety = s.safety(resave=rotated) if options.safety else {}
    scaling_rows = None
    if options.sizes:
        from . import scaling

        scaling_rows = scaling.run(s, tuple(options.sizes))
    metadata = tailstep = None
    if options.metadata:
        metadata = s.optional("metadata", "ckptfmt_tools.bench.metadata_scale:run", {
            "entries": list(options.metadata_entries), "dcp_max_entries": options.dcp_metadata_max_entries,
            "peers": "dcp" in s.systems})
    cadence = None
    if options.tailstep and importlib.util.find_spec("jax") is None:
        s.notes.append("tail-step slowdown skipped: jax is not installed")
    elif options.tailstep and isinstance(L, Recipe):
        cadence = _cadence(s)
    elif options.tailstep:
        tailstep = s.optional("tailstep", "ckptfmt_tools.bench.tailstep:run", {
            "steps": options.tailstep_steps, "every": options.tailstep_every or 10, "url": s.urls["tailstep"]},
            xla_env(1))
    if not options.keep_data:
        s.cleanup()
    result = BenchResult(
        options=asdict(options), layout=L.to_json(), cache=s.cache, runs=s.runs, summary={}, ratios={}, targets=[],
        notes=s.notes, skipped=s.skipped, errors=s.errors, metadata=metadata, tailstep=tailstep, cadence=cadence,
        safety=safety,
        scaling=scaling_rows,
        environment=_environment(),
    )
    if rotated:
        n = options.save_devices
        result.rotated = {"repetitions": options.repetitions, "save_cache": options.save_cache, "reads": s.cache,
                          "phases": rotate.analyse(s.runs, ["save"] + [f"restore_{n}to{m}" for m in options.restore_devices])}
    report.finish(result, s.out, make_plot=options.plot)
    s.log(f"wrote {result.json_path}" + (f" and {result.plot_path}" if result.plot_path else ""))
    return result
