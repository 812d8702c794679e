"""The bridge profiles of spec/FORMAT.md section 13, checked against real saves.

A reader written from the spec alone (``spec_read`` of test_golden for the tensors: json, numpy,
crc32c; msgpack with the ext types of 7.2 for the state; the profile rules of 13.2 and 13.3 for
the meaning) rebuilds a JAX save (typed PRNG keys, a raw key, a tuple, a NamedTuple list, an
int dict key, Python and numpy scalar leaves, a sharded array) and a torch save (a model and an
AdamW state with its param_groups objects), and gets what the bridges themselves give back.
The JAX side of the save runs in a fresh process; this process never imports jax.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from test_golden import _DTYPES, spec_read

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ a spec-only reader
def spec_unpack(data: bytes) -> Any:
    """A state object, decoded by FORMAT.md 7.1 and 7.2 only."""
    def ext(code: int, payload: bytes) -> Any:
        if code == 1:
            return int.from_bytes(payload, "big", signed=True)
        if code in (2, 3):
            name, shape, raw = msgpack.unpackb(payload, raw=False)
            dt = _DTYPES.get(name) or np.dtype(name).newbyteorder("<")
            arr = np.frombuffer(raw, dtype=dt).reshape(shape)
            return arr[()] if code == 3 else arr
        raise ValueError(f"ext type {code}")
    return msgpack.unpackb(data, raw=False, ext_hook=ext, strict_map_key=True)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """FORMAT.md 13.2 / 13.3: split each key path at '/', every component a str map key."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split("/")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
            assert isinstance(node, dict), f"{key} lies beneath a leaf"
        assert last not in node, f"{key} is both a leaf and a prefix"
        node[last] = value
    return root


def flat_paths(tree: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat_paths(v, prefix + (k,)))
        return out
    return {"/".join(prefix): tree}


def read_profile(repo: Path, step: int) -> tuple[dict[str, np.ndarray], Any, dict[str, Any], dict[str, Any]]:
    tensors, states = spec_read(repo, step, revision="1.3")
    manifest = json.loads((repo / f"manifests/{step:020d}.json").read_bytes())
    gstate = spec_unpack(states["global"])
    ranks = {name: spec_unpack(b) for name, b in states.items() if name.startswith("rank/")}
    return tensors, gstate, ranks, manifest


def jax_profile_tree(tensors: dict[str, np.ndarray], gstate: dict[str, Any]) -> dict[str, Any]:
    """The target-less rebuild of FORMAT.md 13.2, with PRNG keys as ("key", impl, key data)."""
    b = gstate["bridge"]
    assert b["name"] == "jax" and b["version"] == 1  # 13.1
    impls, leaves = b["prng_impls"], b["leaves"]
    assert not set(leaves) & set(tensors)
    flat: dict[str, Any] = {}
    for key, arr in tensors.items():
        if key in impls:
            assert arr.dtype == np.uint32 and arr.ndim >= 1
            flat[key] = ("key", impls[key], arr)
        else:
            flat[key] = arr
    flat.update(leaves)
    return nest(flat)


# ------------------------------------------------------------------ JAX
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the [jax] extra")
def test_jax_profile_spec_only_decoding(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "restored.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "jaxproc" / "profile_save.py"), str(repo), str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    bridge = json.loads(out.read_text())

    tensors, gstate, ranks, manifest = read_profile(repo, 1)
    assert "jax" in manifest["versions"] and gstate["extra"] == {"epoch": [1, 2]}  # tuples read back as lists
    assert ranks == {"rank/0": {"cursor": 11}}
    tree = jax_profile_tree(tensors, gstate)

    # The spec's rebuild and the bridge's own target-less restore agree leaf by leaf.
    mine = flat_paths(tree)
    assert sorted(mine) == sorted(bridge["restored"])
    for path, want in bridge["restored"].items():
        got = mine[path]
        if want[0] == "key":
            assert got[0] == "key" and got[1] == want[1] and got[2].tolist() == want[2], path
        elif want[0] == "array":
            assert isinstance(got, np.ndarray) and got.dtype.name == want[1] and list(got.shape) == want[2], path
            assert got.astype(np.float64).tolist() == want[3], path
        else:
            shown = got.hex() if isinstance(got, bytes) else (got.item() if isinstance(got, np.generic) else got)
            assert type(got).__name__ == want[1] and shown == want[2], path

    # What the profile says, case by case.
    assert tree["rng"][1] == "threefry2x32" and tree["rng"][2].shape == (3, 2)  # key dims last
    assert tensors["raw"].dtype == np.uint32 and "raw" not in gstate["bridge"]["prng_impls"]  # only the record
    assert isinstance(tree["raw"], np.ndarray) and tree["raw"].tolist() == [0, 7]       # marks a key
    assert set(tree["pair"]) == {"0", "1"} and tree["pair"]["1"] == "tag"        # a tuple comes back as a map
    assert tree["opt"]["0"]["count"].shape == () and tree["opt"]["1"]["count"] == 3   # NamedTuples by field
    assert "mu" not in tree["opt"]["1"]                                         # an empty dict stores nothing
    assert tree["ints"]["3"].tolist() == 0.5                                    # an int dict key, in decimal
    assert tree["params"]["w"].tolist() == np.arange(32.0).reshape(8, 4).tolist()
    assert manifest["tensors"]["params/w"]["sharding"]["partition"] == [["data"], ["model"]]
    assert len(manifest["tensors"]["params/w"]["shards"]["key"]) == 4
    assert (tree["step"], tree["lr"], tree["name"], tree["big"], tree["blob"]) == (7, 0.25, "run", 2 ** 70, b"\0\1")
    assert isinstance(tree["half"], np.float16) and float(tree["half"]) == 1.5


# ------------------------------------------------------------------ torch
def test_torch_profile_spec_only_decoding(tmp_path):
    torch = pytest.importorskip("torch")
    from bridges import torch as bt

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4,
          "half": model[0].weight.detach().bfloat16()}
    cpu_rng = torch.get_rng_state().numpy().copy()
    repo = tmp_path / "repo"
    bt.save(str(repo), sd, step=2, extra={"loss": 0.5}, rank_state={"sampler": 17})

    tensors, gstate, ranks, manifest = read_profile(repo, 2)
    assert "torch" in manifest["versions"] and set(gstate) == {"torch", "extra"}
    assert gstate["extra"] == {"loss": 0.5}
    objects = gstate["torch"]["objects"]
    assert sorted(objects) == ["epoch", "optim/param_groups"]
    tree = nest({**tensors, **objects})

    def expected(v: Any) -> Any:  # the state dict as the profile stores it
        if isinstance(v, dict):
            return {str(k): expected(x) for k, x in v.items()}  # int keys become decimal strings
        if isinstance(v, (list, tuple)):
            return [expected(x) for x in v]                      # tuples read back as lists
        if isinstance(v, torch.Tensor):
            return bt.to_numpy(v)
        return v

    want = flat_paths(expected(sd))
    got = flat_paths(tree)
    assert sorted(got) == sorted(want)
    assert "model/0.weight" in got and "optim/state/1/exp_avg_sq" in got  # FQN dots kept, '/' between levels
    for path, w in want.items():
        g = got[path]
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), path
        else:
            assert g == w, path
    assert tensors["half"].dtype.name == "bfloat16"
    assert got["optim/param_groups"][0]["betas"] == [0.8, 0.9] and got["optim/param_groups"][0]["params"] == [0, 1, 2, 3]
    assert manifest["tensors"]["model/0.weight"]["sharding"] is None  # a plain tensor

    (rank,) = ranks.values()
    assert set(rank) == {"torch", "extra"} and rank["extra"] == {"sampler": 17}
    assert rank["torch"]["rng"]["cpu"].dtype == np.uint8 and rank["torch"]["rng"]["cpu"].tobytes() == cpu_rng.tobytes()


