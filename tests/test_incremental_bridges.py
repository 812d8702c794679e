"""Incremental saves through the bridges (issue 18): one switch, ``options=SaveOptions(reuse=...)``.

JAX: the same ``jax.Array`` object is proven by identity and the digest of its bytes (never by
identity alone: its buffer may be shared with numpy), a new array with the same values by a
byte comparison; torch tensors (mutable) always by a byte comparison. Control: ``reuse="off"``.
"""
from __future__ import annotations

import importlib.util
import json
import os
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
    assert steps[1]["mu"] == ["ckptfmt.packs"]  # rows in step 0's pack (FORMAT.md 5.15)
    assert steps[3]["referenced"] == 0 and steps[3]["mu"] == ["ckptfmt.packs"]  # control: the opt-out


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
    assert ms[2].referenced_nbytes == 0 and not ms[2].referenced_saves  # control: the opt-out
    base.add_(1)  # a mutated tensor is not reused: its bytes differ
    m3 = bridge.save(url, {"base": base, "ad": torch.zeros(4)}, step=3, save_rng=False)
    assert m3.referenced_nbytes == 0
    repo = Repository(url)
    for s in range(4):
        assert repo.verify(s) == repo.manifest(s).nbytes
    assert (repo.open(1).read("base") == (base - 1).numpy()).all() and (repo.open(3).read("base") == base.numpy()).all()


# A jax.Array that shares its buffer with a numpy array (issue 24, item 4): on CPU, device_put of a
# 64-byte-aligned array and dlpack.from_dlpack do not copy. Mutating the numpy array changes the
# jax.Array's bytes while it stays the same object. "owned" (jnp.array copies) is the control.
_ALIAS = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from bridges import jax as bridge
from ckptfmt import Repository
from ckptfmt.storage import DelegatingStorage, open_storage

class ShardReads(DelegatingStorage):
    """Counts the bytes of shard objects read (the byte proof reads them; the cheap path does not)."""
    nbytes = 0
    def read_range(self, key, start, stop, *, tensor=None):
        fut = self.inner.read_range(key, start, stop, tensor=tensor)
        if "/arrays/" in key and not key.endswith("zarr.json"):
            ShardReads.nbytes += len(fut.result())
        return fut

def aligned(shape):
    raw = np.empty(int(np.prod(shape)) * 4 + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + int(np.prod(shape)) * 4].view(np.float32).reshape(shape)

routes = {"device_put": jax.device_put, "dlpack": jax.dlpack.from_dlpack, "owned": jnp.array}
url, out = sys.argv[1], {}
for name, make in routes.items():
    a = aligned((64, 64))
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    x = make(a)
    repo = Repository(f"{url}/{name}", storage=ShardReads(open_storage(f"{url}/{name}")))
    rec = {"aliased": x.unsafe_buffer_pointer() == a.ctypes.data}
    for step in (1, 2, 3):
        if step == 2:
            a += 1  # in place: the same jax.Array object at step 2
        want = np.array(x)  # the values at save time
        ShardReads.nbytes = 0
        m = bridge.save(repo, {"w": x}, step=step)
        got = np.asarray(bridge.restore(repo.url, None, step=step)["w"])
        rec[step] = {"ok": got.tobytes() == want.tobytes(), "referenced": m.referenced_nbytes,
                     "shard_reads": ShardReads.nbytes, "verified": Repository(repo.url).verify(step) == m.nbytes}
    out[name] = rec
print(json.dumps(out))
'''


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax not installed")
def test_jax_aliased_array_mutated_in_place_is_not_stale(tmp_path):
    """Identity alone is no proof: an array aliased by numpy and changed in place is written again
    (both aliasing routes), and an unchanged array is still proven without reading a shard."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _ALIAS, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["device_put"]["aliased"] and got["dlpack"]["aliased"] and not got["owned"]["aliased"]
    for name in ("device_put", "dlpack"):
        s = got[name]
        assert all(s[k]["ok"] and s[k]["verified"] for k in "123"), s  # step 2 holds the mutated values
        assert s["2"]["referenced"] == 0, s  # changed in place: written again
        assert s["3"]["referenced"] > 0 and s["3"]["shard_reads"] == 0, s  # unchanged since: the cheap path
    s = got["owned"]  # control: the common case keeps the cheap path (referenced, no shard read)
    assert all(s[k]["ok"] and s[k]["verified"] for k in "123"), s
    assert s["2"]["referenced"] > 0 and s["2"]["shard_reads"] == 0 and s["3"]["shard_reads"] == 0, s
