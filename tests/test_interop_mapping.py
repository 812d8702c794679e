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
from bridges.mapping._mapfile import (MAX_AXES, MAX_GLOBS, MAX_PATTERN_CHARS, MAX_PLACEHOLDERS, MAX_RULES,  # noqa: E402
                              MAX_SOURCES, MAX_STACKED, MAX_TRANSFORMS, load_mapping_file)
from bridges.interop import (InvalidMappingError, export, mapped_tensors, mapping_from_json, mapping_to_json,  # noqa: E402
                             preset_mapping, strip_target_prefix)
from bridges.mapping import MappingError  # noqa: E402
from ckptfmt.errors import CheckpointError, KeyMismatchError  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from bridges.presets import hf_gpt2_from_nnx, hf_llama_from_maxtext, hf_llama_from_nnx  # noqa: E402
from ckptfmt import Repository  # noqa: E402
from ckptfmt_tools.cli import app  # noqa: E402
from test_hf_presets import _maxtext_params, _nnx_llama_params  # noqa: E402
from _torchtree import nest_tensors as _nest  # noqa: E402
from torchproc.hf_configs import GPT2, LLAMA  # noqa: E402
from torchproc.hf_side import hf_model, logits  # noqa: E402

runner = CliRunner()


def test_every_preset_round_trips_through_json():
    for m in (hf_llama_from_nnx(LLAMA), hf_llama_from_nnx(LLAMA, rope="interleaved", optimizer=None),
              hf_llama_from_maxtext(dict(LLAMA, head_dim=16, num_attention_heads=4, num_key_value_heads=2)),
              hf_gpt2_from_nnx(GPT2), preset_mapping("hf_gpt2_from_nnx", GPT2),
              preset_mapping("hf_gemma2_from_maxtext", LLAMA),  # Shift, Concat + Reorder of layer pairs
              preset_mapping("hf_mixtral_from_maxtext", dict(LLAMA, num_local_experts=4), experts="per_expert")):
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
    assert unmapped == [] and notes == []  # the export preset ignores the training state (optimizer/*)
    _, unmapped, _ = mapped_tensors(ckpt, strip_target_prefix(hf_llama_from_nnx(LLAMA, optimizer=None), "model/"))
    assert unmapped == ["optimizer/moment"]  # ... which a mapping without that glob reports
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


# ------------------------------------------------------------------ issue 24: complete or refused; caps


#: The llama_step parameters under other names: attention under layers/self_attn, the final norm
#: under final_norm (what a model whose names differ from the preset's looks like).
_RENAMES = {"layers/attn/q/kernel": "layers/self_attn/q/kernel", "layers/attn/k/kernel": "layers/self_attn/k/kernel",
            "layers/attn/v/kernel": "layers/self_attn/v/kernel", "layers/attn/o/kernel": "layers/self_attn/o/kernel",
            "norm/scale": "final_norm/scale"}
_FIT = {"q_kernel": "layers/self_attn/q/kernel", "k_kernel": "layers/self_attn/k/kernel",
        "v_kernel": "layers/self_attn/v/kernel", "o_kernel": "layers/self_attn/o/kernel", "norm": "final_norm/scale"}


