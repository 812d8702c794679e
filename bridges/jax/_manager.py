"""``bridges.jax.CheckpointManager``: the core manager with the JAX bridge's verbs and JAX's collectives.

Everything but the hooks below lives in :mod:`ckptfmt.manager`. The two bridge verbs are called
in :meth:`CheckpointManager._save_verb` and :meth:`CheckpointManager._restore_verb` only.

Preemption: in a ``jax.distributed`` job the coordination service's preemption notifier catches
SIGTERM (on any process) and ``multihost_utils.reached_preemption_sync_point`` turns it into one
step that every process agrees on; the manager then installs no signal handler of its own. In a
single process without ``jax.distributed`` the core's SIGTERM flag is used.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping

import jax
from jax._src import distributed  # the preemption sync manager is not public API in jax 0.10
from jax.experimental import multihost_utils

from ckptfmt import LocalCoordinator
from ckptfmt.asyncsave import RetrySchedule
from ckptfmt.manager import CheckpointManager as _CoreManager
from ckptfmt.manager import TierHooks, distinct_boxes
from ckptfmt.manifest import Manifest

from bridges.jax import _peer as _jaxpeer
from bridges.jax._api import _save, _stage_snapshot, restore
from bridges.jax._coord import JaxCoordinator

__all__ = ["CheckpointManager"]

_instances = itertools.count()  # every process constructs its managers in the same order


def _sync_manager() -> Any:
    if distributed.global_state.client is None:
        return None
    return distributed.global_state.preemption_sync_manager


class JaxTierHooks(TierHooks):
    """The local tier's JAX part (FORMAT.md 8.5): the data plane and the boxes of a pytree live in
    bridges.jax._peer. :meth:`snapshot` keeps its host copies in ``staged`` for the persistent save
    of the same ``save()`` call (the manager takes and clears them)."""

    def __init__(self) -> None:
        self.staged: tuple[Any, Any] | None = None  # (state, its staged leaves) within one save() call

    def new_exchange(self, world: int) -> Any:
        return _jaxpeer.JaxPeerExchange() if world > 1 else None

    def snapshot(self, state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
        leaves, global_state, shards = _stage_snapshot(state, extra, rank_state)
        self.staged = (state, leaves)  # the host copies, kept for this call's persistent save
        return distinct_boxes(shards), global_state

    def take_staged(self, state: Any) -> Any:
        """The staged leaves of ``state`` if the snapshot of this call made them, else None; clears them."""
        staged = self.staged[1] if self.staged is not None and self.staged[0] is state else None
        self.staged = None
        return staged

    def requests(self, target: Any, tensors: Any = None) -> Any:
        return _jaxpeer.requests(target)

    def build(self, target: Any, values: Mapping[Any, Any], global_state: Any, step: int) -> tuple[Any, Any]:
        return _jaxpeer.build(target, values, global_state)


class CheckpointManager(_CoreManager):
    """The checkpoint manager for JAX pytrees; see :class:`ckptfmt.manager.CheckpointManager`.

    ``save(step, state, ...)`` takes the pytree ``bridges.jax.save`` takes; ``restore(target)``
    takes the target ``bridges.jax.restore`` takes and returns a RestoreResult whose ``state`` is
    the restored pytree and whose ``stats`` are that restore's phase timings. Every process of a
    ``jax.distributed`` job constructs the manager (after ``jax.distributed.initialize()``), saves
    and restores.

    ``all_steps()``, ``metrics(step)``, ``best_step()`` and ``restore(target, best=True)`` are the
    core manager's (rank 0 picks the best step for every process). ``local=LocalTier(path, every=10,
    keep=2)`` keeps a local tier with peer replicas, restored from first (FORMAT.md 8.5).
    """

    def _process(self) -> tuple[int, int]:
        return int(jax.process_index()), int(jax.process_count())

    def _new_coordinator(self) -> Any:
        n = next(_instances)
        if self.world == 1:
            return LocalCoordinator()
        return JaxCoordinator(prefix=f"manager-{n}", timeout_s=self.options.timeout_s if self.options else 300.0)

    # The only two calls into the bridge's verbs (the bridge contract: bridges/README.md).
    def _save_verb(self, step: int, state: Any, *, extra: Any, metadata: Mapping[str, Any], rank_state: Any,
                   blocking: bool, retry: RetrySchedule | None = None) -> Callable[[], Manifest]:
        # The local tier's host copies of this very state, made in this save() call: the persistent
        # save writes from them too (both only read them), so the state is copied once.
        staged = self._jax_hooks.take_staged(state) if self._jax_hooks is not None else None
        out = _save(self.repository, state, step=step, extra=extra, rank_state=rank_state, blocking=blocking,
                    coordinator=None, options=self.options, metadata=metadata, staged=staged, retry=retry)
        return (lambda: out) if blocking else out.result

    def _restore_verb(self, target: Any, step: int, rank_state_policy: str | None = None
                      ) -> tuple[Any, Any, Mapping[str, Any]]:
        stats: dict[str, Any] = {}  # the restore's own extra: the step is opened once, as in torch
        state = restore(self.url, target, step=step, rank_state_policy=rank_state_policy, stats=stats)
        return state, stats["extra"], stats

    # The local tier (FORMAT.md 8.5): its hooks, kept here too for the staged host copies.
    _jax_hooks: JaxTierHooks | None = None

    def _new_tier_hooks(self) -> JaxTierHooks:
        self._jax_hooks = JaxTierHooks()
        return self._jax_hooks

    def save(self, step: int, state: Any, *, extra: Any = None, metrics: Mapping[str, Any] | None = None,
             force: bool = False, rank_state: Any = None) -> bool:
        """:meth:`ckptfmt.manager.CheckpointManager.save`; at a step where the local tier and the
        persistent save are both due, the state is copied to host memory once, for both."""
        try:
            return super().save(step, state, extra=extra, metrics=metrics, force=force, rank_state=rank_state)
        finally:
            if self._jax_hooks is not None:
                self._jax_hooks.staged = None  # the host copies never outlive the call that made them

    def _own_sigterm(self) -> bool:
        # Decided once, at construction: a Python handler would replace the notifier's own.
        self._jax_sync = _sync_manager() is not None
        return not self._jax_sync

    def _agree_preemption(self, step: int, local: bool) -> bool:
        if not self._jax_sync:
            return super()._agree_preemption(step, local)
        return bool(multihost_utils.reached_preemption_sync_point(step))
