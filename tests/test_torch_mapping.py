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


# ------------------------------------------------------------------ transforms (global coordinates)

from ckptfmt import Box  # noqa: E402
from bridges.mapping import (Cast, Chain, Concat, MappingError, Merge, Part, Reorder, Scale, Select, Shift,  # noqa: E402
                             Stack, Transpose, Unmerge, interleaved_to_halves)

L, D, H, HD = 3, 6, 4, 4
CHAINS = {
    "select0-merge-transpose (q kernel)": ((Select(0, 1), Merge(1, (H, HD)), Transpose((1, 0))), [(L, D, H, HD)]),
    "select1-reorder-merge-scale (MaxText query)": (
        (Select(1, 2), Reorder(2, interleaved_to_halves(HD)), Merge(1, (H, HD)), Transpose((1, 0)), Scale(0.5)),
        [(D, L, H, HD)]),
    "merge-first (o kernel)": ((Select(0, 0), Merge(0, (H, HD)), Transpose((1, 0))), [(L, H, HD, D)]),
    "concat (fused qkv)": ((Select(0, 2), Concat(1, (5, 5, 5))), [(L, D, 5)] * 3),
    "unmerge (torch -> JAX heads)": ((Transpose((1, 0)), Unmerge(1, (H, HD))), [(H * HD, D)]),
    "unmerge 3 axes": ((Unmerge(0, (3, 4, 5)),), [(60, 2)]),
    "part (fused -> q)": ((Part(1, 1, 3),), [(4, 9)]),
    "stack (layers.{i} -> stacked)": ((Transpose((1, 0)), Unmerge(1, (H, HD)), Stack(0, "i")), [(H * HD, D)] * L),
}


def _random_box(rng, shape):
    off = tuple(int(rng.integers(0, n)) for n in shape)
    return Box(off, tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(off, shape)))


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_transform_boxes_read_assemble_and_write_exactly(name):
    """For random target boxes: the reads assemble exactly that block of the whole-tensor result,
    and a save's pieces tile exactly the box's preimage with the source values (the inverse)."""
    ops, shapes = CHAINS[name]
    rng = np.random.default_rng(0)
    srcs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    keys = [f"s{i}" for i in range(len(srcs))]
    ch = Chain.from_sources("t", keys, ops, shapes, [np.float32] * len(shapes))
    full = Box.full(ch.target_shape)
    whole = ch.assemble(full, [srcs[keys.index(k)][b.slices()] for k, b in ch.reads(full)])
    for _ in range(100):
        box = _random_box(rng, ch.target_shape)
        reads = ch.reads(box)
        got = ch.assemble(box, [srcs[keys.index(k)][b.slices()] for k, b in reads])
        assert np.array_equal(got, whole[box.slices()]), box
        cover = [np.zeros(s, np.int64) for s in shapes]
        for k, b, x in ch.writes(box, whole[box.slices()]):
            assert np.array_equal(x, srcs[keys.index(k)][b.slices()]), (box, b)
            cover[keys.index(k)][b.slices()] += 1
        assert max(c.max() for c in cover) == 1 and sum(int(c.sum()) for c in cover) == box.size
    # broken control: a read one row off does not give the block
    box = Box((1,) + (0,) * (len(ch.target_shape) - 1), (1,) + ch.target_shape[1:])
    k, b = ch.reads(box)[0]
    shifted = Box(tuple((o + 1) % n for o, n in zip(b.offset, srcs[keys.index(k)].shape)), b.shape)
    if all(o + s <= n for o, s, n in zip(shifted.offset, shifted.shape, srcs[keys.index(k)].shape)):
        blocks = [srcs[keys.index(kk)][(shifted if i == 0 else bb).slices()] for i, (kk, bb) in enumerate(ch.reads(box))]
        assert not np.array_equal(ch.assemble(box, blocks), whole[box.slices()])


def test_merge_box_on_and_off_head_boundaries():
    """(heads*head_dim) rows on whole heads -> one exact source box; half a head -> only its part;
    a range across a head boundary -> the smallest covering box (both heads, whole)."""
    ch = Chain.from_sources("t", ["k"], (Merge(1, (4, 16)), Transpose((1, 0))), [(8, 4, 16)], [np.float32])
    assert ch.reads(Box((16, 0), (32, 8))) == [("k", Box((0, 1, 0), (8, 2, 16)))]  # heads 1, 2 exactly
    assert ch.reads(Box((24, 0), (8, 8))) == [("k", Box((0, 1, 8), (8, 1, 8)))]    # second half of head 1
    assert ch.reads(Box((8, 0), (16, 8))) == [("k", Box((0, 0, 0), (8, 2, 16)))]   # covering: heads 0-1
    # a save of the off-boundary block is split into exact boxes (tail of head 0, head of head 1)
    pieces = ch.writes(Box((8, 0), (16, 8)), np.zeros((16, 8), np.float32))
    assert [b for _, b, _ in pieces] == [Box((0, 0, 8), (8, 1, 8)), Box((0, 1, 0), (8, 1, 8))]


