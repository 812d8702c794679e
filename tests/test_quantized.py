"""Quantized weights fail closed (issue 51, item 3): block-FP8 codes (float8_e4m3fn ``X.weight``
with float32 ``X.weight_scale_inv``, one scale per 128 x 128 block, the DeepSeek-V3 / Qwen3-FP8
layout) are refused by a restore that would cast them, dequantized by an explicit ``Dequantize``
rule, and written by ``export(..., quantize="fp8")`` in the layout transformers loads."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

import ckptfmt  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges.interop import export  # noqa: E402
from bridges.mapping import IDENTITY, Cast, Dequantize, Mapping, MappingError, Rule, dequantized  # noqa: E402
from ckptfmt import Box  # noqa: E402
from ckptfmt.errors import ChecksumMismatchError, QuantizedWeightError, ShapeMismatchError  # noqa: E402

B = 128
F8 = torch.float8_e4m3fn


def ref_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's weight layout, block by block in plain loops: scale = amax / 448."""
    rows, cols = w.shape
    scale = np.ones((-(-rows // B), -(-cols // B)), np.float32)
    codes = np.zeros(w.shape, np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * B:(i + 1) * B, j * B:(j + 1) * B]
            amax = float(np.abs(blk).max())
            s = np.float32(amax / 448.0) if amax else np.float32(1.0)
            scale[i, j] = s
            codes[i * B:(i + 1) * B, j * B:(j + 1) * B] = blk / s
    return codes, scale


def ref_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """w = codes.astype(f32) * scale, block by block (edge blocks cropped)."""
    c = codes.to(torch.float32).numpy()
    out = np.empty_like(c)
    s = scale.numpy()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * B:(i + 1) * B, j * B:(j + 1) * B] = c[i * B:(i + 1) * B, j * B:(j + 1) * B] * s[i, j]
    return out


def fp8_dir(path: Path, shape=(200, 300), seed=0, drop_scale=False, scale_shape=None) -> dict:
    path.mkdir(parents=True)
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    codes, scale = ref_quantize(w)
    t = {"l.weight": torch.from_numpy(codes).to(F8), "l.weight_scale_inv": torch.from_numpy(scale),
         "norm.weight": torch.ones(shape[1])}
    if scale_shape is not None:
        t["l.weight_scale_inv"] = torch.ones(scale_shape)
    if drop_scale:
        del t["l.weight_scale_inv"]
    safetensors_torch.save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [B, B]}}))
    return t


