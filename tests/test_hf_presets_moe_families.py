"""The presets added for issue 51 (Qwen3-MoE, gpt-oss, DeepSeek-V3) against Hugging Face
``transformers`` 5.24 from tiny configs (random init, nothing downloaded).

Each family is checked two ways:

* **logits**: random arrays in the preset's NNX layout, saved with ``bridges.torch.save``, load
  into transformers' own class through the preset, and its logits match a numpy forward of the
  JAX-layout arrays written from the family's math (tests/_families_ref.py) where one exists;
* **a training step in both directions, optimizer included**: the HF model takes an AdamW step,
  is saved through the preset into the JAX layout (parameters, optax ``mu``/``nu``/``count``,
  NNX's step), is loaded back through the preset into a fresh model and optimizer, and both take
  the next step: every parameter and moment equal bit for bit; the saved arrays have the shapes
  of the preset's name table.

Broken controls: a wrong rule (the gate and up kernels swapped by ``names=``) loads every tensor
and misses the logits. Llama 4 (text) too, its layout being stable in transformers 5.24.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from _families import ROPE, SIZES, moe_params  # noqa: E402
from _families_ref import deepseek_v3_forward, gpt_oss_forward, llama4_forward, moe_forward  # noqa: E402
from _torchtree import nest_tensors  # noqa: E402
from bridges import presets  # noqa: E402
from bridges import torch as bt  # noqa: E402
from torchproc.hf_configs import EVAL_IDS  # noqa: E402
from torchproc.hf_side import logits  # noqa: E402

LOGIT_ATOL = 1e-4
BROKEN = 1e-2
IDS = EVAL_IDS % SIZES["vocab_size"]
FF = 16
QWEN3_MOE = dict(SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FF, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def _load(model, url: str, mapping) -> np.ndarray:
    out = bt.load(url, {"model": model.state_dict()}, mapping=mapping)
    assert out.report.missing == () and out.report.unexpected == ()
    model.load_state_dict(out["model"])
    return logits(model.eval(), IDS)


def step_both_ways(tmp_path: Path, make, mapping, ids: np.ndarray = IDS) -> dict[str, tuple[int, ...]]:
    """HF model -> AdamW step -> save through ``mapping`` (JAX layout) -> load into a fresh model and
    optimizer -> both take the next step: the parameters and moments must agree bit for bit.
    Returns the saved JAX-layout shapes (key -> shape)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def step(model, opt, batch) -> None:
        t = torch.as_tensor(np.asarray(batch, np.int64))
        out = model(input_ids=t, labels=t)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    a = make().train()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.01)
    step(a, opt_a, ids)
    msd, osd = get_state_dict(a, opt_a)
    url = str(tmp_path / "jax")
    bt.save(url, {"model": msd, "optim": osd}, step=1, mapping=mapping)
    ckpt = ckptfmt.Repository(url).open(1)
    shapes = {k: tuple(ckpt.read(k).shape) for k in ckpt.keys()}
    assert any(k.startswith("optimizer/opt_state/0/mu/") for k in shapes) and "optimizer/opt_state/0/count" in shapes

    torch.manual_seed(1)
    b = make().train()
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.01)
    msd_b, osd_b = get_state_dict(b, opt_b)
    loaded = bt.load(url, {"model": msd_b, "optim": osd_b}, mapping=mapping)
    assert loaded.report.missing == ()
    set_state_dict(b, opt_b, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    nxt = (ids + 1) % SIZES["vocab_size"]
    step(a, opt_a, nxt)
    step(b, opt_b, nxt)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert [k for k in pa if not torch.equal(pa[k], pb[k])] == []
    for k, p in pa.items():
        sa, sb = opt_a.state[p], opt_b.state[pb[k]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]), k
        assert float(sa["step"]) == float(sb["step"]) == 2.0
    return shapes


# ---------------------------------------------------------------------------------- Qwen3-MoE


def _qwen3_moe_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = moe_params(rng, FF, shared=False)
    L, hd = SIZES["num_hidden_layers"], SIZES["head_dim"]
    p.update({f"layers/attn/{n}_norm/scale": (1 + rng.standard_normal((L, hd)) * 0.2).astype(np.float32)
              for n in ("q", "k")})
    return p


