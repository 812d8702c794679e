"""A published per-expert Mixtral directory restored straight onto a JAX expert-parallel mesh.

``MixtralForCausalLM(MixtralConfig(...)).save_pretrained`` (random init, nothing downloaded)
writes one tensor per expert (``model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight``), as
hub checkpoints are. Two JAX processes x 4 CPU devices (tests/interop/jax_moe.py) restore them
onto stacked ``(L, E, d, ff)`` arrays split over the expert axis through the inverse of one
two-Select rule per weight: every value equals the torch model's own fused expert tensors; each
process reads its experts' bytes plus the files' headers (within 5% of its share); broken
control: the experts numbered in the reverse order restore without error and differ.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("jax")

from torchproc.launch import REPO, run_jax  # noqa: E402

pytestmark = pytest.mark.multiprocess
MIXTRAL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=32)


def _run_jax(work: Path) -> list[dict]:
    run_jax(REPO / "tests" / "interop" / "jax_moe.py", work)
    return [json.loads((work / f"moe-{r}.json").read_text()) for r in range(2)]


def test_per_expert_mixtral_restores_onto_an_expert_parallel_jax_mesh(tmp_path):
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**MIXTRAL)).eval()
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    t0 = time.monotonic()
    res = _run_jax(tmp_path)
    print(f"JAX side (2 processes): {time.monotonic() - t0:.1f} s; {len(files)} safetensors files")
    ff = MIXTRAL["intermediate_size"]
    want = {}
    for w in ("w1", "w2", "w3"):
        layers = []
        for layer in model.model.layers:
            gate_up = layer.mlp.experts.gate_up_proj.detach().numpy()      # (E, 2ff, d): gate (w1), then up (w3)
            down = layer.mlp.experts.down_proj.detach().numpy()            # (E, d, ff): w2
            per = {"w1": gate_up[:, :ff], "w3": gate_up[:, ff:], "w2": down}[w]
            layers.append(np.swapaxes(per, 1, 2))                          # JAX kernels (in, out)
        want[f"moe.{w}"] = np.stack(layers)
    got, bad = dict(np.load(tmp_path / "moe.npz")), dict(np.load(tmp_path / "moe_reversed.npz"))
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].tobytes() != want[k].tobytes()]
    wrong = [k for k in want if bad[k].tobytes() != want[k].tobytes()]
    print(f"per-expert files -> stacked (L, E, ...) on the mesh: {len(want) - len(differ)}/{len(want)} tensors bit "
          f"for bit; experts in the reverse order: {len(wrong)}/{len(want)} differ, max |diff| "
          f"{max(float(np.abs(bad[k] - want[k]).max()) for k in want):.2e}")
    assert differ == [] and wrong == sorted(want)
    for rank, r in enumerate(res):
        f = r["moe"]
        ratio = (f["bytes_read"] - r["headers"]) / f["share"]
        print(f"process {rank}: read {f['bytes_read']:,} B = {ratio:.4f} x its share {f['share']:,} B + "
              f"{r['headers']:,} B of headers; all expert tensors {r['total']:,} B; unexpected keys "
              f"(a partial restore) {f['unexpected']}")
        assert f["share"] * 2 == r["total"]  # the mesh splits the experts in two
        assert f["bytes_read"] >= f["share"] and ratio <= 1.05
