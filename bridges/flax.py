"""Flax and optax specifics of the JAX bridge.

The JAX bridge saves any pytree; this module turns Flax objects into plain pytrees and back.

* **NNX** (``nnx.Module``, ``nnx.Optimizer``, anything ``nnx.state`` accepts):
  :func:`nnx_state` returns the object's state as a pure nested dict of arrays (``nnx.Variable``
  wrappers removed, so key paths read ``model/l1/kernel`` rather than ``model/l1/kernel/value``).
  :func:`nnx_target` returns the matching restore target (ShapeDtypeStructs with the live
  object's shardings, or with shardings from a callable), and :func:`nnx_load` writes a restored
  pure dict back into the object in place. The dropout/param ``nnx.Rngs`` state is part of the
  model state (a typed key and a counter), so it round-trips with the model.
* **Linen** ``flax.training.train_state.TrainState`` is a pytree already: save it as is; restore
  with ``bridges.jax.abstract_target(state)`` (or a TrainState of ShapeDtypeStructs) as target.
  Its ``apply_fn`` and ``tx`` are static fields and come from the target.
* **optax** states are NamedTuples and tuples (``ScaleByAdamState(count, mu, nu)`` inside a
  chain's tuple, schedules' ``count``), so their key paths read
  ``opt_state/0/mu/params/...``; ``EmptyState()`` holds no leaves and needs nothing.
"""
from __future__ import annotations

from bridges._requires import require

require("bridges.flax", "jax", "jax", "flax")  # before the framework imports: names the extra

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from bridges.jax import abstract_target

__all__ = ["nnx_state", "nnx_target", "nnx_load", "tree_equal_bits"]


def nnx_state(obj: Any, *filters: Any) -> dict[str, Any]:
    """The state of an NNX object as a pure nested dict (a fresh dict; ``obj`` is untouched)."""
    return nnx.state(obj, *filters).to_pure_dict() if filters else nnx.state(obj).to_pure_dict()


def nnx_target(obj: Any, sharding: Callable[[str, Any], Any] | Any = None) -> dict[str, Any]:
    """A restore target for :func:`nnx_state` of ``obj``.

    ``obj`` may be live or abstract (``nnx.eval_shape``). Leaves become ShapeDtypeStructs with
    ``sharding(key_path, leaf)`` when given (a callable or one Sharding), else the leaf's own
    placement (an uncommitted leaf, such as optax's ``count``, comes back uncommitted:
    :func:`bridges.jax.abstract_target`).
    """
    return abstract_target(nnx_state(obj), sharding)


def nnx_load(obj: Any, pure: dict[str, Any]) -> None:
    """Write a restored pure dict into ``obj`` in place (``nnx.update``).

    Raises ValueError (from flax) when ``pure`` does not have the object's structure.
    """
    state = nnx.state(obj)
    state.replace_by_pure_dict(pure)
    nnx.update(obj, state)


def tree_equal_bits(a: Any, b: Any) -> bool:
    """True when two pytrees have the same structure and bit-identical leaves (host-side)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True
