"""The implementation behind :mod:`bridges.torch` (its face re-exports the public names)."""
from __future__ import annotations

from typing import Any, Mapping as TMapping

import numpy as np
import torch

import ckptfmt
from ckptfmt import Box, LocalShard, SaveHandle
from ckptfmt.asyncsave import HandBack, RetrySchedule, copied_at_call, run_attempts, save_in_flight, start_async
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import SaveInProgressError

from bridges._contract import RESTORE_BATCH_BYTES as RESTORE_BATCH_BYTES
from bridges._contract import UNSET, renamed_keyword, stage_state
from bridges._extra import json_keys
from bridges.torch._conv import _BY_NAME as _BY_NAME, _OBJECTS as _OBJECTS, DTensor as DTensor  # noqa: F401 (bridges.dcp)
from bridges.torch._conv import _flatten, _local_parts, _materialized, _rank, _world
from bridges.torch._conv import (dtype_name as dtype_name, from_numpy as from_numpy, layer_kinds as layer_kinds,
                         local_box as local_box, rng_state as rng_state, set_rng_state as set_rng_state,
                         to_numpy as to_numpy)
from bridges.torch._coord import for_group
from bridges.torch._load import Loaded as Loaded, load as load, load_extra as load_extra, load_rank_state as load_rank_state
from bridges.mapping._mapping import Mapping, Resolved

__all__ = ["save", "load", "load_extra", "load_rank_state", "Loaded", "rng_state", "set_rng_state", "local_box",
           "to_numpy", "from_numpy", "layer_kinds", "RESTORE_BATCH_BYTES"]  # and CheckpointManager, from the face


# ----------------------------------------------------------------------------- save


def _coordinator(coordinator: Any) -> Any:
    if coordinator is not None:
        return coordinator
    if _world() > 1:
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


