"""The outcome table, drawn with rich."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ckptfmt_tools.cli._render import safe, visible

__all__ = ["print_table", "render_table", "to_markdown"]


def _raised(o: Any) -> str:
    """Each distinct error once; the verify error only when it differs from the restore's."""
    names = [r.split(": ", 1)[-1] for r in o.raised]
    return " / ".join(dict.fromkeys(names)) or "-"


def _peers(o: Any) -> str:
    if not o.peers or all(v == "-" for v in o.peers.values()):
        return "-"
    label = {"orbax": "Orbax", "dcp": "DCP"}
    return "; ".join(f"{label.get(k, k)}: {v}" for k, v in o.peers.items())


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
        raised = safe(_raised(o))
        if not o.typed:
            raised = f"[bold red]{raised}[/]"
        row = [safe(o.fault), safe(o.where), raised, _yes_no(o.exposed, False), _yes_no(o.prior_intact, True),
               _yes_no(o.gc_clean, True)]
        if peers:
            row.append(safe(_peers(o)))
        row.append("[green]PASS[/]" if o.passed else "[bold red]FAIL[/]")
        t.add_row(*row)
    return t


def to_markdown(table: Any) -> str:
    """The same table as GitHub markdown (for the README)."""
    peers = any(o.peers for o in table.outcomes)
    head = ["fault", "where injected", "error raised", "state exposed?", "prior intact?", "gc clean?"]
    head += ["Orbax / DCP, same fault, same run"] if peers else []
    head += ["ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in table.outcomes:
        row = [f"`{o.fault}`", o.where, _raised(o), "yes" if o.exposed else "no", "yes" if o.prior_intact else "no",
               "yes" if o.gc_clean else "no"]
        row += [_peers(o)] if peers else []
        row += ["PASS" if o.passed else "**FAIL**"]
        lines.append("| " + " | ".join(visible(c).replace("|", "\\|") for c in row) + " |")
    lines.append("")
    lines.append(f"{sum(o.passed for o in table.outcomes)}/{len(table.outcomes)} faults end terminal and correct.")
    for o in table.outcomes:
        if o.notes:
            lines.append(f"- `{visible(o.fault)}`{'' if o.passed else ' (FAIL)'}: " + visible("; ".join(o.notes)))
    return "\n".join(lines)


def print_table(table: Any, console: Console | None = None) -> None:
    console = console or Console()
    console.print(render_table(table))
    for o in table.outcomes:
        if o.notes:
            style = "green" if o.passed else "bold red"
            console.print(f"[{style}]{safe(o.fault)}[/]: " + safe("; ".join(o.notes)))
