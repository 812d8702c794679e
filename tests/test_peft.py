"""bridges.interop.export_peft: LoRA pairs of an NNX-layout checkpoint -> a PEFT adapter directory
that ``peft.PeftModel.from_pretrained`` loads, or merged into the base weights.

Random base and adapter weights (no training, nothing downloaded); the reference is the numpy
forward of the JAX layout (tests/_llama_ref.py) with ``x @ W + s * (x @ a @ b)`` per adapted kernel.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")

sys.path.insert(0, str(Path(__file__).resolve().parent))
INTEROP_MD = Path(__file__).resolve().parent.parent / "docs" / "INTEROP.md"

from _llama_ref import llama_forward  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges.interop import export_peft, preset_mapping  # noqa: E402
from bridges.presets import hf_llama_from_nnx  # noqa: E402
from ckptfmt.errors import InvalidConfigError, KeyMismatchError, OutputExistsError, ShapeMismatchError  # noqa: E402
from torchproc.hf_configs import EVAL_IDS, LLAMA  # noqa: E402
from _torchtree import nest_tensors  # noqa: E402

LOGIT_ATOL = 1e-4
R, ALPHA = 4, 8.0  # PEFT's scale alpha / r = 2: the JAX forward's s
KERNELS = {"q": "attn/q", "v": "attn/v", "o": "attn/o", "down": "mlp/down"}  # adapted: q_proj v_proj o_proj down_proj
NAMES = {"q": "attn/q/kernel", "k": "attn/k/kernel", "v": "attn/v/kernel", "o": "attn/o/kernel",
         "gate": "mlp/gate/kernel", "up": "mlp/up/kernel", "down": "mlp/down/kernel",
         "attn_norm": "attn_norm/scale", "mlp_norm": "mlp_norm/scale"}


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Base weights in the NNX layout plus nnx.LoRALinear-style pairs a (L, *in, r), b (L, r, *out)."""
    c = LLAMA
    d, h, kv, hd, L, f, v = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                             c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"])
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    p = {"embed/embedding": r(v, d), "layers/attn/q/kernel": r(L, d, h, hd), "layers/attn/k/kernel": r(L, d, kv, hd),
         "layers/attn/v/kernel": r(L, d, kv, hd), "layers/attn/o/kernel": r(L, h, hd, d),
         "layers/mlp/gate/kernel": r(L, d, f), "layers/mlp/up/kernel": r(L, d, f), "layers/mlp/down/kernel": r(L, f, d),
         "layers/attn_norm/scale": 1 + r(L, d), "layers/mlp_norm/scale": 1 + r(L, d), "norm/scale": 1 + r(d),
         "lm_head/kernel": r(d, v)}
    for path in KERNELS.values():
        k = p[f"layers/{path}/kernel"]
        split = 2 if path != "attn/o" else 3  # (L, in..., out...): o's input is (heads, head_dim)
        p[f"layers/{path}/lora/lora_a"] = r(*k.shape[:split], R)
        p[f"layers/{path}/lora/lora_b"] = r(L, R, *k.shape[split:])
    return p




def _reference(p: dict[str, np.ndarray], scale: float,
               pairs: dict[str, tuple[str, str]] | None = None) -> np.ndarray:
    """Logits of base + adapters: each adapted kernel W + s * (a @ b), in float64. ``pairs``: kernel
    name -> (a key, b key) under layers/ (default: KERNELS' nnx.LoRALinear pairs)."""
    if pairs is None:
        pairs = {n: (f"{k}/lora/lora_a", f"{k}/lora/lora_b") for n, k in KERNELS.items()}

    def layer(name: str, i: int) -> np.ndarray | None:
        if name not in NAMES:
            return None
        w = p[f"layers/{NAMES[name]}"][i].astype(np.float64)
        if name in pairs:
            a = p[f"layers/{pairs[name][0]}"][i].astype(np.float64)
            b = p[f"layers/{pairs[name][1]}"][i].astype(np.float64)
            w = w + scale * np.tensordot(a, b, axes=1)
        return w
    return llama_forward(EVAL_IDS, layers=LLAMA["num_hidden_layers"], layer=layer, embed=p["embed/embedding"],
                         norm=p["norm/scale"], head=p["lm_head/kernel"], eps=LLAMA["rms_norm_eps"], theta=10000.0)


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(EVAL_IDS).long()).logits.numpy()


def _base(url: str):
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).eval()
    out = bt.load(url, {"model": model.state_dict()}, mapping=hf_llama_from_nnx(LLAMA, optimizer=None), strict=False)
    model.load_state_dict(out["model"])
    return model


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory):
    p = _params(np.random.default_rng(3))
    url = str(tmp_path_factory.mktemp("peft") / "repo")
    bt.save(url, nest_tensors(p, prefix="model/"), step=1)
    return url, p


