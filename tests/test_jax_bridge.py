"""bridges.jax / bridges.flax unit checks and the jax.distributed coordinator.

JAX needs its device count fixed before it is imported, so every check runs in a fresh
subprocess with 8 CPU devices (tests/jaxproc/bridge_checks.py runs all of them at once, and
each is reported here as its own test).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ckptfmt.coord import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None,
                                reason="needs the [jax] extra: pip install -e '.[jax]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROC = os.path.join(ROOT, "tests", "jaxproc")
CHECKS = [
    "named_1d", "named_2d", "fully_replicated", "partially_replicated", "single_device", "uneven_shapes",
    "scalars_and_leaves", "low_precision_dtypes", "typed_and_raw_keys", "missing_key_and_shape_mismatch",
    "host_structure", "key_paths", "linen_trainstate", "nnx_model_and_optimizer", "extra_rank_state_and_latest",
    "nonblocking_save", "restore_stats_and_partial", "profile_record_checked", "mapping_strict_and_report",
    "reference_cycles", "default_placement", "empty_arrays", "empty_arrays_targetless",
    "empty_arrays_manager", "layout_cache_follows_sharding", "manager_tier_and_persistent_copy_once",
    "key_path_cache_is_exact", "offered_shards_are_addressable_data", "async_save_survives_a_donating_step",
    "finished_async_save_lets_go_of_the_state",
]


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def check_results(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("jaxchecks") / "results.json"
    p = subprocess.run([sys.executable, os.path.join(PROC, "bridge_checks.py"), str(out)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_check_list_is_complete(check_results):
    assert sorted(check_results) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_bridge(check_results, name):
    result = check_results.get(name, "not run")
    assert result == "ok", result


def test_imports_stay_lazy():
    """ckptfmt, ckptfmt_tools.demo and the bridges package import no framework."""
    code = ("import sys, ckptfmt, ckptfmt_tools.demo, bridges, ckptfmt_tools.receipt; "
            "bad = [m for m in ('jax', 'flax', 'optax', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]


def _two_processes(script: str, tmp_path) -> tuple[list[subprocess.Popen], list]:
    """Start ``tests/jaxproc/<script> PORT RANK OUT_JSON`` as ranks 0 and 1 of one jax.distributed job."""
    port = free_port()
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(PROC, script), str(port), str(r), str(outs[r])],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    return procs, outs


def _both_results(script: str, tmp_path) -> tuple[dict, dict]:
    """Run ``script`` as ranks 0 and 1; both must exit 0; their JSON results."""
    procs, outs = _two_processes(script, tmp_path)
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode:
            errs.append(err[-3000:])
    assert not errs, errs
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    return r0, r1


@pytest.mark.multiprocess
def test_jax_coordinator_notices_a_killed_peer_before_the_timeout(tmp_path):
    """Rank 1 SIGKILLs itself between two collectives: rank 0 gets CoordinatorLostError within
    seconds (timeout 120 s). The control: the same rank 1 arriving 8 s late while alive (twice
    dead_after_s) is waited for, not declared dead."""
    procs, outs = _two_processes("dead_peer_check.py", tmp_path)
    try:
        _, err0 = procs[0].communicate(timeout=150)
        procs[1].communicate(timeout=30)
    finally:
        for q in procs:
            q.kill()
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == -9  # it really died mid-protocol
    r0 = json.loads(outs[0].read_text())
    assert r0["slow_peer"] == ["r0", "r1"] and r0["slow_peer_s"] >= 7, r0  # live but late: waited for
    assert r0["dead_peer"] == "CoordinatorLostError", r0
    assert "rank 1 is gone" in r0["dead_peer_message"] and r0["dead_peer_s"] < 30, r0


@pytest.mark.multiprocess
def test_jax_coordinator_two_processes(tmp_path):
    r0, r1 = _both_results("coord_check.py", tmp_path)
    assert r0["default"] == r1["default"] == "JaxCoordinator"
    assert r0["rank_world"] == [0, 2] and r1["rank_world"] == [1, 2]
    for i in range(3):  # one name reused: each call is separate
        assert r0[f"allgather{i}"] == r1[f"allgather{i}"] == [f"r0i{i}", f"r1i{i}"]
    assert r0["bcast"] == r1["bcast"] == "from1"
    assert r1["mismatch"] == "StepMismatchError"  # different collectives: detected, not a hang
    assert r0["timeout"] == "CoordinatorTimeoutError" and r0["timeout_s"] < 10  # bounded wait
    assert r0["slow_reader"] == r1["slow_reader"] == ["s0", "s1"]  # keys outlive a peer that moved on
    assert r0["slow_bcast"] == r1["slow_bcast"] == ["x", "x"]
    # Each process writes its own half; arrays held by rank 0's device only are declared by
    # rank 1 with an empty box and written by rank 0; numpy leaves are written once.
    assert r0["save"]["writers"] == {"split": [0, 1], "only0": [0], "scalar0": [0], "np": [0]}, r0["save"]
    assert r0["save"]["equal"] and r1["save"]["equal"]
    # Rank 0's listing fails: both ranks raise its StorageError at once (ckptfmt.agree_step); rank
    # 1's copy names rank 0. Before issue 14 only this bridge forwarded it (torch: a 300 s wait).
    assert r0["listing"]["error"] == r1["listing"]["error"] == "StorageError", (r0["listing"], r1["listing"])
    assert r1["listing"]["message"].startswith("rank 0: "), r1["listing"]


@pytest.mark.multiprocess
def test_replicated_writes_are_balanced_over_two_processes(tmp_path):
    """A (data=2, model=4) mesh over 2 processes, every parameter replicated over ``data``: each
    process writes within 10% of the other's bytes (FORMAT.md 8.1). The control: offering only
    replica 0's data (the assignment before 1.0.4) leaves process 1 writing nothing."""
    r0, r1 = _both_results("balance_check.py", tmp_path)
    assert r0["equal"] and r1["equal"]
    for run in r0["balanced"]:
        a, b = run["bytes_per_process"]
        assert a > 0 and b > 0 and abs(a - b) <= 0.1 * max(a, b), run
    for run in r0["replica0"]:
        assert run["bytes_per_process"][1] == 0, run


