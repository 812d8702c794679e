"""The progress line of the long commands that report phases as messages (``bench``, ``drill``).

On a terminal: a live line on stderr (spinner, the current phase, elapsed time), with each message
also kept above it. Not on a terminal (CI logs, pipes): the messages as plain timestamped lines,
as before. With ``--json``: nothing, so stdout holds exactly the one JSON document and stderr
stays quiet.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ckptfmt_tools.cli._render import safe, visible

__all__ = ["phase_line"]


@contextlib.contextmanager
def phase_line(what: str, *, quiet: bool, console: Console | None = None) -> Iterator[Callable[[str], None]]:
    """Yield the callback that reports one phase message (see the module docstring)."""
    if quiet:
        yield lambda _msg: None
        return
    err = console or Console(stderr=True, highlight=False)
    if not err.is_terminal:
        yield lambda msg: err.print(f"[{what} {time.strftime('%H:%M:%S')}] {visible(msg)}", markup=False,
                                    soft_wrap=True)
        return
    with Progress(SpinnerColumn(), TextColumn(f"[bold]{what}[/]"), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def say(msg: str) -> None:
            bar.console.print(f"[dim]{what}:[/] {safe(msg)}")
            bar.update(task, description=safe(msg.splitlines()[0] if msg else ""))

        yield say
