"""Hugging Face -> JAX for fused layouts inside scanned layers (issue 51, item 4): a JAX model
whose q/k/v (and gate/up) kernels are one fused tensor stacked over the layers maps to HF's
per-layer tensors by ``Select`` + ``Part`` rules; the mapping's ``inverse()`` now joins those
Parts into one rule, ``Concat`` then ``Stack`` (a :class:`ConcatStacks` join), so a
``save_pretrained``-style directory restores into the fused, stacked layout directly: on 2
``jax.distributed`` processes, each reads only the bytes of its own shards.

Broken controls: a Concat followed by a Stack without the Concat's sizes, and Parts that do not
cover their source, are refused by name; the good rules beside them are accepted.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridges.mapping import Concat, InvalidRuleError, Mapping, Part, Rule, Select, Stack, Transpose  # noqa: E402

DIMS = dict(L=3, d=8, q=16, kv=8, F=12)


def fused_mapping(parts: tuple[str, ...] = ("q", "k", "v")) -> Mapping:
    """A JAX layout with fused, stacked kernels -> HF's per-layer tensors (Select, Part, Transpose)."""
    L, q, kv, F = DIMS["L"], DIMS["q"], DIMS["kv"], DIMS["F"]
    sizes = dict(zip(("q", "k", "v"), (q, kv, kv)))
    qkv = tuple(sizes[p] for p in parts)
    rules = [Rule("layers/attn/qkv/kernel", f"model.layers.{{i}}.self_attn.{n}_proj.weight",
                  transforms=(Select(0, "i", L), Part(1, k, qkv), Transpose((1, 0)))) for k, n in enumerate(parts)]
    rules += [Rule("layers/mlp/wi/kernel", f"model.layers.{{i}}.mlp.{n}_proj.weight",
                   transforms=(Select(0, "i", L), Part(1, k, (F, F)), Transpose((1, 0))))
              for k, n in enumerate(("gate", "up"))]
    return Mapping(tuple(rules), source_sep="/", target_sep=".")


def _hf(rng: np.random.Generator) -> dict[str, np.ndarray]:
    L, d, q, kv, F = (DIMS[k] for k in ("L", "d", "q", "kv", "F"))
    out = {}
    for i in range(L):
        for n, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"model.layers.{i}.self_attn.{n}_proj.weight"] = rng.standard_normal((rows, d)).astype(np.float32)
        for n in ("gate", "up"):
            out[f"model.layers.{i}.mlp.{n}_proj.weight"] = rng.standard_normal((F, d)).astype(np.float32)
    return out


def test_the_inverse_joins_the_parts_into_one_concat_and_stack():
    inv = fused_mapping().inverse()
    assert len(inv.rules) == 2
    qkv = inv.rules[0]
    assert qkv.sources == tuple(f"model.layers.{{i}}.self_attn.{n}_proj.weight" for n in "qkv")
    assert qkv.transforms == (Transpose((1, 0)), Concat(1, (16, 8, 8)), Stack(0, "i", 3))
    assert inv.inverse().rules == fused_mapping().rules  # and back: one Part rule per HF tensor


def test_what_cannot_invert_is_refused_by_name():
    """Broken controls: Parts that do not cover their source (k and v only), and a hand-written
    Concat + Stack without sizes. Controls: the full set, and the rule with sizes."""
    with pytest.raises(ValueError, match="parts \\[0, 1\\] of 3") as e:
        Mapping((fused_mapping().rules[0], fused_mapping().rules[1])).inverse()
    assert "layers/attn/qkv/kernel" in str(e.value)
    with pytest.raises(InvalidRuleError, match="needs its sizes"):
        Rule(("a.{i}.q", "a.{i}.k"), "qk", transforms=(Concat(1), Stack(0, "i")))
    Rule(("a.{i}.q", "a.{i}.k"), "qk", transforms=(Concat(1, (2, 2)), Stack(0, "i")))
    with pytest.raises(InvalidRuleError, match="2 parts for 3 sources"):
        Rule(("a.{i}.q", "a.{i}.k", "a.{i}.v"), "qkv", transforms=(Concat(1, (2, 2)), Stack(0, "i")))


def test_torch_load_of_per_layer_tensors_into_the_fused_stacked_layout(tmp_path):
    torch = pytest.importorskip("torch")
    from bridges import torch as bt

    hf = _hf(np.random.default_rng(0))
    bt.save(str(tmp_path / "hf"), {k: torch.tensor(v) for k, v in hf.items()}, step=1)
    L, d, q, kv, F = (DIMS[k] for k in ("L", "d", "q", "kv", "F"))
    got = bt.load(str(tmp_path / "hf"), {"layers": {"attn": {"qkv": {"kernel": torch.zeros(L, d, q + 2 * kv)}},
                                                     "mlp": {"wi": {"kernel": torch.zeros(L, d, 2 * F)}}}},
                  mapping=fused_mapping().inverse())
    want = np.stack([np.concatenate([hf[f"model.layers.{i}.self_attn.{n}_proj.weight"].T for n in "qkv"], 1)
                     for i in range(L)])
    assert np.array_equal(got["layers"]["attn"]["qkv"]["kernel"].numpy(), want)
    # control: a rule with two parts in the wrong order (k and v swapped) restores another tensor
    swapped = fused_mapping(("q", "v", "k")).inverse()
    bad = bt.load(str(tmp_path / "hf"), {"layers": {"attn": {"qkv": {"kernel": torch.zeros(L, d, q + 2 * kv)}},
                                                     "mlp": {"wi": {"kernel": torch.zeros(L, d, 2 * F)}}}},
                  mapping=swapped)
    assert not np.array_equal(bad["layers"]["attn"]["qkv"]["kernel"].numpy(), want)


@pytest.mark.multiprocess
def test_two_jax_processes_restore_a_hf_directory_each_reading_its_own_bytes(tmp_path):
    """The fused axis sharded over the 4 devices of 2 processes (process 0 holds q, process 1 k
    and v; each half of every layer's gate|up): every shard is exact, and each process reads the
    file's header and then exactly the bytes of its own shards, nothing of the other's."""
    pytest.importorskip("jax")
    from safetensors.numpy import save_file

    from ckptfmt.coord import free_port
    from torchproc.launch import child_env

    (tmp_path / "hf").mkdir()
    save_file(_hf(np.random.default_rng(1)), str(tmp_path / "hf" / "model.safetensors"))
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:  # the length field and the JSON header
        header = 8 + int.from_bytes(f.read(8), "little")
    port = free_port()
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    script = str(Path(__file__).parent / "torchproc" / "fused_jax_side.py")
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / "hf"), str(tmp_path / f"out{p}.json"), str(p),
                               str(port)], env=env) for p in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    res = [json.loads((tmp_path / f"out{p}.json").read_text()) for p in range(2)]
    print("fused HF -> JAX, 2 processes:", res)
    for r in res:
        assert r["exact"]
        assert r["share"] == r["total"] // 2
        assert r["bytes_read"] - header == r["share"]  # the header, then exactly its own bytes
