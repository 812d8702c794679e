"""The checkpoint manager's tier hooks: what ``CheckpointManager`` calls for its local tier (FORMAT.md 8.5).

The bridge hooks here (``_new_exchange``, ``_tier_snapshot``, ``_tier_requests``,
``_tier_build``) are the core's, for flat dicts of numpy arrays in one process; the JAX and torch
managers override them. The save side is :mod:`ckptfmt.manager._tiers`, the restore side
:mod:`ckptfmt.manager._tierrestore`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import CheckpointError
from ckptfmt.manager._tierrestore import (feasible_steps, held_tensors, inventory, persistent_token, step_token,
                                         tiered_read)
from ckptfmt.manager._tiers import TIERS_KEY, LocalTier, PeerExchange, TierSave, TierWriter
from ckptfmt.manager._values import RestoreResult, _err_json

__all__ = ["TierMixin"]

_log = logging.getLogger("ckptfmt.manager")


class TierMixin:
    """The local tier of a :class:`ckptfmt.manager.CheckpointManager` (``local=LocalTier(...)``)."""

    rank: int
    world: int
    url: str
    _coord: Any

    def _init_tiers(self, local: LocalTier | None) -> None:
        if local is not None and not isinstance(local, LocalTier):
            raise ValueError(f"local must be a LocalTier or None, got {type(local).__name__}")
        self.local = local
        self._tiers = None if local is None else TierWriter(local, self.rank, self.world, self._coord,
                                                            self._new_exchange(), self.options,  # type: ignore[attr-defined]
                                                            self.repository)  # type: ignore[attr-defined]
        self._tier_restores = 0

    # ------------------------------------------------------------------ bridge hooks
    def _new_exchange(self) -> PeerExchange | None:
        """The data plane to the peers (the framework's collectives). Bridge hook; the core has none."""
        return None

    def _tier_snapshot(self, state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
        """This process's own boxes as host copies [(key, global shape, dtype, box, array)], and the
        global state a restore hands to :meth:`_tier_build`. Bridge hook; blocks the caller."""
        if not isinstance(state, Mapping):
            raise TypeError("the core manager saves a flat dict of numpy arrays; use a bridge's manager for others")
        boxes = [(str(k), np.shape(a), np.asarray(a).dtype, Box.full(np.shape(a)), np.array(a)) for k, a in state.items()]
        return boxes, {"extra": extra}

    def _tier_requests(self, target: Any, tensors: Mapping[str, tuple[tuple[int, ...], str]] | None = None
                       ) -> list[tuple[str, Box]] | None:
        """The boxes a restore into ``target`` needs on this process, or None (the tiers cannot
        serve this target: the ordinary restore runs). ``tensors``: the global tensors the local
        steps hold (key -> global shape, dtype name; :func:`held_tensors`), for a bridge that maps
        the target to the checkpoint's layout. Bridge hook; never raises."""
        if not isinstance(target, Mapping):
            return None
        return [(str(k), Box.full(np.shape(a))) for k, a in target.items()]

    def _tier_build(self, target: Any, values: Mapping[tuple[str, Box], np.ndarray], global_state: Any,
                    step: int) -> tuple[Any, Any]:
        """The restored state and extra of ``step``, from the verified boxes. Bridge hook."""
        state = {k: values[(str(k), Box.full(np.shape(a)))] for k, a in target.items()}
        return state, (global_state or {}).get("extra")

    # ------------------------------------------------------------------ save
    @property
    def tier_history(self) -> tuple[TierSave, ...]:
        """Every finished local save of this process, oldest first."""
        return () if self._tiers is None else tuple(self._tiers.history)

    def _tier_save(self, step: int, state: Any, extra: Any, rank_state: Any, force: bool) -> bool:
        """Start a local save of ``step`` when its cadence (or ``force``) says so. Blocks for the
        previous local save and the host copy only (no collective)."""
        tiers = self._tiers
        if tiers is None or not tiers.due(step, force):
            return False
        t0 = time.perf_counter()
        tiers.join()
        token = tiers.token(step)
        snapshot, gstate = self._tier_snapshot(state, extra, rank_state)
        tiers.start(step, token, snapshot, gstate, time.perf_counter() - t0)
        return True

    def _tier_metadata(self, step: int) -> dict[str, Any]:
        """The persistent save's record of the tier token, when this call saved ``step`` locally too."""
        token = None if self._tiers is None else self._tiers.tokens.get(step)
        return {} if token is None else {TIERS_KEY: {"token": token}}

    def _tier_wait(self, timeout: float | None = None) -> TierSave | None:
        return None if self._tiers is None else self._tiers.join(timeout)

    def _tier_close(self) -> None:
        if self._tiers is not None:
            self._tiers.close()

    # ------------------------------------------------------------------ restore
    def _tier_served(self, stats: Mapping[str, Any] | None) -> dict[str, Any]:
        """An ordinary restore's stats; with a local tier, ``tiers`` says the persistent tier served it."""
        out = dict(stats or {})
        if self._tiers is not None:
            out["tiers"] = {"local": 0, "peer": 0, "persistent": int(out.get("bytes_read", 0))}
        return out

    def _tier_restore(self, target: Any) -> RestoreResult | None:
        """Restore the newest step some tier holds for every box, if it is a local step no older
        than the newest persistent step; None (on every rank) otherwise, or when any rank fails:
        the ordinary restore then runs. Every rank calls it."""
        tiers = self._tiers
        if tiers is None:
            return None
        n = self._tier_restores
        self._tier_restores += 1
        invs = [{int(s): e for s, e in g["inv"].items()} for g in self._gather(
            f"tiers/restore/{n}/inventory", {"inv": {str(s): e for s, e in inventory(tiers.repository).items()}})]
        invs = [self._of_this_run(r, inv) for r, inv in enumerate(invs)]
        requests = self._tier_requests(target, held_tensors(invs))
        try:
            psteps = set(self.repository.steps())  # type: ignore[attr-defined]
        except CheckpointError:
            psteps = set()
        persistent = {s: persistent_token(self.repository, s)  # type: ignore[attr-defined]
                      for s in {s for inv in invs for s in inv} if s in psteps}
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
        return self._tier_finish(target, n, step, token, bool(mix), requests or [], invs)

    def _of_this_run(self, host: int, inv: dict[int, Any]) -> dict[int, Any]:
        """The local steps of one host's inventory that a restore may use: those recording this
        manager's repository's run identity (FORMAT.md 8.5), or all with ``LocalTier(adopt=True)``.
        Every rank filters the same gathered inventories the same way."""
        tiers = self._tiers
        if tiers is None or tiers.tier.adopt:
            return inv
        kept = {s: e for s, e in inv.items() if tiers.run is not None and e.get("run") == tiers.run}
        for s in sorted(set(inv) - set(kept)):
            if self.rank == host:
                _log.warning("local tier: step %d on host %d belongs to another run (run %s; %s is run %s) and is "
                             "not restored; pass LocalTier(adopt=True) to adopt the tier", s, host, inv[s].get("run"),
                             self.url, tiers.run)
        return kept

    def _tier_finish(self, target: Any, n: int, step: int, token: str, mix: bool, requests: list,
                     invs: list) -> RestoreResult | None:
        t0 = time.perf_counter()
        served: dict[str, int] = {"local": 0, "peer": 0, "persistent": 0}
        err: BaseException | None = None
        try:
            values, gstate = tiered_read(self, step, token, requests, invs, mix, served)
            state, extra = self._tier_build(target, values, gstate, step)
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
        self._emit({"event": "restore", "step": step, "tiers": served, "unix": time.time()})  # type: ignore[attr-defined]
        return RestoreResult(state, step, (), extra, {"tiers": dict(served), "tier_token": token,
                                                       "restore_s": time.perf_counter() - t0})

    def _gather(self, name: str, obj: Any) -> list[Any]:
        raw = msgpack.packb(obj, use_bin_type=True)
        got = [raw] if self.world == 1 else self._coord.allgather(name, raw)
        return [msgpack.unpackb(b, raw=False, strict_map_key=False) for b in got]