def test_peft_adapter_matches_the_jax_forward_and_merge_matches_peft(lora_ckpt, tmp_path):
    url, p = lora_ckpt
    rep = export_peft(url, str(tmp_path / "adapter"), config=LLAMA, alpha=ALPHA)
    assert rep.target_modules == ("down_proj", "o_proj", "q_proj", "v_proj") and rep.rank == R
    lora = peft.PeftModel.from_pretrained(_base(url), str(tmp_path / "adapter")).eval()
    got, want = _logits(lora), _reference(p, ALPHA / R)
    err = float(np.abs(got - want).max())
    print(f"PeftModel vs numpy base + adapter forward: {err:.2e}")
    assert err < LOGIT_ATOL
    assert float(np.abs(_logits(_base(url)) - want).max()) > 1e-2  # the adapters do change the logits
    with pytest.raises(OutputExistsError):  # never over an existing adapter (the first export was the control)
        export_peft(url, str(tmp_path / "adapter"), config=LLAMA, alpha=ALPHA)

    export_peft(url, str(tmp_path / "merged"), config=LLAMA, alpha=ALPHA, merge=True)
    merged = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    err_m = float(np.abs(_logits(merged) - got).max())
    print(f"merged LlamaForCausalLM vs PeftModel: {err_m:.2e}")
    assert err_m < LOGIT_ATOL


def test_nnx_lora_linear_is_the_layout_exported():
    """The installed Flax: nnx.LoRALinear keeps lora/lora_a (in, r) and lora/lora_b (r, out) beside
    its kernel and adds x @ a @ b unscaled, which is what export_peft reads by default (alpha = r)."""
    m = nnx.LoRALinear(6, 5, lora_rank=3, rngs=nnx.Rngs(0))
    m.lora.lora_b[...] = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), jnp.float32)
    flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(m))}
    assert flat["lora/lora_a"].shape == (6, 3) and flat["lora/lora_b"].shape == (3, 5) and "kernel" in flat
    x = jnp.ones((2, 6))
    want = x @ m.kernel[...] + m.bias[...] + x @ m.lora.lora_a[...] @ m.lora.lora_b[...]
    assert float(jnp.abs(m(x) - want).max()) < 1e-6
    assert float(jnp.abs(m(x) - (want - x @ m.kernel[...])).max()) > 1e-3  # the control: the base term counts


def test_wrong_alpha_is_caught_by_the_logits(lora_ckpt, tmp_path):
    """Broken control: alpha = r (scale 1) where the JAX forward scaled by 2 is off by far more."""
    url, p = lora_ckpt
    export_peft(url, str(tmp_path / "a"), config=LLAMA)
    lora = peft.PeftModel.from_pretrained(_base(url), str(tmp_path / "a")).eval()
    assert float(np.abs(_logits(lora) - _reference(p, ALPHA / R)).max()) > 1e-2


def test_missing_or_transposed_adapter_is_refused(lora_ckpt, tmp_path):
    """A pair without its lora_b, and a lora_a stored (L, r, in) as PEFT orients it, are refused by
    name before anything is written (the full checkpoint above is the accepted control)."""
    _, p = lora_ckpt
    url = str(tmp_path / "repo")
    bt.save(url, nest_tensors({k: v for k, v in p.items() if k != "layers/attn/v/lora/lora_b"}, prefix="model/"), step=1)
    with pytest.raises(KeyMismatchError, match="v_proj") as e:
        export_peft(url, str(tmp_path / "out"), config=LLAMA)
    assert e.value.key == "model/layers/attn/v/lora/lora_b"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    bad = dict(p, **{"layers/attn/q/lora/lora_a": np.ascontiguousarray(p["layers/attn/q/lora/lora_a"].transpose(0, 2, 1))})
    url2 = str(tmp_path / "repo2")
    bt.save(url2, nest_tensors(bad, prefix="model/"), step=1)
    with pytest.raises(ShapeMismatchError) as e:
        export_peft(url2, str(tmp_path / "out2"), config=LLAMA)
    assert e.value.key == "model/layers/attn/q/lora/lora_a"


def test_preset_export_of_the_base_leaves_adapters_unmapped(lora_ckpt):
    """The plain Llama export does not silently drop adapters: they are checkpoint keys it does not read."""
    from bridges.interop import mapped_tensors
    from ckptfmt import Repository

    url, _ = lora_ckpt
    _, unmapped, _ = mapped_tensors(Repository(url).open(1), preset_mapping("hf_llama_from_nnx", LLAMA))
    assert "model/layers/attn/q/lora/lora_a" in unmapped


def _docs_own_pair_call() -> str:
    """The "your own pair" call of docs/INTEROP.md section 11, as the page prints it."""
    text = INTEROP_MD.read_text()
    m = re.search(r"^export_peft\(url, out, config=cfg, adapters=.*\n(?:[ ]+\S.*\n)*", text, re.M)
    assert m, "docs/INTEROP.md section 11 lost its adapters= example"
    return m.group(0)


