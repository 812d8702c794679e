"""Rich tables of a drill receipt: the phase table, the guide's table, the continuation checks."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_report", "phase_table", "guide_table"]


def phase_table(receipt: dict[str, Any]) -> Table:
    out = receipt["outputs"]
    r = receipt["replacement"]
    t = Table(title=f"Where the recovery time went, from killing process {out['kill']['rank']} at step "
                    f"{out['kill']['step']} to the replacement job's first training step",
              caption=f"replacement: {r['topology']}; restored step {r['restored_step']}, ran step {r['step']}",
              title_justify="left", caption_justify="left")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    t.add_column("what")
    total = out["recovery_s"]
    for row in out["phases"]:
        if row.get("total"):
            t.add_section()
            t.add_row(f"[bold]{row['phase']}[/]", f"[bold]{row['seconds']:.3f}[/]", "100%", row["note"])
        else:
            share = 100.0 * row["seconds"] / total if total > 0 else 0.0
            t.add_row(row["phase"], f"{row['seconds']:.3f}", f"{share:.0f}%", row["note"])
    return t


def guide_table(receipt: dict[str, Any]) -> Table:
    t = Table(title="Three restores: on the old shape (the control), on the new shape (what recovery needs), "
                    "and from a checkpoint with one file deleted (which must be refused, exposing nothing)",
              title_justify="left")
    t.add_column("Signal")
    t.add_column("Choice")
    t.add_column("Evidence")
    t.add_column("Detail", style="dim")
    for row in receipt["outputs"]["guide_table"]:
        t.add_row(row["signal"], row["choice"], row["evidence"], row["detail"])
    return t


def checks_table(receipt: dict[str, Any]) -> Table:
    t = Table(title="Did the replacement continue exactly where the killed job stopped? (same batches, same "
                    "loss, bit-identical state)", title_justify="left")
    t.add_column("job")
    t.add_column("check")
    t.add_column("ok")
    t.add_column("detail")
    out = receipt["outputs"]
    jobs = [("replacement", out["continuation"]), ("control", out.get("control")),
            ("missing shard", receipt["rejected_control"].get("verdict"))]
    jobs += [(f"tiers: {k}", v) for k, v in receipt.get("tiers_verdict", {}).get("verdicts", {}).items()]
    jobs += [(f"tiers pair {r['pair']}: {k}", v) for r in receipt.get("tiers_verdict", {}).get("pairs", [])
             for k, v in r["checks"].items()]
    for name, verdict in jobs:
        if not verdict:
            continue
        for check, (ok, detail) in verdict["checks"].items():
            t.add_row(name, check, "[green]yes[/]" if ok else "[red]NO[/]", str(detail))
        name = ""
    return t


def tiers_table(receipt: dict[str, Any]) -> Table:
    """drill --tiers: each tier failure, the step it restored, which tier served, its recovery phases."""
    tiers = receipt["tiers"]
    t = Table(title=f"Tier failures (local step {tiers['local_step']}, persistent steps {tiers['persistent_steps']})",
              caption="seconds from the replacement job's launch; bytes summed over processes; recovery = from the "
                      "launch to the end of the first step, without the drill's own validation (end to end includes "
                      "it; the JAX jobs validate after the first step); redo: steps between the restored step and the killed job's "
                      "last, 'back at' = recovery + redo x the training job's median step time (an estimate)",
              title_justify="left", caption_justify="left")
    for col in ("failure", "restored", "local B", "peer B", "persistent B", "ready s", "restore s", "validate s",
                "step s", "end to end s", "recovery s", "redo", "back at s", "ok"):
        t.add_column(col, justify="left" if col == "failure" else "right")
    for name, v in receipt["tiers_verdict"]["verdicts"].items():
        _tier_row(t, name, tiers["scenarios"][name], v)
    return t


def _tier_row(t: Table, name: str, res: dict[str, Any], v: dict[str, Any]) -> None:
    if "skipped" in v:
        t.add_row(name, "skipped", *["-"] * 11, "[yellow]skipped[/]")
        return
    per = res.get("tiers_per_process") or [[0, 0, 0]]
    p = v["phases"]
    t.add_row(name, str(res["restored_step"]), *(f"{sum(x[i] for x in per):,}" for i in range(3)),
              f"{p['launch_to_ready_s']:.2f}", f"{p['restore_s']:.3f}", f"{p['validation_s']:.3f}",
              f"{p['first_step_s']:.3f}", f"{p['end_to_end_s']:.2f}", f"{p['recovery_s']:.2f}",
              str(p.get("steps_redone", "-")),
              f"{p['back_at_kill_step_s']:.2f}" if "back_at_kill_step_s" in p else "-",
              "[green]yes[/]" if v["ok"] else "[red]NO[/]")


def pairs_table(receipt: dict[str, Any]) -> Table:
    """drill --tiers --tier-pairs: each pair's recovery from the own local copies and from the persistent tier."""
    verdict = receipt["tiers_verdict"]
    s = verdict["pairs_summary"]
    t = Table(title=f"Paired recoveries: own local copy against persistent tier ({s['pairs']} pairs, order "
                    f"alternating): local lower in {s['local_lower']} of {s['pairs']}, median difference "
                    f"{s['median_recovery_diff_s']:+.2f} s"
                    + (f" (end to end, with the drill's validation: {s['median_end_to_end_diff_s']:+.2f} s)"
                       if "median_end_to_end_diff_s" in s else ""),
              caption="seconds; recovery = from the launch to the end of the first step, without the drill's own "
                      "validation; difference = local less persistent", title_justify="left", caption_justify="left")
    for col in ("pair", "first", "local: ready s", "restore s", "step s", "recovery s", "persistent: ready s",
                "restore s", "step s", "recovery s", "restore diff s", "recovery diff s", "ok"):
        t.add_column(col, justify="right")
    for r in verdict["pairs"]:
        t.add_row(str(r["pair"]), r["first"], *_pair_phases(r["local"]), *_pair_phases(r["persistent"]),
                  f"{r['restore_diff_s']:+.3f}", f"{r['recovery_diff_s']:+.2f}", "[green]yes[/]" if r["ok"] else "[red]NO[/]")
    return t


