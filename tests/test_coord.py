"""Coordinators: collectives across real processes, and every fault next to its broken control."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ckptfmt.coord import Coordinator, LocalCoordinator, TcpCoordinator, free_port
from ckptfmt.errors import CoordinatorLostError, CoordinatorTimeoutError

REPO = Path(__file__).resolve().parents[1]

# One worker per rank. It runs cfg["steps"] (or its per-rank override) and prints one JSON line
# per "mark" step and a final JSON line with either the results or the error and how long the
# failing operation took. Connecting and the first barrier ("start") get a generous timeout, so
# that slow interpreter start-up on a loaded machine is not mistaken for the fault under test.
WORKER = r"""
import json, sys, time
from ckptfmt.coord import TcpCoordinator
cfg = json.loads(sys.argv[1])
rank, world = cfg["rank"], cfg["world"]
steps = cfg["overrides"].get(str(rank), cfg["steps"])
def emit(**kw):
    print(json.dumps(kw), flush=True)
results, t0 = [], time.monotonic()
try:
    with TcpCoordinator(cfg["address"], rank, world, timeout_s=60.0) as c:
        for step in steps:
            kind, name = step[0], step[1]
            timeout = 60.0 if name == "start" else cfg["timeout"]
            t0 = time.monotonic()
            if kind == "mark":
                emit(mark=name)
            elif kind == "sleep":
                time.sleep(step[1])
            elif kind == "barrier":
                c.barrier(name, timeout)
                results.append(None)
            elif kind == "allgather":
                got = c.allgather(name, f"{name}:{rank}".encode(), timeout)
                results.append([g.decode() for g in got])
            elif kind == "big":
                got = c.allgather(name, bytes([rank]) * step[2], timeout)
                results.append([len(g) == step[2] and set(g) == {r} for r, g in enumerate(got)])
            elif kind == "broadcast":
                root = step[2]
                payload = f"{name}@{rank}".encode() if rank == root else None
                got = c.broadcast(name, payload, root=root, timeout_s=timeout)
                results.append(got.decode())
    emit(done=True, results=results)
except Exception as exc:
    emit(error=type(exc).__name__, message=str(exc), elapsed=time.monotonic() - t0)
