"""Faults of kind ``"tier"``: the checkpoint manager's local tier (FORMAT.md 8.5, 14.8).

Peer replicas: two ranks (threads) run the core :class:`ckptfmt.manager.CheckpointManager`
through its bridge hooks (rank and world, a TcpCoordinator each, and :class:`ThreadShift`, an
in-memory :class:`~ckptfmt.manager._tiers.PeerExchange` where the fault is injected). They save
steps 1-6 to the local tier (every 2, keep 2; each host holds its own boxes and a replica of the
next host's); rank 0 saves steps 4 and 6 to the persistent tier with the same tier tokens. Host
1's local tier is then lost, so its restore of step 6 asks host 0 for the replica.

Elastic (FORMAT.md 8.5, "Elastic restore"): three ranks save rows of ``a`` to their local tiers
(each host also keeping the next host's rows); host 1 is lost with no spare, and two ranks
restore, each on the machine that kept host 0's or host 2's tier: rank 1 needs rows 3..6, of
which rows 3..4 only rank 0 holds (host 0's replica of host 1), so rank 0 answers it in the
planned round, where the fault is injected.

The mapped tier: one rank saves with the default :class:`LocalTier`, restores, and then a byte of
the tier's file is rewritten in place; the restored state must not change. Judged by
:func:`_restorejudge.judge`.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ckptfmt.manager import CheckpointManager, LocalTier, PeerExchange, TierHooks
from ckptfmt_tools.faults._restorejudge import LogTap, RestoreAttempt, run_ranks

__all__ = ["ThreadShift", "peer_other_step", "peer_flipped_chunk", "elastic_peer_other_step",
           "elastic_peer_flipped_chunk", "mapped_rewrite", "default_mapped"]

_WORLD = 2


def _state(step: int) -> dict[str, np.ndarray]:
    return {"a": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "b": np.full(5, step, np.int64)}


class ThreadShift:
    """``shift`` between ranks in threads of one process; ``tamper(name, sender, payload)`` may
    change a payload on its way (returns the bytes delivered)."""

    background = False

    def __init__(self, world: int, tamper: Any = None) -> None:
        self.world, self.tamper = world, tamper
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def at(self, rank: int) -> Any:
        group = self

        class _Rank:
            background = False

            def shift(self, name: str, payload: Any, offset: int) -> Any:
                data = bytes(memoryview(payload).cast("B"))
                if group.tamper is not None:
                    data = group.tamper(name, rank, data)
                group.slots[rank] = data
                group.barrier.wait()
                got = group.slots[(rank - offset) % group.world]
                group.barrier.wait()
                return got
        return _Rank()


class _Hooks(TierHooks):
    """The core's tier hooks, with the in-memory exchange of one rank as the data plane."""

    def __init__(self, exchange: PeerExchange) -> None:
        self.exchange = exchange

    def new_exchange(self, world: int) -> PeerExchange | None:
        return self.exchange


class _Rank(CheckpointManager):
    """The core manager as one rank of ``world`` (the bridge hooks a bridge's manager overrides)."""

    def __init__(self, url: str, rank: int, world: int, address: str, exchange: Any, **kw: Any) -> None:
        self._where = (rank, world, address, exchange)
        super().__init__(url, **kw)

    def _process(self) -> tuple[int, int]:
        return self._where[0], self._where[1]

    def _new_coordinator(self) -> Any:
        from ckptfmt.coord import TcpCoordinator

        return TcpCoordinator(self._where[2], self._where[0], self._where[1], timeout_s=60)

    def _new_tier_hooks(self) -> TierHooks:
        return _Hooks(self._where[3].at(self._where[0]))

    def _own_sigterm(self) -> bool:
        return False


def _managers(persistent: str, tier: LocalTier, exchange: ThreadShift, fn: Any, **kw: Any) -> list[Any]:
    from ckptfmt.coord import free_port

    address = f"127.0.0.1:{free_port()}"

    def rank(r: int) -> Any:
        with _Rank(persistent, r, _WORLD, address, exchange, local=tier, async_save=False, **kw) as m:
            return fn(r, m)
    return run_ranks(_WORLD, rank)