def test_an_export_that_leaves_target_tensors_unwritten_is_refused(llama_step, tmp_path):
    """Item 6. The preset by name on a model whose attention and final norm have other names: the
    API raises KeyMismatchError naming the unwritten targets and the unmatched checkpoint keys and
    saying how to fit them; the CLI exits 1 with that error; OUT holds nothing. --allow-partial
    writes what fits and lists what it left out. Broken control: the same step exported with the
    names fitted (preset_mapping(..., names=...)) loads with from_pretrained and gives exactly the
    logits of the step with the preset's own names."""
    _, url, params = llama_step
    renamed = {_RENAMES.get(k, k): v for k, v in params.items()}
    rurl = str(tmp_path / "renamed")
    bt.save(rurl, {"model": _nest(renamed), "optimizer": {"moment": torch.zeros(3)}}, step=3)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA, model_type="llama")))
    with pytest.raises(KeyMismatchError) as e:
        export(rurl, str(tmp_path / "a"), mapping="hf_llama_from_nnx", config=str(cfg))
    msg = str(e.value)
    for needle in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model/layers/self_attn/q/kernel",
                   "model/final_norm/scale", "names=", "mapping file", "--allow-partial"):
        assert needle in msg, needle
    assert not (tmp_path / "a").exists()
    r = runner.invoke(app, ["export", rurl, str(tmp_path / "b"), "--mapping", "hf_llama_from_nnx", "--config", str(cfg),
                            "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "KeyMismatchError", r.output
    assert not (tmp_path / "b").exists()
    r = runner.invoke(app, ["export", rurl, str(tmp_path / "c"), "--mapping", "hf_llama_from_nnx", "--config", str(cfg),
                            "--allow-partial", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)["report"]
    L = LLAMA["num_hidden_layers"]
    assert rep["tensors"] == 21 - 4 * L - 1 and len(rep["unwritten"]) == 4 * L + 1 and "model.norm.weight" in rep["unwritten"]
    assert sorted(rep["unmapped"]) == sorted(f"model/{v}" for v in _RENAMES.values())
    good = export(url, str(tmp_path / "ref"), mapping="hf_llama_from_nnx", config=str(cfg))
    fitted = export(rurl, str(tmp_path / "fitted"), mapping=preset_mapping("hf_llama_from_nnx", LLAMA, names=_FIT),
                    config=str(cfg), max_shard_size="64KB", processes=2)  # a second writer process
    assert fitted.tensors == good.tensors == 21 and fitted.unmapped == fitted.unwritten == ()
    assert len(fitted.files) >= 2 and not [p for p in (tmp_path / "fitted").iterdir() if p.name.startswith(".")]
    ref = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "ref")).eval()
    got = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "fitted")).eval()
    assert np.array_equal(logits(got), logits(ref))


def test_a_checkpoint_key_no_rule_reads_is_refused_unless_ignored(llama_step, tmp_path):
    """Every target written but a checkpoint key under the model no rule reads (a bias the config
    does not know of): KeyMismatchError naming it. Controls: ignore=[glob] (--ignore) leaves it out
    on purpose and the export succeeds; the preset's own training-state glob already leaves
    optimizer/* out."""
    _, _, params = llama_step
    L, d = LLAMA["num_hidden_layers"], LLAMA["hidden_size"]
    xurl = str(tmp_path / "extra")
    bt.save(xurl, {"model": _nest(dict(params, **{"layers/attn/o/bias": np.ones((L, d), np.float32)})),
                   "optimizer": {"moment": torch.zeros(3)}}, step=1)
    with pytest.raises(KeyMismatchError, match="model/layers/attn/o/bias"):
        export(xurl, str(tmp_path / "a"), mapping=preset_mapping("hf_llama_from_nnx", LLAMA))
    assert not (tmp_path / "a").exists()
    rep = export(xurl, str(tmp_path / "b"), mapping=preset_mapping("hf_llama_from_nnx", LLAMA),
                 ignore=["model/layers/attn/o/bias"])
    assert rep.tensors == 21 and rep.unmapped == ()
    (tmp_path / "cfg.json").write_text(json.dumps(LLAMA))
    r = runner.invoke(app, ["export", xurl, str(tmp_path / "c"), "--mapping", "hf_llama_from_nnx", "--config",
                            str(tmp_path / "cfg.json"), "--ignore", "model/*/o/bias"])
    assert r.exit_code == 0, r.output


#: Item 10: 130 bytes that declared a billion layers (22 GB and an OOM kill before the fix).
_HOSTILE = {"rules": [{"source": "model/layers/mlp_norm/scale", "target": "l.{i}.w",
                       "transforms": [{"op": "Select", "axis": 0, "index": "i", "size": 1000000000}]}]}


def _with(doc: dict, **select) -> dict:
    out = json.loads(json.dumps(doc))
    out["rules"][0]["transforms"][0].update(select)
    return out


