"""The bridge contract's scenarios (bridges/README.md), the same code for every bridge.

usage: contract.py jax|torch OUT_JSON -- runs every scenario through that bridge in this fresh
process and writes {scenario: "ok" | traceback}. tests/test_bridge_contract.py runs it once per
bridge and reports each (bridge, scenario) as its own test.

A scenario sees the bridge only through a side (:class:`JaxSide`, :class:`TorchSide`): the
bridge's module (its verbs are called by their contract names) and how to make a state, a target,
and read values back. Everything else is written once.
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Any, Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import ckptfmt  # noqa: E402
from ckptfmt import Box, LocalShard, TcpCoordinator  # noqa: E402
from ckptfmt.coord import free_port  # noqa: E402
from ckptfmt.errors import (InvalidStateError, KeyMismatchError, RestoreMismatchError,  # noqa: E402
                            SaveInProgressError, ShapeMismatchError, StepAlreadyCommittedError, StepNotFoundError,
                            TopologyChangedError)
from ckptfmt.restoreplan import RestoreReport  # noqa: E402

SHAPES = {"w": ((8, 4), np.float32), "b": ((3,), np.int32)}


class JaxSide:
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        import bridges.jax as bj

        self.jax, self.jnp, self.bridge, self.restore = jax, jnp, bj, bj.restore

    def state(self, seed: int) -> dict[str, Any]:
        w = np.arange(32, dtype=np.float32).reshape(8, 4) + seed
        return {"w": self.jnp.asarray(w), "b": np.full(3, seed, np.int32), "n": seed}

    def target(self, **extra: Any) -> dict[str, Any]:
        out = {"w": self.jax.ShapeDtypeStruct((8, 4), np.float32), "b": np.zeros(3, np.int32), "n": 0}
        out.update({k: self.jax.ShapeDtypeStruct(s, np.float32) for k, s in extra.items()})
        return out

    def values(self, out: Any) -> dict[str, Any]:
        return {k: (np.asarray(v) if k != "n" else int(v)) for k, v in out.items()}

    def typed_target(self, w: str, b: str, w_shape: tuple[int, ...] = (8, 4)) -> dict[str, Any]:
        return {"w": self.jax.ShapeDtypeStruct(w_shape, np.dtype(w)), "b": np.zeros(3, np.dtype(b)), "n": 0}

    def dtype(self, v: Any) -> str:
        return np.dtype(v.dtype).name

    def mutate(self, state: dict[str, Any]) -> None:
        state["b"][:] = -1  # jax arrays are immutable: the numpy leaf is what a caller can change


class TorchSide:
    def __init__(self) -> None:
        import torch

        import bridges.torch as bt

        self.torch, self.bridge, self.restore = torch, bt, bt.load

    def state(self, seed: int) -> dict[str, Any]:
        t = self.torch
        return {"w": t.arange(32, dtype=t.float32).reshape(8, 4) + seed, "b": t.full((3,), seed, dtype=t.int32),
                "n": seed}

    def target(self, **extra: Any) -> dict[str, Any]:
        t = self.torch
        out = {"w": t.zeros(8, 4), "b": t.zeros(3, dtype=t.int32), "n": 0}
        out.update({k: t.zeros(s) for k, s in extra.items()})
        return out

    def values(self, out: Any) -> dict[str, Any]:
        return {k: (v.numpy() if k != "n" else int(v)) for k, v in out.items()}

    def typed_target(self, w: str, b: str, w_shape: tuple[int, ...] = (8, 4)) -> dict[str, Any]:
        t = self.torch
        return {"w": t.zeros(w_shape, dtype=getattr(t, w)), "b": t.zeros(3, dtype=getattr(t, b)), "n": 0}

    def dtype(self, v: Any) -> str:
        return str(v.dtype).replace("torch.", "")

    def mutate(self, state: dict[str, Any]) -> None:
        state["w"].mul_(0)
        state["b"].fill_(-1)


SIDES: dict[str, Callable[[], Any]] = {"jax": JaxSide, "torch": TorchSide}
SCENARIOS: dict[str, Callable[[Any, str], None]] = {}


def scenario(fn: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def expect(error: type, call: Callable[[], Any], match: str = "") -> BaseException:
    try:
        call()
    except error as e:
        assert match in str(e), (match, str(e))
        return e
    raise AssertionError(f"{error.__name__} not raised")


def same(got: dict[str, Any], seed: int) -> None:
    assert np.array_equal(got["w"], np.arange(32, dtype=np.float32).reshape(8, 4) + seed), got["w"]
    assert np.array_equal(got["b"], np.full(3, seed, np.int32)) and got["n"] == seed, got


def peer_save(url: str, step: int, address: str) -> None:
    """Rank 1 of a two-rank save through the core: declares every tensor, holds no data to write."""
    with TcpCoordinator(address, 1, 2, timeout_s=60) as c1:
        ckptfmt.save(url, step, [LocalShard(k, s, np.dtype(d), Box.full(s), None, replica_id=1)
                                 for k, (s, d) in SHAPES.items()], coordinator=c1)


# ------------------------------------------------------------------------------ scenarios


@scenario
def signatures(B: Any, d: str) -> None:
    """The same verbs, the same keywords, kinds and defaults."""
    empty = inspect.Parameter.empty
    kw, pos = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    want = {
        "save": ([("url", pos, empty), ("state", pos, empty)],
                 [("step", empty), ("extra", None), ("rank_state", None), ("blocking", True), ("coordinator", None),
                  ("options", None), ("metadata", None)]),
        "restore": ([("url", pos, empty), ("target", pos, None)],
                    [("step", None), ("rank_state_policy", None), ("mapping", None), ("strict", None),
                     ("stats", None)]),
        "load_extra": ([("url", pos, empty), ("step", pos, None)], []),
        "load_rank_state": ([("url", pos, empty), ("step", pos, None)], [("rank_state_policy", None)]),
    }
    for verb, (positional, keywords) in want.items():
        params = inspect.signature(B.restore if verb == "restore" else getattr(B.bridge, verb)).parameters
        got = [(n, p.kind, p.default) for n, p in list(params.items())[:len(positional)]]
        if verb == "restore" and B.restore.__name__ == "load":  # torch: the target is required
            positional = [positional[0], ("target", pos, empty)]
        assert got == positional, (verb, got)
        for name, default in keywords:
            p = params[name]
            assert p.kind == kw and p.default is default, (verb, name, p.kind, p.default)


@scenario
def round_trip_extra_and_rank_state(B: Any, d: str) -> None:
    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(1), step=1, extra={"epoch": 2, 1: "a", "t": (1, 2)}, rank_state={"cursor": 17})
    B.bridge.save(url, B.state(2), step=2)
    same(B.values(B.restore(url, B.target())), 2)  # step=None: the latest
    same(B.values(B.restore(url, B.target(), step=1)), 1)
    assert B.bridge.load_extra(url, 1) == {"epoch": 2, "1": "a", "t": [1, 2]}  # as json.loads(json.dumps(x))
    assert B.bridge.load_extra(url) is None
    assert B.bridge.load_rank_state(url, 1) == {"cursor": 17}  # same world: no policy needed
    assert B.bridge.load_rank_state(url) is None


@scenario
def no_committed_step(B: Any, d: str) -> None:
    url = os.path.join(d, "empty")
    for call in (lambda: B.restore(url, B.target()), lambda: B.bridge.load_extra(url),
                 lambda: B.bridge.load_rank_state(url)):
        expect(StepNotFoundError, call)


@scenario
def async_save_returns_the_core_handle(B: Any, d: str) -> None:
    url = os.path.join(d, "r")
    address = f"127.0.0.1:{free_port()}"
    c0 = TcpCoordinator(address, 0, 2, timeout_s=60)
    state = B.state(3)
    # Held in flight deterministically: the save waits at its first collective for rank 1.
    handle = B.bridge.save(url, state, step=3, blocking=False, coordinator=c0)
    try:
        assert isinstance(handle, ckptfmt.SaveHandle), type(handle)
        assert not handle.done() and handle.snapshot_bytes == 32 * 4 + 3 * 4, handle.snapshot_bytes
        B.mutate(state)  # the snapshot was taken before save returned
        expect(SaveInProgressError, lambda: B.bridge.save(url, B.state(4), step=4))
        expect(SaveInProgressError, lambda: B.bridge.save(url, B.state(4), step=4, blocking=False))
    finally:
        peer = threading.Thread(target=peer_save, args=(url, 3, address))
        peer.start()
        manifest = handle.result(60)
        peer.join(60)
        c0.close()
    assert manifest.step == 3 and handle.done() and handle.exception() is None
    same(B.values(B.restore(url, B.target(), rank_state_policy="drop")), 3)  # saved by 2 ranks
    again = B.bridge.save(url, B.state(5), step=3, blocking=False)  # control: idle again; a failing save
    expect(StepAlreadyCommittedError, lambda: again.result(60))  # raises from result(), typed
    assert isinstance(again.exception(), StepAlreadyCommittedError)


@scenario
def topology_change_needs_a_policy(B: Any, d: str) -> None:
    url = os.path.join(d, "r")
    address = f"127.0.0.1:{free_port()}"
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with TcpCoordinator(address, r, 2, timeout_s=60) as c:
                B.bridge.save(url, B.state(6), step=6, rank_state={"r": r}, coordinator=c)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert ckptfmt.Repository(url).open(6).saved_world == 2
    # Saved by 2 processes, restored by 1: the default raises, naming the policies, before reading.
    # The core decides (ckptfmt.rankstate, FORMAT.md 7.4): the bridge raises the core's error, with
    # its message, so every bridge raises the same one for the same checkpoint and world.
    core = expect(TopologyChangedError, lambda: ckptfmt.Repository(url).open(6).rank_state(0, world=1))
    for call in (lambda: B.restore(url, B.target()), lambda: B.bridge.load_rank_state(url)):
        e = expect(TopologyChangedError, call, "rank_state_policy")
        assert all(p in str(e) for p in ("'drop'", "'rank0'", "'same-rank'")), e
        assert (type(e), str(e), e.to_json()) == (type(core), str(core), core.to_json()), (str(e), str(core))
    assert all(w in str(core) for w in ("step 6", "saved by 2 processes", "1 are restoring")), core
    same(B.values(B.restore(url, B.target(), rank_state_policy="drop")), 6)  # the control
    assert B.bridge.load_rank_state(url, rank_state_policy="drop") is None
    assert B.bridge.load_rank_state(url, rank_state_policy="rank0") == {"r": 0}
    assert B.bridge.load_rank_state(url, rank_state_policy="same-rank") == {"r": 0}
    for u in (url, os.path.join(d, "empty")):  # an unknown policy: ValueError before anything is opened
        expect(ValueError, lambda: B.restore(u, B.target(), rank_state_policy="bogus"), "unknown rank state policy")
        expect(ValueError, lambda: B.bridge.load_rank_state(u, rank_state_policy="bogus"), "'same-rank'")
    # Control (FORMAT.md 7.4, revision 1.2.7): a step saved by 2 processes with no per-rank state
    # holds nothing to hand to the wrong process: neither the core nor the bridge raises.
    url7, address7 = os.path.join(d, "r7"), f"127.0.0.1:{free_port()}"
    peer = threading.Thread(target=peer_save, args=(url7, 7, address7))
    peer.start()
    values = {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + 7, "b": np.full(3, 7, np.int32)}
    with TcpCoordinator(address7, 0, 2, timeout_s=60) as c0:
        ckptfmt.save(url7, 7, [LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v) for k, v in values.items()],
                     coordinator=c0)
    peer.join(60)
    ck7 = ckptfmt.Repository(url7).open(7)
    assert ck7.saved_world == 2 and not any(n.startswith("rank/") for n in ck7.manifest.state), ck7.manifest.state
    assert ck7.rank_state(0, world=1) is None and B.bridge.load_rank_state(url7) is None
    got = B.values(B.restore(url7, {k: v for k, v in B.target().items() if k != "n"}))
    assert all(np.array_equal(got[k], v) for k, v in values.items()), got


@scenario
def a_bad_policy_raises_before_any_read(B: Any, d: str) -> None:
    """Each public verb checks ``rank_state_policy`` once, before any storage read: the repository is
    a regular file, so any read raises StorageError; a bad policy raises ValueError instead. Control:
    each valid policy (and the core's RankStatePolicy value) gets past the check to that read."""
    from ckptfmt.rankstate import RankStatePolicy

    url = os.path.join(d, "r")
    manager = B.bridge.CheckpointManager(url, async_save=False)
    try:
        with open(url, "wb") as f:
            f.write(b"not a repository")
        verbs = {"restore": lambda p: B.restore(url, B.target(), rank_state_policy=p),
                 "load_rank_state": lambda p: B.bridge.load_rank_state(url, rank_state_policy=p),
                 "CheckpointManager.restore": lambda p: manager.restore(B.target(), rank_state_policy=p)}
        for name, verb in verbs.items():
            for bad in ("bogus", "Drop", "same_rank", ""):
                e = expect(ValueError, lambda: verb(bad), "unknown rank state policy")
                assert "'drop', 'rank0', 'same-rank'" in str(e), (name, e)
                assert not isinstance(e, ckptfmt.CheckpointError), (name, e)
            for good in (None, "drop", "rank0", "same-rank", RankStatePolicy.RANK0):
                expect(ckptfmt.StorageError, lambda: verb(good))
    finally:
        manager.close()


@scenario
def strict_and_mapping(B: Any, d: str) -> None:
    from bridges.mapping import KeptValuesWarning, Mapping, Rule

    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(7), step=7)
    expect(KeyMismatchError, lambda: B.restore(url, B.target(absent=(2,))), "absent")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = B.restore(url, B.target(absent=(2,)), strict=False)
    assert any(issubclass(w.category, KeptValuesWarning) for w in seen), [str(w.message) for w in seen]
    same({k: v for k, v in B.values(got).items() if k != "absent"}, 7)
    transposed = Mapping((Rule("w", "wT", {2: (1, 0)}),))
    target = {k: v for k, v in B.target(wT=(4, 8)).items() if k != "w"}
    got = B.values(B.restore(url, target, mapping=transposed))
    assert np.array_equal(got["wT"], (np.arange(32, dtype=np.float32).reshape(8, 4) + 7).T)


