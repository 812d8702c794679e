"""bridges.presets against Hugging Face transformers: real models across the bridge.

Every model is built from a tiny config with random init; nothing is downloaded.

* In this process (no JAX): the Llama, Mistral and Qwen2 presets on random parameters in the NNX
  layout, and the MaxText preset on a tree with MaxText's names and shapes, each compared with a
  numpy forward written from the JAX layouts' own math (tests/_llama_ref.py).
* With real JAX training (one subprocess, 8 CPU devices, (4, 2) fsdp x tensor mesh): the NNX
  Llama and GPT-2 of tests/torchproc/jax_models.py train 3 steps and save; they load into
  ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` here (logits within 1e-4, broken controls fail on
  logits), at 4 gloo ranks with tensor-parallel DTensors (logits equal to the one-process load,
  bytes read per rank bounded by its share), and torch -> JAX -> torch round trips bit for bit.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from _llama_ref import llama_forward  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges.mapping import (Cast, Concat, InvalidRuleError, Mapping, MappingError, Merge, Rule, Select,  # noqa: E402
                             Transpose)
from bridges.presets import hf_llama_from_maxtext, hf_llama_from_nnx  # noqa: E402
from torchproc.hf_configs import EVAL_IDS, GPT2, LLAMA, TRAIN_STEPS  # noqa: E402
from torchproc.hf_side import hf_model, logits, preset  # noqa: E402
from torchproc.launch import REPO, child_env, run_world  # noqa: E402
from torchproc.scenarios import full_np  # noqa: E402
from _torchtree import nest_tensors  # noqa: E402

LOGIT_ATOL = 1e-4  # float32 forward, JAX or numpy vs torch
# 8 CPU devices; XLA's cheapest CPU compile (these models compile in seconds instead of tens of seconds).
JAX_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")




def _load(name_or_model, url: str, mapping, *, strict: bool = True):
    model = hf_model(name_or_model) if isinstance(name_or_model, str) else name_or_model
    out = bt.load(url, {"model": model.state_dict()}, mapping=mapping, strict=strict)
    model.load_state_dict(out["model"])
    return model, out


# ------------------------------------------------------------------ no JAX: numpy reference


def _nnx_llama_params(cfg: dict, rng: np.random.Generator, bias: bool) -> dict[str, np.ndarray]:
    d, h, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    L, f, v = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    p = {"embed/embedding": r(v, d), "layers/attn/q/kernel": r(L, d, h, hd), "layers/attn/k/kernel": r(L, d, kv, hd),
         "layers/attn/v/kernel": r(L, d, kv, hd), "layers/attn/o/kernel": r(L, h, hd, d),
         "layers/mlp/gate/kernel": r(L, d, f), "layers/mlp/up/kernel": r(L, d, f), "layers/mlp/down/kernel": r(L, f, d),
         "layers/attn_norm/scale": 1 + r(L, d), "layers/mlp_norm/scale": 1 + r(L, d), "norm/scale": 1 + r(d),
         "lm_head/kernel": r(d, v)}
    if bias:
        p.update({"layers/attn/q/bias": r(L, h, hd), "layers/attn/k/bias": r(L, kv, hd), "layers/attn/v/bias": r(L, kv, hd)})
    return p


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_llama_family_preset_matches_transformers(tmp_path, family):
    """Random NNX-layout parameters -> the preset -> transformers' own class: logits equal the
    numpy forward of the NNX layout (Qwen2: q/k/v biases; Mistral: a sliding window)."""
    cfg = dict(LLAMA, num_hidden_layers=3)
    hf_cfg = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
    extra = {"mistral": {"sliding_window": 8}, "qwen2": {}, "llama": {}}[family]
    config = hf_cfg(**cfg, **extra)
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM}[family]
    params = _nnx_llama_params(cfg, np.random.default_rng(1), bias=family == "qwen2")
    url = str(tmp_path / "repo")
    bt.save(url, {"model": nest_tensors(params)}, step=1)
    model = cls(config).eval()
    _, out = _load(model, url, hf_llama_from_nnx(config, optimizer=None))
    assert out.report.missing == () and out.report.unexpected == ()
    ids = EVAL_IDS[:, :12]  # inside Mistral's window and past it
    names = {"q": "attn/q/kernel", "k": "attn/k/kernel", "v": "attn/v/kernel", "o": "attn/o/kernel",
             "gate": "mlp/gate/kernel", "up": "mlp/up/kernel", "down": "mlp/down/kernel",
             "attn_norm": "attn_norm/scale", "mlp_norm": "mlp_norm/scale", "q_bias": "attn/q/bias",
             "k_bias": "attn/k/bias", "v_bias": "attn/v/bias"}
    layer = lambda n, i: params[f"layers/{names[n]}"][i] if f"layers/{names[n]}" in params else None  # noqa: E731
    want = llama_forward(ids, layers=cfg["num_hidden_layers"], layer=layer, embed=params["embed/embedding"],
                         norm=params["norm/scale"], head=params["lm_head/kernel"], eps=cfg["rms_norm_eps"],
                         theta=10000.0)
    if family == "mistral":  # the window masks keys more than 8 back: compare rows inside it
        want, ids = want[:, :8], ids[:, :8]
    err = float(np.abs(logits(model, ids) - want).max())
    print(f"{family}: max |transformers - numpy NNX forward| = {err:.2e}")
    assert err < LOGIT_ATOL


def _maxtext_params(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """MaxText's scanned Llama tree (param_scan_axis=1), names and shapes as MaxText lays them out."""
    d, h, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    L, f, v = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    pre = "params/params/decoder/layers"
    return {"params/params/token_embedder/embedding": r(v, d), "params/params/decoder/decoder_norm/scale": 1 + r(d),
            "params/params/decoder/logits_dense/kernel": r(d, v),
            f"{pre}/self_attention/query/kernel": r(d, L, h, hd) / np.float32(np.sqrt(hd)),
            f"{pre}/self_attention/key/kernel": r(d, L, kv, hd), f"{pre}/self_attention/value/kernel": r(d, L, kv, hd),
            f"{pre}/self_attention/out/kernel": r(h, L, hd, d), f"{pre}/mlp/wi_0/kernel": r(d, L, f),
            f"{pre}/mlp/wi_1/kernel": r(d, L, f), f"{pre}/mlp/wo/kernel": r(f, L, d),
            f"{pre}/pre_self_attention_layer_norm/scale": 1 + r(d, L),
            f"{pre}/post_self_attention_layer_norm/scale": 1 + r(d, L)}


