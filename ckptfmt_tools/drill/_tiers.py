"""``ckptfmt drill --tiers``: tier failures after the kill (FORMAT.md 8.5; docs/tiers.md). Imports no framework.

The training job keeps a local tier (``<work>/local``, or under ``--local-dir``; one repository per host, with peer
replicas) every ``cadence`` steps and saves the persistent tier every ``2 * cadence`` steps. After
the kill, four jobs on the training topology restore in turn, the supervisor damaging the tiers
before each:

(a) killed:   nothing more (the killed process's host survives): every byte from the own tiers;
(d) corrupt:  one own box of the victim's host flipped: rejected, the peer replica serves it;
(b) lost host: the victim's local tier deleted (its clean copy first put back): the peer replica;
(c) all lost: every local tier deleted: the persistent tier's newest step.

Each is judged like the control (same batch ids, loss within tolerance, state hashes) against
the step it must restore, plus which tier served the bytes, and that every process used the
copies of one save (one tier token, the one in the local manifests).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
from typing import Any, Callable

from ckptfmt.errors import CheckpointError
from ckptfmt_tools.bench.child import drop_page_cache
from ckptfmt.repository import Repository

from ._judge import continuation

__all__ = ["SCENARIOS", "ELASTIC", "run_tiers", "judge_tiers", "local_dir"]

SCENARIOS = ("killed", "corrupt", "lost-host", "all-lost")
#: drill --tiers --elastic: the victim's host lost and no spare (restart on one process fewer); the
#: victim's and its holder's hosts lost (two fewer: the boxes only they held come from the
#: persistent tier); and, for the pairs, the first with every local tier lost.
ELASTIC = ("elastic", "elastic-only-copy")
_SERVED = {"killed": "local", "corrupt": "peer", "lost-host": "peer", "all-lost": "persistent"}
#: The pairs: (through the tiers, from the persistent tier alone) for each mode.
_PAIRS = {False: ("killed", "all-lost"), True: ("elastic", "elastic-persistent")}


def local_dir(root: str) -> str:
    """The drill's local tiers (one ``host-N`` directory per training process) under ``root``."""
    return os.path.join(root, "local")



def _host_tokens(local: str, h: int) -> dict[int, str]:
    """Each step host ``h``'s local repository lists, with its save token (unreadable ones left out)."""
    repo, out = Repository(os.path.join(local, f"host-{h}")), {}
    try:
        steps = repo.steps()
    except CheckpointError:
        steps = []
    for s in steps:
        try:
            out[s] = str(repo.open(s).state()["tiers"]["token"])
        except (CheckpointError, KeyError, TypeError):
            continue
    return out

def _newest_local(local: str, hosts: int) -> tuple[int | None, str | None]:
    """The newest step the local tiers can restore, and its token: every host's boxes held, with
    one token, by the host's own tier or by its holder's replica (host ``h - 1`` keeps host
    ``h``'s boxes). A host killed before its own local save of a step committed still leaves
    that step restorable when its holder committed it (the restore then serves its boxes from
    the replica), so the newest step every tier lists is not the answer."""
    tokens = [_host_tokens(local, h) for h in range(hosts)]
    for s in sorted({s for t in tokens for s in t}, reverse=True):
        seen = {t[s] for t in tokens if s in t}
        if len(seen) == 1 and all(s in tokens[h] or (hosts > 1 and s in tokens[(h - 1) % hosts])
                                  for h in range(hosts)):
            return s, seen.pop()
    return None, None


def _two_copies(local: str, host: int, step: int) -> bool:
    """Whether ``host``'s own tier committed ``step`` (its holder's replica, the second copy, is what
    :func:`_newest_local` already required)."""
    try:
        return step in Repository(os.path.join(local, f"host-{host}")).steps()
    except CheckpointError:
        return False


def _corrupt(local: str, host: int, step: int) -> str:
    """Flip one byte of ``host``'s largest own box (a kernel: every restore, JAX or torch, needs it)."""
    repo = Repository(os.path.join(local, f"host-{host}"))
    m = repo.manifest(step)
    key = max((k for k in sorted(m.tensors) if k.startswith(f"h{host}/")),
              key=lambda k: int(m.tensors[k].chunks.nbytes.sum()))
    t = m.tensors[key]
    with open(os.path.join(repo.url, t.object_key(0)), "r+b") as f:  # its first byte, in a pack or not
        f.seek(t.shard_start(0))
        b = f.read(1)
        f.seek(t.shard_start(0))
        f.write(bytes([b[0] ^ 0xFF]))
    return key


