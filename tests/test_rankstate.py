"""ckptfmt.rankstate: the per-rank state policies and the one decision on a topology change
(FORMAT.md 7.4, revision 1.2.7), and the core's public verbs that check a policy before any read
(issue 49 item 7). The bridges' side of the same rules: tests/bridgeproc/contract.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ckptfmt import Box, CheckpointError, LocalShard, Repository, StorageError, TopologyChangedError, save
from ckptfmt.manager import CheckpointManager
from ckptfmt.rankstate import RANK_STATE_POLICIES, RankStatePolicy, holds_rank_state, rank_state_source
from ckptfmt.storage import DelegatingStorage, open_storage

VALID = [None, "drop", "rank0", "same-rank", RankStatePolicy.SAME_RANK]
INVALID = ["bogus", "Drop", "same_rank", "", 0]


def _shards() -> list[LocalShard]:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    return [LocalShard("x", x.shape, x.dtype, Box.full(x.shape), x)]


def test_policy_names_are_derived_from_the_enum() -> None:
    assert RANK_STATE_POLICIES == ("drop", "rank0", "same-rank")
    assert [RankStatePolicy.of(p) for p in RANK_STATE_POLICIES] == list(RankStatePolicy)
    assert RankStatePolicy.of(None) is None
    assert RankStatePolicy.of(RankStatePolicy.RANK0) is RankStatePolicy.RANK0  # validated once: passes through


@pytest.mark.parametrize("bad", INVALID)
def test_an_unknown_policy_is_a_value_error_naming_the_policies(bad: object) -> None:
    with pytest.raises(ValueError, match="'drop', 'rank0', 'same-rank'") as e:
        RankStatePolicy.of(bad)  # type: ignore[arg-type]
    assert not isinstance(e.value, CheckpointError)  # a usage error, never a property of the checkpoint


def test_rank_state_source_follows_7_4() -> None:
    held, none = ["global", "rank/0", "rank/1"], ["global"]

    def source(names: list[str], world: int | None, policy: RankStatePolicy | None, rank: int = 1) -> int | None:
        return rank_state_source(names, step=6, saved_world=2, rank=rank, world=world, policy=policy)

    assert holds_rank_state(held) and not holds_rank_state(none)
    assert source(held, 2, None) == 1 and source(held, None, None) == 1  # the same world: rank r's own
    assert source(held, 3, RankStatePolicy.DROP) is None
    assert source(held, 3, RankStatePolicy.RANK0, rank=2) == 0
    assert source(held, 3, RankStatePolicy.SAME_RANK, rank=2) == 2  # nothing where rank 2 saved none
    with pytest.raises(TopologyChangedError) as e:
        source(held, 1, None)
    message = str(e.value)
    assert "step 6" in message and "saved by 2 processes" in message and "1 are restoring" in message, message
    assert "'drop', 'rank0', 'same-rank'" in message and "rank_state_policy=" in message, message
    assert (e.value.object, e.value.expected, e.value.found) == ("step 6", "world 2", "world 1")
    # Control (revision 1.2.7): no per-rank state, nothing to hand to the wrong rank, for any world.
    for world in (None, 1, 2, 3):
        for policy in [None, *RankStatePolicy]:
            assert source(none, world, policy) is None


#: The Storage calls that touch the store (every read, stat and listing).
_TOUCHES = frozenset({"read", "read_upto", "larger_than", "read_with_generation", "read_each_with_generation",
                      "read_range", "size_check", "size_faults", "check_no_links", "stamps", "open_positional",
                      "list", "scan_children", "plain_dir", "open_array"})


class _Counted(DelegatingStorage):
    """A real storage that records each call that touches the store (passed in, not patched)."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> object:
        if name in _TOUCHES:
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("policy", VALID + INVALID)
def test_checkpoint_rank_state_checks_the_policy_before_any_read(tmp_path: object, policy: object) -> None:
    url = os.path.join(str(tmp_path), "r")
    save(url, 1, _shards(), rank_state={"cursor": 3})
    storage = _Counted(open_storage(url))
    ck = Repository(url, storage=storage).open(1)
    storage.calls.clear()
    if policy in INVALID:
        with pytest.raises(ValueError, match="unknown rank state policy"):
            ck.rank_state(0, world=2, policy=policy)  # type: ignore[arg-type]
        assert storage.calls == []  # nothing was read
    elif policy is None:  # control: no policy on another world is the topology change, still before a read
        with pytest.raises(TopologyChangedError):
            ck.rank_state(0, world=2)
        assert storage.calls == []
        assert ck.rank_state(0, world=1) == {"cursor": 3} and storage.calls  # the same world reads
    else:  # control: each valid policy is accepted, and a policy that hands state over reads it
        got = ck.rank_state(0, world=2, policy=policy)  # type: ignore[arg-type]
        assert got == (None if policy == "drop" else {"cursor": 3})
        assert bool(storage.calls) == (policy != "drop"), storage.calls


@pytest.mark.parametrize("policy", VALID + INVALID)
def test_manager_restore_checks_the_policy_before_any_read(tmp_path: object, policy: object) -> None:
    """The repository is a regular file: any storage read raises StorageError. A bad policy raises
    ValueError instead, so it was raised before any read; each valid one reaches storage (control)."""
    url = os.path.join(str(tmp_path), "r")
    manager = CheckpointManager(url, async_save=False)
    try:
        with open(url, "wb") as f:
            f.write(b"not a repository")
        expected = ValueError if policy in INVALID else StorageError
        with pytest.raises(expected):
            manager.restore(rank_state_policy=policy)  # type: ignore[arg-type]
    finally:
        manager.close()