def test_maxtext_preset_matches_transformers(tmp_path):
    """MaxText's tree (real names, layer axis 1, pre-scaled query, interleaved rotary) -> HF Llama;
    broken control: the other rotary layout; torch -> MaxText save: exact for a power-of-two
    sqrt(head_dim), refused otherwise."""
    cfg = dict(LLAMA, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    params = _maxtext_params(cfg, np.random.default_rng(2))
    url = str(tmp_path / "maxtext")
    bt.save(url, nest_tensors(params), step=1)
    names = {"q": "self_attention/query/kernel", "k": "self_attention/key/kernel", "v": "self_attention/value/kernel",
             "o": "self_attention/out/kernel", "gate": "mlp/wi_0/kernel", "up": "mlp/wi_1/kernel", "down": "mlp/wo/kernel",
             "attn_norm": "pre_self_attention_layer_norm/scale", "mlp_norm": "post_self_attention_layer_norm/scale"}
    layer = lambda n, i: (np.take(params[f"params/params/decoder/layers/{names[n]}"], i, axis=1)  # noqa: E731
                          if n in names else None)
    want = llama_forward(EVAL_IDS, layers=cfg["num_hidden_layers"], layer=layer,
                         embed=params["params/params/token_embedder/embedding"],
                         norm=params["params/params/decoder/decoder_norm/scale"],
                         head=params["params/params/decoder/logits_dense/kernel"], eps=cfg["rms_norm_eps"],
                         theta=10000.0, rope="interleaved", query_prescaled=True)
    config = tf.LlamaConfig(**cfg)
    mapping = hf_llama_from_maxtext(config, optimizer=None)
    model, out = _load(tf.LlamaForCausalLM(config).eval(), url, mapping)
    err = float(np.abs(logits(model, EVAL_IDS) - want).max())
    bad, _ = _load(tf.LlamaForCausalLM(config).eval(), url, hf_llama_from_maxtext(config, optimizer=None, rope="halves"))
    bad_err = float(np.abs(logits(bad, EVAL_IDS) - want).max())
    print(f"MaxText -> HF: max |transformers - numpy MaxText forward| = {err:.2e}; wrong rotary layout: {bad_err:.2e}")
    assert err < LOGIT_ATOL and bad_err > 1e-2

    # torch -> MaxText: sqrt(16) = 4, so the query scale inverts exactly: bit for bit back.
    back = str(tmp_path / "back")
    bt.save(back, {"model": model.state_dict()}, step=2, mapping=mapping)
    got = full_np(bt.load(back, nest_tensors(params), step=2))
    assert sorted(got) == sorted(params)
    assert all(got[k].tobytes() == params[k].tobytes() for k in params), [k for k in params if got[k].tobytes() != params[k].tobytes()]

    # head_dim 8: sqrt(8) is not a power of two, so the save is refused before anything is written.
    cfg8 = dict(LLAMA)
    m8 = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg8))
    with pytest.raises(MappingError, match="Scale"):
        bt.save(str(tmp_path / "refused"), {"model": m8.state_dict()}, step=1,
                mapping=hf_llama_from_maxtext(cfg8, optimizer=None))
    assert not (tmp_path / "refused").exists() or ckptfmt.Repository(str(tmp_path / "refused")).steps() == []
    bt.save(str(tmp_path / "declared"), {"model": m8.state_dict()}, step=1,  # control: declared inexact
            mapping=hf_llama_from_maxtext(cfg8, optimizer=None, allow_inexact_save=True))