def test_restore_refuses_cast_codes_and_dequantize_reads_scales(tmp_path):
    """A float32 target of FP8 codes is refused (QuantizedWeightError naming the scale key and the
    Dequantize rule); through dequantized(IDENTITY) the weights equal the block-by-block reference
    bit for bit, from the safetensors directory and from its imported step. Broken controls: the
    raw cast the refusal prevents is far off (a test comparing weights catches it); a wrong scale
    gives other weights; a missing companion and a wrong scale shape are refused; an explicit
    Cast and a float8 target are allowed (no silent cast)."""
    src = tmp_path / "fp8"
    t = fp8_dir(src)
    want = ref_dequantize(t["l.weight"], t["l.weight_scale_inv"])
    target = {"l.weight": torch.zeros(200, 300), "norm.weight": torch.zeros(300)}
    url = str(tmp_path / "repo")
    ckptfmt.interop.import_safetensors(str(src), url, step=1)
    for where in (str(src), url):
        with pytest.raises(QuantizedWeightError) as e:
            bt.load(where, target)
        err = e.value
        assert isinstance(err, ShapeMismatchError) and isinstance(err, ckptfmt.CheckpointError)
        assert err.key == "l.weight" and err.object == "l.weight_scale_inv", err
        assert "Dequantize" in str(err) and "float8_e4m3fn" in str(err), err
        got = bt.load(where, target, mapping=dequantized(IDENTITY))
        assert got["l.weight"].dtype == torch.float32
        assert np.array_equal(got["l.weight"].numpy(), want)
        assert torch.equal(got["norm.weight"], t["norm.weight"])
        assert not got.report.unexpected and not got.report.cast, got.report

    out = tmp_path / "bf16"  # an export's dtype= casts the weights, never the codes or their scales
    export(url, str(out), dtype="bfloat16")
    back = safetensors_torch.load_file(str(out / "model-00001-of-00001.safetensors"))
    assert back["norm.weight"].dtype == torch.bfloat16 and back["l.weight_scale_inv"].dtype == torch.float32
    assert torch.equal(back["l.weight"].view(torch.uint8), t["l.weight"].view(torch.uint8))

    raw = t["l.weight"].to(torch.float32).numpy()  # what a silent cast gives
    err_raw = float(np.abs(raw - want).max())
    assert err_raw > 1.0 and not np.array_equal(raw, want), err_raw
    print(f"silent cast max |error| {err_raw:.1f} against the dequantized weights (|w| <= {np.abs(want).max():.2f})")

    wrong = dict(t, **{"l.weight_scale_inv": t["l.weight_scale_inv"].clone()})
    wrong["l.weight_scale_inv"][1, 2] *= 2  # one block's scale
    (tmp_path / "wrong").mkdir()
    safetensors_torch.save_file(wrong, str(tmp_path / "wrong" / "model.safetensors"))
    bad = bt.load(str(tmp_path / "wrong"), target, mapping=dequantized(IDENTITY))["l.weight"].numpy()
    diff = bad != want
    assert diff.any() and not diff[:B].any() and not diff[:, :2 * B].any()  # exactly block (1, 2) differs

    fp8_dir(tmp_path / "nocomp", drop_scale=True)
    for m in (None, dequantized(IDENTITY)):
        with pytest.raises(QuantizedWeightError) as e:
            bt.load(str(tmp_path / "nocomp"), target, mapping=m)
        assert "no scale companion" in str(e.value) and e.value.object == "l.weight_scale_inv", e.value

    fp8_dir(tmp_path / "shape", scale_shape=(1, 3))
    rule = Mapping((Rule(("l.weight", "l.weight_scale_inv"), "l.weight", transforms=(Dequantize(),)),))
    with pytest.raises(ckptfmt.CheckpointError) as e:
        bt.load(str(tmp_path / "shape"), target, mapping=rule)
    assert "one scale per (128, 128) block" in str(e.value), e.value

    codes = bt.load(str(src), {"l.weight": torch.zeros(200, 300, dtype=F8), "norm.weight": torch.zeros(300)},
                    strict=False)["l.weight"]
    assert torch.equal(codes.view(torch.uint8), t["l.weight"].view(torch.uint8))  # a float8 target: the codes
    explicit = Mapping((Rule("l.weight", "l.weight", transforms=(Cast("float32"),)),), ignore=("*_scale_inv",))
    assert np.array_equal(bt.load(str(src), target, mapping=explicit)["l.weight"].numpy(), raw)


def test_dequantize_reads_only_the_scales_of_its_box():
    """A sharded rank's box reads the same box of codes and the covering box of scales; edge
    blocks are cropped; a bfloat16 result is the float32 product rounded once."""
    m = dequantized(IDENTITY)
    res = m.resolve("l.weight", 2, {"l.weight", "l.weight_scale_inv"})
    chain = res.chain([(200, 300), (2, 3)], ["float8_e4m3fn", "float32"])
    box = Box((130, 250), (60, 50))
    assert chain.reads(box) == [("l.weight", box), ("l.weight_scale_inv", Box((1, 1), (1, 2)))]
    codes = torch.randn(200, 300).to(F8)
    scale = torch.rand(2, 3) + 0.5
    whole = chain.assemble(Box((0, 0), (200, 300)), [bt.to_numpy(codes), scale.numpy()])
    assert np.array_equal(whole, ref_dequantize(codes, scale))
    part = chain.assemble(box, [bt.to_numpy(codes)[130:190, 250:300], scale.numpy()[1:2, 1:3]])
    assert np.array_equal(part, whole[130:190, 250:300])
    bf = dequantized(IDENTITY, dtype="bfloat16").resolve("l.weight", 2, {"l.weight", "l.weight_scale_inv"})
    out = bf.chain([(200, 300), (2, 3)], ["float8_e4m3fn", "float32"]).assemble(
        Box((0, 0), (200, 300)), [bt.to_numpy(codes), scale.numpy()])
    assert torch.equal(torch.from_numpy(out.view(np.uint16)).view(torch.bfloat16),
                       torch.from_numpy(whole).to(torch.bfloat16))
    with pytest.raises(ValueError):
        m.inverse()  # no exact inverse: a save would quantize
    from bridges.interop import mapping_from_json, mapping_to_json
    doc = mapping_to_json(dequantized(IDENTITY, dtype="bfloat16"))
    assert mapping_from_json(json.loads(json.dumps(doc))) == dequantized(IDENTITY, dtype="bfloat16")
    with pytest.raises(ckptfmt.CheckpointError):  # a mapping file's block is checked against its caps
        mapping_from_json(json.loads(json.dumps(doc).replace('"Dequantize"', '"Dequantize", "block": [-1, 128]')))
    assert mapping_from_json(json.loads(json.dumps(doc).replace('"Dequantize"', '"Dequantize", "block": [1, 32]'))) \
        .rules[0].transforms[0] == Dequantize((1, 32), "bfloat16")  # control: a valid block
    with pytest.raises(MappingError):
        res.chain([(200, 300), (2, 3)], ["float32", "float32"])  # not float8 codes


