"""Smoke tests of ``ckptfmt_tools.bench``: it runs end to end at a tiny size and reports sane numbers.

No timing is asserted: the bench measures, the closing note judges.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from ckptfmt_tools.bench import BenchOptions, run_bench
from ckptfmt_tools.bench import runner as bench_runner
from ckptfmt_tools.bench.args import build_parser, options_from_args, parse_size
from ckptfmt_tools.bench.layout import StateLayout, check_rows, rows_data

HAVE_ORBAX = importlib.util.find_spec("orbax") is not None


def test_layout_divides_every_topology_and_data_is_reproducible():
    layout = StateLayout.for_size(8 << 20, 16, (8, 4))
    assert layout.rows % 8 == 0 and layout.rows % 4 == 0
    assert layout.nbytes <= 8 << 20
    r0, r1 = layout.rows_of(1, 4)
    a = rows_data(layout, 3, r0, r1)
    check_rows(layout, 3, r0, r1, a.copy())
    a[0, 0] += 1
    with pytest.raises(AssertionError):
        check_rows(layout, 3, r0, r1, a)


def test_cli_options_parse():
    assert parse_size("64MiB") == 64 << 20 and parse_size("1GiB") == 1 << 30 and parse_size("1000") == 1000
    opts = options_from_args(build_parser().parse_args(["--size", "8MiB", "--restore-devices", "8,2", "--peers", "none", "-r", "2"]))
    assert opts == BenchOptions(size=8 << 20, restore_devices=(8, 2), peers=(), repetitions=2)


def _phase(wall_s: float, **kw) -> dict:
    return {"wall_s": wall_s, "rss_before": 100, "rss_peak": 150, "rss_base": 100} | kw


def test_report_ratios_and_targets_from_synthetic_runs(tmp_path):
    from ckptfmt_tools.bench import report
    from ckptfmt_tools.bench.runner import BenchResult

    gib = 1 << 30
    runs = {
        "raw": {"save": [_phase(1.0, state_bytes=gib)], "restore": [_phase(0.5, bytes_restored=gib)]},
        "ckptfmt": {
            "save": [_phase(1.2, state_bytes=gib), _phase(1.0, state_bytes=gib), _phase(9.0, state_bytes=gib)],
            "save_steady": [_phase(0.8, state_bytes=gib, save_t_write_s=0.7, save_t_fsync_s=0.05)],
            "restore_8to8": [_phase(0.5, bytes_restored=gib)],
            "restore_8to4": [_phase(0.6, bytes_restored=gib)],
            "slice_1of8": [_phase(0.1, bytes_restored=gib // 8, slice_bytes=gib // 8, bytes_read_per_reader=gib // 8 + 4096)],
        },
        "dcp": {"save": [_phase(2.0, state_bytes=gib)], "save_steady": [_phase(1.0, state_bytes=gib)], "restore_8to8": [_phase(0.6)], "restore_8to4": [_phase(0.66)]},
    }
    opts = {"save_devices": 8, "restore_devices": [8, 4], "repetitions": 3}
    r = BenchResult(options=opts, layout={"tensors": 16, "rows": 1, "cols": 1, "nbytes": gib}, cache="cold", runs=runs,
                    summary={}, ratios={}, targets=[], notes=[], skipped={}, errors={})
    report.finish(r, tmp_path, make_plot=False)
    assert r.summary["ckptfmt"]["save"]["wall_s"] == 1.2  # the median, not the outlier
    assert r.ratios["save_speedup_vs"]["dcp"] == pytest.approx(2.0 / 1.2)
    assert r.ratios["save_fraction_of_raw_write"]["ckptfmt"] == pytest.approx(1.0 / 1.2)
    assert r.ratios["resharded_over_same"]["ckptfmt"] == pytest.approx(1.2)
    holds = {t["target"]: t["holds"] for t in r.targets}
    assert holds["fresh-process durable save vs the faster peer"] is True
    assert holds["fresh-process durable save vs raw parallel write throughput"] is True
    assert holds["steady-state save (2nd in the process) vs the faster peer's"] is False  # 1.0 / 0.8 = 1.25x
    assert r.ratios["save_steady_speedup_vs"]["dcp"] == pytest.approx(1.25)
    assert "ckptfmt save_steady phases (median s): write 0.700, fsync 0.050" in r.table
    assert holds["resharded restore (8->4) vs the faster peer"] is False  # 0.66 / 0.6 = 1.1x
    assert holds["resharded restore / same-topology restore"] is False
    assert holds["bytes read by a 1/8 slice reader"] is True
    rss = [t for t in r.targets if t["target"].startswith("peak RSS during save")]
    assert rss and rss[0]["holds"] is True  # +50 bytes above the start
    assert "| ckptfmt | 1.200 | 895 | 0.800 |" in r.table and (tmp_path / "bench.json").exists()


def test_resharded_ratio_balances_the_places_after_the_save(tmp_path):
    """Three repetitions, the second restore of each pair 30% slower whatever its topology, the
    resharded one second in two of them: the ratio of medians says 1.3x (the place), the
    balanced ratio says 1.0x (no resharding cost); a real 20% cost shows in both orders."""
    from ckptfmt_tools.bench import report
    from ckptfmt_tools.bench.runner import BenchResult

    def runs(cost: float) -> dict:
        same, rs = [], []
        for rep, rs_place in enumerate((2, 1, 2)):
            t = {1: 1.0, 2: 1.3}
            same.append(_phase(t[3 - rs_place], rep=rep, place=3 - rs_place))
            rs.append(_phase(t[rs_place] * cost, rep=rep, place=rs_place))
        return {"ckptfmt": {"restore_8to8": same, "restore_8to4": rs}}

    def result(cost: float) -> BenchResult:
        r = BenchResult(options={"save_devices": 8, "restore_devices": [8, 4], "repetitions": 3},
                        layout={"tensors": 1, "rows": 1, "cols": 1, "nbytes": 1}, cache="cold", runs=runs(cost),
                        summary={}, ratios={}, targets=[], notes=[], skipped={}, errors={})
        report.finish(r, tmp_path, make_plot=False)
        return r

    flat = result(1.0)
    assert flat.ratios["resharded_over_same"]["ckptfmt"] == pytest.approx(1.3)
    assert flat.ratios["resharded_over_same_balanced"]["ckptfmt"] == pytest.approx(1.0)
    assert "places after the save balanced): ckptfmt 1.00x" in flat.table
    assert "rep" not in flat.summary["ckptfmt"]["restore_8to8"]  # tags are not measurements
    holds = {t["target"]: t for t in flat.targets}
    assert holds["resharded restore / same-topology restore (places balanced)"]["holds"] is True
    costly = result(1.2)  # the control: a resharding cost the balance must not hide
    assert costly.ratios["resharded_over_same_balanced"]["ckptfmt"] == pytest.approx(1.2)
    assert {t["target"]: t["holds"] for t in costly.targets}["resharded restore / same-topology restore (places balanced)"] is False
    one_order = report.balanced_ratio(runs(1.0)["ckptfmt"]["restore_8to4"][:1], runs(1.0)["ckptfmt"]["restore_8to8"])
    assert one_order is None  # both orders needed: no balance from one


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_end_to_end_tiny(tmp_path, monkeypatch):
    # DCP is skipped here on purpose (spawning gloo ranks costs ~10 s a phase on 2 cores);
    # marking it "not installed" also exercises the skip path.
    real = bench_runner.peer_available
    monkeypatch.setattr(bench_runner, "peer_available", lambda p: "torch is not installed (test)" if p == "dcp" else real(p))
    opts = BenchOptions(
        size=8 << 20,
        repetitions=1,
        output_dir=str(tmp_path / "out"),
        storage=str(tmp_path / "repo"),
        peers=("orbax", "dcp"),
        metadata_entries=(1_000, 10_000),
        dcp_metadata_max_entries=0,
        tailstep_steps=30,
        tailstep_every=10,
    )
    result = run_bench(opts, log=None)

    assert result.errors == {}, result.errors
    assert "dcp" in result.skipped and "skipped dcp" in result.table
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0
    assert doc["cache"] in ("cold", "warm")

    systems = {"raw", "ckptfmt"} | ({"orbax"} if HAVE_ORBAX else set())
    assert set(doc["summary"]) == systems
    assert set(doc["summary"]["raw"]) == {"save", "restore"}
    want = {"save", "save_steady", "restore_8to8", "restore_8to4"}
    assert set(doc["summary"]["ckptfmt"]) == want | {"slice_1of8"}
    assert doc["summary"]["ckptfmt"]["save"]["save_t_write_s"] > 0
    if HAVE_ORBAX:
        assert set(doc["summary"]["orbax"]) == want
    for system, phases in doc["summary"].items():
        for phase, s in phases.items():
            assert s["n"] == 1
            assert s["wall_s"] > 0 and s["rss_peak"] > 0, (system, phase)
            if not phase.startswith("save") and system != "raw":
                assert s["bytes_read_per_reader"] > 0, (system, phase)
    save = doc["summary"]["ckptfmt"]["save"]
    assert save["objects"] > 0 and save["bytes_on_disk"] >= doc["layout"]["nbytes"]
    # every restored byte was compared with the generator
    for m in (8, 4):
        assert doc["runs"]["ckptfmt"][f"restore_8to{m}"][0]["bytes_checked"] == doc["layout"]["nbytes"]
    assert doc["ratios"]["save_fraction_of_raw_write"]["ckptfmt"] > 0
    if HAVE_ORBAX:
        assert doc["ratios"]["save_speedup_vs"]["orbax"] > 0
    assert [(r["rep"], r["place"]) for r in doc["runs"]["ckptfmt"]["restore_8to8"]] == [(0, 1)]
    assert [(r["rep"], r["place"]) for r in doc["runs"]["ckptfmt"]["restore_8to4"]] == [(0, 2)]
    names = [t["target"] for t in doc["targets"]]
    assert any("resharded restore / same" in n for n in names)
    assert any("slice reader" in n for n in names)

    assert doc["safety"]["ckptfmt"]["outcome"] == "detected", doc["safety"]
    md = doc["metadata"]["ckptfmt"]
    assert [r["entries"] for r in md] == [1024, 10048]
    assert all(r[k] > 0 for r in md for k in ("write_s", "load_s", "validate_s", "plan_s"))
    ts = doc["tailstep"]
    assert ts["baseline"]["p50_ms"] > 0 and ts["with_saves"]["p99_ms"] > 0
    assert ts["saves"] == 3 and ts["rpo_steps"] >= 1 and math.isfinite(ts["sync_save_ms_median"])


def test_scaling_targets_and_lines_from_synthetic_rows(tmp_path):
    from ckptfmt_tools.bench import scaling
    from ckptfmt_tools.bench.args import build_parser, options_from_args

    gib = 1 << 30
    rows = [{"bytes": s * gib, "save_s": 1.0 * s, "save_s_per_gib": 1.0, "save_rss_rise": 8 << 20, "restore_s": 0.5 * s,
             "restore_s_per_gib": 0.5, "restore_rss_rise": s * gib + (10 << 20), "save_phases": {}} for s in (1, 2)]
    rows[-1]["save_s_per_gib"] = 1.3  # too slow per GiB at the larger size
    got: list = []
    scaling.targets(rows, lambda name, want, measured, holds: got.append((name, holds)))
    assert dict(got) == {"save s/GiB at 2.00 GiB / at 1.00 GiB": False, "restore s/GiB at 2.00 GiB / at 1.00 GiB": True,
                         "save peak RSS rise at 2.00 GiB vs 1.00 GiB (flat)": True,
                         "restore peak RSS rise - bytes restored, every size": True}
    assert "| 2.00 GiB | 2.000 | 1.300 |" in "\n".join(scaling.lines(rows))
    assert scaling.plot(rows, tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 0
    opts = options_from_args(build_parser().parse_args(["--sizes", "1GiB,2GiB", "--two-process", "--no-steady"]))
    assert opts.sizes == (gib, 2 * gib) and opts.two_process and not opts.steady


def test_cli_rotate_options_parse():
    opts = options_from_args(build_parser().parse_args(["--rotate", "--save-cache", "sync", "--peers", "none"]))
    assert opts == BenchOptions(rotate=True, save_cache="sync", peers=())
    assert options_from_args(build_parser().parse_args([])).save_cache == "drop"
    with pytest.raises(SystemExit):  # only the two modes
        build_parser().parse_args(["--rotate", "--save-cache", "warm"])


def test_rotated_analysis_pairs_each_repetition_with_its_faster_peer():
    from ckptfmt_tools.bench import rotate

    def run(wall_s: float, rep: int, place: int) -> dict:
        return _phase(wall_s, rep=rep, place=place)

    runs = {
        "raw": {"save": [run(0.1, 0, 0)]},
        "ckptfmt": {"save": [run(1.0, 0, 1), run(3.0, 1, 3), run(1.0, 2, 2)]},
        "orbax": {"save": [run(2.0, 0, 2), run(2.0, 1, 1), run(4.0, 2, 3)]},
        "dcp": {"save": [run(4.0, 0, 3), run(6.0, 1, 2)]},  # its rep 2 failed: orbax alone is the peer there
    }
    a = rotate.analyse(runs, ["save", "restore_8to4"])["save"]
    assert [(r["faster_peer"], r["ratio"]) for r in a["repetitions"]] == [("orbax", 0.5), ("orbax", 1.5), ("orbax", 0.25)]
    assert a["ratio"] == {"median": 0.5, "min": 0.25, "max": 1.5, "n": 3, "lost": 1}
    assert a["by_place"]["ckptfmt"] == {1: 1.0, 2: 1.0, 3: 3.0} and "raw" not in a["by_place"]
    text = "\n".join(rotate.lines({"repetitions": 3, "save_cache": "sync", "reads": "cold",
                                   "phases": rotate.analyse(runs, ["save", "restore_8to4"])}))
    assert "median 0.50 (min 0.25, max 1.50); ckptfmt slower than the faster peer in 1 of 3" in text
    assert "rep 2: ckptfmt 3.000 [3]  orbax 2.000 [1]  dcp 6.000 [2]  ckptfmt / orbax 1.50" in text
    assert "restore_8to4" not in text  # no rows, no lines


def test_raw_limit_is_its_fastest_writer(tmp_path):
    from ckptfmt_tools.bench import raw

    layout = StateLayout.for_size(1 << 20, 2, (2,))
    out = raw.write({"layout": layout.to_json(), "writers": 2, "path": str(tmp_path / "raw"), "threads": 2})
    ph = out["phase"]
    assert set(ph["methods"]) == set(raw.WRITERS)
    timed = {k: v for k, v in ph["methods"].items() if isinstance(v, float)}
    assert "threads" in timed and ph["method"] == min(timed, key=timed.get) and ph["wall_s"] == timed[ph["method"]]
    assert out["disk"]["bytes_on_disk"] == layout.nbytes  # the threads writer's shard files are what is read back
    back = raw.read({"path": str(tmp_path / "raw"), "readers": 2, "threads": 2})
    assert back["phase"]["bytes_restored"] == layout.nbytes


def test_bench_rotated_tiny(tmp_path):
    opts = BenchOptions(size=4 << 20, repetitions=1, output_dir=str(tmp_path / "out"), storage=str(tmp_path / "repo"),
                        peers=(), raw=False, restore_devices=(8,), rotate=True, save_cache="sync", safety=False,
                        metadata=False, tailstep=False, plot=False)
    result = run_bench(opts, log=None)
    assert result.errors == {}, result.errors
    assert [(r["rep"], r["place"]) for r in result.runs["ckptfmt"]["save"]] == [(0, 1)]
    assert [(r["rep"], r["place"]) for r in result.runs["ckptfmt"]["restore_8to8"]] == [(0, 1)]
    assert "save_steady" not in result.runs["ckptfmt"]
    assert result.rotated["save_cache"] == "sync" and result.rotated["phases"]["save"]["ratio"] is None
    assert "Rotated harness: 1 repetitions" in result.table and "rep 1: ckptfmt" in result.table
    assert not any((tmp_path / "repo").rglob("*.json"))  # every checkpoint removed when its repetition ended


def test_inode_churn_keys_layout_is_a_real_saves_and_flat_makes_fewer(tmp_path):
    """The churn tool's ``keys`` layout makes the same files and folders as a real ckptfmt save of
    the cadence state's shapes (so its figures speak of ckptfmt's layout); ``flat`` makes fewer.
    Control: a save of other shapes (one more 2-D tensor) makes a different count."""
    import numpy as np

    import ckptfmt
    from ckptfmt import LocalShard
    from devtools import inode_churn

    def saved(arrays):
        url = tmp_path / f"repo{len(arrays)}"
        shards = []
        for i, (ndim, nbytes) in enumerate(arrays):
            shape = (nbytes // 4 // 1024, 1024) if ndim == 2 else (nbytes // 4,)
            a = np.zeros(shape, np.float32)
            shards.append(LocalShard(f"t{i:02d}", a.shape, a.dtype, ckptfmt.Box.full(a.shape), a))
        ckptfmt.save(str(url), 1, shards, state={"step": 1}, options=ckptfmt.SaveOptions(reuse="off", layout="arrays"))
        (save,) = (url / "saves").iterdir()
        return inode_churn.inodes(str(save))

    run = inode_churn.run(str(tmp_path / "churn"), rounds=2, block=2, pause_s=0.0, log=None)
    assert run["inodes"]["keys"] == saved(inode_churn.ARRAYS)
    assert saved(inode_churn.ARRAYS + ((2, 4 << 20),)) != run["inodes"]["keys"]
    assert run["inodes"]["flat"] < run["inodes"]["keys"]
    assert all(len(v["save_cpu"]) == 2 and len(v["delete_cpu"]) == 0 for v in run["rounds"].values())
    assert not (tmp_path / "churn").exists()


def test_save_cpu_measures_each_system_with_and_without_retention(tmp_path):
    """The save-CPU tool runs every system in its own process and measures every save; ckptfmt's
    row keeps two steps (retention on), its ``-nokeep`` row keeps them all (retention off), DCP's
    keeps two. Control: a system the tool does not know is refused, and the figures of the two
    ckptfmt rows come from different runs (the counts left differ as the modes say)."""
    from devtools import save_cpu

    saves = 3
    rows = save_cpu.compare(save_cpu.SYSTEMS, saves=saves, pause_s=0.0, storage=str(tmp_path / "s"),
                            model={"hidden": 32, "layers": 1, "batch": 4}, log=None)
    by = {r["system"]: r for r in rows}
    assert set(by) == set(save_cpu.SYSTEMS) and not any("error" in r for r in rows), rows
    assert by["ckptfmt"]["left"] == 2 and by["dcp"]["left"] == 2 and by["ckptfmt-nokeep"]["left"] == saves + 1
    for r in rows:
        assert all(len(r[k]) == saves for k in ("user", "sys", "caller", "wall")), r
        assert all(u + s > 0 for u, s in zip(r["user"], r["sys"])) and all(w > 0 for w in r["wall"])
        assert save_cpu.line(r).startswith(f"| {r['system']} | 0 | ")
    assert not any((tmp_path / "s").iterdir())  # every run's checkpoints removed
    with pytest.raises(ValueError, match="systems must be among"):
        save_cpu.compare(("ckptfmt", "tensorflow"), saves=1, log=None)
