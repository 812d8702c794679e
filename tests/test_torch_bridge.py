"""bridges.torch: save / load of tensors and DTensors, keys, shapes, state, faults, topology.

In-process tests use world 1 (no process group). The multiprocess tests fork real gloo ranks
(tests/torchproc): save at world 8 (1-D and 2-D meshes, Shard/Replicate, uneven and empty
shards, plain tensors, a sharded AdamW state), load at 4, 2 and 1 with other placements, bit for
bit; and the JAX -> torch acceptance run (Flax NNX on 8 JAX CPU devices -> 4 torch ranks).
"""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptfmt  # noqa: E402
from bridges import torch as bt  # noqa: E402
from bridges.mapping import flax_nnx_to_torch  # noqa: E402
from ckptfmt.errors import (CheckpointError, ChecksumMismatchError, InvalidStateError,  # noqa: E402
                            KeyMismatchError, ReferenceCycleError, SaveInProgressError, ShapeMismatchError,
                            TopologyChangedError)
from torchproc.launch import REPO, child_env, run_world  # noqa: E402


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"fc.weight": torch.randn(5, 3, generator=g), "fc.bias": torch.randn(5, generator=g).bfloat16(),
                  "emb.weight": torch.randn(4, 6, generator=g).t()},  # non-contiguous
        "f8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
        "flags": torch.tensor([True, False, True]),
        "ids": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4),
        "z": torch.complex(torch.randn(2, generator=g), torch.randn(2, generator=g)),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": ["fc.weight"]}],
        "count": 3,
    }