def _nnx_training_arrays(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every leaf of {"model": nnx_state(model), "optimizer": nnx_state(nnx.Optimizer(model,
    optax.adamw(...)))} for the NNX Llama layout, with the dtypes JAX writes."""
    params = _nnx_llama_params(cfg, rng, bias=False)
    out = {f"model/{k}": v for k, v in params.items()}
    for moment in ("mu", "nu"):
        out.update({f"optimizer/opt_state/0/{moment}/{k}": np.abs(rng.standard_normal(v.shape)).astype(np.float32)
                    for k, v in params.items()})
    out["optimizer/opt_state/0/count"] = np.array(3, np.int32)
    out["optimizer/step"] = np.array(3, np.uint32)
    return out


def _write(url: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    ckptfmt.save(url, step, [ckptfmt.LocalShard(k, a.shape, a.dtype, ckptfmt.Box.full(a.shape), a)
                             for k, a in arrays.items()])


def _hf_with_adamw(cfg: dict) -> tuple:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    msd, osd = get_state_dict(model, opt)
    return model, {"model": msd, "optim": osd}


def _tensors(url: str, step: int) -> dict[str, np.ndarray]:
    ckpt = ckptfmt.Repository(url).open(step)
    return {k: np.asarray(ckpt.read(k)) for k in ckpt.keys()}


def test_preset_carries_the_optimizer_both_ways(tmp_path):
    """JAX layout (optax's int32 count, NNX's uint32 step) -> LlamaForCausalLM + AdamW (float32
    step) -> bt.save(mapping=preset): every tensor of the JAX layout back bit for bit, dtypes
    included, with no user rule. Broken control: the preset without its Casts writes the count
    (and the step) as float32."""
    cfg = dict(LLAMA)
    arrays = _nnx_training_arrays(cfg, np.random.default_rng(3))
    _write(str(tmp_path / "jax"), 1, arrays)
    _, target = _hf_with_adamw(cfg)
    # Broken control of the load: without its Casts the preset's int32 count does not reach torch's
    # float32 step (the one planner casts within one kind only), and the error names the key.
    with pytest.raises(ckptfmt.CheckpointError, match="step") as err:
        bt.load(str(tmp_path / "jax"), target, mapping=_without_casts(hf_llama_from_nnx(cfg)))
    assert "int32" in str(err.value) and "float32" in str(err.value)
    for name, mapping in (("preset", hf_llama_from_nnx(cfg)), ("nocast", _without_casts(hf_llama_from_nnx(cfg)))):
        _, target = _hf_with_adamw(cfg)
        loaded = bt.load(str(tmp_path / "jax"), target, mapping=hf_llama_from_nnx(cfg))
        assert loaded.report.missing == () and loaded.report.unexpected == ()
        steps = {float(v["step"]) for v in loaded["optim"]["state"].values()}
        assert steps == {3.0} and all(v["step"].dtype == torch.float32 for v in loaded["optim"]["state"].values())
        bt.save(str(tmp_path / name), {"model": loaded["model"], "optim": loaded["optim"]}, step=2, mapping=mapping)
        got = _tensors(str(tmp_path / name), 2)
        assert sorted(got) == sorted(arrays), sorted(set(got) ^ set(arrays))
        differ = sorted(k for k in arrays if got[k].dtype != arrays[k].dtype or got[k].tobytes() != arrays[k].tobytes())
        print(f"{name}: {len(arrays)} tensors, differing: {differ}")
        if name == "preset":
            assert differ == []
        else:  # the control: the counters come back float32, everything else equal
            assert differ == ["optimizer/opt_state/0/count", "optimizer/step"]
            assert got["optimizer/opt_state/0/count"].dtype == np.float32


def test_preset_rule_override_on_save_and_load(tmp_path):
    """A user's rule replaces one preset rule on save and on load (mapping.override); broken
    control: the same rule merely added (preset + Mapping) is ambiguous on save (InvalidRuleError
    naming the key and the way out), and the override, unlike a fallback, does not read the
    preset's source on load."""
    cfg = dict(LLAMA)
    preset_m = hf_llama_from_nnx(cfg, optimizer=None)
    mine = Rule("model/final_norm/scale", "model/model.norm.weight")
    model, _ = _hf_with_adamw(cfg)
    state = {"model": model.state_dict()}
    with pytest.raises(InvalidRuleError, match="override") as err:  # control: two rules, no precedence
        bt.save(str(tmp_path / "added"), state, step=1, mapping=preset_m + Mapping((mine,), source_sep="/", target_sep="."))
    assert isinstance(err.value, ckptfmt.CheckpointError) and err.value.key == "model/model.norm.weight"
    m = preset_m.override(mine)
    assert preset_m.rules[0] != mine and len(m.rules) == len(preset_m.rules) + 1  # the preset is untouched
    bt.save(str(tmp_path / "mine"), state, step=1, mapping=m)
    got = _tensors(str(tmp_path / "mine"), 1)
    assert "model/final_norm/scale" in got and "model/norm/scale" not in got and "model/layers/attn/q/kernel" in got
    assert np.array_equal(got["model/final_norm/scale"], model.model.norm.weight.detach().numpy())
    fresh, _ = _hf_with_adamw(cfg)
    loaded = bt.load(str(tmp_path / "mine"), {"model": fresh.state_dict()}, mapping=m)
    assert torch.equal(loaded["model"]["model.norm.weight"], model.model.norm.weight)
    assert loaded.report.missing == () and loaded.report.unexpected == ()
    # The preset's own source is not a fallback for a key the user's rule took.
    _write(str(tmp_path / "jax"), 1, {f"model/{k}": v for k, v in _nnx_llama_params(cfg, np.random.default_rng(4), False).items()})
    with pytest.raises(ckptfmt.KeyMismatchError, match="final_norm"):
        bt.load(str(tmp_path / "jax"), {"model": fresh.state_dict()}, mapping=m)
    assert bt.load(str(tmp_path / "jax"), {"model": fresh.state_dict()}, mapping=preset_m).report.missing == ()
    # inverse and JSON keep the precedence
    from bridges.mapping._mapfile import mapping_from_json, mapping_to_json
    assert mapping_from_json(json.loads(json.dumps(mapping_to_json(m)))) == m
    assert m.inverse().tiers[0] == 0 and set(m.inverse().tiers[1:]) == {1}


#: bridges/MAPPING.md 4.1's worked example: a Llama with the reference implementation's names.
OWN_NAMES = {"embed": "tok_embeddings/embedding",
             "q_kernel": "blocks/attention/wq/kernel", "k_kernel": "blocks/attention/wk/kernel",
             "v_kernel": "blocks/attention/wv/kernel", "o_kernel": "blocks/attention/wo/kernel",
             "gate_kernel": "blocks/feed_forward/w1/kernel", "up_kernel": "blocks/feed_forward/w3/kernel",
             "down_kernel": "blocks/feed_forward/w2/kernel",
             "attn_norm": "blocks/attention_norm/scale", "mlp_norm": "blocks/ffn_norm/scale",
             "norm": "norm/scale", "lm_head": "output/kernel"}


def test_name_tables_in_mapping_md_match_presets():
    """Every preset's name table in bridges/MAPPING.md is the one bridges/presets/_registry.py generates
    (control: a table edited by one row is told apart)."""
    from bridges.presets import NAME_TABLES, names_markdown

    doc = (REPO / "bridges" / "MAPPING.md").read_text()
    for name in NAME_TABLES:
        begin, end = f"<!-- names:{name} -->\n", f"\n<!-- /names:{name} -->"
        assert begin in doc and end in doc, name
        shown = doc.split(begin, 1)[1].split(end, 1)[0]
        assert shown == names_markdown(name), (f"{name}: regenerate with python -c \"from bridges.presets import "
                                               f"names_markdown; print(names_markdown('{name}'))\"")
        rows = shown.splitlines()
        assert "\n".join(rows[:2] + rows[3:] + rows[2:3]) != names_markdown(name)  # control: rows reordered


def test_fitting_your_own_names(tmp_path):
    """MAPPING.md 4.1: a Llama with other parameter names loads through names= (logits equal the
    numpy forward) and exports through ckptfmt export --names (from_pretrained gives the same
    logits); broken controls: without names the load and the export are refused, naming the key;
    an unknown name key is an InvalidRuleError (a CheckpointError and a ValueError)."""
    from typer.testing import CliRunner
    from ckptfmt_tools.cli import app

    cfg = dict(LLAMA)
    params = _nnx_llama_params(cfg, np.random.default_rng(5), bias=False)
    mine = {OWN_NAMES[k]: v for k, v in _by_name_key(params).items()}
    url = str(tmp_path / "own")
    bt.save(url, {"model": nest_tensors(mine)}, step=1)
    want = llama_forward(EVAL_IDS, layers=cfg["num_hidden_layers"],
                         layer=lambda n, i: None if n.endswith("_bias") else params[_REF[n]][i],
                         embed=params["embed/embedding"], norm=params["norm/scale"], head=params["lm_head/kernel"],
                         eps=cfg["rms_norm_eps"], theta=10000.0)
    model, out = _load(tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).eval(), url,
                       hf_llama_from_nnx(cfg, optimizer=None, names=OWN_NAMES))
    err = float(np.abs(logits(model) - want).max())
    with pytest.raises(ckptfmt.KeyMismatchError, match="model/embed/embedding"):  # control: no names
        _load("llama", url, hf_llama_from_nnx(cfg, optimizer=None))
    with pytest.raises(ValueError, match="unknown name key"):
        hf_llama_from_nnx(cfg, names={"q_kernal": "x"})
    (tmp_path / "names.json").write_text(json.dumps(OWN_NAMES))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"])))
    runner = CliRunner()
    base = ["export", url, "--mapping", "hf_llama_from_nnx", "--config", str(tmp_path / "config.json")]
    r = runner.invoke(app, base + [str(tmp_path / "hf"), "--names", str(tmp_path / "names.json")])
    assert r.exit_code == 0, r.output
    hf = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    eerr = float(np.abs(logits(hf) - want).max())
    bad = runner.invoke(app, base + [str(tmp_path / "hf_without"), "--json"])  # control: no --names
    assert bad.exit_code != 0 and "KeyMismatchError" in bad.output, bad.output
    print(f"own names: load {err:.2e}, export --names -> from_pretrained {eerr:.2e} (max |logit diff| vs numpy)")
    assert err < LOGIT_ATOL and eerr < LOGIT_ATOL and out.report.missing == ()


