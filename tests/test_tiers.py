"""The checkpoint manager's local tier (FORMAT.md 8.5; ckptfmt/manager/_tiers.py, _tierrestore.py).

In one process (the core manager, flat numpy dicts): a local step restores from the local tier; a
corrupt local copy is rejected and the persistent tier serves it (broken control: the intact copy
is served locally); a local step whose token the persistent tier does not share is never mixed
with it. In two JAX processes (tests/jaxproc/tiers_job.py, 2 x 2 CPU devices) and two torch gloo
ranks (tests/torchproc/tiers_job.py): the four drill scenarios, each restoring exactly the step's
bytes and saying which tier served how many; every tiered restore of one step carries one token;
the torch manager with a mapping keeps the checkpoint's layout on both tiers. A request tiled by
several held boxes of one tier is assembled from them (corrupt-part and missing-part controls),
and a property test pins the planner (``feasible_steps``) to the read on random tilings.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptfmt import Box
from ckptfmt.manager import CheckpointManager, LocalTier
from ckptfmt.manager._tierrestore import _read_own, feasible_steps, held, inventory
from ckptfmt.manager._tiers import write_local_step
from ckptfmt.repository import Repository

ROOT = Path(__file__).resolve().parent.parent


def _state(step: int) -> dict[str, np.ndarray]:
    return {"a": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "b": np.full(5, step, np.int64),
            "c": np.array(step, dtype=np.int32)}  # a 0-d tensor keeps its shape in the local tier


def _save(tmp: Path, steps: range, every: int = 2, persistent_every: int = 4) -> LocalTier:
    tier = LocalTier(str(tmp / "local"), every=every, keep=2)
    with CheckpointManager(str(tmp / "p"), save_every_steps=persistent_every, local=tier) as m:
        for s in steps:
            m.save(s, _state(s), extra={"s": s})
    return tier


def _flip_first_byte(repo: Repository, step: int, key: str) -> None:
    t = repo.manifest(step).tensors[key]
    path = os.path.join(repo.url, t.object_key(0))
    with open(path, "r+b") as f:  # the shard's first byte, in its pack or its own object
        f.seek(t.shard_start(0))
        b = f.read(1)
        f.seek(t.shard_start(0))
        f.write(bytes([b[0] ^ 0xFF]))


def test_local_tier_rejects_a_corrupt_copy_and_the_next_tier_serves_it(tmp_path):
    tier = _save(tmp_path, range(1, 5))  # local 2, 4; persistent 4 (one call: the same token)
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    # Broken control first: the intact local copy serves every byte.
    assert r.step == 4 and r.stats["tiers"] == {"local": 92, "peer": 0, "persistent": 0}
    assert all(np.array_equal(r.state[k], v) for k, v in _state(4).items()) and r.extra == {"s": 4}
    local = Repository(tier.url(0))
    _flip_first_byte(local, 4, "h0/000000")
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    assert r.step == 4 and r.stats["tiers"] == {"local": 44, "peer": 0, "persistent": 48}
    assert all(np.array_equal(r.state[k], v) for k, v in _state(4).items())


def test_a_local_step_is_never_mixed_with_another_save(tmp_path):
    tier = _save(tmp_path, range(1, 7))  # local 4, 6 (keep 2); persistent 4
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    assert r.step == 6 and r.stats["tiers"]["local"] == 92  # broken control: newest local step
    # The persistent step 4 saved again by another run (another token); the local copy of step 4
    # is then of a different save: corrupting it must not be repaired from the persistent tier.
    Repository(str(tmp_path / "p")).delete(4)
    with CheckpointManager(str(tmp_path / "p"), save_every_steps=4) as m:
        m.save(4, _state(40), force=True)
    local = Repository(tier.url(0))
    local.delete(6)
    _flip_first_byte(local, 4, "h0/000000")
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    # Not mixed: the tiered restore fails closed and the ordinary restore serves the persistent step.
    assert r.step == 4 and r.stats["tiers"]["local"] == r.stats["tiers"]["peer"] == 0
    assert all(np.array_equal(r.state[k], v) for k, v in _state(40).items())


def test_local_tier_cadence_and_retention(tmp_path):
    tier = _save(tmp_path, range(1, 9), every=2, persistent_every=100)
    assert Repository(tier.url(0)).steps() == [6, 8]  # keep 2
    assert Repository(str(tmp_path / "p")).steps() == []
    with pytest.raises(ValueError, match="every"):
        LocalTier(str(tmp_path), every=0)


def test_local_saves_collect_abandoned_saves_of_a_killed_process(tmp_path):
    """A process killed during a local save leaves private objects in host memory; the next local
    save collects them (lease past the grace). Control: a save whose lease is fresh is kept."""
    import json
    import time

    tier = _save(tmp_path, range(1, 3))
    saves = tmp_path / "local" / "host-0" / "saves"
    stale, fresh = "000000000003-20200101T000000-0000dead", "000000000003-20200101T000000-0000beef"
    for sid, beat in ((stale, 0.0), (fresh, time.time())):
        d = saves / sid / "t" / "000000" / "c"
        d.mkdir(parents=True)
        (d / "0").write_bytes(b"partial")
        (saves / sid / "LEASE").write_text(json.dumps({"heartbeat_unix": beat, "save_id": sid, "step": 3, "world": 1}))
    with CheckpointManager(str(tmp_path / "p"), save_every_steps=100, local=tier) as m:
        m.save(4, _state(4))
    assert not (saves / stale).exists() and (saves / fresh / "t" / "000000" / "c" / "0").exists()
    assert Repository(tier.url(0)).steps() == [2, 4]


def _tiled_local_step(tier: LocalTier, step: int, token: str, drop: int | None = None) -> None:
    """Rewrite local step ``step`` of host 0 (one process) with ``a`` held as four row boxes
    (``drop``: one of them left out), ``b`` and ``c`` whole; the same token and state."""
    st = _state(step)
    rows = [(o, n) for o, n in ((0, 1), (1, 1), (2, 1))]
    parts = [("a", (3, 4), np.float32, Box((o, 0), (n, 4)), st["a"][o:o + n]) for o, n in rows]
    parts.insert(1, ("a", (3, 4), np.float32, Box((1, 0), (1, 4)), st["a"][1:2]))  # a repeat: one part serves
    parts = [p for i, p in enumerate(parts) if i != drop]
    whole = [(k, np.shape(v), v.dtype, Box.full(np.shape(v)), v) for k, v in st.items() if k != "a"]
    run = Repository(tier.url(0)).open(step).state()["tiers"]["run"]  # the run this step belongs to
    write_local_step(Repository(tier.url(0)), step, 0, 1, token, [(0, b) for b in parts + whole],
                     {"extra": {"s": step}}, None, whole_chunks=tier.mapped, run=run)


def test_a_request_tiled_by_several_held_boxes_is_assembled_from_one_tier(tmp_path):
    tier = _save(tmp_path, range(1, 5))  # local 2, 4; persistent 4 (one call: the same token)
    token = Repository(tier.url(0)).open(4).state()["tiers"]["token"]
    _tiled_local_step(tier, 4, token)
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    # Broken control first: the three row boxes (and a repeated one) tile "a", all served locally.
    assert r.step == 4 and r.stats["tiers"] == {"local": 92, "peer": 0, "persistent": 0}
    assert all(np.array_equal(r.state[k], v) for k, v in _state(4).items()) and r.extra == {"s": 4}
    # One part corrupt: "a" is not served from the local tier at all; the persistent tier (same token) serves it.
    _flip_first_byte(Repository(tier.url(0)), 4, "h0/000001")  # the first box of row 1: a part cover() takes
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    assert r.step == 4 and r.stats["tiers"] == {"local": 44, "peer": 0, "persistent": 48}
    assert all(np.array_equal(r.state[k], v) for k, v in _state(4).items())
    # One part missing: the local tier does not tile "a"; planned so, and the persistent tier serves it.
    _tiled_local_step(tier, 4, token, drop=3)
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    assert r.step == 4 and r.stats["tiers"] == {"local": 44, "peer": 0, "persistent": 48}
    assert all(np.array_equal(r.state[k], v) for k, v in _state(4).items())


def test_the_planner_agrees_with_the_read_on_random_tilings(tmp_path):
    """Property: for random held boxes (a random grid of a 6 x 8 tensor, some cells left out, some
    repeated) and random requests, ``feasible_steps`` says a request is served exactly when the
    own-tier read serves it, and that happens exactly when the held cells cover every element;
    what the read serves equals the tensor's elements."""
    rng = np.random.default_rng(0)
    full = np.arange(48, dtype=np.float32).reshape(6, 8)
    repo = Repository(str(tmp_path / "host-0"))
    for case in range(12):
        cuts = [np.unique(np.r_[0, rng.integers(1, n, size=2), n]) for n in full.shape]
        cells = [Box((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in zip(cuts[0], cuts[0][1:])
                 for c0, c1 in zip(cuts[1], cuts[1][1:])]
        kept = [b for b in cells if rng.random() > 0.25]
        kept += [kept[0]] if kept else []
        boxes = [(0, ("t", full.shape, full.dtype, b, full[b.slices()])) for b in kept]
        write_local_step(repo, case, 0, 1, f"tok-{case}", boxes, {}, None)
        held_boxes = held(inventory(repo), case, f"tok-{case}", 0, 1)
        covered = np.zeros(full.shape, bool)
        for b in kept:
            covered[b.slices()] = True
        for _ in range(6):
            lo = [int(rng.integers(0, n)) for n in full.shape]
            req = ("t", Box(tuple(lo), tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(lo, full.shape))))
            feasible = feasible_steps(0, 1, [{case: inventory(repo)[case]}], [req], {}) == [case]
            values: dict = {}
            left = _read_own(repo, case, held_boxes, [req], values)
            assert feasible == (left == []) == bool(covered[req[1].slices()].all()), (case, req, kept)
            if feasible:
                assert np.array_equal(values[req], full[req[1].slices()])
        repo.delete(case)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["jaxproc", "torchproc"])
