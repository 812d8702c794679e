"""ckptfmt runs: save from N JAX CPU devices, restore onto M, and a 1/N slice reader.

Each function is a child task (see :mod:`ckptfmt_tools.bench.child`). The JAX bridge
(``bridges.jax``) is used when it is importable; otherwise the core API is
driven directly with :class:`ckptfmt.LocalShard` objects (lazy device-to-host
copies from JAX, or numpy blocks when JAX is not installed). Each result
says which path ran (``api``).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
from typing import Any

from .child import Meter, rss_bytes, sync_after, tree_stats
from .layout import StateLayout, check_rows, rows_data
from .states import Recipe, state_from_json

STEP = 1


def _bridge() -> Any | None:
    try:
        from bridges import jax as bridge  # type: ignore[import-not-found]
    except ImportError:
        return None
    if hasattr(bridge, "save") and hasattr(bridge, "restore"):
        return bridge
    return None


def local_path(url: str) -> str | None:
    """The local directory behind a repository URL, or None for remote storage."""
    if "://" not in url:
        return os.path.abspath(url)
    scheme, rest = url.split("://", 1)
    return "/" + rest.lstrip("/") if scheme == "file" else None


def storage_stats(url: str) -> dict[str, int | None]:
    """Objects and bytes stored under a repository URL."""
    path = local_path(url)
    if path is not None:
        return tree_stats(path)
    import tensorstore as ts

    from ckptfmt.storage._kvurl import kvstore_spec

    keys = ts.KvStore.open(kvstore_spec(url)).result().list().result()
    return {"objects": len(keys), "bytes_on_disk": None}


def clear_repository(url: str) -> None:
    """Remove everything stored under a repository URL (the bench's own scratch repositories only)."""
    path = local_path(url)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
    else:
        import tensorstore as ts

        from ckptfmt.storage._kvurl import kvstore_spec

        kv = ts.KvStore.open(kvstore_spec(url)).result()
        kv.delete_range(ts.KvStore.KeyRange()).result()


def _api(params: dict) -> str:
    """Which path to drive: "bridge" (bridges.jax), "core-jax" or "core-numpy" (no JAX installed)."""
    api = params.get("api", "auto")
    if api != "auto":
        return api
    if importlib.util.find_spec("jax") is None:
        return "core-numpy"
    return "bridge" if _bridge() is not None else "core-jax"


def _jax_shards(state: dict) -> list:
    import numpy as np

    from ckptfmt import Box, LocalShard
    from .jaxstate import flat

    shards = []
    for key, arr in flat(state).items():
        for s in arr.addressable_shards:
            if s.replica_id != 0:
                continue
            offset = tuple(sl.start or 0 for sl in s.index)
            shards.append(LocalShard(key, arr.shape, arr.dtype, Box(offset, s.data.shape), data=lambda d=s.data: np.asarray(d)))
    return shards


def _numpy_shards(layout: StateLayout, writers: int) -> list:
    from ckptfmt import Box, LocalShard

    shards = []
    for i, key in enumerate(layout.keys()):
        for w in range(writers):
            r0, r1 = layout.rows_of(w, writers)
            shards.append(LocalShard(key, layout.shape, "float32", Box((r0, 0), (r1 - r0, layout.cols)), data=rows_data(layout, i, r0, r1)))
    return shards


def _row_boxes(layout: StateLayout, parts: int) -> list:
    from ckptfmt import Box

    out = []
    for key in layout.keys():
        for d in range(parts):
            r0, r1 = layout.rows_of(d, parts)
            out.append((key, Box((r0, 0), (r1 - r0, layout.cols))))
    return out


def save(params: dict) -> dict:
    """Child task: a durable ckptfmt save (returns after commit) from N devices (or N numpy shards).

    The first save is the fresh-process one (``phase``). With ``steady``, the same state is then
    saved again in the same process into a second repository (``steady``: the steady-state save
    of a long-lived job), which is removed afterwards. Both report ckptfmt's own per-phase
    seconds as ``save_t_<phase>_s``.
    """
    import ckptfmt

    _engine_before_the_clock()
    layout, url, devices = state_from_json(params["layout"]), params["url"], params["devices"]
    api = _api(params)
    _recipe_api(layout, api)
    if api != "core-numpy":
        import jax  # noqa: F401  -- imported before the base RSS is taken

        from .jaxstate import state_arrays
    clear_repository(url)
    rss_base = rss_bytes()
    if api == "bridge":
        state = state_arrays(layout, devices)
        label = "bridges.jax.save"

        def run(to: str, timings: dict) -> None:
            _bridge().save(to, state, step=STEP, options=ckptfmt.SaveOptions(timings=timings))
    else:
        shards = _jax_shards(state_arrays(layout, devices)) if api == "core-jax" else _numpy_shards(layout, devices)
        label = f"ckptfmt.save ({api}, LocalShard)"

        def run(to: str, timings: dict) -> None:
            ckptfmt.save(to, STEP, shards, coordinator=ckptfmt.LocalCoordinator(), options=ckptfmt.SaveOptions(timings=timings))
    timings: dict[str, float] = {}
    with Meter("save") as m:
        run(url, timings)
    sync_s = sync_after()
    out = {"phase": m.result | {"rss_base": rss_base, "state_bytes": layout.nbytes, "api": label, "sync_after_s": sync_s}
           | _phase_fields(timings), "disk": storage_stats(url)}
    if params.get("steady"):
        again = url.rstrip("/") + "-steady"
        clear_repository(again)
        os.sync()
        timings = {}
        with Meter("save_steady") as m2:
            run(again, timings)
        out["steady"] = m2.result | {"state_bytes": layout.nbytes, "api": label, "sync_after_s": sync_after()} | _phase_fields(timings)
        clear_repository(again)
    return out


def _engine_before_the_clock() -> None:
    """Import tensorstore, the storage engine ckptfmt opens lazily (on a repository's first
    open), before the clock starts: the peers' children import their whole stacks first (Orbax
    imports tensorstore, DCP torch), so no system's clock holds a library import. Right after a
    page-cache drop that import took about 0.13 s inside ckptfmt's restore."""
    import tensorstore  # noqa: F401


def _recipe_api(layout: "StateLayout | Recipe", api: str) -> None:
    """A state recipe (its pytree of sharded arrays) is saved and restored through the bridge only."""
    if isinstance(layout, Recipe) and api != "bridge":
        raise ValueError(f"the {layout.name} state recipe runs through bridges.jax only, not {api!r}")


def _phase_fields(timings: dict[str, float]) -> dict[str, float]:
    return {f"save_t_{k}_s": v for k, v in timings.items()}


def restore(params: dict) -> dict:
    """Child task: restore the saved state onto N devices (row-sharded), every block verified by the reader."""
    import ckptfmt

    _engine_before_the_clock()
    layout, url, devices = state_from_json(params["layout"]), params["url"], params["devices"]
    api = _api(params)
    _recipe_api(layout, api)
    if api != "core-numpy":
        import jax

        from .jaxstate import row_sharding, state_check, state_target
    rss_base = rss_bytes()
    stats: dict[str, Any] = {}
    checked = 0
    if api == "bridge":
        bridge = _bridge()
        target = state_target(layout, devices)
        bstats: dict[str, Any] = {}
        kw = {"stats": bstats} if "stats" in inspect.signature(bridge.restore).parameters else {}
        with Meter("restore") as m:
            state = bridge.restore(url, target, step=STEP, **kw)
            jax.block_until_ready(jax.tree.leaves(state))
        reader = bstats.get("reader") or {}
        stats = {k: reader[k] for k in ("bytes_read", "requests", "objects") if k in reader}
        stats |= {f"t_{k}_s": v for k, v in (reader.get("timings") or {}).items()}
        stats |= {k: bstats[k] for k in ("open_s", "plan_s", "read_s", "build_s") if k in bstats}
        label = "bridges.jax.restore"
    elif api == "core-jax":
        sharding = row_sharding(devices)
        devs = list(sharding.mesh.devices.flat)
        with Meter("restore") as m:
            ckpt = ckptfmt.Repository(url).open(STEP)
            blocks = ckpt.read_boxes(_row_boxes(layout, devices))
            state = {}
            for k, key in enumerate(layout.keys()):
                parts = [jax.device_put(blocks[k * devices + d], devs[d]) for d in range(devices)]
                for d in range(devices):
                    blocks[k * devices + d] = None  # drop the host copy as soon as it is on its device
                state[key] = jax.make_array_from_single_device_arrays(layout.shape, sharding, parts)
            jax.block_until_ready(list(state.values()))
        stats = _stats(ckpt)
        label = "Repository.open().read_boxes (core) + device_put"
    else:
        boxes = _row_boxes(layout, devices)
        with Meter("restore") as m:
            ckpt = ckptfmt.Repository(url).open(STEP)
            blocks = ckpt.read_boxes(boxes)
        stats = _stats(ckpt)
        label = "Repository.open().read_boxes (core, numpy)"
        if params.get("check", True):
            for (key, box), arr in zip(boxes, blocks):
                check_rows(layout, layout.keys().index(key), box.offset[0], box.stop[0], arr)
                checked += arr.nbytes
    if api != "core-numpy" and params.get("check", True):
        checked = state_check(layout, state, devices)
    read = stats.get("bytes_read") or m.result["ts_bytes_read"] or m.result["io_rchar"]
    return {
        "phase": m.result
        | {"rss_base": rss_base, "bytes_restored": layout.nbytes, "bytes_read_per_reader": read, "bytes_checked": checked, "api": label}
        | {"reader_" + k: v for k, v in stats.items()}
    }


def _stats(ckpt: Any) -> dict[str, Any]:
    st = getattr(ckpt, "stats", None)
    if st is None:
        return {}
    if isinstance(st, dict):
        return dict(st)
    out = {k: getattr(st, k) for k in ("bytes_read", "requests", "objects") if hasattr(st, k)}
    return out | {f"t_{k}_s": v for k, v in (getattr(st, "timings", None) or {}).items()}


def read_slice(params: dict) -> dict:
    """Child task: one reader of ``parts`` reads its row slice of every tensor (core API, host arrays).

    Reports the bytes this reader pulled from storage against the bytes of its slice. On local
    disk the timed read uses positional reads (outside tensorstore); the slice is then read a
    second time through tensorstore's kvstore (``positional_reads=False``), and the bytes that
    tensorstore's own I/O metrics counted for it are the ones reported.
    """
    import ckptfmt

    layout, url, parts, part = StateLayout.from_json(params["layout"]), params["url"], params["parts"], params.get("part", 0)
    r0, r1 = layout.rows_of(part, parts)
    boxes = [(k, ckptfmt.Box((r0, 0), (r1 - r0, layout.cols))) for k in layout.keys()]
    rss_base = rss_bytes()
    with Meter("slice") as m:
        ckpt = ckptfmt.Repository(url).open(STEP)
        got = ckpt.read_boxes(boxes)
    for i, arr in enumerate(got):
        check_rows(layout, i, r0, r1, arr)
    del got
    slice_bytes = layout.tensors * (r1 - r0) * layout.cols * 4
    stats = _stats(ckpt)
    counted = {"bytes_read_reader": stats.get("bytes_read", 0), "bytes_read_counted_by": "tensorstore kvstore metrics"}
    if local_path(url) is not None:  # the timed read bypassed tensorstore: count a tensorstore read of the same slice
        with Meter("slice-ts") as mt:
            via_ts = ckptfmt.Repository(url, options={"positional_reads": False}).open(STEP)
            for i, arr in enumerate(via_ts.read_boxes(boxes)):
                check_rows(layout, i, r0, r1, arr)
        read = mt.result["ts_bytes_read"]
        counted |= {"ts_wall_s": mt.result["wall_s"]}
    else:
        read = m.result["ts_bytes_read"]
    if not read:  # tensorstore's metrics unavailable: fall back to the reader's own count
        read = stats.get("bytes_read", 0) or m.result["io_rchar"]
        counted["bytes_read_counted_by"] = "the reader's own count"
    return {
        "phase": m.result
        | {"rss_base": rss_base, "bytes_restored": slice_bytes, "slice_bytes": slice_bytes, "bytes_read_per_reader": read}
        | counted | {"reader_" + k: v for k, v in stats.items()}
    }