def _damage(scenario: str, root: str, victim: int, step: int) -> dict[str, Any]:
    local = local_dir(root)
    host = os.path.join(local, f"host-{victim}")
    clean = os.path.join(root, f"host-{victim}-clean")  # same file system as the tier: renamed back
    if scenario == "killed":
        shutil.copytree(host, clean)
        return {"damage": "none: the killed process's host and its local tier survive"}
    if scenario == "corrupt":
        if not _two_copies(local, victim, step):
            # The kill landed while the victim's own local save of the step was in flight: its
            # holder committed the step with the victim's replica, the victim did not, so no box of
            # the step has a second local copy for the next tier to serve. Flipping a byte would
            # test nothing this scenario claims; the scenario is skipped, and says why.
            return {"damage": "none", "skipped": f"no box of step {step} has two local copies: host {victim}'s "
                    "own local save of it had not committed when it was killed"}
        return {"damage": f"one byte flipped in host {victim}'s own box {_corrupt(local, victim, step)}"}
    if scenario == "lost-host":
        shutil.rmtree(host)
        os.rename(clean, host)
        shutil.rmtree(host)
        return {"damage": f"host {victim}'s local tier deleted"}
    shutil.rmtree(local)
    return {"damage": "every local tier deleted"}


def _lost(scenario: str, victim: int, hosts: int) -> list[int]:
    """The hosts an elastic scenario loses: the victim's; with ``-only-copy`` its holder's too."""
    return sorted({victim, (victim - 1) % hosts}) if scenario == "elastic-only-copy" else [victim]


def _persistent_tokens(url: str) -> dict[int, str | None]:
    repo, out = Repository(url), {}
    for s in repo.steps():
        try:
            meta = repo.manifest(s).metadata.get("ckptfmt.tiers")
            out[s] = str(meta["token"]) if isinstance(meta, dict) and "token" in meta else None
        except (CheckpointError, KeyError, TypeError):
            out[s] = None
    return out


def elastic_expectation(local: str, hosts: int, lost: list[int], url: str) -> dict[str, Any]:
    """The step an elastic restart after losing ``lost`` must restore (FORMAT.md 8.5, "Elastic
    restore"): the newest step, no older than the newest persistent one, whose every host's boxes
    a surviving copy holds with one token (the host's own tier, or its holder ``h - 1``'s replica),
    or whose missing boxes the persistent tier holds with that token; else the newest persistent
    step. ``covered``: every box had a surviving copy (then no persistent byte may be read)."""
    tokens = [{} if h in lost else _host_tokens(local, h) for h in range(hosts)]
    ptok = _persistent_tokens(url)
    newest_p = max(ptok, default=-1)
    for s in sorted({s for t in tokens for s in t}, reverse=True):
        if s < newest_p:
            break
        token = ptok.get(s) or next((t[s] for t in tokens if s in t), None)
        covered = all(tokens[h].get(s) == token or tokens[(h - 1) % hosts].get(s) == token for h in range(hosts))
        if covered or (s in ptok and ptok[s] == token):
            return {"step": s, "token": token, "covered": covered, "lost": lost}
    return {"step": newest_p, "token": None, "covered": False, "lost": lost, "persistent_only": True}


def _elastic_nodes(root: str, hosts: int, lost: list[int], keep_tiers: bool) -> tuple[str, int]:
    """One directory per surviving machine (``node-<i>``, the new job's rank ``i``) holding the host
    repository that machine kept (none with ``keep_tiers`` False: every local tier lost); the
    ``--local`` template and the new job's process count."""
    nodes = os.path.join(root, "elastic-nodes")
    shutil.rmtree(nodes, ignore_errors=True)
    survivors = [h for h in range(hosts) if h not in lost]
    for i, h in enumerate(survivors):
        os.makedirs(os.path.join(nodes, f"node-{i}"))
        src = os.path.join(local_dir(root), f"host-{h}")
        if keep_tiers and os.path.isdir(src):
            shutil.copytree(src, os.path.join(nodes, f"node-{i}", f"host-{h}"))
    return os.path.join(nodes, "node-{rank}"), len(survivors)


