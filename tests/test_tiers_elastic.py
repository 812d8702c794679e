"""The elastic local tier (FORMAT.md 8.5, "Elastic restore"; ckptfmt/manager/_tierplan.py, _tierelastic.py).

The planner is pure: on random tilings it covers every request exactly once, takes the own copy
first, and sends to the persistent tier exactly the cells no source holds (control: a source
dropped moves its cells there). Then real gloo jobs (tests/torchproc/elastic_job.py): 4 ranks save
with peer replicas; host 2's tier is lost and 3 ranks restore with no spare (new boxes assembled
from several hosts' copies, the lost host's boxes from its peer's replica, nothing from the
persistent tier); two more hosts' tiers lost and 2 ranks restore (the boxes no survivor holds from
the persistent tier, and counted); a peer answering with a corrupted chunk or another step's
manifest is refused and those pieces alone come from the persistent tier (the honest run is the
control). The JAX bridge's elastic restore runs in ``ckptfmt drill --elastic`` (tests/test_drill.py).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfmt import Box
from ckptfmt.manager._tierplan import TierSource, assign_hosts, plan_tier_reads
from ckptfmt.manager._tiers import HeldBox

ROOT = Path(__file__).resolve().parent.parent


def _grid(shape: tuple[int, int], cuts: tuple[list[int], list[int]]) -> list[Box]:
    rows, cols = [0, *cuts[0], shape[0]], [0, *cuts[1], shape[1]]
    return [Box((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]


@pytest.mark.parametrize("seed", range(12))
def test_the_planner_covers_each_request_once_own_first_and_persistent_only_for_unheld_cells(seed):
    rng = random.Random(seed)
    shape = (rng.randint(4, 12), rng.randint(4, 12))
    boxes = _grid(shape, (sorted(rng.sample(range(1, shape[0]), 2)), sorted(rng.sample(range(1, shape[1]), 1))))
    world, me = 3, rng.randrange(3)
    sources = []
    for h, b in enumerate(boxes):  # each box held by 0, 1 or 2 processes (lost, one copy, a replica too)
        for r in rng.sample(range(world), rng.choice([0, 1, 1, 2])):
            sources.append(TierSource(r, h * 10 + r, (HeldBox(f"h{h}/000000", h, "w", shape, "float32", b),)))
    reqs = [("w", Box((o, 0), (min(rng.randint(1, 5), shape[0] - o), shape[1]))) for o in range(0, shape[0], 3)]
    plan = plan_tier_reads(me, reqs, sources)
    held = {s.boxes[0].box for s in sources}
    for q, (_, box) in enumerate(reqs):
        parts = [r for r in plan.reads if r.request == q]
        assert sum(r.part.size for r in parts) == box.size  # every element once
        for i, a in enumerate(parts):
            assert a.part.intersect(box) == a.part
            assert all(a.part.intersect(b.part) is None for b in parts[i + 1:])
            inside = [b for b in held if b.intersect(a.part) == a.part]
            if a.rank is None:  # persistent: no source holds any of it
                assert not any(b.intersect(a.part) is not None for b in held)
            else:
                assert a.source.box.intersect(a.part) == a.part and inside
                mine = any(s.rank == me and s.boxes[0].box == a.source.box for s in sources)
                assert (a.rank == me) == mine  # the own copy whenever this process holds one
                assert a.nbytes == a.part.size * 4
    # Broken control: the same requests with every source dropped go to the persistent tier whole.
    bare = plan_tier_reads(me, reqs, [])
    assert [(r.request, r.part, r.rank) for r in bare.reads] == [(q, b, None) for q, (_, b) in enumerate(reqs)]


def test_a_peer_copy_is_read_from_the_least_loaded_holder_and_the_same_box_once():
    shape = (8, 2)
    a, b = Box((0, 0), (4, 2)), Box((4, 0), (4, 2))
    src = [TierSource(1, 1, (HeldBox("h1/0", 1, "w", shape, "float32", a), HeldBox("h1/1", 1, "w", shape, "float32", b))),
           TierSource(2, 2, (HeldBox("h2/0", 2, "w", shape, "float32", a), HeldBox("h2/1", 2, "w", shape, "float32", b)))]
    plan = plan_tier_reads(0, [("w", Box.full(shape))], src)
    assert sorted(r.rank for r in plan.reads) == [1, 2] and not plan.persistent  # spread over both holders
    # an empty box is served with its dtype, nothing read
    assert plan_tier_reads(0, [("w", Box((8, 0), (0, 2)))], src).empty == ((0, "float32"),)


def test_host_repositories_found_by_several_processes_are_held_by_one():
    # a shared path: every process finds every repository; each is held once, by its own rank when alive
    assert assign_hosts([[0, 1, 3], [0, 1, 3], [0, 1, 3]]) == {0: 0, 1: 1, 3: 0}
    # one path per machine: each process holds what it finds
    assert assign_hosts([[0], [1], [3]]) == {0: 0, 1: 1, 3: 2}


# --------------------------------------------------------------------------- real gloo jobs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(work: Path, mode: str, world: int, *extra: str, tag: str = "") -> list[dict]:
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    outs = [work / f"{mode}{tag}-{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "torchproc" / "elastic_job.py"), mode, "--dir",
                               str(work), "--port", str(port), "--rank", str(r), "--world", str(world), "--out",
                               str(outs[r]), *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, logs
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("elastic")
    assert _job(work, "save", 4)[0]["local_saves"] == [2, 4, 6, 8]
    shutil.rmtree(work / "local" / "host-2")  # host 2 is lost with its process: no spare
    shutil.copytree(work / "local", work / "local-3")
    return work


def _totals(rs: list[dict]) -> dict:
    return {k: sum(r["tiers"][k] for r in rs) for k in ("local", "peer", "persistent", "persistent_held")}


def test_restore_on_three_processes_reads_no_box_a_survivor_holds_from_persistent_storage(saved):
    rs = _job(saved, "restore", 3)
    assert all(r["exact"] and r["step"] == 8 and r["extra"] == {"step": 8} and r["n"] == 8 for r in rs), rs
    assert len({r["token"] for r in rs}) == 1 and rs[0]["elastic"]["hosts"] == 4 and rs[0]["elastic"]["world"] == 3
    t = _totals(rs)
    assert t["persistent"] == 0 and t["peer"] > 0 and t["local"] > 0, rs  # host 2's rows from host 1's replica
    assert all(sum(r["tiers"][k] for k in ("local", "peer", "persistent")) == r["needed"] for r in rs), rs


def test_an_own_copy_that_fails_is_asked_of_a_peer_s_copy(saved):
    """Host 1's own first box flipped: rank 1 rejects it and asks the other copy (host 0's replica,
    held by rank 0) in the second round; nothing from the persistent tier. The intact run above is
    the control."""
    sys.path.insert(0, str(ROOT / "tests" / "jaxproc"))
    from tiers_job_damage import corrupt_own_box

    shutil.copytree(saved / "local" / "host-1", saved / "host-1-clean")
    try:
        corrupt_own_box(str(saved / "local"), 1, 8)
        rs = _job(saved, "restore", 3, tag="own")
    finally:
        shutil.rmtree(saved / "local" / "host-1")
        os.rename(saved / "host-1-clean", saved / "local" / "host-1")
    assert all(r["exact"] and r["step"] == 8 for r in rs), rs
    assert _totals(rs)["persistent"] == 0 and rs[1]["tiers"]["peer"] > 0, rs
    assert all(sum(r["tiers"][k] for k in ("local", "peer", "persistent")) == r["needed"] for r in rs), rs


@pytest.mark.parametrize("tamper", ["corrupt", "other-step"])
def test_a_peer_answering_with_other_bytes_is_refused_and_only_those_pieces_come_from_persistent(saved, tamper):
    rs = _job(saved, "restore", 3, "--tamper", tamper, "--tamper-rank", "0", tag=tamper)
    assert rs[0]["tampered"] >= 1 and all(r["exact"] and r["step"] == 8 for r in rs), rs
    t = _totals(rs)
    assert t["persistent"] == t["persistent_held"] > 0, rs  # pieces a survivor held, its copy refused
    assert all(sum(r["tiers"][k] for k in ("local", "peer", "persistent")) == r["needed"] for r in rs), rs
    if tamper == "other-step":
        refused = [e for r in rs for e in r["tiers"]["refused"]]
        assert refused and all("StepMismatchError" in e["error"] for e in refused), refused


def test_a_box_no_survivor_holds_is_read_from_persistent_storage_and_counted(saved):
    # hosts 1 and 2 lost: host 2's boxes had copies on hosts 2 and 1 only
    shutil.rmtree(saved / "local")
    shutil.copytree(saved / "local-3", saved / "local")
    shutil.rmtree(saved / "local" / "host-1")
    rs = _job(saved, "restore", 2, tag="two")
    assert all(r["exact"] and r["step"] == 8 for r in rs), rs
    t = _totals(rs)
    # w rows 12..18 (6 x 6 float32) and u [6, 9) (3 int64) were held only by the lost hosts
    assert t["persistent"] == 6 * 6 * 4 + 3 * 8 and t["persistent_held"] == 0, rs
    assert t["local"] + t["peer"] > 0


def test_a_jax_job_on_more_processes_than_the_save_restores_through_the_tiers(tmp_path):
    """JAX: 2 processes x 2 devices save; 3 processes x 1 device restore (another mesh; each needs
    rows of two hosts' boxes; the third finds no tier of its own and reads all from its peers)."""
    def job(mode: str, world: int) -> list[dict]:
        port = _port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "jaxproc" / "elastic_job.py"), mode, "--dir",
                                   str(tmp_path), "--port", str(port), "--rank", str(r), "--world", str(world), "--out",
                                   str(tmp_path / f"{mode}-{r}.json")], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        logs = [p.communicate(timeout=180)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * world, logs
        return [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in range(world)]

    assert job("save", 2)[0]["local_saves"] == [2, 4]
    rs = job("restore", 3)
    assert all(r["exact"] and r["step"] == 4 and r["extra"] == {"step": 4} and r["n"] == 4 for r in rs), rs
    assert rs[0]["elastic"]["hosts"] == 2 and rs[0]["elastic"]["world"] == 3 and len({r["token"] for r in rs}) == 1
    assert all(r["tiers"]["persistent"] == 0 and r["tiers"]["persistent_held"] == 0 for r in rs), rs
    assert rs[2]["tiers"]["local"] == 0 and rs[2]["tiers"]["peer"] == 4 * 4 * 4 + 12, rs  # rows 8..12 and b
