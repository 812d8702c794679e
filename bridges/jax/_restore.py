"""The JAX bridge's restore verbs (:func:`restore`, :func:`load_extra`, :func:`load_rank_state`),
re-exported by :mod:`bridges.jax`.

The plan is the core's (:func:`ckptfmt.restoreplan.plan_restore`, the one planner of every
bridge, bridges/README.md "The restore semantics"); this module turns target leaves into
:class:`TargetLeaf`s and the boxes of their addressable shards, and verified blocks into arrays
(``jax.make_array_from_single_device_arrays``: a sharded target is never assembled whole on the host).
"""
from __future__ import annotations

import bisect
import time
import warnings
from typing import Any

import jax
import numpy as np
from numpy.lib.array_utils import byte_bounds

from ckptfmt import Box, Repository, agree_step
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.gcpause import pausing_gc
from ckptfmt.errors import CheckpointError, InvalidStateError, ShapeMismatchError
from ckptfmt.interop import open_source
from ckptfmt.rankstate import RankStatePolicy
from ckptfmt.reader import CoopStats
from ckptfmt.restoreplan import RestorePlan, RestoreSource, TargetLeaf, TensorPlan, plan_restore

from bridges._contract import caller_rank_state, check_topology, effective_policy, read_batches, restore_stats
from bridges.jax._coord import JaxCoordinator
from bridges.jax._place import place_many
from bridges.jax._share import JaxExchange, spans_processes
from bridges.jax._tree import flatten_with_keys, index_to_box, is_prng_key, nest, physical_sharding, placement
from bridges.mapping._mapping import KeptValuesWarning, Mapping as KeyMapping

__all__ = ["restore", "load_extra", "load_rank_state"]

BRIDGE_VERSION = 1


def _open(url: str, step: int | None) -> RestoreSource:
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


def _bridge_state(ckpt: RestoreSource) -> dict[str, Any]:
    """The JAX profile's record (FORMAT.md 13.2), checked; empty for a checkpoint of no profile."""
    st = ckpt.state() or {}
    b = st.get("bridge") if isinstance(st, dict) else None
    if b is None:
        return {"leaves": {}, "prng_impls": {}}

    def bad(what: str, expected: Any, found: Any) -> InvalidStateError:
        return InvalidStateError(f"the JAX profile record of the global state is malformed: {what}",
                                 key="bridge", expected=expected, found=found)

    if not isinstance(b, dict) or b.get("name") != "jax" or b.get("version") != BRIDGE_VERSION \
            or isinstance(b.get("version"), bool):
        found = {k: b.get(k) for k in ("name", "version")} if isinstance(b, dict) else type(b).__name__
        raise bad("name and version", {"name": "jax", "version": BRIDGE_VERSION}, found)
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


def _impl_name(dtype: Any) -> str:
    return str(dtype._impl.name)  # typed key dtypes carry their PRNGImpl


#: Where an array is built besides a sharding: a host numpy array, or JAX's default placement (an
#: uncommitted array on the default device, as ``jnp`` creates one; ``_jaxtree.placement``).
_HOST, _DEFAULT = "host", "default"


class _ArrayPlan:
    """One target array: the core's TensorPlan, and the boxes of this process's shards (``_HOST``
    or ``_DEFAULT``: one whole box); ``reads`` lists each box's checkpoint reads."""

    __slots__ = ("tp", "key", "shape", "sharding", "prng", "boxes", "host", "reads", "devices")

    def __init__(self, tp: TensorPlan, sharding: Any, prng: str | None,
                 placements: dict[tuple[Any, tuple[int, ...]], list[tuple[Any, Box]]] | None = None) -> None:
        self.tp, self.key, self.shape, self.sharding, self.prng = tp, tp.key, tp.shape, sharding, prng
        self.host = sharding is _HOST
        #: Each addressable device and the box of the array it holds (sharded targets only).
        self.devices: list[tuple[Any, Box]] = []
        if sharding is _HOST or sharding is _DEFAULT:
            self.boxes = [Box.full(tp.shape)]
        else:
            # Leaves of one shape and sharding (thousands of experts) share their placement.
            try:
                known = placements.get((sharding, tp.shape)) if placements is not None else None
            except TypeError:  # a sharding that cannot be a key: placed on its own
                known, placements = None, None
            if known is None:
                known = [(d, index_to_box(i, tp.shape)) for d, i in sharding.addressable_devices_indices_map(tp.shape).items()]
                if placements is not None:
                    placements[(sharding, tp.shape)] = known
            self.devices = known
            self.boxes = sorted({b for _, b in self.devices}, key=lambda b: b.offset)
        self.reads = {b: tp.reads(b) for b in self.boxes}

    def requests(self) -> list[tuple[str, Box]]:
        return [r for b in self.boxes for r in self.reads[b]]


