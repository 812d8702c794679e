"""ckptfmt.shard, the one owner of the shard object (FORMAT.md 6.2-6.4): its record's named wire
form, the encoder's verify-after-write, and the checks readers run. Each rejection has its
accepted control beside it; the encoder's bytes are pinned to tensorstore's in test_vectorwrite."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ckptfmt import Box, ChecksumMismatchError, IncompleteSaveError, LocalShard, Repository, save, shard
from ckptfmt.checksum import crc32c
from ckptfmt.plan import TensorGeometry


def test_records_travel_as_named_columns():
    written = shard.ShardRecord(0, (1, 0), 52, 7, (0, 20), (3, 4))
    ref = shard.ShardRecord(2, (0,), 36, 9, (0,), (5,), (32,), ("000000000001-20261130T000000-00000000", "saves/x/t/2"))
    wire = shard.records_to_wire([written, ref])
    assert sorted(wire) == sorted(["tensor", "cell", "nbytes", "index_crc32c", "chunk_offsets", "chunk_crc32c",
                                   "chunk_nbytes", "ref", "where"]) and wire["ref"][0] is None
    assert shard.records_from_wire(wire) == [written, ref]
    assert shard.records_from_wire(shard.records_to_wire([])) == []
    # a record and the same object found in a later manifest (tensor index and cell aside)
    assert written.located("sid", "saves/sid/t/0", 20).same_object(
        shard.ShardRecord(5, (9, 9), 52, 7, (0, 20), (3, 4), (20, 20), ("sid", "saves/sid/t/0"),
                          ("saves/sid/t/0/c/1/0", 0, 52)))
    packed = shard.ShardRecord(0, (1, 0), 52, 7, (0, 20), (3, 4), (20, 20), None, ("saves/sid/p/00000-000000", 104, 300))
    assert shard.records_from_wire(shard.records_to_wire([packed])) == [packed]  # FORMAT.md 5.15: where it lies
    assert not packed.same_object(dataclasses.replace(packed, where=("saves/sid/p/00000-000000", 0, 300)))
    assert not written.located("sid", "saves/sid/t/0", 20).same_object(written.located("other", "saves/o/t/0", 20))


def _encoded() -> tuple[shard.EncodedShard, bytes]:
    g = TensorGeometry((5, 3), (4, 3), (2, 3), 4)  # the shard at (4, 0) holds one row: an edge chunk
    block = np.arange(3, dtype=np.float32).reshape(1, 3)
    enc = shard.encode(0, (1, 0), block, g, (4, 0))
    return enc, b"".join(bytes(memoryview(b).cast("B")) for b in enc.buffers())


def test_verify_after_write_is_the_length():
    enc, data = _encoded()
    assert len(data) == enc.nbytes == 28 + 2 * 16 + 4  # one stored chunk; 2 inner chunks in the index
    rec = enc.verified(len(data), key="w", obj="o")  # control: the length the store reports
    assert rec.chunk_offsets == (0,) and rec.chunk_crc32c == (crc32c(data[:24]),)
    assert rec.index_crc32c == crc32c(data[28:-4]) == int.from_bytes(data[-4:], "little")
    with pytest.raises(IncompleteSaveError, match="unexpected size"):
        enc.verified(len(data) - 1, key="w", obj="o")


def test_verify_encoded_rejects_a_bad_trailer():
    enc, data = _encoded()
    g = enc.geometry
    want = [crc32c(data[:24])]
    ok = shard.verify_encoded(0, (1, 0), "w", "o", g, (4, 0), data, want, 64, lambda d: np.frombuffer(d, np.uint8))
    assert ok.chunk_nbytes == (28,) and ok.nbytes == len(data)  # control
    bad = bytearray(data)
    bad[24] ^= 1  # the stored chunk's trailer
    with pytest.raises(IncompleteSaveError, match="fails its checksum"):
        shard.verify_encoded(0, (1, 0), "w", "o", g, (4, 0), bytes(bad), want, 64, lambda d: np.frombuffer(d, np.uint8))


def test_index_entries_must_equal_the_chunk_table(tmp_path):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    save(str(tmp_path / "r"), 1, [LocalShard("x", x.shape, x.dtype, Box.full(x.shape), x)])
    t = Repository(str(tmp_path / "r")).manifest(1).tensors["x"]
    obj = (tmp_path / "r" / t.object_key(0)).read_bytes()[slice(*shard.shard_bytes(t, 0).whole)]  # its range of the pack
    c0, c1 = int(t.chunk_start[0]), int(t.chunk_start[1])
    assert len(shard.check_whole(t, 0, "o", obj, range(c0, c1))) == c1 - c0  # control
    index = bytearray(obj[-shard.shard_sizes(t.geometry).index:])
    index[0] ^= 1  # an entry's offset, with the index crc32c made to match
    index[-4:] = crc32c(bytes(index[:-4])).to_bytes(4, "little")
    with pytest.raises(ChecksumMismatchError, match="index entry differs"):
        shard.check_entries(t, 0, "o", memoryview(bytes(index)))
