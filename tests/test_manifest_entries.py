"""The manifest's entries cost little per tensor: slotted entries, the empty tables shared by
every tensor with no shard, the fast path's columns viewed (not copied) per entry, and caches
that survive the parser's own replacements. Every table stays read-only, and every value equals
what the exact per-tensor checks build."""
import dataclasses
import gc
import json
import pickle
import tracemalloc

import numpy as np
import pytest

from ckptfmt import Box, LocalShard, SaveOptions, parse_manifest, save
from ckptfmt import manifest as mf
from ckptfmt.layout import arrays_prefix
from ckptfmt.manifest._entries import empty_tables, replace_entry
from manifest_common import same_tables

N_EMPTY = 3000


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The bytes of a save holding two row-sharded tensors of one geometry, a 0-d one and empty ones."""
    d = str(tmp_path_factory.mktemp("entries") / "repo")
    shards = []
    for i in range(2):
        x = np.arange(32, dtype=np.float32).reshape(8, 4) + i
        shards += [LocalShard(f"b/{i}", x.shape, x.dtype, Box((2 * r, 0), (2, 4)), x[2 * r:2 * r + 2]) for r in range(4)]
    shards.append(LocalShard("s", (), np.float32, Box((), ()), np.asarray(1.5, np.float32)))
    shards += [LocalShard(f"e/{i}", (0, 3), np.int32, Box((0, 0), (0, 3)), np.zeros((0, 3), np.int32)) for i in range(3)]
    return save(d, 1, shards, options=SaveOptions(layout="arrays")).to_bytes()


def _many_empty(data: bytes, n: int) -> bytes:
    """``data`` with ``n`` more empty tensors, as an import of empty safetensors tensors writes them."""
    doc = json.loads(data)
    proto, prefix = doc["tensors"]["e/0"], arrays_prefix(doc["save_id"])
    for i in range(n):
        doc["tensors"][f"z/{i:06d}"] = dict(proto, array=dict(proto["array"], path=f"{prefix}z{i:06d}"))
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _retained_per_tensor(build, n: int) -> float:
    """Bytes still held per tensor once ``build()``'s result is built (its input excluded)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept is not None
    return (after - before) / n


def test_parsed_empty_tensors_cost_under_500_bytes_each(saved):
    """Each empty tensor of a parsed manifest holds its key, its path, an entry and an array spec,
    and shares everything else. The control: the same entries, each with its own tables (what the
    parser built before), cost more than the bound, so the measure can fail."""
    data = _many_empty(saved, N_EMPTY)
    per = _retained_per_tensor(lambda: parse_manifest(data), N_EMPTY)
    assert per < 500, per

    def own_tables():
        m = parse_manifest(data)  # built first, then each entry given tables of its own
        return {k: dataclasses.replace(t, shards=mf.ShardTable(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), (),
                                                               np.zeros(0, np.int64), np.zeros(0, np.uint32)),
                                       chunks=mf.ChunkTable(np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                            np.zeros(0, np.uint32)))
                for k, t in m.tensors.items()}
    assert _retained_per_tensor(own_tables, N_EMPTY) > 500


def test_empty_tensors_share_read_only_tables(saved):
    """Every empty tensor of a rank holds the one pair of empty tables; they cannot be written.
    The control: a tensor with shards holds tables of its own."""
    m = parse_manifest(_many_empty(saved, 10))
    shards, chunks = empty_tables(2)
    empties = [t for k, t in m.tensors.items() if k.startswith(("e/", "z/"))]
    assert len(empties) == 13 and all(t.shards is shards and t.chunks is chunks for t in empties)
    assert shards.offset.shape == (0, 2) and shards.offset.dtype == np.int64 and shards.index_crc32c.dtype == np.uint32
    for a in (shards.offset, shards.writer, shards.nbytes, shards.index_crc32c, chunks.offset, chunks.nbytes, chunks.crc32c):
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[...] = 0
    assert m.tensors["b/0"].shards is not shards and len(m.tensors["b/0"].shards) == 4