_REF = {"q": "layers/attn/q/kernel", "k": "layers/attn/k/kernel", "v": "layers/attn/v/kernel", "o": "layers/attn/o/kernel",
        "gate": "layers/mlp/gate/kernel", "up": "layers/mlp/up/kernel", "down": "layers/mlp/down/kernel",
        "attn_norm": "layers/attn_norm/scale", "mlp_norm": "layers/mlp_norm/scale"}


def _by_name_key(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The NNX-layout parameters keyed by the preset's name keys."""
    from bridges.presets import LLAMA_NNX_NAMES

    return {k: params[p] for k, p in LLAMA_NNX_NAMES.items() if p in params}


# ------------------------------------------------------------------ real JAX training


@pytest.fixture(scope="module")
def jax_ckpts(tmp_path_factory):
    """One JAX subprocess trains both NNX models and saves them (see hf_jax_side.py)."""
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    work = tmp_path_factory.mktemp("hf")
    t0 = time.monotonic()
    subprocess.run([sys.executable, str(REPO / "tests" / "torchproc" / "hf_jax_side.py"), "produce", str(work)],
                   env=child_env(XLA_FLAGS=JAX_FLAGS, JAX_PLATFORMS="cpu"),
                   check=True, timeout=600, cwd=str(REPO))
    print(f"JAX side (train + save both models): {time.monotonic() - t0:.1f} s")
    return work


def weights_only(name: str, **kw) -> Mapping:
    """The preset for the model weights alone; the checkpoint's optimizer state is ignored."""
    return preset(name, optimizer=None, ignore=("optimizer/*",), **kw)


def _per_layer(mapping: Mapping, shift: int) -> Mapping:
    """Broken control: every layer {i} reads stacked index (i + shift) mod L."""
    rules = []
    for rule in mapping.rules:
        sel = next((op for op in rule.transforms if isinstance(op, Select) and op.index == "i"), None)
        if sel is None:
            rules.append(rule)
            continue
        for i in range(sel.size):
            ops = tuple(Select(op.axis, (i + shift) % sel.size, op.size) if op is sel else op for op in rule.transforms)
            rules.append(Rule(rule.source, rule.target.replace("{i}", str(i)), transforms=ops))
    return Mapping(tuple(rules), mapping.ignore, mapping.keep, mapping.source_sep, mapping.target_sep)


def _heads_swapped() -> Mapping:
    """Broken control: q/k/v/o merged as (head_dim, heads) instead of (heads, head_dim)."""
    h, kv, hd, L = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], LLAMA["head_dim"], LLAMA["num_hidden_layers"]
    lay = "model/model.layers.{i}.self_attn"
    rules = [Rule(f"model/layers/attn/{p}/kernel", f"{lay}.{p}_proj.weight",
                  transforms=(Select(0, "i", L), Transpose((0, 2, 1)), Merge(1, (hd, n)), Transpose((1, 0))))
             for p, n in (("q", h), ("k", kv), ("v", kv))]
    rules.append(Rule("model/layers/attn/o/kernel", f"{lay}.o_proj.weight",
                      transforms=(Select(0, "i", L), Transpose((1, 0, 2)), Merge(0, (hd, h)), Transpose((1, 0)))))
    return Mapping(tuple(rules), source_sep="/", target_sep=".")


