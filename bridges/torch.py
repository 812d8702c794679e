"""The PyTorch bridge: save a state dict of tensors / DTensors, load one at any topology.

Verbs (the bridge contract, bridges/README.md): :func:`save`, :func:`load`, :func:`load_extra`,
:func:`load_rank_state`.

What a checkpoint holds is the PyTorch profile, normative in spec/FORMAT.md 13.3.

Key paths: nested dicts are flattened with ``/`` (``{"model": {"fc.weight": t}}`` ->
``model/fc.weight``); torch FQNs keep their dots. A tensor (``torch.Tensor`` or ``DTensor``)
becomes a checkpoint tensor; any other leaf (ints, floats, lists such as optimizer
``param_groups``) is non-tensor state, stored as msgpack in the global state under
``torch/objects`` — never pickle.

Sharding: a DTensor's local block is its global box, from
``compute_local_shape_and_global_offset`` (``Shard(d)`` incl. uneven and empty torch.chunk
shards, ``Replicate()``, 1-D and N-D meshes, several placements on one dimension); a strided
layout (``_StridedShard``, FSDP2 over tensor parallelism) is several boxes, each written and read
by global coordinates (:mod:`bridges._dtensor`). ``replica_id`` is the rank's linear coordinate on
the replicated mesh dims; each replicated box is written once, by one of the ranks holding it,
and the ranks take turns (FORMAT.md 8.1). A plain tensor on a multi-rank world is treated as
replicated over all ranks (one rank's copy is written).

Load is target-driven: every rank asks the core reader for exactly the boxes its target values
hold locally, in the checkpoint's coordinates (through a :mod:`bridges.mapping` permutation when
the layouts differ), and permutes the blocks locally. The reads go in batches of about
``RESTORE_BATCH_BYTES`` (``bridges._contract.read_batches``, as in every bridge); the core
verifies every byte of a batch before its values are built, nothing is returned before every
batch is verified, and the target is never modified.

Per-rank state (``rank_state`` and, with ``save_rng``, the torch RNG states) follows the bridge
contract on a topology change: :func:`load` raises TopologyChangedError unless
``rank_state_policy`` says what to do with it.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Mapping as TMapping

import numpy as np
import torch

import ckptfmt
from ckptfmt import Box, LocalShard, SaveHandle, TensorSharding, agree_step
from ckptfmt.asyncsave import save_in_flight, start_async
from ckptfmt.dtypes import DTYPES, ML_DTYPES, numpy_dtype, same_width_int
from ckptfmt.errors import (InvalidStateError, KeyMismatchError, ReferenceCycleError, SaveInProgressError,
                            ShapeMismatchError)
from ckptfmt.reader import check_rank_state_policy
from ckptfmt.interop import open_source
from ckptfmt.state import decode_state, encode_state

from ._contract import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from ._contract import UNSET, check_topology, effective_policy, read_batches, renamed_keyword
from ._contract import rank_state as _rank_state
from ._dtensor import dtensor_pieces
from ._extra import json_keys
from ._rules import closest_key
from .mapping import IDENTITY, KeptValuesWarning, LoadReport, Mapping, MappingError, Resolved

__all__ = ["save", "load", "load_extra", "load_rank_state", "Loaded", "rng_state", "set_rng_state", "local_box",
           "to_numpy", "from_numpy", "layer_kinds", "RESTORE_BATCH_BYTES", "CheckpointManager"]

from ._dtensor import DTensor

_OBJECTS = ("torch", "objects")

# torch dtype -> the core's dtype name (torch names its dtypes as the format does); the ml_dtypes
# ones (numpy has no such type) travel through numpy as same-width integers.
_DTYPES: dict[torch.dtype, str] = {getattr(torch, n): n for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_VIA_INT = {n: (getattr(torch, same_width_int(n).name), same_width_int(n)) for n in _BY_NAME if n in ML_DTYPES}


# ----------------------------------------------------------------------------- conversions


def dtype_name(dtype: torch.dtype, key: str | None = None) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ShapeMismatchError("torch dtype is not supported by the format", key=key,
                                 expected=sorted(_BY_NAME), found=str(dtype)) from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host numpy view (or copy, for non-CPU tensors) of a plain tensor, any dtype we store."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    name = dtype_name(t.dtype)
    if name in _VIA_INT:
        return t.view(_VIA_INT[name][0]).numpy().view(numpy_dtype(name))
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A torch tensor of ``dtype`` holding ``a`` (cast if needed), contiguous, on ``device``."""
    name = dtype_name(dtype)
    want = numpy_dtype(name)
    if a.dtype != want:
        a = a.astype(want)  # a fresh C-contiguous array
    elif not a.flags.c_contiguous:
        a = a.copy(order="C")  # np.ascontiguousarray would turn a 0-d array into 1-d
    t = torch.from_numpy(a.view(_VIA_INT[name][1])).view(dtype) if name in _VIA_INT else torch.from_numpy(a)
    return t.to(device) if torch.device(device).type != "cpu" else t


