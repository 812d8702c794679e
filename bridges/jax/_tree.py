"""Pytree <-> ckptfmt vocabulary for the JAX bridge: key paths, boxes, sharding descriptions.

Key path rendering (the JAX profile, spec/FORMAT.md 13.2; see ``render_path``):

==========================  ==========================================  ===========
pytree key entry            example                                     component
==========================  ==========================================  ===========
``DictKey``                 ``{"params": ...}``, ``{0: ...}``           ``params``, ``0``
``GetAttrKey``              dataclass / namedtuple field ``mu``         ``mu``
``SequenceKey``             list or tuple index 3                       ``3``
``FlattenedIndexKey``       custom node child 1                         ``1``
==========================  ==========================================  ===========

Components are joined with ``/``. A component must be non-empty and must not contain ``/``;
dict keys must be ``str`` or ``int``. Two leaves whose paths render to the same string are an
error (``{0: a, "0": b}``). Violations raise ``ValueError`` naming the offending path, before
anything is written; a node that contains itself raises ``ReferenceCycleError`` naming the key
path where the cycle closes (checked before ``jax.tree_util`` sees the tree).
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

import jax
import numpy as np
from jax._src import sharding_impls  # physical_sharding has no public equivalent in jax 0.10
from jax.sharding import NamedSharding, PartitionSpec

from ckptfmt import Box, TensorSharding
from ckptfmt.errors import ReferenceCycleError

__all__ = [
    "render_path", "flatten_with_keys", "index_to_box", "describe_sharding", "is_prng_key",
    "physical_sharding", "placement", "nest", "check_acyclic",
]

_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex, str, bytes)


def _component(entry: Any, so_far: str) -> str:
    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        k = entry.key
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (str, int, np.integer)):
            raise ValueError(f"pytree dict key {k!r} under {so_far or '<root>'!r} has type "
                             f"{type(k).__name__}; only str and int keys can name a tensor")
        text = str(operator.index(k)) if not isinstance(k, str) else k
    elif isinstance(entry, tu.GetAttrKey):
        text = entry.name
    elif isinstance(entry, tu.SequenceKey):
        text = str(entry.idx)
    elif isinstance(entry, tu.FlattenedIndexKey):
        text = str(entry.key)
    else:
        raise ValueError(f"pytree key entry {entry!r} under {so_far or '<root>'!r} has an "
                         f"unsupported type {type(entry).__name__}")
    if not text or "/" in text:
        raise ValueError(f"pytree key {text!r} under {so_far or '<root>'!r} cannot be part of a "
                         "key path: components must be non-empty and must not contain '/'")
    return text


def render_path(path: Iterable[Any]) -> str:
    """Render a pytree key path as a ckptfmt key path (components joined with ``/``)."""
    out = ""
    for entry in path:
        c = _component(entry, out)
        out = f"{out}/{c}" if out else c
    return out


def _children(node: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``node``'s direct pytree children with their key entries (``[((), node)]`` for a leaf):
    jax.tree_util's own flattening, one level deep (every node below the first is a leaf)."""
    first = [True]

    def below(_: Any) -> bool:
        was, first[0] = first[0], False
        return not was

    return jax.tree_util.tree_flatten_with_path(node, is_leaf=below)[0]


def _where(so_far: str, path: tuple[Any, ...]) -> str:
    try:
        rest = render_path(path)
    except ValueError:  # an unrenderable key is reported later, by flatten_with_keys
        rest = jax.tree_util.keystr(path)
    return f"{so_far}/{rest}" if so_far else rest


def check_acyclic(tree: Any) -> None:
    """Raise ReferenceCycleError, naming the key path where the cycle closes, if a node of
    ``tree`` contains itself. jax.tree_util meets such a tree with a SystemError (after a
    RecursionError inside its C++ code), so this runs first, iteratively, one level at a time."""
    above = {id(tree)}
    stack = [(tree, "", iter(_children(tree)))]
    while stack:
        node, where, kids = stack[-1]
        nxt = next(kids, None)
        if nxt is None:
            above.discard(id(node))
            stack.pop()
            continue
        path, child = nxt
        if isinstance(child, _LEAVES) or child is None:
            continue
        key = _where(where, path)
        if id(child) in above:
            raise ReferenceCycleError(f"pytree node {key!r} contains itself (a reference cycle closes here)", key=key,
                                      expected="a tree", found=f"a {type(child).__name__} seen above")
        grand = _children(child)
        if len(grand) == 1 and not grand[0][0] and grand[0][1] is child:
            continue  # a leaf
        above.add(id(child))
        stack.append((child, key, iter(grand)))