@pytest.mark.multiprocess
def test_llama_and_gpt2_from_jax_training(jax_ckpts):
    """The trained NNX models load into transformers in one process: logits within 1e-4; each
    broken control (heads merged in the wrong order, the wrong rotary layout, a layer index off
    by one, GPT-2's q/k/v fused in the wrong order) loads without error and fails on logits."""
    ref = dict(np.load(jax_ckpts / "jax_logits.npz"))
    url = str(jax_ckpts / "llama")
    model, out = _load("llama", url, weights_only("llama"))
    assert out.report.missing == () and out.report.unexpected == () and len(out.report.loaded) == 21
    assert out.extra == {"config": json.loads(json.dumps(LLAMA))}
    err = float(np.abs(logits(model) - ref["llama"]).max())
    controls = {
        "heads merged in the wrong order": _heads_swapped() + weights_only("llama"),
        "interleaved rotary layout": weights_only("llama", rope="interleaved"),
        "layer index off by one": _per_layer(weights_only("llama"), 1),
    }
    broken = {}
    for what, m in controls.items():
        bad, _ = _load("llama", url, m)
        broken[what] = float(np.abs(logits(bad) - ref["llama"]).max())
    gpt2, _ = _load("gpt2", str(jax_ckpts / "gpt2"), weights_only("gpt2"))
    gerr = float(np.abs(logits(gpt2) - ref["gpt2"]).max())
    d = GPT2["n_embd"]
    kqv = Mapping((Rule(("model/h/attn/k/kernel", "model/h/attn/q/kernel", "model/h/attn/v/kernel"),
                        "model/transformer.h.{i}.attn.c_attn.weight",
                        transforms=(Select(0, "i", GPT2["n_layer"]), Concat(1, (d, d, d)))),), source_sep="/", target_sep=".")
    bad, _ = _load("gpt2", str(jax_ckpts / "gpt2"), kqv + weights_only("gpt2"))
    broken["GPT-2 c_attn fused as k, q, v"] = float(np.abs(logits(bad) - ref["gpt2"]).max())
    print(f"Llama JAX -> HF max |logit diff| {err:.2e}; GPT-2 {gerr:.2e}; broken controls: "
          + ", ".join(f"{k} {v:.2e}" for k, v in broken.items()))
    assert err < LOGIT_ATOL and gerr < LOGIT_ATOL
    assert all(v > 1e-2 for v in broken.values()), broken