class _Unread:
    """A plain tensor of a save over its staging budget, not read yet: :meth:`copy` makes its host
    copy (the device-to-host copy of a tensor on an accelerator, then nothing more; a copy of a CPU
    tensor's memory), at the call or by the writer while the caller waits."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = int(tensor.numel()) * int(tensor.element_size())

    def copy(self) -> np.ndarray:
        a = to_numpy(self.tensor)
        return a if self.tensor.device.type != "cpu" else np.array(a)


def _start_host_copies(flat: list[tuple[str, Any]]) -> dict[int, torch.Tensor]:
    """The device-to-host copy of every plain tensor on a CUDA device, each started (non-blocking,
    into pinned host memory) before any is waited on, then one wait per device: the caller waits
    for the copies, not for each in turn. id(tensor) -> its host copy (a private copy). Empty, and
    nothing done, when no tensor is on a CUDA device (DTensors are copied as they are staged)."""
    todo = [v for _, v in flat if isinstance(v, torch.Tensor) and v.device.type == "cuda"
            and not (DTensor is not None and isinstance(v, DTensor))]
    out: dict[int, torch.Tensor] = {}
    for v in todo:
        host = torch.empty(tuple(v.shape), dtype=v.dtype, device="cpu", pin_memory=True)
        host.copy_(v.detach(), non_blocking=True)
        out[id(v)] = host
    for device in {v.device for v in todo}:
        torch.cuda.synchronize(device)
    return out


def _shards(state_dict: Any, *, copy: bool, mapping: Mapping | None = None, budget: int | None = None,
            hand_back: HandBack | None = None) -> tuple[list[LocalShard], dict[str, Any]]:
    """This rank's blocks of ``state_dict`` as the core's shards, and its non-tensor objects. With
    ``copy`` (an asynchronous save), host copies of the blocks; beyond ``budget``, with
    ``hand_back``, the blocks the writer copies while the caller waits
    (``ckptfmt.asyncsave.copied_at_call`` picks them). Over a budget, a plain tensor (no
    ``mapping``) is read only when copied; otherwise CPU tensors are staged as views first, which
    costs no memory, and a tensor on an accelerator is copied to the host whole at the call."""
    shards: list[LocalShard] = []
    objects: dict[str, Any] = {}
    items: list[tuple[str, Any, Resolved]] = []
    flat = list(_flatten(state_dict))
    hosts = _start_host_copies(flat) if copy and hand_back is None else {}
    private: set[int] = set()  # ids of blocks already private host copies (no second copy)
    for key, v in flat:
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
        if hand_back is not None and mapping is None and not (DTensor is not None and isinstance(v, DTensor)):
            # Over a budget, a plain tensor is not read yet: copied below, or by the writer.
            _materialized(v, key)  # a meta tensor raises here, at the call
            shape = tuple(v.shape)
            shards.append(LocalShard(key, shape, numpy_dtype(dtype_name(v.dtype, key)), Box.full(shape), _Unread(v),
                                     replica_id=_rank()))
            continue
        host = hosts.get(id(v))
        parts, rid, sharding = _local_parts(host if host is not None else v, key)
        if host is not None and parts is not None:
            private.update(id(b) for _, b in parts)
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
            shape, cdtype = gshapes[ckey]
            shards.append(LocalShard(ckey, shape, cdtype, cbox, block, replica_id=rid,
                                     sharding=sharding if ckey == key else None))
    if not copy:
        return shards, objects
    # Host copies (any holder may be picked to write, FORMAT.md 8.1), made once every block is
    # known: within the budget at the call, the rest by the writer while the caller waits.
    held = [i for i, sh in enumerate(shards) if isinstance(sh.data, (np.ndarray, _Unread))]
    at_call = copied_at_call([(shards[i].key, int(shards[i].data.nbytes)) for i in held],  # type: ignore[union-attr]
                             budget if hand_back is not None else None)
    for i, now in zip(held, at_call):
        sh, block = shards[i], shards[i].data
        if isinstance(block, _Unread):
            data: Any = block.copy() if now else hand_back.source(block.copy)  # type: ignore[union-attr]
        elif now:
            data = block if id(block) in private else np.array(block)
        else:
            data = hand_back.source(lambda block=block: np.array(block))  # type: ignore[union-attr]
        shards[i] = LocalShard(sh.key, sh.global_shape, sh.dtype, sh.box, data, replica_id=sh.replica_id,
                               sharding=sh.sharding)
    return shards, objects


def save(url: "str | ckptfmt.Repository", state: TMapping[str, Any], *, step: int, extra: Any = None, rank_state: Any = None,
         blocking: bool = True, coordinator: Any = None, save_rng: bool = True,
         metadata: TMapping[str, Any] | None = None, mapping: Mapping | None = None, options: Any = None,
         rank_extra: Any = UNSET) -> Any:
    """Save ``state`` (a state dict: nested dicts of tensors, DTensors and msgpack-able values) as ``step``
    of the repository at ``url`` (a URL, or a :class:`ckptfmt.Repository`, whose storage and caches a
    caller that saves often keeps: the checkpoint manager passes its own).

    Every rank of the process group must call it with the same keys. ``extra`` goes to the global
    state (rank 0's copy), ``rank_state`` (e.g. the data sampler cursor) and, with ``save_rng``,
    this rank's torch RNG states to the per-rank state. Returns the committed manifest, or with
    ``blocking=False`` a :class:`ckptfmt.SaveHandle` whose ``result()`` returns it (tensor data is
    copied to host memory before this returns, so training may continue and mutate the tensors).
    ``rank_extra`` is the deprecated name of ``rank_state`` (DeprecationWarning; removed next release).

    On failure nothing is committed and every rank raises the same CheckpointError
    (StepMismatchError, IncompleteSaveError, CoordinatorTimeoutError, ...; by ``result()`` for a
    background save); a non-tensor leaf msgpack cannot encode raises InvalidStateError naming its
    key path before anything is written, and so does a meta tensor (no data: materialize it first,
    e.g. ``module.to_empty(device=...)`` and load its weights); a save while an earlier ``blocking=False`` save is in
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
    return _save(url, state, step=step, extra=extra, rank_state=rank_state, blocking=blocking, coordinator=coordinator,
                 save_rng=save_rng, metadata=metadata, mapping=mapping, options=options)


def _save(url: "str | ckptfmt.Repository", state: TMapping[str, Any], *, step: int, extra: Any = None,
          rank_state: Any = None, blocking: bool = True, coordinator: Any = None, save_rng: bool = True,
          metadata: TMapping[str, Any] | None = None, mapping: Mapping | None = None, options: Any = None,
          retry: RetrySchedule | None = None) -> Any:
    """:func:`save`; ``retry``: the manager's retry schedule (``ckptfmt.asyncsave.run_attempts``),
    run in the background for ``blocking=False``."""
    if blocking and save_in_flight():
        raise SaveInProgressError("an earlier save(blocking=False) is still in flight; call its result() first",
                                  expected="no save in flight", found=f"a background save; requested step {step}")

    budget = getattr(options, "max_staging_bytes", None)
    # Beyond options.max_staging_bytes the writer copies the blocks while the caller waits.
    hand_back = HandBack() if budget is not None and not blocking else None

    def stage() -> tuple[Any, int]:
        shards, objects = _shards(state, copy=not blocking, mapping=mapping, budget=budget, hand_back=hand_back)
        # torch.rank_state: whether the caller asked for per-rank state (FORMAT.md 13.3); without
        # it the per-rank objects hold only the RNG states the bridge records itself.
        global_state = {"torch": {"objects": objects, "rank_state": rank_state is not None},
                        "extra": json_keys(extra, "extra")}
        per_rank = {"torch": {"rng": rng_state() if save_rng else None}, "extra": json_keys(rank_state, "rank_state")}
        # InvalidStateError here, before any collective; async saves keep a snapshot, not references.
        global_state, per_rank, md = stage_state(global_state, per_rank, dict(metadata or {}), blocking=blocking)
        kw = dict(state=global_state, rank_state=per_rank, metadata=md,
                  coordinator=_coordinator(coordinator), versions={"torch": torch.__version__})
        if options is not None:
            kw["options"] = options
        staged = sum(int(s.data.nbytes) for s in shards if isinstance(s.data, np.ndarray))
        return (lambda: ckptfmt.save(url, step, shards, **kw)), staged

    if blocking:
        return run_attempts(stage()[0], retry)
    handle: SaveHandle = start_async(stage, step=step, wait=False, retry=retry, hand_back=hand_back,
                                     pause_gc=getattr(options, "pause_gc", True))
    return handle



