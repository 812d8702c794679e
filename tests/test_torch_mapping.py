"""bridges.mapping: rules, inverse, and the box arithmetic of layout transforms (no processes)."""
from __future__ import annotations


import numpy as np
import pytest

from bridges.mapping import (CONV_KERNEL_AXES, IDENTITY, Mapping, Rule, flax_nnx_to_torch,
                             torch_adamw_kwargs, torch_to_flax_nnx)

FLAX_KEYS = {
    "model/fc1/kernel", "model/fc1/bias", "model/norm/scale", "model/norm/bias",
    "model/embed/embedding", "model/blocks/0/conv/kernel",
    "optimizer/opt_state/0/count", "optimizer/opt_state/0/mu/fc1/kernel",
    "optimizer/opt_state/0/nu/fc1/kernel", "optimizer/opt_state/0/mu/norm/scale",
    "optimizer/step",
}


def test_identity_maps_equal_keys():
    r = IDENTITY.resolve("w", 2, {"w"})
    assert (r.source_key, r.axes) == ("w", None)


@pytest.mark.parametrize("target,ndim,source,axes", [
    ("model/fc1.weight", 2, "model/fc1/kernel", (1, 0)),
    ("model/fc1.bias", 1, "model/fc1/bias", None),
    ("model/norm.weight", 1, "model/norm/scale", None),
    ("model/embed.weight", 2, "model/embed/embedding", None),
    ("model/blocks.0.conv.weight", 4, "model/blocks/0/conv/kernel", (3, 2, 0, 1)),
    ("optim/state/fc1.weight/exp_avg", 2, "optimizer/opt_state/0/mu/fc1/kernel", (1, 0)),
    ("optim/state/fc1.weight/exp_avg_sq", 2, "optimizer/opt_state/0/nu/fc1/kernel", (1, 0)),
    ("optim/state/norm.weight/exp_avg", 1, "optimizer/opt_state/0/mu/norm/scale", None),
    ("optim/state/fc1.weight/step", 0, "optimizer/opt_state/0/count", None),
])
def test_flax_nnx_to_torch_resolves(target, ndim, source, axes):
    r = flax_nnx_to_torch().resolve(target, ndim, FLAX_KEYS)
    assert (r.source_key, r.axes) == (source, axes)


def test_missing_source_reports_first_candidate_and_ignore_keep():
    m = flax_nnx_to_torch()
    assert m.resolve("model/fc9.weight", 2, FLAX_KEYS).source_key == "model/fc9/kernel"
    assert m.is_ignored("optimizer/step") and not m.is_ignored("model/fc1/kernel")
    assert m.is_kept("optim/param_groups")


def test_inverse_round_trips_keys_and_axes():
    m = flax_nnx_to_torch()
    inv = torch_to_flax_nnx()
    torch_keys = {"model/fc1.weight", "optim/state/fc1.weight/step", "optim/state/fc1.bias/step",
                  "model/blocks.0.conv.weight"}
    r = inv.resolve("model/fc1/kernel", 2, torch_keys)
    assert (r.source_key, r.axes) == ("model/fc1.weight", (1, 0))
    # Many torch steps -> one optax count: the reverse picks the first key in sorted order.
    assert inv.resolve("optimizer/opt_state/0/count", 0, torch_keys).source_key == "optim/state/fc1.bias/step"
    fwd = m.resolve("model/blocks.0.conv.weight", 4, FLAX_KEYS).axes
    back = inv.resolve("model/blocks/0/conv/kernel", 4, torch_keys).axes
    a = np.arange(2 * 3 * 5 * 7).reshape(2, 3, 5, 7)
    assert np.array_equal(a.transpose(fwd).transpose(back), a)


@pytest.mark.parametrize("ndim", [3, 4, 5])
def test_conv_axes_are_hwio_to_oihw(ndim):
    axes = CONV_KERNEL_AXES[ndim]
    src_shape = tuple(range(2, 2 + ndim))  # (spatial..., I, O)
    out = tuple(src_shape[a] for a in axes)
    assert out[:2] == (src_shape[-1], src_shape[-2]) and out[2:] == src_shape[:-2]


def test_source_box_reads_exactly_the_target_box():
    """Every target box, mapped to source coordinates and permuted back, equals the target slice."""
    rng = np.random.default_rng(0)
    src = rng.standard_normal((3, 4, 5, 6))
    r = flax_nnx_to_torch().resolve("model/blocks.0.conv.weight", 4, FLAX_KEYS)
    tgt = src.transpose(r.axes)
    assert r.source_shape(tgt.shape) == src.shape and r.target_shape(src.shape) == tgt.shape
    for _ in range(50):
        off = tuple(int(rng.integers(0, n)) for n in tgt.shape)
        shp = tuple(int(rng.integers(0, n - o + 1)) for o, n in zip(off, tgt.shape))
        so, ss = r.source_box(off, shp)
        block = src[tuple(slice(o, o + s) for o, s in zip(so, ss))]
        want = tgt[tuple(slice(o, o + s) for o, s in zip(off, shp))]
        assert np.array_equal(r.to_target(block), want)


def test_rule_placeholders_and_separators():
    m = Mapping((Rule("params/{m}/w", "{m}.weight", {2: (1, 0)}),), source_sep="/", target_sep=".")
    r = m.resolve("enc.layers.3.weight", 2, None)
    assert r.source_key == "params/enc/layers/3/w"
    assert m.resolve("enc.layers.3.weight", 3, None).source_key == "enc.layers.3.weight"  # ndim not in table
    with pytest.raises(ValueError):
        Rule("a", "b", {2: (0, 0)})


def test_adamw_hyperparameters():
    kw = torch_adamw_kwargs(learning_rate=1e-3, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1)
    assert kw == {"lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    for bad in ({"eps_root": 1e-8}, {"mask": lambda p: p}, {"nesterov": True}):
        with pytest.raises(ValueError):
            torch_adamw_kwargs(learning_rate=1e-3, **bad)


def test_adamw_update_rule_matches_optax_formula():
    """One torch.optim.AdamW step equals optax adamw's formula (checked in numpy, no JAX)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(7).astype(np.float64)
    g = rng.standard_normal(7)
    mu, nu, count = rng.standard_normal(7) * 0.1, rng.random(7) * 0.1, 3
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.05
    # optax.adamw: scale_by_adam -> add_decayed_weights -> scale_by_learning_rate
    mu1, nu1, c1 = b1 * mu + (1 - b1) * g, b2 * nu + (1 - b2) * g * g, count + 1
    u = (mu1 / (1 - b1 ** c1)) / (np.sqrt(nu1 / (1 - b2 ** c1)) + eps) + wd * p0
    want = p0 - lr * u
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = torch.optim.AdamW([p], **torch_adamw_kwargs(learning_rate=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd))
    p.grad = torch.tensor(g)
    opt.step()  # creates state; overwrite it with the carried-over moments and redo the step
    opt.state[p].update(exp_avg=torch.tensor(mu), exp_avg_sq=torch.tensor(nu),
                        step=torch.tensor(float(count)))
    with torch.no_grad():
        p.copy_(torch.tensor(p0))
    opt.step()
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, atol=1e-14)