# ----------------------------------------------------------------------------- flattening


def _flatten(tree: Any, prefix: str = "", within: frozenset[int] = frozenset()) -> Iterator[tuple[str, Any]]:
    """(key path, leaf) pairs; dicts recurse, everything else is a leaf. A dict that contains
    itself (``within``: the ids of the dicts above) raises ReferenceCycleError at the key path
    where the cycle closes."""
    if isinstance(tree, TMapping):
        if id(tree) in within:
            raise ReferenceCycleError(f"state dict entry {prefix!r} contains itself (a reference cycle closes here)",
                                      key=prefix, expected="a tree of dicts", found="a dict seen above")
        inner = within | {id(tree)}
        for k, v in tree.items():
            part = str(k)
            if not part or "/" in part:
                raise ValueError(f"state dict key {k!r} under {prefix or '<root>'!r} cannot be part "
                                 "of a key path (empty or contains '/')")
            yield from _flatten(v, f"{prefix}/{part}" if prefix else part, inner)
    else:
        if not prefix:
            raise ValueError("the state is a single leaf; wrap it in a dict, e.g. {'x': tensor}")
        yield prefix, tree


def _rebuild(tree: Any, values: dict[str, Any], prefix: str = "") -> Any:
    if isinstance(tree, TMapping):
        out = {}
        for k, v in tree.items():
            p = f"{prefix}/{k}" if prefix else str(k)
            out[k] = _rebuild(v, values, p)
        return out
    return values[prefix]


# ----------------------------------------------------------------------------- boxes


def local_box(t: torch.Tensor) -> tuple[Box | None, int, TensorSharding | None]:
    """This rank's (global box, replica_id, sharding description) of ``t``.

    The box is None when this rank is not part of the DTensor's mesh. Plain tensors: the full
    box, replica_id = this rank (one rank writes it, FORMAT.md 8.1). Raises InvalidStateError for
    a placement that cannot be saved (a ``Partial`` must be reduced first) and for a strided
    layout whose local block is several boxes (``bridges._dtensor.dtensor_pieces`` gives those).
    """
    if DTensor is not None and isinstance(t, DTensor):
        pieces, rid, sharding = dtensor_pieces(t, "<tensor>")
        if pieces is None:
            return None, 0, None
        if len(pieces) != 1:
            raise InvalidStateError("the DTensor's local block is several global boxes",
                                    key="<tensor>", expected="one box", found=len(pieces))
        return pieces[0].box, rid, sharding
    return Box.full(tuple(t.shape)), _rank(), None


def _rank() -> int:
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else 0


def _world() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _norm_like(m: torch.nn.Module) -> bool:
    """A normalization layer by behaviour: a ``*Norm`` class (``LlamaRMSNorm``, ``Qwen2RMSNorm``,
    ``T5LayerNorm``, ...) whose only parameters are a 1-D ``weight`` (and ``bias``), no running stats."""
    name = type(m).__name__
    params = dict(m.named_parameters(recurse=False))
    return (name.endswith(("RMSNorm", "LayerNorm", "GroupNorm")) and "weight" in params
            and params["weight"].ndim == 1 and set(params) <= {"weight", "bias"}
            and not any(True for _ in m.named_buffers(recurse=False)))


