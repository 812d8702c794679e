"""ckptfmt.restoreplan: one planner over one source protocol (a committed step and a safetensors
source plan alike), the restore semantics, and the one error with its short message."""
from __future__ import annotations

import numpy as np
import pytest

import ckptfmt
from ckptfmt import Box, LocalShard
from ckptfmt.errors import KeyMismatchError, RestoreMismatchError, ShapeMismatchError
from ckptfmt.interop import export_safetensors, open_source
from ckptfmt.restoreplan import RestoreSource, TargetLeaf, closest_key, plan_restore

W = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.arange(5, dtype=np.int32)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    url = str(d / "repo")
    ckptfmt.save(url, 1, [LocalShard(k, a.shape, a.dtype, Box.full(a.shape), a) for k, a in (("w", W), ("b", B))])
    export_safetensors(url, str(d / "st"))
    return open_source(url), open_source(str(d / "st"))


def test_both_sources_implement_the_protocol_and_plan_alike(sources):
    leaves = [TargetLeaf("w", "array", (3, 4), np.dtype("float16")), TargetLeaf("b", "array", (5,), np.dtype("int64"))]
    plans = []
    for src in sources:
        assert isinstance(src, RestoreSource), type(src)
        plan = plan_restore(src, leaves)
        plans.append((plan.report, [(t.key, t.source_keys, t.dtype, t.source_dtype) for t in plan.tensors]))
        tp = plan.by_key["w"]
        blocks = src.read_boxes(tp.reads(Box.full((3, 4))))
        assert tp.assemble(Box.full((3, 4)), blocks).dtype == np.float16 and tp.reads(Box((0, 0), (0, 4))) == []
    assert plans[0] == plans[1]
    assert plans[0][0].cast == ("w: float32 -> float16", "b: int32 -> int64") and plans[0][0].loaded == ("w", "b")


def test_semantics_partial_missing_and_across_kinds(sources):
    ckpt = sources[0]
    w = TargetLeaf("w", "array", (3, 4), np.dtype("float32"))
    plan = plan_restore(ckpt, [w])  # a partial restore: reported, not an error
    assert plan.report.unexpected == ("b",) and plan.report.loaded == ("w",)
    e = pytest.raises(KeyMismatchError, plan_restore, ckpt, [w], strict=True).value
    assert e.unexpected == ["b"] and "ignore=('b',)" in str(e)
    gone = TargetLeaf("gone", "array", (2,), np.dtype("float32"))
    with pytest.raises(KeyMismatchError, match="'gone'"):
        plan_restore(ckpt, [w, gone])
    assert plan_restore(ckpt, [w, gone], strict=False).report.missing == ("gone",)  # the control
    with pytest.raises(ShapeMismatchError, match="across kinds"):
        plan_restore(ckpt, [TargetLeaf("w", "array", (3, 4), np.dtype("int32"))])
    with pytest.raises(ShapeMismatchError, match="must match exactly"):
        plan_restore(ckpt, [TargetLeaf("w", "array", (3, 4), np.dtype("float16"), cast=False)])


def test_one_short_error_with_the_full_lists(sources):
    ckpt = sources[0]
    many = [TargetLeaf(f"model/layers/{i}/some_long_parameter_name/kernel", "array", (2,), np.dtype("float32"))
            for i in range(300)]
    bad = TargetLeaf("w", "array", (4, 3), np.dtype("float32"))
    e = pytest.raises(RestoreMismatchError, plan_restore, ckpt, [bad, *many], strict=True).value
    text = str(e)
    assert text.startswith("the restore target does not fit the checkpoint") and "to fix, pass" in text[:200]
    assert len(text) <= 1700 and "names=" in text and "strict=False" in text, len(text)
    assert len(e.missing) == 300 and e.unexpected == ["b"] and e.mismatches[0]["key"] == "w"
    doc = e.to_json()
    assert len(doc["missing"]) == 300 and doc["unexpected"] == ["b"]
    back = ckptfmt.CheckpointError.from_json(doc)
    assert type(back) is RestoreMismatchError and back.missing == e.missing


def test_closest_key_compares_like_with_like():
    keys = {"optimizer/opt_state/0/count", "optimizer/opt_state/0/mu/w", "model/w"}
    assert closest_key("optimizer/step", keys) is None  # optax's count is not NNX's step
    assert closest_key("optimizer/opt_state/0/mu/v", keys) == "optimizer/opt_state/0/mu/w"
    assert closest_key("model/v", keys) == "model/w"  # a tensor for a tensor, not an optimizer slot
    assert closest_key("optim/state/w/exp_avg", {"optim/state/w/exp_avg_sq", "optim/state/v/exp_avg"}) \
        == "optim/state/v/exp_avg"


