"""Incremental saves (format revision 1.1; FORMAT.md 5.13, 8.4, 10; issue 18).

Real file system and real tensorstore. Every check has its control: what is referenced restores
bit for bit and what may not be referenced is written; a damaged referenced object fails every
step that references it and no other; retention and gc keep what a manifest references or a live
lease pins, and free it once nothing does.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import crc32c as _crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfmt import (Box, ChecksumMismatchError, InvalidManifestError, LocalShard, MissingShardError, Repository,
                     SaveOptions, UnsupportedVersionError, save)
from ckptfmt.repository._gc import unrestorable
from ckptfmt.layout import lease_bytes, lease_key, save_prefix
from ckptfmt.manifest import PACKS, REFERENCES, parse_manifest
from ckptfmt.storage import DelegatingStorage, open_storage

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_V11 = ROOT / "spec" / "examples" / "repo-1.1"
BASE = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)  # frozen: 4 row shards


def shards(step: int, base: np.ndarray = BASE, *, source: object = None) -> list[LocalShard]:
    """A frozen base in 4 row blocks, and a small adapter that changes at every step."""
    adapter = np.full((8,), step, np.float32)
    out = [LocalShard("base", base.shape, base.dtype, Box((r, 0), (16, 16)), base[r:r + 16], source=source)
           for r in range(0, 64, 16)]
    return out + [LocalShard("adapter", adapter.shape, adapter.dtype, Box.full(adapter.shape), adapter)]


def values(step: int, base: np.ndarray = BASE) -> dict[str, np.ndarray]:
    return {"base": base, "adapter": np.full((8,), step, np.float32)}


def restores(repo: Repository, step: int, want: dict[str, np.ndarray]) -> None:
    assert repo.verify(step) == repo.manifest(step).nbytes
    ck = repo.open(step)
    for k, v in want.items():
        got = ck.read(k)
        assert got.dtype == v.dtype and got.tobytes() == v.tobytes(), k


def age(path: Path) -> None:
    """mtime a day back for ``path`` and everything below it."""
    old = time.time() - 86400
    for p in [*path.rglob("*"), path]:
        os.utime(p, (old, old), follow_symlinks=False)


def base_object(repo: Repository, step: int, row: int = 0) -> Path:
    return Path(repo.url.removeprefix("file://")) / repo.manifest(step).tensors["base"].object_key(row)


def base_start(repo: Repository, step: int, row: int = 0) -> int:
    """Where row ``row`` of ``base`` starts in its object (its pack, FORMAT.md 5.15)."""
    return repo.manifest(step).tensors["base"].shard_start(row)


def refs(m, key: str = "base") -> set[int]:
    """The rows of ``key`` whose object an earlier save wrote (a pack or a shard object)."""
    t = m.tensors[key]
    return {s for s in range(len(t.shards)) if t.is_referenced(s, m.save_id)}


def test_unchanged_shards_are_referenced_and_every_step_restores(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    m0 = save(url, 0, shards(0))
    m1 = save(url, 1, shards(1))
    m2 = save(url, 2, shards(2))
    assert m0.must_understand == (PACKS,) and m0.referenced_nbytes == 0
    for m in (m1, m2):
        assert m.must_understand == (PACKS,) and refs(m) == {0, 1, 2, 3}  # rows in m0's pack
        assert m.referenced_nbytes == int(m0.tensors["base"].shards.nbytes.sum())
        assert m.written_nbytes == int(m.tensors["adapter"].shards.nbytes.sum())
        assert m.referenced_saves == {m0.save_id}  # one level deep: m2 names m0, not m1
    repo = Repository(url)
    for s in (0, 1, 2):
        restores(repo, s, values(s))
    # control: the opt-out writes everything and gives a revision 1.0 manifest
    m3 = save(url, 3, shards(3), options=SaveOptions(reuse="off"))
    assert m3.referenced_saves == frozenset() and m3.referenced_nbytes == 0 and refs(m3) == set()
    restores(repo, 3, values(3))
    with pytest.raises(ValueError, match="reuse"):
        save(url, 4, shards(4), options=SaveOptions(reuse="sometimes"))


def _crc_twin(data: bytes) -> bytes:
    """Different bytes of the same length with the same crc32c (crc32c is affine over GF(2))."""
    n = len(data)
    zero = _crc32c.crc32c(bytes(n))

    def lin(msg: bytes) -> int:  # the linear part: crc(msg) ^ crc(0^n)
        return _crc32c.crc32c(msg) ^ zero

    def unit(bit: int) -> bytes:  # a 1 in bit ``bit`` of the last 4 bytes
        b = bytearray(n)
        b[n - 4 + bit // 8] = 1 << (bit % 8)
        return bytes(b)

    e = bytearray(n)
    e[0] = 0x01
    target = lin(bytes(e))
    cols = [lin(unit(i)) for i in range(32)]
    # Solve sum(x_i * cols[i]) = target over GF(2) by elimination, tracking combinations.
    rows = [(c, 1 << i) for i, c in enumerate(cols)]
    basis: dict[int, tuple[int, int]] = {}
    for v, comb in rows:
        for bit in reversed(range(32)):
            if not (v >> bit) & 1:
                continue
            if bit in basis:
                v, comb = v ^ basis[bit][0], comb ^ basis[bit][1]
            else:
                basis[bit] = (v, comb)
                break
    v, comb = target, 0
    for bit in reversed(range(32)):
        if (v >> bit) & 1:
            v, comb = v ^ basis[bit][0], comb ^ basis[bit][1]
    assert v == 0
    for i in range(32):
        if (comb >> i) & 1:
            e[n - 4 + i // 8] ^= 1 << (i % 8)
    twin = bytes(a ^ b for a, b in zip(data, e))
    assert twin != data and _crc32c.crc32c(twin) == _crc32c.crc32c(data)
    return twin


def test_a_crc_match_alone_is_not_proof(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    block = BASE[:16]
    twin_block = np.frombuffer(_crc_twin(block.tobytes()), np.float32).reshape(block.shape)
    twin = BASE.copy()
    twin[:16] = twin_block
    save(url, 0, shards(0))
    m1 = save(url, 1, shards(1, twin))
    repo = Repository(url)
    t0, t1 = repo.manifest(0).tensors["base"], m1.tensors["base"]
    assert int(t0.chunks.crc32c[0]) == int(t1.chunks.crc32c[0])  # the chunk crc32c agree ...
    assert refs(m1) == {1, 2, 3}                                     # ... yet row 0 was written
    restores(repo, 1, values(1, twin))
    # control: the same bytes again are referenced
    m2 = save(url, 2, shards(2, twin))
    assert refs(m2) == {0, 1, 2, 3}
    restores(repo, 2, values(2, twin))


def test_identity_proof_reads_nothing_and_byte_proof_rereads(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    frozen = BASE.copy()
    frozen.flags.writeable = False  # the identity proof is for immutable sources only
    save(url, 0, shards(0, frozen, source=frozen))
    repo = Repository(url)
    obj = base_object(repo, 0, 1)
    data = bytearray(obj.read_bytes())
    data[base_start(repo, 0, 1) + 5] ^= 0x40  # damage step 0's object behind the writer's back
    obj.write_bytes(bytes(data))
    # The identity proof reads nothing: it references what this process wrote for this very
    # object, so step 1 carries step 0's damage, which every reader then detects.
    m1 = save(url, 1, shards(1, frozen, source=frozen))
    assert refs(m1) == {0, 1, 2, 3}
    with pytest.raises(ChecksumMismatchError):
        repo.verify(1)
    # control: the byte proof reads the object, finds the damage and writes that shard anew
    m2 = save(url, 2, shards(2, frozen, source=frozen), options=SaveOptions(reuse="compare"))
    assert refs(m2) == {0, 2, 3}
    restores(repo, 2, values(2, frozen))
    # control: another object with the same bytes has no identity proof; the byte proof holds
    other = frozen.copy()
    m3 = save(url, 3, shards(3, other, source=other))
    assert refs(m3) == {0, 1, 2, 3}
    assert m3.tensors["base"].object_key(1).startswith(f"saves/{m2.save_id}/")
    restores(repo, 3, values(3, other))


class _ShardReads(DelegatingStorage):
    """Counts the reads of shard objects (a byte proof reads them; an identity proof does not)."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)
        self.reads = 0

    def read_range(self, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> object:
        self.reads += "/t/" in key or "/p/" in key
        return super().read_range(key, start, stop, tensor=tensor)


def test_a_changed_source_is_not_hashed_until_it_stops_changing(tmp_path: Path) -> None:
    """A tracked source whose bytes changed since the previous save (a training step's new array)
    is written without its digest; the first save that finds it unchanged proves it by bytes (one
    read) and takes the digest, and the next one proves it by identity (no read). Control: a
    source first seen in a first save (a frozen base) is proven by identity at once."""
    url = str(tmp_path / "r")
    first = BASE.copy()
    first.flags.writeable = False
    changed = (BASE + 1).copy()
    changed.flags.writeable = False

    def step(n: int, src: np.ndarray) -> tuple[int, set[int]]:
        counting = _ShardReads(open_storage(url))
        m = save(Repository(url, storage=counting), n, shards(n, src, source=src))
        return counting.reads, refs(m)

    assert step(0, first) == (0, set())  # nothing to prove against
    assert step(1, first) == (0, {0, 1, 2, 3})  # control: first seen in a first save: identity at once
    assert step(2, changed) == (0, set())  # changed since step 1: written, and not hashed
    reads, referenced = step(3, changed)
    assert referenced == {0, 1, 2, 3} and reads == 4  # unchanged now: proven by its bytes, once
    assert step(4, changed) == (0, {0, 1, 2, 3})  # then by identity and digest
    restores(Repository(url), 4, values(4, changed))


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_damaged_referenced_object_fails_every_step_that_references_it(tmp_path: Path, damage: str) -> None:
    url = str(tmp_path / "r")
    for s in range(3):
        save(url, s, shards(s))
    save(url, 3, shards(3), options=SaveOptions(reuse="off"))
    repo = Repository(url)
    obj = base_object(repo, 0, 2)
    assert base_object(repo, 1, 2) == obj == base_object(repo, 2, 2)
    if damage == "delete":
        obj.unlink()
    else:
        b = bytearray(obj.read_bytes())
        b[base_start(repo, 0, 2) + 3] ^= 0x01
        obj.write_bytes(bytes(b))
    want = MissingShardError if damage == "delete" else ChecksumMismatchError
    for s in (0, 1, 2):
        with pytest.raises(want) as e:
            repo.verify(s)
        # (a deleted pack of step 0 also held its adapter, which verify reaches first)
        assert e.value.key == ("adapter" if damage == "delete" and s == 0 else "base") and "saves/" in str(e.value.object)
        with pytest.raises(want):
            repo.open(s).read("base")
        if damage == "flip" or s > 0:  # (deleting step 0's pack takes its own adapter with it)
            np.testing.assert_array_equal(repo.open(s).read("adapter"), values(s)["adapter"])
    restores(repo, 3, values(3))  # control: the step with its own objects is unaffected


def _golden_doc(step: int = 2) -> dict:
    return json.loads((GOLDEN_V11 / f"manifests/{step:020d}.json").read_bytes())


def _parse(doc: dict) -> object:
    return parse_manifest(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n")


def _mutations() -> dict[str, tuple]:
    def g(doc):
        return doc["extensions"][REFERENCES]["tensors"]["base/w"][0]
    other = "000000000009-20260101T000000-00000009"
    return {
        "not in must_understand": (lambda d: d.update(must_understand=[]), InvalidManifestError),
        "payload missing": (lambda d: d.update(extensions={}), InvalidManifestError),
        "unknown extension": (lambda d: d["must_understand"].append("org.example.x"), UnsupportedVersionError),
        "own save id": (lambda d: g(d).update(save_id=d["save_id"]), InvalidManifestError),
        "path of another save": (lambda d: g(d).update(save_id=other), InvalidManifestError),
        "path escapes": (lambda d: g(d).update(path=g(d)["path"] + "/../../x"), InvalidManifestError),
        "row out of range": (lambda d: g(d).update(shards=[1]), InvalidManifestError),
        "rows not ascending": (lambda d: g(d).update(shards=[0, 0]), InvalidManifestError),
        "unknown member": (lambda d: g(d).update(extra=1), InvalidManifestError),
        "unknown tensor": (lambda d: d["extensions"][REFERENCES]["tensors"].update(nope=[g(d)]), InvalidManifestError),
        "own array path": (lambda d: g(d).update(save_id=d["save_id"], path=d["tensors"]["base/w"]["array"]["path"]),
                           InvalidManifestError),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_references_are_validated(name: str) -> None:
    m = _parse(_golden_doc())  # control: the golden 1.1 manifest parses
    assert m.tensors["base/w"].objects == {0: _golden_doc()["extensions"][REFERENCES]["tensors"]["base/w"][0]["path"]}
    mutate, err = _mutations()[name]
    doc = _golden_doc()
    mutate(doc)
    with pytest.raises(err):
        _parse(doc)


def test_retention_keeps_referenced_objects_until_no_manifest_references_them(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    base_sid = save(url, 0, shards(0)).save_id
    for s in (1, 2):
        save(url, s, shards(s))
    repo = Repository(url)
    root = Path(url)
    report = repo.gc(keep_last=1)  # deletes the base step's manifest (and step 1's) ...
    assert report.removed_steps == [0, 1] and repo.steps() == [2]
    assert (root / save_prefix(base_sid)).is_dir()  # ... but not the objects step 2 references
    restores(repo, 2, values(2))
    save(url, 3, shards(3), options=SaveOptions(reuse="off"))
    repo.delete(2)  # the last manifest that references the base save goes
    assert repo.steps() == [3]
    repo.gc(grace_s=0.0)
    assert not (root / save_prefix(base_sid)).exists()  # control: then it is collected
    restores(repo, 3, values(3))


def test_a_live_lease_pins_the_saves_it_may_reference(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    base_sid = save(url, 0, shards(0)).save_id
    root = Path(url)
    busy = "000000000001-20260101T000000-0000abcd"  # a save in progress that may reference step 0
    (root / save_prefix(busy)).mkdir(parents=True)
    lease = root / lease_key(busy)
    lease.write_bytes(lease_bytes({"save_id": busy, "step": 1, "world": 1, "refs": [base_sid]}))
    repo = Repository(url)
    repo.delete(0)
    assert (root / save_prefix(base_sid)).is_dir()
    age(root / save_prefix(base_sid))  # older than the grace period: only the pin keeps it
    report = repo.gc(grace_s=60.0)
    assert report.pinned == [base_sid] and report.in_progress == [busy]
    assert (root / save_prefix(base_sid)).is_dir()
    # control: once the lease is claimed (or gone), the unreferenced save is collected
    lease.write_bytes(lease_bytes({"save_id": busy, "step": 1, "world": 1, "refs": [base_sid], "state": "collected"}))
    repo.gc(grace_s=60.0)
    assert not (root / save_prefix(base_sid)).exists()


class _BlindFolder(DelegatingStorage):
    """The file store, but the shallow scan could not look into one save folder (as when it is
    swapped for a link between the listing and the look, or cannot be opened)."""

    def __init__(self, inner, name: str) -> None:
        super().__init__(inner)
        self.name = name

    def scan_children(self, prefix: str, *, marker=None, deep: bool = True):
        out = self.inner.scan_children(prefix, marker=marker, deep=deep)
        return [dataclasses.replace(e, marker=None, error="PermissionError: denied")
                if not deep and e.name == self.name else e for e in out]


@pytest.mark.parametrize("blind", [True, False])
def test_a_save_folder_the_lease_scan_cannot_look_into_pins_everything(tmp_path: Path, blind: bool) -> None:
    """The leases are read folder by folder (``scan_children(deep=False)``): a folder under saves/
    that could not be looked into may hold a lease that pins anything, so a delete keeps the
    objects it would remove (FORMAT.md 4.4). Control: the same folder, looked into, holds no
    lease, and the delete removes them."""
    url = str(tmp_path / "r")
    base_sid = save(url, 0, shards(0)).save_id
    root = Path(url)
    busy = "000000000001-20260101T000000-0000abcd"
    (root / save_prefix(busy)).mkdir(parents=True)
    inner = open_storage(url)
    repo = Repository(url, storage=_BlindFolder(inner, busy) if blind else inner)
    repo.delete(0)
    assert repo.steps() == []
    assert (root / save_prefix(base_sid)).is_dir() is blind


@pytest.mark.parametrize("killed_lease", ["stale", "fresh", "stale-and-another-pin"])
def test_a_lease_gc_claims_releases_its_pins_in_the_same_run(tmp_path: Path, killed_lease: str) -> None:
    """A killed incremental save's stale lease pins a retired save: one gc run claims the lease and
    then collects both (FORMAT.md 10.3, revision 1.1.1). Controls: a fresh lease is not claimed, so
    its pin holds; a second, live lease pinning the same save keeps it too."""
    url = str(tmp_path / "r")
    base_sid = save(url, 0, shards(0)).save_id
    root = Path(url)
    dead = "000000000001-20260101T000000-0000dead"
    (root / save_prefix(dead) / "t").mkdir(parents=True)
    (root / save_prefix(dead) / "t" / "junk").write_bytes(b"x" * 10)
    beat = time.time() - (0 if killed_lease == "fresh" else 86400)
    (root / lease_key(dead)).write_bytes(lease_bytes({"save_id": dead, "step": 1, "world": 1, "refs": [base_sid]},
                                                     now_unix=beat))
    if killed_lease == "stale-and-another-pin":
        busy = "000000000002-20260101T000000-0000beef"
        (root / save_prefix(busy)).mkdir(parents=True)
        (root / lease_key(busy)).write_bytes(lease_bytes({"save_id": busy, "step": 2, "world": 1, "refs": [base_sid]}))
    repo = Repository(url)
    repo.delete(0)
    age(root / save_prefix(base_sid))
    age(root / save_prefix(dead))
    report = repo.gc(grace_s=60.0)
    if killed_lease == "stale":
        assert sorted(report.removed_saves) == sorted([base_sid, dead]) and report.pinned == [], report.to_json()
        assert not (root / save_prefix(base_sid)).exists() and not (root / save_prefix(dead)).exists()
    else:
        assert report.pinned == [base_sid] and (root / save_prefix(base_sid)).is_dir()
        assert (root / save_prefix(dead)).exists() == (killed_lease == "fresh")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.tuples(st.just("save"), st.booleans(), st.booleans()),
                              st.tuples(st.just("retain"), st.integers(1, 3)),
                              st.tuples(st.just("delete"), st.integers(0, 10))), min_size=3, max_size=9))
def test_property_gc_never_deletes_what_a_committed_manifest_references(tmp_path: Path, ops: list) -> None:
    """Any interleaving of incremental saves (some tensors changed, some not), retention, deletes
    and gc: every listed step keeps every object it references, with its size."""
    root = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
    url = str(root)
    repo = Repository(url)
    step = 0
    a = np.arange(32, dtype=np.int32)
    b = np.ones((4, 4), np.float32)
    for op in ops:
        if op[0] == "save":
            a = a + 1 if op[1] else a
            b = b * 2 if op[2] else b
            save(url, step, [LocalShard("a", a.shape, a.dtype, Box((0,), (16,)), a[:16]),
                             LocalShard("a", a.shape, a.dtype, Box((16,), (16,)), a[16:]),
                             LocalShard("b", b.shape, b.dtype, Box.full(b.shape), b)])
            step += 1
        elif op[0] == "retain" and repo.steps():
            repo.gc(keep_last=op[1], grace_s=0.0)
        elif op[0] == "delete" and repo.steps():
            repo.delete(repo.steps()[op[1] % len(repo.steps())])
            repo.gc(grace_s=0.0)
        for s in repo.steps():
            assert unrestorable(repo, s) is None, (s, ops)
    shutil.rmtree(root, ignore_errors=True)