def _saved(run_dir: Path) -> tuple[str, LocalTier]:
    """Steps 1-6 on the local tier of 2 hosts; steps 4 and 6 on the persistent tier, same tokens."""
    import ckptfmt
    from ckptfmt import Box, LocalShard
    from ckptfmt.manager._tiers import TIERS_KEY

    persistent, tier = str(run_dir / "persistent"), LocalTier(str(run_dir / "local"), every=2, keep=2)

    def save(r: int, m: Any) -> dict[int, str]:
        for step in range(1, 7):
            m.save(step, _state(step), extra={"step": step})
            m.wait()
        return {t.step: t.token for t in m.tier_history if t.committed}
    tokens = _managers(persistent, tier, ThreadShift(_WORLD), save)
    if not all(isinstance(t, dict) and sorted(t) == [2, 4, 6] for t in tokens):
        raise RuntimeError(f"fixture error: the local saves failed: {tokens}")
    for step in (4, 6):
        st = _state(step)
        ckptfmt.save(persistent, step, [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in st.items()],
                     state={"extra": {"step": step}}, metadata={TIERS_KEY: {"token": tokens[0][step]}})
    shutil.rmtree(tier.url(1))  # host 1 lost: its restore asks host 0 for the replica
    return persistent, tier


def _restore(run_dir: Path, ctx: Any, tamper: Any, where: str) -> RestoreAttempt:
    persistent, tier = _saved(run_dir)
    hits: list[str] = []

    def fault(name: str, sender: int, data: bytes) -> bytes:
        if ctx.restore_clean:
            return data
        changed = tamper(name, sender, data)
        if changed != data:
            hits.append(f"{name} from rank {sender} changed on its way")
        return changed

    def restore(r: int, m: Any) -> Any:
        got = m.restore(_state(0))
        return {"step": got.step, "state": got.state, "tiers": got.stats.get("tiers")}
    with LogTap() as tap:
        ranks = _managers(persistent, tier, ThreadShift(_WORLD, fault), restore)
    truth = [_state(6)] * _WORLD
    notes = [f"rank {r}: step {g['step']}, bytes by tier {g['tiers']}"
             + (" (the tiered restore was refused on every rank: the ordinary restore served it)"
                if not any((g["tiers"] or {}).values()) else "")
             for r, g in enumerate(ranks) if isinstance(g, dict)]
    values = [g["state"] if isinstance(g, dict) and g["step"] == 6 else ({} if isinstance(g, dict) else g)
              for g in ranks]
    wrong_step = [r for r, g in enumerate(ranks) if isinstance(g, dict) and g["step"] != 6]
    if wrong_step:
        notes.append(f"rank(s) {wrong_step} restored another step than 6")
        values = [{"a": None} if r in wrong_step else v for r, v in enumerate(values)]
    hosts = tuple(tier.url(h) for h in range(_WORLD))
    return RestoreAttempt(where, values, truth, prior=(persistent, 6, _state(6), {"extra": {"step": 6}}),
                          repos=(persistent, *hosts), fallback=True,
                          detected=tap.named(["StepMismatchError", "ChecksumMismatchError"]),
                          reached=ctx.restore_clean or bool(hits), notes=hits + notes)


def peer_other_step(run_dir: Path, ctx: Any) -> RestoreAttempt:
    def tamper(name: str, sender: int, data: bytes) -> bytes:
        if name == "tiers/restore/6/ask" and sender == 1:  # the holder is asked, and serves, step 4
            ask = msgpack.unpackb(data, raw=False)
            return msgpack.packb(dict(ask, step=4))
        return data
    return _restore(run_dir, ctx, tamper, "local tier, 2 hosts, host 1's tier lost: host 0 asked for host 1's "
                    "replica of step 6 answers with step 4's (asked 6, serves 4)")


def peer_flipped_chunk(run_dir: Path, ctx: Any) -> RestoreAttempt:
    def tamper(name: str, sender: int, data: bytes) -> bytes:
        if name == "tiers/restore/6/serve" and sender == 0:
            doc = msgpack.unpackb(data, raw=False)
            if doc.get("chunks"):
                c = bytearray(doc["chunks"][0])
                c[0] ^= 0xFF
                doc["chunks"][0] = bytes(c)
                return msgpack.packb(doc, use_bin_type=True)
        return data
    return _restore(run_dir, ctx, tamper, "local tier, 2 hosts, host 1's tier lost: one byte of a chunk of host 0's "
                    "replica answer flipped on its way to host 1")


def _rows_state(step: int) -> dict[str, np.ndarray]:
    return {"a": np.arange(24, dtype=np.float32).reshape(6, 4) + step, "b": np.full(5, step, np.int64)}


