"""The bench's command line (``ckptfmt bench ...`` and ``python -m ckptfmt_tools.bench ...``)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from ckptfmt_tools.cli._progress import phase_line
from .runner import BenchOptions, run_bench
from .states import STATES

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'1GiB', '64MiB', '8m', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB, 64MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return () if text.strip().lower() in ("", "none") else tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    d = BenchOptions()
    p = argparse.ArgumentParser(prog="ckptfmt bench", description="ckptfmt vs Orbax vs torch DCP vs the raw disk limit.")
    p.add_argument("--size", type=parse_size, default=d.size, help="state bytes (default 1GiB)")
    p.add_argument("--tensors", type=int, default=d.tensors, help="number of tensors of the tensors16 state (default 16)")
    p.add_argument("--state", choices=STATES, default=d.state,
                   help="the state: tensors16 (float32 matrices split by rows, the default), llama (a Llama-style "
                        "model with AdamW moments, 9L+3 bf16 parameters, 27L+10 leaves, about --size bytes), moe "
                        "(per-expert MoE tensors of a few KiB, about --leaves leaves); a recipe runs the rotated "
                        "harness (see ckptfmt_tools/bench/states.py)")
    p.add_argument("--layers", type=int, default=d.layers, help="--state llama: layers (default 32: 874 leaves)")
    p.add_argument("--leaves", type=int, default=d.leaves, help="--state moe: leaves, about (default 20000)")
    p.add_argument("--save-devices", type=int, default=d.save_devices, help="writers: JAX devices / DCP ranks (default 8)")
    p.add_argument("--restore-devices", type=_ints, default=d.restore_devices, help="restore topologies (default 8,4)")
    p.add_argument("--repetitions", "-r", type=int, default=d.repetitions, help="medians over this many runs (default 5: the disk is noisy)")
    p.add_argument("--storage", "--url", dest="storage", default=None,
                   help="repository URL or path for ckptfmt, e.g. s3://bucket/bench (default OUTPUT_DIR/data)")
    p.add_argument("--output-dir", "-o", default=d.output_dir, help="where bench.json, bench.md, bench.png go")
    p.add_argument("--peers", type=_names, default=d.peers, help="comma list of orbax,dcp or 'none'")
    p.add_argument("--no-steady", dest="steady", action="store_false",
                   help="skip the steady-state save (a second save in the same process) of each system")
    p.add_argument("--two-process", action="store_true",
                   help="also save ckptfmt from 2 processes x N/2 devices (jax.distributed), against DCP's N ranks")
    p.add_argument("--sizes", type=_sizes, default=d.sizes,
                   help="scaling: also save and restore ckptfmt once at each size, e.g. 1GiB,2GiB,4GiB,8GiB "
                        "(seconds per GiB, peak RSS rise, scaling.png)")
    p.add_argument("--rotate", action="store_true",
                   help="the rotated harness: per repetition every system saves back to back (fresh processes, order "
                        "rotated, checkpoints kept until the repetition ends), then restores; paired per-repetition "
                        "ratios ckptfmt / faster peer, and each system's seconds by place")
    p.add_argument("--save-cache", choices=("sync", "drop"), default=d.save_cache,
                   help="--rotate: before each save sync the page cache, or sync and drop it (default drop; needs root)")
    p.add_argument("--no-raw", dest="raw", action="store_false", help="skip the raw disk limit")
    p.add_argument("--raw-threads", type=int, default=d.raw_threads, help="threads of the raw limit's pool (default 32)")
    p.add_argument("--ckptfmt-api", choices=("auto", "bridge", "core-jax", "core-numpy"), default=d.ckptfmt_api,
                   help="how ckptfmt is driven (auto: bridges.jax if present, else the core API)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip comparing restored data")
    p.add_argument("--warm", dest="drop_cache", action="store_false", help="do not drop the page cache before reads")
    p.add_argument("--no-safety", dest="safety", action="store_false", help="skip the 64-byte-flip probe")
    p.add_argument("--no-metadata", dest="metadata", action="store_false", help="skip metadata at scale")
    p.add_argument("--metadata-entries", type=_ints, default=d.metadata_entries, help="shard entry counts to time")
    p.add_argument("--dcp-metadata-max-entries", type=int, default=d.dcp_metadata_max_entries,
                   help="time DCP's pickled metadata up to this many entries (640k takes ~30 s)")
    p.add_argument("--no-tailstep", dest="tailstep", action="store_false", help="skip the training-loop tail-step run")
    p.add_argument("--tailstep-steps", type=int, default=d.tailstep_steps, help="training steps per loop (default 200)")
    p.add_argument("--tailstep-every", type=int, default=d.tailstep_every,
                   help="save every N steps (default 10; a recipe state: 2x the slowest median save over the step time)")
    p.add_argument("--tailstep-saves", type=int, default=d.tailstep_saves,
                   help="a recipe state's cadence: saves per system (default 10)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no bench.png")
    p.add_argument("--keep-data", action="store_true", help="leave the checkpoints on storage")
    p.add_argument("--incremental", action="store_true",
                   help="the incremental-save bench instead (frozen base + adapters; see "
                        "ckptfmt_tools/bench/incremental.py for its own options)")
    p.add_argument("--compression", action="store_true",
                   help="the zstd ratio/speed bench instead (see ckptfmt_tools/bench/compression.py)")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON document on stdout (bench.json is still written); no progress")
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    fields = BenchOptions.__dataclass_fields__
    return BenchOptions(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> int:
    """Run the bench from command-line arguments; print the table (``--json``: one JSON document). Exit
    code 1 if a ckptfmt run failed."""
    raw = list(sys.argv[1:] if argv is None else argv)
    if "--incremental" in raw:  # its own options; it runs in a child with the JAX device count set
        from .incremental import main as incremental_main

        return incremental_main(raw)
    if "--compression" in raw:  # zstd ratio and speed by kind of state (its own options)
        from .compression import main as compression_main

        return compression_main(raw)
    args = build_parser().parse_args(argv)
    with phase_line("bench", quiet=args.json) as say:
        result = run_bench(options_from_args(args), log=say)
    if args.json:
        sys.stdout.write(json.dumps({"ok": "ckptfmt" not in result.errors, **result.to_json()}, default=str) + "\n")
    else:
        print(result.table)
    return 1 if "ckptfmt" in result.errors else 0