def test_stacked_index_is_carried_into_the_target_key():
    m = Mapping((Rule("p/layers/w", "layers.{i}.w", transforms=(Select(0, "i", 2),)),), source_sep="/", target_sep=".")
    r = m.resolve("layers.1.w", 2, {"p/layers/w"})
    assert r.source_keys == ("p/layers/w",) and r.transforms == (Select(0, 1, 2),)
    assert m.resolve("layers.x.w", 2, {"p/layers/w"}).rule is None  # an index matches digits only
    ch = r.chain([(2, 3, 5)], [np.float32])
    assert ch.target_shape == (3, 5) and ch.reads(Box((0, 0), (3, 5))) == [("p/layers/w", Box((1, 0, 0), (1, 3, 5)))]
    with pytest.raises(MappingError, match="out of range"):  # control: layer 5 of 2
        m.resolve("layers.5.w", 2, {"p/layers/w"}).chain([(2, 3, 5)], [np.float32])
    # the inverse reads the key family layers.0, layers.1 into one stacked tensor
    inv = m.inverse().resolve("p/layers/w", 3, {"layers.0.w", "layers.1.w"})
    assert inv.source_keys == ("layers.0.w", "layers.1.w") and isinstance(inv.transforms[0], Stack)
    gap = m.inverse().resolve("p/layers/w", 3, {"layers.0.w", "layers.2.w"})
    assert "layers.1.w" in gap.source_keys and any("lacks ['layers.1.w']" in n for n in gap.notes)


def test_rule_that_matches_but_does_not_apply_says_which_and_why():
    m = Mapping((Rule("ckpt/q", "q.weight", transforms=(Select(0, 0), Merge(1, (4, 16)), Transpose((1, 0)))),),
                source_sep="/", target_sep=".")
    r = m.resolve("q.weight", 2, {"ckpt/q"})
    with pytest.raises(MappingError) as e:
        r.chain([(2, 64, 8, 8)], [np.float32])  # heads 8 x 8, the rule says 4 x 16
    msg = str(e.value)
    assert "'ckpt/q' -> 'q.weight'" in msg and "transform 1 Merge" in msg and "(4, 16)" in msg and e.value.key == "q.weight"
    assert r.chain([(2, 64, 4, 16)], [np.float32]).target_shape == (64, 64)  # control
    with pytest.raises(MappingError, match="needs at least 2 dimensions|at least"):
        r.chain([(64,)], [np.float32])
    # an old-style permute table without the tensor's ndim: the rule is skipped, and says so
    p = Mapping((Rule("a/k", "k", {2: (1, 0)}),), source_sep="/", target_sep=".")
    res = p.resolve("k", 4, {"a/k"})
    assert res.rule is None and "permute table has no entry for 4 dims" in res.notes[0]


def test_inverse_of_concat_and_select_chains():
    fwd = Rule(("q", "k", "v"), "h.{i}.c_attn", transforms=(Select(0, "i", 2), Concat(1, (4, 4, 4))))
    inv = fwd.inverses()
    assert [r.target for r in inv] == ["q", "k", "v"] and all(r.source == "h.{i}.c_attn" for r in inv)
    assert [type(op).__name__ for op in inv[1].transforms] == ["Part", "Stack"]
    with pytest.raises(ValueError, match="inverts to 3 rules"):
        fwd.inverse()
    one = Rule("q", "l.{i}.w", transforms=(Select(0, "i", 2), Merge(1, (2, 3)), Transpose((1, 0))))
    assert one.inverse().inverse() == one
    with pytest.raises(ValueError, match="fixed index"):
        Rule("q", "w", transforms=(Select(0, 1),)).inverse()


def test_scale_and_cast_inverses_are_exact_or_refused():
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    box = Box((0,), (256,))
    exact = Chain.from_target("t", ["s"], (Scale(0.25),), (256,), np.float32)
    assert np.array_equal(exact.writes(box, x)[0][2] * np.float32(0.25), x)
    inexact = Chain.from_target("t", ["s"], (Scale(3.0),), (256,), np.float32)
    with pytest.raises(MappingError, match="not exactly invertible"):
        inexact.writes(box, x)
    declared = Chain.from_target("t", ["s"], (Scale(3.0, allow_inexact_inverse=True),), (256,), np.float32)
    assert declared.writes(box, x)[0][2].dtype == np.float32
    cast = Chain.from_target("t", ["s"], (Cast("float32", source_dtype="bfloat16"),), (256,), np.float32)
    with pytest.raises(MappingError, match="loses information"):
        cast.writes(box, x)
    assert cast.writes(box, x.astype("bfloat16").astype(np.float32))[0][2].dtype.name == "bfloat16"  # control


def test_shift_inverse_is_checked():
    """Shift(-1) (MaxText's plus-one Gemma norms -> HF's): a load adds the offset; a save
    subtracts it back and is refused when a value would not come back bit for bit (values near
    0 lose low bits in x + 1), unless declared; values of a plus-one norm (in [0.5, 2]) pass."""
    box = Box((0,), (4,))
    chain = Chain.from_target("t", ["s"], (Shift(-1.0),), (4,), np.float32)
    assert np.array_equal(chain.assemble(box, [np.array([1.5, 0.75, 2.0, 1.0], np.float32)]), [0.5, -0.25, 1.0, 0.0])
    hf = np.array([0.5, -0.25, 1.0, 0.0], np.float32)
    assert np.array_equal(chain.writes(box, hf)[0][2], [1.5, 0.75, 2.0, 1.0])  # exact: back bit for bit
    tiny = np.array([1e-8, 0.5, 0.1, 3e-7], np.float32)                          # 1 + 1e-8 rounds to 1
    with pytest.raises(MappingError, match="not exactly invertible"):
        chain.writes(box, tiny)
    declared = Chain.from_target("t", ["s"], (Shift(-1.0, allow_inexact_inverse=True),), (4,), np.float32)
    assert declared.writes(box, tiny)[0][2][0] == np.float32(1.0)
    assert Shift(-1.0).inverse() == Shift(1.0)
