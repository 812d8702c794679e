"""bridges.mapping: several stacked axes in one rule (layers x experts), in global coordinates.

The forward rule of a per-expert published MoE (two Selects: layer ``{i}``, expert ``{j}``) and
its inverse (two adjacent Stacks, one join) read, assemble and write every box exactly; the
key family is enumerated from the checkpoint's keys; rules that still cannot compose are refused
with a typed error (no processes; the end-to-end Mixtral restore is in test_interop_moe.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from ckptfmt import Box, CheckpointError
from bridges.mapping import InvalidRuleError, Mapping, Rule, Select, Stack, Transpose

L, E, D, F = 3, 4, 5, 6
KEY = "layers.{i}.experts.{j}.w1.weight"


def _per_expert(w: np.ndarray, order=lambda j: j) -> dict[str, np.ndarray]:
    return {KEY.format(i=i, j=j): np.ascontiguousarray(w[i, order(j)].T) for i in range(L) for j in range(E)}


def _random_boxes(shape, rng, n):
    out = [Box((0,) * len(shape), tuple(shape))]
    for _ in range(n):
        lo = [int(rng.integers(0, s)) for s in shape]
        out.append(Box(tuple(lo), tuple(int(rng.integers(1, s - o + 1)) for s, o in zip(shape, lo))))
    return out


# (forward transforms from the stacked tensor to one expert's (F, D) weight, the stacked shape)
LAYOUTS = {
    "(L, E, d, ff)": ((Select(0, "i", L), Select(0, "j", E), Transpose((1, 0))), (L, E, D, F)),
    "(E, L, d, ff)": ((Select(1, "i", L), Select(0, "j", E), Transpose((1, 0))), (E, L, D, F)),
    "(L, d, E, ff)": ((Select(0, "i", L), Select(1, "j", E), Transpose((1, 0))), (L, D, E, F)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_stacked_axes_invert_exactly(layout):
    """Every box of the stacked tensor assembled from the per-expert keys equals the slice, reads
    only the keys (and rows) it touches, and writes back exactly; the forward rule gives each
    expert's weight."""
    ops, shape = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    stacked = rng.standard_normal(shape).astype(np.float32)
    w = np.moveaxis(stacked, [shape.index(L), shape.index(E)], [0, 1]) if layout != "(L, E, d, ff)" else stacked
    per = _per_expert(w)
    fwd = Mapping((Rule("moe/w1", KEY, transforms=ops),), source_sep="/", target_sep=".")
    for key, want in per.items():
        r = fwd.resolve(key, 2, {"moe/w1"})
        c = r.chain([shape], [np.float32])
        (src, box), = c.reads(Box.full(c.target_shape))
        assert np.array_equal(c.assemble(Box.full(c.target_shape), [stacked[box.slices()]]), want)
    inv = fwd.inverse()
    res = inv.resolve("moe/w1", len(shape), set(per))
    assert len(res.source_keys) == L * E and set(res.source_keys) == set(per)
    chain = res.chain([per[k].shape for k in res.source_keys], [np.float32] * len(per))
    assert chain.target_shape == shape
    for box in _random_boxes(shape, rng, 12):
        reads = chain.reads(box)
        got = chain.assemble(box, [per[k][b.slices()] for k, b in reads])
        assert np.array_equal(got, stacked[box.slices()]), box
        a_i, a_j = shape.index(L), shape.index(E)  # one read per (layer, expert) the box touches
        assert len(reads) == box.shape[a_i] * box.shape[a_j]
        assert sum(int(np.prod(b.shape)) for _, b in reads) == int(np.prod(box.shape))
        for k, b, x in chain.writes(box, stacked[box.slices()]):
            assert np.array_equal(per[k][b.slices()], x)


def test_expert_order_is_checked_by_values():
    """Broken control: a layout whose experts are numbered in the other order assembles without
    error but gives other values; the right order gives the tensor bit for bit."""
    ops, shape = LAYOUTS["(L, E, d, ff)"]
    stacked = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    inv = Mapping((Rule("moe/w1", KEY, transforms=ops),), source_sep="/", target_sep=".").inverse()
    for order, same in ((lambda j: j, True), (lambda j: E - 1 - j, False)):
        per = _per_expert(stacked, order)
        res = inv.resolve("moe/w1", 4, set(per))
        chain = res.chain([per[k].shape for k in res.source_keys], [np.float32] * len(per))
        box = Box.full(shape)
        got = chain.assemble(box, [per[k][b.slices()] for k, b in chain.reads(box)])
        assert np.array_equal(got, stacked) is same


def test_missing_expert_is_reported_and_refusals_are_typed():
    """A gap in the expert family is a missing key (named); joins that do not compose raise
    InvalidRuleError (a CheckpointError), and a save cannot infer two stacked lengths."""
    ops, shape = LAYOUTS["(L, E, d, ff)"]
    inv = Mapping((Rule("moe/w1", KEY, transforms=ops),), source_sep="/", target_sep=".").inverse()
    per = _per_expert(np.zeros(shape, np.float32))
    gone = KEY.format(i=1, j=2)
    res = inv.resolve("moe/w1", 4, set(per) - {gone})
    assert gone in res.source_keys and "lacks" in " ".join(res.notes)
    assert len(inv.resolve("moe/w1", 4, set(per)).notes) == 0  # control: the whole family
    for bad in ((Stack(0, "i"), Transpose((1, 0)), Stack(0, "j")), (Stack(0, "i"), Stack(0, "i"))):
        with pytest.raises(InvalidRuleError) as err:
            Rule(KEY, "moe/w1", transforms=bad)
        assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    Rule(KEY, "moe/w1", transforms=(Transpose((1, 0)), Stack(0, "j"), Stack(0, "i")))  # control: adjacent
    unsized = Mapping((Rule("moe/w1", KEY, transforms=(Select(0, "i"), Select(0, "j"), Transpose((1, 0)))),),
                      source_sep="/", target_sep=".")
    r = unsized.resolve_unique(KEY.format(i=0, j=0), 2)
    with pytest.raises(InvalidRuleError, match="size"):
        r.chain_for_target((F, D), np.float32, select_size=L)
    sized = Mapping((Rule("moe/w1", KEY, transforms=ops),), source_sep="/", target_sep=".")
    assert sized.resolve_unique(KEY.format(i=0, j=0), 2).chain_for_target((F, D), np.float32).source_shapes == (shape,)
