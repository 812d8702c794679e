"""Medians, ratios, targets, the text table, the JSON file and the PNG plot."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from . import rotate

# The stated fixed overhead of the peak-RSS targets: thread stacks, allocator arenas,
# tensorstore's and the framework's caches. It comes on top of the RSS the process had
# when the phase began (imports, and for a save the state itself), which is measured
# per run and reported as ``rss_before``.
FIXED_OVERHEAD_BYTES = 64 << 20
#: ckptfmt's save phases (SaveOptions.timings), in the order they run.
_SAVE_PHASES = ("plan", "stage", "write", "fsync", "verify", "state", "ack", "commit")
#: Fields the runner adds to a run to say where it ran (repetition, place after the save), not measurements.
_TAGS = frozenset({"rep", "place"})



def _median(xs: list) -> Any:
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(xs) if xs else None


def summarise(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per system and phase: the median of every numeric field over repetitions."""
    out: dict[str, dict[str, dict]] = {}
    for system, phases in runs.items():
        for phase, reps in phases.items():
            s: dict[str, Any] = {"n": len(reps)}
            fields = sorted({k for r in reps for k, v in r.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _TAGS})
            for f in fields:
                m = _median([r.get(f) for r in reps])
                if m is not None:
                    s[f] = m
            s["rss_extra"] = _median([r["rss_peak"] - r["rss_before"] for r in reps])
            nbytes = s.get("state_bytes") or s.get("bytes_restored")
            if nbytes and s.get("wall_s"):
                s["throughput_Bps"] = nbytes / s["wall_s"]
            for f in ("api", "bytes_read_counted_by"):
                if reps and f in reps[0]:
                    s[f] = reps[0][f]
            won = [r["method_label"] for r in reps if "method_label" in r]  # the raw limit: which writer won
            if won:
                s["method_label"] = ", ".join(f"{k} x{won.count(k)}" if len(set(won)) > 1 else k for k in sorted(set(won)))
            out.setdefault(system, {})[phase] = s
    return out


def balanced_ratio(reps_a: list[dict], reps_b: list[dict]) -> float | None:
    """Restore ``a`` over restore ``b`` of one system with their places after the save balanced.

    Within a repetition the topologies restore one after the other from the same save, and the
    bench alternates which goes first. On a virtual disk the place matters (the restore right
    after another one was the slower of its pair in most repetitions, for every system), so with
    an odd number of repetitions a ratio of medians leans on whichever topology went second more
    often. Here each repetition gives one paired ratio ``a/b``; the pairs where ``a`` went first
    and those where ``b`` did are summarised apart (medians), and the result is the geometric
    mean of the two, in which a place effect that multiplies the time cancels. None unless both
    orders ran."""
    by_rep = {r.get("rep"): r for r in reps_b if r.get("rep") is not None}
    first: list[float] = []
    second: list[float] = []
    for ra in reps_a:
        rb = by_rep.get(ra.get("rep"))
        if rb is None or not ra.get("wall_s") or not rb.get("wall_s") or ra.get("place") == rb.get("place"):
            continue
        (first if ra["place"] < rb["place"] else second).append(ra["wall_s"] / rb["wall_s"])
    if not first or not second:
        return None
    return math.sqrt(statistics.median(first) * statistics.median(second))


def _t(summary: dict, system: str, phase: str) -> float | None:
    return summary.get(system, {}).get(phase, {}).get("wall_s")