def test_the_docs_one_pair_example_exports_and_loads_with_peft(tmp_path):
    """Issue 47: ``export_peft(..., adapters=...)`` raised "unknown LoRA target module(s) ['q_proj']"
    on every call (``|`` was taken after ``-``). The docs' own example, run verbatim on a checkpoint
    holding its keys (rank 8, the JAX forward's scale 2 -> alpha 16): the adapter PEFT loads gives the
    logits of base + 2 * a @ b on q_proj. Broken controls: a misspelt module is still refused, naming
    only that module; the base alone is off by far more than the tolerance."""
    rng = np.random.default_rng(5)
    p = {k: v for k, v in _params(rng).items() if "/lora/" not in k}
    L, d, h, hd = (LLAMA["num_hidden_layers"], LLAMA["hidden_size"], LLAMA["num_attention_heads"], LLAMA["head_dim"])
    p["layers/attn/q/A"] = (rng.standard_normal((L, d, 8)) * 0.2).astype(np.float32)
    p["layers/attn/q/B"] = (rng.standard_normal((L, 8, h, hd)) * 0.2).astype(np.float32)
    url = str(tmp_path / "repo")
    bt.save(url, nest_tensors(p, prefix="model/"), step=1)
    out = str(tmp_path / "adapter")
    scope = {"export_peft": export_peft, "url": url, "out": out, "cfg": dict(LLAMA)}
    exec(compile("rep = " + _docs_own_pair_call(), str(INTEROP_MD), "exec"), scope)
    rep = scope["rep"]
    assert rep.target_modules == ("q_proj",) and rep.rank == 8 and rep.alpha == 16.0
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["q_proj"] and conf["r"] == 8 and conf["lora_alpha"] == 16.0
    lora = peft.PeftModel.from_pretrained(_base(url), out).eval()
    want = _reference(p, 2.0, {"q": ("attn/q/A", "attn/q/B")})
    assert float(np.abs(_logits(lora) - want).max()) < LOGIT_ATOL
    assert float(np.abs(_logits(_base(url)) - want).max()) > 1e-2
    with pytest.raises(ValueError) as e:
        export_peft(url, str(tmp_path / "bad"), config=LLAMA, adapters={"qq_proj": ("model/layers/attn/q/A", "x")})
    assert "['qq_proj']" in str(e.value) and "['q_proj']" not in str(e.value).split("known")[0]


def test_adapters_prefix_names_the_pair_beside_the_defaults(lora_ckpt, tmp_path):
    """adapters= with a key prefix (the default one spelt out) for one module; the other pairs are
    found by default. Before the fix this raised "unknown LoRA target module(s) ['q_proj']"."""
    url, _ = lora_ckpt
    rep = export_peft(url, str(tmp_path / "a"), config=LLAMA, alpha=ALPHA,
                      adapters={"q_proj": "model/layers/attn/q/lora"})
    assert rep.target_modules == ("down_proj", "o_proj", "q_proj", "v_proj") and rep.rank == R


def _rank0(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same pairs with rank 0: a (L, *in, 0), b (L, 0, *out)."""
    out = dict(p)
    for k, v in p.items():
        if k.endswith("/lora_a"):
            out[k] = np.zeros(v.shape[:-1] + (0,), v.dtype)
        elif k.endswith("/lora_b"):
            out[k] = np.zeros(v.shape[:1] + (0,) + v.shape[2:], v.dtype)
    return out


@pytest.mark.parametrize("merge", [False, True])
def test_rank_zero_pairs_are_refused_by_name(lora_ckpt, tmp_path, merge):
    """Rank-0 pairs: merge=True raised ZeroDivisionError (alpha / r), merge=False wrote an ``r: 0``
    adapter PEFT cannot load. Both are a ShapeMismatchError naming the first module's lora_a and
    what to do, before anything is written. Broken control: the rank-4 checkpoint exports."""
    url, p = lora_ckpt
    url0 = str(tmp_path / "repo0")
    bt.save(url0, nest_tensors(_rank0(p), prefix="model/"), step=1)
    out = tmp_path / "out"
    with pytest.raises(ShapeMismatchError, match="q_proj.*rank 0.*target_modules") as e:
        export_peft(url0, str(out), config=LLAMA, merge=merge)
    assert e.value.key == "model/layers/attn/q/lora/lora_a" and e.value.expected == "r >= 1"
    assert not out.exists() or not any(out.iterdir())
    rep = export_peft(url, str(tmp_path / "good"), config=LLAMA, alpha=ALPHA, merge=merge)
    assert rep.rank == R and rep.merged is merge


def _strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_alpha_is_refused_before_writing(lora_ckpt, tmp_path, alpha):
    """alpha NaN or +-inf wrote ``"lora_alpha": NaN`` (not JSON) into adapter_config.json, and a
    merge would add NaN * a @ b to every adapted kernel: InvalidConfigError naming the config, for
    both, before anything is written. Broken control: a finite alpha writes strict JSON."""
    url, _ = lora_ckpt
    for merge in (False, True):
        out = tmp_path / f"out-{merge}"
        with pytest.raises(InvalidConfigError, match="finite") as e:
            export_peft(url, str(out), config=LLAMA, alpha=alpha, merge=merge)
        assert e.value.object == "adapter_config.json"
        assert not out.exists() or not any(out.iterdir())
    export_peft(url, str(tmp_path / "good"), config=LLAMA, alpha=ALPHA)
    assert _strict_json((tmp_path / "good" / "adapter_config.json").read_text())["lora_alpha"] == ALPHA