"""


class Group:
    """``world`` worker processes on a fresh port."""

    def __init__(self, world: int, steps: list[list[Any]], *, timeout: float,
                 overrides: dict[int, list[list[Any]]] | None = None) -> None:
        address = f"127.0.0.1:{free_port()}"
        self.procs = []
        for rank in range(world):
            cfg = {"address": address, "rank": rank, "world": world, "timeout": timeout,
                   "steps": steps, "overrides": {str(k): v for k, v in (overrides or {}).items()}}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", WORKER, json.dumps(cfg)], cwd=REPO,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

    def wait_mark(self, rank: int, mark: str) -> None:
        line = self.procs[rank].stdout.readline()  # type: ignore[union-attr]
        assert json.loads(line) == {"mark": mark}, line

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait()

    def finish(self, ranks: list[int] | None = None, timeout: float = 20.0) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        try:
            for rank in ranks if ranks is not None else range(len(self.procs)):
                stdout, stderr = self.procs[rank].communicate(timeout=timeout)
                lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
                assert lines, f"rank {rank} printed nothing; stderr:\n{stderr}"
                out[rank] = json.loads(lines[-1])
        finally:
            self.cleanup()
        return out

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def assert_all_done(out: dict[int, dict[str, Any]]) -> None:
    for rank, res in out.items():
        assert res.get("done"), f"rank {rank}: {res}"


# ------------------------------------------------------------------------------ in process


def test_local_coordinator() -> None:
    c = LocalCoordinator()
    assert isinstance(c, Coordinator) and (c.rank, c.world) == (0, 1)
    c.barrier("b", 1.0)
    assert c.allgather("g", b"x", 1.0) == [b"x"]
    assert c.broadcast("c", b"y") == b"y"
    with pytest.raises(ValueError):
        c.broadcast("c", b"y", root=1)
    with pytest.raises(TypeError):
        c.allgather("g", "not bytes", 1.0)  # type: ignore[arg-type]


def run_threads(world: int, fn: Callable[[TcpCoordinator], Any], timeout_s: float = 5.0) -> list[Any]:
    """Run ``fn`` on one TcpCoordinator per rank, each in its own background thread."""
    address = f"127.0.0.1:{free_port()}"
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            with TcpCoordinator(address, rank, world, timeout_s=timeout_s) as c:
                results[rank] = fn(c)
        except Exception as exc:  # reported to the test below
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return results


def test_threads_run_whole_protocol_in_background() -> None:
    def protocol(c: TcpCoordinator) -> Any:
        assert isinstance(c, Coordinator)
        save_id = c.broadcast("save_id", b"000000000042-x" if c.rank == 0 else None)
        acks = c.allgather("ack", bytes([c.rank]) * 3)
        c.barrier("commit")
        return save_id, acks

    results = run_threads(3, protocol)
    for res in results:
        assert res == (b"000000000042-x", [b"\0\0\0", b"\1\1\1", b"\2\2\2"])


def test_garbage_connection_is_rejected_and_group_proceeds() -> None:
    port = free_port()
    with TcpCoordinator(f"127.0.0.1:{port}", 0, 2, timeout_s=5.0) as c0:
        junk = socket.create_connection(("127.0.0.1", port))
        junk.sendall(b"\x00\x00\x00\x05GET /")
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(
            TcpCoordinator(f"127.0.0.1:{port}", 1, 2, timeout_s=5.0).allgather("g", b"one")))
        t.start()
        assert c0.allgather("g", b"zero") == [b"zero", b"one"]
        t.join(10)
        assert result == [[b"zero", b"one"]]
        junk.close()


def test_connect_timeout_when_no_coordinator() -> None:
    t0 = time.monotonic()
    with pytest.raises(CoordinatorTimeoutError, match="could not connect"):
        TcpCoordinator(f"127.0.0.1:{free_port()}", 1, 2, timeout_s=0.5)
    assert time.monotonic() - t0 < 3


def test_never_connected_rank_is_named_and_coordinator_is_then_unusable() -> None:
    with TcpCoordinator(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=0.3) as c:
        with pytest.raises(CoordinatorTimeoutError, match=r"ranks \[1\] did not arrive.*never connected"):
            c.barrier("start")
        with pytest.raises(CoordinatorLostError, match="unusable"):
            c.barrier("again")


# ------------------------------------------------------------------------------ processes


@pytest.mark.multiprocess
def test_four_processes_collectives() -> None:
    steps = [["barrier", "start"], ["allgather", "g"], ["broadcast", "b0", 0],
             ["broadcast", "b2", 2], ["big", "big", 300_000], ["barrier", "end"]]
    out = Group(4, steps, timeout=20).finish()
    assert_all_done(out)
    for res in out.values():
        assert res["results"] == [None, [f"g:{r}" for r in range(4)], "b0@0", "b2@2",
                                  [True] * 4, None]


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", [False, True], ids=["control", "fault"])
def test_rank_that_never_arrives_times_out(fault: bool) -> None:
    steps = [["barrier", "start"], ["allgather", "x"]]
    late = [["barrier", "start"], ["sleep", 10]] if fault else steps
    group = Group(3, steps, timeout=3.0, overrides={2: late})
    out = group.finish([0, 1])
    if not fault:
        assert_all_done(out)
        return
    for rank, res in out.items():
        assert res["error"] == "CoordinatorTimeoutError", res
        assert "allgather 'x'" in res["message"] and "ranks [2] did not arrive" in res["message"]
        assert 2.5 < res["elapsed"] < 6.0, res


def kill_scenario(victim: int, fault: bool) -> dict[int, dict[str, Any]]:
    """Everyone meets, then waits in an allgather while ``victim`` dawdles (and maybe dies)."""
    steps = [["barrier", "start"], ["mark", "in"], ["allgather", "x"], ["barrier", "end"]]
    slow = [["barrier", "start"], ["mark", "in"], ["sleep", 1.0], ["allgather", "x"], ["barrier", "end"]]
    group = Group(3, steps, timeout=30.0, overrides={victim: slow})
    try:
        for rank in range(3):
            group.wait_mark(rank, "in")
    except BaseException:
        group.cleanup()
        raise
    if not fault:
        return group.finish()
    time.sleep(0.3)  # let the others block inside the allgather
    group.kill(victim)
    return group.finish([r for r in range(3) if r != victim])


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", [False, True], ids=["control", "fault"])
def test_killed_coordinator_is_lost_promptly(fault: bool) -> None:
    out = kill_scenario(0, fault)
    if not fault:
        assert_all_done(out)
        return
    for rank, res in out.items():
        assert res["error"] == "CoordinatorLostError", res
        assert res["elapsed"] < 8.0, res  # far below the 30 s timeout


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", [False, True], ids=["control", "fault"])
def test_killed_peer_is_lost_promptly(fault: bool) -> None:
    out = kill_scenario(2, fault)
    if not fault:
        assert_all_done(out)
        return
    for rank, res in out.items():
        assert res["error"] == "CoordinatorLostError", res
        assert "rank 2" in res["message"]
        assert res["elapsed"] < 8.0, res


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", [False, True], ids=["control", "fault"])
def test_mismatched_names_fail_fast_everywhere(fault: bool) -> None:
    steps = [["barrier", "start"], ["allgather", "x"], ["barrier", "end"]]
    odd = [["barrier", "start"], ["allgather", "y" if fault else "x"], ["barrier", "end"]]
    out = Group(3, steps, timeout=30.0, overrides={2: odd}).finish()
    if not fault:
        assert_all_done(out)
        return
    for rank, res in out.items():
        assert res["error"] == "CheckpointError", res
        assert "call-order mismatch" in res["message"], res
        assert res["elapsed"] < 8.0, res


def test_client_times_out_when_coordinator_never_calls() -> None:
    port = free_port()
    with TcpCoordinator(f"127.0.0.1:{port}", 0, 2, timeout_s=5.0):  # listening, never collecting
        with TcpCoordinator(f"127.0.0.1:{port}", 1, 2, timeout_s=0.2) as c1:
            t0 = time.monotonic()
            with pytest.raises(CoordinatorTimeoutError, match="no answer from the coordinator"):
                c1.barrier("start")
            assert time.monotonic() - t0 < 3


def test_world_size_mismatch_is_rejected() -> None:
    port = free_port()
    errors: list[Exception] = []

    def client() -> None:
        try:
            TcpCoordinator(f"127.0.0.1:{port}", 1, 3, timeout_s=5.0).barrier("start")
        except Exception as exc:
            errors.append(exc)

    with TcpCoordinator(f"127.0.0.1:{port}", 0, 2, timeout_s=0.5) as c0:
        t = threading.Thread(target=client)
        t.start()
        with pytest.raises(CoordinatorTimeoutError, match="never connected"):
            c0.barrier("start")
        t.join(10)
    assert len(errors) == 1 and type(errors[0]).__name__ == "CheckpointError"
    assert "world size 3 does not match" in str(errors[0])
