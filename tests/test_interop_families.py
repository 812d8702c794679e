"""Published Qwen3, Gemma 2, Mixtral and Qwen2-MoE directories restored straight onto a JAX mesh.

Per family: random arrays in the preset's NNX layout (tests/_families.py) load into transformers'
own class (tiny config, nothing downloaded) through the preset; its ``save_pretrained``
directory (several files; the MoEs one tensor per expert, as the hub's) is restored by one JAX
process x 4 CPU devices (tests/interop/jax_families.py) onto a (2, 2) mesh through
``preset_mapping(...).inverse()``, with heads, ffn, vocabulary and experts split: every restored
array equals the NNX layout bit for bit, and the jitted JAX forward of the restored arrays
(tests/torchproc/jax_families.py) gives logits within 1e-4 of transformers'. Broken controls:
the wrong rotary layout (Qwen3, Gemma 2) or the experts in the reverse order (the MoEs) restore
without error, and arrays and logits differ.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("jax")

from _families import CONFIGS, E, family_params  # noqa: E402
from _torchtree import nest_tensors  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges import presets  # noqa: E402
from torchproc.hf_configs import EVAL_IDS  # noqa: E402
from torchproc.hf_side import logits  # noqa: E402
from torchproc.launch import REPO, run_jax  # noqa: E402

pytestmark = pytest.mark.multiprocess
LOGIT_ATOL = 1e-4
BROKEN = 1e-2
IDS = EVAL_IDS % CONFIGS["qwen3"]["vocab_size"]
CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"experts": "per_expert"}),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"experts": "per_expert"})}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Each family's save_pretrained directory and transformers' logits, then the one JAX process."""
    w = tmp_path_factory.mktemp("families")
    jobs = []
    for family, (config_cls, model_cls, kwargs) in CLASSES.items():
        config = getattr(tf, config_cls)(**CONFIGS[family], attn_implementation="eager")
        params = family_params(family, seed=11)
        bt.save(str(w / family / "repo"), {"model": nest_tensors(params)}, step=1)
        model = getattr(tf, model_cls)(config).eval()
        out = bt.load(str(w / family / "repo"), {"model": model.state_dict()},
                      mapping=getattr(presets, f"hf_{family}_from_nnx")(config, optimizer=None))
        model.load_state_dict(out["model"])
        model.save_pretrained(w / family / "hf", max_shard_size="100KB")
        np.save(w / family / "torch_logits.npy", logits(model, IDS))
        np.savez(w / family / "params.npz", **{k.replace("/", "."): v for k, v in params.items()})
        jobs.append({"family": family, "preset": f"hf_{family}_from_nnx", "kwargs": kwargs, "experts": E,
                     "shapes": {k: list(v.shape) for k, v in params.items()}})
    (w / "families.json").write_text(json.dumps({"families": jobs, "ids": IDS.tolist()}))
    run_jax(REPO / "tests" / "interop" / "jax_families.py", w, processes=1)
    return w


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_save_pretrained_restores_onto_a_jax_mesh(work, family):
    d = work / family
    want = dict(np.load(d / "params.npz"))
    got, bad = dict(np.load(d / "jax.npz")), dict(np.load(d / "wrong.npz"))
    res = json.loads((d / "result.json").read_text())
    files = len(list((d / "hf").glob("*.safetensors")))
    ref = np.load(d / "torch_logits.npy")
    err = float(np.abs(np.load(d / "logits.npy") - ref).max())
    wrong = float(np.abs(np.load(d / "wrong_logits.npy") - ref).max())
    differ = sorted(k for k in want if bad[k].tobytes() != want[k].tobytes())
    print(f"{family}: {files} files -> (2, 2) JAX mesh, {res['split']}/{res['leaves']} arrays split, "
          f"{res['kept']} with the target's sharding; max |JAX forward - transformers| = {err:.2e}; broken "
          f"control: {len(differ)} arrays differ, logits off by {wrong:.2e}; read {res['bytes_read']:,} B of "
          f"{res['total']:,} B")
    assert sorted(got) == sorted(want) and [k for k in want if got[k].tobytes() != want[k].tobytes()] == []
    assert res["kept"] == res["leaves"] and res["split"] >= 8 and res["unexpected"] == 0 and files > 1
    assert err < LOGIT_ATOL
    assert differ and wrong > BROKEN
