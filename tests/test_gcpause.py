"""Python's cyclic collector is paused while a save runs (ckptfmt.gcpause, SaveOptions.pause_gc):
the pause nests, spans threads, restores what it found, and a save under it starts no automatic
collection, where the same save with ``pause_gc=False`` (the control) starts several."""
from __future__ import annotations

import gc
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

import ckptfmt
from ckptfmt.gcpause import paused_gc


@contextmanager
def _collector(enabled: bool) -> Iterator[None]:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


def test_the_pause_nests_and_resumes_the_collector_it_found_enabled():
    with _collector(True):
        with paused_gc():
            assert not gc.isenabled()
            with paused_gc():
                assert not gc.isenabled()
            assert not gc.isenabled(), "the inner pause's end must not resume the collector"
        assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    with _collector(False):
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()


def test_enabled_false_leaves_the_collector_alone():
    with _collector(True):
        with paused_gc(False):
            assert gc.isenabled()
        assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_resume_once_the_last_ends():
    inside, leave_a, a_left = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with paused_gc():
            inside.set()
            leave_a.wait(10)
        a_left.set()

    with _collector(True):
        t = threading.Thread(target=a)
        t.start()
        assert inside.wait(10)
        with paused_gc():
            leave_a.set()
            assert a_left.wait(10)
            assert not gc.isenabled(), "another thread's pause ended while this one is open"
        t.join(10)
        assert gc.isenabled()


def _shards(n: int) -> list[ckptfmt.LocalShard]:
    out = []
    for i in range(n):
        a = np.full((4, 2), i, np.float32)
        for r in range(2):
            out.append(ckptfmt.LocalShard(f"t{i:04d}", (8, 2), a.dtype, ckptfmt.Box((4 * r, 0), (4, 2)), a))
    return out


@contextmanager
def _collections(ends: tuple[str, ...], threshold: tuple[int, int, int]) -> Iterator[list[int]]:
    """The generations of the automatic collections that ckptfmt's work starts inside the block,
    under a low ``threshold`` (which makes them certain without a pause). A collection counts when
    its innermost ckptfmt frame is not one of ``ends``: where the pause ends, the first allocation
    after the collector resumes collects."""
    seen: list[int] = []

    def cb(phase: str, info: dict) -> None:
        f = sys._getframe(1)
        while f is not None and "/ckptfmt/" not in f.f_code.co_filename.replace("\\", "/"):
            f = f.f_back
        if phase == "start" and f is not None and f.f_code.co_name not in ends:
            seen.append(info["generation"])

    old = gc.get_threshold()
    gc.set_threshold(*threshold)
    gc.callbacks.append(cb)
    try:
        yield seen
    finally:
        gc.callbacks.remove(cb)
        gc.set_threshold(*old)


def _collections_during_save(tmp_path, name: str, pause: bool) -> tuple[int, bool]:
    """Automatic collections started while a save of 300 small tensors runs, and whether the
    collector was enabled after it."""
    shards = _shards(300)
    with _collector(True):
        with _collections(("paused_gc", "save"), (50, 2, 2)) as seen:
            ckptfmt.save(str(tmp_path / name), 1, shards, options=ckptfmt.SaveOptions(pause_gc=pause))
        after = gc.isenabled()
    return len(seen), after


def test_a_save_starts_no_collection_and_resumes_the_collector(tmp_path):
    paused, after = _collections_during_save(tmp_path, "paused", True)
    assert paused == 0 and after, (paused, after)
    # Control: the same save without the pause starts collections (the check can fail).
    unpaused, after = _collections_during_save(tmp_path, "unpaused", False)
    assert unpaused > 0 and after, (unpaused, after)
    assert ckptfmt.Repository(str(tmp_path / "paused")).steps() == [1]


def test_a_failing_save_resumes_the_collector(tmp_path):
    bad = [ckptfmt.LocalShard("x", (4,), np.dtype(np.float32), ckptfmt.Box((0,), (4,)), np.zeros(4, np.float64))]
    with _collector(True):
        with pytest.raises(ckptfmt.CheckpointError):
            ckptfmt.save(str(tmp_path / "bad"), 1, bad)
        assert gc.isenabled()