# ------------------------------------------------------------------ issue 47 item 14.6 and 14.7
def _core_save(url: str, gstate: Any, rank_state: Any = None) -> None:
    from ckptfmt import Box, LocalShard, save
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    save(url, 1, [LocalShard("w", w.shape, w.dtype, Box.full(w.shape), w)], state=gstate, rank_state=rank_state)


@pytest.mark.parametrize("flag", [False, True, 0, 1, "false", None])
def test_a_torch_rank_state_flag_that_is_not_a_boolean_is_refused(tmp_path, flag):
    """FORMAT.md 13.3: a present ``torch.rank_state`` MUST be a boolean; a reader refuses another
    type with InvalidStateError naming it, before it decides what per-rank state to drop. Controls:
    ``false`` and ``true`` load (``true`` on another world needs a policy, 7.4)."""
    torch = pytest.importorskip("torch")
    from bridges import torch as bt
    from ckptfmt.errors import InvalidStateError, TopologyChangedError
    url = str(tmp_path / "repo")
    _core_save(url, {"torch": {"objects": {}, "rank_state": flag}, "extra": None},
               rank_state={"torch": {"rng": None}, "extra": None})
    target = {"w": torch.zeros(2, 3)}
    if isinstance(flag, bool):
        assert bt.load(url, target)["w"].sum().item() == 15.0
        assert bt.load_rank_state(url) is None
        return
    with pytest.raises(InvalidStateError) as e:
        bt.load(url, target)
    assert e.value.key == "torch/rank_state" and e.value.expected == "bool"
    with pytest.raises(InvalidStateError):
        bt.load_rank_state(url)


def test_a_local_tier_step_has_the_tier_profile_and_a_bridge_restore_refuses_it(tmp_path):
    """FORMAT.md 13.1, 8.5: a local-tier step's global state ``{"global": G, "tiers": T}`` is the
    third profile, "tier"; a bridge's plain restore refuses it by name (InvalidStateError), instead
    of finding none of the caller's key paths. Control: the same G saved as an ordinary step loads."""
    torch = pytest.importorskip("torch")
    from bridges import torch as bt
    from bridges._contract import state_profile
    from ckptfmt import Box, Repository
    from ckptfmt.errors import InvalidStateError
    from ckptfmt.manager._tiers import write_local_step
    g = {"torch": {"objects": {}, "rank_state": False}, "extra": None}
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    local = str(tmp_path / "local" / "host-0")
    write_local_step(Repository(local), 1, 0, 1, "t-1", [(0, ("w", w.shape, w.dtype, Box.full(w.shape), w))], g, None)
    gstate = Repository(local).open(1).state()
    assert state_profile(gstate) == "tier" and state_profile(gstate["global"]) == "torch"
    assert state_profile({"bridge": {}, "extra": None}) == "jax" and state_profile({"x": 1}) is None
    assert state_profile({"global": 1, "tiers": [], "x": 2}) is None
    with pytest.raises(InvalidStateError) as e:
        bt.load(local, {"w": torch.zeros(2, 3)})
    assert e.value.key == "tiers" and "local-tier step" in e.value.message
    url = str(tmp_path / "persistent")
    _core_save(url, g)
    assert bt.load(url, {"w": torch.zeros(2, 3)})["w"].sum().item() == 15.0  # control