def test_fast_path_views_are_read_only_and_equal_the_exact_tables(saved):
    """The writer and crc columns of the fast path are views of manifest-wide columns: read-only,
    and equal column for column to what the exact per-tensor checks build. The control: a copy
    of a view can be written, so the flag is what refuses the write."""
    m = parse_manifest(saved)
    doc = json.loads(saved)
    same_tables(m.tensors, mf._tensors_exact(doc["tensors"], arrays_prefix(doc["save_id"]), doc["writers"]))
    b1 = m.tensors["b/1"]
    for a in (b1.shards.writer, b1.shards.index_crc32c, b1.chunks.crc32c):
        assert a.base is not None and not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
    c = b1.chunks.crc32c.copy()
    c[0] = 1  # control
    assert b1.chunks.crc32c.dtype == np.uint32 and b1.shards.writer.dtype == np.int64


def test_entries_are_slotted_values(saved):
    """No per-entry __dict__; the default ``objects`` is one empty read-only map that still
    behaves as {} and pickles; geometry and chunk starts are computed once and cached."""
    m = parse_manifest(saved)
    t = m.tensors["b/0"]
    for o in (t, t.array, t.shards, t.chunks):
        assert not hasattr(o, "__dict__")
    assert t.objects == {} and not t.objects and 0 not in t.objects and t.objects.get(0) is None
    with pytest.raises(TypeError):
        t.objects[0] = "x"  # type: ignore[index]
    u = pickle.loads(pickle.dumps(t))
    assert u.objects is t.objects and u.geometry == t.geometry and np.array_equal(u.chunk_start, t.chunk_start)
    fresh = mf.TensorEntry(t.key, t.shape, t.dtype, t.sharding, t.array, t.shards, t.chunks)
    assert fresh.geometry == t.geometry and fresh.geometry is fresh.geometry
    assert np.array_equal(fresh.chunk_start, t.chunk_start) and fresh.chunk_start is fresh.chunk_start


def test_replace_entry_keeps_what_the_entry_knows(saved):
    """Changing references, packed rows or the sharding keeps the cached geometry and chunk
    starts; changing the shape recomputes them (the control: a stale cache would be wrong)."""
    t = parse_manifest(saved).tensors["b/0"]
    same = replace_entry(t, objects={0: "saves/x/t/000000"})
    assert same.geometry is t.geometry and same.chunk_start is t.chunk_start and same.objects == {0: "saves/x/t/000000"}
    other = replace_entry(t, shape=(16, 4), array=dataclasses.replace(t.array, shard_shape=(4, 4)))
    assert other.geometry is not t.geometry and other.geometry.shape == (16, 4)
    assert other.geometry.shard_shape == (4, 4)
    plain = dataclasses.replace(t, sharding={"mesh": {}})  # the dataclass's own replace: recomputed, equal
    assert plain.geometry == t.geometry and np.array_equal(plain.chunk_start, t.chunk_start)


def test_saved_empty_tensors_share_tables(tmp_path):
    """A save of empty tensors (the import of empty safetensors tensors) commits bytes whose
    manifest gives them the shared tables, equal to what the exact checks build. The control: a
    tensor with data gets its own."""
    shards = [LocalShard(f"e/{i}", (4, 0), np.float32, Box((0, 0), (4, 0)), np.zeros((4, 0), np.float32)) for i in range(3)]
    shards.append(LocalShard("x", (2,), np.float32, Box((0,), (2,)), np.ones(2, np.float32)))
    m = save(str(tmp_path / "repo"), 1, shards, options=SaveOptions(layout="arrays"))
    pair = empty_tables(2)
    assert all((m.tensors[f"e/{i}"].shards, m.tensors[f"e/{i}"].chunks) == pair for i in range(3))
    assert m.tensors["x"].shards is not empty_tables(1)[0]
    doc = json.loads(m.to_bytes())
    same_tables(m.tensors, mf._tensors_exact(doc["tensors"], arrays_prefix(doc["save_id"]), doc["writers"]))
