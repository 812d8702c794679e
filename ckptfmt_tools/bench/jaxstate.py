"""The benchmark state as JAX arrays: the 16 matrices row-sharded over N CPU devices, or a
state recipe (:mod:`.states`) on a (data, model) mesh of N devices.

Imported only inside child processes whose ``XLA_FLAGS`` already set the
device count (see :func:`xla_env`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .layout import StateLayout, block_data, check_rows

if TYPE_CHECKING:
    from .states import Recipe


def xla_env(devices: int) -> dict[str, str]:
    """Environment for a child that needs ``devices`` host CPU devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def row_sharding(devices: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = jax.devices()[:devices]
    if len(devs) != devices:
        raise RuntimeError(f"need {devices} JAX devices, have {len(jax.devices())}; set XLA_FLAGS first")
    mesh = Mesh(np.array(devs), ("rows",))
    return NamedSharding(mesh, PartitionSpec("rows", None))


def make_state(layout: StateLayout, devices: int) -> dict:
    """{key: jax.Array}, each sharded by rows over ``devices``; each device's rows made once."""
    import jax
    import numpy as np

    sharding = row_sharding(devices)
    per = layout.blocks // devices
    n = layout.rows // layout.blocks

    def make(i: int):
        def cb(index):
            start = index[0].start or 0
            b0 = start // n
            return np.concatenate([block_data(layout, i, b0 + k) for k in range(per)]) if per > 1 else block_data(layout, i, b0)

        return jax.make_array_from_callback(layout.shape, sharding, cb)

    state = nest({layout.key(i): make(i) for i in range(layout.tensors)})
    jax.block_until_ready(jax.tree.leaves(state))
    return state


def nest(flat: dict) -> dict:
    """{"a/b": x} -> {"a": {"b": x}} (framework key paths from the layout's flat keys)."""
    out: dict = {}
    for k, v in flat.items():
        *parents, leaf = k.split("/")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def flat(tree: dict, prefix: str = "") -> dict:
    """The inverse of :func:`nest`."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "/"))
        else:
            out[prefix + k] = v
    return out


def abstract_state(layout: StateLayout, devices: int) -> dict:
    """Target shapes, dtypes and shardings for a restore onto ``devices``."""
    import jax
    import numpy as np

    sharding = row_sharding(devices)
    return nest({k: jax.ShapeDtypeStruct(layout.shape, np.float32, sharding=sharding) for k in layout.keys()})


def check_state(layout: StateLayout, state: dict, devices: int) -> int:
    """Check every restored device shard against the generator; return bytes checked."""
    checked = 0
    state = flat(state)
    for i, key in enumerate(layout.keys()):
        arr = state[key]
        if len(arr.sharding.device_set) != devices:
            raise AssertionError(f"{key}: restored onto {len(arr.sharding.device_set)} devices, wanted {devices}")
        for shard in arr.addressable_shards:
            start = shard.index[0].start or 0
            data = shard.data
            check_rows(layout, i, start, start + data.shape[0], data)
            checked += data.nbytes
    return checked


# --------------------------------------------------------------------------- state recipes (states.py)


def recipe_mesh(devices: int):
    """The (data, model) JAX mesh of :func:`ckptfmt_tools.bench.states.mesh_shape` over ``devices``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from .states import AXES, mesh_shape

    devs = jax.devices()[:devices]
    if len(devs) != devices:
        raise RuntimeError(f"need {devices} JAX devices, have {len(jax.devices())}; set XLA_FLAGS first")
    return Mesh(np.array(devs).reshape(mesh_shape(devices)), AXES)


def _recipe_sharding(mesh, leaf):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*leaf.spec))


def make_recipe_state(recipe: "Recipe", devices: int) -> dict:
    """A recipe's state as JAX arrays on ``devices``; each device's boxes made once, from the generator."""
    import jax

    from .states import box_data

    mesh = recipe_mesh(devices)

    def make(i: int, leaf):
        def cb(index):
            offset = tuple(sl.start or 0 for sl in index)
            shape = tuple((sl.stop if sl.stop is not None else n) - (sl.start or 0) for sl, n in zip(index, leaf.shape))
            return box_data(i, leaf, offset, shape)

        return jax.make_array_from_callback(leaf.shape, _recipe_sharding(mesh, leaf), cb)

    state = nest({leaf.key: make(i, leaf) for i, leaf in enumerate(recipe.leaves)})
    jax.block_until_ready(jax.tree.leaves(state))
    return state


def abstract_recipe_state(recipe: "Recipe", devices: int) -> dict:
    """Target shapes, dtypes and shardings of a recipe's state on ``devices``."""
    import jax

    from .states import numpy_dtype

    mesh = recipe_mesh(devices)
    return nest({leaf.key: jax.ShapeDtypeStruct(leaf.shape, numpy_dtype(leaf.dtype), sharding=_recipe_sharding(mesh, leaf))
                 for leaf in recipe.leaves})


def check_recipe_state(recipe: "Recipe", state: dict, devices: int) -> int:
    """Check every device shard of every leaf, bit for bit; return the bytes of the distinct boxes
    checked (replica 0 of each), which equal the state's bytes when everything came back."""
    from .states import check_box

    state = flat(state)
    if len(state) != len(recipe.leaves):
        raise AssertionError(f"restored {len(state)} leaves, the recipe has {len(recipe.leaves)}")
    checked = 0
    for i, leaf in enumerate(recipe.leaves):
        arr = state[leaf.key]
        if tuple(arr.shape) != leaf.shape or len(arr.sharding.device_set) != devices:
            raise AssertionError(f"{leaf.key}: restored {arr.shape} onto {len(arr.sharding.device_set)} devices, "
                                 f"wanted {leaf.shape} onto {devices}")
        for shard in arr.addressable_shards:
            n = check_box(i, leaf, tuple(sl.start or 0 for sl in shard.index), shard.data)
            checked += n if shard.replica_id == 0 else 0
    return checked


def state_arrays(layout: "StateLayout | Recipe", devices: int) -> dict:
    """:func:`make_state` or :func:`make_recipe_state`, by the kind of state."""
    return make_recipe_state(layout, devices) if _is_recipe(layout) else make_state(layout, devices)


def state_target(layout: "StateLayout | Recipe", devices: int) -> dict:
    """:func:`abstract_state` or :func:`abstract_recipe_state`, by the kind of state."""
    return abstract_recipe_state(layout, devices) if _is_recipe(layout) else abstract_state(layout, devices)


def state_check(layout: "StateLayout | Recipe", state: dict, devices: int) -> int:
    """:func:`check_state` or :func:`check_recipe_state`, by the kind of state."""
    return check_recipe_state(layout, state, devices) if _is_recipe(layout) else check_state(layout, state, devices)


def _is_recipe(layout: object) -> bool:
    from .states import Recipe

    return isinstance(layout, Recipe)