def layer_kinds(module: torch.nn.Module) -> dict[str, str]:
    """Module path -> layer kind for :func:`bridges.mapping.flax_nnx_to_torch` (``layers=``).

    torch layers by class (``nn.Linear`` -> linear, ``_ConvNd`` -> conv, ``nn.Embedding``,
    ``_BatchNorm``, ``nn.LayerNorm`` / ``nn.GroupNorm`` / ``nn.RMSNorm`` -> norm); any other
    ``*RMSNorm`` / ``*LayerNorm`` class with a 1-D weight (transformers' ``LlamaRMSNorm``) -> norm;
    transformers' ``Conv1D`` (weight stored (in, out)) -> conv1d.
    """
    nn = torch.nn
    kinds: list[tuple[type, str]] = [
        (nn.Linear, "linear"), (nn.modules.conv._ConvNd, "conv"), (nn.Embedding, "embedding"),
        (nn.modules.batchnorm._BatchNorm, "batchnorm"), (nn.LayerNorm, "norm"), (nn.GroupNorm, "norm")]
    if hasattr(nn, "RMSNorm"):
        kinds.append((nn.RMSNorm, "norm"))
    out: dict[str, str] = {}
    for name, m in module.named_modules():
        if not name:
            continue
        for cls, kind in kinds:
            if isinstance(m, cls):
                out[name] = kind
                break
        else:
            if _norm_like(m):
                out[name] = "norm"
            elif type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None:
                out[name] = "conv1d"
    return out


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """This process's torch RNG states: CPU, and every CUDA device when CUDA is initialized."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: TMapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only when CUDA is present)."""
    torch.set_rng_state(torch.from_numpy(np.asarray(state["cpu"], dtype=np.uint8).copy()))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.asarray(s, dtype=np.uint8).copy())
                                      for s in state["cuda"]])


# ----------------------------------------------------------------------------- save


def _coordinator(coordinator: Any) -> Any:
    if coordinator is not None:
        return coordinator
    if _world() > 1:
        from ._torchcoord import for_group
        return for_group()
    return ckptfmt.LocalCoordinator()


def _select_sizes(items: list[tuple[str, Any, Resolved]]) -> dict[tuple[str, ...], int]:
    """The stacked length of every unsized Select: all of 0..n-1 must be saved (one per layer key)."""
    seen: dict[tuple[str, ...], set[int]] = {}
    for _, _, res in items:
        sel = res.unsized_select
        if sel is not None:
            seen.setdefault(res.source_keys, set()).add(int(sel.index))  # type: ignore[arg-type]
    out = {}
    for src, idx in seen.items():
        n = max(idx) + 1
        if idx != set(range(n)):
            raise ValueError(f"{src[0]!r} is stacked from keys with indices {sorted(idx)}; every index "
                             f"0..{n - 1} must be saved (or give Select(size=...))")
        out[src] = n
    return out


def _target_boxes(v: torch.Tensor, key: str) -> list[tuple[Box, tuple[slice, ...] | None]] | None:
    """The global boxes a target value's local tensor covers, with where each lies in it (None:
    the whole local tensor is that one box); None when this rank is not on the DTensor's mesh."""
    if DTensor is None or not isinstance(v, DTensor):
        return [(Box.full(tuple(v.shape)), None)]
    pieces, _, _ = dtensor_pieces(v, key)
    if pieces is None:
        return None
    if len(pieces) == 1 and pieces[0].box.shape == tuple(_local(v).shape):
        return [(pieces[0].box, None)]
    return [(p.box, p.local) for p in pieces]


def _assemble(chain: Any, pieces: list[tuple[Box, Any, list]], blocks: TMapping[Any, np.ndarray],
              local_shape: tuple[int, ...]) -> np.ndarray:
    """The local array of a target value from its pieces' verified blocks."""
    if len(pieces) == 1 and pieces[0][1] is None:
        box, _, reads = pieces[0]
        return chain.assemble(box, [blocks[r] for r in reads])
    out: np.ndarray | None = None
    for box, where, reads in pieces:
        part = chain.assemble(box, [blocks[r] for r in reads])
        if out is None:
            out = np.empty(local_shape, dtype=part.dtype)
        out[where] = part
    assert out is not None
    return out


