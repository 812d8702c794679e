"""Values that cross layers: boxes, sharding descriptions, local shards."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np

__all__ = ["Box", "TensorSharding", "LocalShard"]


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular region of a tensor in global coordinates: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offset", _int_tuple(self.offset))
        object.__setattr__(self, "shape", _int_tuple(self.shape))
        if len(self.offset) != len(self.shape):
            raise ValueError(f"box offset {self.offset} and shape {self.shape} differ in rank")

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> "Box":
        return cls(_ZEROS[len(shape)] if len(shape) < len(_ZEROS) else (0,) * len(shape), tuple(shape))

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # exact Python ints: no int64 overflow for any declared shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The overlap of two boxes, or None when they do not overlap (or either is empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= l for l, h in zip(lo, hi)):
            return None if self.ndim else Box((), ())
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices(self, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
        """Slices selecting this box inside an array whose first element sits at ``origin``."""
        origin = origin or (0,) * self.ndim
        return tuple(slice(o - g, o - g + s) for o, s, g in zip(self.offset, self.shape, origin))

    def to_json(self) -> dict[str, list[int]]:
        return {"offset": list(self.offset), "shape": list(self.shape)}


@dataclass(frozen=True)
class TensorSharding:
    """A framework-neutral description of how a tensor was sharded at save time (informative only).

    ``partition[d]`` lists the mesh axes that split tensor dimension ``d`` (None: not split).
    ``replicated_axes`` are mesh axes over which the tensor is replicated.
    """

    framework: str = ""
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] = ()
    partition: tuple[tuple[str, ...] | None, ...] = ()
    replicated_axes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"framework": self.framework, "mesh_shape": list(self.mesh_shape),
                "axis_names": list(self.axis_names),
                "partition": [None if p is None else list(p) for p in self.partition],
                "replicated_axes": list(self.replicated_axes)}


ArrayLike = Union[np.ndarray, Callable[[], np.ndarray]]


@dataclass(frozen=True, eq=False, slots=True)
class LocalShard:
    """One block of a global tensor held by this process.

    ``data`` is a host array of shape ``box.shape`` or a zero-argument callable returning one
    (for lazy device-to-host copies), or None: the region is held but this process offers no
    data for it. Each shard is written once, by one holder that offers data; copies of the same
    region on several processes (replicas) take turns (FORMAT.md 8.1). ``source``, when given, is
    the object ``data`` comes from (the JAX bridge passes the global ``jax.Array``): the same
    object with the same digest of its block as the last time this process saved it proves the
    bytes equal without reading the stored object (an incremental save's identity proof,
    FORMAT.md 8.4; the identity alone proves nothing, as a buffer may be shared).
    """

    key: str
    global_shape: tuple[int, ...]
    dtype: Any
    box: Box
    data: ArrayLike | None = None
    replica_id: int = 0
    sharding: TensorSharding | None = None
    source: object = field(default=None, compare=False, repr=False)  # a framework's array: the core never names its type

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", _int_tuple(self.global_shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    def materialize(self) -> np.ndarray:
        d = self.data() if callable(self.data) else self.data
        if d is None:
            raise ValueError(f"shard of {self.key!r} at {self.box} has no data")
        return np.asarray(d)


#: The origin of each rank up to 8: every whole box of that rank shares it (a constant).
_ZEROS: tuple[tuple[int, ...], ...] = tuple((0,) * n for n in range(9))


def _int_tuple(values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints: the very tuple when it is one already (a save of many
    tensors then keeps one shape tuple per tensor, not one per object that names it)."""
    if type(values) is tuple and all(type(x) is int for x in values):
        return values
    return tuple(int(x) for x in values)
