"""The one preset registry (bridges.presets.REGISTRY, issue 49): every list of presets is derived
from it, a preset function defined outside it is reported, and every preset in it saves, loads and
exports through the consumers that once kept their own lists."""
from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptfmt
from bridges import interop, presets
from bridges.mapping import Mapping
from bridges.presets import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _unregistered(namespace: dict, registry: dict) -> list[str]:
    """Functions of ``namespace`` shaped like a preset (a ``config`` first, a Mapping back) that
    ``registry`` does not hold."""
    out = []
    for name, obj in namespace.items():
        if inspect.isfunction(obj) and not name.startswith("_"):
            sig = inspect.signature(obj)
            first = next(iter(sig.parameters), None)
            if first == "config" and sig.return_annotation in ("Mapping", Mapping) and name not in registry:
                out.append(name)
    return out


def test_every_list_of_presets_is_the_registry():
    """What each consumer accepts is the registry's names: interop's PRESETS (preset_mapping,
    export, load_mapping), the name tables, the module's exports, ``ckptfmt export --help`` and
    docs/INTEROP.md. Control: a preset function defined beside the registry is reported."""
    names = list(REGISTRY)
    assert len(names) == 17 and all(p.name == n for n, p in REGISTRY.items())
    assert interop.PRESETS == tuple(names)
    assert list(presets.NAME_TABLES) == names and all(presets.NAME_TABLES[n] is REGISTRY[n].names for n in names)
    # __all__ spells the presets out for static readers (the API reference); it must be the registry's.
    assert [n for n in presets.__all__ if n.startswith("hf_")] == names
    assert all(getattr(presets, n) is REGISTRY[n].build for n in names)
    assert _unregistered(vars(presets), REGISTRY) == []
    assert sorted(_unregistered(vars(presets), {})) == sorted(names)  # the shape finds every preset

    def hf_phi_from_nnx(config, *, names=None) -> Mapping:  # defined outside the registry
        raise AssertionError

    assert _unregistered(dict(vars(presets), hf_phi_from_nnx=hf_phi_from_nnx), REGISTRY) == ["hf_phi_from_nnx"]

    from typer.testing import CliRunner

    from ckptfmt_tools.cli import app

    shown = " ".join(CliRunner().invoke(app, ["export", "--help"], env={"COLUMNS": "400"}).stdout.split())
    assert f"A preset ({', '.join(names)}; needs --config)" in shown
    doc = " ".join((ROOT / "docs" / "INTEROP.md").read_text().split())
    listed = re.search(r"`--mapping` is a preset name \(([^;]*);", doc).group(1)
    assert listed.replace("`", "").split(", ") == names


def test_every_preset_is_a_nnx_maxtext_or_torchtitan_source_with_its_training_state():
    """Each preset's source says which keys an export leaves out; the exports' ignore globs are
    exactly those (plus the preset's own). Control: an export mapping made without them differs."""
    cfg = dict(presets._registry._SIZES, num_hidden_layers=2)
    for name, p in REGISTRY.items():
        assert p.source in (presets.NNX, presets.MAXTEXT, presets.TORCHTITAN)
        assert p.source is (presets.MAXTEXT if name.endswith("_from_maxtext") else
                            presets.TORCHTITAN if name.endswith("_from_torchtitan") else presets.NNX)
        m = interop.preset_mapping(name, cfg)
        assert m.ignore[-len(p.source.training_state):] == p.source.training_state
        assert interop.load_mapping(name, cfg) == m
    assert presets.NNX.training_state != presets.MAXTEXT.training_state


# ---------------------------------------------------------------- save, load, export (torch side)

