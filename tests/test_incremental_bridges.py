"""Incremental saves through the bridges (issue 18): one switch, ``options=SaveOptions(reuse=...)``.

JAX: the same ``jax.Array`` object is proven by identity, a new array with the same values by a
byte comparison; torch tensors (mutable) always by a byte comparison. Control: ``reuse="off"``.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

_JAX = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from bridges import jax as bridge
from ckptfmt import SaveOptions
url = sys.argv[1]
base = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
out = []
for step, b in enumerate([base, base, jnp.array(np.asarray(base)), base]):
    opts = SaveOptions(reuse="off") if step == 3 else None
    m = bridge.save(url, {"base": b, "ad": jnp.full((4,), step, jnp.float32)}, step=step, options=opts)
    got = bridge.restore(url, None, step=step)
    ok = np.asarray(got["base"]).tobytes() == np.asarray(base).tobytes() and float(got["ad"][0]) == step
    out.append({"referenced": m.referenced_nbytes, "mu": list(m.must_understand), "ok": bool(ok)})
print(json.dumps(out))
'''


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax not installed")
def test_jax_bridge_reuses_frozen_arrays(tmp_path):
    r = subprocess.run([sys.executable, "-c", _JAX, str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(s["ok"] for s in steps)
    assert steps[0]["referenced"] == 0 and steps[1]["referenced"] > 0 and steps[2]["referenced"] > 0
    assert steps[1]["mu"] == ["ckptfmt.references"]
    assert steps[3]["referenced"] == 0 and steps[3]["mu"] == []  # control: the opt-out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_bridge_reuses_by_byte_comparison(tmp_path):
    import torch

    from bridges import torch as bridge
    from ckptfmt import Repository, SaveOptions

    url = str(tmp_path / "r")
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    ms = [bridge.save(url, {"base": base, "ad": torch.full((4,), float(s))}, step=s, save_rng=False,
                      options=SaveOptions(reuse="off") if s == 2 else None) for s in range(3)]
    assert ms[0].referenced_nbytes == 0 and ms[1].referenced_nbytes > 0
    assert ms[2].referenced_nbytes == 0 and ms[2].must_understand == ()  # control: the opt-out
    base.add_(1)  # a mutated tensor is not reused: its bytes differ
    m3 = bridge.save(url, {"base": base, "ad": torch.zeros(4)}, step=3, save_rng=False)
    assert m3.referenced_nbytes == 0
    repo = Repository(url)
    for s in range(4):
        assert repo.verify(s) == repo.manifest(s).nbytes
    assert (repo.open(1).read("base") == (base - 1).numpy()).all() and (repo.open(3).read("base") == base.numpy()).all()
