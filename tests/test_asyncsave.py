"""Async saves: the caller is blocked only for the snapshot; saves never interleave."""
import numpy as np
import pytest

from ckptfmt import Box, LocalShard, Repository, SaveInProgressError, save_async


def _shards(x):
    return [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]


def test_async_save_snapshots_and_commits(repo_url):
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    h = save_async(repo_url, 1, _shards(x))
    x[:] = -1  # the caller mutates its buffer right away: the snapshot protects the save
    m = h.result(60)
    assert m.step == 1 and h.snapshot_bytes == x.nbytes and h.blocked_s >= 0
    assert np.array_equal(Repository(repo_url).open(1).read("x"), np.arange(4096, dtype=np.float32).reshape(64, 64))


def test_second_save_waits_or_fails_cleanly(repo_url):
    x = np.ones((256, 256), np.float32)
    slow = [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x)]
    h1 = save_async(repo_url, 1, slow)
    h2 = save_async(repo_url, 2, _shards(x * 2))  # waits for h1, never interleaves
    assert h1.result(60).step == 1 and h2.result(60).step == 2
    assert Repository(repo_url).steps() == [1, 2]
    # Hold save 3 in flight deterministically: its 2-rank group waits at the first collective
    # until rank 1 joins, which happens only after the check.
    import threading
    from ckptfmt import TcpCoordinator
    from ckptfmt.coord import free_port
    addr = f"127.0.0.1:{free_port()}"
    c0 = TcpCoordinator(addr, 0, 2, timeout_s=60)
    h3 = save_async(repo_url, 3, _shards(x), coordinator=c0)
    try:
        assert not h3.done()
        with pytest.raises(SaveInProgressError):
            save_async(repo_url, 4, _shards(x), wait=False)
    finally:
        def rank1():
            with TcpCoordinator(addr, 1, 2, timeout_s=60) as c1:
                from ckptfmt import save
                save(repo_url, 3, [LocalShard("x", x.shape, x.dtype, Box((0, 0), x.shape), x, replica_id=1)], coordinator=c1)
        t = threading.Thread(target=rank1)
        t.start()
        assert h3.result(60).step == 3
        t.join(60)
        c0.close()
    assert save_async(repo_url, 4, _shards(x), wait=False).result(60).step == 4  # control: accepted when idle


def test_async_error_is_delivered(repo_url):
    x = np.ones((4, 4), np.float32)
    save_async(repo_url, 1, _shards(x)).result(60)
    h = save_async(repo_url, 1, _shards(x))
    with pytest.raises(Exception) as ei:
        h.result(60)
    assert type(ei.value).__name__ == "StepAlreadyCommittedError"


def test_write_rate_limit_and_jitter_pace_the_writes(tmp_path):
    """The rate limit bounds bytes/s: 1 MiB at 4 MiB/s cannot finish in under 0.25 s (a lower bound
    that only pacing produces; no assert on speed)."""
    import time
    from ckptfmt import SaveOptions, save
    x = np.ones((1024, 256), np.float32)  # 1 MiB in 4 blocks
    shards = [LocalShard("x", x.shape, x.dtype, Box((r * 256, 0), (256, 256)), x[r * 256:(r + 1) * 256]) for r in range(4)]
    t = time.monotonic()
    save(str(tmp_path / "paced"), 1, shards, options=SaveOptions(max_write_bytes_per_s=4 << 20, jitter_s=0.2))
    paced = time.monotonic() - t
    assert paced >= 0.25  # 1 MiB at 4 MiB/s cannot take less than 0.25 s
    assert np.array_equal(Repository(str(tmp_path / "paced")).open().read("x"), x)


def test_background_worker_lets_go_of_a_finished_job_while_it_waits_for_the_next():
    """A job holds what its save staged (a whole state's host copies): once it has run, the idle
    worker must not keep it alive until the next job or its idle timeout. The worker thread is
    still waiting when the job is gone (the release is not the thread's exit). Control: a job that
    something else still holds is seen alive by the same check."""
    import threading
    import time
    import weakref

    from ckptfmt.session.asyncsave import BackgroundWorker

    class Job:
        def __init__(self) -> None:
            self.staged = np.ones(1 << 16)
            self.ran = threading.Event()

        def __call__(self) -> None:
            self.ran.set()

    def gone_after_run(w: BackgroundWorker, *, held_elsewhere: bool, wait_s: float) -> bool:
        job = Job()
        ref, ran = weakref.ref(job), job.ran
        holder = job if held_elsewhere else None
        w.submit(job)
        del job
        assert ran.wait(10)
        deadline = time.monotonic() + wait_s
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = ref() is None
        del holder
        return gone

    w = BackgroundWorker("ckptfmt-test-release", idle_s=60)
    assert gone_after_run(w, held_elsewhere=False, wait_s=10), "the idle worker still holds its last job"
    assert w._thread is not None and w._thread.is_alive()
    assert not gone_after_run(w, held_elsewhere=True, wait_s=0.5)  # control: held elsewhere, seen alive
    w.stop()


def test_background_worker_reuses_one_thread_and_restarts_after_idle_or_stop():
    import threading
    import time

    from ckptfmt.session.asyncsave import BackgroundWorker

    w = BackgroundWorker("ckptfmt-test", idle_s=0.2)
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    for k in range(3):  # in order, on one thread: no thread start per job
        w.submit(lambda k=k: seen.append((k, threading.get_ident())))
    w.submit(done.set)
    assert done.wait(10)
    assert [k for k, _ in seen] == [0, 1, 2] and len({t for _, t in seen}) == 1
    first = w._thread
    deadline = time.monotonic() + 10
    while first.is_alive() and time.monotonic() < deadline:  # idle: the thread ends
        time.sleep(0.05)
    assert not first.is_alive()
    again = threading.Event()
    w.submit(again.set)  # a new thread picks up the next job
    assert again.wait(10)
    w.stop()
    stopped = threading.Event()
    w.submit(stopped.set)  # after stop() too
    assert stopped.wait(10)
    w.stop()