def run(request, tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp(f"tiers-{request.param}")
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / request.param / "tiers_job.py"), "--dir", str(work),
                               "--port", str(port), "--rank", str(r), "--out", str(work / f"out{r}.json")], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return [json.loads((work / f"out{r}.json").read_text()) for r in (0, 1)]


def test_tiers_four_scenarios(run):
    """JAX (2 x 2 devices) and torch (a DTensor Shard(0) over 2 gloo ranks)."""
    r0, r1 = (o["restores"] for o in run)
    assert run[0]["local_saves"] == [2, 4, 6]
    for rs in (r0, r1):
        assert all(v["exact"] and v["n_ok"] and v["extra"] == {"step": v["step"]} for v in rs.values()), rs
    # (a) intact: every byte from the own local tier, one token on both ranks (one save).
    assert r0["intact"]["tiers"] == r1["intact"]["tiers"] == {"local": 140, "peer": 0, "persistent": 0}
    assert r0["intact"]["token"] == r1["intact"]["token"] and r0["intact"]["step"] == 6
    # (d) one own box corrupt on host 0: rejected, the peer replica serves it; host 1 unaffected.
    assert r0["corrupt"]["tiers"]["peer"] > 0 and r0["corrupt"]["tiers"]["persistent"] == 0
    assert r1["corrupt"]["tiers"] == {"local": 140, "peer": 0, "persistent": 0}
    # (b) host 1's local tier lost: its bytes come from the replica host 0 holds.
    assert r1["lost-host"]["tiers"] == {"local": 0, "peer": 140, "persistent": 0}
    assert r0["lost-host"]["tiers"] == {"local": 140, "peer": 0, "persistent": 0} and r1["lost-host"]["step"] == 6
    # (c) every local copy lost: the persistent tier's newest step.
    assert r0["all-lost"]["step"] == r1["all-lost"]["step"] == 4
    assert r0["all-lost"]["tiers"]["persistent"] > 0 and r0["all-lost"]["tiers"]["local"] == 0
    # No restore mixed two saves: every tiered restore of step 6, on both ranks, used one token.
    assert len({v["token"] for rs in (r0, r1) for k, v in rs.items() if k != "all-lost"}) == 1