def _local_parts(v: torch.Tensor, key: str) -> tuple[list[tuple[Box, np.ndarray]] | None, int, TensorSharding | None]:
    """This rank's (global box, block) pairs of ``v`` (None: not on its mesh), replica id and
    sharding description: one pair for a plain tensor or a Shard/Replicate DTensor, several for
    a strided layout (bridges/_dtensor.py)."""
    if DTensor is None or not isinstance(v, DTensor):
        return [(Box.full(tuple(v.shape)), to_numpy(v))], _rank(), None
    pieces, rid, sharding = dtensor_pieces(v, key)
    if pieces is None:
        return None, rid, None
    local = _local(v)
    data = to_numpy(local)
    covered = sum(int(np.prod(p.box.shape)) for p in pieces)
    if covered != int(np.prod(tuple(local.shape))):
        raise InvalidStateError("the DTensor's local tensor does not match the boxes its placements give",
                                key=key, expected=[str(p.box) for p in pieces][:4], found=tuple(local.shape))
    return [(p.box, data[p.local]) for p in pieces], rid, sharding


def _shards(state_dict: Any, *, copy: bool, mapping: Mapping | None = None
            ) -> tuple[list[LocalShard], dict[str, Any]]:
    shards: list[LocalShard] = []
    objects: dict[str, Any] = {}
    items: list[tuple[str, Any, Resolved]] = []
    for key, v in _flatten(state_dict):
        if not isinstance(v, torch.Tensor):
            objects[key] = v
            continue
        # resolve_writes: the tensor(s) a key is written to (a rule's `also` copies: NNX's step).
        items += [(key, v, r) for r in (mapping.resolve_writes(key, v.ndim) if mapping is not None
                                        else (Resolved(key, key),))]
    sizes = _select_sizes(items)
    written: dict[tuple[str, Box], tuple[str, Any]] = {}  # (checkpoint key, box) -> (state key, block)
    declared: dict[str, tuple[tuple[int, ...], Any]] = {}  # checkpoint key -> (global shape, dtype)
    for key, v, res in items:
        parts, rid, sharding = _local_parts(v, key)
        dtype = numpy_dtype(dtype_name(v.dtype, key))
        if not res.transforms and res.source_keys == (key,):
            pieces = [] if parts is None else [(key, box, data) for box, data in parts]
            gshapes = {key: (tuple(v.shape), dtype)}
        else:  # store in the checkpoint's layout: each piece is a box of a checkpoint-side tensor
            chain = res.chain_for_target(tuple(v.shape), dtype, sizes.get(res.source_keys))
            pieces = [] if parts is None else [w for box, data in parts for w in chain.writes(box, data)]
            gshapes = {k: (s, d) for k, s, d in zip(chain.source_keys, chain.source_shapes, chain.source_dtypes)}
            sharding = None
        for ckey, spec in gshapes.items():
            if declared.setdefault(ckey, spec) != spec:
                raise ValueError(f"{key!r} maps to {ckey!r} as {spec}, another state key as {declared[ckey]}")
        if parts is None:
            continue
        for ckey in gshapes:  # every rank lists every checkpoint key, even without a piece of it
            if not any(p[0] == ckey for p in pieces):
                shape = gshapes[ckey][0]
                pieces.append((ckey, Box((0,) * len(shape), (0,) * len(shape)), None))
        for ckey, cbox, block in pieces:
            if block is not None and block.dtype != gshapes[ckey][1]:
                block = block.astype(gshapes[ckey][1])
            if (ckey, cbox) in written and block is not None:
                # Several state keys map to one checkpoint box (torch's per-parameter AdamW `step`
                # -> optax's single `count`; tied weights): written once, and only if they agree.
                first, other = written[ckey, cbox]
                if other is None or other.shape != block.shape or other.dtype != block.dtype \
                        or other.tobytes() != block.tobytes():
                    raise ValueError(f"{key!r} and {first!r} both map to {ckey!r} {cbox} but differ")
                continue
            if block is not None:
                written[ckey, cbox] = (key, block)
            if copy and block is not None:  # any holder may be picked to write (FORMAT.md 8.1)
                block = np.array(block)
            shape, cdtype = gshapes[ckey]
            shards.append(LocalShard(ckey, shape, cdtype, cbox, block, replica_id=rid,
                                     sharding=sharding if ckey == key else None))
    return shards, objects


