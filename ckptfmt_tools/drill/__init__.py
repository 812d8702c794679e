"""``ckptfmt drill``: the executable restore gate.

A real multi-process JAX training job saves asynchronously; one of its processes is SIGKILLed at a
seeded random step; a replacement on a new topology (fewer devices, or torch ranks) restores the
newest committed step and runs exactly one step, which must match the uninterrupted run (the same
batch ids, the loss within the documented tolerance). A same-topology control and a missing-shard
control run in the same drill. The phase table measures recovery from the moment of the kill.

Importing this package imports no framework: JAX and torch run in child processes.

    >>> from ckptfmt_tools.drill import DrillConfig, run_drill
    >>> receipt = run_drill(DrillConfig(seed=3))     # doctest: +SKIP
    >>> receipt["pass"], receipt["outputs"]["recovery_s"]  # doctest: +SKIP
"""
from __future__ import annotations

import json
import sys
from typing import Any

from ._config import DrillConfig as DrillConfig

__all__ = ["DrillConfig", "run_drill", "DrillFailed", "main"]


def __getattr__(name: str) -> Any:
    if name in ("run_drill", "DrillFailed"):
        from . import _run

        return getattr(_run, name)
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (``ckptfmt drill``). Exit 0 when the receipt passes, 1 when not, 2 on usage."""
    from rich.console import Console

    from ckptfmt_tools.cli._progress import phase_line

    from ._config import from_args, parser
    from ._report import print_report
    from ._run import DrillFailed, run_drill

    ap = parser()
    ns = ap.parse_args(argv)
    try:
        cfg = from_args(ns)
    except ValueError as exc:
        ap.error(str(exc))
    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        err = Console(stderr=True, highlight=False, width=132)
    try:
        with phase_line("drill", quiet=ns.json, console=err) as progress:
            receipt = run_drill(cfg, progress=progress)
    except DrillFailed as exc:
        if ns.json:
            sys.stdout.write(json.dumps({"pass": False, **exc.receipt}, default=str) + "\n")
        else:
            err.print(f"[bold red]drill failed:[/] {exc}")
            err.print(f"partial receipt: {exc.receipt.get('receipt_path')}")
            err.print(str(exc.receipt.get("error", ""))[-3000:])
        return 1
    if ns.json:
        sys.stdout.write(json.dumps(receipt, indent=1, default=str) + "\n")
    else:
        print_report(receipt)
    return 0 if receipt["pass"] else 1
