"""State recipes: the bench's states shaped like what users train (``ckptfmt bench --state``).

A :class:`Recipe` is shapes only: each leaf's key, global shape, dtype and partition over a
``(data, model)`` mesh. Building one allocates nothing, so a recipe of 20,000 leaves is cheap to
make in every process, and a child rebuilds it from :meth:`Recipe.to_json`. Values are a pure
function of (leaf index, global element index) (:func:`box_bits`), so every writer makes only
its own boxes and every reader checks any box it holds, bit for bit, against the generator.

Recipes (:data:`STATES`; ``tensors16`` is the 16 float32 matrices of :mod:`.layout`):

- ``llama``: ``layers`` x (q, k, v, o with grouped kv = H/4, gate, up, down with I = 3.5 H, two
  RMS norms) + embedding (V = 16 H) + final norm + untied lm head = 9 L + 3 parameters, in
  bfloat16, each with float32 AdamW moments ``mu`` and ``nu``, and an int32 ``count``:
  27 L + 10 leaves (874 at L = 32). H, a multiple of 16, is chosen so that the bytes come
  closest to ``size``.
- ``moe``: ``layers`` x (q, k, v, o, a router, two norms, E experts x gate/up/down as separate
  tensors) + embedding, final norm, lm head, with the same moments and count; H = 64 and an
  expert width of 16, so each tensor is a few KiB and the per-leaf cost dominates. ``layers``
  (at most 16) and E are chosen so that the leaf count comes closest to ``leaves``, keeping
  about 8.5 experts per layer as the 20,000-leaf recipe (16 layers x 136 experts) has.

Partitions, Megatron's tensor parallelism over ``model`` with the other dimension over
``data`` (FSDP-style): column-parallel weights (q, k, v, gate, up, every expert's gate and up,
the lm head, H x V) ``P('data', 'model')``; row-parallel weights (o, down, every expert's down)
and the embedding (V x H: vocabulary-parallel, its vocabulary rows over ``model``)
``P('model', 'data')``; norms, routers and the count replicated. Moments are partitioned as
their parameter. N devices form the mesh :func:`mesh_shape` (N): (2, N / 2), so 8 devices are
(data = 2, model = 4) and a restore onto 4 is (2, 2): the model split changes, a true reshard.
DCP gets the same placements as DTensors on ``init_device_mesh('cpu', mesh_shape(N))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout import StateLayout

#: The bench's states: the default 16 float32 matrices (:mod:`.layout`), and the recipes here.
STATES = ("tensors16", "llama", "moe")
AXES = ("data", "model")
COL = ("data", "model")  # column-parallel: input features over data, output features over model
ROW = ("model", "data")  # row-parallel: input features over model
REP: tuple[str, ...] = ()  # replicated
_HIDDEN_STEP = 16  # H multiple: kv = H/4 and I = 3.5 H then divide by every mesh axis of 8 and 4 devices
_MOE_HIDDEN, _MOE_EXPERT_WIDTH, _MOE_MAX_LAYERS, _MOE_EXPERTS_PER_LAYER = 64, 16, 16, 8.5
_BITS = {"bfloat16": np.uint16, "float32": np.uint32, "int32": np.uint32}


@dataclass(frozen=True)
class Leaf:
    """One leaf of a recipe: its key path (``/``-joined), global shape, dtype and partition
    (one mesh axis name or None per dimension; empty for a replicated leaf)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[str | None, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(_BITS[self.dtype]).itemsize


@dataclass(frozen=True)
class Recipe:
    """The shapes of one recipe state (nothing allocated). ``args`` rebuild it (:meth:`from_json`)."""

    name: str
    args: tuple[tuple[str, int], ...]
    leaves: tuple[Leaf, ...]
    describe: str

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def parameters(self) -> int:
        return sum(1 for leaf in self.leaves if leaf.key.startswith("params/"))

    def keys(self) -> list[str]:
        return [leaf.key for leaf in self.leaves]

    def check_topologies(self, devices: tuple[int, ...]) -> None:
        """Raise ValueError unless every sharded dimension divides evenly on every topology."""
        for n in devices:
            mesh = dict(zip(AXES, mesh_shape(n)))
            for leaf in self.leaves:
                for dim, axis in zip(leaf.shape, leaf.spec):
                    if axis and dim % mesh[axis]:
                        raise ValueError(f"{self.name}: {leaf.key} {leaf.shape} does not split over {axis}={mesh[axis]} "
                                         f"of {n} devices (mesh {mesh_shape(n)})")

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.name, "args": dict(self.args), "describe": self.describe, "nbytes": self.nbytes,
                "leaves": len(self.leaves), "parameters": self.parameters, "tensors": len(self.leaves)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Recipe":
        return _RECIPES[d["recipe"]](**d["args"])


def mesh_shape(devices: int) -> tuple[int, int]:
    """The (data, model) mesh of ``devices`` devices or ranks: (2, N/2), or (1, N) for odd N."""
    return (2, devices // 2) if devices >= 2 and devices % 2 == 0 else (1, devices)


def _with_moments(params: list[tuple[str, tuple[int, ...], tuple]]) -> tuple[Leaf, ...]:
    leaves = [Leaf("params/" + k, s, "bfloat16", p) for k, s, p in params]
    for m in ("mu", "nu"):
        leaves += [Leaf(f"opt/{m}/{k}", s, "float32", p) for k, s, p in params]
    return tuple(leaves) + (Leaf("opt/count", (), "int32", REP),)


def _attention(prefix: str, h: int) -> list[tuple[str, tuple[int, ...], tuple]]:
    kv = h // 4
    return [(f"{prefix}/attn/q", (h, h), COL), (f"{prefix}/attn/k", (h, kv), COL), (f"{prefix}/attn/v", (h, kv), COL),
            (f"{prefix}/attn/o", (h, h), ROW), (f"{prefix}/attn_norm", (h,), REP), (f"{prefix}/mlp_norm", (h,), REP)]


def _ends(h: int) -> list[tuple[str, tuple[int, ...], tuple]]:
    v = 16 * h
    return [("embed", (v, h), ROW), ("final_norm", (h,), REP), ("lm_head", (h, v), COL)]


def llama_hidden(size: int, layers: int) -> int:
    """The hidden size H (a multiple of 16) whose Llama-style state comes closest to ``size`` bytes:
    (13 L + 32) H^2 elements of 2 + 4 + 4 bytes (a bf16 parameter, two f32 moments)."""
    h = math.sqrt(max(size, 1) / (10 * (13 * layers + 32)))
    return max(_HIDDEN_STEP, round(h / _HIDDEN_STEP) * _HIDDEN_STEP)


def llama(size: int, layers: int = 32) -> Recipe:
    """The Llama-style recipe of about ``size`` bytes with ``layers`` layers (module docstring)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    h = llama_hidden(size, layers)
    i = h * 7 // 2
    params: list = []
    for n in range(layers):
        p = f"layers/{n:02d}"
        params += _attention(p, h)
        params += [(f"{p}/mlp/gate", (h, i), COL), (f"{p}/mlp/up", (h, i), COL), (f"{p}/mlp/down", (i, h), ROW)]
    leaves = _with_moments(params + _ends(h))
    return Recipe("llama", (("size", size), ("layers", layers)), leaves,
                  f"Llama-style: {layers} layers, H={h}, kv={h // 4}, I={i}, V={16 * h}; {len(leaves)} leaves "
                  f"({(len(leaves) - 1) // 3} bf16 parameters, f32 mu and nu, int32 count)")


def moe_shape(leaves: int) -> tuple[int, int]:
    """(layers, experts) whose MoE state comes closest to ``leaves`` leaves (3 P + 1, with
    P = layers x (7 + 3 E) + 3 parameters), keeping about 8.5 experts per layer."""
    p = max((leaves - 1) / 3, 13)
    layers = max(1, min(_MOE_MAX_LAYERS, round(math.sqrt(p / (3 * _MOE_EXPERTS_PER_LAYER)))))
    experts = max(1, round(((p - 3) / layers - 7) / 3))
    return layers, experts


def moe(leaves: int) -> Recipe:
    """The per-expert MoE recipe of about ``leaves`` leaves (module docstring)."""
    layers, experts = moe_shape(leaves)
    h, f = _MOE_HIDDEN, _MOE_EXPERT_WIDTH
    params: list = []
    for n in range(layers):
        p = f"layers/{n:02d}"
        params += _attention(p, h) + [(f"{p}/moe/router", (h, experts), REP)]
        for e in range(experts):
            x = f"{p}/moe/experts/{e:03d}"
            params += [(f"{x}/gate", (h, f), COL), (f"{x}/up", (h, f), COL), (f"{x}/down", (f, h), ROW)]
    out = _with_moments(params + _ends(h))
    return Recipe("moe", (("leaves", leaves),), out,
                  f"per-expert MoE: {layers} layers x {experts} experts (gate/up/down {h}x{f} each), H={h}; "
                  f"{len(out)} leaves ({(len(out) - 1) // 3} bf16 parameters, f32 mu and nu, int32 count)")


_RECIPES = {"llama": llama, "moe": moe}


def recipe(state: str, *, size: int, layers: int, leaves: int) -> Recipe:
    """The recipe named ``state`` (``llama``: ``size`` and ``layers``; ``moe``: ``leaves``)."""
    if state == "llama":
        return llama(size, layers)
    if state == "moe":
        return moe(leaves)
    raise ValueError(f"unknown state recipe {state!r}; known: {', '.join(_RECIPES)}")


def state_from_json(d: dict[str, Any]) -> "StateLayout | Recipe":
    """The state a child was given (its params' ``layout``): a recipe, or the 16-matrix layout."""
    return Recipe.from_json(d) if "recipe" in d else StateLayout.from_json(d)


# --------------------------------------------------------------------------- values


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: uint64 arithmetic wraps, which is the point
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def box_bits(leaf_index: int, leaf: Leaf, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The raw bits (uint16 for bfloat16, uint32 otherwise) of the box ``offset``/``shape`` of a leaf.

    Every value is finite (a fixed exponent, random sign and mantissa), so no system can change
    a value by canonicalising a NaN; the check compares bits."""
    idx = np.zeros(shape, dtype=np.uint64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        ax = np.arange(offset[d], offset[d] + shape[d], dtype=np.uint64) * np.uint64(stride)
        idx += ax.reshape((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= leaf.shape[d]
    # 1-d while mixing: numpy turns 0-d results into scalars, whose arithmetic warns on the wrap
    h = _mix(idx.reshape(-1) + np.uint64((leaf_index + 1) * 0x9E3779B97F4A7C15 % 2**64)) >> np.uint64(32)
    if leaf.dtype == "bfloat16":
        bits = (((h >> np.uint64(16)) & np.uint64(0x807F)) | np.uint64(0x3C00)).astype(np.uint16)
    elif leaf.dtype == "float32":
        bits = ((h & np.uint64(0x807FFFFF)) | np.uint64(0x3C000000)).astype(np.uint32)
    else:
        bits = (h & np.uint64(0x7FFFFFFF)).astype(np.uint32)
    return bits.reshape(shape)


def numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes  # JAX's own bfloat16; only the JAX children build bfloat16 arrays

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def box_data(leaf_index: int, leaf: Leaf, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The values of a box of a leaf, in the leaf's dtype."""
    return box_bits(leaf_index, leaf, offset, shape).view(numpy_dtype(leaf.dtype))


def check_box(leaf_index: int, leaf: Leaf, offset: tuple[int, ...], got: Any) -> int:
    """Raise AssertionError unless ``got`` has the bits of the box at ``offset``; return its bytes."""
    got = np.array(got, order="C")  # a copy that keeps a 0-d array 0-d (ascontiguousarray would not)
    want = box_bits(leaf_index, leaf, offset, tuple(got.shape))
    if got.dtype.itemsize != want.dtype.itemsize or not np.array_equal(got.view(want.dtype), want):
        raise AssertionError(f"{leaf.key} box at {offset} {got.shape} {got.dtype}: restored data differs")
    return got.nbytes


def rank_box(leaf: Leaf, devices: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(offset, shape, first) of the box that ``rank`` of ``devices`` holds on the mesh
    :func:`mesh_shape` (ranks in row-major mesh order, as ``init_device_mesh`` and the JAX mesh
    lay them out); ``first``: the lowest replica of that box (coordinate 0 on every axis that
    does not split the leaf)."""
    mesh = mesh_shape(devices)
    coords = dict(zip(AXES, (rank // mesh[1], rank % mesh[1])))
    sizes = dict(zip(AXES, mesh))
    offset, shape = [], []
    for dim, axis in zip(leaf.shape, leaf.spec):
        n = sizes[axis] if axis else 1
        offset.append(coords[axis] * (dim // n) if axis else 0)
        shape.append(dim // n)
    if not leaf.spec:
        offset, shape = [0] * len(leaf.shape), list(leaf.shape)
    first = all(coords[a] == 0 for a in AXES if a not in leaf.spec)
    return tuple(offset), tuple(shape), first