def test_the_message_counts_only_what_is_an_error(sources):
    """Issue 52: a restore missing a key, whose checkpoint holds keys the target does not name,
    said "0 unexpected" beside the list of them. Now the header counts only the errors and the
    list says how many there are; control: under strict=True they are counted as unexpected."""
    ckpt = sources[0]
    leaves = [TargetLeaf("gone", "array", (2,), np.dtype("float32"))]
    e = pytest.raises(KeyMismatchError, plan_restore, ckpt, leaves).value
    assert "(1 missing keys)" in str(e) and "0 unexpected" not in str(e), str(e)
    assert "also holds 2 keys the target does not name" in str(e) and e.unexpected == ["b", "w"]
    e = pytest.raises(KeyMismatchError, plan_restore, ckpt, leaves, strict=True).value
    assert "(1 missing keys, 2 unexpected keys)" in str(e), str(e)


def test_a_target_without_the_mappings_top_level_is_told_so(sources):
    """Issue 52: a torch state dict passed where the preset expects ``{"model": state_dict}`` was
    told to use ``names=``. Now the error says the target lacks the mapping's 'model' level;
    control: the same mapping with the level restores."""
    from bridges.mapping import Mapping, Rule

    mapping = Mapping(rules=(Rule("w", "model/weight"),))
    flat = [TargetLeaf("weight", "array", (3, 4), np.dtype("float32"))]
    e = pytest.raises(KeyMismatchError, plan_restore, sources[0], flat, mapping=mapping).value
    assert "lacks the 'model' level" in str(e) and "names=" not in str(e), str(e)
    nested = [TargetLeaf("model/weight", "array", (3, 4), np.dtype("float32"))]
    assert plan_restore(sources[0], nested, mapping=mapping).report.loaded == ("model/weight",)
    other = [TargetLeaf("bias", "array", (3, 4), np.dtype("float32"))]  # control: a key no rule names one level down
    e = pytest.raises(KeyMismatchError, plan_restore, sources[0], other, mapping=mapping).value
    assert "level" not in str(e) and "names=" in str(e)


def test_per_expert_tensors_against_a_fused_preset_suggest_per_expert(tmp_path):
    """Issue 52: a checkpoint of one tensor per expert read through a mapping for fused experts now
    points to experts="per_expert"; control: the fused checkpoint loads through the same mapping,
    and a plain missing key gets no such hint."""
    from bridges.mapping import Mapping, Rule

    mapping = Mapping(rules=(Rule("m.experts.gate_up", "moe/gate"),))
    leaves = [TargetLeaf("moe/gate", "array", (3, 4), np.dtype("float32"))]
    per, fused = str(tmp_path / "per"), str(tmp_path / "fused")
    ckptfmt.save(per, 1, [LocalShard(f"m.experts.{e}.w1", W.shape, W.dtype, Box.full(W.shape), W) for e in (0, 1)])
    ckptfmt.save(fused, 1, [LocalShard("m.experts.gate_up", W.shape, W.dtype, Box.full(W.shape), W)])
    e = pytest.raises(KeyMismatchError, plan_restore, open_source(per), leaves, mapping=mapping).value
    assert 'experts="per_expert"' in str(e) and "m.experts.0.w1" in str(e), str(e)
    assert plan_restore(open_source(fused), leaves, mapping=mapping).report.loaded == ("moe/gate",)
    e = pytest.raises(KeyMismatchError, plan_restore, open_source(fused),
                      leaves + [TargetLeaf("x", "array", (2,), np.dtype("float32"))], mapping=mapping).value
    assert "per_expert" not in str(e)


def test_a_rule_that_does_not_fit_points_to_the_mapping(sources):
    """Issue 52: values that a mapping's rules shaped wrongly were answered with "pass a target of the
    checkpoint's shapes". Now the advice is a mapping whose rules fit; control: without a mapping,
    wrong target shapes still get the target advice."""
    from bridges.mapping import Mapping, Rule, Transpose

    mapping = Mapping(rules=(Rule("w", "wt", transforms=(Transpose((1, 0)),)), Rule("b", "bt")))
    leaves = [TargetLeaf("wt", "array", (3, 4), np.dtype("float32")), TargetLeaf("bt", "array", (6,), np.dtype("int32"))]
    e = pytest.raises(RestoreMismatchError, plan_restore, sources[0], leaves, mapping=mapping).value
    assert "a mapping whose rules fit" in str(e) and "checkpoint's shapes" not in str(e), str(e)
    plain = [TargetLeaf("w", "array", (4, 3), np.dtype("float32")), TargetLeaf("b", "array", (6,), np.dtype("int32"))]
    e = pytest.raises(RestoreMismatchError, plan_restore, sources[0], plain).value
    assert "checkpoint's shapes" in str(e) and "rules fit" not in str(e), str(e)
