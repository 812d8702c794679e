"""The cooperative restore's core (FORMAT.md 9.1, ckptfmt/reader/_cooperative.py): the pure
assignment, and the rounds over a real checkpoint with two "processes" as threads sharing an
in-memory all-gather (the bridges' collectives are tested with real processes in
tests/test_jax_bridge.py and tests/test_torch_bridge.py)."""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard, Repository
from ckptfmt.errors import ChecksumMismatchError
from ckptfmt.reader import CoopStats, cooperative_reads, plan_cooperative


def _req(key: str, row: int) -> tuple[str, Box]:
    return (key, Box((row, 0), (4, 8)))


def _size(req: Any) -> int:
    return req[1].size * 4


def test_each_shared_box_goes_to_one_process_balanced_and_the_same_on_every_process():
    shared = [_req(k, r) for k in ("a", "b") for r in (0, 4, 8, 12)]
    own = [_req("c", 0)]
    needs = [[shared + own], [list(reversed(shared))]]  # rank 1 lists them in another order
    plans = [plan_cooperative(needs, _size, rank) for rank in (0, 1)]
    assert plans[0].rounds[0].serves == plans[1].rounds[0].serves  # the same assignment everywhere
    serves = plans[0].rounds[0].serves
    assert sorted(serves[0] + serves[1], key=str) == sorted(shared, key=str)  # each exactly once
    assert len(serves[0]) == len(serves[1]) == 4  # balanced by bytes
    assert set(plans[0].rounds[0].reads) == set(serves[0]) | set(own)  # own-only requests: read by their owner
    assert set(plans[1].rounds[0].reads) == set(serves[1])
    # The control: needs with nothing in common share nothing, and each process reads its own.
    alone = plan_cooperative([[shared[:4]], [shared[4:]]], _size, 0)
    assert alone.shared == 0 and alone.rounds[0].reads == tuple(shared[:4])


class _Threads:
    """Two ranks in threads of one process: an all-gather through a shared list and a barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world, timeout=30)

    def at(self, rank: int) -> Any:
        group = self

        class _Rank:
            def __init__(self) -> None:
                self.rank, self.world = rank, group.world

            def allgather(self, name: str, data: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
                assert data.size == sizes[rank], (name, data.size, sizes)
                group.slots[rank] = np.array(data)
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out
        return _Rank()


def _run(url: str, batches: list[list[list[Any]]]) -> list[Any]:
    world = len(batches)
    group, out = _Threads(world), [None] * world

    def rank(r: int) -> None:
        stats = CoopStats()
        try:
            got = list(cooperative_reads(Repository(url).open(1), batches[r], group.at(r), stats=stats))
            out[r] = (got, stats)
        except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_rounds_share_verified_boxes_and_a_failed_read_fails_every_rank(tmp_path):
    url = str(tmp_path / "repo")
    a = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    ckptfmt.save(url, 1, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4]) for r in range(0, 16, 4)])
    reqs = [_req("a", r) for r in range(0, 16, 4)]
    # Rank 0 has two batches, rank 1 one: rank 1 takes part in round 1 after its last batch.
    batches = [[reqs[:2], reqs[2:]], [reqs[:2]]]
    (got0, s0), (got1, s1) = _run(url, batches)
    assert [len(b) for b in got0] == [2, 2] and len(got1) == 1
    for got, want in ((got0[0], reqs[:2]), (got0[1], reqs[2:]), (got1[0], reqs[:2])):
        for blk, (_, box) in zip(got, want):
            assert np.array_equal(blk, a[box.offset[0]:box.offset[0] + 4])
    assert s0.cooperative and s0.shared_boxes == 2 and s0.bytes_received == s1.bytes_sent == 128
    # A flipped byte in the shard rank 1 serves: both ranks raise its ChecksumMismatchError.
    served = Repository(url).manifest(1).tensors["a"]
    row = next(i for i in range(len(served.shards)) if list(served.shards.offset[i]) == s1.served[0][1])
    path = tmp_path / "repo" / served.object_key(row)
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF
    path.write_bytes(bytes(data))
    e0, e1 = _run(url, batches)
    assert isinstance(e0, ChecksumMismatchError) and isinstance(e1, ChecksumMismatchError), (e0, e1)
    assert e0.key == e1.key == "a" and e0.object == e1.object and str(e0).startswith("rank 1: "), (e0, e1)


def test_a_process_that_serves_nothing_in_a_round_keeps_its_reads_in_step(tmp_path):
    """Three ranks need the same two boxes, one per round: rank 0 serves round 0 and rank 1 round 1,
    so rank 1 reads nothing from storage in round 0 (a round it must skip in its reader) and every
    rank gets both boxes exactly; each reads one box at most."""
    url = str(tmp_path / "repo")
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    ckptfmt.save(url, 1, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4]) for r in (0, 4)])
    reqs = [_req("a", 0), _req("a", 4)]
    out = _run(url, [[[reqs[0]], [reqs[1]]]] * 3)
    for got, stats in out:
        assert np.array_equal(got[0][0], a[:4]) and np.array_equal(got[1][0], a[4:])
        assert stats.bytes_sent <= 128
    assert [s.served for _, s in out] == [[["a", [0, 0]]], [["a", [4, 0]]], []]


def test_a_process_that_never_arrives_is_a_bounded_typed_failure(tmp_path):
    """The needs go through the coordinator (FORMAT.md 9.1), whose waits are bounded: when rank 1
    fails before the restore (say, in planning) and never calls it, rank 0 raises
    CoordinatorTimeoutError within the coordinator's timeout instead of waiting in a collective
    with none. Control: with both ranks calling, the same coordinators carry a cooperative restore."""
    from ckptfmt.coord import TcpCoordinator, free_port
    from ckptfmt.errors import CoordinatorTimeoutError

    url = str(tmp_path / "repo")
    a = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    ckptfmt.save(url, 1, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4]) for r in range(0, 16, 4)])
    reqs = [_req("a", r) for r in range(0, 16, 4)]
    for arrives in (True, False):
        address, group, out, done = f"127.0.0.1:{free_port()}", _Threads(2), [None, None], threading.Event()

        def rank(r: int) -> None:
            with TcpCoordinator(address, r, 2, timeout_s=3) as coord:
                ex = group.at(r)
                ex.coordinator = coord
                if r == 1 and not arrives:
                    out[r] = "failed before the restore"
                    done.wait(30)  # alive, its coordinator open: rank 0 can only time out
                    return
                try:
                    out[r] = list(cooperative_reads(Repository(url).open(1), [reqs], ex, stats=CoopStats()))
                except Exception as e:  # noqa: BLE001 - the test looks at what rank 0 raised
                    out[r] = e
                done.set()
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if arrives:
            assert all(isinstance(o, list) and len(o[0]) == 4 for o in out), out
        else:
            assert isinstance(out[0], CoordinatorTimeoutError), out
