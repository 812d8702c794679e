"""The cooperative restore's core (FORMAT.md 9.1, ckptfmt/reader/_cooperative.py): the pure
assignment, and the rounds over a real checkpoint with two "processes" as threads sharing an
in-memory all-gather (the bridges' collectives are tested with real processes in
tests/test_jax_bridge.py and tests/test_torch_bridge.py)."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

import ckptfmt
from ckptfmt import Box, LocalShard, Repository
from ckptfmt.errors import ChecksumMismatchError, CoordinatorLostError, StepMismatchError
from ckptfmt.reader import CoopStats, cooperative_reads, plan_cooperative

from ckptfmt_tools.faults._coopfaults import OtherStepSender, ThreadGather


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


def _run(url: str, batches: list[list[list[Any]]], group: Any = None, sources: Any = None) -> list[Any]:
    world = len(batches)
    group, out = group or ThreadGather(world), [None] * world

    def rank(r: int) -> None:
        stats = CoopStats()
        try:
            source = sources(r) if sources is not None else Repository(url).open(1)
            got = list(cooperative_reads(source, batches[r], group.at(r), stats=stats))
            out[r] = (got, stats)
        except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _flip(repo: Any, key: str, row: int) -> None:
    """Flip one data byte of stored chunk ``row`` of tensor ``key`` of step 1."""
    t = Repository(str(repo)).manifest(1).tensors[key]
    s = int(np.searchsorted(t.chunk_start, row, side="right")) - 1
    path = repo / t.object_key(s)
    data = bytearray(path.read_bytes())
    data[t.shard_start(s) + int(t.chunks.offset[row]) + 8] ^= 0xFF
    path.write_bytes(bytes(data))


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
    # Two shared stored chunks of 4 x 8 float32, each sent with its 4-byte crc32c trailer.
    assert s0.cooperative and s0.shared_boxes == 2 and s0.bytes_received == s1.bytes_sent == 132
    # A flipped byte in the chunk rank 1 serves: both ranks raise its ChecksumMismatchError.
    _flip(tmp_path / "repo", *s1.served[0])
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
        assert stats.bytes_sent <= 132
    assert [s.served for _, s in out] == [[["a", 0]], [["a", 1]], []]  # (key path, chunk row)


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
        address, group, out, done = f"127.0.0.1:{free_port()}", ThreadGather(2), [None, None], threading.Event()

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


# ---------------------------------------------------------------- the receiver verifies (FORMAT.md 9.1)
def _two_ranks_one_box(tmp_path: Any) -> tuple[str, np.ndarray, list]:
    url = str(tmp_path / "repo")
    a = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    ckptfmt.save(url, 1, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4]) for r in range(0, 16, 4)])
    return url, a, [[[_req("a", r) for r in range(0, 16, 4)]]] * 2


def test_a_chunk_changed_in_transit_fails_on_the_receiver_and_every_rank(tmp_path):
    """Rank 0 receives rank 1's chunks with one byte flipped on the way: rank 0 checks them
    against its own manifest and raises ChecksumMismatchError naming rank 1 as the sender, and
    rank 1 raises the same error ("rank 0: ..."). The control: the same exchange without the flip
    is exact on both, and the flip did reach rank 0's buffer."""
    url, a, batches = _two_ranks_one_box(tmp_path)
    for r, (got, stats) in enumerate(_run(url, batches, ThreadGather(2))):
        assert stats.cooperative and all(np.array_equal(b, a[4 * i:4 * i + 4]) for i, b in enumerate(got[0])), r
    group = ThreadGather(2, flip=(1, 0))
    e0, e1 = _run(url, batches, group)
    assert len(group.hits) == 1 and "flipped" in group.hits[0], group.hits  # the fault reached the receiver
    assert isinstance(e0, ChecksumMismatchError) and isinstance(e1, ChecksumMismatchError), (e0, e1)
    assert "sent by rank 1" in e0.object and e0.key == "a", e0
    assert str(e1).startswith("rank 0: ") and e1.object == e0.object, e1


def test_a_sender_of_other_bytes_or_another_save_is_refused(tmp_path):
    """Rank 1 sends the stored chunks of step 2 (the same layout, other values, each with its own
    valid trailer) as step 1's: rank 0's check against its manifest raises ChecksumMismatchError
    and both ranks fail. Rank 1 restoring step 2 outright (another save) makes the binding differ:
    StepMismatchError on both. The control: a sender that reads step 1 is exact."""
    url, a, batches = _two_ranks_one_box(tmp_path)
    ckptfmt.save(url, 2, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4] + 1) for r in range(0, 16, 4)])
    repo = Repository(url)

    def lying(r: int) -> Any:
        return repo.open(1) if r == 0 else OtherStepSender(repo.open(1), repo.open(2))

    def honest(r: int) -> Any:
        return OtherStepSender(repo.open(1), repo.open(1))
    for r, (got, _) in enumerate(_run(url, batches, sources=honest)):
        assert all(np.array_equal(b, a[4 * i:4 * i + 4]) for i, b in enumerate(got[0])), r
    e0, e1 = _run(url, batches, sources=lying)
    assert isinstance(e0, ChecksumMismatchError) and "sent by rank 1" in e0.object, e0
    assert isinstance(e1, ChecksumMismatchError) and str(e1).startswith("rank 0: "), e1
    e0, e1 = _run(url, batches, sources=lambda r: repo.open(1 + r))
    assert isinstance(e0, StepMismatchError) and isinstance(e1, StepMismatchError), (e0, e1)


def test_a_peer_lost_in_a_round_is_a_typed_error(tmp_path):
    """Rank 1's first data round's collective fails as gloo's does when a peer dies (RuntimeError): rank 1
    raises CoordinatorLostError naming the round, and rank 0, whose collective broke, too; nothing
    is returned. The control: the same exchange with no loss is exact."""
    url, a, batches = _two_ranks_one_box(tmp_path)
    ok = _run(url, batches, ThreadGather(2))
    assert all(isinstance(o, tuple) for o in ok), ok
    e0, e1 = _run(url, batches, ThreadGather(2, lose=(1, 3)))  # calls 1-2 gather the needs, 3 is round 0
    assert isinstance(e0, CoordinatorLostError) and isinstance(e1, CoordinatorLostError), (e0, e1)
    assert "restore/coop/0" in e1.object and "gloo" in str(e1), e1


def test_a_source_that_cannot_verify_chunks_is_read_by_each_process_alone(tmp_path):
    """A source without stored chunks to share (a safetensors file: ``chunk_refs`` absent) is never
    shared: each process reads every box itself, so no unverifiable bytes cross processes."""
    url, a, batches = _two_ranks_one_box(tmp_path)

    class _BoxesOnly:
        def __init__(self) -> None:
            self._ckpt = Repository(url).open(1)

        def tensor(self, key: str) -> Any:
            return self._ckpt.tensor(key)

        def iter_read_boxes(self, batches: Any) -> Any:
            return self._ckpt.iter_read_boxes(batches)
    for got, stats in _run(url, batches, sources=lambda r: _BoxesOnly()):
        assert not stats.cooperative and stats.bytes_received == 0
        assert all(np.array_equal(b, a[4 * i:4 * i + 4]) for i, b in enumerate(got[0]))