def test_torch_manager_with_a_mapping_keeps_and_restores_the_checkpoint_layout_through_the_tiers(run):
    """bridges.torch.CheckpointManager(mapping=...): the steps hold the checkpoint's layout (``w``
    stored transposed as ``wt``) on both tiers, and the tiered restore maps it back: from the own
    tier, and with host 1's tier lost from the replica host 0 holds."""
    if "mapped" not in run[0]:
        pytest.skip("the JAX job has no mapping")
    for rank, out in enumerate(run):
        m = out["mapped"]
        assert "wt" in m["keys"] and "w" not in m["keys"], m
        assert m["intact"] == {"step": 6, "tiers": {"local": 140, "peer": 0, "persistent": 0}, "exact": True}, m
        assert m["lost-host"]["step"] == 6 and m["lost-host"]["exact"], m
        assert m["lost-host"]["tiers"] == ({"local": 140, "peer": 0, "persistent": 0} if rank == 0 else
                                           {"local": 0, "peer": 140, "persistent": 0}), m


def test_jax_local_saves_exchange_in_the_background_while_training_runs_collectives(run):
    """The JAX peer exchange (jax.experimental.transfer) runs in the local save's background thread
    while the caller runs cross-process programs every step: every local save commits with its
    peer replica, the caller is not blocked for the exchange, and the newest step restores exactly
    from the local tier. (The torch exchange has its own gloo group; its job has no such phase.)"""
    if "training" not in run[0]:
        pytest.skip("the torch job has no training phase")
    for out in run:
        t = out["training"]
        assert [r[0] for r in t["records"]] == [1, 2, 3, 4, 5, 6] and all(r[1] for r in t["records"]), t
        assert all(r[4] > 0 and r[3] > 0 for r in t["records"]), t  # each step exchanged and holds the peer's boxes
        assert t["sums_ok"] and t["restored"] == 6 and t["exact"] and t["tiers"]["local"] > 0, t


def test_a_peer_payload_is_checked_against_the_senders_crc32c():
    """Every PeerExchange checks what it received here (FORMAT.md 8.5): the sender's crc32c passes
    (the control), a flipped byte raises naming the exchange and the rank."""
    from ckptfmt.checksum import crc32c
    from ckptfmt.errors import ChecksumMismatchError
    from ckptfmt.manager._tiers import check_payload

    sent = b"the boxes of host 1" * 100
    assert check_payload(sent, crc32c(sent), "tiers/save/6 from rank 1") == sent
    bad = bytearray(sent)
    bad[7] ^= 1
    with pytest.raises(ChecksumMismatchError, match="in transit") as e:
        check_payload(bytes(bad), crc32c(sent), "tiers/save/6 from rank 1")
    assert e.value.object == "tiers/save/6 from rank 1"