@pytest.mark.multiprocess
def test_cooperative_restore_reads_each_replicated_box_once(tmp_path):
    """A (data=2, model=4) mesh over 2 processes, every box restored by both (FORMAT.md 9.1): the
    cooperative restore (``cooperative=True``) is exact and each process reads within 10% of half the
    replicated bytes; the control, ``cooperative=False``, reads them all on each, and so does the
    default on CPU devices (off where it does not pay). A flipped byte
    in a shard only process 1 read makes BOTH raise ChecksumMismatchError for that tensor (rank
    0's copy names rank 1); the intact checkpoint restored above is the control."""
    r0, r1 = _both_results("coop_check.py", tmp_path)
    full = r0["replicated_bytes"]
    for r in (r0, r1):
        assert r["coop"]["exact"] and r["independent"]["exact"], r
        assert r["coop"]["coop"]["cooperative"] and r["coop"]["coop"]["shared_boxes"] > 0, r
        assert abs(r["coop"]["bytes_read"] - full / 2) <= 0.1 * full / 2, r["coop"]
        assert r["independent"]["bytes_read"] >= full and not r["independent"]["coop"]["cooperative"], r
        assert r["default"]["exact"] and not r["default"]["coop"]["cooperative"], r
        assert r["default"]["bytes_read"] >= full, r["default"]
    assert r0["corrupt"] is not None and r1["corrupt"] is not None, (r0, r1)
    assert r0["corrupt"]["error"] == r1["corrupt"]["error"] == "ChecksumMismatchError", (r0, r1)
    assert r0["corrupt"]["key"] == r1["corrupt"]["key"] == r1["flipped"]
    assert r0["corrupt"]["message"].startswith("rank 1: "), r0["corrupt"]


_EXIT_CHECK = r'''
import atexit, os, sys, threading
sys.path.insert(0, sys.argv[3])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
out = sys.argv[2]

def last():  # registered first, so it runs after every later atexit handler (LIFO)
    alive = [t.name for t in threading.enumerate() if t.name == "ckptfmt-jax-heartbeat" and t.is_alive()]
    with open(out, "w") as f:
        f.write(",".join(alive) or "none")

atexit.register(last)
from ckptfmt_tools.jaxjoin import join
join(int(sys.argv[1]), 1, 0, timeout=60)
from bridges.jax._coord import _client, _start_heartbeat
_start_heartbeat(_client(), 0)  # what a coordinator of a world of 2 or more starts
assert any(t.name == "ckptfmt-jax-heartbeat" for t in threading.enumerate())
'''


@pytest.mark.multiprocess
def test_the_heartbeat_thread_is_stopped_before_the_interpreter_exits(tmp_path):
    """The coordinator's heartbeat (a daemon thread that calls into the jax.distributed client's
    C++) is stopped and joined at exit, before the interpreter tears daemon threads down: one
    caught inside that call is unwound through pybind11 and aborts the process after its work is
    done (seen once in a full run: "terminate called ... FATAL: exception not rethrown"). The
    process exits 0 and, by the time the last exit handler runs, no heartbeat thread is alive;
    the control is the assertion inside the child that the thread did run."""
    out = tmp_path / "alive.txt"
    p = subprocess.run([sys.executable, "-c", _EXIT_CHECK, str(free_port()), str(out), ROOT], env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert out.read_text() == "none"
