"""The torch user's end-to-end run (issue 26 item 5; the ranks' code: tests/torchproc/llama_e2e.py).

A tiny LlamaForCausalLM on 4 gloo ranks, tensor parallel + FSDP2 on a (2, 2) mesh, AdamW and
StepLR, saves every 2 steps through ``dcp.async_save`` with ``CkptfmtStorageWriter`` and through
``bridges.torch.CheckpointManager``; rank 1 is SIGKILLed at step 6 as the saves of step 6 start
(the other ranks' saves block and are killed: step 6 never commits).
Two ranks on a (1, 2) mesh resume from the newest committed step both ways: the continuation
receipt (ckptfmt_tools.receipt.judge: batch ids of the next step identical, its loss within
LOSS_RTOL, every leaf of the live state bit-identical) against what the killed run logged, with
two broken controls (the loader's position, the optimizer not restored). The same DCP checkpoint
restores into the JAX Llama through the inverse preset: logits within 1e-4 of torch's (control:
the wrong rotary layout).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from ckptfmt_tools.receipt import judge  # noqa: E402
from torchproc.launch import REPO, child_env, run_world  # noqa: E402

# Three process groups start (4 ranks, 2 ranks, one JAX process): about 90 CPU-seconds in all,
# so it is one of the slow tests (measured 111 s wall at a load average of 10-13 on 2 cores, 340 s at 16).
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_llama_tp_fsdp2_killed_resumed_on_2_ranks_and_in_jax(tmp_path):
    from torchproc.llama_e2e import KILL_AT

    paths = {"dcp": str(tmp_path / "dcp"), "mgr": str(tmp_path / "mgr"), "log": str(tmp_path / "train.jsonl")}
    ranks = run_world("llama_e2e:train", 4, tmp_path / "train", paths, check=False)
    assert all(r is None for r in ranks)  # no rank got past the kill
    log = [json.loads(line) for line in Path(paths["log"]).read_text().splitlines()]
    steps = {r["step"]: r for r in log if "step" in r}
    digests = {r["saved"]: r["digests"] for r in log if "saved" in r}
    assert sorted(steps) == list(range(1, KILL_AT + 1)), sorted(steps)
    # The saves of step KILL_AT were in flight when rank 1 died: never committed, in either repository.
    assert ckptfmt.Repository(paths["dcp"]).steps() == [2, 4] == ckptfmt.Repository(paths["mgr"]).steps()
    k = 4
    saved = {"step": k, "digests": digests[k], "batch_ids_k1": steps[k + 1]["ids"],
             "loss_k1": steps[k + 1]["loss"], "loss_k2": steps[k + 2]["loss"]}
    res = run_world("llama_e2e:resume", 2, tmp_path / "resume", paths)[0]
    for case in ("dcp", "manager"):
        verdict = judge(saved, res[case])
        assert verdict["ok"], (case, verdict)
    loader = judge(saved, res["no-loader"])  # control: the data position not restored
    assert not loader["ok"] and not loader["checks"]["batch_ids"][0] and not loader["checks"]["loss_k1"][0], loader
    optim = judge(saved, res["no-optim"])  # control: AdamW left fresh
    assert not optim["ok"] and not optim["checks"]["state_bits"][0] and not optim["checks"]["loss_k2"][0], optim
    assert "optim/" in optim["checks"]["state_bits"][1]
    # torch -> JAX: the DCP checkpoint of 4 ranks into the JAX Llama on 8 CPU devices, no policy.
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
                    JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(REPO / "tests" / "torchproc" / "hf_jax_side.py"), "llama_logits",
                    paths["dcp"], str(tmp_path / "jax.npz")], env=env, check=True, timeout=300, cwd=str(REPO))
    torch_logits = np.load(tmp_path / "resume" / "torch_logits.npy")
    jax = dict(np.load(tmp_path / "jax.npz"))
    err = float(np.abs(jax["logits"] - torch_logits).max())
    bad = float(np.abs(jax["wrong_rope"] - torch_logits).max())
    print(f"\ntorch (TP + FSDP2, DCP) -> JAX logits: max |diff| {err:.2e}; wrong rotary layout {bad:.2e}")
    assert err < 1e-4 and bad > 1e-2, (err, bad)