def test_qwen3_moe_logits_match_transformers(tmp_path):
    """Qwen3-MoE: per-head q/k norms, softmax top-2 routing renormalized, fused experts. Broken
    control: gate and up kernels swapped (names=)."""
    config = tf.Qwen3MoeConfig(**QWEN3_MOE)
    params = _qwen3_moe_params(5)
    url = str(tmp_path / "repo")
    bt.save(url, {"model": nest_tensors(params)}, step=1)
    want = moe_forward(IDS, params, eps=SIZES["rms_norm_eps"], theta=ROPE["rope_theta"], top_k=2, renormalize=True,
                       qk_norm=True)
    m = presets.hf_qwen3_moe_from_nnx(config, optimizer=None)
    err = float(np.abs(_load(tf.Qwen3MoeForCausalLM(config), url, m) - want).max())
    swapped = {"gate_kernel": "layers/moe/up/kernel", "up_kernel": "layers/moe/gate/kernel"}
    wrong = float(np.abs(_load(tf.Qwen3MoeForCausalLM(config), url, presets.hf_qwen3_moe_from_nnx(
        config, optimizer=None, names=swapped)) - want).max())
    print(f"qwen3-moe: max |transformers - numpy NNX forward| = {err:.2e}; gate/up swapped: {wrong:.2e}")
    assert err < LOGIT_ATOL and wrong > BROKEN


def test_qwen3_moe_training_step_both_ways(tmp_path):
    config = tf.Qwen3MoeConfig(**QWEN3_MOE)
    shapes = step_both_ways(tmp_path, lambda: tf.Qwen3MoeForCausalLM(config), presets.hf_qwen3_moe_from_nnx(config))
    L, E, d, hd = SIZES["num_hidden_layers"], 4, SIZES["hidden_size"], SIZES["head_dim"]
    assert shapes["model/layers/moe/gate/kernel"] == (L, E, d, FF)
    assert shapes["model/layers/moe/router/kernel"] == (L, d, E)
    assert shapes["model/layers/attn/q_norm/scale"] == (L, hd)
    assert shapes["optimizer/opt_state/0/nu/layers/moe/down/kernel"] == (L, E, FF, d)


def test_qwen3_moe_refuses_dense_layers():
    with pytest.raises(ValueError, match="every layer must be sparse"):
        presets.hf_qwen3_moe_from_nnx(dict(QWEN3_MOE, mlp_only_layers=[0]))
    presets.hf_qwen3_moe_from_nnx(QWEN3_MOE)  # control


# ------------------------------------------------------------------------------------ gpt-oss

GPT_OSS = dict(SIZES, num_local_experts=4, num_experts_per_tok=2, intermediate_size=FF, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], attention_bias=True, tie_word_embeddings=False,
               swiglu_limit=7.0, rope_parameters=dict(ROPE))