def _qwen3() -> "transformers.PreTrainedModel":
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def test_export_fp8_loads_in_transformers(tmp_path):
    """A training checkpoint (a Qwen3 from a config, saved by bridges.torch) exported with
    quantize="fp8": every Linear weight of the layers as float8_e4m3fn codes with its
    weight_scale_inv, quantization_config in config.json, crc32c per block in each header.
    transformers' FineGrainedFP8 loader (dequantizing on CPU, into the config's dtype) gives exactly the
    reference dequantization of the file's codes and scales, and logits near the float32
    model's. Broken controls: a flipped scale byte is caught by the crc32c on import; the
    checkpoint's float32 weights are no restore target for the codes without Dequantize."""
    model = _qwen3()
    url, out = str(tmp_path / "repo"), tmp_path / "hf-fp8"
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bt.save(url, sd, step=1)
    rep = export(url, str(out), quantize="fp8", config=model.config.to_dict())
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128], q
    assert q["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"], q
    files = {}
    for f in rep.files:
        files.update(safetensors_torch.load_file(str(out / f)))
    quantized = sorted(k for k, v in files.items() if v.dtype == F8)
    assert len(quantized) == 2 * 7 and all(k + "_scale_inv" in files for k in quantized), quantized
    assert files["model.embed_tokens.weight"].dtype == torch.float32 and files["lm_head.weight"].dtype == torch.float32
    w = sd["model.layers.0.self_attn.k_proj.weight"].numpy()
    codes, scale = ref_quantize(w)
    assert np.array_equal(files["model.layers.0.self_attn.k_proj.weight_scale_inv"].numpy(), scale)
    assert torch.equal(files["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8),
                       torch.from_numpy(codes).to(F8).view(torch.uint8))

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    loaded = dict(hf.named_parameters())
    for k in quantized:
        want = torch.from_numpy(ref_dequantize(files[k], files[k + "_scale_inv"])).to(loaded[k].dtype)
        assert torch.equal(loaded[k].detach(), want), k
    # the same files back through ckptfmt: crc32c verified, dequantized by the rule
    back = bt.load(str(out), {k: torch.zeros(v.shape) for k, v in sd.items()}, mapping=dequantized(IDENTITY))
    k = "model.layers.1.mlp.down_proj.weight"
    assert np.array_equal(back[k].numpy(), ref_dequantize(files[k], files[k + "_scale_inv"]))
    ours = _qwen3()
    ours.load_state_dict(dict(back))
    ids = torch.arange(16).reshape(1, 16) % 256
    with torch.no_grad():
        ref, got, mine = model(ids).logits, hf(ids).logits.float(), ours(ids).logits
    assert torch.equal(got, mine)  # transformers' loader and ckptfmt's Dequantize agree bit for bit
    err = float((ref - got).abs().max())
    assert 0 < err < 0.1 * float(ref.abs().max()), err  # FP8 (3 mantissa bits) against float32
    print(f"FP8 export -> transformers: max |logit diff| {err:.3e} against the float32 model "
          f"(logits up to {float(ref.abs().max()):.2f}); 0 against ckptfmt's Dequantize")
    with pytest.raises(ckptfmt.CheckpointError) as e:  # 14 refusals in the restore's one error
        bt.load(str(out), {k: torch.zeros(v.shape) for k, v in sd.items()})
    assert [m["error"] for m in e.value.mismatches] == ["QuantizedWeightError"] * 14, e.value
    name = next(f for f in rep.files if "model.layers.0.self_attn.k_proj.weight_scale_inv"
                in safetensors_torch.load_file(str(out / f)))
    raw = bytearray((out / name).read_bytes())
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    begin = header["model.layers.0.self_attn.k_proj.weight_scale_inv"]["data_offsets"][0]
    raw[8 + int.from_bytes(raw[:8], "little") + begin] ^= 0x10
    (out / name).write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        bt.load(str(out), {k: torch.zeros(v.shape) for k, v in sd.items()}, mapping=dequantized(IDENTITY))


def test_a_stacked_preset_refuses_fp8_codes_and_a_per_layer_rule_dequantizes(tmp_path):
    """HF FP8 files into a scanned NNX target through hf_llama_from_nnx(...).inverse() (Stack
    rules): dequantized() leaves joined rules alone, so the codes are refused with
    QuantizedWeightError naming each companion, never stacked as raw codes. Control: a per-layer
    rule (no join) with dequantized() restores the dequantized weight transposed, bit for bit."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bridges.interop import strip_target_prefix
    from bridges.mapping import Transpose
    from bridges.presets import hf_llama_from_nnx
    from test_hf_presets import _nnx_llama_params
    from _torchtree import nest_tensors

    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    url, out = str(tmp_path / "repo"), tmp_path / "fp8"
    bt.save(url, {k: v.detach().clone() for k, v in hf.state_dict().items()}, step=1)
    export(url, str(out), quantize="fp8", config=hf.config.to_dict())
    m = strip_target_prefix(hf_llama_from_nnx(cfg, optimizer=None), "model/").inverse()
    target = nest_tensors({"model/" + k: np.zeros_like(v) for k, v in _nnx_llama_params(cfg, np.random.default_rng(0),
                                                                                        bias=False).items()})
    for mapping in (m, dequantized(m)):
        with pytest.raises(ckptfmt.CheckpointError) as e:
            bt.load(str(out), target, mapping=mapping)
        kinds = {d["error"] for d in getattr(e.value, "mismatches", [e.value.to_json()])}
        assert kinds == {"QuantizedWeightError"}, e.value
        assert "weight_scale_inv" in str(e.value)

    one = Mapping((Rule("model.layers.1.mlp.up_proj.weight", "up", transforms=(Transpose((1, 0)),)),))
    got = bt.load(str(out), {"up": torch.zeros(128, 256)}, mapping=dequantized(one), strict=False)["up"]
    f = safetensors_torch.load_file(str(out / "model-00001-of-00001.safetensors"))
    want = ref_dequantize(f["model.layers.1.mlp.up_proj.weight"], f["model.layers.1.mlp.up_proj.weight_scale_inv"])
    assert np.array_equal(got.numpy(), want.T)


def test_mxfp4_blocks_and_scales_are_refused_as_quantized(tmp_path):
    """gpt-oss's MXFP4 layout (X_blocks uint8, X_scales uint8 e8m0) stands for X: a target X is
    refused with QuantizedWeightError naming X_scales, not reported as a missing key. Control: a
    checkpoint with only X_blocks is a plain missing key."""
    (tmp_path / "mx").mkdir()
    (tmp_path / "half").mkdir()
    blocks = torch.randint(0, 255, (4, 8, 16), dtype=torch.uint8)
    scales = torch.full((4, 8), 127, dtype=torch.uint8)
    safetensors_torch.save_file({"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales},
                                str(tmp_path / "mx" / "model.safetensors"))
    safetensors_torch.save_file({"e.gate_up_proj_blocks": blocks}, str(tmp_path / "half" / "model.safetensors"))
    target = {"e.gate_up_proj": torch.zeros(4, 8, 32)}
    with pytest.raises(QuantizedWeightError) as e:
        bt.load(str(tmp_path / "mx"), target)
    assert e.value.key == "e.gate_up_proj" and e.value.object == "e.gate_up_proj_scales", e.value
    with pytest.raises(ckptfmt.errors.KeyMismatchError) as e:
        bt.load(str(tmp_path / "half"), target)
    assert not isinstance(e.value, QuantizedWeightError) and e.value.missing == ["e.gate_up_proj"]
