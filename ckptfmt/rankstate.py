"""Per-rank state on a topology change (FORMAT.md 7.4): the policies, and the one decision of which
saved rank's state a restoring process receives. The core and both bridges decide here, so they
raise the same TopologyChangedError with the same message for the same checkpoint and world.

Call order: a public verb (``Checkpoint.rank_state``, a manager's ``restore``, ``bridges.torch.load``,
``bridges.jax.restore``, each bridge's ``load_rank_state``) turns the caller's policy into a
:class:`RankStatePolicy` with :meth:`RankStatePolicy.of` once, before it reads anything, and
passes that value inward; :func:`rank_state_source` (pure: names, numbers, no I/O) then decides.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable

from ckptfmt.errors import TopologyChangedError

__all__ = ["RankStatePolicy", "RANK_STATE_POLICIES", "holds_rank_state", "rank_state_source"]


class RankStatePolicy(enum.StrEnum):
    """What a restoring process receives of per-rank state saved by another number of processes
    (FORMAT.md 7.4). None, where a policy is optional, means "no policy": the same world only."""

    DROP = "drop"  #: nothing: every process starts its per-rank state afresh
    RANK0 = "rank0"  #: rank 0's state, in every process
    SAME_RANK = "same-rank"  #: rank r's state where rank r saved one, and nothing otherwise

    @classmethod
    def of(cls, policy: str | None) -> RankStatePolicy | None:
        """The validated policy: None for None, the member for its name; a RankStatePolicy passes
        through (it was validated where it was made). Anything else raises ValueError naming the
        accepted policies: a caller's mistake, not a property of the checkpoint, so never a
        CheckpointError (FORMAT.md 7.4: "before it reads anything")."""
        if policy is None or isinstance(policy, cls):
            return policy
        if isinstance(policy, str) and policy in _BY_NAME:
            return _BY_NAME[policy]
        raise ValueError(f"unknown rank state policy {policy!r}; expected one of "
                         f"{', '.join(map(repr, RANK_STATE_POLICIES))} or None")


#: The accepted policy names, in FORMAT.md 7.4's order (derived from :class:`RankStatePolicy`).
RANK_STATE_POLICIES: tuple[str, ...] = tuple(p.value for p in RankStatePolicy)
_BY_NAME = {p.value: p for p in RankStatePolicy}


def holds_rank_state(state_names: Iterable[str]) -> bool:
    """Whether a checkpoint holds per-rank state: a ``rank/<r>`` entry among its state objects
    (``manifest.state``'s names, FORMAT.md 5.8, 7.4)."""
    return any(str(name).startswith("rank/") for name in state_names)


def rank_state_source(state_names: Iterable[str], *, step: int, saved_world: int, rank: int, world: int | None,
                      policy: RankStatePolicy | None) -> int | None:
    """The saved rank whose per-rank state restoring process ``rank`` of ``world`` receives, or None
    for nothing (FORMAT.md 7.4, revision 1.2.7). Reads nothing.

    None when the checkpoint holds no per-rank state, whatever the world and the policy. ``world``
    None or equal to ``saved_world``: ``rank``. Otherwise per ``policy`` (already validated:
    :meth:`RankStatePolicy.of`): DROP gives None, RANK0 gives 0, SAME_RANK gives ``rank`` (the
    caller receives nothing where that rank saved none), and None raises TopologyChangedError
    naming the step, the saved and the restoring world, and the policies that resolve it.
    """
    if not holds_rank_state(state_names):
        return None  # nothing per rank was saved: nothing to hand to the wrong rank
    if world is None or int(world) == int(saved_world):
        return rank
    if policy is None:
        raise TopologyChangedError(
            f"step {step} holds per-rank state saved by {saved_world} processes, but {world} are restoring "
            f"(FORMAT.md 7.4); pass a rank state policy (rank_state_policy=; policy= of Checkpoint.rank_state), "
            f"one of {', '.join(map(repr, RANK_STATE_POLICIES))}: 'drop' (start per-rank state afresh), "
            "'rank0' (give every process rank 0's state) or 'same-rank' (rank r gets rank r's state where one "
            "was saved)", object=f"step {step}", expected=f"world {saved_world}", found=f"world {world}")
    if policy is RankStatePolicy.DROP:
        return None
    return 0 if policy is RankStatePolicy.RANK0 else rank