def _is_array_target(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _leaf(ckpt: RestoreSource, keys: set[str], impls: dict[str, Any], key: str, leaf: Any,
          errors: list[CheckpointError]) -> TargetLeaf:
    """The planner's view of one target leaf. A typed PRNG key is its uint32 key data (the trailing
    key dimensions are the checkpoint's), restored as is; a key of another implementation is a
    mismatch (``errors``)."""
    if not _is_array_target(leaf):
        return TargetLeaf(key, "any")
    shape = tuple(int(n) for n in leaf.shape)
    if not is_prng_key(leaf):
        return TargetLeaf(key, "array", shape, np.dtype(leaf.dtype))
    want = _impl_name(leaf.dtype)
    if key not in keys:
        return TargetLeaf(key, "array", shape, np.dtype("uint32"), cast=False)
    entry = ckpt.tensor(key)
    found = tuple(int(n) for n in entry.shape)
    saved = impls.get(key)
    if saved != want or str(entry.dtype) != "uint32" or found[:len(shape)] != shape:
        errors.append(ShapeMismatchError("typed PRNG key does not match the checkpoint", key=key,
                                         expected=(shape, f"key<{want}>"),
                                         found=(found, f"key<{saved}>" if saved else str(entry.dtype))))
        return TargetLeaf(key, "any")  # read nothing more for it
    return TargetLeaf(key, "array", found, np.dtype("uint32"), cast=False)


def _arrays(plan: RestorePlan, flat: list[tuple[str, Any]], impls: dict[str, Any]) -> dict[str, _ArrayPlan]:
    leaves = dict(flat)
    out: dict[str, _ArrayPlan] = {}
    placements: dict[tuple[Any, tuple[int, ...]], list[tuple[Any, Box]]] = {}
    for tp in plan.tensors:
        leaf = leaves.get(tp.key)
        prng = impls.get(tp.key) if leaf is None or is_prng_key(leaf) else None
        if leaf is not None and is_prng_key(leaf):
            if tp.chain is not None:
                raise ShapeMismatchError("typed PRNG keys are restored under their own key, not through a mapping",
                                         key=tp.key, expected="an identity mapping", found=str(tp.source_keys))
            logical = tuple(int(n) for n in leaf.shape)
            placed = placement(leaf)
            sharding = _DEFAULT if placed is None else physical_sharding(placed, logical, leaf.dtype)
        elif leaf is None or isinstance(leaf, np.ndarray) or not _is_array_target(leaf):
            sharding = _HOST  # host numpy (target None, a numpy leaf, a scalar placeholder for an array)
        else:
            placed = placement(leaf)
            sharding = _DEFAULT if placed is None else placed
        out[tp.key] = _ArrayPlan(tp, sharding, prng, placements)
    return out


def _build_many(items: list[tuple[_ArrayPlan, dict[Box, np.ndarray]]]) -> list[Any]:
    """Each plan's array from its verified blocks: host numpy as is, an uncommitted array on the
    default device, or a sharded array whose device shards are placed together
    (:func:`bridges.jax._place.place_many`). The blocks are fresh arrays this restore owns, so a
    device may take the host memory as is (no second copy on CPU); a block placed on several
    devices (replication) is given once and copied for the others, so no two device buffers
    ever share memory."""
    sharded = [i for i, (plan, _) in enumerate(items) if not plan.host and plan.sharding is not _DEFAULT]
    leaves = []
    for i in sharded:
        plan, blocks = items[i]
        used: set[Box] = set()
        pairs = []
        for device, box in plan.devices:
            block = blocks[box]
            fresh = box not in used and block.flags.c_contiguous  # (a 0-d block stays 0-d: no ascontiguousarray)
            pairs.append((device, block if fresh else np.array(block, order="C")))
            used.add(box)
        leaves.append((plan.shape, plan.sharding, pairs))
    placed = dict(zip(sharded, place_many(leaves)))
    out = []
    for i, (plan, blocks) in enumerate(items):
        if plan.host:
            arr: Any = blocks[plan.boxes[0]]
        elif i not in placed:
            arr = jax.device_put(blocks[plan.boxes[0]], may_alias=True)  # uncommitted: jit may move it
        else:
            arr = placed[i]
        out.append(jax.random.wrap_key_data(arr, impl=plan.prng) if plan.prng else arr)
    return out


def _build(plan: _ArrayPlan, blocks: dict[Box, np.ndarray]) -> Any:
    return _build_many([(plan, blocks)])[0]


def _unshared(blk: np.ndarray, handed: list[tuple[int, int]]) -> np.ndarray:
    """``blk``, or a copy of it when its bytes overlap a block already handed out (a source block
    that two leaves share: tied weights), so that no two arrays of one restore share host memory.
    A view into the reader's buffer that overlaps nothing is handed out as is (no copy)."""
    lo, hi = byte_bounds(blk)
    at = bisect.bisect_left(handed, (lo, hi))
    if blk.nbytes and ((at < len(handed) and handed[at][0] < hi) or (at and handed[at - 1][1] > lo)):
        blk = np.array(blk)
        lo, hi = byte_bounds(blk)
        at = bisect.bisect_left(handed, (lo, hi))
    if blk.nbytes:
        handed.insert(at, (lo, hi))
    return blk


def _restore_batches(ckpt: RestoreSource, plans: list[_ArrayPlan], built: dict[str, Any], exchange: Any = None,
                     coop: CoopStats | None = None) -> tuple[int, float, int]:
    """Build each batch's arrays as soon as it is read and verified (``exchange``: a cooperative
    restore, FORMAT.md 9.1). Returns (bytes, read s, batches).

    Where every array lives in host memory (CPU devices, or host numpy), the arrays are built once
    every batch is read instead: a CPU device takes the verified block as is (no copy), so
    building early frees no memory, and its thousands of small calls, made while the reader's
    threads work, queued for the interpreter lock behind them (1 GiB Llama state: the build took
    1.0-1.6 s against 0.2-0.5 s after the reads)."""
    nbytes, t_read, count = 0, 0.0, 0
    later: list[tuple[int, dict[Box, np.ndarray]]] | None = [] if _in_host_memory(plans) else None
    batches = read_batches(ckpt, [p.requests() for p in plans], exchange=exchange, coop=coop)
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
            assembled: dict[int, dict[Box, np.ndarray]] = {}
            handed: list[tuple[int, int]] = []  # byte ranges already handed out, sorted
            for i in indices:  # every leaf first: several may share a source block (tied weights)
                blocks = {}
                for b in plans[i].boxes:
                    blocks[b] = _unshared(plans[i].tp.assemble(b, [got[r] for r in plans[i].reads[b]]), handed)
                assembled[i] = blocks
            if later is not None:
                later.extend((i, assembled.pop(i)) for i in indices)
            else:
                order = list(indices)
                for i, arr in zip(order, _build_many([(plans[i], assembled.pop(i)) for i in order])):
                    built[plans[i].key] = arr
            del got
    finally:
        batches.close()  # stops the reader's threads on every path
    if later:
        for (i, _), arr in zip(later, _build_many([(plans[i], blocks) for i, blocks in later])):
            built[plans[i].key] = arr
    for p in plans:
        if not p.requests():  # an empty tensor has no shards to read (FORMAT.md 5.7): build it as it is
            built[p.key] = _build(p, {b: _empty(p, b) for b in p.boxes})
    return nbytes, t_read, count


def _in_host_memory(plans: list[_ArrayPlan]) -> bool:
    """Every array of ``plans`` is host numpy or lives on CPU devices."""
    default = None
    for p in plans:
        if p.host:
            continue
        if p.sharding is _DEFAULT:
            default = default or jax.devices()[0].platform
            if default != "cpu":
                return False
        elif any(d.platform != "cpu" for d, _ in p.devices):
            return False
    return True


def _empty(plan: _ArrayPlan, box: Box) -> np.ndarray:
    """The block of a box with nothing to read: a box of no elements."""
    if not box.is_empty():  # every box of a tensor with elements has reads: never invent its values
        raise CheckpointError("a box of a restored tensor has no reads; report this as a bug", key=plan.key,
                              expected="reads for every box with elements", found=f"box {box.offset} {box.shape}")
    return np.empty(box.shape, dtype=plan.tp.dtype)


@pausing_gc
def restore(url: str, target: Any = None, *, step: int | None = None, rank_state_policy: str | None = None,
            mapping: KeyMapping | None = None, strict: bool | None = None, stats: dict[str, Any] | None = None,
            cooperative: bool | None = None) -> Any:
    """Restore step ``step`` (None: the latest committed step) of the repository at ``url``.

    ``target`` is a pytree like the saved state. Leaves that are ``jax.ShapeDtypeStruct`` (with
    a ``.sharding``) or committed ``jax.Array`` (its sharding is used) come back as ``jax.Array``
    laid out that way; a ShapeDtypeStruct without a sharding, or an uncommitted ``jax.Array``,
    comes back uncommitted on the default device, as ``jnp`` places a new array (a jitted step
    moves it to its other arguments' devices); ``numpy.ndarray`` leaves come back as host
    numpy arrays; any other leaf takes the saved scalar. ``target=None`` returns host numpy arrays
    in nested dicts keyed by the key-path components (typed PRNG keys come back as key arrays on
    the default device); custom pytree classes and sequences need a target to come back as themselves.

    ``mapping`` (a :class:`bridges.mapping.Mapping` from checkpoint keys to target keys, e.g.
    ``bridges.presets.hf_llama_from_nnx(cfg).inverse()``) renames keys and transforms layouts;
    each device's box reads only the source boxes it needs. ``url`` may also name a safetensors
    file or directory (``save_pretrained``'s), read in place (``ckptfmt.interop``).

    The restore semantics of every bridge (bridges/README.md; ``ckptfmt.restoreplan``): checkpoint
    keys the target does not name are a partial restore, reported (``strict=True``: an error);
    target keys the checkpoint lacks raise unless ``strict=False``, which returns that leaf as given
    (an abstract ShapeDtypeStruct stays abstract), reports it and warns with KeptValuesWarning; a
    dtype of the same kind (float to float, int to int) is cast to the target's and reported,
    across kinds it is an error (typed PRNG keys must match exactly). Every mismatch is raised in
    ONE error (KeyMismatchError, ShapeMismatchError or MappingError when it is the only kind,
    RestoreMismatchError otherwise), with the full lists as its attributes, before anything is
    read. Also StepNotFoundError, TopologyChangedError (see the module docstring of
    :mod:`bridges.jax`), or any verification error of the core reader, all raised before any
    array is returned.

    ``cooperative``: a box several processes restore is read by one and shared (FORMAT.md 9.1;
    by default as :func:`_cooperates` says; False: each reads all). ``stats``, if given, is filled
    as in every bridge (``step``, ``report``, ``extra``, ``rank_state``, ``batches``, ``bytes_read``
    from storage, ``cooperative``) plus phase timings (``open_s``, ``plan_s``, ``read_s`` -- read
    and verify --, ``build_s``), ``bytes_restored``, ``boxes`` and the reader's counters (``reader``).
    """
    t0 = time.perf_counter()
    policy = RankStatePolicy.of(rank_state_policy)  # the one check (a usage error), before anything is opened
    ckpt = _open(url, step)
    # A torch checkpoint holding only the torch bridge's RNG states goes on at another world size
    # without a policy (FORMAT.md 13.3), as in bridges.torch.load.
    world = jax.process_count()
    policy = effective_policy(ckpt, world, policy, caller_state=caller_rank_state(ckpt.state() or {}))
    check_topology(ckpt, world, policy)
    bridge = _bridge_state(ckpt)
    t1 = time.perf_counter()
    keys = set(ckpt.keys())
    errors: list[CheckpointError] = []
    if target is None:
        flat: list[tuple[str, Any]] = [(k, None) for k in sorted(keys)]
        leaves = [TargetLeaf(k, "array", tuple(ckpt.tensor(k).shape), np.dtype(_dtype(ckpt, k)), cast=False)
                  for k, _ in flat] + [TargetLeaf(k, "object") for k in sorted(bridge["leaves"])]
        treedef = None
    else:
        flat, treedef = flatten_with_keys(target)
        leaves = [_leaf(ckpt, keys, bridge["prng_impls"], k, leaf, errors) for k, leaf in flat]
    plan = plan_restore(ckpt, leaves, mapping, strict, objects=bridge["leaves"], mismatches=errors)
    arrays = _arrays(plan, flat, bridge["prng_impls"])
    t2 = time.perf_counter()
    # Read in batches of about RESTORE_BATCH_BYTES so at most one batch of host copies exists at a
    # time (bridges._contract.read_batches). Every batch is verified by the core reader before its
    # arrays are built, and nothing is returned to the caller until every batch has been read and
    # verified: a fault in a later batch raises and drops the arrays already built.
    built: dict[str, Any] = {}
    before = int(ckpt.stats.bytes_read)
    exchange, coop = JaxExchange() if _cooperates(cooperative, flat, plan) else None, CoopStats()
    nbytes, t_read, batches = _restore_batches(ckpt, list(arrays.values()), built, exchange, coop)
    t3 = t2 + t_read
    values = {**{k: bridge["leaves"][src] for k, src in plan.objects.items()}, **built}
    message = plan.report.warning()
    if message:
        warnings.warn(message, KeptValuesWarning, stacklevel=2)
    t4 = time.perf_counter()
    if stats is not None:
        _fill_stats(stats, ckpt, plan, policy, batches, int(ckpt.stats.bytes_read) - before)
        stats.update(open_s=t1 - t0, plan_s=t2 - t1, read_s=t3 - t2, build_s=t4 - t3, bytes_restored=nbytes,
                     cooperative=coop.as_dict(), boxes=sum(len(a.requests()) for a in arrays.values()))
    if treedef is None:
        return nest(values)
    return jax.tree_util.tree_unflatten(treedef, [values[k] if k in values else leaf for k, leaf in flat])


def _cooperates(cooperative: bool | None, flat: list[tuple[str, Any]], plan: RestorePlan) -> bool:
    """Whether this restore is cooperative: ``cooperative=None`` (the default) when the devices are
    accelerators (on the host CPU's collectives sharing is slower than reading: 100 MB/s against
    2 GB/s, docs/cooperative-restore.md) and a target array
    lies on devices of several processes with some box on devices of more than one (every process
    then calls ``restore``, as a sharded restore requires anyway); True: for every restore on
    several processes (every process must call it); False: never. The same answer on every
    process: it depends only on the option and the target's shardings. A read that fails on any
    process then raises the same typed error on every process, and none returns anything."""
    if cooperative is False or jax.process_count() == 1:
        return False
    if cooperative:
        return True
    if all(d.platform == "cpu" for d in jax.devices()):
        return False
    planned = {tp.key: tp for tp in plan.tensors}
    for key, leaf in flat:
        if key not in planned or not spans_processes(leaf) or is_prng_key(leaf):
            continue
        owners: dict[Box, set[int]] = {}
        for device, index in leaf.sharding.devices_indices_map(planned[key].shape).items():
            owners.setdefault(index_to_box(index, planned[key].shape), set()).add(device.process_index)
        if any(len(ps) > 1 for ps in owners.values()):
            return True
    return False


def _dtype(ckpt: RestoreSource, key: str) -> np.dtype:
    return numpy_dtype(ckpt.tensor(key).dtype)


def _fill_stats(stats: dict[str, Any], ckpt: RestoreSource, plan: RestorePlan, policy: RankStatePolicy | None, batches: int,
                bytes_read: int) -> None:
    st = ckpt.state() or {}
    extra = st.get("extra") if isinstance(st, dict) else None
    rank_state = ckpt.rank_state(jax.process_index(), world=jax.process_count(), policy=policy)
    stats.update(restore_stats(plan, extra=extra, rank_state=rank_state, batches=batches, bytes_read=bytes_read))
    reader = ckpt.stats
    stats["reader"] = {"bytes_read": reader.bytes_read, "requests": reader.requests,
                       "objects": reader.objects, "timings": dict(reader.timings)}


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
    policy = RankStatePolicy.of(rank_state_policy)  # the one check, before anything is opened
    return _open(url, step).rank_state(jax.process_index(), world=jax.process_count(), policy=policy)
