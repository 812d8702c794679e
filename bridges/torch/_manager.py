"""``bridges.torch.CheckpointManager``: the core manager with the torch bridge's verbs and the process group.

Everything but the hooks below lives in :mod:`ckptfmt.manager`. The two bridge verbs are called
in :meth:`CheckpointManager._save_verb` and :meth:`CheckpointManager._restore_verb` only.

Preemption: the core's SIGTERM handler only sets a flag; :meth:`reached_preemption` all-reduces
that flag (MAX) over the default process group at every step, so every rank sees it at the same
step. The manager's own collectives (restore agreement, time cadence) run over a c10d-store
coordinator of their own, never the one a save in flight uses.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ckptfmt import LocalCoordinator
from ckptfmt.asyncsave import RetrySchedule
from ckptfmt.manager import CheckpointManager as _CoreManager
from ckptfmt.manager import TierHooks
from ckptfmt.manifest import Manifest
from ckptfmt.rankstate import RankStatePolicy

from bridges.torch import _peer as _torchpeer
from bridges.torch._api import _save, load
from bridges.torch._coord import TorchCoordinator

__all__ = ["CheckpointManager"]

_instances = itertools.count()  # every rank constructs its managers in the same order


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class TorchTierHooks(TierHooks):
    """The local tier's torch part (FORMAT.md 8.5), through ``mapping`` when there is one: the data
    plane and the boxes of a state dict live in bridges.torch._peer."""

    def __init__(self, mapping: Any = None) -> None:
        self.mapping = mapping
        self.plan: Any = None  # the mapped plan of the restore in progress, from requests() to build()

    def new_exchange(self, world: int) -> Any:
        return _torchpeer.TorchPeerExchange() if world > 1 else None

    def snapshot(self, state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
        return _torchpeer.snapshot(state, extra, rank_state, self.mapping)

    def requests(self, target: Any, tensors: Any = None) -> Any:
        if self.mapping is None:
            return _torchpeer.requests(target)
        # The plan of this restore, kept for build (every tiered restore calls both, in order).
        self.plan = _torchpeer.mapped_requests(target, self.mapping, tensors)
        return None if self.plan is None else self.plan.requests

    def build(self, target: Any, values: Mapping[Any, Any], global_state: Any, step: int) -> tuple[Any, Any]:
        if self.mapping is None:
            return _torchpeer.build(target, values, global_state, step)
        return _torchpeer.mapped_build(target, self.plan, self.mapping, values, global_state, step)


class CheckpointManager(_CoreManager):
    """The checkpoint manager for torch state dicts; see :class:`ckptfmt.manager.CheckpointManager`.

    ``save(step, state_dict, ..., rank_state=...)`` saves what ``bridges.torch.save`` saves;
    ``restore(target)`` takes the target
    ``bridges.torch.load`` takes and returns a RestoreResult whose ``state`` is its ``Loaded``.
    Every rank of the default process group constructs the manager, saves and restores.

    ``all_steps()``, ``metrics(step)``, ``best_step()`` and ``restore(target, best=True)`` are the
    core manager's (rank 0 picks the best step for every process). ``local=LocalTier(path, every=10,
    keep=2)`` keeps a local tier with peer replicas, restored from first (FORMAT.md 8.5); a ``Loaded``
    it serves has ``report`` None, and ``rank_state`` / ``rng`` only from this rank's own tier.

    ``mapping`` (a :class:`bridges.mapping.Mapping`, e.g. ``flax_nnx_to_torch(...)``): the layout of
    this manager's checkpoints on every tier. Saves write through it and restores read through it,
    as ``bridges.torch.save`` / ``load`` with the same mapping do; a restore through the tiers
    plans the target against the tensors the local steps hold (a JAX job's local tier restores
    into a torch target).
    """

    def __init__(self, url: str, *, mapping: Any = None, **kwargs: Any) -> None:
        self.mapping = mapping
        super().__init__(url, **kwargs)

    def _process(self) -> tuple[int, int]:
        return (dist.get_rank(), dist.get_world_size()) if _initialized() else (0, 1)

    def _new_coordinator(self) -> Any:
        n = next(_instances)
        if self.world == 1:
            return LocalCoordinator()
        return TorchCoordinator(namespace=f"ckptfmt/manager/{n}",
                                timeout_s=self.options.timeout_s if self.options else 300.0)

    # The only two calls into the bridge's verbs (the bridge contract: bridges/README.md).
    def _save_verb(self, step: int, state: Any, *, extra: Any, metadata: Mapping[str, Any], rank_state: Any,
                   blocking: bool, retry: RetrySchedule | None = None) -> Callable[[], Manifest]:
        out = _save(self.repository, state, step=step, extra=extra, rank_state=rank_state, blocking=blocking,
                    metadata=metadata, options=self.options, mapping=self.mapping, retry=retry)
        return (lambda: out) if blocking else out.result

    def _restore_verb(self, target: Any, step: int, rank_state_policy: RankStatePolicy | None = None
                      ) -> tuple[Any, Any, Mapping[str, Any]]:
        if target is None:
            raise TypeError("bridges.torch.CheckpointManager.restore needs a target state dict")
        loaded = load(self.url, target, step=step, rank_state_policy=rank_state_policy, mapping=self.mapping)
        return loaded, loaded.extra, {"bytes_read": int(loaded.bytes_read), "saved_world": int(loaded.saved_world)}

    # The local tier (FORMAT.md 8.5): its data plane and hooks live in bridges.torch._peer.
    def _new_tier_hooks(self) -> TorchTierHooks:
        return TorchTierHooks(self.mapping)

    def _agree_preemption(self, step: int, local: bool) -> bool:
        if self.world == 1:
            return local
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag.item()))