class _RowHooks(_Hooks):
    """Rank ``r`` of ``world`` holds rows ``[6r/world, 6(r+1)/world)`` of ``a`` (and all of ``b``):
    another process count cuts ``a`` along other rows, so an elastic restore reads pieces of
    several hosts' boxes."""

    def __init__(self, exchange: PeerExchange, rank: int, world: int) -> None:
        super().__init__(exchange)
        self.rank, self.world = rank, world

    def rows(self) -> Any:
        from ckptfmt import Box

        n = 6 // self.world
        return Box((n * self.rank, 0), (n, 4))

    def snapshot(self, state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
        from ckptfmt import Box

        r = self.rows()
        a, b = state["a"], state["b"]
        return ([("a", a.shape, a.dtype, r, np.array(a[r.slices()])), ("b", b.shape, b.dtype, Box.full(b.shape),
                                                                       np.array(b))], {"extra": extra})

    def requests(self, target: Any, tensors: Any = None) -> Any:
        from ckptfmt import Box

        return [("a", self.rows()), ("b", Box.full(np.shape(target["b"])))]

    def build(self, target: Any, values: Any, global_state: Any, step: int) -> tuple[Any, Any]:
        from ckptfmt import Box

        return ({"a": values[("a", self.rows())], "b": values[("b", Box.full(np.shape(target["b"])))]},
                (global_state or {}).get("extra"))


class _RowRank(_Rank):
    def _new_tier_hooks(self) -> TierHooks:
        rank, world, _, exchange = self._where
        return _RowHooks(exchange.at(rank), rank, world)


def _elastic_restore(run_dir: Path, ctx: Any, tamper: Any, where: str) -> RestoreAttempt:
    """Three hosts save steps 2, 4, 6 locally (4 and 6 also persistent, same tokens); host 1 is
    lost; two ranks restore elastically, each on the machine that kept host 0's or host 2's tier."""
    import ckptfmt
    from ckptfmt import Box, LocalShard
    from ckptfmt.coord import free_port
    from ckptfmt.manager._tiers import TIERS_KEY

    persistent, saved = str(run_dir / "persistent"), LocalTier(str(run_dir / "local"), every=2, keep=3)

    def managers(world: int, tier_of: Any, exchange: ThreadShift, fn: Any) -> list[Any]:
        address = f"127.0.0.1:{free_port()}"

        def rank(r: int) -> Any:
            with _RowRank(persistent, r, world, address, exchange, local=tier_of(r), async_save=False) as m:
                return fn(r, m)
        return run_ranks(world, rank)

    def save(r: int, m: Any) -> dict[int, str]:
        for step in range(1, 7):
            m.save(step, _rows_state(step), extra={"step": step})
            m.wait()
        return {t.step: t.token for t in m.tier_history if t.committed}
    tokens = managers(3, lambda r: saved, ThreadShift(3), save)
    if not all(isinstance(t, dict) and sorted(t) == [2, 4, 6] for t in tokens):
        raise RuntimeError(f"fixture error: the local saves failed: {tokens}")
    for step in (4, 6):
        st = _rows_state(step)
        ckptfmt.save(persistent, step, [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in st.items()],
                     state={"extra": {"step": step}}, metadata={TIERS_KEY: {"token": tokens[0][step]}})
    for i, h in enumerate((0, 2)):  # host 1 lost, no spare: the machines of hosts 0 and 2 restart
        shutil.copytree(saved.url(h), str(run_dir / f"node-{i}" / f"host-{h}"))
    hits: list[str] = []

    def fault(name: str, sender: int, data: bytes) -> bytes:
        if ctx.restore_clean or "/serve/" not in name or sender != 0:
            return data
        changed = tamper(run_dir, data)
        if changed != data:
            hits.append(f"{name} from rank {sender} changed on its way")
        return changed

    def restore(r: int, m: Any) -> Any:
        got = m.restore(_rows_state(0))
        return {"step": got.step, "state": got.state, "tiers": got.stats.get("tiers")}
    with LogTap() as tap:
        ranks = managers(2, lambda r: LocalTier(str(run_dir / f"node-{r}"), every=2, keep=3), ThreadShift(2, fault),
                         restore)
    truth = [{"a": _rows_state(6)["a"][3 * r:3 * r + 3], "b": _rows_state(6)["b"]} for r in range(2)]
    notes = [f"rank {r}: step {g['step']}, bytes by tier {g['tiers']}" for r, g in enumerate(ranks) if isinstance(g, dict)]
    values = [g["state"] if isinstance(g, dict) and g["step"] == 6 else ({"a": None} if isinstance(g, dict) else g)
              for g in ranks]
    return RestoreAttempt(where, values, truth, prior=(persistent, 6, _rows_state(6), {"extra": {"step": 6}}),
                          repos=(persistent, *(saved.url(h) for h in range(3))), fallback=True,
                          detected=tap.named(["StepMismatchError", "ChecksumMismatchError"]),
                          reached=ctx.restore_clean or bool(hits), notes=hits + notes)


def _retell(data: bytes, change: Any) -> bytes:
    """A planned-round answer message with ``change(host, answer)`` applied to each answer."""
    from ckptfmt.manager._tieranswer import pack_answers, unpack_answers

    docs = unpack_answers(data)
    for h, doc in docs.items():
        doc["chunks"] = [bytes(c) for c in doc["chunks"]]
        change(h, doc)
    return bytes(memoryview(pack_answers(sorted(docs.items()))).cast("B"))


def elastic_peer_flipped_chunk(run_dir: Path, ctx: Any) -> RestoreAttempt:
    def tamper(_: Path, data: bytes) -> bytes:
        def flip(h: int, doc: dict[str, Any]) -> None:
            if doc["chunks"]:
                doc["chunks"][0] = bytes([doc["chunks"][0][0] ^ 0xFF]) + doc["chunks"][0][1:]
        return _retell(data, flip)
    return _elastic_restore(run_dir, ctx, tamper, "elastic restore (3 hosts saved, host 1 lost, 2 processes): one "
                            "byte of a chunk of rank 0's answer (host 0's replica of host 1) flipped on its way")


def elastic_peer_other_step(run_dir: Path, ctx: Any) -> RestoreAttempt:
    def tamper(root: Path, data: bytes) -> bytes:
        from ckptfmt import Repository

        def stale(h: int, doc: dict[str, Any]) -> None:
            doc["manifest"] = Repository(str(root / "node-0" / f"host-{h}")).open(4).manifest_bytes
        return _retell(data, stale)
    return _elastic_restore(run_dir, ctx, tamper, "elastic restore (3 hosts saved, host 1 lost, 2 processes): rank 0 "
                            "answers for step 6 with its step 4's manifest (asked 6, serves 4)")


def default_mapped() -> bool:
    """The default of ``LocalTier.mapped``."""
    return bool(next(f.default for f in dataclasses.fields(LocalTier) if f.name == "mapped"))


def _mapped_once(run_dir: Path, mapped: bool | None) -> tuple[bool, bool, Any]:
    """Save and restore through a one-host local tier (``mapped``; None: the default), then
    rewrite one byte of the restored box's tier file in place. (restored exactly, unchanged after)."""
    from ckptfmt import Repository

    kw = {} if mapped is None else {"mapped": mapped}
    d = run_dir / f"mapped-{'default' if mapped is None else mapped}"
    tier = LocalTier(str(d / "local"), every=2, keep=2, **kw)
    with CheckpointManager(str(d / "persistent"), local=tier, async_save=False) as m:
        for step in (1, 2):
            m.save(step, _state(step))
        m.wait()
    with CheckpointManager(str(d / "persistent"), local=tier) as m:
        got = m.restore(_state(0))
    exact = got.step == 2 and all(np.array_equal(got.state[k], v) for k, v in _state(2).items())
    before = {k: np.array(v) for k, v in got.state.items()}
    local = Repository(tier.url(0))
    held = local.open(2).state()["tiers"]["boxes"]
    name = next(w[0] for w in held if w[2] == "a")
    t = local.manifest(2).tensors[name]
    path = os.path.join(local.url, t.object_key(0))
    with open(path, "r+b") as f:  # the same file, in place: as another process writing the tier would
        at = t.shard_start(0) + int(t.chunks.offset[0])
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    unchanged = all(np.array_equal(got.state[k], before[k]) for k in before)
    return exact, unchanged, got.state


def mapped_rewrite(run_dir: Path, ctx: Any) -> RestoreAttempt:
    default = default_mapped()
    exact, unchanged, state = _mapped_once(run_dir, None)
    notes = [f"LocalTier default found: mapped={default}",
             f"default (mapped={default}): the restored state is "
             + ("unaffected by the later write" if unchanged else "CHANGED by the later write (it shares the tier "
                                                                  "file's pages)")]
    _, other_unchanged, _ = _mapped_once(run_dir, not default)
    notes.append(f"mapped={not default}: the restored state is " + ("unaffected (copied)" if other_unchanged else
                                                                   "changed by the write (the risk of mapping)"))
    if not exact:
        notes.append("the restore itself did not return step 2's values")
    got = dict(state) if exact else {"a": None}
    return RestoreAttempt(f"local tier (1 host, default LocalTier: mapped={default}): a byte of the restored "
                          "box's tier file rewritten in place after the restore", [got], [_state(2)],
                          fallback=True, notes=notes)
