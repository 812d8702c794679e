"""The integrity conformance suite (FORMAT.md 9.1, "The receiver verifies"; issue 47).

One table, :data:`PATHS`, lists every path that delivers tensor bytes into a restore (or into a
repository, for imports and the replica a local save keeps): where the bytes come from, the
classes that implement it, and the faults it must survive, each with its required outcome:

* a typed :class:`ckptfmt.CheckpointError` subclass, with nothing returned; or
* ``FALLBACK``: the documented fallback (the next tier) serves the right values, and the path
  itself hands out nothing of the damaged copy.

One parametrized test injects each fault into each path. Every case also runs its broken
control: the injection is shown to have reached the bytes (``probe["effective"]``), and the
same path without the fault returns exactly the saved values. A last test finds every
delivery path by introspection (every class in ``ckptfmt`` and ``bridges`` that implements a
source, exchange or reader method) and fails when one is not in the table, so that a new path
cannot skip this suite (its own control: a new class with such a method is reported).
"""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import shutil
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard, Repository
from ckptfmt.errors import (ChecksumMismatchError, CoordinatorLostError, InvalidStateError, MissingShardError,
                            SizeMismatchError, StepMismatchError)

from ckptfmt_tools.faults._coopfaults import OtherStepSender, ThreadGather

ROOT = Path(__file__).resolve().parent.parent
FALLBACK = "fallback"
EXACT = "exact"


@dataclass(frozen=True)
class DeliveryPath:
    """One way tensor bytes reach live state: what it is, the classes that implement it, and for
    each fault the outcome it must have (an error class, or FALLBACK)."""

    what: str
    classes: tuple[str, ...]
    faults: dict[str, Any] = field(default_factory=dict)
    note: str = ""


#: Every delivery path. A class implementing a source, exchange or reader method in ckptfmt or
#: bridges must appear in some entry's ``classes`` (test_every_delivery_path_is_in_the_table).
PATHS: dict[str, DeliveryPath] = {
    "storage": DeliveryPath(
        "a committed step read from its repository (FORMAT.md 9)",
        ("ckptfmt.reader.Checkpoint",),
        {"flip-at-rest": ChecksumMismatchError, "stale-object": ChecksumMismatchError,
         "truncated": SizeMismatchError, "missing": MissingShardError}),
    "cooperative": DeliveryPath(
        "a stored chunk another process read and sent (FORMAT.md 9.1)",
        ("ckptfmt.reader.Checkpoint", "bridges.jax._share.JaxExchange", "bridges.torch._share.TorchExchange"),
        {"flip-in-transit": ChecksumMismatchError, "stale-chunks": ChecksumMismatchError,
         "another-save": StepMismatchError, "dead-peer": CoordinatorLostError}),
    "peer-replica": DeliveryPath(
        "the replica of this host's boxes its holder keeps, sent at restore (FORMAT.md 8.5)",
        ("bridges.jax._peer.JaxPeerExchange", "bridges.torch._peer.TorchPeerExchange"),
        {"stale-step": StepMismatchError, "another-host": StepMismatchError, "flip-in-transit": FALLBACK,
         "another-owner": FALLBACK}),
    "elastic-peer": DeliveryPath(
        "pieces of boxes another process's surviving tier copy holds, sent at an elastic restore "
        "(FORMAT.md 8.5, \"Elastic restore\")",
        ("bridges.jax._peer.JaxPeerExchange", "bridges.torch._peer.TorchPeerExchange"),
        {"stale-step": FALLBACK, "another-host": FALLBACK, "flip-in-transit": FALLBACK, "another-box": FALLBACK},
        note="a refused answer (StepMismatchError, listed in stats['tiers']['refused']) or a failing chunk is "
             "read from the persistent tier when it holds the same save, else the ordinary restore runs"),
    "save-replica": DeliveryPath(
        "a peer's boxes received by a local save, to be kept as its replica (FORMAT.md 8.5)",
        ("bridges.jax._peer.JaxPeerExchange", "bridges.torch._peer.TorchPeerExchange"),
        {"flip-in-transit": ChecksumMismatchError, "malformed": InvalidStateError}),
    "own-tier": DeliveryPath(
        "this host's own local tier (FORMAT.md 8.5, 14.8)",
        ("ckptfmt.reader.Checkpoint",),
        {"flip-at-rest": FALLBACK, "rewritten-after-restore": FALLBACK},
        note="rewritten-after-restore: the default copy is unaffected (the live state keeps the saved values)"),
    "safetensors": DeliveryPath(
        "a safetensors directory restored directly (docs/INTEROP.md)",
        ("ckptfmt.interop._stsource.SafetensorsSource",),
        {"flip-at-rest": ChecksumMismatchError},
        note="only files that carry ckptfmt's checksums can be verified; other writers' files carry none"),
    "dcp-reader": DeliveryPath(
        "torch.distributed.checkpoint.load through CkptfmtStorageReader (bridges/dcp/_reader.py)",
        ("bridges.dcp._reader.CkptfmtStorageReader",),
        {"flip-at-rest": ChecksumMismatchError}),
    "import": DeliveryPath(
        "a foreign checkpoint imported into a repository (safetensors, DCP, Orbax)",
        ("ckptfmt.interop._stimport.BatchReader", "bridges.interop._dcp._DcpBatchReader", "bridges.interop._orbax._OrbaxBatchReader"),
        {"flip-at-rest": ChecksumMismatchError},
        note="a checksummed safetensors source is verified block by block; DCP and Orbax files carry no "
             "checksum to check, and the import's provenance says so"),
}


