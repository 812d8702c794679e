"""``ckptfmt demo``, ``ckptfmt bench`` and ``ckptfmt drill``: typer commands over the tools' runners.

Each command declares its options here (so ``--help`` shows them, and a typo is a usage error),
then calls the module's ``main(argv)`` with exactly the options given: the module's own argparse
parser stays the one place that holds defaults and checks values, and ``python -m
ckptfmt_tools.bench ...`` keeps working. An option left out here takes the module's default.
tests/test_cli.py checks that every option of the three modules' parsers is declared here.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import typer

__all__ = ["register"]


def _flag(help: str, *names: str) -> Any:
    """A boolean flag: shown as ``--name`` (no value), False unless given."""
    return typer.Option(False, *names, help=help)


def _opt(help: str, *names: str, **kw: Any) -> Any:
    """An option with a value; None (the module's default) unless given."""
    return typer.Option(None, *names, help=help, **kw)


def _argv(pairs: list[tuple[str, Any]]) -> list[str]:
    """``--flag`` for a flag that is set, ``--opt value`` for an option given, nothing otherwise."""
    out: list[str] = []
    for name, value in pairs:
        if value is None or value is False:
            continue
        out += [name] if value is True else [name, str(value)]
    return out


def _run(module: str, pairs: list[tuple[str, Any]]) -> None:
    code = importlib.import_module(module).main(_argv(pairs))
    if isinstance(code, int) and code != 0:
        raise typer.Exit(code=code)


def demo_cmd(workdir: Optional[str] = _opt("Work directory (default: a temporary one, removed afterwards).", "--dir"),
             k: Optional[int] = _opt("The step to save (default 3).", "--k"),
             save_devices: Optional[int] = _opt("Devices in all, split over the processes (default 8).",
                                                "--save-devices"),
             save_processes: Optional[int] = _opt("Processes of the saving job (default 1).", "--save-processes"),
             restore_devices: Optional[int] = _opt("Devices of the restoring side (default 4).", "--restore-devices"),
             restore_mesh: Optional[str] = _opt("Data x model mesh of the restoring side (default 2x2).",
                                                "--restore-mesh"),
             as_json: bool = _flag("Print the full results as one JSON document.", "--json")) -> None:
    """Run the end-to-end demo: a JAX job saves on 8 devices and resumes exactly on 4 (the receipt)."""
    _run("ckptfmt_tools.demo", [("--dir", workdir), ("--k", k), ("--save-devices", save_devices),
                                ("--save-processes", save_processes), ("--restore-devices", restore_devices),
                                ("--restore-mesh", restore_mesh), ("--json", as_json)])


def bench_cmd(size: Optional[str] = _opt("State bytes, e.g. 1GiB, 64MiB (default 1GiB; --compression: 64MiB "
                                         "of each kind).", "--size"),
              tensors: Optional[int] = _opt("Number of tensors of the tensors16 state (default 16).", "--tensors"),
              state: Optional[str] = _opt("The state: tensors16 (default), llama (Llama-style with AdamW moments, "
                                          "about --size bytes) or moe (per-expert tensors, about --leaves leaves); "
                                          "a recipe runs the rotated harness.", "--state"),
              layers: Optional[int] = _opt("--state llama: layers (default 32: 874 leaves).", "--layers"),
              leaves: Optional[int] = _opt("--state moe: leaves, about (default 20000).", "--leaves"),
              save_devices: Optional[int] = _opt("Writers: JAX devices / DCP ranks (default 8).", "--save-devices"),
              restore_devices: Optional[str] = _opt("Restore topologies, comma list (default 8,4; --incremental: "
                                                    "one count, 4).", "--restore-devices"),
              repetitions: Optional[int] = _opt("Medians over this many runs (default 5: the disk is noisy).",
                                                "--repetitions", "-r"),
              storage: Optional[str] = _opt("Repository URL or path for ckptfmt, e.g. s3://bucket/bench "
                                            "(default OUTPUT_DIR/data).", "--storage", "--url"),
              output_dir: Optional[str] = _opt("Where bench.json, bench.md, bench.png go.", "--output-dir", "-o"),
              peers: Optional[str] = _opt("Comma list of orbax,dcp, or 'none'.", "--peers"),
              no_steady: bool = _flag("Skip the steady-state save (a second save in the same process).",
                                      "--no-steady"),
              two_process: bool = _flag("Also save ckptfmt from 2 processes x N/2 devices (jax.distributed).",
                                        "--two-process"),
              sizes: Optional[str] = _opt("Scaling: also save and restore once at each size, e.g. 1GiB,2GiB,4GiB.",
                                          "--sizes"),
              no_raw: bool = _flag("Skip the raw disk limit.", "--no-raw"),
              raw_threads: Optional[int] = _opt("Threads of the raw limit's pool (default 32).", "--raw-threads"),
              ckptfmt_api: Optional[str] = _opt("How ckptfmt is driven: auto, bridge, core-jax, core-numpy.",
                                                "--ckptfmt-api"),
              no_check: bool = _flag("Skip comparing restored data.", "--no-check"),
              warm: bool = _flag("Do not drop the page cache before reads.", "--warm"),
              no_safety: bool = _flag("Skip the 64-byte-flip probe.", "--no-safety"),
              no_metadata: bool = _flag("Skip metadata at scale.", "--no-metadata"),
              metadata_entries: Optional[str] = _opt("Shard entry counts to time, comma list.", "--metadata-entries"),
              dcp_metadata_max_entries: Optional[int] = _opt("Time DCP's pickled metadata up to this many entries.",
                                                             "--dcp-metadata-max-entries"),
              no_tailstep: bool = _flag("Skip the training-loop tail-step run.", "--no-tailstep"),
              tailstep_steps: Optional[int] = _opt("Training steps per loop (default 200).", "--tailstep-steps"),
              tailstep_every: Optional[int] = _opt("Save every N steps (default 10; a recipe state: 2x the "
                                                   "slowest median save over the step time).", "--tailstep-every"),
              tailstep_saves: Optional[int] = _opt("A recipe state's cadence: saves per system (default 10).",
                                                   "--tailstep-saves"),
              no_plot: bool = _flag("No bench.png.", "--no-plot"),
              keep_data: bool = _flag("Leave the checkpoints on storage.", "--keep-data"),
              rotate: bool = _flag("The rotated harness: per repetition every system saves back to back (fresh "
                                   "processes, order rotated, checkpoints kept until the repetition ends), then "
                                   "restores; prints the paired per-repetition ratios.", "--rotate"),
              save_cache: Optional[str] = _opt("--rotate: before each save sync the page cache, or sync and drop it "
                                               "(sync or drop; default drop, needs root).", "--save-cache"),
              incremental: bool = _flag("The incremental-save bench instead (frozen base + adapters).",
                                        "--incremental"),
              base_size: Optional[str] = _opt("--incremental: frozen base bytes (default 1GiB).", "--base-size"),
              base_tensors: Optional[int] = _opt("--incremental: frozen base tensors (default 8).", "--base-tensors"),
              adapter_size: Optional[str] = _opt("--incremental: adapter bytes changed per save.", "--adapter-size"),
              saves: Optional[int] = _opt("--incremental: saves, the first one full (default 4).", "--saves"),
              compression: bool = _flag("The zstd ratio/speed bench instead.", "--compression"),
              levels: Optional[str] = _opt("--compression: zstd levels (default 1,3).", "--levels"),
              as_json: bool = _flag("Print the results as one JSON document on stdout (bench.json is still "
                                    "written); no progress on stderr.", "--json")) -> None:
    """(For ckptfmt's developers.) Measure ckptfmt against Orbax, torch DCP and the raw disk limit
    (writes bench.json, bench.md, bench.png; docs/bench.md says what each option measures)."""
    if incremental and compression:
        raise typer.BadParameter("give --incremental or --compression, not both")
    only = {"--base-size": base_size, "--base-tensors": base_tensors, "--adapter-size": adapter_size,
            "--saves": saves}
    for name, value in only.items():
        if value is not None and not incremental:
            raise typer.BadParameter(f"{name} needs --incremental")
    if levels is not None and not compression:
        raise typer.BadParameter("--levels needs --compression")
    _run("ckptfmt_tools.bench.args", [
        ("--incremental", incremental), ("--compression", compression), ("--size", size), ("--tensors", tensors),
        ("--state", state), ("--layers", layers), ("--leaves", leaves),
        ("--save-devices", save_devices), ("--restore-devices", restore_devices), ("--repetitions", repetitions),
        ("--storage", storage), ("--output-dir", output_dir), ("--peers", peers), ("--no-steady", no_steady),
        ("--two-process", two_process), ("--sizes", sizes), ("--no-raw", no_raw), ("--raw-threads", raw_threads),
        ("--ckptfmt-api", ckptfmt_api), ("--no-check", no_check), ("--warm", warm), ("--no-safety", no_safety),
        ("--no-metadata", no_metadata), ("--metadata-entries", metadata_entries),
        ("--dcp-metadata-max-entries", dcp_metadata_max_entries), ("--no-tailstep", no_tailstep),
        ("--tailstep-steps", tailstep_steps), ("--tailstep-every", tailstep_every),
        ("--tailstep-saves", tailstep_saves), ("--no-plot", no_plot),
        ("--keep-data", keep_data), ("--rotate", rotate), ("--save-cache", save_cache), *only.items(), ("--levels", levels), ("--json", as_json)])


def drill_cmd(processes: Optional[int] = _opt("Processes of the training job (default 2).", "--processes"),
              devices_per_process: Optional[int] = _opt("CPU devices per training process (default 4).",
                                                        "--devices-per-process"),
              replacement_devices: Optional[int] = _opt("Devices of the replacement (torch: ranks; default 4).",
                                                        "--replacement-devices"),
              replacement: Optional[str] = _opt("Framework of the replacement job: jax or torch (default jax).",
                                                "--replacement"),
              train_mesh: Optional[str] = _opt("Data x model mesh of the training job (default: N/2 x 2).",
                                               "--train-mesh"),
              replacement_mesh: Optional[str] = _opt("Data x model mesh of the replacement.", "--replacement-mesh"),
              cadence: Optional[int] = _opt("Steps between asynchronous saves (default 5).", "--cadence"),
              step_time: Optional[float] = _opt("Minimum seconds per training step (default 0.05).", "--step-time"),
              kill_window: Optional[str] = _opt("Steps LO:HI the kill is drawn from (default: 2*cadence+1 : "
                                                "4*cadence-1).", "--kill-window", metavar="LO:HI"),
              capacity_delay: Optional[float] = _opt("Seconds to wait for replacement capacity, like a scheduler (default 0).",
                                                     "--capacity-delay"),
              monitor_interval: Optional[float] = _opt("Seconds between the supervisor's liveness polls (default 0.1).",
                                                       "--monitor-interval"),
              storage: Optional[str] = _opt("Repository URL (default: OUT/repo); must hold no step.", "--storage"),
              out: Optional[str] = _opt("Output directory (default: a new temporary directory).", "--out"),
              seed: Optional[int] = _opt("Seed of the kill step and the victim (default 0).", "--seed"),
              d_in: Optional[int] = _opt("Model input width (default 256).", "--d-in"),
              hidden: Optional[int] = _opt("Model hidden width; sets the checkpoint size (default 2048).", "--hidden"),
              timeout: Optional[float] = _opt("Seconds allowed per job (default 240).", "--timeout"),
              no_control: bool = _flag("Skip the same-topology control restore.", "--no-control"),
              tiers: bool = _flag("Keep a local tier with peer replicas (persistent every 2 x cadence) and run its "
                                  "four failures: killed process, lost host, every local copy lost, corrupt copy.",
                                  "--tiers"),
              cold_cache: bool = _flag("--tiers: drop the page cache before each tier failure's restore job "
                                       "(root), as for a replacement whose host never read the persistent tier.",
                                       "--cold-cache"),
              tier_pairs: Optional[int] = _opt("--tiers: then N pairs of replacement jobs, one restoring from the own "
                                               "local copies and one from the persistent tier, back to back in "
                                               "alternating order; prints their paired recovery times (default 0).",
                                               "--tier-pairs"),
              local_dir: Optional[str] = _opt("--tiers: keep the local tiers in a new directory under this one, "
                                              "removed at the end (for example /dev/shm; default: OUT).",
                                              "--local-dir"),
              elastic: bool = _flag("--tiers: instead of the four same-topology failures, lose the killed "
                                    "process's host and restart on one process fewer with no spare, then on two "
                                    "fewer (the boxes only the lost hosts held from the persistent tier); "
                                    "--tier-pairs pairs it with a recovery from the persistent tier alone.",
                                    "--elastic"),
              as_json: bool = _flag("Print the receipt as one JSON document; no progress on stderr.",
                                    "--json")) -> None:
    """The restore drill: SIGKILL one process of a training job, restore on a new topology, check one step."""
    _run("ckptfmt_tools.drill", [
        ("--processes", processes), ("--devices-per-process", devices_per_process),
        ("--replacement-devices", replacement_devices), ("--replacement", replacement), ("--train-mesh", train_mesh),
        ("--replacement-mesh", replacement_mesh), ("--cadence", cadence), ("--step-time", step_time),
        ("--kill-window", kill_window), ("--capacity-delay", capacity_delay), ("--monitor-interval", monitor_interval),
        ("--storage", storage), ("--out", out), ("--seed", seed), ("--d-in", d_in), ("--hidden", hidden),
        ("--timeout", timeout), ("--no-control", no_control), ("--tiers", tiers), ("--cold-cache", cold_cache),
        ("--tier-pairs", tier_pairs), ("--local-dir", local_dir), ("--elastic", elastic), ("--json", as_json)])


def register(app: typer.Typer) -> None:
    """Add ``demo``, ``bench`` and ``drill`` to ``app``."""
    app.command("demo")(demo_cmd)
    app.command("drill")(drill_cmd)
    app.command("bench")(bench_cmd)  # last: the developers' command after the users' ones
