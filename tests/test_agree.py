"""ckptfmt.agree_step: every rank restores the step rank 0 lists, and rank 0's failure reaches
every rank at once (issue 14). Two ranks over a real TcpCoordinator, one thread each; the bridges'
own two-process runs are in tests/test_jax_bridge.py (coord_check) and tests/test_torch_bridge.py
(load_world)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard, Repository, TcpCoordinator, agree_step
from ckptfmt.coord import free_port
from ckptfmt.errors import CheckpointError, CoordinatorTimeoutError, StepNotFoundError, StorageError

TIMEOUT_S = 60.0  # a rank left waiting would raise CoordinatorTimeoutError after this


def _two_ranks(repos: list[Any]) -> list[Any]:
    """agree_step(repos[r], None, ...) on ranks 0 and 1; each rank's step or exception."""
    address = f"127.0.0.1:{free_port()}"
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            with TcpCoordinator(address, r, 2, timeout_s=TIMEOUT_S) as coord:
                out[r] = agree_step(repos[r], None, coord)
        except Exception as e:  # noqa: BLE001 - compared below
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    return out


def _committed(tmp_path, steps: list[int]) -> str:
    url = str(tmp_path / "repo")
    x = np.arange(4, dtype=np.float32)
    for s in steps:
        ckptfmt.save(url, s, [LocalShard("x", x.shape, x.dtype, Box.full(x.shape), x)])
    return url


def test_rank0_listing_error_reaches_every_rank(tmp_path):
    url = _committed(tmp_path, [3, 5])
    bad = tmp_path / "not-a-repository"
    bad.write_text("a regular file: listing manifests/ under it fails")
    got = _two_ranks([Repository(str(bad)), Repository(url)])
    assert isinstance(got[0], StorageError) and isinstance(got[1], StorageError), got
    assert not isinstance(got[1], CoordinatorTimeoutError)
    assert got[1].message.startswith("rank 0: ") and got[1].object == got[0].object == "manifests/", got[1]
    # Control: the same two ranks with rank 0's listing working agree on the latest step.
    assert _two_ranks([Repository(url), Repository(url)]) == [5, 5]


def test_no_committed_step_fails_on_every_rank(tmp_path):
    url = str(tmp_path / "empty")
    got = _two_ranks([Repository(url), Repository(url)])
    assert all(isinstance(e, StepNotFoundError) for e in got), got


class _Listing:
    """A repository whose listing raises ``error`` (an untyped failure: not a CheckpointError)."""

    url = "listing-fails"

    def __init__(self, error: Callable[[], BaseException]) -> None:
        self._error = error

    def latest(self) -> int | None:
        raise self._error()


def test_untyped_error_of_rank0_reaches_the_others_typed(tmp_path):
    url = _committed(tmp_path, [1])
    got = _two_ranks([_Listing(lambda: OSError("connection reset")), Repository(url)])
    assert type(got[0]) is OSError  # rank 0 raises its own error
    assert type(got[1]) is CheckpointError and "rank 0: OSError: connection reset" in str(got[1]), got[1]


def test_a_given_step_needs_no_exchange(tmp_path):
    class NoPeers:  # a coordinator of two ranks whose peer never comes: any collective would fail
        rank, world = 1, 2

        def broadcast(self, *a: Any, **k: Any) -> bytes:
            raise AssertionError("agree_step exchanged a message for a given step")

    assert agree_step(Repository(str(tmp_path / "r")), 7, NoPeers()) == 7
    with pytest.raises(AssertionError):  # control: without a step it does exchange
        agree_step(Repository(str(tmp_path / "r")), None, NoPeers())
