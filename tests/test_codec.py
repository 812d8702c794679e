"""Optional zstd compression of inner chunks (format revision 1.1; FORMAT.md 5.7, 6.3; issue 18).

Real tensorstore, real file system. Controls: raw stays the default and byte-identical in form;
each rejection below is shown next to the intact case it differs from.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ckptfmt
import ckptfmt.checksum
from ckptfmt import (Box, ChecksumMismatchError, InvalidDataError, LocalShard, Repository, SaveOptions,
                     UnsupportedVersionError)
from ckptfmt.shard import shard_sizes
from ckptfmt.shard._codec import ChunkDecoder
from ckptfmt.manifest import REFERENCES, ZSTD, parse_manifest
from ckptfmt_tools.faults._scene import flip

ZSTD_OPTS = SaveOptions(codec="zstd", chunk_target_bytes=1024)


def tensors(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    w = (rng.standard_normal((64, 33)) * 0.01).astype(np.float32)
    w[48:] = 0  # rows that compress well: encoded chunks of different lengths
    return {"w": w, "w_bf16": w.astype(ml_dtypes.bfloat16), "mask": w > 0, "count": np.array([step, 2, 3], np.int64)}


def shards(values: dict[str, np.ndarray]) -> list[LocalShard]:
    out = []
    for k, v in values.items():
        if v.ndim == 2:  # two row blocks, so shards differ and edge chunks are padded
            out += [LocalShard(k, v.shape, v.dtype, Box((0, 0), (32, 33)), v[:32]),
                    LocalShard(k, v.shape, v.dtype, Box((32, 0), (32, 33)), v[32:])]
        else:
            out.append(LocalShard(k, v.shape, v.dtype, Box.full(v.shape), v))
    return out


def test_zstd_round_trip_sub_boxes_and_incremental(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    m0 = ckptfmt.save(url, 0, shards(tensors(0)), options=ZSTD_OPTS)
    assert m0.must_understand == (ZSTD,) and m0.extensions == {ZSTD: {}}
    assert {t.array.codec for t in m0.tensors.values()} == {"zstd"}
    w = m0.tensors["w"]
    assert len(set(w.chunks.nbytes.tolist())) > 1 and int(w.chunks.nbytes.min()) < shard_sizes(w.geometry).chunk
    same = tensors(0) | {"count": np.array([1, 2, 3], np.int64)}
    m1 = ckptfmt.save(url, 1, shards(same), options=ZSTD_OPTS)  # only count changed: the rest is referenced
    assert m1.must_understand == (REFERENCES, ZSTD) and set(m1.tensors["w"].objects) == {0, 1}
    repo = Repository(url)
    for step, want in ((0, tensors(0)), (1, same)):
        assert repo.verify(step) == repo.manifest(step).nbytes
        ck = repo.open(step)
        for k, v in want.items():
            assert ck.read(k).tobytes() == v.tobytes(), k
        assert ck.read("w", Box((10, 3), (30, 20))).tobytes() == want["w"][10:40, 3:23].tobytes()
    # control: raw is the default, and a raw step after zstd ones writes everything anew
    m2 = ckptfmt.save(url, 2, shards(same))
    assert m2.must_understand == ("ckptfmt.packs",) and {t.array.codec for t in m2.tensors.values()} == {"raw"}
    with pytest.raises(ValueError, match="codec"):
        ckptfmt.save(url, 3, shards(same), options=SaveOptions(codec="lz4"))


def test_a_flipped_encoded_chunk_is_caught_before_decoding(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    m = ckptfmt.save(url, 0, shards(tensors(0)), options=ZSTD_OPTS)
    repo = Repository(url)
    t = m.tensors["w"]
    obj = Path(url) / t.object_key(0)
    flip(obj, int(t.chunks.offset[0]) + 2, 1)
    with pytest.raises(ChecksumMismatchError) as e:
        repo.verify(0)
    assert e.value.key == "w"
    with pytest.raises(ChecksumMismatchError):
        repo.open(0).read("w")
    assert repo.open(0).read("w_bf16").tobytes() == tensors(0)["w_bf16"].tobytes()  # control


def test_a_frame_that_does_not_decode_to_one_chunk_is_invalid_data() -> None:
    dec = ChunkDecoder("float32", np.dtype(np.float32), (4, 4))
    import tensorstore as ts

    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True, "metadata": {
        "shape": [4, 4], "data_type": "float32", "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                   {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]}}).result()
    want = np.arange(16, dtype=np.float32).reshape(4, 4)
    arr.write(want).result()
    frame = arr.kvstore.read("c/0/0").result().value
    assert dec.decode(frame, key="k", obj="o").tobytes() == want.tobytes()  # control
    with pytest.raises(InvalidDataError):
        dec.decode(b"\x00" * len(frame), key="k", obj="o")
    with pytest.raises(InvalidDataError):  # a valid frame of another size
        small = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True, "metadata": {
            "shape": [2], "data_type": "float32", "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
            "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]}}).result()
        small.write(np.ones(2, np.float32)).result()
        dec.decode(small.kvstore.read("c/0").result().value, key="k", obj="o")


def test_zstd_codec_must_be_declared(tmp_path: Path) -> None:
    url = str(tmp_path / "r")
    ckptfmt.save(url, 0, shards(tensors(0)), options=ZSTD_OPTS)
    raw = (Path(url) / "manifests" / f"{0:020d}.json").read_bytes()
    parse_manifest(raw)  # control
    doc = json.loads(raw)
    doc["must_understand"], doc["extensions"] = [], {}
    with pytest.raises(UnsupportedVersionError, match="ckptfmt.zstd"):
        parse_manifest(json.dumps(doc).encode())
    doc = json.loads(raw)
    doc["extensions"][ZSTD] = {"level": 3}
    with pytest.raises(ckptfmt.InvalidManifestError):
        parse_manifest(json.dumps(doc).encode())


# Bytes after the one zstd frame of a chunk (issue 24, spec text): tensorstore's zarr3 driver
# refuses each of them, and so does ckptfmt (FORMAT.md 6.3: exactly one frame, nothing else).
SKIPPABLE_FRAME = struct.pack("<II", 0x184D2A50, 3) + b"abc"
EMPTY_FRAME = bytes.fromhex("28b52ffd2000010000")  # a complete frame whose content is 0 bytes
TRAILERS = {"skippable-frame": SKIPPABLE_FRAME, "garbage-byte": b"\x00", "empty-frame": EMPTY_FRAME}


def _one_chunk_step(tmp_path: Path) -> tuple[str, bytes]:
    """A zstd step whose tensor ``w`` is one shard of one chunk; returns the URL and that chunk's frame."""
    url = str(tmp_path / "r")
    w = np.arange(64, dtype=np.float32)
    m = ckptfmt.save(url, 0, [LocalShard("w", w.shape, w.dtype, Box.full(w.shape), w),
                              LocalShard("v", w.shape, w.dtype, Box.full(w.shape), w + 1)], options=SaveOptions(codec="zstd"))
    t = m.tensors["w"]
    obj = (Path(url) / t.object_key(0)).read_bytes()
    return url, obj[int(t.chunks.offset[0]):int(t.chunks.offset[0]) + int(t.chunks.nbytes[0]) - 4]


