"""``ckptfmt bench``: ckptfmt side by side with Orbax, torch DCP and the raw disk limit.

Entry point (the CLI's ``bench`` subcommand calls exactly this)::

    from ckptfmt_tools.bench import BenchOptions, run_bench
    result = run_bench(BenchOptions(size=1 << 30, tensors=16, repetitions=3,
                                    storage="/mnt/ckpt", output_dir="bench-out"))
    print(result.table)          # Markdown table, ratios and targets
    result.json_path, result.plot_path   # bench-out/bench.json, bench-out/bench.png

Command line: ``ckptfmt bench --help`` (the CLI delegates to ``ckptfmt_tools.bench.main(argv)``)
or standalone ``python -m ckptfmt_tools.bench --help``.

Every measured run (one save, or one restore) happens in a fresh Python
process (``child.py``); JAX gets its device count through ``XLA_FLAGS`` before
it is imported, DCP ranks are forked gloo processes. The page cache is dropped
before every read where the OS allows it (root on Linux), and the result says
whether reads were cold or warm. A peer that is not installed is skipped and
named in ``result.skipped``. Modules: ``raw`` (the disk limit), ``ours``
(ckptfmt), ``peers`` (Orbax, DCP), ``safety`` (a 64-byte flip, who notices),
``metadata_scale``, ``tailstep`` (async saves in a training loop; ``tailstep_state``: on a
recipe state, beside the host copy), ``report``
(medians, ratios, targets, JSON, PNG), ``layout``/``jaxstate`` (the state),
``child`` (fresh processes and per-phase meters), ``args`` (command line).

Run it on a quiet machine: everything is measured against the raw limit of
the same run, but other load on the disk or CPUs still moves the numbers.
"""

from .args import main as main
from .runner import BenchOptions as BenchOptions
from .runner import BenchResult as BenchResult
from .runner import run_bench as run_bench

__all__ = ["BenchOptions", "BenchResult", "run_bench", "main"]