def _gpt_oss_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    L, d, h, kv, hd = (SIZES[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim"))
    E = 4
    p = moe_params(rng, FF, shared=False)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    p.update({"layers/attn/q/bias": r(L, h, hd), "layers/attn/k/bias": r(L, kv, hd), "layers/attn/v/bias": r(L, kv, hd),
              "layers/attn/o/bias": r(L, d), "layers/attn/sinks": r(L, h) * 5, "layers/moe/router/bias": r(L, E),
              "layers/moe/gate/bias": r(L, E, FF), "layers/moe/up/bias": r(L, E, FF), "layers/moe/down/bias": r(L, E, d)})
    p["layers/moe/gate/kernel"] *= 8  # some gate values past the clamp limit
    return p


def test_gpt_oss_logits_match_transformers(tmp_path):
    """gpt-oss: biases, sinks, a sliding layer (window 8 < the 16 tokens), the biased router,
    experts with gate and up interleaved in one tensor and the clamped SwiGLU. Broken control: the
    gate and up kernels swapped (names=): the interleave then puts up where gate belongs."""
    config = tf.GptOssConfig(**GPT_OSS)
    params = _gpt_oss_params(7)
    url = str(tmp_path / "repo")
    bt.save(url, {"model": nest_tensors(params)}, step=1)
    want = gpt_oss_forward(IDS, params, eps=SIZES["rms_norm_eps"], theta=ROPE["rope_theta"], top_k=2,
                           limit=config.swiglu_limit, alpha=config.swiglu_alpha, window=GPT_OSS["sliding_window"])
    m = presets.hf_gpt_oss_from_nnx(config, optimizer=None)
    err = float(np.abs(_load(tf.GptOssForCausalLM(config), url, m) - want).max())
    swapped = {"gate_kernel": "layers/moe/up/kernel", "up_kernel": "layers/moe/gate/kernel"}
    wrong = float(np.abs(_load(tf.GptOssForCausalLM(config), url, presets.hf_gpt_oss_from_nnx(
        config, optimizer=None, names=swapped)) - want).max())
    print(f"gpt-oss: max |transformers - numpy NNX forward| = {err:.2e}; gate/up swapped: {wrong:.2e}")
    assert err < LOGIT_ATOL and wrong > BROKEN


def test_gpt_oss_training_step_both_ways(tmp_path):
    config = tf.GptOssConfig(**GPT_OSS)
    shapes = step_both_ways(tmp_path, lambda: tf.GptOssForCausalLM(config), presets.hf_gpt_oss_from_nnx(config))
    L, E, d, h = SIZES["num_hidden_layers"], 4, SIZES["hidden_size"], SIZES["num_attention_heads"]
    assert shapes["model/layers/moe/gate/kernel"] == shapes["model/layers/moe/up/kernel"] == (L, E, d, FF)
    assert shapes["model/layers/moe/up/bias"] == (L, E, FF) and shapes["model/layers/attn/sinks"] == (L, h)
    assert shapes["optimizer/opt_state/0/mu/layers/moe/down/bias"] == (L, E, d)


# -------------------------------------------------------------------------------- DeepSeek-V3

DSV3 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=FF, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=24, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_parameters=dict(ROPE), rms_norm_eps=1e-6,
            tie_word_embeddings=False, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64)


def _dsv3_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = DSV3
    L, Ld, d, H, E = c["num_hidden_layers"], c["first_k_dense_replace"], c["hidden_size"], c["num_attention_heads"], 4
    Lm, qk, kvl, rope = L - Ld, c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    one = lambda *s: 1 + r(*s)  # noqa: E731
    return {"embed/embedding": r(64, d), "norm/scale": one(d), "lm_head/kernel": r(d, 64),
            "layers/attn/wq_a/kernel": r(L, d, 24), "layers/attn/q_norm/scale": one(L, 24),
            "layers/attn/wq_b/kernel": r(L, 24, H, qk), "layers/attn/wkv_a/kernel": r(L, d, kvl + rope),
            "layers/attn/kv_norm/scale": one(L, kvl), "layers/attn/wkv_b/kernel": r(L, kvl, H, 16),
            "layers/attn/out/kernel": r(L, H, 8, d), "layers/attn_norm/scale": one(L, d), "layers/mlp_norm/scale": one(L, d),
            "dense_layers/mlp/gate/kernel": r(Ld, d, 48), "dense_layers/mlp/up/kernel": r(Ld, d, 48),
            "dense_layers/mlp/down/kernel": r(Ld, 48, d), "moe_layers/moe/router/kernel": r(Lm, d, E),
            "moe_layers/moe/router/bias": r(Lm, E), "moe_layers/moe/gate/kernel": r(Lm, E, d, FF),
            "moe_layers/moe/up/kernel": r(Lm, E, d, FF), "moe_layers/moe/down/kernel": r(Lm, E, FF, d),
            "moe_layers/moe/shared/gate/kernel": r(Lm, d, FF), "moe_layers/moe/shared/up/kernel": r(Lm, d, FF),
            "moe_layers/moe/shared/down/kernel": r(Lm, FF, d)}


def test_deepseek_v3_logits_match_transformers(tmp_path):
    """DeepSeek-V3: MLA (low-rank q and kv, the shared rotary key, interleaved rotary pairs), a
    dense first layer, then MoE layers with the correction bias and a shared expert. Broken
    control: the dense and shared experts' gate and up swapped (names=)."""
    config = tf.DeepseekV3Config(**DSV3)
    params = _dsv3_params(11)
    url = str(tmp_path / "repo")
    bt.save(url, {"model": nest_tensors(params)}, step=1)
    want = deepseek_v3_forward(IDS, params, eps=DSV3["rms_norm_eps"], theta=ROPE["rope_theta"], nope=8, rope=8,
                               kv_lora=16, dense=1, top_k=2, scaling_factor=DSV3["routed_scaling_factor"])
    m = presets.hf_deepseek_v3_from_nnx(config, optimizer=None)
    err = float(np.abs(_load(tf.DeepseekV3ForCausalLM(config), url, m) - want).max())
    swapped = {"shared_gate": "moe_layers/moe/shared/up/kernel", "shared_up": "moe_layers/moe/shared/gate/kernel"}
    wrong = float(np.abs(_load(tf.DeepseekV3ForCausalLM(config), url, presets.hf_deepseek_v3_from_nnx(
        config, optimizer=None, names=swapped)) - want).max())
    print(f"deepseek-v3: max |transformers - numpy NNX forward| = {err:.2e}; shared gate/up swapped: {wrong:.2e}")
    assert err < LOGIT_ATOL and wrong > BROKEN


def test_deepseek_v3_training_step_both_ways(tmp_path):
    config = tf.DeepseekV3Config(**DSV3)
    shapes = step_both_ways(tmp_path, lambda: tf.DeepseekV3ForCausalLM(config),
                            presets.hf_deepseek_v3_from_nnx(config))
    want = {k: v.shape for k, v in _dsv3_params(0).items()}
    assert {k[len("model/"):]: v for k, v in shapes.items() if k.startswith("model/")} == want
    assert shapes["optimizer/opt_state/0/mu/layers/attn/wkv_b/kernel"] == want["layers/attn/wkv_b/kernel"]


def test_deepseek_v3_refuses_what_it_does_not_map():
    with pytest.raises(ValueError, match="q_lora_rank"):
        presets.hf_deepseek_v3_from_nnx(dict(DSV3, q_lora_rank=None))
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        presets.hf_deepseek_v3_from_nnx(dict(DSV3, first_k_dense_replace=5))
    presets.hf_deepseek_v3_from_nnx(DSV3)  # control


# ---------------------------------------------------------------------------------- Llama 4

LLAMA4 = dict(vocab_size=64, hidden_size=32, intermediate_size=FF, intermediate_size_mlp=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=64, no_rope_layers=[1, 1, 1], use_qk_norm=True,
              rms_norm_eps=1e-5, rope_parameters=dict(ROPE), tie_word_embeddings=False, max_position_embeddings=64)


def _llama4_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = LLAMA4
    L, d, H, KV, hd, E = 3, c["hidden_size"], 4, 2, 8, 4
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    one = lambda *s: 1 + r(*s)  # noqa: E731
    return {"embed/embedding": r(64, d), "norm/scale": one(d), "lm_head/kernel": r(d, 64),
            "layers/attn/q/kernel": r(L, d, H, hd), "layers/attn/k/kernel": r(L, d, KV, hd),
            "layers/attn/v/kernel": r(L, d, KV, hd), "layers/attn/o/kernel": r(L, H, hd, d),
            "layers/attn_norm/scale": one(L, d), "layers/mlp_norm/scale": one(L, d),
            "dense_layers/mlp/gate/kernel": r(2, d, 48), "dense_layers/mlp/up/kernel": r(2, d, 48),
            "dense_layers/mlp/down/kernel": r(2, 48, d), "moe_layers/moe/router/kernel": r(1, d, E) * 5,
            "moe_layers/moe/gate/kernel": r(1, E, d, FF), "moe_layers/moe/up/kernel": r(1, E, d, FF),
            "moe_layers/moe/down/kernel": r(1, E, FF, d), "moe_layers/moe/shared/gate/kernel": r(1, d, FF),
            "moe_layers/moe/shared/up/kernel": r(1, d, FF), "moe_layers/moe/shared/down/kernel": r(1, FF, d)}


def test_llama4_logits_match_transformers(tmp_path):
    """Llama 4 text: layers 0 and 2 dense, layer 1 MoE (config.moe_layers), interleaved rotary,
    weightless q/k L2 norms, the router's sigmoid scaling each chosen expert's input, the shared
    expert. Broken control: the experts' gate and up swapped (names=)."""
    config = tf.Llama4TextConfig(**LLAMA4)
    assert list(config.moe_layers) == [1]
    params = _llama4_params(13)
    url = str(tmp_path / "repo")
    bt.save(url, {"model": nest_tensors(params)}, step=1)
    want = llama4_forward(IDS, params, eps=LLAMA4["rms_norm_eps"], theta=ROPE["rope_theta"], moe_layers=[1], top_k=1)
    m = presets.hf_llama4_from_nnx(config, optimizer=None)
    err = float(np.abs(_load(tf.Llama4ForCausalLM(config), url, m) - want).max())
    swapped = {"gate": "moe_layers/moe/up/kernel", "up": "moe_layers/moe/gate/kernel"}
    wrong = float(np.abs(_load(tf.Llama4ForCausalLM(config), url, presets.hf_llama4_from_nnx(
        config, optimizer=None, names=swapped)) - want).max())
    print(f"llama4: max |transformers - numpy NNX forward| = {err:.2e}; expert gate/up swapped: {wrong:.2e}")
    assert err < LOGIT_ATOL and wrong > BROKEN


def test_llama4_training_step_both_ways(tmp_path):
    config = tf.Llama4TextConfig(**LLAMA4)
    shapes = step_both_ways(tmp_path, lambda: tf.Llama4ForCausalLM(config), presets.hf_llama4_from_nnx(config))
    want = {k: v.shape for k, v in _llama4_params(0).items()}
    assert {k[len("model/"):]: v for k, v in shapes.items() if k.startswith("model/")} == want