def _like(sd: dict) -> dict:
    return {k: _like(v) if isinstance(v, dict) else
            (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}


def _bits(t: torch.Tensor) -> bytes:
    return np.ascontiguousarray(bt.to_numpy(t)).tobytes()


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
            assert _bits(a[k]) == _bits(b[k]), k
        else:
            assert a[k] == b[k], k


def test_round_trip_dtypes_objects_and_state(tmp_path):
    sd = _state()
    url = str(tmp_path / "repo")
    torch.manual_seed(11)
    bt.save(url, sd, step=1, extra={"epoch": 2}, rank_state={"sampler": {"cursor": 17}})
    drawn = torch.rand(4)
    target = _like(sd)
    out = bt.load(url, target)
    want = dict(sd, groups=[{"lr": 0.1, "betas": [0.9, 0.99], "foreach": None, "params": ["fc.weight"]}])
    _assert_same(out, want)  # msgpack gives tuples back as lists
    assert out.step == 1 and out.extra == {"epoch": 2} and out.rank_state == {"sampler": {"cursor": 17}}
    assert bt.load_extra(url) == {"epoch": 2} and bt.load_rank_state(url) == {"sampler": {"cursor": 17}}
    assert out.missing_keys == [] and out.unexpected_keys == []
    bt.set_rng_state(out.rng)
    assert torch.equal(torch.rand(4), drawn)
    assert all(float(v.abs().sum()) == 0 for v in target["model"].values())  # target untouched


def test_size_zero_tensors_load_as_new_empty_tensors(tmp_path):
    """Issue 47 item 10, checked in the torch bridge: a tensor with a zero in its shape has no shards
    (FORMAT.md 5.7) and loads as a new empty tensor of the target's shape and dtype, never as the
    target's own tensor; the tensors beside it load as usual."""
    sd = {"a": torch.zeros(0), "b": torch.zeros(3, 0, 2, dtype=torch.bfloat16), "c": torch.zeros(0, 4, dtype=torch.int8),
          "d": torch.zeros(2, 0, dtype=torch.bool), "w": torch.arange(6.0)}
    url = str(tmp_path / "repo")
    bt.save(url, sd, step=1)
    assert sorted(ckptfmt.Repository(url).manifest(1).tensors) == ["a", "b", "c", "d", "w"]
    target = _like(sd)
    out = bt.load(url, target)
    _assert_same(out, sd)
    assert all(out[k] is not target[k] for k in sd) and out.missing_keys == [] and out.unexpected_keys == []
    assert torch.cat([out["c"], torch.ones(1, 4, dtype=torch.int8)]).shape == (1, 4)


def test_unknown_rank_policy_is_a_usage_error(tmp_path):
    url = str(tmp_path / "repo")
    bt.save(url, {"w": torch.ones(2)}, step=1, rank_state={"cursor": 3})
    with pytest.raises(ValueError, match="'drop', 'rank0', 'same-rank'"):
        bt.load(url, {"w": torch.zeros(2)}, rank_state_policy="bogus")
    # Refused before anything is opened: an empty repository would otherwise be StepNotFoundError.
    with pytest.raises(ValueError, match="unknown rank state policy"):
        bt.load(str(tmp_path / "empty"), {"w": torch.zeros(2)}, rank_state_policy="bogus")
    with pytest.raises(ValueError, match="unknown rank state policy"):
        bt.load_rank_state(str(tmp_path / "empty"), rank_state_policy="bogus")
    assert bt.load(url, {"w": torch.zeros(2)}, rank_state_policy="same-rank").rank_state == {"cursor": 3}  # control


def test_deprecated_keyword_names_warn_and_still_work(tmp_path):
    """rank_extra= / rank_policy= / Loaded.rank_extra stay one release (bridges/README.md)."""
    url = str(tmp_path / "repo")
    with pytest.warns(DeprecationWarning, match="rank_extra= is deprecated"):
        bt.save(url, {"w": torch.ones(2)}, step=1, rank_extra={"cursor": 3})
    with pytest.warns(DeprecationWarning, match="rank_policy= is deprecated"):
        out = bt.load(url, {"w": torch.zeros(2)}, rank_policy="same-rank")
    assert out.rank_state == {"cursor": 3}
    with pytest.warns(DeprecationWarning, match="Loaded.rank_extra is deprecated"):
        assert out.rank_extra == {"cursor": 3}
    with pytest.raises(TypeError, match="both rank_state= and its deprecated name rank_extra="):
        bt.save(url, {"w": torch.ones(2)}, step=2, rank_state={"a": 1}, rank_extra={"b": 2})
    assert ckptfmt.Repository(url).steps() == [1]


def test_malformed_objects_record_is_refused(tmp_path):
    # FORMAT.md 13.3: torch.objects must be a map; anything else is InvalidStateError, not an
    # AttributeError from the bridge. The control differs only in the record.
    x = np.ones(2, np.float32)
    shards = [ckptfmt.LocalShard("w", (2,), x.dtype, ckptfmt.Box.full((2,)), x)]
    for i, record in enumerate(([1], {"objects": [1]}, {"objects": None}, {})):
        url = str(tmp_path / f"bad{i}")
        ckptfmt.save(url, 1, shards, state={"torch": record, "extra": None})
        with pytest.raises(InvalidStateError, match="torch.objects must be a map"):
            bt.load(url, {"w": torch.zeros(2)})
    url = str(tmp_path / "good")
    ckptfmt.save(url, 1, shards, state={"torch": {"objects": {"n": 3}}, "extra": None})
    out = bt.load(url, {"w": torch.zeros(2), "n": 0})
    assert out["n"] == 3 and torch.equal(out["w"], torch.ones(2))


def test_missing_and_unexpected_keys(tmp_path):
    url = str(tmp_path / "repo")
    bt.save(url, {"w": torch.ones(2), "b": torch.ones(3)}, step=1)
    with pytest.raises(KeyMismatchError) as e:
        bt.load(url, {"w": torch.zeros(2), "extra": torch.zeros(1)})
    assert "extra" in str(e.value) and "'b'" in str(e.value)
    from bridges.mapping import KeptValuesWarning
    with pytest.warns(KeptValuesWarning, match="keep their initial values"):
        out = bt.load(url, {"w": torch.zeros(2), "extra": torch.full((1,), 7.0)}, strict=False)
    assert out.missing_keys == ["extra"] and out.unexpected_keys == ["b"]
    assert torch.equal(out["w"], torch.ones(2)) and torch.equal(out["extra"], torch.full((1,), 7.0))


def test_shape_mismatch_names_key_and_loads_nothing(tmp_path):
    url = str(tmp_path / "repo")
    bt.save(url, {"model": {"a.weight": torch.ones(4, 2), "b.weight": torch.ones(3)}}, step=1)
    target = {"model": {"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(5)}}
    with pytest.raises(ShapeMismatchError) as e:
        bt.load(url, target)
    assert e.value.key == "model/b.weight" and isinstance(e.value, CheckpointError)
    assert float(target["model"]["a.weight"].sum()) == 0
    # dtype: a cast within one kind (int32 -> int64) is done and reported; across kinds it is refused
    bt.save(url, {"n": torch.arange(3, dtype=torch.int32)}, step=2)
    out = bt.load(url, {"n": torch.zeros(3, dtype=torch.int64)}, step=2)
    assert out["n"].tolist() == [0, 1, 2] and out["n"].dtype == torch.int64 and out.report.cast == ("n: int32 -> int64",)
    with pytest.raises(ShapeMismatchError, match="across kinds"):
        bt.load(url, {"n": torch.zeros(3)}, step=2)
    bt.save(url, {"x": torch.ones(3)}, step=3)
    with pytest.raises(ShapeMismatchError):
        bt.load(url, {"x": torch.zeros(3, dtype=torch.int64)}, step=3)


def test_corrupt_byte_fails_closed(tmp_path):
    url = tmp_path / "repo"
    bt.save(str(url), {"w": torch.arange(64, dtype=torch.float32)}, step=1)
    target = {"w": torch.zeros(64)}
    assert torch.equal(bt.load(str(url), target)["w"], torch.arange(64, dtype=torch.float32))  # control
    shard = next(p for p in url.rglob("*") if p.is_file() and "/p/" in str(p))  # the one pack
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x40
    shard.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        bt.load(str(url), target)
    assert float(target["w"].sum()) == 0


def test_no_pickle_written_or_read(tmp_path, monkeypatch):
    url = tmp_path / "repo"
    bt.save(str(url), _state(), step=1)
    for p in url.rglob("*"):
        if p.is_file():
            head = p.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), p

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    bt.load(str(url), _like(_state()))


def test_async_save_snapshots_before_returning(tmp_path):
    url = str(tmp_path / "repo")
    w = torch.ones(1000)
    handle = bt.save(url, {"w": w}, step=1, blocking=False)
    assert isinstance(handle, ckptfmt.SaveHandle) and handle.snapshot_bytes == 4000
    w.mul_(3)  # training continues while the save runs
    assert handle.result(timeout=60).step == 1
    assert torch.equal(bt.load(url, {"w": torch.zeros(1000)})["w"], torch.ones(1000))


def test_unencodable_leaf_and_overlapping_async_saves(tmp_path):
    url = str(tmp_path / "repo")
    with pytest.raises(InvalidStateError) as e:
        bt.save(url, {"w": torch.ones(2), "opt": {"fn": object()}}, step=1)
    assert "opt/fn" in str(e.value)
    assert ckptfmt.Repository(url).steps() == []
    fut = bt.save(url, {"w": torch.ones(1 << 16)}, step=2, blocking=False)
    try:
        with pytest.raises(SaveInProgressError):
            bt.save(url, {"w": torch.ones(2)}, step=3)
    except pytest.fail.Exception:
        if not fut.done():
            raise  # the first save may legitimately have finished already
    fut.result(timeout=60)


@pytest.mark.parametrize("blocking", [True, False])
def test_meta_tensor_is_refused_by_key_path_before_writing(tmp_path, blocking):
    """Issue 47: a module built on the meta device (no data) made save raise an untyped
    NotImplementedError ("Cannot copy out of meta tensor"). Now InvalidStateError naming the key
    path and saying to materialize it, from save() itself (blocking or not), nothing written.
    Broken control: the same module after to_empty() and initialization saves and loads back."""
    with torch.device("meta"):
        net = torch.nn.Linear(4, 3)
    url = str(tmp_path / "repo")
    with pytest.raises(InvalidStateError, match="materialize") as e:
        bt.save(url, {"model": net.state_dict()}, step=1, blocking=blocking)
    assert e.value.key == "model/weight" and "to_empty" in str(e.value) and "meta" in str(e.value.found)
    assert not (tmp_path / "repo").exists() or ckptfmt.Repository(url).steps() == []
    net.to_empty(device="cpu")
    with torch.no_grad():
        net.weight.copy_(torch.arange(12.0).reshape(3, 4))
        net.bias.fill_(0.5)
    saved = bt.save(url, {"model": net.state_dict()}, step=1, blocking=blocking)
    if not blocking:
        saved.result(timeout=60)
    out = bt.load(url, {"model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}})
    assert torch.equal(out["model"]["weight"], net.weight.detach()) and torch.equal(out["model"]["bias"], net.bias.detach())


def test_mapping_writes_jax_layout_and_reads_back(tmp_path):
    """save(mapping=...) stores torch Linear weights as Flax kernels (transposed); load reverses it."""
    net = torch.nn.Sequential()
    net.add_module("fc", torch.nn.Linear(3, 5))
    net.add_module("emb", torch.nn.Embedding(7, 3))
    net.add_module("norm", torch.nn.LayerNorm(3))
    m = flax_nnx_to_torch(layers=bt.layer_kinds(net), optimizer=None)
    sd = {"model": dict(net.state_dict())}
    url = str(tmp_path / "repo")
    bt.save(url, sd, step=1, mapping=m)
    ckpt = ckptfmt.Repository(url).open()
    assert sorted(ckpt.keys()) == ["model/emb/embedding", "model/fc/bias", "model/fc/kernel",
                                   "model/norm/bias", "model/norm/scale"]
    assert np.array_equal(ckpt.read("model/fc/kernel"), sd["model"]["fc.weight"].numpy().T)
    out = bt.load(url, _like(sd), mapping=m)
    _assert_same(out, sd)
    with pytest.raises(ValueError, match="several mapping rules"):  # generic rules: ambiguous on write
        bt.save(url, sd, step=2, mapping=flax_nnx_to_torch(optimizer=None))


@pytest.mark.multiprocess
def test_save_world8_load_worlds_4_2_1(tmp_path):
    url = str(tmp_path / "repo")
    saved = run_world("save_world", 8, tmp_path, {"url": url})
    assert all(r["ok"] and r["rng_restored"] for r in saved)
    assert [r["rank_state"]["sampler"]["cursor"] for r in saved] == [100 + r for r in range(8)]
    for world in (4, 2):
        res = run_world("load_world", world, tmp_path, {"url": url})
        for r in res:
            assert all(r["ok"].values()), (world, r["ok"])
            assert r["placements_kept"] and r["untouched"] and r["train_ok"], (world, r)
            assert r["extra"] == {"epoch": 3} and r["rank_state"] is None and r["step"] == 7
            # The contract's default: per-rank state of 8 ranks has no owner on 4 or 2 (issue 14).
            assert r["without_policy"] == "TopologyChangedError" and "'same-rank'" in r["without_policy_message"], r
            t = r["transposed"]
            # the transposed Shard(0) target reads its own columns only: data + shard indexes
            assert t["ok"] and t["local_bytes"] <= t["bytes_read"] < t["local_bytes"] + 512, (world, t)
        # Rank 0's listing fails: every rank gets its StorageError at once (ckptfmt.agree_step), none
        # waits for the coordinator's 300 s timeout; the other ranks' copy names rank 0.
        assert all(r["listing"]["error"] == "StorageError" for r in res), [r["listing"] for r in res]
        assert all(r["listing"]["message"].startswith("rank 0: ") for r in res[1:]), res[1]["listing"]
    # world 1, plain tensors, in this process
    from torchproc.scenarios import BIG, TENSORS, global_value
    target = {"t": {k: torch.zeros(s, dtype=dt) for k, (s, dt) in TENSORS.items()}, "big": torch.zeros(BIG)}
    with pytest.raises(TopologyChangedError, match="'drop', 'rank0', 'same-rank'"):
        bt.load(url, target, strict=False)
    out = bt.load(url, target, strict=False, rank_state_policy="drop")
    for k, (s, dt) in TENSORS.items():
        assert _bits(out["t"][k]) == _bits(global_value(k, s, dt)), k
    assert sorted({k.split("/")[0] for k in out.unexpected_keys}) == ["net", "optim"]


@pytest.mark.multiprocess
def test_new_world_size_needs_no_policy_without_caller_rank_state(tmp_path):
    """Issue 26: a plain torch save from 4 ranks loads on 2 with no policy; the RNG states the
    bridge recorded come back only on the same world size or when a policy asks. Control: the same
    save with a rank_state still raises TopologyChangedError without a policy."""
    url = str(tmp_path / "repo")
    saved = run_world("plain_save", 4, tmp_path, {"url": url})
    assert all(r["rng_restored"] for r in saved), saved
    for r in run_world("plain_load", 2, tmp_path, {"url": url}):
        assert r["ok"] and not r["rng"] and r["rank_state"] is None and r["load_rank_state"] is None, r
        assert r["asked_rng"], r  # asked for: rank 0's RNG states
        assert r["step2"] == "TopologyChangedError" and r["step2_drop"] is None, r  # the control


@pytest.mark.multiprocess
def test_jax_to_torch_acceptance(tmp_path):
    """Flax NNX + optax adamw on 8 JAX devices -> 4 torch ranks -> one more step -> back to JAX."""
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    side = str(REPO / "tests" / "torchproc" / "jax_side.py")
    url, out_url = str(tmp_path / "jax_repo"), str(tmp_path / "torch_repo")
    subprocess.run([sys.executable, side, "train", url, str(tmp_path / "jax.npz")], env=env, check=True,
                   timeout=300, cwd=str(REPO))
    from torchproc.accept import STEP_ATOL
    (r, *_) = run_world("accept_load", 4, tmp_path, {"url": url, "jax_npz": str(tmp_path / "jax.npz"),
                                                    "out_url": out_url})
    assert r["forward_err"] < 1e-5, r
    assert r["broken_forward_err"] > 1e-3, r          # control: a missing transpose is caught
    assert r["bad_shape"] == ["ShapeMismatchError", "model/fc2.weight"] and r["unchanged_after_bad"]
    assert r["generic_mapping"]
    assert r["placements"]["fc1.weight"] == "(Shard(dim=0),)"
    assert max(r["step_errs"].values()) < STEP_ATOL, r["step_errs"]
    assert r["torch_step"] == 4.0
    # torch -> JAX: the stepped torch state restores through bridges.jax.restore, bit for bit.
    subprocess.run([sys.executable, side, "restore", out_url, "4", str(tmp_path / "back.npz")], env=env,
                   check=True, timeout=300, cwd=str(REPO))
    back = dict(np.load(tmp_path / "back.npz"))
    want = dict(np.load(tmp_path / "torch_after.npz"))
    assert bool(back.pop("ok_sharding"))
    assert len(back) == 21 and all(back[k].tobytes() == want[k].tobytes() for k in back)


def test_non_strict_load_reports_and_warns_strict_explains(tmp_path):
    """A rule that matches but whose source is absent: strict raises with the rule and the closest
    checkpoint key; non-strict returns the report and warns that target keys kept their values."""
    from bridges.mapping import KeptValuesWarning, Mapping, Rule, Select

    url = str(tmp_path / "repo")
    bt.save(url, {"p": {"layers": {"w": torch.arange(12.0).reshape(2, 6)}}, "other": torch.ones(1)}, step=1)
    m = Mapping((Rule("p/layers/wq", "layers.{i}.w", transforms=(Select(0, "i", 2),)),), source_sep="/", target_sep=".")
    target = {"layers.0.w": torch.zeros(6), "layers.1.w": torch.full((6,), 5.0)}
    with pytest.raises(KeyMismatchError) as e:
        bt.load(url, target, mapping=m)
    assert "lacks ['p/layers/wq']" in str(e.value) and "'p/layers/w'" in str(e.value)  # the closest key
    with pytest.warns(KeptValuesWarning, match="2 target keys keep their initial values"):
        out = bt.load(url, target, mapping=m, strict=False)
    assert out.report.missing == ("layers.0.w", "layers.1.w") and out.report.loaded == ()
    assert out.report.unexpected == ("other", "p/layers/w") and torch.equal(out["layers.1.w"], torch.full((6,), 5.0))
    good = Mapping((Rule("p/layers/w", "layers.{i}.w", transforms=(Select(0, "i", 2),)),), ignore=("other",),
                   source_sep="/", target_sep=".")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeptValuesWarning)  # control: nothing kept, no warning
        out = bt.load(url, target, mapping=good)
    assert out.report.loaded == ("layers.0.w", "layers.1.w") and torch.equal(out["layers.1.w"], torch.arange(6.0, 12.0))


def test_save_per_layer_keys_into_one_stacked_tensor(tmp_path):
    """torch layers.{i} keys are written as boxes of one stacked JAX tensor; all layers required."""
    from bridges.mapping import Mapping, Rule, Select, Transpose

    m = Mapping((Rule("jax/w", "t/layers.{i}.weight", transforms=(Select(0, "i"), Transpose((1, 0)))),),
                source_sep="/", target_sep=".")
    sd = {"t": {f"layers.{i}.weight": torch.randn(3, 5) for i in range(3)}}
    url = str(tmp_path / "repo")
    bt.save(url, sd, step=1, mapping=m)
    stacked = ckptfmt.Repository(url).open().read("jax/w")
    assert stacked.shape == (3, 5, 3)
    assert all(np.array_equal(stacked[i], sd["t"][f"layers.{i}.weight"].numpy().T) for i in range(3))
    out = bt.load(url, {"t": {k: torch.zeros(3, 5) for k in sd["t"]}}, mapping=m)
    _assert_same(out, sd)
    with pytest.raises(ValueError, match=r"indices \[0, 2\]"):  # control: a layer missing from the state
        bt.save(url, {"t": {k: v for k, v in sd["t"].items() if ".1." not in k}}, step=2, mapping=m)


def test_layer_kinds_knows_rmsnorm_classes_and_conv1d():
    class LlamaRMSNorm(torch.nn.Module):  # transformers' own is a plain Module with a 1-D weight
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

    class FakeRMSNorm(torch.nn.Module):  # control: a 2-D weight is not a norm scale
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))

    net = torch.nn.ModuleDict({"norm": LlamaRMSNorm(), "fake": FakeRMSNorm(), "bn": torch.nn.BatchNorm1d(4),
                               "fc": torch.nn.Linear(4, 4)})
    kinds = bt.layer_kinds(net)
    assert kinds == {"norm": "norm", "bn": "batchnorm", "fc": "linear"}
    tf = pytest.importorskip("transformers")
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8,
                                            bos_token_id=0, eos_token_id=0))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=16,
                                               num_attention_heads=2, vocab_size=16))
    assert bt.layer_kinds(gpt2)["transformer.h.0.attn.c_attn"] == "conv1d"
    assert bt.layer_kinds(gpt2)["transformer.h.0.ln_1"] == "norm"
    assert bt.layer_kinds(llama)["model.layers.0.input_layernorm"] == "norm"
    assert bt.layer_kinds(llama)["model.norm"] == "norm"