def ratios_and_targets(result: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Speed-ups of ckptfmt over each peer and the raw limit, and the issue's targets."""
    o = result.options
    n, summary = o["save_devices"], result.summary
    same = f"restore_{n}to{n}"
    resharded = [f"restore_{n}to{m}" for m in o["restore_devices"] if m != n]
    rs = resharded[0] if resharded else None
    peers = [p for p in summary if p != "raw" and not p.startswith("ckptfmt")]
    ratios: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []

    def speedups(phase: str) -> dict[str, float]:
        ours = _t(summary, "ckptfmt", phase)
        return {p: _t(summary, p, phase) / ours for p in peers if ours and _t(summary, p, phase)}

    def target(name: str, want: str, measured: Any, holds: bool | None) -> None:
        targets.append({"target": name, "want": want, "measured": measured, "holds": holds})

    for phase in ["save", "save_steady", same] + resharded:
        ratios[f"{phase}_speedup_vs"] = speedups(phase)
    two = _t(summary, "ckptfmt_2proc", "save")
    if two:
        ratios["save_2proc_speedup_vs"] = {p: _t(summary, p, "save") / two for p in peers if _t(summary, p, "save")}
    for system in summary:
        if rs and _t(summary, system, rs) and _t(summary, system, same):
            ratios.setdefault("resharded_over_same", {})[system] = _t(summary, system, rs) / _t(summary, system, same)
            runs = result.runs.get(system, {})
            bal = balanced_ratio(runs.get(rs, []), runs.get(same, []))
            if bal is not None:
                ratios.setdefault("resharded_over_same_balanced", {})[system] = bal
    raw_w = summary.get("raw", {}).get("save", {}).get("throughput_Bps")
    raw_r = summary.get("raw", {}).get("restore", {}).get("throughput_Bps")
    ours_w = summary.get("ckptfmt", {}).get("save", {}).get("throughput_Bps")
    if raw_w:
        ratios["save_fraction_of_raw_write"] = {s: summary[s]["save"]["throughput_Bps"] / raw_w for s in summary if s != "raw" and "save" in summary[s]}
    if raw_r:
        ratios["restore_fraction_of_raw_read"] = {
            s: {ph: v["throughput_Bps"] / raw_r for ph, v in summary[s].items() if ph.startswith("restore_") and "throughput_Bps" in v}
            for s in summary
            if s != "raw"
        }

    def best_peer(phase: str) -> tuple[str, float] | None:
        sp = ratios.get(f"{phase}_speedup_vs") or {}
        return min(sp.items(), key=lambda kv: kv[1]) if sp else None

    b = best_peer("save")
    target("fresh-process durable save vs the faster peer", ">= 1.5x", f"{b[1]:.2f}x vs {b[0]}" if b else "n/a",
           b[1] >= 1.5 if b else None)
    frac = ratios.get("save_fraction_of_raw_write", {}).get("ckptfmt")
    target("fresh-process durable save vs raw parallel write throughput", ">= 70%", f"{frac:.0%}" if frac else "n/a",
           frac >= 0.7 if frac else None)
    if "save_steady" in summary.get("ckptfmt", {}):
        b = best_peer("save_steady")
        target("steady-state save (2nd in the process) vs the faster peer's", ">= 1.5x",
               f"{b[1]:.2f}x vs {b[0]}" if b else "n/a", b[1] >= 1.5 if b else None)
    if rs:
        b = best_peer(rs)
        target(f"resharded restore ({rs[8:].replace('to', '->')}) vs the faster peer", ">= 1.25x", f"{b[1]:.2f}x vs {b[0]}" if b else "n/a", b[1] >= 1.25 if b else None)
        r = ratios.get("resharded_over_same", {}).get("ckptfmt")
        bal = ratios.get("resharded_over_same_balanced", {}).get("ckptfmt")
        if bal is not None:  # judged on the place-balanced ratio; the ratio of medians shown beside it
            target("resharded restore / same-topology restore (places balanced)", "<= 1.1x",
                   f"{bal:.2f}x ({r:.2f}x of medians)", bal <= 1.1)
        else:
            target("resharded restore / same-topology restore", "<= 1.1x", f"{r:.2f}x" if r else "n/a", r <= 1.1 if r else None)
    ours = summary.get("ckptfmt", {})
    # Peak RSS: the rise above the phase's start, per run, median. A save starts with the state
    # resident, so it may add 10% of it; a restore starts without it, so it may add 110% of what
    # it restores. Either may add FIXED_OVERHEAD_BYTES on top.
    for phase, nbytes_field, share in [("save", "state_bytes", 0.1), (same, "bytes_restored", 1.1)] + [
            (p, "bytes_restored", 1.1) for p in resharded]:
        s = ours.get(phase)
        if not s or nbytes_field not in s or s.get("rss_extra") is None:
            continue
        limit = share * s[nbytes_field] + FIXED_OVERHEAD_BYTES
        target(
            f"peak RSS during {phase} (rise above the phase start)",
            f"<= {share:g} x {'state' if phase == 'save' else 'bytes restored'} + 64 MiB",
            f"+{s['rss_extra'] / 2**20:,.0f} MiB (limit +{limit / 2**20:,.0f}; peak {s['rss_peak'] / 2**20:,.0f} MiB)",
            s["rss_extra"] <= limit,
        )
    sl = ours.get(f"slice_1of{n}")
    if sl:
        r = sl["bytes_read_per_reader"] / sl["slice_bytes"]
        ratios["slice_read_amplification"] = r
        target(f"bytes read by a 1/{n} slice reader", "<= 1.1x slice", f"{r:.3f}x", r <= 1.1)
    sf = (result.safety or {}).get("ckptfmt")
    if sf:
        target("a 64-byte flip inside tensor data fails the restore", "detected", sf.get("error_type") or sf["outcome"], sf["outcome"] == "detected")
    md = result.metadata or {}
    big = (md.get("ckptfmt") or [{}])[-1]
    if big:
        worst = max(big.get(k, 0) for k in ("write_s", "load_s", "validate_s", "plan_s"))
        target(f"metadata phases at {big.get('entries')} shard entries", "each <= 1 s", f"max {worst:.3f} s", worst <= 1.0)
    if getattr(result, "scaling", None):
        from . import scaling

        scaling.targets(result.scaling, target)
    ours = [r for r in getattr(result, "cadence", None) or [] if r.get("system") == "ckptfmt" and r.get("blocked_over_copy")]
    if ours:
        x = statistics.median(r["blocked_over_copy"] for r in ours)
        b, c = (statistics.median(r[k] for r in ours) for k in ("blocked_ms_median", "copy_ms_median"))
        target("async save under the cadence: caller blocked / host copy of the state", "<= 2x",
               f"{x:.2f}x ({b:.1f} ms / {c:.1f} ms)", x <= 2.0)
    ts_ = result.tailstep or {}
    if ts_.get("blocked_fraction") is not None:
        f = ts_["blocked_fraction"]
        target("async save: caller blocked / sync save time", "<= 10%", f"{f:.1%} ({ts_.get('save_mode')})", f <= 0.10)
    return ratios, targets


def _mib(x: Any) -> str:
    return f"{x / 2**20:,.0f}" if isinstance(x, (int, float)) else "-"


def _mb(x: Any) -> str:
    return f"{x / 1e6:,.2f} MB" if isinstance(x, (int, float)) else "-"


def _s(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def table(result: Any) -> str:
    """The results as a Markdown table plus ratio and target lines."""
    o, summary = result.options, result.summary
    n = o["save_devices"]
    same = f"restore_{n}to{n}"
    resharded = [m for m in o["restore_devices"] if m != n]
    L = result.layout
    what = (f"{L['describe']} = {L['nbytes'] / 2**20:,.0f} MiB, on a (data, model) mesh of {n}" if "recipe" in L else
            f"{L['tensors']} tensors x {L['rows']}x{L['cols']} float32 = {L['nbytes'] / 2**20:,.0f} MiB, sharded by rows over {n}")
    lines = [
        f"State: {what}; medians of {o['repetitions']}; reads {result.cache}. Every run is a fresh process. "
        "Peak RSS is the whole process (summed over ranks for DCP); (+extra) is the rise above the phase's start. "
        "read/reader = bytes the busiest reading process pulled from storage.",
        "",
    ]
    head = ["system", "save s", "save MB/s", "steady save s", f"restore {n}->{n} s"]
    head += [f"restore {n}->{m} s" for m in resharded]
    head += ["save peak RSS MiB (+extra)", f"restore {n}->{resharded[0] if resharded else n} peak RSS MiB (+extra)"]
    head += ["on disk MiB", "objects per save", f"read/reader MiB ({n}->{resharded[0] if resharded else n})"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system, ph in summary.items():
        sv = ph.get("save", {})
        rd = {m: ph.get(f"restore_{n}to{m}") or (ph.get("restore") if system == "raw" else None) or {} for m in o["restore_devices"]}
        last = rd.get(resharded[0] if resharded else n, {})
        label = f"raw (fastest writer: {sv.get('method_label', str(o.get('raw_threads', n)) + ' threads')})" if system == "raw" else system
        row = [label, _s(sv.get("wall_s")), f"{sv['throughput_Bps'] / 1e6:,.0f}" if "throughput_Bps" in sv else "-",
               _s(ph.get("save_steady", {}).get("wall_s")), _s((rd.get(n) or {}).get("wall_s"))]
        row += [_s(rd[m].get("wall_s")) for m in resharded]
        row += [f"{_mib(sv.get('rss_peak'))} (+{_mib(sv.get('rss_extra'))})" if sv else "-"]
        row += [f"{_mib(last.get('rss_peak'))} (+{_mib(last.get('rss_extra'))})" if last else "-"]
        row += [_mib(sv.get("bytes_on_disk")), f"{sv['objects']:,.0f}" if "objects" in sv else "-", _mib(last.get("bytes_read_per_reader"))]
        lines.append("| " + " | ".join(row) + " |")
    sl = summary.get("ckptfmt", {}).get(f"slice_1of{n}")
    if sl:
        lines += ["", f"ckptfmt 1/{n} slice reader: {sl['wall_s']:.3f} s, read {_mib(sl['bytes_read_per_reader'])} MiB for a "
                      f"{_mib(sl['slice_bytes'])} MiB slice (counted by {sl.get('bytes_read_counted_by', 'the reader')})."]
    for phase, ph in summary.get("ckptfmt", {}).items():
        steps = sorted(((k[len("save_t_"):-2], v) for k, v in ph.items() if k.startswith("save_t_")),
                       key=lambda kv: _SAVE_PHASES.index(kv[0]) if kv[0] in _SAVE_PHASES else len(_SAVE_PHASES))
        if steps:
            lines.append(f"ckptfmt {phase} phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in steps))
        parts = [(k[len("reader_t_"):-2], v) for k, v in ph.items() if k.startswith("reader_t_") and k != "reader_t_total_s"]
        if "reader_build_s" in ph:
            parts.append(("build arrays", ph["reader_build_s"]))
        if parts:
            lines.append(f"ckptfmt {phase} inside the reader (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts))
    r = result.ratios
    lines.append("")
    for phase in ["save", "save_steady", same] + [f"restore_{n}to{m}" for m in resharded]:
        sp = r.get(f"{phase}_speedup_vs") or {}
        if sp:
            lines.append(f"ckptfmt {phase} speed-up: " + ", ".join(f"{v:.2f}x vs {k}" for k, v in sp.items()))
    if r.get("save_2proc_speedup_vs"):
        per = summary.get("ckptfmt_2proc", {}).get("save", {})
        lines.append("ckptfmt save from 2 processes x " + f"{n // 2} devices speed-up: "
                     + ", ".join(f"{v:.2f}x vs {k} ({n} ranks)" for k, v in r["save_2proc_speedup_vs"].items()))
    if r.get("save_fraction_of_raw_write"):
        lines.append("save throughput / raw write (its fastest writer): " + ", ".join(f"{k} {v:.0%}" for k, v in r["save_fraction_of_raw_write"].items()))
    if r.get("restore_fraction_of_raw_read"):
        parts = [f"{s} {ph[8:]} {v:.0%}" for s, d in r["restore_fraction_of_raw_read"].items() for ph, v in d.items()]
        lines.append("restore throughput / raw parallel read: " + ", ".join(parts))
    syncs = {s_: ph["save"]["sync_after_s"] for s_, ph in summary.items() if "sync_after_s" in ph.get("save", {})}
    if syncs:
        lines.append("system-wide sync right after the save (data it left unflushed; not in the save time): "
                     + ", ".join(f"{k} {v:.3f} s" for k, v in syncs.items()))
    apis = sorted({v["api"] for v in summary.get("ckptfmt", {}).values() if "api" in v})
    if apis:
        lines.append("ckptfmt driven through: " + ", ".join(apis))
    if r.get("resharded_over_same"):
        lines.append("resharded / same-topology restore (ratio of medians): "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in r["resharded_over_same"].items()))
    if r.get("resharded_over_same_balanced"):
        lines.append("resharded / same-topology restore (places after the save balanced): "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in r["resharded_over_same_balanced"].items()))
    if result.safety:
        lines += ["", "Safety: 64 bytes flipped inside tensor data of each checkpoint, then a restore:"]
        for system, r in result.safety.items():
            what = {"detected": f"detected ({r.get('error_type')})", "silent": "NOT detected: wrong values returned",
                    "missed": "flip hit unused bytes (values correct)"}.get(r["outcome"], r["outcome"])
            lines.append(f"  {system}: {what}; object {r.get('object')}")
    if result.metadata:
        lines += ["", *metadata_lines(result.metadata)]
    if result.tailstep:
        lines += ["", *tailstep_lines(result.tailstep)]
    if getattr(result, "cadence", None):
        from . import tailstep_state

        lines += ["", *tailstep_state.lines(result.cadence)]
    if getattr(result, "scaling", None):
        from . import scaling

        lines += ["", *scaling.lines(result.scaling)]
    if result.targets:
        lines += ["", "| target | want | measured | holds |", "|---|---|---|---|"]
        for t in result.targets:
            h = {True: "yes", False: "NO", None: "n/a"}[t["holds"]]
            lines.append(f"| {t['target']} | {t['want']} | {t['measured']} | {h} |")
    for k, v in result.skipped.items():
        lines.append(f"skipped {k}: {v}")
    for k, v in result.errors.items():
        lines.append(f"FAILED {k}: {v.splitlines()[0]}")
    lines += [f"note: {x}" for x in result.notes]
    return "\n".join(lines)


def metadata_lines(md: dict) -> list[str]:
    out = ["Metadata at scale (seconds; ckptfmt manifest JSON vs DCP pickled Metadata; "
           "load includes full validation; plan save = the 64-writer save plan, plan read = one of 4 readers):", "",
           "| shard entries | tensors x shards | form | ckptfmt bytes | write | load | validate | plan save | plan read | DCP bytes | DCP dump | DCP load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dcp = {d["entries"]: d for d in md.get("dcp", [])}
    for c in md.get("ckptfmt", []):
        d = dcp.get(c["entries"], {})
        out.append(
            f"| {c['entries']:,} | {c['tensors']:,} x {c['shards']} | {c.get('form', '-')} | {_mb(c.get('bytes'))} | {_s(c.get('write_s'))} | {_s(c.get('load_s'))} | "
            f"{_s(c.get('validate_s'))} | {_s(c.get('plan_save_s'))} | {_s(c.get('plan_read_s'))} | {_mb(d.get('bytes')) if d else '-'} | {_s(d.get('dump_s'))} | {_s(d.get('load_s'))} |"
        )
    out += [f"note: {x}" for x in md.get("notes", [])]
    return out


def tailstep_lines(t: dict) -> list[str]:
    b, s = t.get("baseline", {}), t.get("with_saves", {})
    out = [
        f"Training cadence ({t.get('steps')} steps, a save every {t.get('every')} steps, {t.get('save_mode')}; state {_mib(t.get('state_bytes'))} MiB):",
        f"  step time p50 {b.get('p50_ms', 0):.2f} ms -> {s.get('p50_ms', 0):.2f} ms; p99 {b.get('p99_ms', 0):.2f} ms -> {s.get('p99_ms', 0):.2f} ms",
        f"  caller blocked per save: median {t.get('blocked_ms_median', 0):.1f} ms, max {t.get('blocked_ms_max', 0):.1f} ms"
        f" ({t.get('blocked_fraction') or 0:.1%} of a sync save: median {t.get('sync_save_ms_median', 0):.1f} ms)",
        f"  per save: write (to commit) median {t.get('write_ms_median', 0):.1f} ms, {(t.get('bytes_per_save') or 0) / 2**20:.1f} MiB;"
        f" longest wait for the previous save {t.get('waited_ms_max', 0):.1f} ms; {t.get('committed', '-')}/{t.get('saves', '-')} committed",
        f"  recovery-point objective: {t.get('rpo_steps')} steps at risk at most (median {t.get('rpo_steps_median')})",
    ]
    return out + [f"  note: {x}" for x in t.get("notes", [])]


def plot(result: Any, path: Path) -> str | None:
    """Times and peak RSS per system as a PNG (matplotlib, Agg). None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        result.notes.append("matplotlib is not installed: no plot")
        return None
    o, summary = result.options, result.summary
    n = o["save_devices"]
    phases = ["save"] + [f"restore_{n}to{m}" for m in o["restore_devices"]]
    systems = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(phases), 1)
    for j, phase in enumerate(phases):
        def val(s: str, key: str) -> float:
            ph = summary[s].get(phase) or (summary[s].get("restore") if s == "raw" and phase != "save" else None) or {}
            v = ph.get(key)
            return (v or 0) / (2**20 if key == "rss_extra" else 1)

        xs = [i + (j - (len(phases) - 1) / 2) * width for i in range(len(systems))]
        label = "save" if phase == "save" else "restore " + phase[len("restore_"):].replace("to", "->")
        axes[0].bar(xs, [val(s, "wall_s") for s in systems], width, label=label)
        axes[1].bar(xs, [val(s, "rss_extra") for s in systems], width, label=label)
    axes[1].axhline(result.layout["nbytes"] / 2**20, color="grey", linestyle="--", linewidth=1, label="state bytes")
    for ax, title in zip(axes, ["time (s), lower is better (raw: one read, shown for each restore)",
                                "peak RSS above phase start (MiB)"]):
        ax.set_xticks(range(len(systems)), systems)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    L = result.layout
    fig.suptitle(f"ckptfmt bench: {L['nbytes'] / 2**20:,.0f} MiB in {L['tensors']} {'leaves' if 'recipe' in L else 'tensors'}, {n} writers, medians of {o['repetitions']}, {result.cache} reads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def finish(result: Any, out: Path, *, make_plot: bool = True) -> None:
    """Fill summary, ratios, targets and table; write bench.json, bench.md and bench.png."""
    result.summary = summarise(result.runs)
    result.ratios, result.targets = ratios_and_targets(result)
    if make_plot and result.summary:
        result.plot_path = plot(result, out / "bench.png")
    if make_plot and len(getattr(result, "scaling", None) or []) > 1:
        from . import scaling

        scaling.plot(result.scaling, out / "scaling.png")
    result.table = table(result)
    if getattr(result, "rotated", None):
        result.table += "\n" + "\n".join(rotate.lines(result.rotated))
    result.json_path = str(out / "bench.json")
    (out / "bench.md").write_text(result.table + "\n")
    Path(result.json_path).write_text(json.dumps(result.to_json(), indent=1, default=str))
