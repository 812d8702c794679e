"""An export reads no more than it writes plus a bounded overhead (issue 51, item 6): a stacked
(scanned) MaxText checkpoint, whose stored chunks span every layer, exported through the
hf_llama_from_maxtext preset reads each stored chunk once, not once per layer."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridges import torch as bt  # noqa: E402
from bridges.interop import export, mapped_tensors, strip_target_prefix  # noqa: E402
from bridges.presets import hf_llama_from_maxtext  # noqa: E402
from ckptfmt import Box, Repository  # noqa: E402
from test_hf_presets import _maxtext_params  # noqa: E402
from _torchtree import nest_tensors  # noqa: E402


def test_stacked_export_reads_each_chunk_once(tmp_path):
    """Bytes read (the reader's own counter, every writer summed in the report) <= bytes written
    + 0.1% + 64 KiB (chunk trailers and shard indexes). Broken control: reading each output
    tensor's boxes on its own, as the export did before, reads over 3x what it writes; the
    exported bytes equal those reads."""
    L = 6
    cfg = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=L, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)
    url = str(tmp_path / "maxtext")
    bt.save(url, nest_tensors(_maxtext_params(cfg, np.random.default_rng(0))), step=1)
    ckpt = Repository(url).open(1)
    q = ckpt.tensor("params/params/decoder/layers/self_attention/query/kernel")
    assert q.array.chunk_shape[1] == L  # a stored chunk spans every layer: the case that re-read
    m = strip_target_prefix(hf_llama_from_maxtext(cfg, optimizer=None), "model/")
    rep = export(url, str(tmp_path / "hf"), mapping=m)
    overhead = rep.bytes_read - rep.nbytes
    print(f"stacked export, {L} layers: wrote {rep.nbytes:,} B, read {rep.bytes_read:,} B "
          f"({rep.bytes_read / rep.nbytes:.4f}x, overhead {overhead:,} B)")
    assert rep.nbytes <= rep.bytes_read <= rep.nbytes * 1.001 + (64 << 10), (rep.nbytes, rep.bytes_read)

    fresh = Repository(url).open(1)
    outs, _, _ = mapped_tensors(fresh, m)
    got = {}
    for f in rep.files:
        got.update(safetensors_numpy.load_file(str(tmp_path / "hf" / f)))
    for t in outs:
        box = Box((0,) * len(t.shape), t.shape)
        arr = t.source.assemble(box, fresh.read_boxes(t.source.reads(box)))
        assert np.array_equal(got[t.name], arr), t.name
    alone = int(fresh.stats.bytes_read)
    print(f"control: each tensor read on its own: {alone:,} B ({alone / rep.nbytes:.3f}x)")
    assert alone > 3 * rep.nbytes


def test_a_flipped_byte_in_a_shared_chunk_fails_the_export(tmp_path):
    """The shared chunks are checked (read_chunks, then read_boxes again): a flipped byte in the
    stacked query kernel's stored data raises ChecksumMismatchError naming it, and no index or
    file of the export is left. Control: the same export of an intact copy succeeds."""
    import shutil

    from ckptfmt.errors import ChecksumMismatchError

    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    url = str(tmp_path / "maxtext")
    bt.save(url, nest_tensors(_maxtext_params(cfg, np.random.default_rng(1))), step=1)
    shutil.copytree(url, tmp_path / "intact")
    m = strip_target_prefix(hf_llama_from_maxtext(cfg, optimizer=None), "model/")
    key = "params/params/decoder/layers/self_attention/query/kernel"
    t = Repository(url).open(1).tensor(key)
    obj = Path(url) / t.object_key(0)
    raw = bytearray(obj.read_bytes())
    raw[t.shard_start(0) + 100] ^= 0x01  # inside the kernel's own range of its pack
    obj.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError) as e:
        export(url, str(tmp_path / "bad"), mapping=m)
    assert e.value.key == key, e.value
    assert not [p for p in (tmp_path / "bad").iterdir() if p.is_file()], list((tmp_path / "bad").iterdir())
    rep = export(str(tmp_path / "intact"), str(tmp_path / "good"), mapping=m)
    assert rep.bytes_read <= rep.nbytes * 1.001 + (64 << 10)