def test_state_dict_that_contains_itself_is_refused_before_writing(tmp_path):
    """A state dict, a non-tensor value or ``extra`` that contains itself: ReferenceCycleError
    naming where the cycle closes (was RecursionError), nothing written; the same process then
    saves a normal state dict, and one with a shared (acyclic) sub-dict."""
    url = str(tmp_path / "r")
    sd: dict = {"w": torch.ones(3)}
    sd["self"] = sd
    loop: list = [1]
    loop.append(loop)
    ex: dict = {"note": 1}
    ex["again"] = {"up": ex}
    cases = [(sd, {}, "self"), ({"w": torch.ones(3), "l": loop}, {}, "torch/objects/l/1"),
             ({"w": torch.ones(3)}, {"extra": ex}, "extra/again/up")]
    for state, kw, where in cases:
        with pytest.raises(ReferenceCycleError) as info:
            bt.save(url, state, step=1, save_rng=False, **kw)
        assert info.value.key == where and where in str(info.value)
        assert not (tmp_path / "r").exists()  # raised before anything was written
    sub = {"w": torch.arange(3.0)}
    bt.save(url, {"a": sub, "b": sub, "n": [1, 2]}, step=1, save_rng=False, extra={"p": [1], "q": [1]})
    back = bt.load(url, {"a": {"w": torch.zeros(3)}, "b": {"w": torch.zeros(3)}, "n": None})
    assert torch.equal(back["a"]["w"], sub["w"]) and torch.equal(back["b"]["w"], sub["w"]) and back["n"] == [1, 2]


