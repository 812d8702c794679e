"""The PyTorch bridge's conversions (bridges/torch/_api.py): torch dtypes and tensors <-> numpy, state
dict flattening (key paths), a value's global boxes on this rank, layer kinds and the RNG states.
The bridge's own half of the contract: leaf <-> box and block <-> value; nothing here plans."""
from __future__ import annotations

from typing import Any, Iterator, Mapping as TMapping

import numpy as np
import torch

from ckptfmt import Box, TensorSharding
from ckptfmt.dtypes import DTYPES, ML_DTYPES, numpy_dtype, same_width_int
from ckptfmt.errors import InvalidStateError, ReferenceCycleError, ShapeMismatchError

from bridges.torch._dtensor import DTensor, dtensor_pieces

__all__ = ["dtype_name", "to_numpy", "from_numpy", "local_box", "layer_kinds", "rng_state", "set_rng_state"]

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
    layout whose local block is several boxes (``bridges.torch._dtensor.dtensor_pieces`` gives those).
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


def _materialized(t: torch.Tensor, key: str) -> torch.Tensor:
    """``t`` itself; InvalidStateError naming ``key`` for a meta tensor, which has a shape but no data
    (a model built under ``torch.device("meta")`` and not yet materialized), before anything is written."""
    if t.is_meta:
        raise InvalidStateError("a meta tensor has no data to save: materialize it first (module.to_empty(device=...) "
                                "and load or initialize its weights) or leave it out of the state",
                                key=key, expected="a tensor with data (cpu, cuda, ...)", found=f"meta tensor {tuple(t.shape)}")
    return t


def _local_parts(v: torch.Tensor, key: str) -> tuple[list[tuple[Box, np.ndarray]] | None, int, TensorSharding | None]:
    """This rank's (global box, block) pairs of ``v`` (None: not on its mesh), replica id and
    sharding description: one pair for a plain tensor or a Shard/Replicate DTensor, several for
    a strided layout (bridges/torch/_dtensor.py)."""
    if DTensor is None or not isinstance(v, DTensor):
        return [(Box.full(tuple(v.shape)), to_numpy(_materialized(v, key)))], _rank(), None
    pieces, rid, sharding = dtensor_pieces(v, key)
    if pieces is None:
        return None, rid, None
    local = _materialized(_local(v), key)
    data = to_numpy(local)
    covered = sum(int(np.prod(p.box.shape)) for p in pieces)
    if covered != int(np.prod(tuple(local.shape))):
        raise InvalidStateError("the DTensor's local tensor does not match the boxes its placements give",
                                key=key, expected=[str(p.box) for p in pieces][:4], found=tuple(local.shape))
    return [(p.box, data[p.local]) for p in pieces], rid, sharding


def _wrap_like(v: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(v, DTensor):
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    return local
