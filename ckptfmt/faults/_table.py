"""The outcome table, drawn with rich."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_table", "render_table"]


def _yes_no(flag: bool, good: bool) -> str:
    text = "yes" if flag else "no"
    return f"[green]{text}[/]" if flag == good else f"[bold red]{text}[/]"


def render_table(table: Any) -> Table:
    peers = any(o.peers for o in table.outcomes)
    t = Table(title="ckptfmt: terminal outcome of each injected fault", show_lines=False,
              caption=(f"{sum(o.passed for o in table.outcomes)}/{len(table.outcomes)} faults end terminal "
                       f"and correct; base save of steps 1-2 by 2 writer processes took "
                       f"{table.base_seconds:.1f}s"))
    t.add_column("fault", style="bold", no_wrap=True)
    t.add_column("where injected", overflow="fold", max_width=48)
    t.add_column("error raised", overflow="fold")
    t.add_column("state exposed?", justify="center")
    t.add_column("prior intact?", justify="center")
    t.add_column("gc clean?", justify="center")
    if peers:
        t.add_column("Orbax / DCP (same fault, this machine)", overflow="fold", max_width=40)
    t.add_column("ok", justify="center")
    for o in table.outcomes:
        raised = ", ".join(dict.fromkeys(o.raised)) or "-"
        if not o.typed:
            raised = f"[bold red]{raised}[/]"
        row = [o.fault, o.where, raised, _yes_no(o.exposed, False), _yes_no(o.prior_intact, True),
               _yes_no(o.gc_clean, True)]
        if peers:
            row.append("; ".join(f"{k}: {v}" for k, v in o.peers.items()) or "-")
        row.append("[green]PASS[/]" if o.passed else "[bold red]FAIL[/]")
        t.add_row(*row)
    return t


def print_table(table: Any, console: Console | None = None) -> None:
    console = console or Console()
    console.print(render_table(table))
    for o in table.outcomes:
        if not o.passed and o.notes:
            console.print(f"[red]{o.fault}[/]: " + "; ".join(o.notes))