def save(url: str, state: TMapping[str, Any], *, step: int, extra: Any = None, rank_state: Any = None,
         blocking: bool = True, coordinator: Any = None, save_rng: bool = True,
         metadata: TMapping[str, Any] | None = None, mapping: Mapping | None = None, options: Any = None,
         rank_extra: Any = UNSET) -> Any:
    """Save ``state`` (a state dict: nested dicts of tensors, DTensors and msgpack-able values) as ``step``.

    Every rank of the process group must call it with the same keys. ``extra`` goes to the global
    state (rank 0's copy), ``rank_state`` (e.g. the data sampler cursor) and, with ``save_rng``,
    this rank's torch RNG states to the per-rank state. Returns the committed manifest, or with
    ``blocking=False`` a :class:`ckptfmt.SaveHandle` whose ``result()`` returns it (tensor data is
    copied to host memory before this returns, so training may continue and mutate the tensors).
    ``rank_extra`` is the deprecated name of ``rank_state`` (DeprecationWarning; removed next release).

    On failure nothing is committed and every rank raises the same CheckpointError
    (StepMismatchError, IncompleteSaveError, CoordinatorTimeoutError, ...; by ``result()`` for a
    background save); a non-tensor leaf msgpack cannot encode raises InvalidStateError naming its
    key path before anything is written; a save while an earlier ``blocking=False`` save is in
    flight raises SaveInProgressError.

    ``extra`` / ``rank_state`` take any value ``json.dumps`` takes (a Hugging Face config dict)
    plus bytes and numpy arrays; dict keys are stored as JSON writes them (``1`` -> ``"1"``,
    ``True`` -> ``"true"``, ``None`` -> ``"null"``) and tuples come back as lists, so what
    :func:`load` returns equals ``json.loads(json.dumps(extra))`` for JSON values (see
    ``bridges/_extra.py``).

    ``mapping`` (the same object :func:`load` takes, e.g. ``flax_nnx_to_torch()`` or a preset of
    :mod:`bridges.presets`) writes tensors under the checkpoint-side names and layouts, so that
    ``bridges.jax.restore`` can read a torch save directly: each rank writes its local block as
    the box(es) of the checkpoint-side tensor(s) (per-layer keys into one stacked tensor, a fused
    tensor into its parts), no gather. A transform whose inverse is not exact for the values
    (a non-power-of-two Scale) raises MappingError before anything is written.
    """
    rank_state = renamed_keyword("save", "rank_extra", "rank_state", rank_extra, rank_state)
    if blocking and save_in_flight():
        raise SaveInProgressError("an earlier save(blocking=False) is still in flight; call its result() first",
                                  expected="no save in flight", found=f"a background save; requested step {step}")

    def stage() -> tuple[Any, int]:
        shards, objects = _shards(state, copy=not blocking, mapping=mapping)
        # torch.rank_state: whether the caller asked for per-rank state (FORMAT.md 13.3); without
        # it the per-rank objects hold only the RNG states the bridge records itself.
        global_state = {"torch": {"objects": objects, "rank_state": rank_state is not None},
                        "extra": json_keys(extra, "extra")}
        per_rank = {"torch": {"rng": rng_state() if save_rng else None}, "extra": json_keys(rank_state, "rank_state")}
        # InvalidStateError here, before any collective; async saves keep a snapshot, not references.
        blobs = encode_state(global_state), encode_state(per_rank)
        if not blocking:
            global_state, per_rank = decode_state(blobs[0]), decode_state(blobs[1])
        kw = dict(state=global_state, rank_state=per_rank, metadata=dict(metadata or {}),
                  coordinator=_coordinator(coordinator), versions={"torch": torch.__version__})
        if options is not None:
            kw["options"] = options
        staged = sum(int(s.data.nbytes) for s in shards if isinstance(s.data, np.ndarray))
        return (lambda: ckptfmt.save(url, step, shards, **kw)), staged

    if blocking:
        return stage()[0]()
    handle: SaveHandle = start_async(stage, step=step, wait=False)
    return handle


def _open(url: str, step: int | None) -> Any:
    """Open ``step``, or the latest step as rank 0 sees it, agreed by every rank (ckptfmt.agree_step:
    rank 0's listing error reaches every rank at once); or a safetensors source (ckptfmt.interop)."""
    return open_source(url, step, resolve=_step_everyone_opens)


def _step_everyone_opens(repo: Any, step: int | None) -> int | None:
    if step is None and _world() > 1:
        from ._torchcoord import for_group
        return agree_step(repo, None, for_group())
    return step


# ----------------------------------------------------------------------------- load


