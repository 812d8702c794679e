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

import copy
import sys
import time
import warnings
from typing import Any, Callable, Mapping

import jax
import numpy as np

from ckptfmt import Box, LocalShard, Repository, SaveHandle, SaveOptions, agree_step
from ckptfmt.asyncsave import save_in_flight, start_async
from ckptfmt.dtypes import numpy_dtype
from ckptfmt import save as _core_save
from ckptfmt.reader import RANK_STATE_POLICIES as _CORE_POLICIES, check_rank_state_policy
from ckptfmt.interop import open_source
from ckptfmt.errors import (CheckpointError, InvalidStateError, KeyMismatchError, SaveInProgressError,
                            ShapeMismatchError)

from ._contract import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from ._contract import check_topology, effective_policy, read_batches
from ._contract import rank_state as _rank_state
from ._extra import json_keys
from ._jaxcoord import JaxCoordinator, default_coordinator
from ._rules import closest_key
from .mapping import KeptValuesWarning, LoadReport, Mapping as KeyMapping
from ._jaxtree import describe_sharding, index_to_box, is_prng_key, nest, physical_sharding
from ._jaxtree import flatten_with_keys as flatten_with_keys  # public: the profile's key paths of a pytree

__all__ = ["save", "restore", "load_extra", "load_rank_state", "abstract_target", "flatten_with_keys",
           "RANK_STATE_POLICIES", "RESTORE_BATCH_BYTES", "CheckpointManager"]

#: The accepted values of ``rank_state_policy`` (the core's, FORMAT.md 7.4).
RANK_STATE_POLICIES = _CORE_POLICIES
_BRIDGE_VERSION = 1
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
    for sh in shards:
        b = index_to_box(sh.index, shape)
        lowest[b] = min(lowest.get(b, sh.replica_id), sh.replica_id)
    for sh in shards:
        box = index_to_box(sh.index, shape)
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


def save(url: str, state: Any, *, step: int, extra: Any = None, rank_state: Mapping[str, Any] | None = None,
         blocking: bool = True, coordinator: Any = None, options: SaveOptions | None = None,
         metadata: Mapping[str, Any] | None = None) -> Any:
    """Save the pytree ``state`` as step ``step`` of the repository at ``url``.

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
    opts = options if options is not None else SaveOptions()

    def stage() -> tuple[Callable[[], Any], int]:
        shards, bridge_state = _to_shards(state, copy=not blocking)
        global_state = {"bridge": bridge_state, "extra": json_keys(extra, "extra")}
        per_rank = json_keys(rank_state, "rank_state")
        # The save runs later: keep a snapshot of the metadata, not a reference.
        md = copy.deepcopy(dict(metadata)) if metadata is not None and not blocking else metadata

        def run() -> Any:
            manifest = _core_save(url, step, shards, state=global_state, rank_state=per_rank,
                                  coordinator=coord, versions=_versions(), options=opts, metadata=md)
            if coordinator is None and isinstance(coord, JaxCoordinator):
                # The commit broadcast's value (the manifest) stays in the coordination service
                # until a call every rank enters; release it. The step is committed either way.
                try:
                    coord.barrier("save/release", opts.timeout_s)
                except CheckpointError:
                    pass
            return manifest

        staged = sum(int(s.data.nbytes) for s in shards if isinstance(s.data, np.ndarray))
        return run, staged

    if blocking:
        return stage()[0]()
    handle: SaveHandle = start_async(stage, step=step, wait=False)
    return handle


# ---------------------------------------------------------------------------------- restore


def _open(url: str, step: int | None) -> Any:
    return open_source(url, step, resolve=_step_everyone_opens)  # a committed step, or a safetensors source


def _step_everyone_opens(repo: Repository, step: int | None) -> int | None:
    if step is not None or jax.process_count() == 1:
        return step
    # Rank 0 decides which step is latest, so all restore the same one; its answer (a step, or
    # the error it hit) reaches every rank at once (ckptfmt.agree_step).
    coord = JaxCoordinator()
    try:
        return agree_step(repo, None, coord)
    finally:
        coord.close()


def _bridge_state(ckpt: Any) -> dict[str, Any]:
    """The JAX profile's record (FORMAT.md 13.2), checked; empty for a checkpoint of no profile."""
    st = ckpt.state() or {}
    b = st.get("bridge") if isinstance(st, dict) else None
    if b is None:
        return {"leaves": {}, "prng_impls": {}}

    def bad(what: str, expected: Any, found: Any) -> InvalidStateError:
        return InvalidStateError(f"the JAX profile record of the global state is malformed: {what}",
                                 key="bridge", expected=expected, found=found)

    if not isinstance(b, dict) or b.get("name") != "jax" or b.get("version") != _BRIDGE_VERSION \
            or isinstance(b.get("version"), bool):
        found = {k: b.get(k) for k in ("name", "version")} if isinstance(b, dict) else type(b).__name__
        raise bad("name and version", {"name": "jax", "version": _BRIDGE_VERSION}, found)
    leaves, impls = b.get("leaves", {}), b.get("prng_impls", {})
    if not isinstance(leaves, dict) or not isinstance(impls, dict):
        raise bad("leaves and prng_impls must be maps", "map", (type(leaves).__name__, type(impls).__name__))
    keys = set(ckpt.keys())
    both = sorted(set(leaves) & keys)
    if both:
        raise bad("a key path is both a tensor and a non-array leaf", "distinct key paths", both[:5])
    for key, impl in impls.items():
        t = ckpt.tensor(key) if key in keys else None
        if not isinstance(impl, str) or t is None or t.dtype != "uint32" or not len(t.shape):
            raise bad("a PRNG key record names no uint32 key-data tensor", "uint32 tensor, ndim >= 1",
                      {"key path": key, "impl": impl, "tensor": None if t is None else (t.dtype, list(t.shape))})
    return b