@scenario
def batched_restore(B: Any, d: str) -> None:
    """Both bridges read through bridges._contract.read_batches: one batch per value once the
    batch size is below a value's size, one batch at the default; the values are the same."""
    import bridges._contract as contract

    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(8), step=8)

    def batches(out: Any, stats: dict[str, Any]) -> int:
        return stats["batches"] if "batches" in stats else out.batches

    def restore() -> tuple[Any, int]:
        stats: dict[str, Any] = {}
        kw = {"stats": stats} if "stats" in inspect.signature(B.restore).parameters else {}
        out = B.restore(url, B.target(), **kw)
        return out, batches(out, stats)

    out, n = restore()
    same(B.values(out), 8)
    assert n == 1, n
    saved = contract.RESTORE_BATCH_BYTES
    contract.RESTORE_BATCH_BYTES = 16  # below each tensor's size: one batch per tensor
    try:
        out, n = restore()
    finally:
        contract.RESTORE_BATCH_BYTES = saved
    same(B.values(out), 8)
    assert n == 2, n


@scenario
def partial_restore(B: Any, d: str) -> None:
    """Checkpoint keys the target does not name: a partial restore, reported the same way (the
    report, extra and rank_state in ``stats``); strict=True makes them one KeyMismatchError."""
    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(9), step=9, extra={"epoch": 3}, rank_state={"cursor": 5})
    stats: dict[str, Any] = {}
    got = B.values(B.restore(url, {k: v for k, v in B.target().items() if k == "w"}, stats=stats))
    assert np.array_equal(got["w"], np.arange(32, dtype=np.float32).reshape(8, 4) + 9) and list(got) == ["w"], got
    report = stats["report"]
    assert isinstance(report, RestoreReport) and report.loaded == ("w",) and report.unexpected == ("b", "n"), report
    assert (stats["step"], stats["extra"], stats["rank_state"]) == (9, {"epoch": 3}, {"cursor": 5}), stats
    e = expect(KeyMismatchError, lambda: B.restore(url, {"w": B.target()["w"]}, strict=True), "'b'")
    assert e.unexpected == ["b", "n"] and e.missing == [] and "ignore=" in str(e), (e.unexpected, str(e))
    same(B.values(B.restore(url, B.target(), strict=True)), 9)  # the control: the whole target


