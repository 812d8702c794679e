"""A tiny, fully deterministic Flax NNX training job for tests, the demo and the drill.

* Model: an MLP (``d_in -> hidden -> d_out``) with dropout, its kernels split over both mesh
  axes (``model`` for the hidden dimension, ``data`` FSDP-style for the other); batches split
  over ``data``. Mesh axes are always ``("data", "model")``.
* Optimizer: ``nnx.Optimizer`` with optax adamw (``mu``/``nu``/``count``) under a warmup-cosine
  schedule, chained after global-norm clipping.
* Data: a fixed synthetic dataset; the batch of a step depends only on the data cursor
  (global sample position, epoch, shuffle seed): sample ids are a per-epoch permutation seeded by
  ``(shuffle_seed, epoch)``, read at ``position .. position + global_batch``. Every process
  computes the same global batch and hands each device its slice, so the batch is the same on
  any topology.
* Loss scale: a static power of two (exact in float arithmetic) carried in the state, as a
  mixed-precision job would carry its dynamic loss-scale state.

The checkpointed pytree (:meth:`Trainer.checkpoint_state`)::

    {"model": <nnx pure dict: params + dropout Rngs (typed key, count)>,
     "optimizer": <nnx pure dict: step, opt_state (clip, adamw mu/nu/count)>,
     "loss_scale": {"scale": f32[], "good_steps": i32[]},
     "aux_key": raw uint32[2] PRNG key, "data": {"position", "epoch", "shuffle_seed"} (ints),
     "step": int}
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bridges.flax import nnx_load, nnx_state

__all__ = ["Config", "MLP", "Trainer", "make_mesh", "batch_ids", "digest_tree"]

@dataclass(frozen=True)
class Config:
    n_samples: int = 512
    d_in: int = 16
    hidden: int = 64
    d_out: int = 8
    global_batch: int = 32
    lr: float = 3e-3
    warmup: int = 2
    total_steps: int = 100
    weight_decay: float = 1e-4
    dropout: float = 0.1
    model_seed: int = 0
    data_seed: int = 1234
    shuffle_seed: int = 7
    loss_scale: float = 2.0 ** 8


def make_mesh(shape: tuple[int, int], devices: Any = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``shape`` over ``devices`` (default: all devices)."""
    devs = np.asarray(jax.devices() if devices is None else devices)[: shape[0] * shape[1]]
    return Mesh(devs.reshape(shape), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


class MLP(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(cfg.d_in, cfg.hidden, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.l2 = nnx.Linear(cfg.hidden, cfg.d_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def _spec(key: str, ndim: int) -> P:
    """Partition spec of a model / optimizer leaf by its key path (moments follow their params)."""
    if key.endswith("l1/kernel"):  # FSDP-style: also split over "data", so every process writes
        return P("data", "model")
    if key.endswith("l1/bias"):
        return P("model")
    if key.endswith("l2/kernel"):
        return P("model", "data")
    return P()


def dataset(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(cfg.data_seed)
    x = rng.standard_normal((cfg.n_samples, cfg.d_in), dtype=np.float32)
    w = rng.standard_normal((cfg.d_in, cfg.d_out), dtype=np.float32) / np.sqrt(cfg.d_in)
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((cfg.n_samples, cfg.d_out), dtype=np.float32)
    return x, y.astype(np.float32)


def batch_ids(cursor: dict[str, int], cfg: Config) -> np.ndarray:
    """Sample ids of the batch at ``cursor``: per-epoch permutation read at the global position."""
    pos = cursor["position"] + np.arange(cfg.global_batch)
    epochs, within = pos // cfg.n_samples, pos % cfg.n_samples
    out = np.empty(cfg.global_batch, dtype=np.int64)
    for e in np.unique(epochs):
        perm = np.random.default_rng([cursor["shuffle_seed"], int(e)]).permutation(cfg.n_samples)
        sel = epochs == e
        out[sel] = perm[within[sel]]
    return out


def advance(cursor: dict[str, int], cfg: Config) -> dict[str, int]:
    pos = cursor["position"] + cfg.global_batch
    return {"position": pos, "epoch": pos // cfg.n_samples, "shuffle_seed": cursor["shuffle_seed"]}


def _to_host_tree(tree: Any) -> Any:
    """Full host copies of every array leaf (gathers across processes when needed)."""
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            if not x.is_fully_addressable:
                return np.asarray(multihost_utils.process_allgather(x, tiled=True))
            return np.asarray(x)
        return x

    return jax.tree_util.tree_map(one, tree)


def digest_tree(tree: Any) -> dict[str, str]:
    """sha256 of every leaf's bytes (dtype and shape included), by key path."""
    from bridges.jax import flatten_with_keys

    flat, _ = flatten_with_keys(_to_host_tree(tree))
    out = {}
    for key, leaf in flat:
        a = np.asarray(leaf)
        h = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        out[key] = h.hexdigest()[:32]
    return out


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
    """Lay out a value that every process holds identically (works across processes)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        host = np.asarray(jax.random.key_data(value))
        # The key data's trailing dimensions (the implementation's words) are never split.
        phys = NamedSharding(sharding.mesh, P(*sharding.spec, *([None] * (host.ndim - len(sharding.spec)))))
        data = jax.make_array_from_callback(host.shape, phys, lambda idx: host[idx])
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


@nnx.jit
def _train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
    def loss_fn(m: MLP) -> tuple[jax.Array, jax.Array]:
        loss = jnp.mean((m(x) - y) ** 2)
        return loss * scale, loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
    optimizer.update(model, grads)
    return loss


class Trainer:
    """Model, optimizer, loss scale, data cursor and keys of one job, laid out on ``mesh``."""

    def __init__(self, cfg: Config, mesh: Mesh) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.x, self.y = dataset(cfg)
        self.model = MLP(cfg, nnx.Rngs(params=cfg.model_seed, dropout=cfg.model_seed + 1))
        schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.total_steps)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=cfg.weight_decay))
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
        self._place(self.model)
        self._place(self.optimizer)
        rep = NamedSharding(mesh, P())
        self.loss_scale = {"scale": _put(np.float32(cfg.loss_scale), rep), "good_steps": _put(np.int32(0), rep)}
        self.aux_key = _put(np.asarray(jax.random.PRNGKey(cfg.model_seed + 2)), rep)
        self.cursor = {"position": 0, "epoch": 0, "shuffle_seed": cfg.shuffle_seed}
        self.step = 0

    # -- layout ---------------------------------------------------------------------------
    def sharding_for(self, key: str, leaf: Any) -> NamedSharding:
        return NamedSharding(self.mesh, _spec(key, len(getattr(leaf, "shape", ()))))

    def _place(self, obj: Any) -> None:
        from bridges.jax import flatten_with_keys

        pure = nnx_state(obj)
        flat, treedef = flatten_with_keys(pure)
        placed = [_put(v, self.sharding_for(k, v)) if isinstance(v, jax.Array) else v for k, v in flat]
        nnx_load(obj, jax.tree_util.tree_unflatten(treedef, placed))

    # -- checkpointed state ---------------------------------------------------------------
    def checkpoint_state(self, *, with_optimizer: bool = True) -> dict[str, Any]:
        st = {"model": nnx_state(self.model), "loss_scale": dict(self.loss_scale), "aux_key": self.aux_key,
              "data": dict(self.cursor), "step": self.step}
        if with_optimizer:
            st["optimizer"] = nnx_state(self.optimizer)
        return st

    def target(self, *, with_optimizer: bool = True) -> dict[str, Any]:
        """A restore target laid out on this trainer's mesh."""
        from bridges.jax import abstract_target

        def shard(key: str, leaf: Any) -> NamedSharding:
            return self.sharding_for(key, leaf)

        return abstract_target(self.checkpoint_state(with_optimizer=with_optimizer), shard)

    def load(self, st: dict[str, Any]) -> None:
        nnx_load(self.model, st["model"])
        if "optimizer" in st:
            nnx_load(self.optimizer, st["optimizer"])
        self.loss_scale = dict(st["loss_scale"])
        self.aux_key = st["aux_key"]
        self.cursor = {k: int(v) for k, v in st["data"].items()}
        self.step = int(st["step"])

    # -- training -------------------------------------------------------------------------
    def _global(self, host: np.ndarray) -> jax.Array:
        sharding = NamedSharding(self.mesh, P("data", None))
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def train_step(self) -> tuple[float, list[int]]:
        """One optimizer step on the batch at the cursor. Returns (loss, batch ids)."""
        ids = batch_ids(self.cursor, self.cfg)
        x, y = self._global(self.x[ids]), self._global(self.y[ids])
        loss = _train_step(self.model, self.optimizer, x, y, self.loss_scale["scale"])
        self.cursor = advance(self.cursor, self.cfg)
        self.loss_scale["good_steps"] = self.loss_scale["good_steps"] + 1
        self.step += 1
        return float(loss), [int(i) for i in ids]