def _check_policy(ckpt: Any, policy: str | None) -> None:
    # A torch-profile checkpoint whose torch.rank_state is false holds only the RNG states the
    # torch bridge recorded: another world size goes on without a policy (FORMAT.md 13.3).
    st = ckpt.state() or {}
    record = st.get("torch") if isinstance(st, dict) else None
    asked = not (isinstance(record, dict) and record.get("rank_state") is False)
    world = jax.process_count()
    check_topology(ckpt, world, effective_policy(ckpt, world, policy, caller_state=asked))


def _impl_name(dtype: Any) -> str:
    return str(dtype._impl.name)  # typed key dtypes carry their PRNGImpl


def _target_sharding(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:  # a bare ShapeDtypeStruct: jnp's default placement
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return sharding


class _ArrayPlan:
    __slots__ = ("key", "shape", "sharding", "prng", "boxes", "host", "chain", "reads")

    def __init__(self, key: str, shape: tuple[int, ...], sharding: Any, prng: str | None,
                 boxes: list[Box], host: bool, chain: Any = None) -> None:
        self.key, self.shape, self.sharding, self.prng, self.boxes, self.host = key, shape, sharding, prng, boxes, host
        # A mapped leaf: the boxes are the target's; ``reads`` lists the source boxes of each.
        self.chain = chain
        self.reads: dict[Box, list[tuple[str, Box]]] = {b: chain.reads(b) for b in boxes} if chain is not None else {}

    def requests(self) -> list[tuple[str, Box]]:
        if self.chain is None:
            return [(self.key, b) for b in self.boxes]
        return [r for b in self.boxes for r in self.reads[b]]


def _plan_leaf(ckpt: Any, keys: set[str], bridge: dict[str, Any], key: str, leaf: Any) -> _ArrayPlan:
    if key not in keys:
        raise KeyMismatchError("the restore target has a key the checkpoint does not hold", key=key,
                               expected="a tensor of the checkpoint", found="missing")
    entry = ckpt.tensor(key)
    found = (tuple(int(n) for n in entry.shape), str(entry.dtype))  # a validated format v1 dtype name
    saved_impl = bridge["prng_impls"].get(key)
    if is_prng_key(leaf):
        want_impl = _impl_name(leaf.dtype)
        logical = tuple(leaf.shape)
        shape = logical + found[0][len(logical):]
        if saved_impl != want_impl or found[1] != "uint32" or found[0][:len(logical)] != logical:
            raise ShapeMismatchError("typed PRNG key does not match the checkpoint", key=key,
                                     expected=(logical, f"key<{want_impl}>"),
                                     found=(found[0], f"key<{saved_impl}>" if saved_impl else found[1]))
        sharding = physical_sharding(_target_sharding(leaf), logical, leaf.dtype)
        prng = want_impl
    else:
        shape = tuple(int(n) for n in leaf.shape)
        want = (shape, np.dtype(leaf.dtype).name)
        if want != found or saved_impl is not None:
            raise ShapeMismatchError("restore target does not match the checkpoint", key=key,
                                     expected=want, found=found if saved_impl is None else (found[0], f"key<{saved_impl}>"))
        sharding = None if isinstance(leaf, np.ndarray) else _target_sharding(leaf)
        prng = None
    if sharding is None:
        return _ArrayPlan(key, shape, None, None, [Box.full(shape)], True)
    boxes = {index_to_box(idx, shape) for idx in sharding.addressable_devices_indices_map(shape).values()}
    return _ArrayPlan(key, shape, sharding, prng, sorted(boxes, key=lambda b: b.offset), False)


def _plan_mapped(ckpt: Any, key: str, leaf: Any, res: Any) -> _ArrayPlan:
    """A target leaf read through a mapping rule (not the identity)."""
    entries = [ckpt.tensor(k) for k in res.source_keys]
    chain = res.chain([tuple(int(n) for n in e.shape) for e in entries], [numpy_dtype(e.dtype) for e in entries])
    if is_prng_key(leaf):
        raise ShapeMismatchError("typed PRNG keys are restored under their own key, not through a mapping",
                                 key=key, expected="an identity mapping", found=res.where)
    want = (tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).name)
    found = (chain.target_shape, chain.target_dtype.name)
    if want != found:
        raise ShapeMismatchError(f"restore target does not match the checkpoint through {res.where}", key=key,
                                 expected=want, found=found)
    shape = want[0]
    sharding = None if isinstance(leaf, np.ndarray) else _target_sharding(leaf)
    if sharding is None:
        return _ArrayPlan(key, shape, None, None, [Box.full(shape)], True, chain)
    boxes = {index_to_box(idx, shape) for idx in sharding.addressable_devices_indices_map(shape).values()}
    return _ArrayPlan(key, shape, sharding, None, sorted(boxes, key=lambda b: b.offset), False, chain)