@scenario
def cast_within_one_kind(B: Any, d: str) -> None:
    """A dtype of the target's kind is cast and reported; across kinds it is an error."""
    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(10), step=10)
    stats: dict[str, Any] = {}
    out = B.restore(url, B.typed_target("float16", "int16"), stats=stats)
    got = B.values(out)
    assert B.dtype(out["w"]) == "float16" and B.dtype(out["b"]) == "int16", (out["w"].dtype, out["b"].dtype)
    assert np.array_equal(got["w"].astype(np.float32), np.arange(32, dtype=np.float32).reshape(8, 4) + 10)
    assert np.array_equal(got["b"], np.full(3, 10, np.int16)), got["b"]
    assert sorted(stats["report"].cast) == ["b: int32 -> int16", "w: float32 -> float16"], stats["report"].cast
    e = expect(ShapeMismatchError, lambda: B.restore(url, B.typed_target("int32", "int32")), "across kinds")
    assert e.key == "w" and (e.expected, e.found) == ("int32", "float32"), e
    same(B.values(B.restore(url, B.typed_target("float32", "int32"))), 10)  # the control: exact dtypes


@scenario
def every_mismatch_in_one_error(B: Any, d: str) -> None:
    """A wrong shape, a cast across kinds and a missing key at once: ONE error listing all three."""
    url = os.path.join(d, "r")
    B.bridge.save(url, B.state(11), step=11)
    target = dict(B.typed_target("float32", "float32", w_shape=(4, 8)), absent=B.target(absent=(2,))["absent"])
    e = expect(RestoreMismatchError, lambda: B.restore(url, target))
    assert isinstance(e, KeyMismatchError) and isinstance(e, ShapeMismatchError), type(e).__mro__
    assert e.missing == ["absent"] and sorted(m["key"] for m in e.mismatches) == ["b", "w"], (e.missing, e.mismatches)
    assert all(k in str(e) for k in ("'absent'", "w:", "b:", "strict=False")) and len(str(e)) < 1800, str(e)
    assert e.to_json()["missing"] == ["absent"] and len(e.to_json()["mismatches"]) == 2
    same(B.values(B.restore(url, B.target())), 11)  # the control


