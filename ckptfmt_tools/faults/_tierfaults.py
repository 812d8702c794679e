"""Faults of kind ``"tier"``: the checkpoint manager's local tier (FORMAT.md 8.5, 14.8).

Peer replicas: two ranks (threads) run the core :class:`ckptfmt.manager.CheckpointManager`
through its bridge hooks (rank and world, a TcpCoordinator each, and :class:`ThreadShift`, an
in-memory :class:`~ckptfmt.manager._tiers.PeerExchange` where the fault is injected). They save
steps 1-6 to the local tier (every 2, keep 2; each host holds its own boxes and a replica of the
next host's); rank 0 saves steps 4 and 6 to the persistent tier with the same tier tokens. Host
1's local tier is then lost, so its restore of step 6 asks host 0 for the replica.

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

__all__ = ["ThreadShift", "peer_other_step", "peer_flipped_chunk", "mapped_rewrite", "default_mapped"]

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