@pytest.mark.multiprocess
def test_tensor_parallel_load_4_ranks(jax_ckpts):
    """4 gloo ranks, q/k/v/gate/up Shard(0), o/down Shard(1) (GPT-2's Conv1D: the other dims):
    logits equal the one-process load; each rank reads its share (sharded tensors' local blocks
    plus the replicated small ones) plus per shard object its index and checksums only."""
    res = run_world("hf_tp", 4, jax_ckpts, {})
    for name in ("llama", "gpt2"):
        one, _ = _load(name, str(jax_ckpts / name), weights_only(name))
        assert np.array_equal(np.load(jax_ckpts / f"tp_logits_{name}.npy"), logits(one)), name
        total = sum(p.stat().st_size for p in (jax_ckpts / name).rglob("*") if p.is_file() and ("/t/" in str(p) or "/p/" in str(p)))
        for rank, r in enumerate(res):
            f = r[name]
            over = f["bytes_read"] - f["local_bytes"]
            print(f"{name} rank {rank}: read {f['bytes_read']:,} B = share {f['local_bytes']:,} B (its blocks of the "
                  f"sharded tensors {f['sharded_bytes']:,} B + replicated tensors {f['replicated_bytes']:,} B) + {over:,} B "
                  f"indexes and checksums of {f['objects_read']} shard objects; all tensors in the checkpoint: {total:,} B")
            assert f["sharded_bytes"] + f["replicated_bytes"] == f["local_bytes"]
            assert 0 <= over <= 24 * f["objects_read"], (name, rank, f)
        assert set(res[0][name]["placements"].values()) == {"(Shard(dim=0),)", "(Shard(dim=1),)"}