@scenario
def async_save_snapshots_numpy_extra(B: Any, d: str) -> None:
    """numpy arrays in extra / rank_state are snapshotted before save(blocking=False) returns."""
    url = os.path.join(d, "r")
    address = f"127.0.0.1:{free_port()}"
    c0 = TcpCoordinator(address, 0, 2, timeout_s=60)
    extra, rank = {"a": np.arange(4, dtype=np.int64)}, {"r": np.arange(3, dtype=np.float32)}
    handle = B.bridge.save(url, B.state(12), step=12, extra=extra, rank_state=rank, blocking=False, coordinator=c0)
    try:
        extra["a"][:] = -1  # the save waits for rank 1 at its first collective: it has not encoded yet
        rank["r"][:] = -1
        extra["b"] = "added later"
    finally:
        peer = threading.Thread(target=peer_save, args=(url, 12, address))
        peer.start()
        handle.result(60)
        peer.join(60)
        c0.close()
    got = B.bridge.load_extra(url, 12)
    assert set(got) == {"a"} and np.array_equal(got["a"], np.arange(4)), got
    assert np.array_equal(B.bridge.load_rank_state(url, 12, rank_state_policy="rank0")["r"], np.arange(3)), "rank"


@scenario
def unencodable_extra_raises_at_the_call(B: Any, d: str) -> None:
    """An extra msgpack cannot hold raises InvalidStateError at the save call (blocking or not),
    before any shard is written; the control saves the same state with a plain extra."""
    url = os.path.join(d, "r")
    for blocking in (False, True):
        e = expect(InvalidStateError, lambda: B.bridge.save(url, B.state(13), step=13, extra={"f": object()},
                                                            blocking=blocking))
        assert "extra" in str(e.key), e
        written = [os.path.join(r, f) for r, _, fs in os.walk(url) for f in fs] if os.path.exists(url) else []
        assert written == [], written
    B.bridge.save(url, B.state(13), step=13, extra={"f": 1})
    assert B.bridge.load_extra(url, 13) == {"f": 1}


def main() -> None:
    side_name, out = sys.argv[1], sys.argv[2]
    side = SIDES[side_name]()
    results: dict[str, str] = {}
    for name, fn in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as d:
            try:
                fn(side, d)
                results[name] = "ok"
            except BaseException:  # noqa: BLE001 - reported per scenario
                results[name] = traceback.format_exc()[-3000:]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