def _store_chunk(url: str, encoded: bytes) -> str:
    """Rewrite ``w``'s one shard to hold ``encoded`` as its chunk, with every checksum and size in
    the object and the manifest made to match: only the chunk's content is wrong. Returns the object key."""
    path = Path(url) / "manifests" / f"{0:020d}.json"
    doc = json.loads(path.read_bytes())
    e = doc["tensors"]["w"]
    crc = ckptfmt.checksum.crc32c(encoded)
    chunk = encoded + struct.pack("<I", crc)
    entry = struct.pack("<QQ", 0, len(chunk))
    key = e["array"]["path"] + "/" + e["shards"]["key"][0]
    (Path(url) / key).write_bytes(chunk + entry + struct.pack("<I", ckptfmt.checksum.crc32c(entry)))
    e["chunks"] = {"crc32c": [crc], "nbytes": [len(chunk)], "offset": [0]}
    e["shards"]["nbytes"], e["shards"]["index_crc32c"] = [len(chunk) + 20], [ckptfmt.checksum.crc32c(entry)]
    path.write_text(json.dumps(doc))
    return key


def _tensorstore_reads(url: str) -> bool:
    import tensorstore as ts

    path = Path(url) / json.loads((Path(url) / "manifests" / f"{0:020d}.json").read_bytes())["tensors"]["w"]["array"]["path"]
    try:
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}}).result().read().result()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(TRAILERS))
def test_bytes_after_the_frame_are_invalid_data(tmp_path: Path, name: str) -> None:
    url, frame = _one_chunk_step(tmp_path)
    obj = _store_chunk(url, frame)  # control: the clean frame, re-stored the same way, reads
    repo = Repository(url)
    assert repo.open(0).read("w").tobytes() == np.arange(64, dtype=np.float32).tobytes()
    assert repo.verify(0) and _tensorstore_reads(url)
    _store_chunk(url, frame + TRAILERS[name])
    for read in (lambda: Repository(url).open(0).read("w"), lambda: Repository(url).verify(0),
                 lambda: Repository(url, options={"positional_reads": False}).open(0).read("w")):
        with pytest.raises(InvalidDataError) as e:
            read()
        assert e.value.key == "w" and e.value.object == obj and "one zstd frame" in str(e.value.expected)
    assert not _tensorstore_reads(url)  # tensorstore's zarr3 driver agrees
    assert Repository(url).open(0).read("v").tobytes() == (np.arange(64, dtype=np.float32) + 1).tobytes()


def test_the_decoder_refuses_each_trailer() -> None:
    dec = ChunkDecoder("float32", np.dtype(np.float32), (4,))
    import tensorstore as ts

    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "create": True, "metadata": {
        "shape": [4], "data_type": "float32", "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                   {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]}}).result()
    arr.write(np.arange(4, dtype=np.float32)).result()
    frame = arr.kvstore.read("c/0").result().value
    assert dec.decode(frame, key="k", obj="o").tolist() == [0, 1, 2, 3]  # control
    for tail in TRAILERS.values():
        with pytest.raises(InvalidDataError):
            dec.decode(frame + tail, key="k", obj="o")
