"""JAX bridge: save a pytree of sharded ``jax.Array``s, restore it onto any topology.

Verbs (the bridge contract, bridges/README.md): :func:`save`, :func:`restore`, :func:`load_extra`,
:func:`load_rank_state`.

What a checkpoint holds (the JAX profile, normative in spec/FORMAT.md 13.2; summarised here):

* Every array leaf (``jax.Array``, ``numpy.ndarray``) is one tensor. Its key path is the pytree
  path rendered by :func:`bridges._jaxtree.render_path` (dict keys and attribute names as they
  are, sequence indices in decimal, joined with ``/``). Each process offers the boxes of its
  addressable shards (``Shard.index``) with their ``replica_id``, and the data of its lowest
  replica of each box; each box is written once, and the processes holding a replicated box take
  turns (FORMAT.md 8.1). A ``numpy.ndarray`` leaf is taken to be the same on every process; one copy is written.
* Typed PRNG keys (``jax.random.key``) are stored as ``jax.random.key_data`` (a ``uint32``
  tensor with the key dimensions last), and the implementation name is recorded in the global
  state under ``bridge.prng_impls[<key path>]``. Raw ``uint32`` keys are ordinary tensors.
* Every other leaf (Python ``bool``/``int``/``float``/``str``/``bytes``/``None``, numpy scalars)
  goes into the global msgpack state under ``bridge.leaves[<key path>]``.
* ``extra`` (any msgpack-able value, and anything ``json.dumps`` takes: dict keys are stored as
  JSON writes them, ``1`` -> ``"1"``, see ``bridges/_extra.py``) is stored beside it in the
  global state: ``{"bridge": {...}, "extra": extra}``; read it back with :func:`load_extra`.
* ``rank_state`` is per-process state (numpy/Python RNG state, iterator position), stored as
  format v1 rank state. **Topology-change policy**: when the number of processes at restore
  differs from the number that saved, rank state has no owner. :func:`restore` and
  :func:`load_rank_state` then raise :class:`TopologyChangedError` unless the caller passes
  ``rank_state_policy``: ``"drop"`` (discard it; every process starts its per-rank state
  afresh), ``"rank0"`` (every process receives rank 0's state) or ``"same-rank"`` (process ``r``
  gets rank ``r``'s state where one was saved, None otherwise). With the same process count,
  process ``r`` gets rank ``r``'s state and no policy is needed.

Restore reads, for each target leaf, only the boxes of its addressable shards (identical boxes on
several local devices are read once), in batches of about RESTORE_BATCH_BYTES
(``bridges._contract.read_batches``, the batched restore of every bridge); the core reader
verifies every byte of a batch before it is built, and nothing is returned before every batch
has been read and verified. Arrays are then built with
``jax.make_array_from_callback``; a sharded target is never assembled whole on the host.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Mapping

import jax
import numpy as np

from ckptfmt import Box, LocalShard, Repository, SaveHandle, SaveOptions
from ckptfmt.asyncsave import save_in_flight, start_async
from ckptfmt import session as _session
from ckptfmt.reader import RANK_STATE_POLICIES as _CORE_POLICIES
from ckptfmt.errors import CheckpointError, SaveInProgressError

from ._contract import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from ._contract import stage_state
from ._extra import json_keys
from ._jaxcoord import JaxCoordinator, default_coordinator
from ._jaxrestore import BRIDGE_VERSION as _BRIDGE_VERSION
from ._jaxrestore import load_extra as load_extra, load_rank_state as load_rank_state, restore as restore
from ._jaxrestore import _bridge_state as _bridge_state, _open as _open  # noqa: F401 (tests, the manager)
from ._jaxtree import describe_sharding, index_to_box, is_prng_key, placement
from ._jaxtree import flatten_with_keys as flatten_with_keys  # public: the profile's key paths of a pytree

__all__ = ["save", "restore", "load_extra", "load_rank_state", "abstract_target", "flatten_with_keys",
           "RANK_STATE_POLICIES", "RESTORE_BATCH_BYTES", "CheckpointManager"]

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


def _array_shards(key: str, arr: jax.Array, copy: bool) -> list[LocalShard]:
    shape, dtype = tuple(arr.shape), np.dtype(arr.dtype)
    desc = describe_sharding(arr.sharding, arr.ndim)
    out = []
    shards = arr.addressable_shards
    # Per box, this process offers the data of its lowest replica id: the plan spreads the
    # writes of a replicated box over the processes holding it (FORMAT.md 8.1); further copies
    # in this process only prove the box is held. Lazy: a copy not picked is never made.
    lowest: dict[Box, int] = {}
    boxes = [index_to_box(sh.index, shape) for sh in shards]
    for sh, b in zip(shards, boxes):
        lowest[b] = min(lowest.get(b, sh.replica_id), sh.replica_id)
    for sh, box in zip(shards, boxes):
        data: Any = None
        if sh.replica_id == lowest[box]:
            data = np.asarray(sh.data) if copy else (lambda d=sh.data: np.asarray(d))
        out.append(LocalShard(key, shape, dtype, box, data, replica_id=int(sh.replica_id), sharding=desc,
                              source=arr if sh.replica_id == 0 else None))  # identity + digest (8.4)
    if not out:
        # Held by other processes only. Every rank must list the same inventory, so declare
        # the tensor: an empty box holds nothing (a scalar's box cannot be empty, so it claims
        # a replica id no real holder has and is never chosen to write).
        empty = Box((0,) * len(shape), (0,) * len(shape))
        out.append(LocalShard(key, shape, dtype, empty, None, replica_id=_PLACEHOLDER_REPLICA))
    return out


def _to_shards(state: Any, *, copy: bool) -> tuple[list[LocalShard], dict[str, Any]]:
    flat, _ = flatten_with_keys(state)
    pid = jax.process_index()
    shards: list[LocalShard] = []
    leaves: dict[str, Any] = {}
    prng: dict[str, str] = {}
    for key, leaf in flat:
        if isinstance(leaf, jax.Array):
            arr = leaf
            if is_prng_key(leaf):
                prng[key] = str(jax.random.key_impl(leaf))
                arr = jax.random.key_data(leaf)
            shards.extend(_array_shards(key, arr, copy))
        elif isinstance(leaf, np.ndarray):
            data = np.array(leaf) if copy else leaf
            shards.append(LocalShard(key, leaf.shape, leaf.dtype, Box.full(leaf.shape), data, replica_id=pid))
        elif isinstance(leaf, _SCALAR_TYPES):
            leaves[key] = leaf
        else:
            raise TypeError(f"leaf {key!r} has type {type(leaf).__module__}.{type(leaf).__qualname__}; "
                            "expected a jax.Array, numpy array, or Python/numpy scalar")
    return shards, {"name": "jax", "version": _BRIDGE_VERSION, "leaves": leaves, "prng_impls": prng}


def save(url: "str | Repository", state: Any, *, step: int, extra: Any = None, rank_state: Mapping[str, Any] | None = None,
         blocking: bool = True, coordinator: Any = None, options: SaveOptions | None = None,
         metadata: Mapping[str, Any] | None = None) -> Any:
    """Save the pytree ``state`` as step ``step`` of the repository at ``url`` (a URL, or a
    :class:`ckptfmt.Repository`, whose storage and caches a caller that saves often keeps: the
    checkpoint managers pass theirs).

    Every process of a ``jax.distributed`` job must call it with the same ``step`` and a
    state of the same structure; each writes its share of its addressable shards (a replicated
    box once, FORMAT.md 8.1). The coordinator defaults to :class:`bridges._jaxcoord.JaxCoordinator` when
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
    if blocking and save_in_flight():
        raise SaveInProgressError("an earlier save(blocking=False) is still in flight; call its result() first",
                                  expected="no save in flight", found=f"a background save; requested step {step}")
    coord = coordinator if coordinator is not None else default_coordinator()
    options = options if options is not None else SaveOptions()
    release = coordinator is None and isinstance(coord, JaxCoordinator)
    if blocking:
        shards, global_state, per_rank, md = _stage(state, extra, rank_state, metadata, blocking=True)
        return _commit(url, step, shards, global_state, per_rank, md, coord, options, release)

    def stage() -> tuple[Callable[[], Any], int]:
        shards, global_state, per_rank, md = _stage(state, extra, rank_state, metadata, blocking=False)
        staged = sum(int(s.data.nbytes) for s in shards if isinstance(s.data, np.ndarray))
        return functools.partial(_commit, url, step, shards, global_state, per_rank, md, coord, options, release), staged

    handle: SaveHandle = start_async(stage, step=step, wait=False)
    return handle


def _stage(state: Any, extra: Any, rank_state: Any, metadata: Mapping[str, Any] | None, *,
           blocking: bool) -> tuple[list[LocalShard], Any, Any, Any]:
    """The save's shards and non-tensor state, staged in the caller's thread (bridges/README.md,
    "Saving"): InvalidStateError here, at the call, before any shard is written; a background save
    keeps copies and snapshots (numpy arrays in extra / rank_state, the metadata), not references."""
    shards, bridge_state = _to_shards(state, copy=not blocking)
    global_state = {"bridge": bridge_state, "extra": json_keys(extra, "extra")}
    per_rank = json_keys(rank_state, "rank_state")
    global_state, per_rank, md = stage_state(global_state, per_rank,
                                             dict(metadata) if metadata is not None else None, blocking=blocking)
    return shards, global_state, per_rank, md


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


from ._jaxmanager import CheckpointManager as CheckpointManager  # noqa: E402  (it calls the verbs above)
