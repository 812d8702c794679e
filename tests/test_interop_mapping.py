"""Exports through a mapping, without JAX: the JSON mapping format (round trips of every preset,
malformed documents refused), which output tensors a preset names from a checkpoint (exactly the
Hugging Face model's state dict), ``ckptfmt export --mapping FILE`` equal to the preset by name,
and a mapping that does not fit refused before anything is written (broken controls)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from typer.testing import CliRunner  # noqa: E402

from bridges import torch as bt  # noqa: E402
from bridges.interop import (export, mapped_tensors, mapping_from_json, mapping_to_json, preset_mapping,  # noqa: E402
                             strip_target_prefix)
from bridges.mapping import MappingError  # noqa: E402
from bridges.presets import hf_gpt2_from_nnx, hf_llama_from_maxtext, hf_llama_from_nnx  # noqa: E402
from ckptfmt import Repository  # noqa: E402
from ckptfmt_tools.cli import app  # noqa: E402
from test_hf_presets import _maxtext_params, _nest, _nnx_llama_params  # noqa: E402
from torchproc.hf_configs import GPT2, LLAMA  # noqa: E402
from torchproc.hf_side import hf_model, logits  # noqa: E402

runner = CliRunner()


def test_every_preset_round_trips_through_json():
    for m in (hf_llama_from_nnx(LLAMA), hf_llama_from_nnx(LLAMA, rope="interleaved", optimizer=None),
              hf_llama_from_maxtext(dict(LLAMA, head_dim=16, num_attention_heads=4, num_key_value_heads=2)),
              hf_gpt2_from_nnx(GPT2), preset_mapping("hf_gpt2_from_nnx", GPT2)):
        for mm in (m, m.inverse()):
            doc = json.loads(json.dumps(mapping_to_json(mm)))
            assert mapping_from_json(doc) == mm


@pytest.mark.parametrize("edit, match", [
    (lambda d: {**d, "rulez": []}, "unknown member"),
    (lambda d: {**d, "rules": [{**d["rules"][0], "transforms": [{"op": "Squash", "axis": 0}]}]}, "unknown op"),
    (lambda d: {**d, "rules": [{**d["rules"][0], "transforms": [{"op": "Select", "axis": 0, "idx": 1}]}]}, "no field"),
    (lambda d: {**d, "rules": [{**d["rules"][0], "transforms": [{"op": "Transpose", "axes": [0, 0]}]}]}, "not valid"),
    (lambda d: {**d, "rules": [{"source": 3, "target": "x"}]}, "source"),
    (lambda d: {**d, "mapping": 99}, "version"),
])
def test_malformed_mapping_documents_are_refused(edit, match):
    good = mapping_to_json(preset_mapping("hf_llama_from_nnx", LLAMA))
    assert mapping_from_json(good) == preset_mapping("hf_llama_from_nnx", LLAMA)  # control
    with pytest.raises(ValueError, match=match):
        mapping_from_json(edit(good))


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory):
    """NNX-layout Llama parameters (numpy, random), saved as ``model/...`` with an optimizer-like extra."""
    d = tmp_path_factory.mktemp("mapexport")
    params = _nnx_llama_params(LLAMA, np.random.default_rng(1), bias=False)
    url = str(d / "repo")
    state = {"model": _nest(params), "optimizer": {"moment": torch.zeros(3)}}
    bt.save(url, state, step=3)
    return d, url, params


def test_presets_name_exactly_the_hf_state_dict(llama_step, tmp_path):
    """Llama and GPT-2 presets, forward from a checkpoint: the names and shapes of the HF model's
    state dict (GPT-2's tied head included); MaxText likewise; unread keys are reported."""
    d, url, _ = llama_step
    ckpt = Repository(url).open()
    outs, unmapped, notes = mapped_tensors(ckpt, preset_mapping("hf_llama_from_nnx", LLAMA))
    sd = hf_model("llama").state_dict()
    assert {t.name: t.shape for t in outs} == {k: tuple(v.shape) for k, v in sd.items()}
    assert unmapped == ["optimizer/moment"] and notes == []
    gpt = {k: np.asarray(v.numpy()) for k, v in hf_model("gpt2").state_dict().items()}
    L, dm = GPT2["n_layer"], GPT2["n_embd"]
    r = np.random.default_rng(2)
    nnx = {"wte/embedding": gpt["transformer.wte.weight"], "wpe/embedding": gpt["transformer.wpe.weight"],
           "ln_f/scale": r.standard_normal(dm).astype(np.float32), "ln_f/bias": r.standard_normal(dm).astype(np.float32)}
    for n, shape in (("ln_1/scale", (L, dm)), ("ln_1/bias", (L, dm)), ("ln_2/scale", (L, dm)), ("ln_2/bias", (L, dm)),
                     ("attn/q/kernel", (L, dm, dm)), ("attn/k/kernel", (L, dm, dm)), ("attn/v/kernel", (L, dm, dm)),
                     ("attn/q/bias", (L, dm)), ("attn/k/bias", (L, dm)), ("attn/v/bias", (L, dm)),
                     ("attn/proj/kernel", (L, dm, dm)), ("attn/proj/bias", (L, dm)), ("mlp/fc/kernel", (L, dm, 4 * dm)),
                     ("mlp/fc/bias", (L, 4 * dm)), ("mlp/proj/kernel", (L, 4 * dm, dm)), ("mlp/proj/bias", (L, dm))):
        nnx[f"h/{n}"] = r.standard_normal(shape).astype(np.float32)
    gurl = str(tmp_path / "gpt2")
    bt.save(gurl, {"model": _nest(nnx)}, step=1)
    outs, unmapped, _ = mapped_tensors(Repository(gurl).open(), preset_mapping("hf_gpt2_from_nnx", GPT2))
    want = {k: v.shape for k, v in gpt.items() if not k.endswith(".attn.bias") and not k.endswith("masked_bias")}
    assert {t.name: t.shape for t in outs} == want and unmapped == []
    cfg = dict(LLAMA, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    murl = str(tmp_path / "maxtext")
    bt.save(murl, _nest(_maxtext_params(cfg, np.random.default_rng(3))), step=1)
    m = strip_target_prefix(hf_llama_from_maxtext(cfg, optimizer=None), "model/")
    outs, unmapped, _ = mapped_tensors(Repository(murl).open(), m)
    assert {t.name for t in outs} == set(hf_model("llama").state_dict()) and unmapped == []


def test_export_with_a_mapping_file_equals_the_preset_and_a_misfit_is_refused(llama_step, tmp_path):
    """--mapping FILE (the preset dumped as JSON) writes the same tensors as --mapping PRESET, and
    from_pretrained gives the logits of the model loaded through bridges.torch.load. Broken
    control: heads merged as (8, 4) instead of (4, 8) for k/v: MappingError, nothing written."""
    _, url, _ = llama_step
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dict(LLAMA, model_type="llama")))
    by_name = export(url, str(tmp_path / "a"), mapping="hf_llama_from_nnx", config=str(cfg_path), max_shard_size="64KB")
    mfile = tmp_path / "llama.json"
    mfile.write_text(json.dumps(mapping_to_json(preset_mapping("hf_llama_from_nnx", LLAMA))))
    r = runner.invoke(app, ["export", url, str(tmp_path / "b"), "--mapping", str(mfile), "--max-shard-size", "64KB"])
    assert r.exit_code == 0, r.output
    for f in by_name.files:
        from safetensors.numpy import load_file
        a, b = load_file(str(tmp_path / "a" / f)), load_file(str(tmp_path / "b" / f))
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    ref = hf_model("llama", seed=9)
    ref.load_state_dict(bt.load(url, {"model": ref.state_dict()}, mapping=hf_llama_from_nnx(LLAMA, optimizer=None),
                                strict=False)["model"])
    got = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "a")).eval()
    assert np.array_equal(logits(got), logits(ref))
    doc = mapping_to_json(preset_mapping("hf_llama_from_nnx", LLAMA))
    for rule in doc["rules"]:
        for op in rule.get("transforms", []):
            if op["op"] == "Merge" and op["sizes"] == [4, 8]:
                op["sizes"] = [8, 4]
    mfile.write_text(json.dumps(doc))
    r = runner.invoke(app, ["export", url, str(tmp_path / "c"), "--mapping", str(mfile), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "MappingError", r.output
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*.safetensors"))
    r = runner.invoke(app, ["export", url, str(tmp_path / "d"), "--mapping", "hf_llama_from_nnx"])
    assert r.exit_code == 2  # a preset needs --config
    with pytest.raises(MappingError):
        export(url, str(tmp_path / "e"), mapping=mapping_from_json(doc))
