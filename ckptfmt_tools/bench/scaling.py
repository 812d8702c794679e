"""Scaling (``--sizes 1GiB,2GiB,4GiB,8GiB``): ckptfmt's save and restore at several state sizes.

For each size one fresh-process save from N devices and one fresh-process restore onto N
devices (page cache dropped first where the OS allows it), each once: seconds per GiB, and the
peak-RSS rise of each phase above its start. Targets (issue 17): seconds per GiB at the largest
size within 1.2x of the smallest size's, for save and for restore; the save's RSS rise flat (at
most the smallest size's rise + 64 MiB); the restore's rise at most the bytes restored + 64 MiB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .jaxstate import xla_env
from .layout import StateLayout

GIB = 1 << 30
SLACK = 64 << 20


def run(session: Any, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """One save and one restore per size (``session``: the runner's _Session); rows in size order.
    A failed run is recorded in ``session.errors`` and ends the scaling runs."""
    o = session.o
    n = o.save_devices
    rows: list[dict[str, Any]] = []
    for size in sorted(sizes):
        layout = StateLayout.for_size(size, o.tensors, (n,))
        p = {"layout": layout.to_json(), "check": False, "url": session.urls["ckptfmt"].rstrip("/") + "-scaling",
             "api": o.ckptfmt_api, "steady": False}
        session.log(f"scaling: {layout.nbytes / GIB:.2f} GiB")
        try:
            session.clear_url(p["url"])
            sv = session.child("ckptfmt_tools.bench.ours:save", p | {"devices": n}, xla_env(n))["phase"]
            session.before_read()
            rs = session.child("ckptfmt_tools.bench.ours:restore", p | {"devices": n}, xla_env(n))["phase"]
        except Exception as e:  # noqa: BLE001 -- recorded; the main results still count
            session.errors["scaling"] = f"{layout.nbytes} bytes: {e}"
            session.log(f"scaling FAILED: {str(e).splitlines()[0]}")
            break
        finally:
            session.clear_url(p["url"])
        gib = layout.nbytes / GIB
        rows.append({"bytes": layout.nbytes, "save_s": sv["wall_s"], "save_s_per_gib": sv["wall_s"] / gib,
                     "save_rss_rise": sv["rss_peak"] - sv["rss_before"], "restore_s": rs["wall_s"],
                     "restore_s_per_gib": rs["wall_s"] / gib, "restore_rss_rise": rs["rss_peak"] - rs["rss_before"],
                     "save_phases": {k[7:-2]: v for k, v in sv.items() if k.startswith("save_t_")}})
        session.log(f"scaling {gib:.2f} GiB: save {sv['wall_s']:.3f} s, restore {rs['wall_s']:.3f} s")
    return rows


def targets(rows: list[dict[str, Any]], target: Callable[[str, str, Any, bool | None], None]) -> None:
    if len(rows) < 2:
        return
    a, b = rows[0], rows[-1]
    big, small = _size(b["bytes"]), _size(a["bytes"])
    for what in ("save", "restore"):
        r = b[f"{what}_s_per_gib"] / a[f"{what}_s_per_gib"]
        target(f"{what} s/GiB at {big} / at {small}", "<= 1.2x", f"{r:.2f}x", r <= 1.2)
    rise = b["save_rss_rise"] - a["save_rss_rise"]
    target(f"save peak RSS rise at {big} vs {small} (flat)", "<= +64 MiB",
           f"{rise / 2**20:+,.0f} MiB ({b['save_rss_rise'] / 2**20:,.0f} vs {a['save_rss_rise'] / 2**20:,.0f})", rise <= SLACK)
    worst = max(r["restore_rss_rise"] - r["bytes"] for r in rows)
    target("restore peak RSS rise - bytes restored, every size", "<= 64 MiB", f"{worst / 2**20:+,.0f} MiB", worst <= SLACK)


def _size(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.0f} MiB"


def lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["Scaling (ckptfmt, one fresh-process save and restore per size):", "",
           "| state | save s | save s/GiB | save RSS rise MiB | restore s | restore s/GiB | restore RSS rise MiB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {_size(r['bytes'])} | {r['save_s']:.3f} | {r['save_s_per_gib']:.3f} | "
                   f"{r['save_rss_rise'] / 2**20:,.0f} | {r['restore_s']:.3f} | {r['restore_s_per_gib']:.3f} | "
                   f"{r['restore_rss_rise'] / 2**20:,.0f} |")
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    """Seconds per GiB and RSS rise against state size (matplotlib, Agg); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [r["bytes"] / GIB for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(xs, [r["save_s_per_gib"] for r in rows], "o-", label="save")
    axes[0].plot(xs, [r["restore_s_per_gib"] for r in rows], "s-", label="restore")
    axes[0].set_title("seconds per GiB (lower is better)", fontsize=10)
    axes[1].plot(xs, [r["save_rss_rise"] / 2**20 for r in rows], "o-", label="save")
    axes[1].plot(xs, [r["restore_rss_rise"] / 2**20 for r in rows], "s-", label="restore")
    axes[1].plot(xs, [x * 1024 for x in xs], ":", color="grey", label="bytes restored")
    axes[1].set_title("peak RSS rise above the phase start (MiB)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("state (GiB)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.suptitle("ckptfmt scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