def _models() -> dict[str, tuple]:
    """For each preset: (HF config, model class, preset arguments), the smallest the preset tests use."""
    tf = pytest.importorskip("transformers")
    from _families import CONFIGS, SIZES, WIDE, configs
    from torchproc.hf_configs import GPT2, LLAMA
    from test_hf_presets_moe_families import DSV3, LLAMA4

    gemma3 = dict(SIZES, query_pre_attn_scalar=24, sliding_window=32, hidden_activation="gelu_pytorch_tanh",
                  tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    llama = (lambda: tf.LlamaConfig(**LLAMA), tf.LlamaForCausalLM)
    # MaxText pre-scales by sqrt(head_dim) (Gemma 2: the embedding by sqrt(hidden_size)): sizes whose
    # square roots are powers of two keep a save exact
    maxtext_llama = (lambda: tf.LlamaConfig(**SIZES), tf.LlamaForCausalLM)
    qwen3 = (lambda: tf.Qwen3Config(**CONFIGS["qwen3"]), tf.Qwen3ForCausalLM)
    gemma2 = (lambda: tf.Gemma2Config(**CONFIGS["gemma2"]), tf.Gemma2ForCausalLM)
    mixtral = (lambda: tf.MixtralConfig(**CONFIGS["mixtral"]), tf.MixtralForCausalLM)
    return {"hf_llama_from_nnx": llama, "hf_llama_from_maxtext": maxtext_llama,
            "hf_gpt2_from_nnx": (lambda: tf.GPT2Config(**GPT2), tf.GPT2LMHeadModel),
            "hf_qwen3_from_nnx": qwen3, "hf_qwen3_from_maxtext": qwen3,
            "hf_gemma2_from_nnx": gemma2,
            "hf_gemma2_from_maxtext": (lambda: tf.Gemma2Config(**configs(WIDE)["gemma2"]), tf.Gemma2ForCausalLM),
            "hf_gemma3_from_nnx": (lambda: tf.Gemma3TextConfig(**gemma3), tf.Gemma3ForCausalLM),
            "hf_mixtral_from_nnx": mixtral, "hf_mixtral_from_maxtext": mixtral,
            "hf_qwen2_moe_from_nnx": (lambda: tf.Qwen2MoeConfig(**CONFIGS["qwen2_moe"]), tf.Qwen2MoeForCausalLM),
            "hf_llama_from_torchtitan": llama, "hf_qwen3_from_torchtitan": qwen3,
            "hf_qwen3_moe_from_nnx": (lambda: tf.Qwen3MoeConfig(**dict(CONFIGS["qwen2_moe"], decoder_sparse_step=1,
                                                                      mlp_only_layers=[])), tf.Qwen3MoeForCausalLM),
            "hf_gpt_oss_from_nnx": (lambda: tf.GptOssConfig(**dict(CONFIGS["mixtral"], intermediate_size=16,
                                                                   attention_bias=True)), tf.GptOssForCausalLM),
            "hf_deepseek_v3_from_nnx": (lambda: tf.DeepseekV3Config(**DSV3), tf.DeepseekV3ForCausalLM),
            "hf_llama4_from_nnx": (lambda: tf.Llama4TextConfig(**LLAMA4), tf.Llama4ForCausalLM)}


def _training_state(globs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """One key under each glob of a source's training state (an optimizer counter); a bare name
    (torchtitan's ``dataloader``, a state that was None) has its glob with ``/*`` beside it."""
    return {g.replace("*", "0/count"): np.array(3, dtype=np.int32) for g in globs if "*" in g}


def _write(url: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    ckptfmt.save(url, step, [ckptfmt.LocalShard(k, a.shape, a.dtype, ckptfmt.Box.full(a.shape), a)
                             for k, a in arrays.items()])


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_preset_saves_loads_and_exports(tmp_path, name):
    """A tiny HF model's weights saved through the preset into its JAX layout, with its source's
    training state beside them; loaded back bit for bit; exported by name (``--mapping NAME``) as
    the model's tensors, the training state left out. Control (first preset): the same export
    without the training state's globs is refused, writing nothing."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    from bridges import torch as bt
    from ckptfmt.errors import CheckpointError

    make_config, model_cls = _models()[name]
    config = make_config()
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in model_cls(config).state_dict().items()}
    preset = REGISTRY[name]
    m = preset.build(config, optimizer=None)
    bt.save(str(tmp_path / "jax"), {"model": sd}, step=1, mapping=m)
    ckpt = ckptfmt.Repository(str(tmp_path / "jax")).open(1)
    arrays = {k: np.asarray(ckpt.read(k)) for k in ckpt.keys()}
    assert arrays and not set(arrays) & {f"model/{k}" for k in sd}  # the JAX layout, not the state dict
    url = str(tmp_path / "ckpt")
    _write(url, 1, dict(arrays, **_training_state(preset.source.training_state)))

    back = bt.load(url, {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}, mapping=m)["model"]
    assert [k for k in sd if not torch.equal(back[k], sd[k])] == []

    cfg = json.loads(config.to_json_string())
    interop.export(url, str(tmp_path / "out"), mapping=name, config=cfg)
    files = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        files.update(load_file(str(f)))
    assert sorted(files) == sorted(sd)
    assert [k for k in sd if not np.array_equal(files[k], sd[k].numpy())] == []

    if name == next(iter(REGISTRY)):
        full = interop.preset_mapping(name, cfg)
        bare = Mapping(full.rules, tuple(g for g in full.ignore if g not in preset.source.training_state),
                       full.keep, full.source_sep, full.target_sep, full.tiers)
        with pytest.raises(CheckpointError, match="optimizer/0/count"):
            interop.export(url, str(tmp_path / "bare"), mapping=bare, config=cfg)
        assert not list((tmp_path / "bare").glob("*.safetensors")) if (tmp_path / "bare").exists() else True
