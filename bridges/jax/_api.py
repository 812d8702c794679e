"""The implementation behind :mod:`bridges.jax` (its face re-exports the public names)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from ckptfmt import Box, LocalShard, Repository, SaveHandle, SaveOptions
from ckptfmt.asyncsave import HandBack, RetrySchedule, copied_at_call, run_attempts, save_in_flight, start_async
from ckptfmt import session as _session
from ckptfmt.reader import RANK_STATE_POLICIES as _CORE_POLICIES
from ckptfmt.errors import CheckpointError, SaveInProgressError

from bridges._contract import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from bridges._contract import stage_state
from bridges._extra import json_keys
from bridges.jax._coord import JaxCoordinator, default_coordinator
from bridges.jax._restore import BRIDGE_VERSION as _BRIDGE_VERSION
from bridges.jax._restore import load_extra as load_extra, load_rank_state as load_rank_state, restore as restore
from bridges.jax._tree import describe_sharding, index_to_box, is_prng_key, placement
from bridges.jax._tree import flatten_with_keys as flatten_with_keys  # public: the profile's key paths of a pytree

__all__ = ["save", "restore", "load_extra", "load_rank_state", "abstract_target", "flatten_with_keys",
           "RANK_STATE_POLICIES", "RESTORE_BATCH_BYTES"]  # and CheckpointManager, from the face

#: The accepted values of ``rank_state_policy`` (the core's, FORMAT.md 7.4).
RANK_STATE_POLICIES = _CORE_POLICIES
_PLACEHOLDER_REPLICA = 1 << 30
_SCALAR_TYPES = (bool, int, float, str, bytes, type(None), np.generic)


# ------------------------------------------------------------------------------------- save


def _versions() -> dict[str, str]:
    out = {"jax": jax.__version__}
    for name in ("flax", "optax"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__version__", None):
            out[name] = str(mod.__version__)
    return out


@dataclass(frozen=True)
class _ArrayLayout:
    """Where one array's addressable shards lie, for every array of the same (shape, dtype,
    sharding): per position in ``addressable_shards`` its box and replica id, the positions whose
    data this process offers (per box its lowest replica id: the plan spreads the writes of a
    replicated box over the processes holding it, FORMAT.md 8.1; further copies here only prove
    the box is held), the sharding's description, and whether its devices are the host's (CPU:
    no device-to-host copy to start)."""

    boxes: tuple[Box, ...]
    replicas: tuple[int, ...]
    offered: tuple[int, ...]
    sharding: Any
    on_host: bool = True
    offered_nbytes: int = 0  # the bytes of the offered shards (what a host copy of them holds)
    whole: bool = False  # fully replicated: every shard is the whole array
    unbuffered: bool = False  # an ml_dtypes dtype (bfloat16, float8, int4): no buffer protocol on host


# A job saves the same shapes and shardings at every step: their layouts are computed once. Keyed
# by the sharding itself (equal shardings place the shards of equal shapes alike); bounded.
_LAYOUTS: dict[tuple[Any, ...], _ArrayLayout] = {}
_LAYOUTS_MAX = 1 << 16


def _layout(arr: jax.Array) -> _ArrayLayout:
    shape = tuple(arr.shape)
    cache_key: tuple[Any, ...] | None = (shape, np.dtype(arr.dtype), arr.sharding)
    try:
        found = _LAYOUTS.get(cache_key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable sharding: computed every time
        found, cache_key = None, None
    if found is not None:
        return found
    shards = arr.addressable_shards
    boxes = tuple(index_to_box(sh.index, shape) for sh in shards)
    replicas = tuple(int(sh.replica_id) for sh in shards)
    lowest: dict[Box, int] = {}
    for b, r in zip(boxes, replicas):
        lowest[b] = min(lowest.get(b, r), r)
    offered = tuple(i for i, (b, r) in enumerate(zip(boxes, replicas)) if r == lowest[b])
    on_host = all(d.platform == "cpu" for d in arr.sharding.device_set)
    nbytes = sum(boxes[i].size for i in offered) * np.dtype(arr.dtype).itemsize
    found = _ArrayLayout(boxes, replicas, offered, describe_sharding(arr.sharding, arr.ndim), on_host, nbytes,
                         bool(arr.is_fully_replicated), np.dtype(arr.dtype).kind == "V")
    if cache_key is not None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[cache_key] = found
    return found


class _HostCopies:
    """Bytes this process copied from device to host for saves."""

    bytes = 0


_HOST_COPIES = _HostCopies  # read by tests and benchmarks, not API


class _Staged(NamedTuple):
    """One array leaf as the caller's thread stages it: its layout and the data of its offered
    positions (host copies, or lazy copies for a blocking save)."""

    key: str
    arr: jax.Array
    layout: _ArrayLayout
    data: tuple[Any, ...]
    nbytes: int = 0  # of the host arrays in ``data`` (none when they are lazy or the writer's)


def _start_copies(arr: jax.Array, lay: _ArrayLayout) -> list[jax.Array] | None:
    """Start the device-to-host copies of ``arr``'s offered shards (not waited for): every array of
    a save is started before any is waited on, so the copies overlap. None on the host (CPU), where
    there is nothing to start and nothing is done."""
    if lay.on_host:
        return None
    shards = _offered_data(arr, lay)
    for sh in shards:
        sh.copy_to_host_async()
    return shards


def _offered_data(arr: jax.Array, lay: _ArrayLayout) -> list[jax.Array]:
    """The single-device arrays of ``arr``'s offered shards (the lowest replica of each box).
    jax's list of an array's per-device arrays (``_arrays``: what ``addressable_data`` indexes;
    tests/jaxproc/bridge_checks.py ``offered_shards_are_addressable_data`` holds the two equal) is
    taken once, not once per shard: ``addressable_data`` checks the array and builds that list on
    every call (1.3 ms a save of the 874-leaf state, docs/profile-save.md). A fully replicated or
    deleted array, a layout of another shard count, or a jax without ``_arrays`` goes through
    ``addressable_data`` (which raises jax's own error for a deleted array)."""
    every = None if lay.whole else getattr(arr, "_arrays", None)
    if every is None or len(every) != len(lay.boxes):
        return [arr.addressable_data(i) for i in lay.offered]
    if len(lay.offered) == len(every):
        return list(every)
    return [every[i] for i in lay.offered]


def _host_views(arr: jax.Array, lay: _ArrayLayout) -> tuple[np.ndarray, ...]:
    """Numpy views of the buffers of ``arr``'s offered shards on the host (CPU), taken in the
    caller's thread: each holds an external reference to its buffer, so a later step that donates
    the array cannot reuse the buffer while the save reads it (tests/jaxproc/bridge_checks.py
    ``async_save_survives_a_donating_step``). A dtype with a buffer protocol (float32, ...) is
    viewed by ``np.asarray``; an ml_dtypes one (bfloat16, ...), which ``np.asarray`` reaches through
    ``jax.Array.__array__`` and ``_value``, by the method ``_value`` ends in, called directly (4 ms a
    save of the 874-leaf state's 1,873 bfloat16 shards, docs/profile-save.md)."""
    shards = _offered_data(arr, lay)
    if lay.unbuffered and shards and hasattr(shards[0], "_single_device_array_to_np_array_did_copy"):
        views = tuple(sh._single_device_array_to_np_array_did_copy()[0] for sh in shards)
        for v in views:  # read-only, as _value leaves it
            v.flags.writeable = False
        return views
    return tuple(np.asarray(sh) for sh in shards)


def _uncached_host_copy(arr: jax.Array, i: int, on_host: bool) -> np.ndarray:
    """Shard ``i`` of ``arr`` in host memory, held by the returned array only. ``np.asarray`` of a
    device array keeps its host copy in the array (jax's host-value cache) for as long as the
    caller's array lives, which would hold every copy a budgeted or blocking save makes: a device
    shard is moved to a fresh CPU array instead, which dies with the copy. On CPU the host copy is
    a view of the buffer, as before."""
    shard = arr.addressable_data(i)
    if on_host:
        return np.asarray(shard)
    return np.asarray(jax.device_put(shard, jax.local_devices(backend="cpu")[0]))


def _stage_array(key: str, arr: jax.Array, copy: bool, started: list[jax.Array] | None = None,
                 hand_back: HandBack | None = None, lay: _ArrayLayout | None = None) -> _Staged:
    """One array's staged data: host copies (``copy``; from the copies ``started`` when given),
    sources ``hand_back`` reads while the caller waits (beyond the staging budget), or lazy
    copies (a blocking save)."""
    lay = lay if lay is not None else _layout(arr)
    if copy and hand_back is None:  # the device-to-host copies: the only per-shard work in the caller's thread
        data: tuple[Any, ...] = tuple(np.asarray(sh) for sh in started) if started is not None else _host_views(arr, lay)
        for d in data:  # shared by a manager's local tier and persistent save: neither may write it
            d.flags.writeable = False
        _HOST_COPIES.bytes += lay.offered_nbytes
        return _Staged(key, arr, lay, data, lay.offered_nbytes)
    elif copy:  # beyond the budget: copied by the writer, while the caller waits (ckptfmt.asyncsave.HandBack)
        data = tuple(hand_back.source(lambda i=i: _uncached_host_copy(arr, i, lay.on_host)) for i in lay.offered)
    elif lay.on_host:  # a view of each buffer (no copy), taken here: in the writer's scheduling
        # thread, 8 per leaf, these waited for the GIL behind busy writer threads (docs/profile-save.md)
        data = _host_views(arr, lay)
        return _Staged(key, arr, lay, data, lay.offered_nbytes)
    else:  # lazy: a copy not picked by the plan is never made
        data = tuple((lambda i=i: _uncached_host_copy(arr, i, lay.on_host)) for i in lay.offered)
    return _Staged(key, arr, lay, data)


def _array_shards(staged: _Staged) -> list[LocalShard]:
    key, arr, lay = staged.key, staged.arr, staged.layout
    shape, dtype = tuple(arr.shape), np.dtype(arr.dtype)
    data = dict(zip(lay.offered, staged.data))
    out = [LocalShard(key, shape, dtype, box, data.get(i), replica_id=rep, sharding=lay.sharding,
                      source=arr if rep == 0 else None)  # identity + digest (8.4)
           for i, (box, rep) in enumerate(zip(lay.boxes, lay.replicas))]
    if not out:
        # Held by other processes only. Every rank must list the same inventory, so declare
        # the tensor: an empty box holds nothing (a scalar's box cannot be empty, so it claims
        # a replica id no real holder has and is never chosen to write).
        empty = Box((0,) * len(shape), (0,) * len(shape))
        out.append(LocalShard(key, shape, dtype, empty, None, replica_id=_PLACEHOLDER_REPLICA))
    return out


def _stage_leaves(state: Any, *, copy: bool, budget: int | None = None,
                  hand_back: HandBack | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The caller's share of staging: every leaf checked, the arrays' host copies made (``copy``)
    and the scalars taken; a constant amount of Python work per leaf besides the copies. Each
    item is a ``_Staged`` array or a ready ``LocalShard`` (a numpy leaf). Every device-to-host
    copy is started before any is waited on. With ``budget`` and ``hand_back`` (an asynchronous
    save's ``max_staging_bytes``), the leaves beyond the budget are ``hand_back``'s sources
    (``ckptfmt.asyncsave.copied_at_call`` picks them)."""
    flat, _ = flatten_with_keys(state)
    pid = jax.process_index()
    found: list[tuple[str, Any, Any]] = []  # (key, array or numpy leaf, layout or None)
    leaves: dict[str, Any] = {}
    prng: dict[str, str] = {}
    for key, leaf in flat:
        if isinstance(leaf, jax.Array):
            arr = leaf
            if is_prng_key(leaf):
                prng[key] = str(jax.random.key_impl(leaf))
                arr = jax.random.key_data(leaf)
            found.append((key, arr, _layout(arr)))
        elif isinstance(leaf, np.ndarray):
            found.append((key, leaf, None))
        elif isinstance(leaf, _SCALAR_TYPES):
            leaves[key] = leaf
        else:
            raise TypeError(f"leaf {key!r} has type {type(leaf).__module__}.{type(leaf).__qualname__}; "
                            "expected a jax.Array, numpy array, or Python/numpy scalar")
    at_call = [True] * len(found)
    if copy and hand_back is not None:
        at_call = copied_at_call([(k, _offered_bytes(a, lay)) for k, a, lay in found], budget)
    # Every device-to-host copy made at the call is started first, then each is waited for.
    started = [_start_copies(a, lay) if copy and lay is not None and now else None
               for (_, a, lay), now in zip(found, at_call)]
    items: list[Any] = []
    for (key, a, lay), now, st in zip(found, at_call, started):
        if lay is not None:
            items.append(_stage_array(key, a, copy, st, None if now else hand_back, lay))
            continue
        data = (np.array(a) if now else hand_back.source(lambda a=a: np.array(a))) if copy else a  # type: ignore[union-attr]
        items.append(LocalShard(key, a.shape, a.dtype, Box.full(a.shape), data, replica_id=pid))
    return items, {"name": "jax", "version": _BRIDGE_VERSION, "leaves": leaves, "prng_impls": prng}


def _offered_bytes(a: Any, lay: _ArrayLayout | None) -> int:
    """The host bytes this process stages of a leaf (its offered shards; a numpy leaf whole)."""
    if lay is None:
        return int(a.nbytes)
    return lay.offered_nbytes


def _shards_of(items: list[Any]) -> list[LocalShard]:
    """The staged leaves as the core's shards (a background save builds them in its own thread)."""
    shards: list[LocalShard] = []
    for it in items:
        if isinstance(it, _Staged):
            shards.extend(_array_shards(it))
        else:
            shards.append(it)
    return shards


def _to_shards(state: Any, *, copy: bool) -> tuple[list[LocalShard], dict[str, Any]]:
    """Every leaf of ``state`` as the core's shards, and the bridge's global state."""
    items, bridge_state = _stage_leaves(state, copy=copy)
    return _shards_of(items), bridge_state


def _staged_bytes(items: list[Any]) -> int:
    return sum(it.nbytes if isinstance(it, _Staged) else int(it.data.nbytes) if isinstance(it.data, np.ndarray) else 0
               for it in items)


def save(url: "str | Repository", state: Any, *, step: int, extra: Any = None, rank_state: Mapping[str, Any] | None = None,
         blocking: bool = True, coordinator: Any = None, options: SaveOptions | None = None,
         metadata: Mapping[str, Any] | None = None) -> Any:
    """Save the pytree ``state`` as step ``step`` of the repository at ``url`` (a URL, or a
    :class:`ckptfmt.Repository`, whose storage and caches a caller that saves often keeps: the
    checkpoint managers pass theirs).

    Every process of a ``jax.distributed`` job must call it with the same ``step`` and a
    state of the same structure; each writes its share of its addressable shards (a replicated
    box once, FORMAT.md 8.1). The coordinator defaults to :class:`bridges.jax._coord.JaxCoordinator` when
    ``jax.process_count() > 1`` and to ``LocalCoordinator`` otherwise.

    Returns the committed Manifest once the step is committed (``blocking=True``), or a
    :class:`ckptfmt.SaveHandle` whose ``result()`` returns it (``blocking=False``: the
    device-to-host copies are done before this returns, so the caller may modify or donate its
    arrays at once). On failure nothing is committed: the core's CheckpointError
    (StepMismatchError, IncompleteSaveError, CoordinatorTimeoutError, StepAlreadyCommittedError,
    ...) is raised on every process (by ``result()`` for a background save). A save while an
    earlier ``blocking=False`` save is in flight raises SaveInProgressError. A leaf of an
    unsupported type or an unrenderable key raises TypeError/ValueError before anything is written.

    ``metadata`` (plain JSON) goes into the manifest's ``metadata`` as rank 0 passes it.
    """
    return _save(url, state, step=step, extra=extra, rank_state=rank_state, blocking=blocking, coordinator=coordinator,
                 options=options, metadata=metadata)


def _save(url: "str | Repository", state: Any, *, step: int, extra: Any, rank_state: Any, blocking: bool,
          coordinator: Any, options: SaveOptions | None, metadata: Mapping[str, Any] | None,
          staged: list[Any] | None = None, retry: RetrySchedule | None = None) -> Any:
    """:func:`save`; ``staged``: the leaves of ``state`` already staged with host copies (the
    manager's local tier made them at this step: the state is copied once); ``retry``: the
    manager's retry schedule (``ckptfmt.asyncsave.run_attempts``), run in the background for
    ``blocking=False``."""
    if blocking and save_in_flight():
        raise SaveInProgressError("an earlier save(blocking=False) is still in flight; call its result() first",
                                  expected="no save in flight", found=f"a background save; requested step {step}")
    coord = coordinator if coordinator is not None else default_coordinator()
    options = options if options is not None else SaveOptions()
    release = coordinator is None and isinstance(coord, JaxCoordinator)
    if blocking:
        items, global_state, per_rank, md = _stage_items(state, extra, rank_state, metadata, blocking=True, staged=staged)
        shards = _shards_of(items)
        return run_attempts(lambda: _commit(url, step, shards, global_state, per_rank, md, coord, options, release),
                            retry)

    # Beyond options.max_staging_bytes the writer copies the leaves while the caller waits.
    hand_back = HandBack() if options.max_staging_bytes is not None and staged is None else None

    def stage() -> tuple[Callable[[], Any], int]:
        # The caller's thread makes the host copies only; the shards, the plan, the writes, the
        # checksums and the manifest are the background thread's.
        items, global_state, per_rank, md = _stage_items(state, extra, rank_state, metadata, blocking=False,
                                                         staged=staged, budget=options.max_staging_bytes,
                                                         hand_back=hand_back)
        return (lambda: _commit(url, step, _shards_of(items), global_state, per_rank, md, coord, options, release),
                _staged_bytes(items))

    handle: SaveHandle = start_async(stage, step=step, wait=False, retry=retry, hand_back=hand_back,
                                     pause_gc=options.pause_gc)
    return handle


def _stage_items(state: Any, extra: Any, rank_state: Any, metadata: Mapping[str, Any] | None, *,
                 blocking: bool, staged: list[Any] | None = None, budget: int | None = None,
                 hand_back: HandBack | None = None) -> tuple[list[Any], Any, Any, Any]:
    """The save's staged leaves and non-tensor state, staged in the caller's thread (bridges/README.md,
    "Saving"): InvalidStateError here, at the call, before any shard is written; a background save
    keeps copies and snapshots (numpy arrays in extra / rank_state, the metadata), not references."""
    items, bridge_state = (_stage_leaves(state, copy=not blocking, budget=budget, hand_back=hand_back)
                           if staged is None else staged)
    return (items, *_stage_state(bridge_state, extra, rank_state, metadata, blocking=blocking))


def _stage_snapshot(state: Any, extra: Any, rank_state: Any) -> tuple[tuple[list[Any], dict[str, Any]], Any, list[LocalShard]]:
    """The manager's local-tier snapshot of ``state`` (FORMAT.md 8.5), staged here in one call: its
    leaves with host copies (kept for the persistent save of the same manager call), the global
    state, and the shards of this process."""
    leaves = _stage_leaves(state, copy=True)
    global_state, _, _ = _stage_state(leaves[1], extra, rank_state, None, blocking=False)
    return leaves, global_state, _shards_of(leaves[0])


def _stage_state(bridge_state: Any, extra: Any, rank_state: Any, metadata: Mapping[str, Any] | None, *,
                 blocking: bool) -> tuple[Any, Any, Any]:
    """The save's non-tensor state (global state, per-rank state, metadata) from the leaves' bridge
    record, staged as :func:`_stage_items` says; the state itself is not needed again."""
    global_state = {"bridge": bridge_state, "extra": json_keys(extra, "extra")}
    per_rank = json_keys(rank_state, "rank_state")
    return stage_state(global_state, per_rank, dict(metadata) if metadata is not None else None, blocking=blocking)


def _commit(url: "str | Repository", step: int, shards: list[LocalShard], global_state: Any, per_rank: Any, metadata: Any,
            coord: Any, options: SaveOptions, release: bool) -> Any:
    """Write, verify and commit the staged save (the caller's thread, or the background save's)."""
    manifest = _session.save(url, step, shards, state=global_state, rank_state=per_rank, coordinator=coord,
                          versions=_versions(), options=options, metadata=metadata)
    if release:
        # The commit broadcast's value (the manifest) stays in the coordination service until a
        # call every rank enters; release it. The step is committed either way.
        try:
            coord.barrier("save/release", options.timeout_s)
        except CheckpointError:
            pass
    return manifest


def abstract_target(tree: Any, sharding: Any = None) -> Any:
    """A restore target from a live or abstract pytree: arrays become ShapeDtypeStructs.

    ``sharding`` is None (keep each leaf's own placement), one ``jax.sharding.Sharding`` for every
    array leaf, or a callable ``(key path, leaf) -> Sharding | None`` (None: the leaf's own).
    A leaf's own placement is its sharding when it is committed, and none when JAX placed it by
    default (an uncommitted array, such as optax's ``count`` or a fresh ``jnp.zeros``): that leaf
    is restored uncommitted on the default device, so a jitted step moves it to the devices of its
    other arguments as it did before the save. Other leaves pass through. ``tree`` is not modified.
    """
    flat, treedef = flatten_with_keys(tree)
    out = []
    for key, leaf in flat:
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            s = sharding(key, leaf) if callable(sharding) else sharding
            s = s if s is not None else placement(leaf)
            out.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s))
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


