"""The fault of kind ``"reuse"``: an array that shares its buffer with a numpy array, changed in
place between two incremental saves (FORMAT.md 8.4, issue 24 item 4).

A fresh process saves steps 3, 4 and 5 of the scene's repository from one array object: with JAX,
``jax.device_put`` of a page-aligned numpy array (on CPU it does not copy); without JAX, a
read-only numpy view passed to the core as the shard's ``source``. Between steps 3 and 4 the
numpy array is changed in place, so the array object stays the same and its bytes do not. The
check: every step restores exactly the values it had at its save (step 4 must not reference step
3's object), and every step verifies. Step 5 (unchanged since step 4) may be referenced.

Weakening (broken control, tests only): ``identity_only`` gives every block the same digest in
that process, which is the identity proof without its digest: step 4 is then stale.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReuseAttempt", "aliased_mutated", "WEAKEN"]

WEAKEN = {"identity_only": "the identity proof without its digest (every block hashes alike)"}

_SCRIPT = r'''
import json, sys
import numpy as np
from ckptfmt import Box, CheckpointError, LocalShard, Repository, save as core_save

url, weaken = sys.argv[1], sys.argv[2]
if weaken == "identity_only":
    import ckptfmt.session._reuse as reuse
    same = reuse.start_digest(np.zeros(0, np.uint8))
    reuse.start_digest = lambda block: same

raw = np.empty(256 * 256 * 4 + 4096, np.uint8)
off = (-raw.ctypes.data) % 4096
a = raw[off:off + 256 * 256 * 4].view(np.float32).reshape(256, 256)
a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
try:
    import jax
    from bridges import jax as bridge
except ImportError:
    jax = None
if jax is not None:
    x = jax.device_put(a)
    route, aliased = "jax.device_put of a page-aligned numpy array", x.unsafe_buffer_pointer() == a.ctypes.data
    save = lambda step: bridge.save(url, {"aliased": x}, step=step)
    load = lambda step: np.asarray(bridge.restore(url, None, step=step)["aliased"])
    now = lambda: np.array(x)
else:
    view = a.view()
    view.flags.writeable = False
    route, aliased = "a read-only numpy view of a writable array, passed as LocalShard.source", True
    save = lambda step: core_save(url, step, [LocalShard("aliased", a.shape, a.dtype, Box.full(a.shape), view,
                                                         source=view)])
    load = lambda step: Repository(url).open(step).read("aliased")
    now = lambda: np.array(view)
out = {"route": route, "aliased": bool(aliased), "steps": []}
try:
    for step in (3, 4, 5):
        if step == 4:
            a += 1  # in place, through the numpy array: the same array object at step 4
        want = now()
        m = save(step)
        got = load(step)
        out["steps"].append({"step": step, "same": got.tobytes() == want.tobytes(),
                             "referenced": m.referenced_nbytes, "verified": Repository(url).verify(step) == m.nbytes})
except CheckpointError as e:
    out["error"] = {"error": type(e).__name__, "message": str(e)[:300]}
print(json.dumps(out))
'''


@dataclass
class ReuseAttempt:
    """What the saving process reported: the route, each step's check, or the error it raised."""

    where: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    hung: bool = False


def aliased_mutated(scene: Any, ctx: Any) -> ReuseAttempt:
    """Run the three saves in a fresh process (see the module docstring)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    weaken = ctx.writer_weaken if ctx.writer_weaken in WEAKEN else "none"
    try:
        p = subprocess.run([sys.executable, "-c", _SCRIPT, scene.url, weaken], capture_output=True, text=True,
                           env=env, timeout=ctx.save_timeout_s * 3 + 30)
    except subprocess.TimeoutExpired:
        return ReuseAttempt("saves of steps 3-5 from one aliased array", hung=True, notes=["the saving process hung"])
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return ReuseAttempt("saves of steps 3-5 from one aliased array",
                            error={"error": "ProcessFailed", "message": tail[0], "untyped": True})
    doc = json.loads(lines[-1])
    a = ReuseAttempt(f"steps 3-5 saved from one array ({doc['route']}), changed in place before step 4",
                     doc["steps"], doc.get("error"))
    if not doc["aliased"]:
        a.notes.append("the array did not share the numpy buffer here: the fault was not injected")
    return a