def test_a_read_starts_no_collection(tmp_path):
    """The core's read_boxes runs paused; the control runs the same read unpaused (``__wrapped__``)
    and starts collections, so the check can fail."""
    ckptfmt.save(str(tmp_path / "r"), 1, _shards(300))
    ck = ckptfmt.Repository(str(tmp_path / "r")).open(1)
    requests = [(f"t{i:04d}", ckptfmt.Box((0, 0), (8, 2))) for i in range(300)]
    counts = []
    for read in (ck.read_boxes, lambda r: type(ck).read_boxes.__wrapped__(ck, r)):
        with _collector(True):
            with _collections(("paused_gc", "run"), (20, 2, 2)) as seen:
                out = read(requests)
            assert gc.isenabled()
        assert all(np.array_equal(o, np.full((8, 2), i, np.float32)) for i, o in enumerate(out))
        counts.append(len(seen))
    assert counts[0] == 0 and counts[1] > 0, counts


def test_a_held_pause_opened_on_one_thread_is_closed_on_another_once():
    """An asynchronous save's pause (HeldPause) is opened by the caller's thread and closed by the
    save's: the collector stays paused until then, a second close does nothing (it must not end
    another pause), and ``enabled=False`` pauses nothing. Control: the collector is enabled
    before and after, so each check of 'paused' can fail."""
    from ckptfmt.gcpause import HeldPause

    with _collector(True):
        held = HeldPause()
        assert not gc.isenabled()
        with paused_gc():
            t = threading.Thread(target=held.close)
            t.start()
            t.join(10)
            assert not gc.isenabled(), "the held pause's close ended the open block's pause"
            held.close()
            assert not gc.isenabled(), "a second close ended another pause"
        assert gc.isenabled()
        HeldPause(False).close()
        assert gc.isenabled()


def _async_save(tmp_path, name: str, pause: bool, fail: bool = False) -> dict:
    """An asynchronous save through ``start_async`` of 300 small tensors: whether the collector
    was enabled when the stage ran (the caller's thread), while the background save ran, when
    what the save staged was freed, and after the save ended."""
    import time
    import weakref

    seen: dict = {}
    shards = _shards(300)

    class Marker:  # freed with what the save staged
        pass

    def stage():
        seen["stage_enabled"] = gc.isenabled()
        if fail:
            raise ValueError("staging failed")
        held = Marker()  # only the save's closure holds it
        weakref.finalize(held, lambda: seen.setdefault("freed_enabled", gc.isenabled()))

        def run():
            seen["run_enabled"] = gc.isenabled()
            assert held is not None
            return ckptfmt.save(str(tmp_path / name), 1, shards, options=ckptfmt.SaveOptions(pause_gc=pause))
        return run, 0

    from ckptfmt.session.asyncsave import start_async

    with _collector(True):
        try:
            h = start_async(stage, step=1, pause_gc=pause)
        except ValueError:
            seen["raised"] = True
        else:
            h.result(60)
        deadline = time.monotonic() + 10
        while not fail and "freed_enabled" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after_enabled"] = gc.isenabled()
    return seen


def test_an_async_save_pauses_the_collector_from_its_stage_to_its_end(tmp_path):
    """From before the caller's stage until the background save ends, and what the save staged is
    freed while still paused (so the collections the stage would start cannot promote it to the
    oldest generation: docs/profile-save.md); then the collector is enabled again, also after a
    stage that raises. Control: with ``pause_gc=False`` the collector is enabled throughout."""
    got = _async_save(tmp_path, "paused", True)
    assert got == {"stage_enabled": False, "run_enabled": False, "freed_enabled": False, "after_enabled": True}, got
    failed = _async_save(tmp_path, "failed", True, fail=True)
    assert failed["raised"] and failed["after_enabled"] and not failed["stage_enabled"], failed
    control = _async_save(tmp_path, "unpaused", False)
    assert control == {"stage_enabled": True, "run_enabled": True, "freed_enabled": True, "after_enabled": True}, control
    assert ckptfmt.Repository(str(tmp_path / "paused")).steps() == [1]
