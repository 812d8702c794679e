"""The restore drill end to end (real processes, SIGKILL, new topology), plus its judge's controls."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from ckptfmt.errors import CheckpointError
from ckptfmt_tools.drill import DrillConfig, main
from ckptfmt_tools.drill import _judge

SMALL = ["--d-in", "16", "--hidden", "64", "--cadence", "3", "--step-time", "0.03", "--timeout", "180"]


def _load(out) -> dict:
    return json.loads((out / "receipt.json").read_text())


def _assert_receipt(r: dict, *, framework: str, control: bool) -> None:
    assert r["pass"], json.dumps(r.get("outputs", {}).get("continuation"), indent=1)
    out = r["outputs"]
    # The kill landed on a non-save step after the first commit; the newest commit was restored.
    assert out["kill"]["signal"] == "SIGKILL" and out["kill"]["victim_rc"] == -9
    repo = out["repository"]
    assert repo["latest"] == r["replacement"]["restored_step"] <= out["kill"]["step"]
    assert repo["latest"] % r["inputs"]["cadence"] == 0
    cont = out["continuation"]
    assert cont["checks"]["batch_ids"][0] and cont["checks"]["loss"][0] and cont["checks"]["state_hashes"][0]
    assert cont["loss_rel_diff"] <= cont["loss_rtol"]
    assert r["replacement"]["framework"] == framework
    # The phase table covers the whole recovery: its rows add up to the end-to-end time.
    phases = out["phases"]
    names = [p["phase"] for p in phases]
    for want in ("detection", "provisioning: framework init", "manifest load", "validation: state hashes",
                 "first successful step", "end-to-end recovery"):
        assert want in names
    total = phases[-1]["seconds"]
    assert abs(sum(p["seconds"] for p in phases[:-1]) - total) < 1e-6
    assert 0 <= phases[0]["seconds"] < 5 and total > 0
    # The guide's table: control, required ("exact"), rejected.
    guide = out["guide_table"]
    assert [g["choice"] for g in guide] == (["Control"] if control else []) + ["Required", "Reject"]
    assert guide[-2]["evidence"].endswith("· exact")
    assert guide[-1]["evidence"] == "rejected, no state exposed"
    # The rejected control: typed error, nothing exposed, the original intact.
    rc = r["rejected_control"]
    assert rc["raised"] == "MissingShardError" and rc["exposed"] is False and rc["live_state_unchanged"]
    assert rc["original_intact"] and rc["verdict"]["ok"]
    # Inputs, outputs and the rejected control side by side.
    assert {"inputs", "outputs", "rejected_control"} <= set(r)


@pytest.mark.multiprocess
def test_drill_jax_cli(tmp_path, capsys):
    out = tmp_path / "drill"
    code = main(SMALL + ["--out", str(out), "--seed", "5", "--capacity-delay", "0.5"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Where the recovery time went" in printed and "end-to-end recovery" in printed
    assert "ckptfmt ls " in printed and "ckptfmt verify " in printed  # what to try next
    assert "Three restores" in printed and "rejected, no state exposed" in printed and "PASS" in printed
    r = _load(out)
    _assert_receipt(r, framework="jax", control=True)
    assert r["outputs"]["control"]["ok"]
    # 8 -> 4: one process reads everything; 8 -> 8: each of the two processes reads its half.
    per = r["outputs"]["bytes_read_per_reader"]
    assert len(per["replacement"]) == 1 and len(per["control"]) == 2
    assert max(per["control"]) < per["replacement"][0]
    wait = next(p for p in r["outputs"]["phases"] if p["phase"] == "replacement capacity wait")
    assert wait["seconds"] >= 0.5 and r["outputs"]["recovery_s"] > 0.5


@pytest.mark.multiprocess
def test_drill_torch_replacement(tmp_path, capsys):
    out = tmp_path / "drill-torch"
    storage = tmp_path / "elsewhere" / "repo"
    code = main(SMALL + ["--out", str(out), "--seed", "2", "--replacement", "torch", "--no-control",
                         "--storage", str(storage)])
    assert code == 0, capsys.readouterr().out
    r = _load(out)
    _assert_receipt(r, framework="torch", control=False)
    assert len(r["outputs"]["bytes_read_per_reader"]["replacement"]) == 4
    assert r["inputs"]["dropout"] == 0.0  # torch cannot replay JAX dropout masks
    assert r["inputs"]["storage"] == str(storage) and (storage / "manifests").is_dir()


# ------------------------------------------------------------- the judge's broken controls


def _fake_receipt() -> dict:
    ref = {"4": {"loss": 0.5, "ids": [1, 2, 3]}, "5": {"loss": 0.4, "ids": [4, 5, 6]}}
    result = {"restored_step": 3, "loss": 0.5, "ids": [1, 2, 3], "loss_rtol": 1e-6,
              "hashes": {"exact": True, "leaves": 7, "differ": []}}
    return {"ref": ref, "result": result}


def test_judge_accepts_a_matching_continuation():
    f = _fake_receipt()
    assert _judge.continuation(f["result"], f["ref"], 3)["ok"]


@pytest.mark.parametrize("break_it", ["ids", "loss", "hashes", "stale_step", "no_reference"])
def test_judge_rejects_a_broken_continuation(break_it):
    f = _fake_receipt()
    res, ref, latest = copy.deepcopy(f["result"]), f["ref"], 3
    if break_it == "ids":
        res["ids"] = [1, 3, 2]  # a shuffled data cursor
    elif break_it == "loss":
        res["loss"] = 0.5 * (1 + 1e-5)  # outside the 1e-6 tolerance
    elif break_it == "hashes":
        res["hashes"] = {"exact": False, "leaves": 7, "differ": ["optimizer/opt_state/1/0/mu/l1/kernel"]}
    elif break_it == "stale_step":
        latest = 6  # restored an older step than the newest committed one
    elif break_it == "no_reference":
        ref = {}
    assert not _judge.continuation(res, ref, latest)["ok"]


@pytest.mark.parametrize("break_it", ["no_error", "exposed", "changed", "original_damaged"])
def test_judge_rejects_a_broken_rejected_control(break_it):
    good = {"raised": "MissingShardError", "exposed": False, "live_state_unchanged": True,
            "live_state_leaves": 3, "original_intact": True, "original_verified_bytes": 10}
    assert _judge._rejected(good)["ok"]
    bad = dict(good)
    if break_it == "no_error":
        bad["raised"] = None
    elif break_it == "exposed":
        bad["exposed"] = True
    elif break_it == "changed":
        bad["live_state_unchanged"] = False
    else:
        bad.update(original_intact=False, original_error="ChecksumMismatchError")
    assert not _judge._rejected(bad)["ok"]


def test_config_rejects_bad_windows():
    with pytest.raises(ValueError):
        DrillConfig(cadence=5, kill_window=(3, 4)).check()  # before the first save
    with pytest.raises(ValueError):
        DrillConfig(cadence=5, kill_window=(10, 10)).check()  # only a save step
    with pytest.raises(ValueError):
        DrillConfig(train_mesh="3x2").check()
    with pytest.raises(ValueError):
        DrillConfig(tier_pairs=2).check()  # pairs need --tiers
    DrillConfig(tiers=True, tier_pairs=2).check()
    with pytest.raises(ValueError, match="--local-dir goes with --tiers"):
        DrillConfig(local_parent="/").check()
    with pytest.raises(ValueError, match="not a directory"):
        DrillConfig(tiers=True, local_parent="/nonexistent/ckptfmt").check()
    DrillConfig(tiers=True, local_parent="/").check()
    DrillConfig().check()


def test_import_loads_no_framework():
    code = ("import sys, ckptfmt_tools.drill, ckptfmt_tools.drill._run, ckptfmt_tools.drill._judge, ckptfmt_tools.drill._report; "
            "bad = [m for m in ('jax', 'torch', 'flax') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tier_drill_expects_a_step_a_holder_s_replica_completes(tmp_path):
    """drill --tiers: a host killed before its own local save of step 15 committed leaves step 15
    restorable when its holder committed it (the replica serves that host's boxes); the drill must
    expect 15, not the newest step every tier lists. Control: without the holder's copy, 10."""
    import numpy as np

    from ckptfmt import Box
    from ckptfmt.manager._tiers import write_local_step
    from ckptfmt.repository import Repository
    from ckptfmt_tools.drill._tiers import _newest_local

    box = ("w", (4,), np.dtype(np.float32), Box((0,), (4,)), np.zeros(4, np.float32))

    def local(host: int, step: int) -> None:
        write_local_step(Repository(str(tmp_path / f"host-{host}")), step, host, 2, f"n-{step}",
                         [(host, box), ((host + 1) % 2, box)], {}, None)

    for h in (0, 1):
        local(h, 10)
    local(0, 15)  # host 1 was killed before its own step 15 committed; host 0 holds host 1's boxes
    assert _newest_local(str(tmp_path), 2) == (15, "n-15")
    Repository(str(tmp_path / "host-0")).delete(15)  # the control: no tier holds step 15 at all
    assert _newest_local(str(tmp_path), 2) == (10, "n-10")
    local(1, 15)  # host 1 alone: its own boxes, and host 0's, which host 1 (= 0 - 1 mod 2) replicates
    assert _newest_local(str(tmp_path), 2) == (15, "n-15")


def test_the_corrupt_scenario_is_skipped_when_no_box_has_two_local_copies(tmp_path):
    """The kill can land while the victim's own local save of the newest local step is in flight:
    its holder committed the step (with the victim's replica), the victim did not. No box of that
    step then has a second local copy, so the corrupt scenario cannot show the next tier serving
    it: the drill skips it and says why, and the judge reports it as skipped. Control: once the
    victim's own step committed, the scenario flips a byte of the victim's own box."""
    import numpy as np

    from ckptfmt import Box
    from ckptfmt.manager._tiers import write_local_step
    from ckptfmt.repository import Repository
    from ckptfmt_tools.drill._tiers import _damage, judge_tiers, local_dir

    box = ("w", (4,), np.dtype(np.float32), Box((0,), (4,)), np.arange(4, dtype=np.float32))

    def local(host: int, step: int) -> None:
        write_local_step(Repository(os.path.join(local_dir(str(tmp_path)), f"host-{host}")), step, host, 2,
                         f"n-{step}", [(host, box), ((host + 1) % 2, box)], {}, None)

    local(0, 15)
    note = _damage("corrupt", str(tmp_path), 1, 15)
    assert "skipped" in note and "host 1's own local save" in note["skipped"]
    v = judge_tiers({"local_step": 15, "local_token": "n-15", "persistent_steps": [10],
                     "scenarios": {"corrupt": {**note, "scenario": "corrupt"}}}, _fake_receipt()["ref"])
    assert v["ok"] and v["verdicts"]["corrupt"]["skipped"] == note["skipped"]
    local(1, 15)  # the control: host 1's own copy exists, so its box is corrupted
    note = _damage("corrupt", str(tmp_path), 1, 15)
    assert "skipped" not in note and note["damage"].startswith("one byte flipped in host 1's own box h1/")
    with pytest.raises(CheckpointError):
        Repository(os.path.join(local_dir(str(tmp_path)), "host-1")).verify(15)


@pytest.mark.multiprocess
def test_drill_tiers_with_a_local_dir_leaves_nothing_there(tmp_path, capsys):
    """drill --tiers --local-dir: the local tiers live in a new directory under the one given (as
    /dev/shm would be), every scenario and pair passes, and the drill removes that directory at
    the end, leaving the rest of the given directory alone."""
    fast = tmp_path / "fast"
    fast.mkdir()
    (fast / "keep-me").write_text("not the drill's")
    out = tmp_path / "drill-tiers"
    code = main(SMALL + ["--out", str(out), "--seed", "5", "--no-control", "--tiers", "--tier-pairs", "1",
                         "--local-dir", str(fast)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    r = _load(out)
    assert r["inputs"]["local_tier_dir"].startswith(str(fast) + os.sep)
    assert r["tiers_verdict"]["ok"] and len(r["tiers_verdict"]["pairs"]) == 1
    phases = [v["phases"] for v in r["tiers_verdict"]["verdicts"].values() if "phases" in v]
    assert phases and all(p["validated_after_step"] and p["first_step_s"] > 0 for p in phases)  # the JAX jobs' order
    assert sorted(os.listdir(fast)) == ["keep-me"]
    assert not (out / "local").exists()  # nothing under the output directory either


def _tier_result(scenario: str, step: int, restore_s: float, extra: float = 0.0) -> dict:
    f = _fake_receipt()["result"]
    served = [0, 0, 100] if scenario == "all-lost" else [100, 0, 0]
    return dict(f, restored_step=step, scenario=scenario, tiers_per_process=[served], tokens_per_process=["n-3"],
                t_launch=0.0, t_ready=1.0, t_setup=1.1, t_restored=1.1 + restore_s, t_valid=3.1 + restore_s,
                t_step=3.6 + restore_s + extra)


def test_tier_pairs_are_judged_and_their_recovery_leaves_out_the_drill_s_validation():
    """drill --tiers --tier-pairs: each pair's two jobs are judged like the scenarios; the recovery
    is end to end less the drill's own validation, and the summary counts the pairs where the own
    local copy recovered sooner. Controls: a pair whose local job read the persistent tier, and a
    pair without its persistent half, fail the verdict."""
    from ckptfmt_tools.drill._tiers import judge_tiers

    ref = _fake_receipt()["ref"]
    scen = {"killed": _tier_result("killed", 3, 0.2), "all-lost": _tier_result("all-lost", 3, 0.9)}
    pairs = []
    for i, (local_s, pers_s, extra) in enumerate([(0.2, 0.9, 0.0), (0.3, 0.8, 1.0), (0.2, 1.0, 0.0)]):
        pair = [dict(_tier_result("killed", 3, local_s, extra), pair=i), dict(_tier_result("all-lost", 3, pers_s), pair=i)]
        pairs += pair if i % 2 == 0 else pair[::-1]  # the order the drill runs them in
    tiers = {"local_step": 3, "local_token": "n-3", "persistent_steps": [3], "scenarios": scen, "pairs": pairs}
    v = judge_tiers(tiers, ref)
    assert v["ok"], v
    k = v["verdicts"]["killed"]["phases"]
    assert abs(k["recovery_s"] - (k["end_to_end_s"] - k["validation_s"])) < 1e-9 and abs(k["validation_s"] - 2.0) < 1e-9
    assert [round(r["recovery_diff_s"], 6) for r in v["pairs"]] == [-0.7, 0.5, -0.8]
    assert v["pairs_summary"] == {"pairs": 3, "local_lower": 2, "median_recovery_diff_s": v["pairs"][0]["recovery_diff_s"],
                                  "median_end_to_end_diff_s": v["pairs"][0]["end_to_end_diff_s"]}
    assert [r["first"] for r in v["pairs"]] == ["local", "persistent", "local"]

    bad = copy.deepcopy(tiers)
    bad["pairs"][0]["tiers_per_process"] = [[0, 0, 100]]  # the "local" job read the persistent tier
    assert not judge_tiers(bad, ref)["ok"]
    half = copy.deepcopy(tiers)
    del half["pairs"][-1]  # pair 2 lost its persistent job
    assert not judge_tiers(half, ref)["ok"]


def test_a_tier_job_that_validates_after_its_first_step_is_timed_in_that_order():
    """The JAX tier jobs hash the restored state after their first step (t_restored < t_step <
    t_valid): the recovery runs from the launch to the end of that step, and the validation after it
    counts only in the end to end. Control: the same times read in the old order (validation before
    the step) would give a negative first step and a recovery that leaves out the step."""
    from ckptfmt_tools.drill._tiers import judge_tiers

    ref = _fake_receipt()["ref"]
    after = dict(_tier_result("killed", 3, 0.2), t_step=1.8, t_valid=3.8,
                 validated_after_step=True)  # restored at 1.3, stepped until 1.8, hashed until 3.8
    tiers = {"local_step": 3, "local_token": "n-3", "persistent_steps": [3],
             "scenarios": {"killed": after, "all-lost": _tier_result("all-lost", 3, 0.9)}}
    v = judge_tiers(tiers, ref)
    p = v["verdicts"]["killed"]["phases"]
    assert v["ok"] and p["validated_after_step"]
    assert abs(p["recovery_s"] - 1.8) < 1e-9 and abs(p["first_step_s"] - 0.5) < 1e-9
    assert abs(p["end_to_end_s"] - 3.8) < 1e-9 and abs(p["validation_s"] - 2.0) < 1e-9

    old_order = {k: x for k, x in after.items() if k != "validated_after_step"}
    q = judge_tiers({**tiers, "scenarios": {**tiers["scenarios"], "killed": old_order}}, ref)["verdicts"]["killed"]["phases"]
    assert q["first_step_s"] < 0 and abs(q["recovery_s"] - 1.8) > 0.1  # what the flag prevents


def test_the_elastic_scenarios_are_judged_on_bytes_by_tier():
    """drill --tiers --elastic: a restart on fewer processes passes when every byte of a box some
    survivor held came from the tiers (and, when every box had a surviving copy, no byte from the
    persistent tier), with one token and the elastic record; its pair from the persistent tier
    alone passes when every byte came from there. Controls: a persistent read of a held piece
    (column 4), any persistent byte when every box was held, no elastic record, another token."""
    from ckptfmt_tools.drill._tiers import judge_tiers

    ref = _fake_receipt()["ref"]

    def elastic(scenario: str, per: list, restore_s: float = 0.2, pair: int | None = None) -> dict:
        r = dict(_tier_result("killed", 3, restore_s), scenario=scenario, tiers_per_process=per, nproc=3,
                 elastic={"hosts": 4, "world": 3, "held_by": {"0": 0, "1": 1, "2": 2}})
        return r if pair is None else dict(r, pair=pair)

    held = [[80, 20, 0, 0]] * 3
    tiers = {"local_step": 3, "local_token": "n-3", "persistent_steps": [3], "pairs": [],
             "elastic": {"elastic": {"step": 3, "token": "n-3", "covered": True},
                         "elastic-only-copy": {"step": 3, "token": "n-3", "covered": False},
                         "elastic-persistent": {"step": 3}},
             "scenarios": {"elastic": elastic("elastic", held),
                           "elastic-only-copy": elastic("elastic-only-copy", [[80, 20, 0, 0], [60, 0, 40, 0]])}}
    tiers["pairs"] = [elastic("elastic", held, 0.2, 0), elastic("elastic-persistent", [[0, 0, 100, 0]] * 3, 0.9, 0)]
    v = judge_tiers(tiers, ref)
    assert v["ok"], v
    assert v["pairs_summary"]["pairs"] == 1 and v["pairs"][0]["recovery_diff_s"] < 0

    def broken(scenario: str, **change) -> dict:
        bad = copy.deepcopy(tiers)
        bad["scenarios"][scenario].update(change)
        return judge_tiers(bad, ref)

    assert not broken("elastic", tiers_per_process=[[80, 20, 0, 0], [80, 0, 20, 0], [80, 20, 0, 0]])["ok"]
    assert not broken("elastic-only-copy", tiers_per_process=[[80, 20, 0, 0], [60, 0, 40, 10]])["ok"]
    assert not broken("elastic-only-copy", tiers_per_process=[[80, 20, 0, 0], [80, 20, 0, 0]])["ok"]
    assert not broken("elastic", elastic=None)["ok"]
    assert not broken("elastic", tokens_per_process=["n-2"])["ok"]
    bad = copy.deepcopy(tiers)
    bad["pairs"][1]["tiers_per_process"] = [[10, 0, 90, 0]] * 3  # the "persistent alone" job used a tier
    assert not judge_tiers(bad, ref)["ok"]
