"""Placing verified host blocks onto devices as one global ``jax.Array`` per leaf.

A restore of tens of thousands of small leaves spent most of its time in ``jax.device_put``'s
per-array Python work (an abstract value, a sharding and a tree broadcast for every device
shard). JAX's own host-array path (``jax.device_put(numpy_array, sharding)``) places all of one
array's device shards with a single call into its runtime, ``pxla.batched_device_put``; this
module makes that call with the restore's own blocks, one per device, so a CPU device takes each
block as is (no copy). That function is internal to JAX: where it is missing or refuses its
arguments, :func:`place_many` falls back to the public ``device_put`` plus
``make_array_from_single_device_arrays``, which give the same array.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["place_many"]


try:  # JAX's internals: where they moved, the public path alone
    from jax._src import core as _core
    from jax._src.interpreters import pxla as _pxla
except ImportError:
    _core = _pxla = None


def _runtime_put() -> Any:
    """JAX's one-call placement of a sharded array's device shards, or None."""
    put = getattr(_pxla, "batched_device_put", None)
    shaped = getattr(_core, "ShapedArray", None)
    if put is None or shaped is None:
        return None
    return lambda shape, dtype, sharding, xs, devices: put(shaped(tuple(shape), np.dtype(dtype)), sharding, xs, devices)


def place_many(leaves: Sequence[tuple[tuple[int, ...], Any, list[tuple[Any, np.ndarray]]]], *,
               runtime: bool = True) -> list[Any]:
    """Each ``(shape, sharding, [(device, block), ...])`` as a committed global array; every
    block is a fresh C-contiguous array the caller gives away (a device may keep it as its
    buffer), and no block is listed for two devices (the caller copies a replicated one).
    ``runtime=False``: the public path only."""
    put = _runtime_put() if runtime else None
    out: list[Any] = [None] * len(leaves)
    rest = list(range(len(leaves)))
    if put is not None:
        # A fully replicated array is left to the public path: the runtime keeps one block for
        # every device there, and no two device buffers of a restore may share memory.
        fast = [i for i in rest if len(leaves[i][2]) == 1 or not getattr(leaves[i][1], "is_fully_replicated", True)]
        try:
            for i in fast:
                shape, sharding, pairs = leaves[i]
                out[i] = put(shape, pairs[0][1].dtype, sharding, [b for _, b in pairs], [d for d, _ in pairs])
            rest = [i for i in rest if out[i] is None]
        except (TypeError, ValueError, AttributeError):  # its signature changed: the public path
            out, rest = [None] * len(leaves), list(range(len(leaves)))
    xs = [b for i in rest for _, b in leaves[i][2]]
    devices = [d for i in rest for d, _ in leaves[i][2]]
    placed = jax.device_put(xs, devices, may_alias=True) if xs else []
    at = 0
    for i in rest:
        shape, sharding, pairs = leaves[i]
        out[i] = jax.make_array_from_single_device_arrays(shape, sharding, placed[at:at + len(pairs)])
        at += len(pairs)
    return out
