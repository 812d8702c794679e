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
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.coord import Coordinator
from ckptfmt.errors import CheckpointError
from ckptfmt.manager._tierelastic import elastic_feasible, elastic_read, elastic_sources, host_dirs
from ckptfmt.manager._tierplan import assign_hosts
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
        the ordinary restore then runs. A step saved by another number of hosts than this job's
        processes is restored elastically (:meth:`_restore_elastic`). Every rank calls it."""
        n = self.restores
        self.restores += 1
        own = inventory(self.writer.repository)
        got = self._gather(f"tiers/restore/{n}/inventory", {"inv": {str(s): e for s, e in own.items()},
                                                            "dirs": host_dirs(self.local.path)})
        invs = [{int(s): e for s, e in g["inv"].items()} for g in got]
        invs = [self._of_this_run(r, inv) for r, inv in enumerate(invs)]
        if self._elastic(invs, [g["dirs"] for g in got]):
            return self._restore_elastic(target, n, own, [[int(h) for h in g["dirs"]] for g in got])
        requests = self.hooks.requests(target, held_tensors(invs))
        psteps = self._persistent_steps()
        persistent = {s: persistent_token(self.persistent, s) for s in {s for inv in invs for s in inv} if s in psteps}
        mine = feasible_steps(self.rank, self.world, invs, requests or [], persistent)
        plan = self._gather(f"tiers/restore/{n}/feasible", {
            "steps": mine, "newest": max(psteps, default=-1), "ok": requests is not None,
            "tokens": {str(s): [step_token(s, invs, persistent.get(s)), s in persistent and persistent[s] ==
                                step_token(s, invs, persistent.get(s))] for s in mine}})
        agreed = _agreed(plan)
        if agreed is None:
            return None
        step, token, mix = agreed

        def read(served: dict[str, Any]) -> tuple[Any, Any]:
            return tiered_read(self.writer, self._gather, self.url, n, step, token, requests or [], invs, bool(mix),
                               served)

        return self._finish(target, n, step, token, read)

    def _persistent_steps(self) -> set[int]:
        """The steps the persistent tier lists (none where it cannot be listed)."""
        try:
            return set(self.persistent.steps())
        except CheckpointError:
            return set()

    def _elastic(self, invs: Sequence[Mapping[int, Any]], dirs: Sequence[Sequence[int]]) -> bool:
        """Whether this restore is elastic (FORMAT.md 8.5): the newest local step some process
        holds as its own was saved by another number of hosts than this job's processes, or no
        process holds its own host repository's steps but some process finds another host's."""
        newest = max(((s, e) for inv in invs for s, e in inv.items()), key=lambda se: se[0], default=None)
        if newest is not None:
            return int(newest[1]["hosts"]) != self.world
        return any(int(h) != r for r, hs in enumerate(dirs) for h in hs)

    def _restore_elastic(self, target: Any, n: int, own: Mapping[int, Any], dirs: list[list[int]]
                         ) -> RestoreResult | None:
        """The elastic restore (FORMAT.md 8.5, "Elastic restore"; :mod:`ckptfmt.manager._tierelastic`):
        the host repositories each process finds are assigned to one process each, every process
        plans its boxes against all of them, and all agree on the newest step every process can
        restore from surviving copies (plus the persistent tier for pieces no survivor holds)."""
        held = assign_hosts(dirs)
        mine = sorted(h for h, r in held.items() if r == self.rank)
        opts = {"mapped_reads": self.local.mapped}
        repos = {h: (self.writer.repository if h == self.rank else Repository(self.local.url(h), options=opts))
                 for h in mine}
        invs = {h: (dict(own) if h == self.rank else inventory(repos[h])) for h in mine}
        got = self._gather(f"tiers/restore/{n}/hosts", {"hosts": [[h, {str(s): e for s, e in inv.items()}]
                                                                  for h, inv in invs.items()]})
        held_by: dict[int, tuple[int, dict[int, Any]]] = {}
        for r, g in enumerate(got):
            for h, inv in g["hosts"]:
                if held.get(int(h)) == r:
                    held_by[int(h)] = (r, self._of_this_run(int(h), {int(s): e for s, e in inv.items()}))
        requests = self.hooks.requests(target, held_tensors([inv for _, inv in held_by.values()]))
        psteps = self._persistent_steps()
        steps = {s for _, inv in held_by.values() for s in inv}
        persistent = {s: persistent_token(self.persistent, s) for s in steps if s in psteps}
        feasible = elastic_feasible(self.rank, requests or [], held_by, persistent)
        ordered = [held_by[h][1] for h in sorted(held_by)]
        # The requests go with the vote: every process then plans every process's reads (pure), and
        # the holders send what their peers planned to read without being asked.
        plan = self._gather(f"tiers/restore/{n}/feasible", {
            "steps": feasible, "newest": max(psteps, default=-1), "ok": requests is not None,
            "tokens": {str(s): [step_token(s, ordered, persistent.get(s)),
                                s in persistent and persistent[s] == step_token(s, ordered, persistent.get(s))]
                       for s in feasible},
            "requests": [[k, list(b.offset), list(b.shape)] for k, b in requests or []]})
        agreed = _agreed(plan)
        if agreed is None:
            return None
        step, token, mix = agreed
        sources, hosts = elastic_sources(step, token, held_by)
        everyone = [[(str(k), Box(tuple(o), tuple(sh))) for k, o, sh in p["requests"]] for p in plan]
        digests = {h: (inv.get(step) or {}).get("digest") for h, (_, inv) in held_by.items()}

        def read(served: dict[str, Any]) -> tuple[Any, Any]:
            return elastic_read(rank=self.rank, world=self.world, exchange=self.writer.exchange,
                                gather=self._gather, url=self.url, n=n, step=step, token=token, hosts=int(hosts or 0),
                                mix=bool(mix), requests=everyone, sources=sources, repos=repos, digests=digests,
                                stats=served)

        return self._finish(target, n, step, token, read,
                            elastic={"hosts": hosts, "world": self.world, "held_by": {str(h): r for h, r in held.items()}})

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

    def _finish(self, target: Any, n: int, step: int, token: str, read: Callable[[dict[str, Any]], tuple[Any, Any]],
                elastic: dict[str, Any] | None = None) -> RestoreResult | None:
        t0 = time.perf_counter()
        served: dict[str, Any] = {"local": 0, "peer": 0, "persistent": 0}
        if elastic is not None:
            served.update(persistent_held=0, refused=[])
        err: BaseException | None = None
        try:
            values, gstate = read(served)
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
        record: dict[str, Any] = {"event": "restore", "step": step, "tiers": served, "unix": time.time()}
        stats: dict[str, Any] = {"tiers": dict(served), "tier_token": token, "restore_s": time.perf_counter() - t0}
        if elastic is not None:
            record["elastic"] = stats["elastic"] = elastic
        self._emit(record)
        return RestoreResult(state, step, (), extra, stats)

    def _gather(self, name: str, obj: Any) -> list[Any]:
        raw = msgpack.packb(obj, use_bin_type=True)
        got = [raw] if self.world == 1 else self.coord.allgather(name, raw)
        return [msgpack.unpackb(b, raw=False, strict_map_key=False) for b in got]


def _agreed(plan: Sequence[Mapping[str, Any]]) -> tuple[int, str, bool] | None:
    """(step, token, whether the persistent tier holds that save) every rank's vote agrees on:
    the newest step every rank can restore from the tiers, when no rank's persistent tier lists a
    newer one; None when some rank's target is not one the tiers serve, there is no such step,
    or the ranks see the persistent tier differently (the ordinary restore then decides)."""
    if not all(p["ok"] for p in plan):
        return None
    common = set.intersection(*(set(p["steps"]) for p in plan))
    if not common or max(p["newest"] for p in plan) > max(common):
        return None
    step = max(common)
    token, mix = plan[0]["tokens"][str(step)]
    if any(p["tokens"][str(step)] != [token, mix] for p in plan):
        return None
    return step, token, mix