def test_extra_takes_what_json_takes(tmp_path):
    """An HF config dict (id2label has int keys) is stored as json.loads(json.dumps(x)) would give it."""
    import json

    cfg = {"id2label": {0: "NEG", 1: "POS"}, "label2id": {"NEG": 0}, "rope": {"theta": 1e4, "scaling": None},
           "flags": (True, False), "odd": {True: 1, None: 2, 1.5: 3}}
    url = str(tmp_path / "repo")
    bt.save(url, {"w": torch.ones(1)}, step=1, extra=cfg, rank_state={"cursor": {7: 1}})
    out = bt.load(url, {"w": torch.zeros(1)})
    assert out.extra == json.loads(json.dumps(cfg)) and out.extra["id2label"] == {"0": "NEG", "1": "POS"}
    assert out.rank_state == {"cursor": {"7": 1}}
    with pytest.raises(InvalidStateError, match="both stored as '1'"):  # control: keys that collide
        bt.save(url, {"w": torch.ones(1)}, step=2, extra={1: "a", "1": "b"})
    with pytest.raises(InvalidStateError, match="tuple"):
        bt.save(url, {"w": torch.ones(1)}, step=2, extra={(1, 2): "a"})
    assert ckptfmt.Repository(url).steps() == [1]


@pytest.mark.multiprocess
def test_fsdp2_with_tensor_parallel_saves_and_restores_on_other_meshes(tmp_path):
    """Issue 26: FSDP2 (fully_shard) over TP (parallelize_module) on a (2, 2) mesh of 4 gloo ranks
    produces _StridedShard placements; they are saved box-exact and restored bit for bit on 2
    ranks (Shard(0)), on 1 (plain tensors), on a (1, 4) FSDP2 + TP mesh, and into JAX on a (2, 4)
    CPU mesh, every device's shard checked against its box (control: a box shifted by one row)."""
    url = str(tmp_path / "repo")
    saved = run_world("fsdp_tp_save", 4, tmp_path, {"url": url})
    assert any("_StridedShard" in p for p in saved[0]["placements"]), saved[0]  # really strided
    for world, args in ((2, {"layout": "shard0"}), (1, {"layout": "plain"}),
                        (4, {"layout": "fsdp_tp", "mesh": [1, 4]})):
        for r in run_world("fsdp_tp_load", world, tmp_path / f"w{world}",
                           dict(args, url=url, expect=str(tmp_path / "fsdp_tp.npz"))):
            assert r["ok"] and all(r["ok"].values()), (world, r)
    pytest.importorskip("jax")
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(REPO / "tests" / "torchproc" / "jax_side.py"), "fsdp_tp", url,
                    str(tmp_path / "fsdp_tp.npz"), str(tmp_path / "jax.json")], env=env, check=True, timeout=300,
                   cwd=str(REPO))
    import json
    j = json.loads((tmp_path / "jax.json").read_text())
    assert j["keys"] and all(j["exact"].values()) and len(j["exact"]) == 12 and j["devices"] == [8], j
    assert not j["control"], j  # the check sees a misplaced box
    assert j["asked_rank_state"] == "TopologyChangedError", j  # control: a caller's rank_state still needs a policy