def test_a_tiny_mapping_file_declaring_a_huge_select_is_refused_by_its_caps(llama_step, tmp_path):
    """The hostile file (size 1e9 as an integer and as a float): InvalidMappingError naming the rule,
    the field and the value, before anything is enumerated (CLI: exit 1, typed). Within the cap but
    contradicted by the checkpoint (size 10^6, the tensor has 2 layers): MappingError naming the
    rule, before anything is enumerated; a rule of 10^6 targets that matches nothing: the
    incomplete-export error with the count, not 10^6 names. Control: the same rule with the real
    size exports its 2 tensors."""
    _, url, params = llama_step
    L = LLAMA["num_hidden_layers"]
    for size in (1000000000, 1e9):
        p = tmp_path / f"hostile-{size!r}.json"
        p.write_text(json.dumps(_with(_HOSTILE, size=size)))
        assert p.stat().st_size < 160
        with pytest.raises(InvalidMappingError) as e:
            load_mapping_file(p)
        assert e.value.object == "rule 0 transform 0" and "Select.size" in e.value.message
        assert str(size) in str(e.value.found) and str(MAX_STACKED) in e.value.expected
        r = runner.invoke(app, ["export", url, str(tmp_path / "out"), "--mapping", str(p), "--json"])
        assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "InvalidMappingError", r.output
    with pytest.raises(MappingError, match="declares a stacked length of 1000000"):
        export(url, str(tmp_path / "o1"), mapping=mapping_from_json(_with(_HOSTILE, size=10**6)), allow_partial=True)
    idle = json.loads(json.dumps(_with(_HOSTILE, size=10**6)))
    idle["rules"][0]["source"] = "nothing/here"
    with pytest.raises(KeyMismatchError, match="1000000 target"):
        export(url, str(tmp_path / "o2"), mapping=mapping_from_json(idle))
    ok = _with(_HOSTILE, size=L)
    ok["ignore"] = ["*"]  # the rest of the step is left out on purpose
    rep = export(url, str(tmp_path / "o3"), mapping=mapping_from_json(ok))
    assert rep.tensors == L
    got = load_file(str(tmp_path / "o3" / rep.files[0]))
    assert all(np.array_equal(got[f"l.{i}.w"], params["layers/mlp_norm/scale"][i]) for i in range(L))


def _rule(**kw) -> dict:
    return {"rules": [dict({"source": "a", "target": "b"}, **kw)]}


@pytest.mark.parametrize("doc, what", [
    ({"rules": [{"source": "a", "target": "b"}] * (MAX_RULES + 1)}, "too many rules"),
    (_rule(source=["a{x}"] * (MAX_SOURCES + 1), transforms=[{"op": "Concat", "axis": 0}]), "too many sources"),
    (_rule(transforms=[{"op": "Transpose", "axes": [0]}] * (MAX_TRANSFORMS + 1)), "too many transforms"),
    (_rule(target="b" * (MAX_PATTERN_CHARS + 1)), "too long"),
    (_rule(source="".join(f"{{p{i}}}/" for i in range(MAX_PLACEHOLDERS + 1))), "too many placeholders"),
    (_rule(transforms=[{"op": "Merge", "axis": 0, "sizes": 10**9}]), "Merge.sizes"),
    (_rule(transforms=[{"op": "Select", "axis": 10**9, "index": 0}]), "Select.axis"),
    (_rule(transforms=[{"op": "Part", "axis": 0, "index": 0, "parts": 10**9}]), "Part.parts"),
    (_rule(transforms=[{"op": "Transpose", "axes": list(range(MAX_AXES + 1))}]), "Transpose.axes"),
    (_rule(target="l.{i}", transforms=[{"op": "Select", "axis": 0, "index": "i", "size": True}]), "Select.size"),
    ({"rules": [], "ignore": ["*"] * (MAX_GLOBS + 1)}, "too many ignore globs"),
    (_rule(transforms=[{"op": "Merge", "axis": 0, "sizes": [[[[[[2]]]]]]}]), "too deeply"),
])
def test_mapping_caps_are_typed_errors_naming_the_rule_and_the_value(doc, what):
    """Each structural cap of bridges/MAPPING.md, one over: InvalidMappingError (a CheckpointError
    and a ValueError) saying which cap. Control: the same shape at the cap loads."""
    with pytest.raises(InvalidMappingError, match=what) as e:
        mapping_from_json(doc)
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, ValueError)
    assert mapping_from_json({"rules": [{"source": "a", "target": "b"}] * 8, "ignore": ["*"] * MAX_GLOBS})
    assert mapping_from_json(_rule(target="l.{i}", transforms=[{"op": "Select", "axis": 0, "index": "i",
                                                                 "size": MAX_STACKED}]))
    assert mapping_from_json(_rule(source="".join(f"{{p{i}}}/" for i in range(MAX_PLACEHOLDERS)),
                                   target="".join(f"{{p{i}}}." for i in range(MAX_PLACEHOLDERS))))


