"""The JAX manager's local tier (FORMAT.md 8.5): the peer exchange over JAX's collectives, and the
tier hooks (host copies of the own boxes, the boxes a target needs, arrays built from verified boxes).

The exchange is a ``jax.lax.ppermute`` of one ``uint8`` buffer per process over a one-axis mesh
of one device per process: a JAX collective across processes (gloo on CPU), never the
coordination service; each buffer moves once, to its one receiver. The buffer is padded to a
power of two that every process agrees on (``process_allgather`` of one integer), so a run
compiles one program per size.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ckptfmt import Box
from ckptfmt.errors import KeyMismatchError, ShapeMismatchError
from ckptfmt.manager._tiers import distinct_boxes

from ._jaxtree import flatten_with_keys, index_to_box, is_prng_key, physical_sharding

__all__ = ["JaxExchange", "snapshot", "requests", "build"]


class JaxExchange:
    """:class:`ckptfmt.manager._tiers.PeerExchange` over a JAX ``ppermute`` between one device of each
    process (a one-axis mesh of the first local device of every process)."""

    #: Not from a background thread: JAX's cross-process programs must start in the same order on
    #: every process, and the training loop launches its own (a local save exchanges in save()).
    background = False

    def __init__(self) -> None:
        self.rank, self.world = int(jax.process_index()), int(jax.process_count())
        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(self.world)]
        self.mesh = Mesh(np.array(devices), ("host",))
        self.device = devices[self.rank]
        self.sharding = NamedSharding(self.mesh, P("host"))
        self._programs: dict[int, Any] = {}

    def _program(self, offset: int) -> Any:
        if offset not in self._programs:
            perm = [(i, (i + offset) % self.world) for i in range(self.world)]
            body = jax.shard_map(lambda x: jax.lax.ppermute(x, "host", perm), mesh=self.mesh, in_specs=P("host"),
                             out_specs=P("host"))
            self._programs[offset] = jax.jit(body)
        return self._programs[offset]

    def _move(self, buf: np.ndarray, offset: int) -> np.ndarray:
        local = jax.device_put(buf[None, :], self.device)
        arr = jax.make_array_from_single_device_arrays((self.world, buf.size), self.sharding, [local])
        out = self._program(offset)(arr)
        return np.asarray(out.addressable_shards[0].data)[0]

    def shift(self, name: str, payload: bytes, offset: int) -> bytes:
        n = len(payload)
        lens = self._move(np.array([n], dtype=np.int64).view(np.uint8), offset).view(np.int64)
        # Padded to a power of two, the larger of the two lengths: one compiled program per size.
        size = 1 << max(max(n, int(lens[0])) - 1, 1).bit_length()
        size = int(np.asarray(multihost_utils.process_allgather(np.array([size], dtype=np.int64))).max())
        buf = np.zeros(size, dtype=np.uint8)
        buf[:n] = np.frombuffer(payload, dtype=np.uint8)
        return self._move(buf, offset)[:int(lens[0])].tobytes()


def snapshot(state: Any, extra: Any, rank_state: Any) -> tuple[list[Any], Any]:
    """This process's boxes as host copies (each distinct box once: its lowest local replica), and
    the global state as the bridge's save stages it."""
    from .jax import _stage

    shards, global_state, _, _ = _stage(state, extra, rank_state, None, blocking=False)
    return distinct_boxes(shards), global_state


def _physical(leaf: Any) -> tuple[tuple[int, ...], Any, Any]:
    """(shape, dtype, sharding) of what is stored for a target leaf: a typed PRNG key is its uint32
    key data (trailing key dimensions never split), as the bridge saves it."""
    if is_prng_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(data.shape), np.dtype(data.dtype), physical_sharding(leaf.sharding, tuple(leaf.shape), leaf.dtype)
    return tuple(leaf.shape), np.dtype(leaf.dtype), getattr(leaf, "sharding", None)


def _leaf_boxes(key: str, leaf: Any) -> list[tuple[Any, Box]] | None:
    if isinstance(leaf, np.ndarray):
        return [(None, Box.full(tuple(leaf.shape)))]
    if getattr(leaf, "sharding", None) is None or not hasattr(leaf, "dtype"):
        return None
    shape, _, sharding = _physical(leaf)
    return [(d, index_to_box(idx, shape)) for d, idx in sharding.addressable_devices_indices_map(shape).items()]


def requests(target: Any) -> list[tuple[str, Box]] | None:
    """The boxes ``target`` (arrays or ``jax.ShapeDtypeStruct`` with shardings; typed PRNG keys as
    their key data) needs here, or None when the tiers cannot serve it (no target, a leaf
    without a sharding)."""
    if target is None:
        return None
    try:
        flat, _ = flatten_with_keys(target)
    except (ValueError, TypeError):
        return None
    out: list[tuple[str, Box]] = []
    for key, leaf in flat:
        if not hasattr(leaf, "shape"):
            continue  # a scalar leaf comes from the global state
        boxes = _leaf_boxes(key, leaf)
        if boxes is None:
            return None
        out.extend(dict.fromkeys((key, b) for _, b in boxes))
    return out


def build(target: Any, values: Mapping[tuple[str, Box], np.ndarray], global_state: Any) -> tuple[Any, Any]:
    """The target's pytree rebuilt from verified boxes (a dtype or shape that differs raises:
    the ordinary restore then runs, which casts or reports as the bridge does)."""
    flat, treedef = flatten_with_keys(target)
    bridge = (global_state or {}).get("bridge") or {}
    scalars, impls = bridge.get("leaves", {}), bridge.get("prng_impls", {})
    leaves = []
    for key, leaf in flat:
        if not hasattr(leaf, "shape"):
            if key not in scalars:
                raise KeyMismatchError("a scalar leaf is not in the local step's state", key=key,
                                       expected="a saved leaf", found="missing")
            leaves.append(scalars[key])
            continue
        if isinstance(leaf, np.ndarray):
            shape, dtype, sharding = tuple(leaf.shape), leaf.dtype, None
        else:
            shape, dtype, sharding = _physical(leaf)
        parts = []
        for d, box in _leaf_boxes(key, leaf) or []:
            a = values[(key, box)]
            if a.dtype != dtype or tuple(a.shape) != box.shape:
                raise ShapeMismatchError("a local copy differs from the target", key=key, expected=f"{dtype} {box.shape}",
                                         found=f"{a.dtype} {tuple(a.shape)}")
            parts.append(a if d is None else jax.device_put(a, d))
        if isinstance(leaf, np.ndarray):
            leaves.append(np.array(parts[0]))
            continue
        arr = jax.make_array_from_single_device_arrays(shape, sharding, parts)
        if is_prng_key(leaf):
            if key not in impls:
                raise KeyMismatchError("a typed PRNG key has no implementation in the local step's state", key=key,
                                       expected="bridge.prng_impls entry", found="missing")
            arr = jax.random.wrap_key_data(arr, impl=impls[key])
        leaves.append(arr)
    return jax.tree_util.tree_unflatten(treedef, leaves), (global_state or {}).get("extra")