@pytest.mark.multiprocess
def test_cooperative_load_reads_each_replicated_box_once(tmp_path):
    """2 gloo ranks load DTensors replicated over both (FORMAT.md 9.1): the cooperative load
    (``cooperative=True``; on gloo the default is off, and reads everything) is exact and each rank reads within 10% of half the replicated bytes, as does a
    plain-tensor load with cooperative=True; the control, cooperative=False, reads them all on
    each rank. A flipped byte in a shard only rank 1 read makes BOTH raise ChecksumMismatchError
    for that tensor (rank 0's copy names rank 1); the intact loads above are the control."""
    r0, r1 = run_world("coop:load", 2, tmp_path)
    full = r0["replicated_bytes"]
    for r in (r0, r1):
        for name in ("coop", "plain"):
            assert r[name]["exact"] and r[name]["coop"]["cooperative"], (name, r)
            assert abs(r[name]["bytes_read"] - full / 2) <= 0.1 * full / 2, (name, r[name])
        assert r["independent"]["exact"] and not r["independent"]["coop"]["cooperative"], r
        assert r["independent"]["bytes_read"] >= full, r["independent"]
        assert r["default"]["exact"] and not r["default"]["coop"]["cooperative"], r
        assert r["default"]["bytes_read"] >= full, r["default"]
    assert r0["corrupt"] is not None and r1["corrupt"] is not None, (r0, r1)
    assert r0["corrupt"]["error"] == r1["corrupt"]["error"] == "ChecksumMismatchError", (r0, r1)
    assert r0["corrupt"]["key"] == r1["corrupt"]["key"] == r1["flipped"]
    assert r0["corrupt"]["message"].startswith("rank 1: "), r0["corrupt"]


@pytest.mark.multiprocess
def test_a_rank_lost_in_a_cooperative_round_is_a_typed_error_on_the_others(tmp_path):
    """Two gloo ranks read the same boxes cooperatively; rank 1 dies (os._exit) at the first data
    round's all-gather. Rank 0 gets CoordinatorLostError naming the round, within seconds, where
    gloo's own error was an untyped RuntimeError (issue 47 item 7). Control: the same read with no
    death is exact on both ranks."""
    ok = run_world("coop:dead_peer", 2, tmp_path / "ok", {"die": False})
    assert all(r["error"] is None and r["exact"] for r in ok), ok
    r0, r1 = run_world("coop:dead_peer", 2, tmp_path / "dead", {"die": True}, check=False)
    assert r1 is None and r0 is not None, (r0, r1)  # rank 1 died before writing a result
    assert r0["error"] == "CoordinatorLostError" and r0["typed"] and r0["object"] == "restore/coop/0", r0
    assert r0["seconds"] < 60, r0