def test_a_select_after_a_concat_names_every_joined_layer(tmp_path):
    """The shape of MaxText Gemma 2's rules: local and global layers concatenated, then one
    selected. The export names l.0 (the local layer) and l.1 (the global one) from the joined
    length. Control: with the global key absent the joined length is unknown, and the export is
    refused before anything is written."""
    from ckptfmt import Box, LocalShard, save

    loc, glo = np.arange(6, dtype=np.float32).reshape(1, 2, 3), np.arange(6, 12, dtype=np.float32).reshape(1, 2, 3)
    doc = _rule(source=["a/local", "a/global"], target="l.{i}.w",
                transforms=[{"op": "Concat", "axis": 0, "sizes": [1, 1]}, {"op": "Select", "axis": 0, "index": "i", "size": 2}])
    for name, arrays in (("both", {"a/local": loc, "a/global": glo}), ("control", {"a/local": loc})):
        url = str(tmp_path / name)
        save(url, 1, [LocalShard(k, a.shape, a.dtype, Box.full(a.shape), a) for k, a in arrays.items()])
        if name == "both":
            rep = export(url, str(tmp_path / f"{name}-out"), mapping=mapping_from_json(doc))
            got = load_file(str(tmp_path / f"{name}-out" / rep.files[0]))
            assert sorted(got) == ["l.0.w", "l.1.w"]
            assert np.array_equal(got["l.0.w"], loc[0]) and np.array_equal(got["l.1.w"], glo[0])
        else:
            with pytest.raises(MappingError, match="no Select before its join"):
                export(url, str(tmp_path / f"{name}-out"), mapping=mapping_from_json(doc))
            assert not list((tmp_path / f"{name}-out").glob("*.safetensors"))


def test_export_passes_preset_arguments(tmp_path):
    """``ckptfmt export --mapping hf_mixtral_from_nnx --preset-arg experts=per_expert``: the
    files carry the hub's one-tensor-per-expert names, from_pretrained loads them, and the logits
    equal the numpy MoE forward within 1e-4; without the argument the fused names are written.
    Broken controls (exit 2, nothing written): an argument the preset lacks (named, with the
    ones it takes), a value the preset rejects, ``--preset-arg`` with no preset, no ``=``."""
    from _families import CONFIGS, SIZES, family_params
    from _families_ref import moe_forward

    params = family_params("mixtral", seed=14)
    url = str(tmp_path / "repo")
    bt.save(url, {"model": _nest(params)}, step=1)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(CONFIGS["mixtral"], model_type="mixtral", architectures=["MixtralForCausalLM"])))
    opts = ["--mapping", "hf_mixtral_from_nnx", "--config", str(cfg), "--json"]
    r = runner.invoke(app, ["export", url, str(tmp_path / "per")] + opts + ["--preset-arg", "experts=per_expert"])
    assert r.exit_code == 0, r.output
    keys = lambda d: {k for f in sorted(d.glob("*.safetensors")) for k in load_file(str(f))}  # noqa: E731
    names = keys(tmp_path / "per")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names and not any("gate_up" in n for n in names)
    ids = np.random.default_rng(99).integers(0, SIZES["vocab_size"], (2, 16)).astype(np.int32)
    model = tf.MixtralForCausalLM.from_pretrained(str(tmp_path / "per")).eval()
    err = float(np.abs(logits(model, ids) - moe_forward(ids, params, eps=SIZES["rms_norm_eps"], theta=10000.0, top_k=2,
                                                          renormalize=True)).max())
    print(f"export --preset-arg experts=per_expert -> from_pretrained: max |logits - numpy forward| = {err:.2e}")
    assert err < 1e-4
    r = runner.invoke(app, ["export", url, str(tmp_path / "fused")] + opts)  # control: the default
    assert r.exit_code == 0 and any("gate_up_proj" in n for n in keys(tmp_path / "fused"))
    for extra, words in ((["--preset-arg", "expert=per_expert"], ("expert", "experts", "rope")),
                         (["--preset-arg", "experts=some"], ("experts", "per_expert")),
                         (["--preset-arg", "experts"], ("KEY=VALUE",))):
        r = runner.invoke(app, ["export", url, str(tmp_path / "bad")] + opts + extra)
        assert r.exit_code == 2 and all(w in r.output for w in words), r.output
        assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())
    r = runner.invoke(app, ["export", url, str(tmp_path / "bad"), "--preset-arg", "experts=per_expert", "--json"])
    assert r.exit_code == 2 and "not a preset" in r.output