# The rendered key paths of a tree structure: a job saves a state of one structure at every step,
# so its paths are rendered and checked once, not once per leaf per save (2.5 ms a save of the
# 874-leaf state, docs/profile-save.md). Keyed by the treedef and its text: treedefs compare dict
# keys by ``==`` (``{1: x}`` equals ``{True: x}``, which must raise), their texts by ``repr``.
# Bounded (a job saves and restores a few structures); one that cannot be hashed is rendered every time.
_KEYS: dict[tuple[Any, str], tuple[str, ...]] = {}
_KEYS_MAX = 32


def _render_keys(tree: Any) -> tuple[str, ...]:
    """The key path of each leaf of ``tree``, in pytree order, checked (see flatten_with_keys)."""
    out: list[str] = []
    seen: set[str] = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = render_path(path)
        if not key:
            raise ValueError("the state is a single leaf; wrap it in a container, e.g. {'x': array}")
        if key in seen:
            raise ValueError(f"two pytree leaves render to the same key path {key!r}")
        seen.add(key)
        out.append(key)
    return tuple(out)


def flatten_with_keys(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """Flatten ``tree`` to ``[(key path, leaf)]`` in pytree order, plus its treedef.

    Raises ValueError for a bare leaf (no key path), an unrenderable key, or two leaves
    whose key paths collide; ReferenceCycleError (a CheckpointError) for a node that contains
    itself.
    """
    check_acyclic(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    cache_key: tuple[Any, str] | None = (treedef, str(treedef))
    try:
        keys = _KEYS.get(cache_key)  # type: ignore[arg-type]
    except TypeError:  # unhashable auxiliary data in a custom node
        keys, cache_key = None, None
    if keys is None:
        keys = _render_keys(tree)
        if cache_key is not None:
            if len(_KEYS) >= _KEYS_MAX:
                _KEYS.clear()
            _KEYS[cache_key] = keys
    if len(keys) != len(leaves):  # the tree changed between the two flattens (another thread)
        raise ValueError(f"the tree has {len(leaves)} leaves but its key paths name {len(keys)}: was it "
                         "modified by another thread while it was being flattened?")
    return list(zip(keys, leaves)), treedef


def index_to_box(index: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
    """The global box addressed by a shard index (a tuple of slices, as in ``Shard.index``)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    offset, size = [], []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"shard index {index} has a strided slice")
        offset.append(start)
        size.append(max(stop - start, 0))
    return Box(tuple(offset), tuple(size))


def _spec_entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...] | None]:
    out: list[tuple[str, ...] | None] = []
    for e in tuple(spec)[:ndim]:
        if e is None or e is PartitionSpec.UNCONSTRAINED:
            out.append(None)
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e) or None)
    return out + [None] * (ndim - len(out))


def describe_sharding(sharding: Any, ndim: int) -> TensorSharding | None:
    """A framework-neutral description of a NamedSharding (None for other shardings).

    Informative only: restore never depends on it.
    """
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    names = tuple(str(n) for n in mesh.axis_names)
    partition = _spec_entries(sharding.spec, ndim)
    used = {a for p in partition if p for a in p}
    return TensorSharding(
        framework="jax", mesh_shape=tuple(int(mesh.shape[n]) for n in mesh.axis_names),
        axis_names=names, partition=tuple(partition),
        replicated_axes=tuple(n for n in names if n not in used))


def is_prng_key(x: Any) -> bool:
    """True for typed PRNG key arrays (and ShapeDtypeStructs of a key dtype)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype):  # a numpy dtype (bfloat16 too) is never a key's
        return False
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def placement(leaf: Any) -> Any:
    """The sharding ``leaf`` asks a restore for, or None where it leaves the placement to JAX.

    None for an uncommitted ``jax.Array`` (one that JAX placed by default, as ``jnp.zeros`` or
    optax's ``count`` are: a jitted computation moves it to the devices of its other arguments)
    and for a ShapeDtypeStruct without a sharding; a committed array's own sharding otherwise,
    one device included (a leaf put there on purpose stays there).
    """
    if isinstance(leaf, jax.Array) and not leaf.committed:
        return None
    return getattr(leaf, "sharding", None)


def physical_sharding(sharding: Any, logical_shape: tuple[int, ...], dtype: Any) -> Any:
    """The sharding of ``key_data(keys)`` for typed keys of ``dtype`` laid out with ``sharding``.

    The trailing key-data dimensions are never split.
    """
    return sharding_impls.physical_sharding(jax.core.ShapedArray(tuple(logical_shape), dtype), sharding)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts from ``{"a/b/c": v}``. Raises ValueError when a path is both a leaf and a prefix."""
    root: dict[str, Any] = {}
    for key in sorted(flat):
        node = root
        parts = key.split("/")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ValueError(f"key path {key!r} lies beneath the leaf {p!r}")
            node = child
        if parts[-1] in node:
            raise ValueError(f"key path {key!r} is both a leaf and a prefix of other keys")
        node[parts[-1]] = flat[key]
    return root
