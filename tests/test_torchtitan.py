"""torchtitan through ckptfmt (issue 51, item 1): a training loop of torchtitan's components on 4
gloo ranks (FSDP2 over tensor parallelism, (dp, tp) = (2, 2)) saves through
``bridges.torchtitan.CkptfmtCheckpointManager``; a fresh job resumes from it bit for bit; the
checkpoint loads into Hugging Face ``LlamaForCausalLM`` (built from a config) through the preset
``hf_llama_from_torchtitan`` with no hand-written names, logits and AdamW moments compared; and a
wrong preset (no q/k rotary permutation) loads and fails on the logits (the broken control).

Why not torchtitan's ``Trainer``: see tests/torchproc/titan_job.py (its models import ``triton``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges.mapping import interleaved_to_halves  # noqa: E402
from bridges.presets import hf_llama_from_torchtitan, hf_qwen3_from_torchtitan  # noqa: E402
from bridges.torchtitan import CkptfmtCheckpointManager, step_of  # noqa: E402
from torchproc import titan_job  # noqa: E402
from torchproc.launch import run_world  # noqa: E402

pytestmark = pytest.mark.multiprocess
ARGS = dict(dp=2, tp=2, steps=4, interval=2)
LOGIT_ATOL = 1e-4
BROKEN = 1e-2


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    wd = tmp_path_factory.mktemp("titan")
    run_world("titan_job:train", 4, wd, ARGS, timeout=300)
    return wd


def _hf_load(url: str, mapping):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(7)
    hf = tf.LlamaForCausalLM(titan_job.hf_config()).eval()
    adamw = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    msd, osd = get_state_dict(hf, adamw)
    out = bt.load(url, {"model": msd, "optim": osd}, mapping=mapping)
    set_state_dict(hf, adamw, model_state_dict=out["model"], optim_state_dict=out["optim"])
    with torch.no_grad():
        logits = hf(torch.tensor(titan_job.EVAL_IDS)).logits.float().numpy()
    return out, logits


def test_the_manager_saves_ckptfmt_steps_and_resumes_them(trained: Path):
    """Every interval's step folder is a committed ckptfmt step holding torchtitan's states
    (model FQNs at the root, the flattened optimizer, the LR schedulers, ``train_state``); a job
    started from other values resumes the latest one bit for bit, train state and logits too."""
    folder = trained / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]
    for s in (2, 4):
        assert ckptfmt.Repository(str(folder / f"step-{s}")).steps() == [s]
    keys = set(ckptfmt.Repository(str(folder / "step-4")).manifest(4).tensors)
    assert "layers.0.attention.qkv_linear.wq.weight" in keys
    assert "optimizer/state.layers.0.attention.qkv_linear.wq.weight.exp_avg_sq" in keys
    assert not any(p.name == ".metadata" for p in (folder / "step-4").rglob("*"))  # no DCP pickle
    res = run_world("titan_job:resume", 4, trained, ARGS, timeout=300)
    assert all(r == {"step": 4, "ntokens_seen": 128, "differ": [], "lr": res[0]["lr"]} for r in res)
    assert np.array_equal(np.load(trained / "resumed.npy"), np.load(trained / "logits.npy"))


def test_the_threaded_async_mode_commits_every_step(tmp_path: Path):
    """torchtitan's ``async_mode="async"`` (DCP's thread-based ``async_save``, a gloo group of its
    own) through the ckptfmt writer at 2 FSDP ranks, saving every step while training goes on:
    every step is committed and the last one resumes bit for bit."""
    args = dict(dp=2, tp=1, steps=3, interval=1, async_mode="async")
    run_world("titan_job:train", 2, tmp_path, args, timeout=300)
    folder = tmp_path / "ckpt"
    assert {p.name: ckptfmt.Repository(str(p)).steps() for p in sorted(folder.iterdir())} == {
        f"step-{s}": [s] for s in range(1, 4)}
    res = run_world("titan_job:resume", 2, tmp_path, args, timeout=300)
    assert all(r["step"] == 3 and r["differ"] == [] for r in res)
    assert np.array_equal(np.load(tmp_path / "resumed.npy"), np.load(tmp_path / "logits.npy"))


def test_a_torchtitan_checkpoint_loads_into_transformers_with_the_preset(trained: Path):
    """The preset maps torchtitan's names and its flattened AdamW state onto LlamaForCausalLM and
    torch's AdamW: logits within 1e-4 of the torchtitan model's, each moment the torchtitan moment
    (q/k rows permuted per head), every step 4. Control: the Qwen3 preset (no q/k permutation,
    right for Qwen3, wrong for Llama 3) loads every tensor and misses the logits."""
    url = str(trained / "ckpt" / "step-4")
    want = np.load(trained / "logits.npy")
    cfg = titan_job.hf_config()
    out, got = _hf_load(url, hf_llama_from_torchtitan(cfg))
    assert out.report.missing == () and out.report.unexpected == ()
    err = float(np.abs(got - want).max())
    assert err < LOGIT_ATOL, err

    raw = bt.load(url, {"optimizer": {
        f"state.layers.1.attention.qkv_linear.{w}.weight.exp_avg": torch.zeros(n * 8, 32) for w, n in (("wq", 4), ("wk", 2))}})
    for w, proj, n in (("wq", "q_proj", 4), ("wk", "k_proj", 2)):
        tt = raw["optimizer"][f"state.layers.1.attention.qkv_linear.{w}.weight.exp_avg"].numpy()
        halves = tt.reshape(n, 8, 32)[:, list(interleaved_to_halves(8))].reshape(n * 8, 32)
        hf_m = out["optim"]["state"][f"model.layers.1.self_attn.{proj}.weight"]["exp_avg"].numpy()
        assert np.array_equal(hf_m, halves) and np.abs(hf_m).max() > 0
    assert {float(s["step"]) for s in out["optim"]["state"].values()} == {4.0}

    _, broken = _hf_load(url, hf_qwen3_from_torchtitan(cfg))
    print(f"torchtitan -> transformers: max |logits diff| = {err:.2e}; without the q/k permutation: "
          f"{float(np.abs(broken - want).max()):.2e}")
    assert float(np.abs(broken - want).max()) > BROKEN


def test_export_with_the_preset_writes_a_directory_transformers_loads(trained: Path, tmp_path: Path):
    """``ckptfmt export --mapping hf_llama_from_torchtitan`` (the registry's preset) writes
    safetensors that ``from_pretrained`` reads with the same logits; the training state is left out."""
    from bridges.interop import export

    cfg = titan_job.hf_config()
    export(str(trained / "ckpt" / "step-4"), str(tmp_path / "hf"), mapping="hf_llama_from_torchtitan",
           config=cfg.to_dict())
    hf = tf.LlamaForCausalLM.from_pretrained(tmp_path / "hf", config=cfg).eval()
    with torch.no_grad():
        got = hf(torch.tensor(titan_job.EVAL_IDS)).logits.float().numpy()
    assert float(np.abs(got - np.load(trained / "logits.npy")).max()) < LOGIT_ATOL


def _jax_side(url: str, work: Path, *extra: str) -> dict:
    import json
    import subprocess

    from torchproc.launch import child_env

    cfg = dict(titan_job.CFG, eval_ids=titan_job.EVAL_IDS)
    (work / "cfg.json").write_text(json.dumps(cfg))
    out = work / f"jax{'-'.join(extra)}.npz"
    subprocess.run([sys.executable, str(Path(__file__).parent / "torchproc" / "titan_jax_side.py"), url, str(out),
                    str(work / "cfg.json"), *extra], check=True, timeout=300,
                   env=child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"))
    return dict(np.load(out))


def test_a_torchtitan_checkpoint_restores_into_jax_by_two_presets_composed(trained: Path, tmp_path: Path):
    """``compose(hf_llama_from_torchtitan(cfg), hf_llama_from_nnx(cfg).inverse())`` restores the
    checkpoint into the NNX Llama layout on a (2, 2) mesh of 4 CPU devices (no torch process): the
    reference forward of the restored arrays gives the torchtitan model's logits within 1e-4, the
    count is torch's step, the head's mu is torchtitan's exp_avg transposed. Control: the Qwen3
    preset composed the same way restores and misses the logits."""
    pytest.importorskip("jax")
    from jax.sharding import PartitionSpec as P

    url = str(trained / "ckpt" / "step-4")
    want = np.load(trained / "logits.npy")
    got = _jax_side(url, tmp_path)
    err = float(np.abs(got["logits"] - want).max())
    assert err < LOGIT_ATOL, err
    assert int(got["count"]) == 4 and int(got["step"]) == 4
    assert str(got["q_spec"]) == str(P(None, "data", "model"))  # restored sharded, as the target asked
    raw = bt.load(url, {"optimizer": {"state.lm_head.weight.exp_avg": torch.zeros(96, 32)}})
    assert np.array_equal(got["mu_head"], raw["optimizer"]["state.lm_head.weight.exp_avg"].numpy().T)
    broken = _jax_side(url, tmp_path, "broken")
    print(f"torchtitan -> JAX (4 devices): max |logits diff| = {err:.2e}; without the q/k permutation: "
          f"{float(np.abs(broken['logits'] - want).max()):.2e}")
    assert float(np.abs(broken["logits"] - want).max()) > BROKEN


def test_a_torchtitan_qwen3_loads_into_transformers_with_the_preset(tmp_path: Path):
    """torchtitan's Qwen3 names (the Llama 3 names plus ``attention.{q,k}_norm.weight``, halves
    rotary): its state dict, saved as torchtitan's checkpoint holds it (FQNs at the root), loads
    into ``Qwen3ForCausalLM`` through ``hf_qwen3_from_torchtitan`` with the same logits. Broken
    control: the q and k norms swapped (names=)."""
    torch.manual_seed(3)
    model = titan_job.Llama3(dict(titan_job.CFG, qwen3=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    want = titan_job._logits(model)
    bt.save(str(tmp_path / "tt"), {k: v.detach() for k, v in model.state_dict().items()}, step=1)
    cfg = titan_job.hf_config(qwen3=True)

    def logits_with(mapping) -> np.ndarray:
        hf = tf.Qwen3ForCausalLM(cfg).eval()
        out = bt.load(str(tmp_path / "tt"), {"model": hf.state_dict()}, mapping=mapping)
        assert out.report.missing == () and out.report.unexpected == ()
        hf.load_state_dict(out["model"])
        with torch.no_grad():
            return hf(torch.tensor(titan_job.EVAL_IDS)).logits.float().numpy()

    err = float(np.abs(logits_with(hf_qwen3_from_torchtitan(cfg, optimizer=None)) - want).max())
    assert err < LOGIT_ATOL, err
    swapped = {"q_norm": "layers.{i}.attention.k_norm.weight", "k_norm": "layers.{i}.attention.q_norm.weight"}
    wrong = float(np.abs(logits_with(hf_qwen3_from_torchtitan(cfg, optimizer=None, names=swapped)) - want).max())
    print(f"torchtitan Qwen3 -> transformers: max |logits diff| = {err:.2e}; q/k norms swapped: {wrong:.2e}")
    assert wrong > BROKEN, wrong


def test_step_of_names_torchtitan_folders_only():
    assert step_of("/x/checkpoint/step-12") == 12 and step_of("step-0/") == 0
    with pytest.raises(ValueError, match="step-N"):
        step_of("/x/checkpoint/latest")
    assert issubclass(CkptfmtCheckpointManager.Config, CkptfmtCheckpointManager.__mro__[1].Config)
    assert CkptfmtCheckpointManager.Config._owner is CkptfmtCheckpointManager  # build() constructs ours