class Loaded(dict):
    """The loaded state dict (same nesting as the target) plus what the load found.

    ``report``: a :class:`bridges.mapping.LoadReport` (loaded, kept, missing, unexpected keys and
    the notes that explain missing ones). ``missing_keys`` / ``unexpected_keys``: the same lists
    (only non-empty with ``strict=False``). ``extra``: the global ``extra`` saved with the
    checkpoint. ``rank_state`` / ``rng``: this rank's saved per-rank state (the caller's
    ``rank_state`` and the torch RNG states; at another world size per ``rank_state_policy``).
    ``rank_extra``: the deprecated name of ``rank_state``. ``bytes_read``: tensor bytes this rank
    read (chunk data, checksums and shard indexes); ``objects_read``: how many shard objects it read from;
    ``batches``: how many read batches (of about RESTORE_BATCH_BYTES) the load took.
    """

    step: int
    report: LoadReport
    missing_keys: list[str]
    unexpected_keys: list[str]
    extra: Any
    rank_state: Any
    rng: Any
    saved_world: int
    bytes_read: int
    objects_read: int
    batches: int

    @property
    def rank_extra(self) -> Any:
        warnings.warn("Loaded.rank_extra is deprecated and will be removed in the next release; use Loaded.rank_state",
                      DeprecationWarning, stacklevel=2)
        return self.rank_state


def _can_cast(src: np.dtype, dst: np.dtype) -> bool:
    try:
        return bool(np.can_cast(src, dst, "same_kind"))
    except TypeError:
        return False