def _pair_phases(p: dict[str, Any]) -> list[str]:
    return [f"{p['launch_to_ready_s']:.2f}", f"{p['restore_s']:.3f}", f"{p['first_step_s']:.3f}", f"{p['recovery_s']:.2f}"]


def print_report(receipt: dict[str, Any], console: Console | None = None) -> None:
    c = console
    if c is None:
        c = Console(highlight=False)
        if not c.is_terminal:  # piped or captured: wide enough that the tables do not wrap
            c = Console(highlight=False, width=150)
    facts = receipt["outputs"]["repository"]
    c.print(f"committed steps: {facts['committed_steps']}; saves started but never committed (torn by the kill): "
            f"{facts['torn_save_steps'] or 'none'}; private leftovers: {len(facts['uncommitted_saves'])}")
    c.print(phase_table(receipt))
    c.print(guide_table(receipt))
    c.print(checks_table(receipt))
    if "tiers_verdict" in receipt:
        c.print(tiers_table(receipt))
        if receipt["tiers_verdict"].get("pairs"):
            c.print(pairs_table(receipt))
    verdict = "[bold green]PASS[/]" if receipt["pass"] else "[bold red]FAIL[/]"
    c.print(f"result: {verdict} (every figure of this run: {receipt['receipt_path']})")
    url = receipt.get("inputs", {}).get("storage")
    if url:
        c.print("Next, look at the checkpoints the job left (after make demo the command is .venv/bin/ckptfmt):")
        for cmd in (f"ckptfmt ls {url}", f"ckptfmt inspect {url}", f"ckptfmt verify {url} --all",
                    f"ckptfmt gc {url} --keep-last 1 --dry-run"):
            c.print(f"  {cmd}")
        c.print("and read docs/getting-started.md for the same in your own training loop.")