def _run_elastic(cfg: Any, root: str, url: str, victim: int, restore_job: Callable[..., tuple[dict[str, Any], float]],
                 say: Callable[[str], None], out: dict[str, Any]) -> None:
    """drill --tiers --elastic: the two elastic scenarios, then the pairs (tiers, persistent alone)."""
    out["elastic"] = {}
    for scenario in ELASTIC:
        lost = _lost(scenario, victim, cfg.processes)
        expect = elastic_expectation(local_dir(root), cfg.processes, lost, url)
        out["elastic"][scenario] = expect
        template, nproc = _elastic_nodes(root, cfg.processes, lost, keep_tiers=True)
        note = {"damage": f"host(s) {lost} lost with their local tiers; no spare: restart on {nproc} processes "
                          f"(mesh {cfg.elastic_mesh(nproc)})", "lost": lost, "nproc": nproc}
        out["scenarios"][scenario] = _tier_job(cfg, scenario, f"tiers-{scenario}", note, root, restore_job, say,
                                               local=template, nproc=nproc)
    lost = _lost("elastic", victim, cfg.processes)
    out["elastic"]["elastic-persistent"] = {"step": max(_persistent_tokens(url), default=-1), "lost": lost}
    for i in range(int(getattr(cfg, "tier_pairs", 0))):
        for scenario in (_PAIRS[True] if i % 2 == 0 else _PAIRS[True][::-1]):
            template, nproc = _elastic_nodes(root, cfg.processes, lost, keep_tiers=scenario == "elastic")
            note = {"damage": f"host {lost} lost, no spare, restart on {nproc} processes"
                    + ("" if scenario == "elastic" else "; every local tier lost"), "pair": i, "lost": lost,
                    "nproc": nproc}
            out["pairs"].append(_tier_job(cfg, scenario, f"tiers-pair{i}-{scenario}", note, root, restore_job, say,
                                          local=template, nproc=nproc))
    shutil.rmtree(os.path.join(root, "elastic-nodes"), ignore_errors=True)


def run_tiers(cfg: Any, work: str, url: str, victim: int, restore_job: Callable[..., tuple[dict[str, Any], float]],
              say: Callable[[str], None], *, tier_root: str = "") -> dict[str, Any]:
    """Run the four scenarios (with ``cfg.elastic``: the elastic ones); return their raw results
    (judged by :func:`judge_tiers`). The local tiers are under ``tier_root`` (default ``work``), as
    the training job kept them."""
    root = tier_root or work
    step, token = _newest_local(local_dir(root), cfg.processes)
    out: dict[str, Any] = {"local_step": step, "local_token": token, "persistent_steps": Repository(url).steps(),
                           "scenarios": {}, "pairs": []}
    if getattr(cfg, "elastic", False):
        _run_elastic(cfg, root, url, victim, restore_job, say, out)
        return out
    pairs = int(getattr(cfg, "tier_pairs", 0)) if step is not None else 0
    backup = os.path.join(root, "local-pairs")
    if pairs:  # the local tiers as the kill left them, for the pairs after the four scenarios
        shutil.copytree(local_dir(root), backup)
    for scenario in SCENARIOS:
        note = _damage(scenario, root, victim, step) if step is not None else {"damage": "no local step"}
        if "skipped" in note:
            say(f"tiers-{scenario}: skipped: {note['skipped']}")
            out["scenarios"][scenario] = {**note, "scenario": scenario}
            continue
        out["scenarios"][scenario] = _tier_job(cfg, scenario, f"tiers-{scenario}", note, root, restore_job, say)
    out["pairs"] = []
    for i in range(pairs):
        # Alternating order: neither source always runs first after the other's job.
        for scenario in (("killed", "all-lost") if i % 2 == 0 else ("all-lost", "killed")):
            shutil.rmtree(local_dir(root), ignore_errors=True)
            if scenario == "killed":
                shutil.copytree(backup, local_dir(root))
            note = {"damage": "none: the local tiers as the kill left them" if scenario == "killed"
                    else "every local tier deleted", "pair": i}
            out["pairs"].append(_tier_job(cfg, scenario, f"tiers-pair{i}-{scenario}", note, root, restore_job, say))
    if pairs:
        shutil.rmtree(backup, ignore_errors=True)
    return out