def load(url: str, target: TMapping[str, Any], *, step: int | None = None, rank_state_policy: str | None = None,
         mapping: Mapping | None = None, strict: bool = True, rank_policy: Any = UNSET) -> Loaded:
    """Load checkpoint ``step`` (default: the latest) into new tensors shaped like ``target``.

    With ``step=None`` on several ranks, every rank must call ``load``: rank 0 picks the latest
    step and broadcasts it (or the error it hit listing the repository), so all ranks read the
    same one.

    ``target``'s values say what is wanted: global shape, dtype (values are cast when the
    checkpoint's dtype is of the same kind or narrower kind, e.g. int32 -> float32), device,
    and for DTensors the mesh and placements. ``mapping`` renames keys and transforms layouts
    (see :mod:`bridges.mapping`, :mod:`bridges.presets`); without one, keys must be equal. Each
    rank reads only the source boxes its target values need.

    ``url`` may also name a safetensors file or directory (``save_pretrained``'s): it is read in
    place, each process reading only the byte ranges of its own boxes (``ckptfmt.interop``).

    Fails closed: missing or unexpected keys raise KeyMismatchError naming them and, for a
    missing key, why each matching rule did not apply. ``strict=False`` keeps the target's value
    for a missing key, reports it (``Loaded.report``) and warns with KeptValuesWarning. A rule that
    matched but does not fit the tensors raises MappingError (a ShapeMismatchError) naming the
    rule, the transform and the reason; a shape or dtype that does not match raises
    ShapeMismatchError naming the key; corrupt data raises the core's CheckpointError, and nothing
    is returned before every batch of reads is verified. Per-rank state (``rank_state``, ``rng``)
    saved by another number of ranks: when the save was given a ``rank_state``, raises
    TopologyChangedError, naming the policies, before any tensor is read, unless
    ``rank_state_policy`` is "drop" (None), "rank0" (rank 0's) or "same-rank"; when it was not
    (the per-rank state is only the RNG states the bridge recorded), the restore goes on with
    ``rng`` None unless a policy asks for them. Any other ``rank_state_policy`` raises ValueError
    naming the accepted ones, before anything is opened. ``rank_policy`` is its deprecated name (DeprecationWarning).
    ``target`` is never modified.
    """
    rank_state_policy = renamed_keyword("load", "rank_policy", "rank_state_policy", rank_policy, rank_state_policy)
    check_rank_state_policy(rank_state_policy)  # a usage error, raised before anything is opened
    mapping = mapping or IDENTITY
    ckpt = _open(url, step)
    gstate = ckpt.state() or {}
    rank_state_policy = _policy(ckpt, gstate, rank_state_policy)
    check_topology(ckpt, _world(), rank_state_policy)
    src_keys = set(ckpt.keys())
    saved_objects = _saved_objects(gstate)

    flat = list(_flatten(target))
    missing: list[str] = []
    kept: list[str] = []
    notes: list[str] = []
    used: set[str] = set()
    mismatches: list[ShapeMismatchError] = []
    plan: dict[str, tuple[Any, Box, list[tuple[str, Box]]] | None] = {}
    values: dict[str, Any] = {}
    for key, v in flat:
        if not isinstance(v, torch.Tensor):
            if key in saved_objects:
                values[key] = saved_objects[key]
                used.add(key)
            else:
                kept.append(key)
                if not mapping.is_kept(key):
                    missing.append(key)
                values[key] = v
            continue
        res = mapping.resolve(key, v.ndim, src_keys)
        lacking = [k for k in res.source_keys if k not in src_keys]
        if lacking:
            kept.append(key)
            if not mapping.is_kept(key):
                missing.append(key)
                note = "; ".join(res.notes) if res.notes else f"{res.where}: the checkpoint lacks {lacking[:3]}"
                hint = closest_key(lacking[0], src_keys) if len(missing) <= 3 else None  # slow: a few only
                notes.append(f"{key}: {note}" + (f" (closest checkpoint key: {hint!r})" if hint else ""))
            values[key] = v
            continue
        used.update(res.source_keys)
        entries = [ckpt.tensor(k) for k in res.source_keys]
        try:
            chain = res.chain([tuple(e.shape) for e in entries], [numpy_dtype(e.dtype) for e in entries])
        except MappingError as e:
            mismatches.append(e)
            continue
        want_shape = tuple(v.shape)
        dst_dt = numpy_dtype(dtype_name(v.dtype, key))
        if chain.target_shape != want_shape:
            mismatches.append(ShapeMismatchError(
                f"target shape does not match the checkpoint (source {list(res.source_keys)[:3]} through "
                f"{res.where})", key=key, expected=want_shape, found=chain.target_shape))
            continue
        if chain.target_dtype != dst_dt and not _can_cast(chain.target_dtype, dst_dt):
            mismatches.append(ShapeMismatchError(f"cannot cast checkpoint dtype to the target's "
                                                 f"(source {res.source_key!r})", key=key,
                                                 expected=str(dst_dt), found=str(chain.target_dtype)))
            continue
        boxes = _target_boxes(v, key)
        if boxes is None:  # this rank holds no part of the DTensor
            plan[key] = None
            continue
        pieces = [(b, sl, [] if b.is_empty() else chain.reads(b)) for b, sl in boxes]
        plan[key] = (chain, pieces, [r for _, _, rs in pieces for r in rs])

    unexpected = sorted(k for k in (src_keys | set(saved_objects)) - used if not mapping.is_ignored(k))
    if len(mismatches) == 1:
        raise mismatches[0]
    if mismatches:
        raise ShapeMismatchError(f"{len(mismatches)} target values do not match the checkpoint: "
                                 + "; ".join(str(m) for m in mismatches),
                                 key=mismatches[0].key, expected=[m.expected for m in mismatches],
                                 found=[m.found for m in mismatches])
    if strict and (missing or unexpected):
        why = (" -- " + " | ".join(notes[:6])) if notes else ""
        raise KeyMismatchError(f"target and checkpoint keys differ: missing {missing}, "
                               f"unexpected {unexpected}{why}", key=(missing or unexpected)[0],
                               expected=missing, found=unexpected)

    before, objects_before = _bytes_read(ckpt), _stat(ckpt, "objects")
    targets = dict(flat)
    for key, item in plan.items():
        if item is None:
            values[key] = targets[key]
        elif not item[2]:  # an empty local box: nothing to read
            local = _local(targets[key])
            values[key] = _wrap_like(targets[key], torch.empty(tuple(local.shape), dtype=targets[key].dtype,
                                                               device=local.device))
    order = [k for k, item in plan.items() if item is not None and item[2]]
    batches = 0
    for batch in read_batches(ckpt, [plan[k][2] for k in order]):  # type: ignore[index]
        batches += 1
        for i in batch.groups:
            key = order[i]
            chain, pieces, reads = plan[key]  # type: ignore[misc]
            blocks = [batch.blocks[r] for r in reads]
            arr = _assemble(chain, pieces, batch.blocks, tuple(_local(targets[key]).shape))
            if any(r in batch.shared for r in reads) and any(np.shares_memory(arr, b) for b in blocks):
                arr = arr.copy()  # a block read once for several keys: no two tensors share memory
            v = targets[key]
            values[key] = _wrap_like(v, from_numpy(arr, v.dtype, _local(v).device))

    out = Loaded(_rebuild(target, values))
    out.step = ckpt.step
    kept_set = set(kept)
    out.report = LoadReport(loaded=tuple(k for k, _ in flat if k not in kept_set), kept=tuple(kept),
                            missing=tuple(missing), unexpected=tuple(unexpected), notes=tuple(notes))
    out.missing_keys, out.unexpected_keys = missing, unexpected
    out.extra = gstate.get("extra") if isinstance(gstate, dict) else None
    out.saved_world = int(ckpt.saved_world)
    rs = _rank_state(ckpt, _rank(), _world(), rank_state_policy) or {}
    out.rank_state = rs.get("extra") if isinstance(rs, dict) else None
    out.rng = ((rs.get("torch") or {}).get("rng")) if isinstance(rs, dict) else None
    out.bytes_read = _bytes_read(ckpt) - before
    out.objects_read = _stat(ckpt, "objects") - objects_before
    out.batches = batches
    message = out.report.warning()
    if message:
        warnings.warn(message, KeptValuesWarning, stacklevel=2)
    return out


