"""The checkpoint manager's local tier (FORMAT.md 8.5): the object ``CheckpointManager`` holds as
``tiers`` when it was given ``local=LocalTier(...)``, and the hooks a framework passes it.

:class:`TierHooks` is the framework's part (the data plane to the peers, the host copy of a state,
the boxes a target needs, the state built from them); the core's hooks serve flat dicts of numpy
arrays in one process, and the JAX and torch managers hand in their own. :class:`LocalTiers` is the
rest: the cadence and the local save (:mod:`ckptfmt.manager._tiers`), and the restore that every
rank agrees on (:mod:`ckptfmt.manager._tierrestore`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.coord import Coordinator
from ckptfmt.errors import CheckpointError
from ckptfmt.manager._tierrestore import (feasible_steps, held_tensors, inventory, persistent_token, step_token,
                                         tiered_read)
from ckptfmt.manager._tiers import TIERS_KEY, LocalTier, PeerExchange, TierSave, TierWriter
from ckptfmt.manager._values import RestoreResult, _err_json
from ckptfmt.repository import Repository
from ckptfmt.session._saveopts import SaveOptions

__all__ = ["LocalTiers", "TierHooks"]

_log = logging.getLogger("ckptfmt.manager")


class TierHooks:
    """A framework's part of the local tier. These are the core's, for flat dicts of numpy arrays
    in one process; a bridge's manager passes a subclass. A restore through the tiers calls
    :meth:`requests` then :meth:`build`, in that order, on every rank."""

    def new_exchange(self, world: int) -> PeerExchange | None:
        """The data plane to the peers (the framework's collectives), or None; the core has none."""
        return None

    def snapshot(self, state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
        """This process's own boxes as host copies [(key, global shape, dtype, box, array)], and the
        global state a restore hands to :meth:`build`. Blocks the caller."""
        if not isinstance(state, Mapping):
            raise TypeError("the core manager saves a flat dict of numpy arrays; use a bridge's manager for others")
        boxes = [(str(k), np.shape(a), np.asarray(a).dtype, Box.full(np.shape(a)), np.array(a)) for k, a in state.items()]
        return boxes, {"extra": extra}

    def requests(self, target: Any, tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None
                 ) -> list[tuple[str, Box]] | None:
        """The boxes a restore into ``target`` needs on this process, or None (the tiers cannot
        serve this target: the ordinary restore runs). ``tensors``: the global tensors the local
        steps hold (key -> global shape, dtype name; :func:`held_tensors`), for a framework that maps
        the target to the checkpoint's layout. Never raises."""
        if not isinstance(target, Mapping):
            return None
        return [(str(k), Box.full(np.shape(a))) for k, a in target.items()]

    def build(self, target: Any, values: Mapping[tuple[str, Box], np.ndarray], global_state: Any,
              step: int) -> tuple[Any, Any]:
        """The restored state and extra of ``step``, from the verified boxes."""
        state = {k: values[(str(k), Box.full(np.shape(a)))] for k, a in target.items()}
        return state, (global_state or {}).get("extra")


class LocalTiers:
    """The local tier of one :class:`ckptfmt.manager.CheckpointManager` (``local=LocalTier(...)``).

    ``repository``: the manager's persistent repository; ``coord``: the manager's coordinator (every
    restore gathers through it); ``emit``: where a restore through the tiers records its event (the
    manager's metrics file)."""

    def __init__(self, local: LocalTier, *, rank: int, world: int, url: str, repository: Repository,
                 coord: Coordinator, options: SaveOptions | None, hooks: TierHooks,
                 emit: Callable[[dict[str, Any]], None]) -> None:
        if not isinstance(local, LocalTier):
            raise ValueError(f"local must be a LocalTier or None, got {type(local).__name__}")
        self.local, self.rank, self.world, self.url = local, rank, world, url
        self.persistent, self.coord, self.hooks, self._emit = repository, coord, hooks, emit
        self.writer = TierWriter(local, rank, world, coord, hooks.new_exchange(world), options, repository)
        self.restores = 0  # numbers each restore's collectives; every rank counts the same

    # ------------------------------------------------------------------ save
    @property
    def history(self) -> tuple[TierSave, ...]:
        """Every finished local save of this process, oldest first."""
        return tuple(self.writer.history)

    def save(self, step: int, state: Any, extra: Any, rank_state: Any, force: bool) -> bool:
        """Start a local save of ``step`` when its cadence (or ``force``) says so. Blocks for the
        previous local save and the host copy only (no collective)."""
        writer = self.writer
        if not writer.due(step, force):
            return False
        t0 = time.perf_counter()
        writer.join()
        token = writer.token(step)
        snapshot, gstate = self.hooks.snapshot(state, extra, rank_state)
        writer.start(step, token, snapshot, gstate, time.perf_counter() - t0)
        return True

    def metadata(self, step: int) -> dict[str, Any]:
        """The persistent save's record of the tier token, when this call saved ``step`` locally too."""
        token = self.writer.tokens.get(step)
        return {} if token is None else {TIERS_KEY: {"token": token}}

    def wait(self, timeout: float | None = None) -> TierSave | None:
        return self.writer.join(timeout)

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ restore
    @staticmethod
    def served(stats: Mapping[str, Any] | None) -> dict[str, Any]:
        """An ordinary restore's stats, with ``tiers`` saying the persistent tier served it."""
        out = dict(stats or {})
        out["tiers"] = {"local": 0, "peer": 0, "persistent": int(out.get("bytes_read", 0))}
        return out

    def restore(self, target: Any) -> RestoreResult | None:
        """Restore the newest step some tier holds for every box, if it is a local step no older
        than the newest persistent step; None (on every rank) otherwise, or when any rank fails:
        the ordinary restore then runs. Every rank calls it."""
        n = self.restores
        self.restores += 1
        invs = [{int(s): e for s, e in g["inv"].items()} for g in self._gather(
            f"tiers/restore/{n}/inventory", {"inv": {str(s): e for s, e in inventory(self.writer.repository).items()}})]
        invs = [self._of_this_run(r, inv) for r, inv in enumerate(invs)]
        requests = self.hooks.requests(target, held_tensors(invs))
        try:
            psteps = set(self.persistent.steps())
        except CheckpointError:
            psteps = set()
        persistent = {s: persistent_token(self.persistent, s) for s in {s for inv in invs for s in inv} if s in psteps}
        mine = feasible_steps(self.rank, self.world, invs, requests or [], persistent)
        plan = self._gather(f"tiers/restore/{n}/feasible", {
            "steps": mine, "newest": max(psteps, default=-1), "ok": requests is not None,
            "tokens": {str(s): [step_token(s, invs, persistent.get(s)), s in persistent and persistent[s] ==
                                step_token(s, invs, persistent.get(s))] for s in mine}})
        if not all(p["ok"] for p in plan):
            return None  # some rank's target is not one the tiers serve
        common = set.intersection(*(set(p["steps"]) for p in plan))
        if not common or max(p["newest"] for p in plan) > max(common):
            return None
        step = max(common)
        token, mix = plan[0]["tokens"][str(step)]
        if any(p["tokens"][str(step)] != [token, mix] for p in plan):
            return None  # the ranks see the persistent tier differently: the ordinary restore decides
        return self._finish(target, n, step, token, bool(mix), requests or [], invs)

    def _of_this_run(self, host: int, inv: dict[int, Any]) -> dict[int, Any]:
        """The local steps of one host's inventory that a restore may use: those recording this
        manager's repository's run identity (FORMAT.md 8.5), or all with ``LocalTier(adopt=True)``.
        Every rank filters the same gathered inventories the same way."""
        writer = self.writer
        if writer.tier.adopt:
            return inv
        kept = {s: e for s, e in inv.items() if writer.run is not None and e.get("run") == writer.run}
        for s in sorted(set(inv) - set(kept)):
            if self.rank == host:
                _log.warning("local tier: step %d on host %d belongs to another run (run %s; %s is run %s) and is "
                             "not restored; pass LocalTier(adopt=True) to adopt the tier", s, host, inv[s].get("run"),
                             self.url, writer.run)
        return kept

    def _finish(self, target: Any, n: int, step: int, token: str, mix: bool, requests: list,
                invs: list) -> RestoreResult | None:
        t0 = time.perf_counter()
        served: dict[str, int] = {"local": 0, "peer": 0, "persistent": 0}
        err: BaseException | None = None
        try:
            values, gstate = tiered_read(self.writer, self._gather, self.url, n, step, token, requests, invs, mix,
                                         served)
            state, extra = self.hooks.build(target, values, gstate, step)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = e
        outcome = self._gather(f"tiers/restore/{n}/done", {} if err is None else {"error": _err_json(err)})
        failed = [(r, o["error"]) for r, o in enumerate(outcome) if "error" in o]
        if failed:
            _log.warning("local tier: step %d does not restore through the tiers (rank %d: %s); the ordinary "
                         "restore runs", step, failed[0][0], failed[0][1])
            return None
        _log.info("restored step %d through the tiers: %s bytes by tier (%.1f ms)", step, served,
                  (time.perf_counter() - t0) * 1e3)
        self._emit({"event": "restore", "step": step, "tiers": served, "unix": time.time()})
        return RestoreResult(state, step, (), extra, {"tiers": dict(served), "tier_token": token,
                                                       "restore_s": time.perf_counter() - t0})

    def _gather(self, name: str, obj: Any) -> list[Any]:
        raw = msgpack.packb(obj, use_bin_type=True)
        got = [raw] if self.world == 1 else self.coord.allgather(name, raw)
        return [msgpack.unpackb(b, raw=False, strict_map_key=False) for b in got]