def _tier_job(cfg: Any, scenario: str, name: str, note: dict[str, Any], root: str,
              restore_job: Callable[..., tuple[dict[str, Any], float]], say: Callable[[str], None], *,
              local: str = "", nproc: int = 0) -> dict[str, Any]:
    """One replacement job restoring after ``note``'s damage (the local tiers under ``root``, or
    ``local``: a per-rank template, on ``nproc`` processes); its raw result."""
    if getattr(cfg, "cold_cache", False):
        note["cache_dropped"] = drop_page_cache()
    say(f"{name}: {note['damage']}" + (f"; page cache dropped: {note['cache_dropped']}" if "cache_dropped" in note else ""))
    res, t_launch = restore_job(name, local=local or local_dir(root), **({"nproc": nproc} if nproc else {}))
    res.update(note, scenario=scenario, t_launch=t_launch)
    return res


def step_interval(train: dict[str, Any] | None) -> float | None:
    """The training job's median seconds between logged steps (its train-steps log), or None."""
    try:
        with open(str((train or {})["log"])) as f:
            ts = [float(json.loads(line)["t"]) for line in f if line.strip()]
    except (OSError, KeyError, TypeError, ValueError):
        return None
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return gaps[len(gaps) // 2] if gaps else None


def judge_tiers(tiers: dict[str, Any], reference: dict[str, Any], train: dict[str, Any] | None = None) -> dict[str, Any]:
    """A verdict per scenario: the continuation checks, the tier that served, one save's copies; with
    ``train``, the steps each recovery must redo (the killed job reached ``step_at_kill``) and the
    estimated seconds until training is back there (recovery + redone steps x the job's median
    step interval). With pairs (``--tier-pairs``): each pair's two verdicts, and the paired
    differences of the recovery time, own local copy less persistent tier."""
    dt = step_interval(train)
    verdicts = {scenario: _verdict(tiers, scenario, res, reference, dt, train)
                for scenario, res in tiers["scenarios"].items()}
    pairs: dict[int, dict[str, Any]] = {}  # in the order the jobs ran
    for res in tiers.get("pairs") or []:
        pairs.setdefault(int(res["pair"]), {})[res["scenario"]] = _verdict(tiers, res["scenario"], res, reference, dt, train)
    rows = []
    tiered, alone = _PAIRS["elastic" in tiers]
    for i, got in sorted(pairs.items()):
        if {tiered, alone} <= got.keys():
            local, pers = got[tiered]["phases"], got[alone]["phases"]
            first = "local" if next(iter(got)) == tiered else "persistent"
            rows.append({"pair": i, "first": first, "ok": got[tiered]["ok"] and got[alone]["ok"],
                         "local": local, "persistent": pers, "recovery_diff_s": local["recovery_s"] - pers["recovery_s"],
                         "restore_diff_s": local["restore_s"] - pers["restore_s"],
                         "end_to_end_diff_s": local["end_to_end_s"] - pers["end_to_end_s"], "checks": got})
    ok = all(v["ok"] for v in verdicts.values()) and all(r["ok"] for r in rows) and len(rows) == len(pairs)
    out: dict[str, Any] = {"verdicts": verdicts, "ok": ok}
    if rows:
        diffs = [r["recovery_diff_s"] for r in rows]
        out["pairs"] = rows
        out["pairs_summary"] = {"pairs": len(rows), "local_lower": sum(d < 0 for d in diffs),
                                "median_recovery_diff_s": statistics.median(diffs),
                                "median_end_to_end_diff_s": statistics.median(r["end_to_end_diff_s"] for r in rows)}
    return out


def _verdict(tiers: dict[str, Any], scenario: str, res: dict[str, Any], reference: dict[str, Any], dt: float | None,
             train: dict[str, Any] | None) -> dict[str, Any]:
    if "skipped" in res:  # reported, not run: nothing to judge (see _damage)
        return {"ok": True, "skipped": res["skipped"], "checks": {"skipped": [True, res["skipped"]]}}
    persistent = tiers["persistent_steps"]
    if scenario in tiers.get("elastic", {}):
        v = _elastic_checks(tiers["elastic"][scenario], scenario, res, reference)
    else:
        expect = persistent[-1] if scenario == "all-lost" else tiers["local_step"]
        v = continuation(res, reference, expect)
        per = res.get("tiers_per_process") or []
        col = {"local": 0, "peer": 1, "persistent": 2}[_SERVED[scenario]]
        ok_tier = bool(per) and any(p[col] > 0 for p in per) and (scenario == "all-lost" or all(p[2] == 0 for p in per))
        v["checks"]["tier_served"] = [ok_tier, f"bytes [local, peer, persistent] per process: {per}"]
    if scenario not in ("all-lost", "elastic-persistent", "elastic", "elastic-only-copy"):
        tokens = set(res.get("tokens_per_process") or [])
        one = tokens == {tiers["local_token"]}
        v["checks"]["one_save"] = [one, f"tokens {sorted(tokens)}; local manifests' {tiers['local_token']}"]
    v["ok"] = all(c[0] for c in v["checks"].values())
    # recovery: from the launch to the end of the first step, without the drill's own validation
    # (full-state gathers and hashes, which no production restore runs; the JAX job takes it after
    # the first step, the torch job before it); end to end includes it.
    after = bool(res.get("validated_after_step"))
    validation = float(res["t_valid"] - (res["t_step"] if after else res["t_restored"]))
    first_step = float(res["t_step"] - (res["t_restored"] if after else res["t_valid"]))
    recovery = float(res["t_restored"] - res["t_launch"]) + first_step
    v["phases"] = {"launch_to_ready_s": float(res["t_ready"] - res["t_launch"]),
                   "restore_s": float(res["t_restored"] - res["t_setup"]), "validation_s": validation,
                   "first_step_s": first_step, "end_to_end_s": recovery + validation, "recovery_s": recovery,
                   "validated_after_step": after}
    at_kill = (train or {}).get("step_at_kill")
    if dt is not None and at_kill is not None:
        redo = max(0, int(at_kill) - int(res["restored_step"]))
        v["phases"].update(steps_redone=redo, back_at_kill_step_s=v["phases"]["recovery_s"] + redo * dt)
    return v


def _elastic_checks(expect: dict[str, Any], scenario: str, res: dict[str, Any], reference: dict[str, Any]
                    ) -> dict[str, Any]:
    """An elastic scenario's verdict: the continuation of the step it must restore, and where the
    bytes came from: through the tiers, the persistent tier read for no piece a surviving copy held
    (column 4: persistent bytes of held pieces), and for nothing at all when every box had a
    surviving copy; one token on every process; alone (every local tier lost), all persistent."""
    v = continuation(res, reference, expect["step"])
    per = res.get("tiers_per_process") or []
    if scenario == "elastic-persistent":
        ok = bool(per) and all(p[0] == p[1] == 0 for p in per) and any(p[2] > 0 for p in per)
        v["checks"]["tier_served"] = [ok, f"bytes [local, peer, persistent, held] per process: {per}"]
        return v
    held = all(len(p) > 3 and p[3] == 0 for p in per)
    unheld = all(p[2] == 0 for p in per) if expect.get("covered") else any(p[2] > 0 for p in per)
    tiers = any(p[0] + p[1] > 0 for p in per)
    v["checks"]["tier_served"] = [bool(per) and held and unheld and tiers,
                                  f"bytes [local, peer, persistent, persistent of held pieces] per process: {per}; "
                                  f"every box had a surviving copy: {expect.get('covered')}"]
    tokens = set(res.get("tokens_per_process") or [])
    v["checks"]["one_save"] = [tokens == {expect.get("token")}, f"tokens {sorted(tokens)}; expected {expect.get('token')}"]
    el = res.get("elastic") or {}
    v["checks"]["elastic"] = [el.get("world") == res.get("nproc") and el.get("hosts") is not None,
                              f"restored through the tiers elastically: {el}"]
    return v