def _build(plan: _ArrayPlan, got: dict[tuple[str, Box], np.ndarray]) -> Any:
    if plan.host:
        return got.pop((plan.key, plan.boxes[0]))

    # The blocks are fresh arrays this restore owns, so a device may take the host memory as is
    # (may_alias: no second copy on CPU). A block placed on several devices (replication) is
    # aliased once and copied for the others, so no two device buffers ever share memory.
    used: set[Box] = set()
    per_device = []
    for device, index in plan.sharding.addressable_devices_indices_map(plan.shape).items():
        box = index_to_box(index, plan.shape)
        per_device.append(jax.device_put(got[(plan.key, box)], device, may_alias=box not in used))
        used.add(box)
    arr = jax.make_array_from_single_device_arrays(plan.shape, plan.sharding, per_device)
    for b in plan.boxes:  # let the host copies go as soon as the device array holds them
        got.pop((plan.key, b), None)
    return jax.random.wrap_key_data(arr, impl=plan.prng) if plan.prng else arr


def _restore_batches(ckpt: Any, plans: list[Any], built: dict[int, Any]) -> tuple[int, float, int]:
    """Build each batch's arrays as soon as it is read and verified. Returns (bytes, read s, batches)."""
    nbytes, t_read, count = 0, 0.0, 0
    batches = read_batches(ckpt, [None if p is None else p.requests() for p in plans])
    try:
        while True:
            tr = time.perf_counter()
            batch = next(batches, None)  # every byte of this batch is verified before it is yielded
            t_read += time.perf_counter() - tr
            if batch is None:
                break
            got, indices = batch.blocks, batch.groups
            del batch
            count += 1
            nbytes += sum(int(a.nbytes) for a in got.values())
            mapped: dict[int, dict[tuple[str, Box], np.ndarray]] = {}
            for i in indices:  # every mapped leaf first: several may share a source block (tied weights)
                plan = plans[i]
                if plan.chain is not None:
                    blocks = {}
                    for b in plan.boxes:
                        blk = plan.chain.assemble(b, [got[r] for r in plan.reads[b]])
                        blocks[(plan.key, b)] = blk if blk.flags.owndata and blk.flags.c_contiguous else np.array(blk)
                    mapped[i] = blocks
            for i in indices:
                plan = plans[i]
                if i in mapped:
                    built[i] = _build(plan, mapped.pop(i))
                elif plan.host and plan.prng:
                    built[i] = jax.random.wrap_key_data(_build(plan, got), impl=plan.prng)
                else:
                    built[i] = _build(plan, got)
            del got
    finally:
        batches.close()  # stops the reader's threads on every path
    return nbytes, t_read, count


