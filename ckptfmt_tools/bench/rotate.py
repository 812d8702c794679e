"""``ckptfmt bench --rotate``: the systems back to back in rotated order, judged by paired ratios.

Each repetition:

1. every system's checkpoint of the previous repetition is removed, and the disk synced;
2. the raw limit (unless ``--no-raw``) writes and reads its files, which are then removed and
   synced, so that it is the same distance from every system's save;
3. ckptfmt and each peer save, one after another, in an order rotated by one place per
   repetition, each in a fresh process, with the page cache synced (``--save-cache sync``: a
   training job's warm cache) or synced and dropped (``drop``) before each save, and every
   checkpoint left on disk until the repetition ends;
4. each of them restores (every topology of ``--restore-devices``) in the same order, the page
   cache dropped before each read where the OS allows it (not with ``--warm``).

The report gives every repetition's seconds with each system's place in the order, the paired
ratio ckptfmt / the faster peer of that repetition, the median and range of those ratios, how
many repetitions ckptfmt lost, and each system's median by place, so that a result that depends
on what ran before it shows as such.
"""
from __future__ import annotations

import os
import shutil
import statistics
from typing import Any

from .child import drop_page_cache

SAVE_CACHE_MODES = ("sync", "drop")


def prepare_save(mode: str) -> str:
    """Sync the page cache, and drop it with ``drop`` (needs root): what was done ("drop" or "sync")."""
    os.sync()
    return "drop" if mode == "drop" and drop_page_cache() else "sync"


def repetition(s: Any, rep: int) -> None:
    """One rotated repetition of the bench session ``s`` (:class:`ckptfmt_tools.bench.runner._Session`)."""
    o, n = s.o, s.o.save_devices
    systems = [x for x in s.systems if x != "raw"]
    for x in s.systems:
        s.clear(x)
    os.sync()
    if "raw" in s.systems:
        _raw(s, rep)
    k = rep % len(systems) if systems else 0
    order = systems[k:] + systems[:k]
    saved = []
    for place, system in enumerate(order, 1):
        done = prepare_save(o.save_cache)
        if done != o.save_cache and "page cache could not be dropped before saves: synced only" not in s.notes:
            s.notes.append("page cache could not be dropped before saves: synced only")
        save = s.tasks(system, steady=False)[1]
        if s.record(system, "save", lambda: s.child(*save), rep=rep, place=place):
            saved.append(system)
    for place, system in enumerate(order, 1):
        if system not in saved:
            continue
        restore = s.tasks(system, steady=False)[2]
        for m in o.restore_devices:
            s.before_read()
            s.record(system, f"restore_{n}to{m}", lambda m=m: s.child(*restore(m)), rep=rep, place=place)
    for x in s.systems:
        s.clear(x)
    os.sync()


def _raw(s: Any, rep: int) -> None:
    n = s.o.save_devices
    prepare_save(s.o.save_cache)
    if s.record("raw", "save", lambda: s.child("ckptfmt_tools.bench.raw:write", s.raw_params()), rep=rep, place=0):
        s.before_read()
        s.record("raw", "restore", lambda: s.child("ckptfmt_tools.bench.raw:read", {
            "path": s.paths["raw"], "readers": n, "threads": s.o.raw_threads}), rep=rep, place=0)
    shutil.rmtree(s.paths["raw"], ignore_errors=True)
    os.sync()


def _spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def analyse(runs: dict[str, dict[str, list[dict]]], phases: list[str]) -> dict[str, Any]:
    """Per phase: each repetition's seconds and places, the paired ratios ckptfmt / faster peer
    (median, min, max, repetitions lost), and each system's median seconds by place."""
    peers = [x for x in runs if x not in ("raw", "ckptfmt") and not x.startswith("ckptfmt_")]
    out: dict[str, Any] = {}
    for phase in phases:
        reps: dict[int, dict[str, dict]] = {}
        for system in ["ckptfmt"] + peers:
            for r in runs.get(system, {}).get(phase, []):
                if "rep" in r:
                    reps.setdefault(r["rep"], {})[system] = {"wall_s": r["wall_s"], "place": r.get("place")}
        rows, ratios = [], []
        for rep in sorted(reps):
            row: dict[str, Any] = {"rep": rep, "systems": reps[rep]}
            there = [p for p in peers if p in reps[rep]]
            if "ckptfmt" in reps[rep] and there:
                best = min(there, key=lambda p: reps[rep][p]["wall_s"])
                row |= {"faster_peer": best, "ratio": reps[rep]["ckptfmt"]["wall_s"] / reps[rep][best]["wall_s"]}
                ratios.append(row["ratio"])
            rows.append(row)
        by_place: dict[str, dict[int, float]] = {}
        for system in ["ckptfmt"] + peers:
            places: dict[int, list[float]] = {}
            for row in rows:
                v = row["systems"].get(system)
                if v and v["place"] is not None:
                    places.setdefault(v["place"], []).append(v["wall_s"])
            if places:
                by_place[system] = {p: statistics.median(v) for p, v in sorted(places.items())}
        spread = _spread(ratios)
        if spread:
            spread["lost"] = sum(1 for x in ratios if x > 1.0)
        out[phase] = {"repetitions": rows, "ratio": spread, "by_place": by_place}
    return out


def lines(rotated: dict[str, Any]) -> list[str]:
    """The rotated harness's report lines (Markdown-friendly)."""
    out = ["", f"Rotated harness: {rotated['repetitions']} repetitions, the order rotated by one place each; every "
                f"checkpoint left on disk until its repetition ends; before each save the page cache was "
                f"{ {'drop': 'synced and dropped', 'sync': 'synced only'}[rotated['save_cache']] }; reads {rotated['reads']}."]
    for phase, a in rotated["phases"].items():
        if not a["repetitions"]:
            continue
        out.append(f"{phase} per repetition (seconds, [place in the order]):")
        for row in a["repetitions"]:
            cells = "  ".join(f"{k} {v['wall_s']:.3f} [{v['place']}]" for k, v in row["systems"].items())
            ratio = f"  ckptfmt / {row['faster_peer']} {row['ratio']:.2f}" if "ratio" in row else ""
            out.append(f"  rep {row['rep'] + 1}: {cells}{ratio}")
        r = a["ratio"]
        if r:
            out.append(f"{phase} paired ratio ckptfmt / faster peer: median {r['median']:.2f} (min {r['min']:.2f}, "
                       f"max {r['max']:.2f}); ckptfmt slower than the faster peer in {r['lost']} of {r['n']} repetitions")
        if a["by_place"]:
            out.append(f"{phase} median seconds by place: " + "; ".join(
                f"{k} " + ", ".join(f"{p}: {v:.3f}" for p, v in places.items()) for k, places in a["by_place"].items()))
    return out