def _boxes():
    import ml_dtypes

    from ckptfmt import Box

    rng = np.random.default_rng(3)
    wide = rng.standard_normal((6, 10))
    return [("w", (12, 10), np.dtype(np.float64), Box((6, 0), (6, 10)), wide[:, :]),
            ("t", (8, 8), np.dtype(np.float32), Box((0, 0), (4, 8)), rng.standard_normal((8, 4)).astype(np.float32).T),  # not contiguous
            ("b", (3,), np.dtype(ml_dtypes.bfloat16), Box((0,), (3,)), np.arange(3).astype(ml_dtypes.bfloat16)),
            ("s", (), np.dtype(np.int32), Box((), ()), np.array(7, np.int32)),
            ("e", (0, 4), np.dtype(np.bool_), Box((0, 0), (0, 4)), np.zeros((0, 4), np.bool_))]


def test_peer_payload_round_trip_is_views_of_one_buffer():
    """pack_payload: one uint8 buffer (copies that release the GIL); unpack_payload: views into it,
    equal to the boxes, for every dtype and layout (a transposed source, a scalar, an empty box)."""
    from ckptfmt.manager._payload import pack_payload, unpack_payload

    boxes = _boxes()
    payload = pack_payload(boxes)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    assert np.array_equal(payload, pack_payload(boxes))  # padding included: the same boxes, the same bytes
    got = unpack_payload(payload, "test")
    for (k, shape, dt, box, a), (k2, shape2, dt2, box2, a2) in zip(boxes, got, strict=True):
        assert (k, tuple(shape), np.dtype(dt), box) == (k2, shape2, dt2, box2)
        assert a2.shape == box.shape and np.array_equal(np.asarray(a), a2)
        if a2.size:
            assert np.shares_memory(a2, payload)
    assert unpack_payload(bytes(payload), "test")[0][4].tolist() == boxes[0][4].tolist()  # bytes work too


