"""The bench's state recipes (``ckptfmt bench --state llama|moe``): their shapes, their values, and
every system saving and restoring them end to end, bit for bit.

No timing is asserted: the bench measures.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckptfmt_tools.bench import BenchOptions, run_bench
from ckptfmt_tools.bench.args import build_parser, options_from_args
from ckptfmt_tools.bench.peers import PEERS, peer_available
from ckptfmt_tools.bench.states import (COL, REP, ROW, Recipe, box_bits, check_box, llama, mesh_shape, moe, moe_shape,
                                        rank_box, state_from_json)


def test_llama_at_32_layers_has_874_leaves_and_291_parameters():
    r = llama(1 << 30)  # shapes only: nothing is allocated
    assert len(r.leaves) == 874 and r.parameters == 291
    assert len({leaf.key for leaf in r.leaves}) == 874
    by_dtype = {d: sum(1 for leaf in r.leaves if leaf.dtype == d) for d in ("bfloat16", "float32", "int32")}
    assert by_dtype == {"bfloat16": 291, "float32": 2 * 291, "int32": 1}
    assert abs(r.nbytes - (1 << 30)) / (1 << 30) < 0.1
    leaf = {x.key: x for x in r.leaves}
    h = leaf["params/final_norm"].shape[0]
    assert leaf["params/layers/00/attn/k"].shape == (h, h // 4) and leaf["params/layers/31/mlp/down"].shape == (h * 7 // 2, h)
    assert leaf["params/embed"].spec == ROW and leaf["params/lm_head"].spec == COL and leaf["params/layers/05/mlp_norm"].spec == REP
    assert leaf["opt/mu/layers/05/attn/o"].spec == ROW and leaf["opt/nu/layers/05/attn/q"].spec == COL
    for layers in (1, 2, 7):
        small = llama(4 << 20, layers)
        assert (len(small.leaves), small.parameters) == (27 * layers + 10, 9 * layers + 3)
    assert Recipe.from_json(json.loads(json.dumps(r.to_json()))) == r
    r.check_topologies((8, 4))


def test_moe_hits_the_leaf_count_with_separate_expert_tensors():
    for want in (200, 2000, 20_000):
        r = moe(want)
        layers, experts = moe_shape(want)
        assert len(r.leaves) == 3 * (layers * (7 + 3 * experts) + 3) + 1
        assert abs(len(r.leaves) - want) / want < 0.03, (want, len(r.leaves))
        assert max(leaf.nbytes for leaf in r.leaves if "/experts/" in leaf.key) <= 8 << 10
        r.check_topologies((8, 4))
    assert moe_shape(20_000) == (16, 136)  # the reference recipe: 19,930 leaves
    assert sum(1 for leaf in moe(2000).leaves if leaf.key.startswith("params/layers/00/moe/experts/")) == 3 * moe_shape(2000)[1]


def test_a_topology_that_does_not_split_the_shapes_is_refused():
    with pytest.raises(ValueError, match="does not split"):
        llama(4 << 20, 2).check_topologies((8, 6))  # a model axis of 3 splits no H = 80 dimension
    with pytest.raises(ValueError, match="16-tensor state only"):
        run_bench(BenchOptions(state="llama", layers=2, size=4 << 20, two_process=True, peers=()), log=None)
    with pytest.raises(ValueError, match="bridges.jax only"):
        run_bench(BenchOptions(state="moe", leaves=200, ckptfmt_api="core-numpy", peers=()), log=None)


def test_values_are_a_function_of_the_global_index_and_the_check_is_bit_exact():
    r = llama(4 << 20, 2)
    i, leaf = next((i, x) for i, x in enumerate(r.leaves) if x.key == "opt/mu/layers/01/mlp/gate")
    whole = box_bits(i, leaf, (0, 0), leaf.shape)
    assert np.array_equal(box_bits(i, leaf, (40, 70), (40, 70)), whole[40:80, 70:140])
    assert not np.array_equal(whole, box_bits(i + 1, leaf, (0, 0), leaf.shape))  # leaves differ
    assert np.isfinite(whole.view(np.float32)).all()
    assert check_box(i, leaf, (40, 70), whole[40:80, 70:140].view(np.float32)) == 40 * 70 * 4
    broken = whole[40:80, 70:140].copy()
    broken[3, 5] ^= 1  # one bit
    with pytest.raises(AssertionError, match="differs"):
        check_box(i, leaf, (40, 70), broken.view(np.float32))
    count = r.leaves[-1]
    assert check_box(len(r.leaves) - 1, count, (), box_bits(len(r.leaves) - 1, count, (), ()).view(np.int32)) == 4


def test_rank_boxes_tile_each_leaf_once_per_replica():
    r = llama(4 << 20, 2)
    for world in (8, 4):
        assert mesh_shape(world) == (2, world // 2)
        for leaf in r.leaves[:12] + r.leaves[-4:]:
            cover = np.zeros(leaf.shape, dtype=np.int64)
            firsts = np.zeros(leaf.shape, dtype=np.int64)
            for rank in range(world):
                off, shape, first = rank_box(leaf, world, rank)
                sl = tuple(slice(o, o + n) for o, n in zip(off, shape))
                cover[sl] += 1
                firsts[sl] += first
            assert (firsts == 1).all(), leaf.key  # the first replicas cover every element exactly once
            sizes = dict(zip(("data", "model"), mesh_shape(world)))
            assert (cover == world // int(np.prod([sizes[a] for a in leaf.spec if a]))).all(), leaf.key


def test_cli_state_options_parse():
    opts = options_from_args(build_parser().parse_args(["--state", "moe", "--leaves", "2000", "--layers", "4"]))
    assert (opts.state, opts.leaves, opts.layers) == ("moe", 2000, 4)
    assert options_from_args(build_parser().parse_args([])).state == "tensors16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--state", "gpt"])
    assert isinstance(state_from_json(llama(4 << 20, 2).to_json()), Recipe)


def _run_recipe(tmp_path, **kw) -> dict:
    opts = BenchOptions(repetitions=1, output_dir=str(tmp_path / "out"), storage=str(tmp_path / "repo"), peers=PEERS,
                        metadata=False, plot=False, **{"safety": False, "tailstep": False} | kw)
    result = run_bench(opts, log=None)
    assert result.errors == {}, result.errors
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    available = [p for p in PEERS if peer_available(p) is None]
    assert set(doc["skipped"]) == set(PEERS) - set(available)
    systems = ["ckptfmt"] + available
    nbytes = doc["layout"]["nbytes"]
    phases = ("save", "restore_8to8", "restore_8to4")
    for system in systems:
        s = doc["summary"][system]
        assert set(phases) <= set(s), (system, set(s))
        for phase in phases:
            assert s[phase]["wall_s"] > 0 and s[phase]["rss_peak"] > 0, (system, phase)
        assert s["save"]["objects"] > 0 and s["save"]["bytes_on_disk"] > 0, system
        for phase in phases[1:]:  # every restore of every system checked bit for bit, every byte
            assert [r["bytes_checked"] for r in doc["runs"][system][phase]] == [nbytes], (system, phase)
            assert [r["place"] for r in doc["runs"][system][phase]] == [systems.index(system) + 1]
    rot = doc["rotated"]["phases"]
    for phase in phases:
        assert set(rot[phase]["repetitions"][0]["systems"]) == set(systems)
        if available:
            assert rot[phase]["ratio"]["n"] == 1 and rot[phase]["repetitions"][0]["faster_peer"] in available
    assert "objects per save" in result.table and doc["layout"]["describe"] in result.table
    assert "Rotated harness: 1 repetitions" in result.table
    assert not any((tmp_path / "repo").rglob("*.json"))  # the checkpoints were removed
    return doc


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_llama_recipe_end_to_end(tmp_path):
    doc = _run_recipe(tmp_path, state="llama", layers=2, size=4 << 20, tailstep=True, tailstep_every=3, tailstep_saves=2)
    assert doc["layout"]["leaves"] == 64 and doc["layout"]["parameters"] == 21
    # The cadence on the same state: every system, 2 saves 3 steps apart, the host copy beside them.
    rows = doc["cadence"]
    assert {r["system"] for r in rows} == set(doc["summary"]) - {"raw"}
    for r in rows:
        assert "error" not in r, r
        assert (r["every"], r["saves"], r["committed"]) == (3, 2, 2) and r["copy_bytes"] == doc["layout"]["nbytes"]
    assert "caller blocked / host copy of the state" in doc["table"]
    raw = doc["summary"]["raw"]["save"]["bytes_on_disk"]  # the raw limit writes about the state's bytes
    assert abs(raw - doc["layout"]["nbytes"]) / doc["layout"]["nbytes"] < 0.05


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_moe_recipe_end_to_end(tmp_path):
    doc = _run_recipe(tmp_path, state="moe", leaves=200, raw=False, safety=True)
    assert doc["layout"]["leaves"] == len(moe(200).leaves)
    assert "raw" not in doc["summary"]
    # The rotated harness removed its checkpoints, so the flip probe saved each system again first.
    assert doc["safety"]["ckptfmt"]["outcome"] == "detected", doc["safety"]
    for peer in set(doc["summary"]) - {"ckptfmt"}:
        assert doc["safety"][peer]["outcome"] in ("detected", "silent", "missed"), doc["safety"]
