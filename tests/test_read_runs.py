"""Small whole shards lying back to back in a pack are read in runs (one positional read for
many shards, FORMAT.md 5.15), and every shard of a run is still checked against the manifest
before any output is handed out: a flipped byte in a chunk or in an index is refused, naming
its tensor and object; the untouched pack reads back bit for bit in fewer reads than shards."""
from __future__ import annotations

import numpy as np
import pytest

from ckptfmt import Box, ChecksumMismatchError, CheckpointError, LocalShard, Repository, save
from ckptfmt.shard import shard_bytes

N = 600


def _save(root):
    rng = np.random.default_rng(7)
    arrays = {f"t/{i:03d}": rng.standard_normal((4, 6)).astype(np.float32) for i in range(N)}
    shards = [LocalShard(k, a.shape, a.dtype, Box((0, 0), a.shape), a) for k, a in arrays.items()]
    save(str(root), 1, shards)
    return arrays


def _read_all(root, arrays):
    ck = Repository(str(root)).open(1)
    out = ck.read_boxes([(k, Box((0, 0), a.shape)) for k, a in arrays.items()])
    return ck, out


def _flip(root, key, where):
    ck = Repository(str(root)).open(1)
    t = ck.tensor(key)
    sb = shard_bytes(t, 0)
    at = sb.chunk_bounds(0)[0] + 5 if where == "chunk" else sb.index[0] + 3
    path = root / t.object_key(0)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    return t.object_key(0)


def test_runs_read_back_bit_for_bit_in_fewer_reads(tmp_path):
    arrays = _save(tmp_path)
    ck, out = _read_all(tmp_path, arrays)
    for (k, a), o in zip(arrays.items(), out):
        assert o.tobytes() == a.tobytes(), k
    assert ck.stats.requests < N  # runs: not one read per shard (control below: the flips are found)


@pytest.mark.parametrize("where", ["chunk", "index"])
def test_a_flipped_byte_inside_a_run_is_refused(tmp_path, where):
    arrays = _save(tmp_path)
    key = f"t/{N // 2:03d}"  # in the middle of a run
    obj = _flip(tmp_path, key, where)
    with pytest.raises(CheckpointError) as e:
        _read_all(tmp_path, arrays)
    assert e.value.key == key and obj in str(e.value.object)
    if where == "chunk":
        assert isinstance(e.value, ChecksumMismatchError)
    # control: the other tensors still read, bit for bit
    ck = Repository(str(tmp_path)).open(1)
    others = [(k, a) for k, a in arrays.items() if k != key]
    got = ck.read_boxes([(k, Box((0, 0), a.shape)) for k, a in others])
    assert all(g.tobytes() == a.tobytes() for g, (_, a) in zip(got, others))
