"""The benchmark state as JAX arrays, row-sharded over N CPU devices.

Imported only inside child processes whose ``XLA_FLAGS`` already set the
device count (see :func:`xla_env`).
"""

from __future__ import annotations

import os

from .layout import StateLayout, block_data, check_rows


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