def _is_array_target(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def restore(url: str, target: Any = None, *, step: int | None = None, rank_state_policy: str | None = None,
            mapping: KeyMapping | None = None, strict: bool = True, stats: dict[str, Any] | None = None) -> Any:
    """Restore step ``step`` (None: the latest committed step) of the repository at ``url``.

    ``target`` is a pytree like the saved state. Leaves that are ``jax.ShapeDtypeStruct`` (with
    a ``.sharding``; none means the first local device) or ``jax.Array`` (its sharding is used)
    come back as ``jax.Array`` laid out that way; ``numpy.ndarray`` leaves come back as host
    numpy arrays; any other leaf takes the saved scalar. Keys of the checkpoint that the target
    does not name are not read (a partial restore). ``target=None`` returns host numpy arrays in
    nested dicts keyed by the key-path components (typed PRNG keys come back as key arrays on the
    default device); custom pytree classes and sequences need a target to come back as themselves.

    ``mapping`` (a :class:`bridges.mapping.Mapping` from checkpoint keys to target keys, e.g.
    ``bridges.presets.hf_llama_from_nnx(cfg).inverse()`` for a checkpoint saved by
    ``bridges.torch.save`` from a Hugging Face model) renames keys and transforms layouts; each
    device's box reads only the source boxes it needs. Dtypes must then match exactly, as without.

    ``strict``: a target key the checkpoint lacks raises KeyMismatchError (with why each matching
    rule did not apply); with ``strict=False`` that leaf is returned as given (an abstract
    ShapeDtypeStruct stays abstract: nothing is filled in) and a KeptValuesWarning names it.
    Checkpoint keys the target does not name are never an error here (a partial restore).

    ``stats``, if given, is filled with phase timings (``open_s``, ``plan_s``, ``read_s`` -- read
    and verify --, ``build_s``), ``bytes_restored``, ``batches`` (read batches of about
    RESTORE_BATCH_BYTES), the reader's counters and ``report`` (a
    :class:`bridges.mapping.LoadReport`: loaded, kept, missing, unexpected keys).

    ``url`` may also name a safetensors file or directory (``save_pretrained``'s): it is read in
    place, each process reading only the byte ranges of its own boxes (``ckptfmt.interop``).

    Fails closed: StepNotFoundError, KeyMismatchError (a target key the checkpoint lacks),
    ShapeMismatchError (shape, dtype or PRNG implementation differs; MappingError, a subclass,
    when a mapping rule matched but does not fit), TopologyChangedError (see the module
    docstring), or any verification error of the core reader, all raised before any array is
    returned.
    """
    t0 = time.perf_counter()
    check_rank_state_policy(rank_state_policy)  # a usage error, raised before anything is opened
    ckpt = _open(url, step)
    _check_policy(ckpt, rank_state_policy)
    bridge = _bridge_state(ckpt)
    t1 = time.perf_counter()
    keys = set(ckpt.keys())
    kept: dict[int, Any] = {}
    notes: dict[str, str] = {}
    if target is None:
        flat_keys = sorted(keys)
        plans = [_ArrayPlan(k, tuple(ckpt.tensor(k).shape), None, bridge["prng_impls"].get(k),
                            [Box.full(tuple(ckpt.tensor(k).shape))], True) for k in flat_keys]
        treedef, flat = None, [(k, None) for k in flat_keys]
    else:
        flat, treedef = flatten_with_keys(target)
        plans = []
        for key, leaf in flat:
            res = mapping.resolve(key, len(getattr(leaf, "shape", ())), keys) if mapping is not None else None
            if res is not None and (res.transforms or res.source_keys != (key,)):
                lacking = [k for k in res.source_keys if k not in keys]
                if not lacking and _is_array_target(leaf):
                    plans.append(_plan_mapped(ckpt, key, leaf, res))
                    continue
                if not lacking:
                    raise ShapeMismatchError("a mapped key needs an array target (jax.Array, ShapeDtypeStruct or "
                                             "numpy array)", key=key, expected="an array", found=type(leaf).__name__)
                notes[key] = "; ".join(res.notes) or f"{res.where}: the checkpoint lacks {lacking[:3]}"
            elif _is_array_target(leaf):
                if key in keys:
                    plans.append(_plan_leaf(ckpt, keys, bridge, key, leaf))
                    continue
            elif key in bridge["leaves"]:
                plans.append(None)
                continue
            elif key in keys:  # a scalar placeholder for a saved array: host numpy
                shape = tuple(ckpt.tensor(key).shape)
                plans.append(_ArrayPlan(key, shape, None, None, [Box.full(shape)], True))
                continue
            if res is not None and res.notes and key not in notes:
                notes[key] = "; ".join(res.notes)
            if strict:
                hint = closest_key(res.source_key if res is not None else key, keys)
                parts = ([notes[key]] if key in notes else []) + ([f"closest checkpoint key: {hint!r}"] if hint else [])
                why = f" ({'; '.join(parts)})" if parts else ""
                raise KeyMismatchError(f"the restore target has a key the checkpoint does not hold{why}", key=key,
                                       expected="a tensor or scalar of the checkpoint", found="missing")
            kept[len(plans)] = leaf
            plans.append(None)
    requests = [r for p in plans if p is not None for r in p.requests()]
    t2 = time.perf_counter()
    # Read in batches of about RESTORE_BATCH_BYTES so at most one batch of host copies exists at a
    # time (bridges._contract.read_batches). Every batch is verified by the core reader before its
    # arrays are built, and nothing is returned to the caller until every batch has been read and
    # verified: a fault in a later batch raises and drops the arrays already built.
    built: dict[int, Any] = {}
    nbytes, t_read, batches = _restore_batches(ckpt, plans, built)
    t3 = t2 + t_read
    out = [kept[i] if i in kept else bridge["leaves"][key] if plan is None else built.pop(i)
           for i, ((key, _), plan) in enumerate(zip(flat, plans))]
    report = _report(flat, plans, kept, notes, keys, mapping)
    message = report.warning()
    if message:
        warnings.warn(message, KeptValuesWarning, stacklevel=2)
    t4 = time.perf_counter()
    if stats is not None:
        stats.update(step=ckpt.step, open_s=t1 - t0, plan_s=t2 - t1, read_s=t3 - t2, build_s=t4 - t3,
                     bytes_restored=nbytes, boxes=len(requests), batches=batches)
        reader = ckpt.stats
        stats["reader"] = {"bytes_read": reader.bytes_read, "requests": reader.requests,
                           "objects": reader.objects, "timings": dict(reader.timings)}
        stats["report"] = report
    if treedef is None:
        flat_map = {k: v for (k, _), v in zip(flat, out)}
        flat_map.update(bridge["leaves"])
        return nest(flat_map)
    return jax.tree_util.tree_unflatten(treedef, out)


def _report(flat: list[tuple[str, Any]], plans: list[Any], kept: dict[int, Any], notes: dict[str, str],
            keys: set[str], mapping: KeyMapping | None) -> LoadReport:
    used = {r[0] for p in plans if p is not None for r in p.requests()}
    used |= {k for k, _ in flat}
    missing = tuple(flat[i][0] for i in sorted(kept))
    return LoadReport(loaded=tuple(k for i, (k, _) in enumerate(flat) if i not in kept), kept=missing,
                      missing=missing, unexpected=tuple(sorted(k for k in keys - used
                                                               if mapping is None or not mapping.is_ignored(k))),
                      notes=tuple(f"{k}: {notes[k]}" for k in missing if k in notes))


def load_extra(url: str, step: int | None = None) -> Any:
    """The ``extra`` value saved with step ``step`` (None: latest); None if none was saved."""
    st = _open(url, step).state() or {}
    return st.get("extra") if isinstance(st, dict) else None


def load_rank_state(url: str, step: int | None = None, *, rank_state_policy: str | None = None) -> Any:
    """This process's per-rank state of step ``step``, under the topology-change policy.

    Same process count as the save: rank ``jax.process_index()``'s state. Otherwise
    TopologyChangedError unless ``rank_state_policy`` is ``"drop"`` (returns None), ``"rank0"``
    (returns rank 0's state) or ``"same-rank"``. Returns None when no rank state was saved.
    """
    check_rank_state_policy(rank_state_policy)
    return _rank_state(_open(url, step), jax.process_index(), jax.process_count(), rank_state_policy)


def abstract_target(tree: Any, sharding: Any = None) -> Any:
    """A restore target from a live or abstract pytree: arrays become ShapeDtypeStructs.

    ``sharding`` is None (keep each leaf's own), one ``jax.sharding.Sharding`` for every array
    leaf, or a callable ``(key path, leaf) -> Sharding | None``. Other leaves pass through.
    """
    flat, treedef = flatten_with_keys(tree)
    out = []
    for key, leaf in flat:
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            s = sharding(key, leaf) if callable(sharding) else sharding
            s = s if s is not None else getattr(leaf, "sharding", None)
            out.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s))
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


from ._jaxmanager import CheckpointManager as CheckpointManager  # noqa: E402  (it calls the verbs above)
