"""Profile ckptfmt saves in one fresh process: wall, user and system CPU, page faults, per-phase
times, and (``--cprofile``) a cProfile top list per save.

usage: python -m ckptfmt_tools.bench.profile_save [--size 1GiB] [--devices 8] [--saves 2] [--cprofile N] [DIR]

Builds the bench's state (row-sharded over ``--devices`` JAX CPU devices), then saves it
``--saves`` times with ``bridges.jax.save`` into DIR (a temporary directory by default). The
first save is the fresh-process one; the rest are steady-state saves in the same process.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_save")
    p.add_argument("dir", nargs="?")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--write-threads", type=int, default=None, help="the save's writer threads (default 16)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions by cumulative time")
    a = p.parse_args(argv)
    from .args import parse_size
    from .jaxstate import xla_env

    os.environ.update(xla_env(a.devices))
    import cProfile
    import io
    import pstats
    import resource
    import time

    import bridges.jax as bj
    from ckptfmt import Repository, SaveOptions

    from .jaxstate import make_state
    from .layout import StateLayout

    layout = StateLayout.for_size(parse_size(a.size), a.tensors, (a.devices,))
    state = make_state(layout, a.devices)
    root = a.dir or tempfile.mkdtemp(prefix="ckptfmt-profile-")
    for n in range(a.saves):
        phases: dict[str, float] = {}
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        prof = cProfile.Profile() if a.cprofile else None
        if prof:
            prof.enable()
        opts = {"write_threads": a.write_threads} if a.write_threads else {}
        repo = Repository(os.path.join(root, f"s{n}"), options=opts)
        bj.save(repo, state, step=1, options=SaveOptions(timings=phases))
        if prof:
            prof.disable()
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        kind = "fresh" if n == 0 else "steady"
        print(f"save {n} ({kind}): wall {wall:.3f} s  user {r1.ru_utime - r0.ru_utime:.3f} s  "
              f"sys {r1.ru_stime - r0.ru_stime:.3f} s  minflt {r1.ru_minflt - r0.ru_minflt}  "
              f"majflt {r1.ru_majflt - r0.ru_majflt}  maxrss {r1.ru_maxrss >> 10} MiB")
        print("  phases: " + "  ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.cprofile)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-6000:])
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
