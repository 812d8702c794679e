"""README.md's checkpoint-manager example, run as printed, in ONE process of N CPU devices.

tests/test_readme_resume.py runs it three times on one checkpoint root: saving on 8 devices, then
resuming on 8 and on 4 (fresh processes: JAX fixes its device count at import).

The block between README.md's ``--8<-- [start:manager]`` markers is executed with only what the
README leaves to the user supplied here: ``opt`` (an optax optimizer) and ``train_step`` ("your
step; it counts state["step"] too"), and its literal "/tmp/run" replaced by a directory of the
test's. Two users run it:

* ``readme``: the block exactly as printed; the train step lays its outputs over a ``data`` mesh.
* ``nnx``: the block's lines from ``mgr = ...`` on, after the state of a Flax NNX model (from a
  small config, its parameters laid out over the mesh) and its ``nnx.Optimizer`` (optax adamw):
  ``{"model": nnx_state(model), "optimizer": nnx_state(optimizer), "step": 0}``.

The train step sends this process SIGTERM at its third call, so the README's own preemption
branch saves that step and leaves the loop. Each run records, per user, the state the first train
step received (a digest of every leaf's bits), the losses, the state after the block, and the
error, if any, as a type and a message.

usage: readme_resume.py DEVICES ROOT OUT_JSON
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import traceback

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import bridges.jax as bjax  # noqa: E402
from bridges import flax as bflax  # noqa: E402

CONFIG = {"features": 16, "hidden": 32, "out": 4, "batch": 16}  # hidden splits over 8 and 4 devices
STEPS_PER_RUN = 3
MESH = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def readme_block() -> tuple[str, str]:
    """The manager example's code: (the lines before ``mgr = ...``, the lines from it on)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = re.search(r"<!-- --8<-- \[start:manager\] -->\n```python\n(.*?)```\n<!-- --8<-- \[end:manager\] -->",
                        text, re.S)
    assert section, "README.md has no manager example between its --8<-- markers"
    code = section.group(1)
    assert code.count('"/tmp/run"') == 1, "the manager example no longer names its directory \"/tmp/run\""
    at = code.index("mgr = ")
    return code[:at], code[at:]


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of ``step``: a function of the step alone, on every topology."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((CONFIG["batch"], CONFIG["features"]), dtype=np.float32)
    return x, rng.standard_normal((CONFIG["batch"], CONFIG["out"]), dtype=np.float32)


def digest(tree) -> dict[str, str]:
    flat, _ = bjax.flatten_with_keys(tree)
    out = {}
    for key, leaf in flat:
        a = np.asarray(leaf)
        out[key] = f"{a.dtype.name}{list(a.shape)}:{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"
    return out


class Recorder:
    """Wraps the user's step: records what it receives and returns, and preempts at the third call."""

    def __init__(self, step_fn):
        self.step_fn, self.calls, self.first, self.losses = step_fn, 0, None, []

    def __call__(self, state):
        if self.first is None:
            self.first = digest(state)
        out, loss = self.step_fn(state)
        self.calls += 1
        self.losses.append(loss)
        if self.calls == STEPS_PER_RUN:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption: the README's loop saves and stops
        return out, loss


def readme_user() -> tuple[dict, str]:
    """``opt`` and ``train_step`` for the block as printed (``params = {"w": jnp.zeros((16, 4))}``)."""
    opt = optax.adam(1e-2)
    rows = NamedSharding(MESH, P("data", None))

    @jax.jit
    def update(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return {"w": jax.lax.with_sharding_constraint(params["w"], rows)}, opt_state, loss

    def train_step(state):
        step = state["step"] + 1
        params, opt_state, loss = update(state["params"], state["opt"], *batch(step))
        return {"params": params, "opt": opt_state, "step": step}, float(loss)

    head, tail = readme_block()
    return {"opt": opt, "train_step": Recorder(train_step)}, head + tail


class MLP(nnx.Module):
    def __init__(self, cfg: dict, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(cfg["features"], cfg["hidden"], rngs=rngs)
        self.l2 = nnx.Linear(cfg["hidden"], cfg["out"], rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_user() -> tuple[dict, str]:
    """A Flax NNX model and its nnx.Optimizer, the parameters laid out over the mesh (the hidden
    dimension split over ``data``), and the block's lines from ``mgr = ...`` on."""
    model = MLP(CONFIG, nnx.Rngs(0))
    specs = {"l1": {"kernel": P(None, "data"), "bias": P("data")}, "l2": {"kernel": P("data", None), "bias": P()}}
    params = bflax.nnx_state(model)
    bflax.nnx_load(model, {layer: {name: jax.device_put(a, NamedSharding(MESH, specs[layer][name]))
                                   for name, a in leaves.items()} for layer, leaves in params.items()})
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def update(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def train_step(state):
        bflax.nnx_load(model, state["model"])
        bflax.nnx_load(optimizer, state["optimizer"])
        step = state["step"] + 1
        loss = update(model, optimizer, *batch(step))
        return {"model": bflax.nnx_state(model), "optimizer": bflax.nnx_state(optimizer), "step": step}, float(loss)

    head, tail = readme_block()
    imports = "".join(line + "\n" for line in head.splitlines() if line.startswith(("import ", "from ")))
    state = {"model": bflax.nnx_state(model), "optimizer": bflax.nnx_state(optimizer), "step": 0}
    return {"train_step": Recorder(train_step), "state": state}, imports + tail


def run(user, directory: str) -> dict:
    scope, code = user()
    code = code.replace('"/tmp/run"', repr(directory))
    out: dict = {"error": None}
    try:
        exec(compile(code, "README.md (manager example)", "exec"), scope)  # noqa: S102 - the README's own code
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["traceback"] = traceback.format_exc()[-3000:]
    rec = scope["train_step"]
    out.update(first=rec.first, losses=rec.losses, calls=rec.calls, devices=DEVICES)
    if out["error"] is None:
        out["final"] = digest(scope["state"])
        out["final_step"] = scope["state"]["step"]
    return out


def main() -> None:
    root, dest = sys.argv[2], sys.argv[3]
    results = {name: run(user, os.path.join(root, name)) for name, user in (("readme", readme_user), ("nnx", nnx_user))}
    with open(dest, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