@pytest.mark.parametrize("damage", ["magic", "short", "header_len", "nbytes", "start", "dtype"])
def test_a_malformed_peer_payload_is_an_invalid_state_error(damage):
    """A peer payload is untrusted: each malformed field raises InvalidStateError naming the
    exchange; the intact payload (the control) unpacks."""
    import msgpack

    from ckptfmt.errors import InvalidStateError
    from ckptfmt.manager._payload import pack_payload, unpack_payload

    good = pack_payload(_boxes()[:2])
    assert len(unpack_payload(good, "tiers/save/3 from rank 1")) == 2
    bad = good.copy()
    n = int(bad[8:16].view("<u8")[0])
    head = msgpack.unpackb(bad[16:16 + n].tobytes())

    def rebuild(head: list) -> np.ndarray:
        raw = msgpack.packb(head, use_bin_type=True)
        base = -(-(16 + len(raw)) // 64) * 64  # the data region moves with the header's length
        data = good[-(-(16 + n) // 64) * 64:]
        out = np.zeros(base + data.size, np.uint8)
        out[:8] = good[:8]
        out[8:16] = np.frombuffer(np.uint64(len(raw)).astype("<u8").tobytes(), np.uint8)
        out[16:16 + len(raw)] = np.frombuffer(raw, np.uint8)
        out[base:] = data
        return out

    assert len(unpack_payload(rebuild(head), "x")) == 2  # the rebuild itself keeps a payload intact
    if damage == "magic":
        bad[0] ^= 1
    elif damage == "short":
        bad = bad[:len(bad) - 8]
    elif damage == "header_len":
        bad[8:16] = np.frombuffer(np.uint64(1 << 40).astype("<u8").tobytes(), np.uint8)
    else:
        if damage == "nbytes":
            head[0][6] += 8
        elif damage == "start":
            head[1][5] = 1 << 30
        else:
            head[0][2] = "float128"
        bad = rebuild(head)
    with pytest.raises(InvalidStateError) as e:
        unpack_payload(bad, "tiers/save/3 from rank 1")
    assert e.value.object == "tiers/save/3 from rank 1"


# ---------------------------------------------------------------- the receiver verifies a peer's answer (FORMAT.md 8.5)
def _holder(tmp_path: Path) -> tuple[Repository, dict, list]:
    """Host 0 of 2 holds, in its local tier, its own box and host 1's box of tensor "a" for steps 4
    and 6 (tokens tok-4 and tok-6); host 1 asks for its box of "a" (rows 2-3)."""
    repo = Repository(str(tmp_path / "host-0"))
    for step in (4, 6):
        a = np.arange(16, dtype=np.float32).reshape(4, 4) + step
        boxes = [(0, ("a", a.shape, a.dtype, Box((0, 0), (2, 4)), a[:2])),
                 (1, ("a", a.shape, a.dtype, Box((2, 0), (2, 4)), a[2:]))]
        write_local_step(repo, step, 0, 2, f"tok-{step}", boxes, {"step": step}, None, whole_chunks=True)
    inv = inventory(repo)
    return repo, inv, [("a", Box((2, 0), (2, 4)))]


def _ask(inv: dict, step: int, reqs: list) -> tuple[bytes, list]:
    from ckptfmt.manager._tierrestore import _peer_ask, by_key, cover

    index = by_key(held([{step: inv[step]}][0], step, f"tok-{step}", 1, 2))
    plan = [(r, cover(index, *r)) for r in reqs]
    return _peer_ask(step, f"tok-{step}", plan), plan


def test_a_peer_answer_is_bound_to_the_step_token_and_host_asked(tmp_path):
    """Host 1 asks host 0 for its box of step 6. The honest answer (control) is exact, with the
    step's global state. An answer of step 4 (a holder serving an older step), of host 1's own
    tier (another host), or an answer whose manifest differs from the one the holder listed, is
    refused as a whole (StepMismatchError): nothing of it is used."""
    from ckptfmt.errors import StepMismatchError
    from ckptfmt.manager._tierrestore import accept_replica, serve_replica

    repo, inv, reqs = _holder(tmp_path)
    ask6, plan6 = _ask(inv, 6, reqs)
    ask4, _ = _ask(inv, 4, reqs)
    kw = dict(step=6, token="tok-6", holder=0, world=2, digest=inv[6]["digest"], plan=plan6)
    values, gstate = accept_replica(serve_replica(repo, 1, ask6), **kw)
    assert np.array_equal(values[reqs[0]], (np.arange(16, dtype=np.float32).reshape(4, 4) + 6)[2:]) and gstate == {"step": 6}
    with pytest.raises(StepMismatchError):  # asked 6, served 4
        accept_replica(serve_replica(repo, 1, ask4), **kw)
    other = Repository(str(tmp_path / "host-1"))  # host 1's own tier, same steps and tokens, other host
    a = np.arange(16, dtype=np.float32).reshape(4, 4) + 6
    write_local_step(other, 6, 1, 2, "tok-6", [(1, ("a", a.shape, a.dtype, Box((2, 0), (2, 4)), a[2:]))], {"step": 6}, None,
                     whole_chunks=True)
    with pytest.raises(StepMismatchError):  # the inventory's digest is host 0's manifest
        accept_replica(serve_replica(other, 1, ask6), **kw)
    with pytest.raises(StepMismatchError):  # the right digest, but the manifest records host 1
        accept_replica(serve_replica(other, 1, ask6), **dict(kw, digest=inventory(other)[6]["digest"]))


def test_a_peer_answer_with_other_bytes_serves_nothing_and_the_next_tier_does(tmp_path):
    """The holder's chunks are checked by the receiver against the holder's listed manifest: a
    byte flipped in transit, or the holder's own box's bytes sent under the asked one (a valid
    trailer, other values), leaves the box unserved (the persistent tier then serves it) and
    never reaches the values. The control: the unaltered answer serves it exactly. A truncated
    answer is an InvalidStateError."""
    import msgpack

    from ckptfmt.errors import InvalidStateError
    from ckptfmt.manager._tierrestore import accept_replica, serve_replica

    repo, inv, reqs = _holder(tmp_path)
    ask, plan = _ask(inv, 6, reqs)
    kw = dict(step=6, token="tok-6", holder=0, world=2, digest=inv[6]["digest"], plan=plan)
    honest = serve_replica(repo, 1, ask)
    assert reqs[0] in accept_replica(honest, **kw)[0]
    doc = msgpack.unpackb(honest, raw=False)
    flipped = dict(doc, chunks=[bytes([doc["chunks"][0][0] ^ 1]) + bytes(doc["chunks"][0][1:])])
    assert accept_replica(msgpack.packb(flipped, use_bin_type=True), **kw)[0] == {}
    ckpt = repo.open(6)  # the holder's own box (h0/...), stored with its own valid trailer
    own = ckpt.read_chunks(ckpt.chunk_refs([("h0/000000", Box((0, 0), (2, 4)))]))[0]
    swapped = dict(doc, chunks=[bytes(own)])
    assert bytes(own) != bytes(doc["chunks"][0]) and accept_replica(msgpack.packb(swapped, use_bin_type=True), **kw)[0] == {}
    with pytest.raises(InvalidStateError):
        accept_replica(honest[:len(honest) // 2], **kw)


def test_a_holder_never_serves_a_box_of_another_owner(tmp_path):
    """Asked by host 1 for host 0's own tensor (h0/...), the holder serves nothing of it; the
    control: asked for h1/..., it serves."""
    import msgpack

    from ckptfmt.manager._tierrestore import serve_replica

    repo, _, _ = _holder(tmp_path)
    for local, served in (("h0/000000", False), ("h1/000001", True)):
        ask = msgpack.packb({"step": 6, "token": "tok-6", "reqs": [[local, [0, 0], [2, 4]]]})
        doc = msgpack.unpackb(serve_replica(repo, 1, ask), raw=False)
        assert bool(doc["refs"]) == served, (local, doc["refs"])

def _raw_payload(head: list, data: bytes) -> np.ndarray:
    """A payload with this header (a list of box records, packed as is) and data region: what a
    hostile peer can send, since the payload's crc32c only proves it arrived as sent."""
    import msgpack

    raw = msgpack.packb(head, use_bin_type=True)
    base = -(-(16 + len(raw)) // 64) * 64
    out = np.zeros(base + len(data), np.uint8)
    out[:8] = np.frombuffer(b"ckptbox1", np.uint8)
    out[8:16] = np.frombuffer(len(raw).to_bytes(8, "little"), np.uint8)
    out[16:16 + len(raw)] = np.frombuffer(raw, np.uint8)
    out[base:] = np.frombuffer(data, np.uint8)
    return out


def _good_head() -> tuple[list, bytes]:
    """Two float32 boxes of "w" (12,) and a bool box of "m" (2,), laid out as pack_payload lays them."""
    data = bytearray(192)
    data[0:16] = np.arange(4, dtype="<f4").tobytes()
    data[64:80] = np.arange(4, 8, dtype="<f4").tobytes()
    data[128:130] = b"\x01\x00"
    return [["w", [12], "float32", [0], [4], 0, 16], ["w", [12], "float32", [4], [4], 64, 16],
            ["m", [2], "bool", [0], [2], 128, 2]], bytes(data)


def _damaged(damage: str) -> tuple[list, bytes]:
    head, data = _good_head()
    if damage == "negative_shape":
        head[1][4] = [-4]
    elif damage == "box_outside_tensor":
        head[1][3] = [10]  # rows 10..13 of a 12-row tensor
    elif damage == "box_rank":
        head[1][3], head[1][4] = [4, 0], [4, 1]
    elif damage == "duplicate_box":
        head[1][3] = [0]  # the first box again, at its own bytes
    elif damage == "overlapping_data":
        head[1][5] = 0  # another box, on the first box's bytes
    elif damage == "unaligned_data":
        head[1][5] = 32
    elif damage == "two_shapes_for_a_key":
        head[1][1] = [16]
    elif damage == "bool_byte":
        data = data[:129] + b"\x02" + data[130:]
    elif damage == "unknown_dtype":
        head[0][2] = "float128"  # numpy knows it; the format does not
    elif damage == "non_integer_extent":
        head[0][4] = [True]
    elif damage == "too_many_dims":
        head[0][1], head[0][3], head[0][4] = [1] * 40, [0] * 40, [1] * 40
    elif damage == "short_record":
        head[0] = head[0][:6]
    elif damage == "trailing_header_bytes":
        head = [*head, []]  # the box count says 4, the records 3 and an empty array
        raw = _raw_payload(head, data)
        raw[16] = 0x93  # fixarray of 3: a header with bytes after its last box
        return raw, data  # type: ignore[return-value]
    return head, data


@pytest.mark.parametrize("damage", ["negative_shape", "box_outside_tensor", "box_rank", "duplicate_box",
                                    "overlapping_data", "unaligned_data", "two_shapes_for_a_key", "bool_byte",
                                    "unknown_dtype", "non_integer_extent", "too_many_dims", "short_record",
                                    "trailing_header_bytes"])
def test_unpack_boxes_checks_every_header_field(damage):
    """Each hostile header field (issue 47, item 6) raises a typed error naming the exchange and,
    where the record names one, the key: InvalidStateError, InvalidDataError for a bool byte other
    than 0/1. The control: the intact payload built the same way decodes to its values."""
    from ckptfmt.errors import InvalidDataError, InvalidStateError
    from ckptfmt.manager._payload import unpack_payload

    head, data = _good_head()
    got = unpack_payload(_raw_payload(head, data), "tiers/save/3 from rank 1")
    assert [(k, s, b) for k, s, _, b, _ in got] == [("w", (12,), Box((0,), (4,))), ("w", (12,), Box((4,), (4,))),
                                                    ("m", (2,), Box((0,), (2,)))]
    assert got[1][4].tolist() == [4.0, 5.0, 6.0, 7.0] and got[2][4].tolist() == [True, False]
    head, data = _damaged(damage)
    bad = head if isinstance(head, np.ndarray) else _raw_payload(head, data)
    want = InvalidDataError if damage == "bool_byte" else InvalidStateError
    with pytest.raises(want) as e:
        unpack_payload(bad, "tiers/save/3 from rank 1")
    assert type(e.value) is want and e.value.object == "tiers/save/3 from rank 1"
    if damage in ("negative_shape", "box_outside_tensor", "box_rank", "duplicate_box", "overlapping_data",
                  "unaligned_data", "two_shapes_for_a_key", "bool_byte"):
        assert e.value.key == ("m" if damage == "bool_byte" else "w"), e.value


_HOSTILE = r'''
import json, resource, sys, time
import msgpack, numpy as np
from ckptfmt.manager import _payload as P

case = sys.argv[1]
pk = msgpack.Packer(use_bin_type=True)
if case == "empty_arrays":  # the decoder's own header cap, all empty arrays
    n = P._MAX_HEADER - 5
    raw, data = pk.pack_array_header(n) + b"\x90" * n, 0
elif case == "one_empty_array":  # an empty box list followed by a header cap of empty arrays
    raw, data = b"\x90" * P._MAX_HEADER, 0
else:  # the box cap of valid records (+1 over it), or at the cap with the last the first again
    n = P._MAX_BOXES + (case == "over_box_cap")
    raw = bytearray(pk.pack_array_header(n))
    for i in range(n):  # entry by entry, so that building the header does not raise the peak
        raw += pk.pack([f"k{0 if case == 'duplicate_at_cap' and i == n - 1 else i}", [], "bool", [], [], 64 * i, 1])
    data = 64 * n
base = -(-(16 + len(raw)) // 64) * 64
pay = np.zeros(base + data, np.uint8)
pay[:8] = np.frombuffer(b"ckptbox1", np.uint8)
pay[8:16] = np.frombuffer(len(raw).to_bytes(8, "little"), np.uint8)
pay[16:16 + len(raw)] = np.frombuffer(bytes(raw), np.uint8)
del raw
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
try:
    P.unpack_payload(pay, "tiers/save/3 from rank 1")
    err = None
except Exception as e:
    err = type(e).__name__
print(json.dumps({"s": time.perf_counter() - t, "mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024,
                  "error": err, "header": int(pay[8:16].view("<u8")[0])}))
'''


@pytest.mark.parametrize("case", ["empty_arrays", "one_empty_array", "over_box_cap", "duplicate_at_cap"])
def test_a_hostile_peer_header_costs_at_most_its_size(case):
    """A header at the decoder's caps is rejected with InvalidStateError in bounded time and memory
    (the peak RSS growth of a fresh process): 64 MiB of empty msgpack arrays took 47 s and 4.86 GB
    before the box count was checked before decoding. The box cap itself: one box over it is
    rejected before any box is decoded; at the cap every box is decoded, so a duplicate as the
    last box is the dearest header there is. The control: the same boxes without it decode."""
    from ckptfmt.manager import _payload

    def run(case: str) -> dict:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, "-c", _HOSTILE, case], env=env, capture_output=True, text=True,
                           timeout=120, cwd=root)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout)

    got = run(case)
    assert got["error"] == "InvalidStateError", got
    assert got["mib"] < 200, got
    if case in ("empty_arrays", "one_empty_array"):
        assert got["header"] == _payload._MAX_HEADER and got["s"] < 5, got
    elif case == "over_box_cap":
        assert got["s"] < 1, got  # rejected before any box is decoded
    else:
        assert got["s"] < 10, got  # every box decoded (about 2 s here)
        control = run("at_cap")
        assert control["error"] is None and control["mib"] < 200, control


def test_a_hostile_answer_or_ask_costs_about_its_size(tmp_path):
    """16 MiB of empty msgpack arrays as a holder's answer (or as an ask to a holder) is refused in
    well under a second (InvalidStateError; the holder answers with nothing), where the decoder's
    default limits built 16 M lists first. The control: an honest answer of the same step decodes."""
    import time

    import msgpack

    from ckptfmt.errors import InvalidStateError
    from ckptfmt.manager._tierrestore import accept_replica, serve_replica

    repo, inv, reqs = _holder(tmp_path)
    ask, plan = _ask(inv, 6, reqs)
    kw = dict(step=6, token="tok-6", holder=0, world=2, digest=inv[6]["digest"], plan=plan)
    assert reqs[0] in accept_replica(serve_replica(repo, 1, ask), **kw)[0]
    n = 16 << 20
    hostile = msgpack.packb({"manifest": b"", "refs": [[]] * (n - 64), "chunks": [], "state": None})
    t0 = time.perf_counter()
    with pytest.raises(InvalidStateError):
        accept_replica(hostile, **kw)
    empty = msgpack.unpackb(serve_replica(repo, 1, msgpack.packb({"step": 6, "token": "tok-6", "reqs": [[]] * (n - 64)})))
    assert empty["refs"] == [] and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("mapped", [False, True])
def test_a_tier_file_written_after_a_restore_never_reaches_the_default_restore(tmp_path, mapped):
    """After a restore from the local tier, another process rewrites every tier file in place
    (same size, other bytes). With the default (``mapped=False``: a private copy) the restored
    state is unchanged. The broken control, ``mapped=True`` (opt-in, documented risk), shows the
    write reaching the live state through the mapping."""
    assert LocalTier(str(tmp_path)).mapped is False  # the default copies
    tier = LocalTier(str(tmp_path / "local"), every=2, keep=2, mapped=mapped)
    with CheckpointManager(str(tmp_path / "p"), save_every_steps=4, local=tier) as m:
        for s in range(1, 5):
            m.save(s, _state(s), extra={"s": s})
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:
        r = m.restore(_state(0))
    assert r.stats["tiers"]["local"] > 0 and r.stats["tiers"]["persistent"] == 0
    before = {k: np.array(v) for k, v in r.state.items()}
    for root, _, files in os.walk(tier.url(0)):
        for name in files:
            path = os.path.join(root, name)
            if "/t/" in path or "/p/" in path:  # a shard object or a pack of a tensor
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.write(b"\x7f" * size)
    changed = any(not np.array_equal(before[k], r.state[k]) for k in before)
    assert changed == mapped, (mapped, changed)


def test_a_local_tier_serves_only_its_own_run(tmp_path):
    """Run A saves steps 1-6 beside repository pA (local 4 and 6; persistent 4). A new run B with a
    fresh, empty repository pB and the same tier path (a sweep, a copied config, a /dev/shm that
    outlived a crash) must not resume from A's local step: it finds nothing to restore. Controls:
    run A restarted on pA resumes from its own tier (step 6), and B with
    ``LocalTier(adopt=True)`` adopts A's tier on purpose. The run identity is pA's, kept in
    ``tiers/run.json`` and recorded in every local step."""
    from ckptfmt.errors import StepNotFoundError
    from ckptfmt.manager._tiers import RUN_KEY

    tier = _save(tmp_path, range(1, 7))
    pa = Repository(str(tmp_path / "p"))
    run_a = json.loads(pa.storage.read(RUN_KEY))["run"]
    assert inventory(Repository(tier.url(0)))[6]["run"] == run_a
    with CheckpointManager(str(tmp_path / "p"), local=tier) as m:  # control: the same run resumes locally
        r = m.restore(_state(0))
    assert r.step == 6 and r.stats["tiers"]["local"] > 0
    with CheckpointManager(str(tmp_path / "pB"), local=tier) as m:
        with pytest.raises(StepNotFoundError):  # nothing of run A: a fresh start
            m.restore(_state(0))
    assert json.loads(Repository(str(tmp_path / "pB")).storage.read(RUN_KEY))["run"] != run_a
    adopted = LocalTier(tier.path, every=tier.every, keep=tier.keep, adopt=True)
    with CheckpointManager(str(tmp_path / "pB"), local=adopted) as m:  # control: adopted on purpose
        r = m.restore(_state(0))
    assert r.step == 6 and all(np.array_equal(r.state[k], v) for k, v in _state(6).items())


def test_the_manager_s_tier_hooks_are_a_collaborator_it_is_given(tmp_path):
    """A manager subclass hands the local tier its own TierHooks (as the bridges' managers do):
    the tier snapshots through it at save and asks it for the boxes at restore. Hooks that refuse
    the target (``requests`` None) leave the restore to the persistent tier, on the same step the
    local copy would have served; control: the core's hooks serve step 6 from the local tier."""
    from ckptfmt.manager import TierHooks

    class Counting(TierHooks):
        def __init__(self, serve: bool) -> None:
            self.serve, self.calls = serve, []

        def snapshot(self, state, extra, rank_state):
            self.calls.append("snapshot")
            return super().snapshot(state, extra, rank_state)

        def requests(self, target, tensors=None):
            self.calls.append("requests")
            return super().requests(target, tensors) if self.serve else None

    class Manager(CheckpointManager):
        def __init__(self, url: str, hooks: TierHooks, **kw) -> None:
            self._hooks = hooks
            super().__init__(url, **kw)

        def _new_tier_hooks(self) -> TierHooks:
            return self._hooks

    tier = LocalTier(str(tmp_path / "local"), every=2, keep=2)
    saving = Counting(serve=True)
    with Manager(str(tmp_path / "p"), saving, save_every_steps=3, local=tier) as m:
        for s in range(1, 7):
            m.save(s, _state(s))
        m.wait()
        assert [t.step for t in m.tier_history] == [2, 4, 6] and m.tiers is not None
    assert saving.calls == ["snapshot"] * 3
    refusing = Counting(serve=False)
    with Manager(str(tmp_path / "p"), refusing, local=tier) as m:
        r = m.restore(_state(0))
    assert refusing.calls == ["requests"] and r.step == 6
    assert "tier_token" not in r.stats and r.stats["tiers"]["local"] == r.stats["tiers"]["peer"] == 0
    with Manager(str(tmp_path / "p"), Counting(serve=True), local=tier) as m:  # control
        r = m.restore(_state(0))
    assert r.step == 6 and r.stats["tier_token"] and r.stats["tiers"]["local"] > 0
    assert all(np.array_equal(r.state[k], v) for k, v in _state(6).items())
