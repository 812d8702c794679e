"""The JAX half of the JAX <-> torch acceptance test (run with 8 host CPU devices).

``train <url> <out.npz>``: a Flax NNX model equivalent to ``torch_side.TorchNet`` (Embed,
LayerNorm, two Linear) trains TRAIN_STEPS steps with optax adamw on a mesh of 8 devices and
saves ``{"model", "optimizer"}`` through ``bridges.jax.save`` as step TRAIN_STEPS. Then it writes
the reference forward output on EVAL_IDS and the parameters after ONE MORE step to ``out.npz``.

``restore <url> <step> <out.npz>``: restores a torch-written checkpoint (saved with the mapping)
through ``bridges.jax.restore`` onto 8 devices and writes the restored leaves to ``out.npz``.

``fsdp_tp <url> <expect.npz> <out.json>``: restores the FSDP2 + TP save of 4 torch ranks
(``scenarios.fsdp_tp_save``: model and AdamW moments, ``_StridedShard`` placements) onto a (2, 4)
JAX mesh with no policy and no mapping, and checks every device's shard against its box of the
expected global value, bit for bit (with a broken control: a box shifted by one row must fail);
step 2 of the same save holds a caller's ``rank_state``: restoring it without a policy must raise.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bridges import jax as bj  # noqa: E402
from bridges.jax._tree import flatten_with_keys  # noqa: E402
from bridges.flax import nnx_state, nnx_target  # noqa: E402
from ckptfmt.errors import TopologyChangedError  # noqa: E402

VOCAB, D, OUT = 50, 32, 16
HP = dict(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)
TRAIN_STEPS = 3
SEQ = 6


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        # torch LayerNorm: eps 1e-5 and the two-pass variance
        self.norm = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.fc1 = nnx.Linear(D, D, rngs=rngs)  # square: a missing transpose still loads
        self.fc2 = nnx.Linear(D, OUT, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.relu(self.fc1(self.norm(self.embed(ids)))))


def data(seed: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int32),
            rng.standard_normal((batch, SEQ, OUT)).astype(np.float32))


EVAL_IDS = data(99, 4)[0]


def spec(key: str) -> P:
    if key.endswith("embed/embedding"):
        return P(None, "x")
    if key.endswith("fc1/kernel"):
        return P(None, "x")
    if key.endswith("fc2/kernel"):
        return P("x", None)
    return P()


def mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def build() -> tuple[Net, nnx.Optimizer]:
    m = mesh()
    model = Net(nnx.Rngs(0))
    state = nnx.state(model)
    flat = dict(flatten_with_keys(state.to_pure_dict())[0])
    pure = {}
    for k, v in flat.items():
        pure[k] = jax.device_put(v, NamedSharding(m, spec(k)))
    from bridges.jax._tree import nest
    state.replace_by_pure_dict(nest(pure))
    nnx.update(model, state)
    opt = nnx.Optimizer(model, optax.adamw(**HP), wrt=nnx.Param)
    return model, opt


@nnx.jit
def train_step(model: Net, opt: nnx.Optimizer, ids: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m: Net) -> jax.Array:
        return jnp.mean((m(ids) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def train(url: str, out: str) -> None:
    model, opt = build()
    for s in range(TRAIN_STEPS):
        ids, y = data(s, 8)
        train_step(model, opt, jnp.asarray(ids), jnp.asarray(y))
    bj.save(url, {"model": nnx_state(model), "optimizer": nnx_state(opt)}, step=TRAIN_STEPS)
    y_ref = np.asarray(model(jnp.asarray(EVAL_IDS)))
    ids, y = data(TRAIN_STEPS, 8)
    train_step(model, opt, jnp.asarray(ids), jnp.asarray(y))
    after = {f"after|{k}": np.asarray(v) for k, v in flatten_with_keys(
        {"model": nnx_state(model), "optimizer": nnx_state(opt)})[0]}
    np.savez(out, y_ref=y_ref, eval_ids=EVAL_IDS, **after)


def restore(url: str, step: int, out: str) -> None:
    model, opt = build()
    m = mesh()
    shard = lambda k, leaf: NamedSharding(m, spec(k))  # noqa: E731
    target = {"model": nnx_target(model, shard),
              "optimizer": {"opt_state": {"0": {
                  "mu": nnx_target(model, shard), "nu": nnx_target(model, shard)}}}}
    got = bj.restore(url, target, step=step, rank_state_policy="drop")  # torch RNG is per rank
    leaves = flatten_with_keys(got)[0]
    ok_sharding = all(v.sharding.is_equivalent_to(NamedSharding(m, spec(k)), v.ndim) for k, v in leaves)
    np.savez(out, ok_sharding=np.array(ok_sharding), **{k.replace("/", "|"): np.asarray(v) for k, v in leaves})


def _shards_exact(arr: jax.Array, want: np.ndarray) -> bool:
    """Every addressable shard of ``arr`` equals its box of ``want``, bit for bit."""
    return all(np.asarray(s.data).tobytes() == np.ascontiguousarray(want[s.index]).tobytes()
               for s in arr.addressable_shards)


def fsdp_tp(url: str, expect: str, out: str) -> None:
    import json

    from bridges.jax._tree import nest
    want = {k.replace("|", "/"): v for k, v in np.load(expect).items()}
    m = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"),
                          axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sizes = dict(m.shape)

    def spec(shape: tuple[int, ...]) -> P:  # the first layout that divides evenly: not the torch one
        cands = [P("a", "b"), P("b", "a")] if len(shape) == 2 else [P("b"), P("a")]
        return next(c for c in cands if all(n % sizes[a] == 0 for n, a in zip(shape, c)))

    target = nest({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, spec(v.shape)))
                   for k, v in want.items()})
    got = dict(flatten_with_keys(bj.restore(url, target, step=1))[0])  # 4 torch ranks, no rank_state: no policy
    try:  # control: step 2 was saved with a caller's rank_state, which another world size must not drop silently
        bj.restore(url, {"model": target["model"]}, step=2)
        asked = "restored"
    except TopologyChangedError as e:
        asked = type(e).__name__
    res = {"keys": sorted(got) == sorted(want), "exact": {k: _shards_exact(got[k], want[k]) for k in want},
           "devices": sorted({len(v.addressable_shards) for v in got.values()}),
           "asked_rank_state": asked, "control": _shards_exact(got["model/2.weight"], np.roll(want["model/2.weight"], 1, axis=0))}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "fsdp_tp":
        fsdp_tp(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        restore(sys.argv[2], int(sys.argv[3]), sys.argv[4])
