"""bridges.mapping's with_moments (a parameter rule -> its two Adam-moment rules) and compose (two
mappings in a row as one), issue 51: checked on real arrays through a real checkpoint, each with a
broken control."""
from __future__ import annotations

import numpy as np
import pytest

import ckptfmt
from bridges.mapping import (OPTAX_ADAM, TORCH_ADAM, TORCHTITAN_ADAM, Concat, InvalidRuleError, Mapping, Merge,
                             MomentLayout, Rule, Select, Stack, Transpose, Unmerge, compose, with_moments)


def test_with_moments_moves_the_keys_and_keeps_the_transforms():
    r = Rule("model/layers/q/kernel", "model/model.layers.{i}.q_proj.weight",
             transforms=(Select(0, "i", 2), Merge(1, (2, 4)), Transpose((1, 0))))
    p, mu, nu = with_moments(r, OPTAX_ADAM, TORCH_ADAM)
    assert p is r
    assert (mu.source, mu.target) == ("optimizer/opt_state/0/mu/layers/q/kernel",
                                      "optim/state/model.layers.{i}.q_proj.weight/exp_avg")
    assert (nu.source, nu.target) == ("optimizer/opt_state/0/nu/layers/q/kernel",
                                      "optim/state/model.layers.{i}.q_proj.weight/exp_avg_sq")
    assert mu.transforms == nu.transforms == r.transforms
    tt = Rule(("layers.{i}.w1.weight", "layers.{i}.w3.weight"), "model/gate_up.{i}", transforms=(Concat(0),))
    _, mu, _ = with_moments(tt, TORCHTITAN_ADAM, TORCH_ADAM)
    assert mu.source == ("optimizer/state.layers.{i}.w1.weight.exp_avg", "optimizer/state.layers.{i}.w3.weight.exp_avg")


def test_with_moments_refuses_a_key_outside_the_layouts_prefix():
    """Broken control: a parameter rule whose source is not under ``model/`` has no optax moment
    key; the error names the key and the prefix expected. A layout without {slot} is refused."""
    r = Rule("params/layers/q/kernel", "model/q.weight")
    with pytest.raises(InvalidRuleError, match="parameter prefix") as e:
        with_moments(r, OPTAX_ADAM, TORCH_ADAM)
    assert e.value.key == "params/layers/q/kernel" and "model/" in str(e.value.expected)
    with pytest.raises(InvalidRuleError, match="slot"):
        MomentLayout("model", "optim/state/{path}", ("a", "b"))


def _write(url: str, arrays: dict[str, np.ndarray]) -> None:
    ckptfmt.save(url, 1, [ckptfmt.LocalShard(k, a.shape, a.dtype, ckptfmt.Box.full(a.shape), a)
                          for k, a in arrays.items()])


def test_compose_restores_through_the_middle_layout(tmp_path):
    """Per-layer torch-style (out, in) weights -> (A -> B) transposed and renamed -> (B -> C)
    stacked: the composed mapping restores the stacked array straight from A, equal to what the
    two steps give by hand. Control: composing with the middle layout's names wrong leaves the
    rule unjoined and the restore reports the stacked key missing."""
    from bridges import torch as bt

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w = {f"blocks.{i}.fc.weight": rng.standard_normal((6, 4)).astype(np.float32) for i in range(3)}
    _write(str(tmp_path / "a"), w)
    a_to_b = Mapping((Rule("blocks.{i}.fc.weight", "mid/{i}/fc", transforms=(Transpose((1, 0)), Unmerge(1, (2, 3)))),),
                     target_sep="/")
    b_to_c = Mapping((Rule("mid/{i}/fc", "fc/kernel", transforms=(Stack(0, "i"),)),))
    m = compose(a_to_b, b_to_c)
    got = bt.load(str(tmp_path / "a"), {"fc": {"kernel": torch.zeros(3, 4, 2, 3)}}, mapping=m)
    want = np.stack([w[f"blocks.{i}.fc.weight"].T.reshape(4, 2, 3) for i in range(3)])
    assert np.array_equal(got["fc"]["kernel"].numpy(), want)
    wrong = Mapping((Rule("middle/{i}/fc", "fc/kernel", transforms=(Stack(0, "i"),)),))
    with pytest.raises(ckptfmt.CheckpointError, match="middle"):
        bt.load(str(tmp_path / "a"), {"fc": {"kernel": torch.zeros(3, 4, 2, 3)}}, mapping=compose(a_to_b, wrong))


def test_compose_refuses_what_it_cannot_join():
    """A permute table, separators that do not meet, and a Concat over keys of the middle layout
    are refused by name; the good case beside them composes."""
    good = Mapping((Rule("a", "b", transforms=(Transpose((1, 0)),)),))
    then = Mapping((Rule("b", "c", transforms=(Transpose((1, 0)),)),))
    assert compose(good, then).rules == (Rule("a", "c", transforms=(Transpose((1, 0)), Transpose((1, 0)))),)
    with pytest.raises(InvalidRuleError, match="permute"):
        compose(Mapping((Rule("a", "b", permute={2: (1, 0)}),)), good)
    with pytest.raises(InvalidRuleError, match="one layout"):
        compose(Mapping((Rule("a", "b"),), target_sep="."), good)
    with pytest.raises(InvalidRuleError, match="one source"):
        compose(good, Mapping((Rule(("b", "c"), "d", transforms=(Concat(0),)),)))
