"""Judge a drill: the continuation receipts, the phase table and the guide's table, from raw results.

Every figure is computed from timestamps and counters the processes of one run wrote; nothing
is estimated. The receipt passes when:

* the replacement restored the newest committed step, its reconstructed state hashes equal the
  hashes saved with that step, its one step used the same batch ids as the original run's step,
  and its loss is within the documented tolerance of the original run's loss;
* the control (same topology as the training job) passes the same checks;
* the rejected control (the step with one shard object deleted) raised a CheckpointError,
  exposed no state (the live state's hashes are unchanged), and left the original step intact.
"""
from __future__ import annotations

from typing import Any

__all__ = ["judge", "continuation", "phase_rows", "guide_rows"]


def continuation(result: dict[str, Any], reference: dict[str, Any], latest: int | None) -> dict[str, Any]:
    """Checks of one restored job against the original run's log."""
    k = int(result["restored_step"])
    ref = reference.get(str(k + 1))
    tol = float(result["loss_rtol"])
    checks: dict[str, list[Any]] = {}
    checks["latest_committed"] = [k == latest, f"restored step {k}, newest committed {latest}"]
    hashes = result.get("hashes", {})
    checks["state_hashes"] = [bool(hashes.get("exact")),
                              f"{hashes.get('leaves', 0)} leaves equal" if hashes.get("exact")
                              else f"differ: {hashes.get('differ', [])[:4]}"]
    if ref is None:
        checks["reference"] = [False, f"the original run did not log step {k + 1}"]
        return {"ok": False, "step": k + 1, "checks": checks}
    same = list(result["ids"]) == list(ref["ids"])
    checks["batch_ids"] = [same, "identical" if same else f"{result['ids'][:6]}... vs {ref['ids'][:6]}..."]
    rel = abs(result["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    checks["loss"] = [rel <= tol, f"{result['loss']!r} vs {ref['loss']!r} (rel {rel:.1e}, tol {tol:g})"]
    info = {}
    nxt = reference.get(str(k + 2))
    if "next_loss" in result and nxt is not None:  # informative, not a gate (see _torch_job)
        rel2 = abs(result["next_loss"] - nxt["loss"]) / max(abs(nxt["loss"]), 1e-30)
        info["next_loss"] = {"got": result["next_loss"], "reference": nxt["loss"], "rel": rel2,
                             "rtol": result.get("next_loss_rtol"), "within": rel2 <= result.get("next_loss_rtol", 0)}
    return {"ok": all(c[0] for c in checks.values()), "step": k + 1, "loss": result["loss"], "informative": info,
            "reference_loss": ref["loss"], "loss_rel_diff": rel, "loss_rtol": tol, "batch_ids": result["ids"],
            "checks": checks}


def _restore_s(r: dict[str, Any]) -> float:
    """Restore time: manifest load through verified arrays on the new topology."""
    return float(r.get("restore_s", r["t_restored"] - r["t_setup"]))


def _validation_s(r: dict[str, Any]) -> float:
    """State-hash validation (a gather of every leaf when the job has several processes)."""
    return float(r["t_valid"] - r["t_restored"])


def phase_rows(receipt: dict[str, Any]) -> list[dict[str, Any]]:
    """The recovery phases of the replacement, from the kill to the first successful step."""
    tr, r, cap = receipt["train"], receipt["replacement"], receipt["capacity_wait"]
    rows = [
        ("detection", tr["t_detect"] - tr["t_kill"],
         f"supervisor polls every {receipt['inputs']['monitor_interval_s']:g} s; saw rank {tr['victim_rank']} die"),
        ("teardown of surviving ranks", tr["t_torn_down"] - tr["t_detect"], "SIGKILL + reap"),
        ("replacement capacity wait", cap["t_end"] - cap["t_start"], "--capacity-delay"),
        ("provisioning: process start", r["t_start"] - r["t_launch"], "exec + interpreter"),
        ("provisioning: framework init", r["t_ready"] - r["t_start"], r.get("init_note", "framework import + init")),
        ("job setup", r.get("job_setup_s", r["t_setup"] - r["t_ready"]),
         "model, optimizer, restore target on the new topology"),
    ]
    rows += [(n, s, note) for n, s, note in r["restore_phases"]]
    rows += [
        ("first successful step", r["t_step"] - r["t_valid"], r.get("step_note", "one train step (includes compile)")),
    ]
    e2e = r["t_step"] - tr["t_kill"]
    gaps = e2e - sum(s for _, s, _ in rows)
    rows.append(("unattributed", gaps, "between phases (supervisor bookkeeping)"))
    out = [{"phase": n, "seconds": float(s), "note": note} for n, s, note in rows]
    out.append({"phase": "end-to-end recovery", "seconds": float(e2e), "note": "from the SIGKILL to the first step",
                "total": True})
    return out


def guide_rows(receipt: dict[str, Any], verdicts: dict[str, Any]) -> list[dict[str, str]]:
    inp, r = receipt["inputs"], receipt["replacement"]
    n, m = inp["processes"] * inp["devices_per_process"], inp["replacement_devices"]
    topo = f"{inp['processes']}x{inp['devices_per_process']}"
    rows = []
    c = receipt.get("control")
    if c is not None:
        exact = "exact" if verdicts["control"]["ok"] else "NOT exact"
        rows.append({"signal": f"{n} → {n} devices ({topo} → {topo})", "choice": "Control",
                     "evidence": f"{_restore_s(c):.2f} s restore + {_validation_s(c):.2f} s validation · {exact}",
                     "detail": f"first step {c['t_step'] - c['t_launch']:.2f} s after launch"})
    exact = "exact" if verdicts["replacement"]["ok"] else "NOT exact"
    label = f"{n} → {m} {'devices' if r['framework'] == 'jax' else 'torch ranks'} ({topo} → 1x{m})" \
        if r["framework"] == "jax" else f"{n} JAX devices → {m} torch ranks"
    rows.append({"signal": label, "choice": "Required",
                 "evidence": f"{_restore_s(r):.2f} s restore + {_validation_s(r):.2f} s validation · {exact}",
                 "detail": f"first step {r['t_step'] - r['t_launch']:.2f} s after launch, "
                           f"{r['t_step'] - receipt['train']['t_kill']:.2f} s after the kill"})
    rc = receipt["replacement"].get("rejected_control", {})
    ok = verdicts["rejected_control"]["ok"]
    rows.append({"signal": "Missing shard", "choice": "Reject",
                 "evidence": "rejected, no state exposed" if ok else "NOT REJECTED / state exposed",
                 "detail": f"{rc.get('raised')} after {rc.get('reject_s', 0.0):.3f} s"})
    return rows


def _rejected(rc: dict[str, Any]) -> dict[str, Any]:
    checks = {
        "raised_typed_error": [bool(rc.get("raised")), str(rc.get("raised"))],
        "no_state_exposed": [rc.get("exposed") is False and bool(rc.get("live_state_unchanged")),
                             f"live state {'unchanged' if rc.get('live_state_unchanged') else 'CHANGED'} "
                             f"({rc.get('live_state_leaves', 0)} leaf hashes)"],
        "original_intact": [bool(rc.get("original_intact")),
                            f"{rc.get('original_verified_bytes', 0)} bytes verified" if rc.get("original_intact")
                            else str(rc.get("original_error"))],
    }
    return {"ok": all(c[0] for c in checks.values()), "checks": checks}


def judge(receipt: dict[str, Any]) -> dict[str, Any]:
    """The verdicts, tables and repository facts to merge into the receipt."""
    from ckptfmt import Repository

    from ._damage import uncommitted_saves

    url = receipt["inputs"]["storage"]
    repo = Repository(url)
    steps = repo.steps()
    tr = receipt["train"]
    # The newest step committed when the job died (the control's later reads change nothing).
    latest = steps[-1] if steps else None
    m = repo.manifest(latest) if latest is not None else None
    facts = {"committed_steps": steps, "latest": latest, "saves_started": tr["saves_started"],
             "latest_bytes": int(m.nbytes) if m else 0, "latest_writers": int(m.writers) if m else 0,
             "latest_tensors": len(m.tensors) if m else 0, "versions": dict(m.versions) if m else {},
             "uncommitted_saves": uncommitted_saves(url),
             "torn_save_steps": sorted(set(tr["saves_started"]) - set(steps))}
    ref = tr["reference"]
    verdicts: dict[str, Any] = {"replacement": continuation(receipt["replacement"], ref, latest)}
    if "control" in receipt:
        verdicts["control"] = continuation(receipt["control"], ref, latest)
    verdicts["rejected_control"] = _rejected(receipt["replacement"].get("rejected_control", {}))
    phases = phase_rows(receipt)
    guide = guide_rows(receipt, verdicts)
    rc = dict(receipt["replacement"].get("rejected_control", {}))
    rc["verdict"] = verdicts["rejected_control"]
    outputs = {
        "repository": facts,
        "kill": {"step": tr["step_at_kill"], "rank": tr["victim_rank"], "signal": "SIGKILL",
                 "victim_rc": tr["victim_rc"], "survivors": tr["survivors"]},
        "continuation": verdicts["replacement"],
        "control": verdicts.get("control"),
        "phases": phases,
        "recovery_s": phases[-1]["seconds"],
        "guide_table": guide,
        "bytes_read_per_reader": {"replacement": receipt["replacement"].get("bytes_read_per_process"),
                                  "control": receipt.get("control", {}).get("bytes_read_per_process")},
    }
    ok = all(v["ok"] for v in verdicts.values())
    return {"outputs": outputs, "rejected_control": rc, "pass": ok}