def _without_casts(mapping: Mapping) -> Mapping:
    """Broken control: the preset with every Cast removed (torch's float32 step written as is)."""
    rules = tuple(Rule(r.source, r.target, r.permute, tuple(op for op in r.transforms if not isinstance(op, Cast)),
                       also=r.also) for r in mapping.rules)
    return Mapping(rules, mapping.ignore, mapping.keep, mapping.source_sep, mapping.target_sep)


@pytest.mark.multiprocess
def test_torch_jax_torch_round_trip(jax_ckpts, tmp_path):
    """Both models: load, one torch AdamW step, save twice (the JAX layout through the preset; the
    HF layout as is), restore both in JAX on the (4, 2) mesh into the real ``nnx.Optimizer``
    target (the second through preset.inverse()): identical; the restored Llama's JAX logits match
    torch's; JAX saves again and torch loads it: parameters, Adam moments and steps bit for bit.
    And JAX -> torch -> JAX with no user rule: every leaf of the model and of
    ``nnx.Optimizer(model, optax.adamw(...))`` (optax's int32 count, NNX's uint32 step) bit for
    bit; broken control: without the preset's Casts the restore fails on the count's dtype."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    before, torch_logits = {}, {}
    for name in ("llama", "gpt2"):
        model = hf_model(name)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        msd, osd = get_state_dict(model, opt)
        loaded = bt.load(str(jax_ckpts / name), {"model": msd, "optim": osd}, mapping=preset(name))
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        ids = torch.from_numpy(np.random.default_rng(7).integers(0, 256, (4, 9))).long()
        model(ids, labels=ids).loss.backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        before[name] = full_np(state)
        model.eval()
        torch_logits[name] = logits(model)
        bt.save(str(jax_ckpts / f"{name}_mapped"), state, step=TRAIN_STEPS + 1, mapping=preset(name))
        bt.save(str(jax_ckpts / f"{name}_plain"), state, step=TRAIN_STEPS + 1)
    # JAX -> torch -> JAX: the trained checkpoint into HF + AdamW and straight back through the
    # preset; broken control: the same preset without its Casts.
    for suffix, mapping in (("", preset("llama")), ("_nocast", _without_casts(preset("llama")))):
        model = hf_model("llama")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        msd, osd = get_state_dict(model, opt)
        # The load always through the preset (without its Casts the one planner refuses the int32
        # count for torch's float32 step: see test_preset_carries_the_optimizer_both_ways); the save
        # through each, so the control's checkpoint holds a float32 count.
        loaded = bt.load(str(jax_ckpts / "llama"), {"model": msd, "optim": osd}, mapping=preset("llama"))
        assert loaded.report.unexpected == () and loaded.report.missing == ()
        bt.save(str(jax_ckpts / f"llama_j2t{suffix}"), {"model": loaded["model"], "optim": loaded["optim"]},
                step=TRAIN_STEPS, mapping=mapping, extra=loaded.extra)
    subprocess.run([sys.executable, str(REPO / "tests" / "torchproc" / "hf_jax_side.py"), "roundtrip", str(jax_ckpts)],
                   env=child_env(XLA_FLAGS=JAX_FLAGS, JAX_PLATFORMS="cpu"),
                   check=True, timeout=600, cwd=str(REPO))
    rt = dict(np.load(jax_ckpts / "roundtrip.npz"))
    assert bool(rt["llama_same"]) and bool(rt["gpt2_same"]) and bool(rt["llama_sharded"]) and bool(rt["gpt2_sharded"])
    keys = [str(k) for k in rt["j2t_keys"]]
    print(f"JAX -> torch -> JAX: {int(rt['j2t_leaves'])} leaves of model + nnx.Optimizer bit for bit: "
          f"{bool(rt['j2t_same'])}; without the Casts: {str(rt['nocast_error'])[:200]}")
    assert bool(rt["j2t_same"]) and "optimizer/step" in keys and "optimizer/opt_state/0/count" in keys
    assert "MismatchError" in str(rt["nocast_error"]) and "int32" in str(rt["nocast_error"])
    jerr = float(np.abs(rt["llama_logits"] - torch_logits["llama"]).max())
    print(f"torch -> JAX: Llama logits max |JAX - torch| {jerr:.2e}")
    assert jerr < LOGIT_ATOL
    for name in ("llama", "gpt2"):
        model = hf_model(name, seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        msd, osd = get_state_dict(model, opt)
        back = bt.load(str(jax_ckpts / f"{name}_back"), {"model": msd, "optim": osd}, mapping=preset(name))
        got = full_np({"model": back["model"], "optim": back["optim"]})
        want = before[name]
        assert sorted(got) == sorted(want)
        differ = [k for k in want if got[k].dtype != want[k].dtype or got[k].tobytes() != want[k].tobytes()]
        assert not differ, (name, differ[:5])
        assert sum("exp_avg_sq" in k for k in got) == len(msd) - (1 if name == "gpt2" else 0)  # tied head