def load_extra(url: str, step: int | None = None) -> Any:
    """The ``extra`` value saved with step ``step`` (None: the latest, agreed as in :func:`load`);
    None if none was saved. Raises StepNotFoundError, or the core's error for an unreadable state."""
    st = _open(url, step).state() or {}
    return st.get("extra") if isinstance(st, dict) else None


def load_rank_state(url: str, step: int | None = None, *, rank_state_policy: str | None = None) -> Any:
    """This rank's ``rank_state`` (as passed to :func:`save`) of step ``step``, under the
    topology-change policy of :func:`load`; None when none was saved. The RNG states come with
    :func:`load` (``Loaded.rng``). Raises ValueError for an unknown policy before anything is
    opened, and TopologyChangedError (naming the policies) at another world size without one
    when the save was given a ``rank_state`` (None otherwise: nothing was asked for).
    """
    check_rank_state_policy(rank_state_policy)
    ckpt = _open(url, step)
    rs = _rank_state(ckpt, _rank(), _world(), _policy(ckpt, ckpt.state() or {}, rank_state_policy))
    return rs.get("extra") if isinstance(rs, dict) else None


def _policy(ckpt: Any, gstate: Any, policy: str | None) -> str | None:
    """The per-rank-state policy of a restore (bridges._contract.effective_policy): a checkpoint
    whose ``torch.rank_state`` is false holds only the bridge's RNG states per rank, which another
    world size drops unless ``policy`` asks for them. A checkpoint without the flag (written before
    it existed, or by another profile) is taken to hold the caller's per-rank state."""
    record = gstate.get(_OBJECTS[0]) if isinstance(gstate, dict) else None
    asked = not (isinstance(record, dict) and record.get("rank_state") is False)
    return effective_policy(ckpt, _world(), policy, caller_state=asked)


def _saved_objects(gstate: Any) -> dict[str, Any]:
    """``torch.objects`` of the global state (FORMAT.md 13.3); {} for a checkpoint of no profile."""
    record = gstate.get(_OBJECTS[0]) if isinstance(gstate, dict) else None
    if record is None:
        return {}
    objects = record.get(_OBJECTS[1]) if isinstance(record, dict) else None
    if not isinstance(objects, dict):
        raise InvalidStateError("the torch profile record of the global state is malformed: "
                                "torch.objects must be a map", key="torch/objects", expected="map",
                                found=type(objects).__name__ if isinstance(record, dict) else type(record).__name__)
    return objects


def _bytes_read(ckpt: Any) -> int:
    return _stat(ckpt, "bytes_read")


def _stat(ckpt: Any, name: str) -> int:
    stats = getattr(ckpt, "stats", None)
    if stats is None:
        return 0
    return int(stats.get(name, 0) if isinstance(stats, dict) else getattr(stats, name, 0))


def _wrap_like(v: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(v, DTensor):
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    return local


from ._torchmanager import CheckpointManager as CheckpointManager  # noqa: E402  (it calls the verbs above)