def _a(step: int = 1) -> np.ndarray:
    return np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step


def _save(url: str, step: int = 1) -> None:
    a = _a(step)
    ckptfmt.save(url, step, [LocalShard("a", a.shape, a.dtype, Box((r, 0), (4, 8)), a[r:r + 4]) for r in range(0, 16, 4)])


def _object(url: str, step: int, key: str = "a", shard: int = 0) -> str:
    t = Repository(url).manifest(step).tensors[key]
    return os.path.join(url, t.object_key(shard))


def _flip(path: str, at: int = 8) -> bool:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    return True


# ---------------------------------------------------------------- the paths' runners
def _storage(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    url = str(tmp / "repo")
    _save(url, 1)
    _save(url, 2)
    obj = _object(url, 1)
    if fault == "flip-at-rest":
        probe["effective"] = _flip(obj)
    elif fault == "stale-object":  # step 2's shard, the same size, in step 1's place
        shutil.copyfile(_object(url, 2), obj)
        probe["effective"] = True
    elif fault == "truncated":
        os.truncate(obj, os.path.getsize(obj) - 1)
        probe["effective"] = True
    elif fault == "missing":
        os.remove(obj)
        probe["effective"] = True
    return {"a": Repository(url).open(1).read("a")}


def _cooperative(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    from ckptfmt.reader import CoopStats, cooperative_reads

    url = str(tmp / "repo")
    _save(url, 1)
    _save(url, 2)
    repo = Repository(url)
    group = ThreadGather(2, flip=(1, 0) if fault == "flip-in-transit" else None,
                      lose=(1, 3) if fault == "dead-peer" else None)

    def source(r: int) -> Any:
        if r == 1 and fault == "stale-chunks":
            return OtherStepSender(repo.open(1), repo.open(2))
        return repo.open(2 if (r == 1 and fault == "another-save") else 1)
    reqs = [("a", Box((r, 0), (4, 8))) for r in range(0, 16, 4)]
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        stats = CoopStats()
        try:
            out[r] = (list(cooperative_reads(source(r), [reqs], group.at(r), stats=stats)), stats)
        except Exception as e:  # noqa: BLE001 - compared below
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    probe["effective"] = fault in ("stale-chunks", "another-save") or bool(group.hits)
    for r in (0, 1):
        if isinstance(out[r], BaseException):
            raise out[r]
    got, stats = out[0]
    assert stats.cooperative and stats.bytes_received > 0  # the bytes did come from the other rank
    return {"a": np.concatenate(got[0])}


def _tier_holder(tmp: Path) -> tuple[Repository, dict, list, Any]:
    from ckptfmt.manager._tierrestore import by_key, cover, held, inventory
    from ckptfmt.manager._tiers import write_local_step

    repo = Repository(str(tmp / "host-0"))
    for step in (4, 6):
        a = _a(step)
        boxes = [(0, ("a", a.shape, a.dtype, Box((0, 0), (8, 8)), a[:8])),
                 (1, ("a", a.shape, a.dtype, Box((8, 0), (8, 8)), a[8:]))]
        write_local_step(repo, step, 0, 2, f"tok-{step}", boxes, {"step": step}, None)
    inv = inventory(repo)
    reqs = [("a", Box((8, 0), (8, 8)))]

    def plan(step: int) -> list:
        index = by_key(held(inv, step, f"tok-{step}", 1, 2))
        return [(r, cover(index, *r)) for r in reqs]
    return repo, inv, reqs, plan


def _peer_replica(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    import msgpack

    from ckptfmt.manager._tierrestore import _peer_ask, accept_replica, serve_replica
    from ckptfmt.manager._tiers import write_local_step

    repo, inv, reqs, plan = _tier_holder(tmp)
    ask_step = 4 if fault == "stale-step" else 6
    holder = repo
    if fault == "another-host":  # host 1's own tier answers in host 0's place
        holder = Repository(str(tmp / "host-1"))
        a = _a(6)
        write_local_step(holder, 6, 1, 2, "tok-6", [(1, ("a", a.shape, a.dtype, Box((8, 0), (8, 8)), a[8:]))],
                         {"step": 6}, None)
    answer = serve_replica(holder, 1, _peer_ask(ask_step, f"tok-{ask_step}", plan(ask_step)))
    if fault in ("flip-in-transit", "another-owner"):
        doc = msgpack.unpackb(answer, raw=False)
        if fault == "flip-in-transit":
            doc["chunks"][0] = bytes([doc["chunks"][0][0] ^ 1]) + bytes(doc["chunks"][0][1:])
        else:  # the holder's own box's stored chunk, sent under the asked tensor
            ckpt = repo.open(6)
            doc["chunks"][0] = bytes(ckpt.read_chunks(ckpt.chunk_refs([("h0/000000", Box((0, 0), (8, 8)))]))[0])
        answer = msgpack.packb(doc, use_bin_type=True)
    probe["effective"] = fault is not None
    values, _ = accept_replica(answer, step=6, token="tok-6", holder=0, world=2, digest=inv[6]["digest"], plan=plan(6))
    if reqs[0] not in values:
        probe["fallback"] = True  # not served here: the next tier (the persistent step) serves it
        return {}
    return {"a[8:]": values[reqs[0]]}


def _elastic_peer(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    """Host 0's local step (its own rows 0..8 and host 1's 8..16 as the replica) served by the
    process holding it to a process of a job with another process count that needs rows 4..12:
    two pieces of two held boxes, checked by the receiver (``_accept``)."""
    from ckptfmt.manager._tieranswer import pack_answers, serve_hosts, unpack_answers
    from ckptfmt.manager._tierelastic import _accept, _pack_ask, _Places
    from ckptfmt.manager._tierplan import TierSource, plan_tier_reads
    from ckptfmt.manager._tiers import HeldBox, write_local_step

    repo, inv, _, _ = _tier_holder(tmp)
    box = Box((4, 0), (8, 8))
    sources = [TierSource(0, 0, tuple(HeldBox.from_wire(w) for w in inv[6]["boxes"]))]
    reads = list(plan_tier_reads(1, [("a", box)], sources).reads)
    assert len(reads) == 2 and all(r.rank == 0 for r in reads)  # assembled from two held boxes
    repos = {0: repo}
    if fault == "another-host":  # host 1's own tier answers in host 0's place
        other = Repository(str(tmp / "host-1"))
        a = _a(6)
        write_local_step(other, 6, 1, 2, "tok-6", [(1, ("a", a.shape, a.dtype, Box((8, 0), (8, 8)), a[8:])),
                                                  (0, ("a", a.shape, a.dtype, Box((0, 0), (8, 8)), a[:8]))],
                         {"step": 6}, None)
        repos = {0: other}
    ask_step = 4 if fault == "stale-step" else 6
    answer = serve_hosts(repos, _pack_ask(ask_step, f"tok-{ask_step}", reads, False))
    if fault in ("flip-in-transit", "another-box"):
        docs = unpack_answers(answer)
        chunks = docs[0]["chunks"] = [bytes(c) for c in docs[0]["chunks"]]
        if fault == "flip-in-transit":
            chunks[0] = bytes([chunks[0][0] ^ 1]) + bytes(chunks[0][1:])
        else:  # each piece's stored chunk sent under the other's reference
            chunks[0], chunks[1] = chunks[1], chunks[0]
        answer = pack_answers(sorted(docs.items()))
    probe["effective"] = fault is not None
    stats: dict = {"refused": []}
    places = _Places([("a", box)], reads)  # each checked piece copied into its place, as elastic_read does
    served, _ = _accept(answer, 0, step=6, token="tok-6", hosts=2, digests={0: inv[6]["digest"]}, reads=reads,
                        mine=list(range(len(reads))), stats=stats, places=places)
    if len(served) < len(reads):
        probe["fallback"] = True  # not served here: the persistent tier (same token) serves those pieces
        assert fault not in ("stale-step", "another-host") or stats["refused"], stats  # refused whole
        return {}
    return {"a[4:12]": places.outputs[0]}


def _save_replica(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    from ckptfmt.checksum import crc32c
    from ckptfmt.manager._payload import check_payload, pack_payload, unpack_payload

    a = _a(1)
    payload = pack_payload([("a", a.shape, a.dtype, Box.full(a.shape), a)])
    crc = crc32c(payload)  # the sender's, sent beside the payload
    got = np.array(payload)
    if fault == "flip-in-transit":
        got[-1] ^= 0x10
    elif fault == "malformed":
        got[16] ^= 0xFF  # the header's first byte
        crc = crc32c(got)  # a sender that packs a bad header: the transit check passes
    probe["effective"] = not np.array_equal(got, payload)
    boxes = unpack_payload(check_payload(got, crc, "tiers/save/1 from rank 1"), "the boxes of host 1 for step 1")
    return {k: np.array(v) for k, _, _, _, v in boxes}


def _own_tier(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    from ckptfmt.manager import CheckpointManager, LocalTier

    tier = LocalTier(str(tmp / "local"), every=2, keep=2)
    with CheckpointManager(str(tmp / "p"), save_every_steps=2, local=tier) as m:
        m.save(2, {"a": _a(1)})
    local = Repository(tier.url(0))
    if fault == "flip-at-rest":
        t = local.manifest(2).tensors["h0/000000"]
        probe["effective"] = _flip(os.path.join(local.url, t.object_key(0)))
    with CheckpointManager(str(tmp / "p"), local=tier) as m:
        r = m.restore({"a": np.zeros((16, 8), np.float32)})
    served = r.stats["tiers"]
    if fault == "flip-at-rest":
        probe["fallback"] = served["persistent"] > 0 and served["local"] == 0
    else:
        assert served["local"] > 0 and served["persistent"] == 0, served
    if fault == "rewritten-after-restore":
        before = np.array(r.state["a"])
        for root, _, files in os.walk(tier.url(0)):
            for name in files:
                if "/t/" in os.path.join(root, name) or "/p/" in os.path.join(root, name):
                    path = os.path.join(root, name)
                    with open(path, "r+b") as f:
                        f.write(b"\x7f" * os.path.getsize(path))
        probe["effective"] = True
        probe["fallback"] = np.array_equal(before, r.state["a"])  # the live state kept its values
    return {"a": np.array(r.state["a"])}


def _exported(tmp: Path) -> Path:
    from ckptfmt.interop import export_safetensors

    url = str(tmp / "repo")
    _save(url, 1)
    out = tmp / "st"
    export_safetensors(url, str(out))
    return out


def _st_data(out: Path) -> str:
    import json

    f = next(p for p in out.iterdir() if p.suffix == ".safetensors")
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return str(f), 8 + n + json.loads(raw[8:8 + n])["a"]["data_offsets"][0]


def _safetensors(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    from ckptfmt.interop import open_source

    out = _exported(tmp)
    if fault == "flip-at-rest":
        f, at = _st_data(out)
        probe["effective"] = _flip(f, at + 5)
    src = open_source(str(out))
    assert src.checksummed
    return {"a": src.read("a")}


def _dcp_reader(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from bridges import torch as bt
    from bridges.dcp import CkptfmtStorageReader, unwrap
    from torch.distributed.checkpoint.api import CheckpointException

    url = str(tmp / "repo")
    bt.save(url, {"a": torch.from_numpy(_a(1))}, step=1)
    if fault == "flip-at-rest":
        probe["effective"] = _flip(_object(url, 1))
    target = {"a": torch.zeros(16, 8)}
    try:
        dcp.load(target, storage_reader=CkptfmtStorageReader(url), no_dist=True)
    except CheckpointException as e:  # DCP wraps every error; the typed one is inside
        err = unwrap(e)
        assert torch.equal(target["a"], torch.zeros(16, 8))  # nothing copied into the target
        raise err if err is not None else AssertionError(f"no ckptfmt error inside {e!r}") from e
    return {"a": target["a"].numpy()}


def _import(tmp: Path, fault: str | None, probe: dict) -> dict[str, np.ndarray]:
    from ckptfmt.interop import import_safetensors

    out = _exported(tmp)
    if fault == "flip-at-rest":
        f, at = _st_data(out)
        probe["effective"] = _flip(f, at + 5)
    url = str(tmp / "imported")
    try:
        import_safetensors(str(out), url, step=3)
    except Exception:
        assert Repository(url).steps() == []  # nothing committed
        raise
    return {"a": Repository(url).open(3).read("a")}


RUNNERS: dict[str, Callable[[Path, str | None, dict], dict[str, np.ndarray]]] = {
    "storage": _storage, "cooperative": _cooperative, "peer-replica": _peer_replica, "elastic-peer": _elastic_peer,
    "save-replica": _save_replica,
    "own-tier": _own_tier, "safetensors": _safetensors, "dcp-reader": _dcp_reader, "import": _import,
}
WANT = {"storage": {"a": _a(1)}, "cooperative": {"a": _a(1)}, "peer-replica": {"a[8:]": _a(6)[8:]},
        "elastic-peer": {"a[4:12]": _a(6)[4:12]},
        "save-replica": {"a": _a(1)}, "own-tier": {"a": _a(1)}, "safetensors": {"a": _a(1)}, "dcp-reader": {"a": _a(1)},
        "import": {"a": _a(1)}}
CASES = [(p, None) for p in PATHS] + [(p, f) for p, d in PATHS.items() for f in d.faults]


def _exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("path,fault", CASES, ids=[f"{p}:{f or 'control'}" for p, f in CASES])
def test_each_fault_on_each_delivery_path(tmp_path, path, fault):
    """The control (no fault) returns exactly the saved values; each fault reaches the bytes and
    ends as the table says: its typed error with nothing returned, or the documented fallback
    with nothing of the damaged copy handed out (and the right values where the path restores)."""
    probe: dict[str, Any] = {}
    run, want = RUNNERS[path], WANT[path]
    if fault is None:
        assert _exact(run(tmp_path, None, probe), want)
        return
    expected = PATHS[path].faults[fault]
    if expected == FALLBACK:
        got = run(tmp_path, fault, probe)
        assert probe.get("effective") and probe.get("fallback"), probe
        assert got == {} or _exact(got, want), got  # nothing of the damaged copy, or the right values
        return
    with pytest.raises(expected):
        run(tmp_path, fault, probe)
    assert probe.get("effective"), probe  # the fault reached the bytes: the check, not luck, refused it


# ---------------------------------------------------------------- every path is in the table
#: Methods through which a class delivers tensor bytes: a restore source, a reader of stored
#: chunks, DCP's reader, a peer exchange; an all-gather with ``sizes`` is a data-plane exchange
#: (the coordinators' all-gathers carry metadata only); ``read(key, box)`` an import's reader.
_SOURCE_METHODS = ("read_boxes", "iter_read_boxes", "read_chunks", "read_data", "shift")


def delivery_classes(modules: list[types.ModuleType]) -> set[str]:
    """Every class defined in ``modules`` that implements a delivery method (protocols excepted)."""
    out: set[str] = set()
    for mod in modules:
        for obj in vars(mod).values():
            if not isinstance(obj, type) or obj.__module__ != mod.__name__ or getattr(obj, "_is_protocol", False):
                continue
            own = vars(obj)
            hit = any(m in own for m in _SOURCE_METHODS)
            if "allgather" in own:
                hit |= "sizes" in inspect.signature(own["allgather"]).parameters
            if "read" in own and callable(own["read"]):
                params = list(inspect.signature(own["read"]).parameters)
                hit |= params[1:3] == ["key", "box"]
            if hit:
                out.add(f"{obj.__module__}.{obj.__qualname__}")
    return out


def _all_modules() -> list[types.ModuleType]:
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    mods = []
    for pkg in ("ckptfmt", "bridges"):
        root = importlib.import_module(pkg)
        mods.append(root)
        for info in pkgutil.walk_packages(root.__path__, prefix=pkg + "."):
            if info.name.endswith("__main__"):
                continue
            mods.append(importlib.import_module(info.name))
    return mods


def test_every_delivery_path_is_in_the_table():
    """Every delivery class of ckptfmt and bridges is listed in PATHS, and every class PATHS names
    exists and delivers. The control: a module defining a new source class (``read_boxes``) and a
    new data-plane exchange is reported as unlisted."""
    listed = {c for d in PATHS.values() for c in d.classes}
    found = delivery_classes(_all_modules())
    assert found - listed == set(), f"delivery paths missing from the integrity table: {sorted(found - listed)}"
    assert listed - found == set(), f"the table names classes that deliver nothing: {sorted(listed - found)}"
    rogue = types.ModuleType("rogue_feature")
    exec("class Shortcut:\n    def read_boxes(self, requests):\n        return []\n"
         "class Broadcast:\n    def allgather(self, name, data, sizes):\n        return []\n"
         "class Coordinator:\n    def allgather(self, name, payload, timeout_s=None):\n        return []\n",
         rogue.__dict__)
    for cls in ("Shortcut", "Broadcast", "Coordinator"):
        getattr(rogue, cls).__module__ = "rogue_feature"
    assert delivery_classes([rogue]) - listed == {"rogue_feature.Shortcut", "rogue_feature.Broadcast"}
