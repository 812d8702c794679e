"""LoRA adapters out: a committed step's low-rank pairs as a PEFT adapter directory, or merged into
the base weights as a Hugging Face export (docs/INTEROP.md, "LoRA adapters").

The JAX side (Flax NNX ``nnx.LoRA`` / ``nnx.LoRALinear``, or the user's own pair) computes
``y = x @ W + s * (x @ a @ b)`` with ``a`` (in, r) and ``b`` (r, out); ``nnx.LoRA`` applies no
scale (s = 1). PEFT's ``LoraLayer`` computes ``y = x W^T + (alpha / r) * (x A^T) B^T`` with
``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r), under the keys
``base_model.model.<module path>.lora_{A,B}.weight``. So ``A = a^T``, ``B = b^T`` and
``alpha = s * r`` (default: ``alpha = r``, nnx.LoRA's forward).

Layout (the ``hf_llama_from_nnx`` preset's): per-layer tensors stacked on axis 0, so a pair is
``a`` (L, *in_dims, r) and ``b`` (L, r, *out_dims), the dims flattened in C order as the preset
merges (heads, head_dim). By default the pair of module ``q_proj`` sits beside its kernel as
``nnx.LoRALinear`` keeps it: ``model/layers/attn/q/lora/lora_a`` and ``.../lora_b``.

Fails closed: every pair, its shapes, one rank and the base kernel it adapts are checked before
anything is written; every byte read is verified by the reader, and the adapter file is read
back and compared (crc32c) before it gets its name; ``adapter_config.json`` is published last.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping as TMapping, Sequence

import numpy as np

from ckptfmt.checksum import crc32c
from ckptfmt.errors import ChecksumMismatchError, InvalidConfigError, KeyMismatchError, ShapeMismatchError
from ckptfmt.dtypes import dtype_name, numpy_dtype
from ckptfmt.interop import ExportReport, ImportTensor, check_out_dir, export_safetensors, import_tensors, output_dtype
from ckptfmt.interop import create_exclusive, encode_header, publish, read_config, temp_name
from ckptfmt.reader import Checkpoint
from ckptfmt.repository import Repository
from ckptfmt import Box

from bridges.interop._export_map import export_tensors, preset_mapping
from bridges.presets._registry import LLAMA_NNX_NAMES, llama_dims

__all__ = ["export_peft", "PeftReport", "LORA_MODULES", "ADAPTER_FILE", "ADAPTER_CONFIG"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: PEFT target module -> (HF parent module, the preset's name key of its kernel).
LORA_MODULES = {"q_proj": ("self_attn", "q_kernel"), "k_proj": ("self_attn", "k_kernel"),
                "v_proj": ("self_attn", "v_kernel"), "o_proj": ("self_attn", "o_kernel"),
                "gate_proj": ("mlp", "gate_kernel"), "up_proj": ("mlp", "up_kernel"), "down_proj": ("mlp", "down_kernel")}
_PRESET = "hf_llama_from_nnx"


@dataclass(frozen=True)
class PeftReport:
    """What :func:`export_peft` wrote: the files, the adapted modules, rank, alpha, adapter tensor
    bytes (or, merged, the export's tensor bytes), bytes read from the checkpoint, seconds."""

    out_dir: str
    files: tuple[str, ...]
    target_modules: tuple[str, ...]
    rank: int
    alpha: float
    nbytes: int
    bytes_read: int
    seconds: float
    step: int
    merged: bool


@dataclass(frozen=True)
class _Pair:
    module: str          # q_proj
    a: str               # checkpoint key of a (L, *in, r)
    b: str               # checkpoint key of b (L, r, *out)
    base: str            # checkpoint key of the kernel it adapts
    parent: str          # self_attn
    features: tuple[int, int]  # (in, out) of the HF Linear


def _features(dims: dict[str, Any]) -> dict[str, tuple[int, int]]:
    d, q, kv, f = dims["d"], dims["heads"] * dims["head_dim"], dims["kv"] * dims["head_dim"], dims["ffn"]
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def _pairs(keys: set[str], config: Any, target_modules: Sequence[str] | None,
           adapters: TMapping[str, str | tuple[str, str]] | None, names: TMapping[str, str] | None,
           model: str) -> list[_Pair]:
    """The adapted modules and their keys; KeyMismatchError for a pair or a base kernel missing."""
    table = dict(LLAMA_NNX_NAMES, **(names or {}))
    feats = _features(llama_dims(config))
    given = dict(adapters or {})
    # Parenthesised: `-` binds tighter than `|`, and every module adapters= names was reported unknown.
    unknown = sorted((set(given) | set(target_modules or ())) - set(LORA_MODULES))
    if unknown:
        raise ValueError(f"unknown LoRA target module(s) {unknown}; known: {sorted(LORA_MODULES)}")
    out = []
    for module, (parent, kname) in LORA_MODULES.items():
        base = f"{model}/{table[kname]}"
        where = given.get(module, base.rsplit("/", 1)[0] + "/lora")
        a, b = (f"{where}/lora_a", f"{where}/lora_b") if isinstance(where, str) else tuple(where)
        wanted = module in (target_modules or ()) or (target_modules is None and (module in given or a in keys or b in keys))
        if not wanted:
            continue
        for key, what in ((a, "lora_a (in, r)"), (b, "lora_b (r, out)"), (base, "the base kernel it adapts")):
            if key not in keys:
                raise KeyMismatchError(f"LoRA target {module}: {what} is not in the checkpoint; an adapter export "
                                       "needs both tensors of every pair (adapters= names them)", key=key,
                                       expected="a saved key", found="missing")
        out.append(_Pair(module, a, b, base, parent, feats[module]))
    if not out:
        raise KeyMismatchError("no LoRA pair in the checkpoint (looked for nnx.LoRALinear's <kernel dir>/lora/lora_a "
                               "and lora_b; name yours with adapters=)", object=model,
                               expected="at least one pair", found="none")
    return out


def _check_shapes(ckpt: Checkpoint, pairs: Sequence[_Pair], layers: int, rank: int | None) -> int:
    """The one rank of every pair; ShapeMismatchError naming the tensor otherwise."""
    ranks = set()
    for p in pairs:
        fi, fo = p.features
        sa, sb, sk = (tuple(ckpt.tensor(k).shape) for k in (p.a, p.b, p.base))
        r = sa[-1] if sa else -1
        checks = [(p.a, sa, len(sa) >= 3 and sa[0] == layers and math.prod(sa[1:-1]) == fi, f"({layers}, {fi}, r)"),
                  (p.b, sb, len(sb) >= 3 and sb[0] == layers and sb[1] == r and math.prod(sb[2:]) == fo,
                   f"({layers}, {r}, {fo})"),
                  (p.base, sk, len(sk) >= 3 and sk[0] == layers and math.prod(sk[1:]) == fi * fo,
                   f"({layers}, {fi} x {fo} in the preset's dims)")]
        for key, found, ok, want in checks:
            if not ok:
                raise ShapeMismatchError(f"LoRA target {p.module}: tensor does not fit its layer (a stacked "
                                         "(L, in, r) / (L, r, out) pair, nnx.LoRA's orientation)", key=key,
                                         expected=want, found=found)
        if r < 1:  # PEFT cannot load r = 0, and alpha / r (the merge's scale) is undefined
            raise ShapeMismatchError(f"LoRA target {p.module}: the pair has rank 0 (lora_a's last dim); PEFT's r "
                                     f"must be 1 or more: leave {p.module} out of target_modules= (or adapters=), "
                                     "or save the pair with its rank", key=p.a, expected="r >= 1", found=sa)
        ranks.add(r)
    if len(ranks) != 1 or (rank is not None and ranks != {rank}):
        raise ShapeMismatchError("the LoRA pairs do not share one rank (PEFT's r)", key=pairs[0].a,
                                 expected=rank if rank is not None else "one rank", found=sorted(ranks))
    return ranks.pop()


def _finite_alpha(alpha: float | None, r: int) -> float:
    """PEFT's lora_alpha as a finite float; InvalidConfigError otherwise (JSON has no NaN or Infinity,
    and a merge would add NaN * a @ b to every adapted kernel)."""
    value = float(r if alpha is None else alpha)
    if not math.isfinite(value):
        raise InvalidConfigError("alpha (PEFT's lora_alpha) is not a finite number, so adapter_config.json cannot "
                                 "hold it and a merge would write NaN weights; pass alpha= as the JAX forward's "
                                 "scale times r (None: r)", object=ADAPTER_CONFIG, expected="a finite number",
                                 found=repr(alpha))
    return value


def _config_bytes(conf: TMapping[str, Any]) -> bytes:
    """``adapter_config.json``'s bytes; strict JSON (no NaN/Infinity), InvalidConfigError otherwise."""
    try:
        return json.dumps(dict(conf), indent=2, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:  # a non-JSON base_model_name_or_path, a non-finite float
        raise InvalidConfigError("the adapter config cannot be written as JSON", object=ADAPTER_CONFIG,
                                 found=str(e)[:200]) from None


def _peft_tensors(ckpt: Checkpoint, pairs: Sequence[_Pair], layers: int, dtype: str | None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for p in pairs:
        fi, fo = p.features
        a, b = ckpt.read(p.a), ckpt.read(p.b)  # verified reads
        for i in range(layers):
            stem = f"base_model.model.model.layers.{i}.{p.parent}.{p.module}"
            out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(fi, -1).T)
            out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(-1, fo).T)
    if dtype is not None:  # floating-point cast, as export's dtype=
        out = {k: v.astype(numpy_dtype(output_dtype(dtype_name(v.dtype), dtype))) for k, v in out.items()}
    return out


def _write_verified(out_dir: str, name: str, data: bytes) -> str:
    """Write ``data`` under its temporary name, fsync, read back and compare, then publish."""
    tmp = os.path.join(out_dir, temp_name(name))
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp, "rb") as f:
            back = f.read()
        if len(back) != len(data) or crc32c(back) != crc32c(data):
            raise ChecksumMismatchError("the written file differs from the bytes meant for it", object=tmp,
                                        expected=f"{len(data)} bytes, crc32c {crc32c(data):08x}",
                                        found=f"{len(back)} bytes, crc32c {crc32c(back):08x}")
        publish(tmp, os.path.join(out_dir, name))
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return name


def _safetensors_bytes(tensors: TMapping[str, np.ndarray], metadata: TMapping[str, str]) -> bytes:
    names = sorted(tensors)
    header, _ = encode_header([(n, dtype_name(tensors[n].dtype), tensors[n].shape) for n in names], metadata)
    return header + b"".join(tensors[n].tobytes() for n in names)


def adapter_config(pairs: Sequence[_Pair], rank: int, alpha: float, base: str | None) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for these pairs (no dropout, no bias, (out, in) weights)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(p.module for p in pairs), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base,
            "modules_to_save": None}


def _merged_reader(ckpt: Checkpoint, p: _Pair, scale: float) -> Callable[[Box], np.ndarray]:
    """Blocks of the base kernel plus ``scale * a @ b`` (float32 arithmetic, the kernel's dtype)."""
    fi, fo = p.features

    def read(box: Box) -> np.ndarray:
        base = ckpt.read(p.base, box)
        lo, n = box.offset[0], box.shape[0]
        r = ckpt.tensor(p.a).shape[-1]
        a = ckpt.read(p.a).reshape(-1, fi, r)[lo:lo + n].astype(np.float32)
        b = ckpt.read(p.b).reshape(-1, r, fo)[lo:lo + n].astype(np.float32)
        delta = (np.float32(scale) * (a @ b)).reshape((n,) + tuple(ckpt.tensor(p.base).shape[1:]))
        sl = (slice(None),) + tuple(slice(o, o + s) for o, s in zip(box.offset[1:], box.shape[1:]))
        return (base.astype(np.float32) + delta[sl]).astype(base.dtype)
    return read


def _merge(url: str, ckpt: Checkpoint, out_dir: str, pairs: Sequence[_Pair], scale: float, config: Any,
           names: TMapping[str, str] | None, model: str, dtype: str | None) -> ExportReport:
    """Base + adapters as a temporary step (streamed, verified), then the preset's export of it."""
    check_out_dir(out_dir, ["config.json"])  # early: before the temporary step is written
    kw: dict[str, Any] = {"model": (model, "model")}
    if names is not None:
        kw["names"] = dict(names)
    mapping = preset_mapping(_PRESET, config, **kw)
    adapters = {k for p in pairs for k in (p.a, p.b)}
    merged = {p.base: p for p in pairs}
    tensors = []
    for key in ckpt.keys():
        if key in adapters or mapping.is_ignored(key):
            continue
        t = ckpt.tensor(key)
        read = _merged_reader(ckpt, merged[key], scale) if key in merged else \
            (lambda box, key=key: ckpt.read(key, box))
        tensors.append(ImportTensor(key, tuple(t.shape), t.dtype, read))
    tmp = tempfile.mkdtemp(prefix="ckptfmt-merge-")
    try:
        import_tensors(os.path.join(tmp, "repo"), ckpt.step, tensors,
                       provenance={"format": "lora-merge", "source": str(url), "step": ckpt.step,
                                   "targets": sorted(merged), "scale": scale})
        return export_safetensors(os.path.join(tmp, "repo"), out_dir, config=config, dtype=dtype,
                                  tensors=lambda c: export_tensors(c, mapping, dtype)[:2])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_peft(url: str, out_dir: str, *, config: TMapping[str, Any] | str | os.PathLike,
                target_modules: Sequence[str] | None = None,
                adapters: TMapping[str, str | tuple[str, str]] | None = None, rank: int | None = None,
                alpha: float | None = None, merge: bool = False, step: int | None = None,
                names: TMapping[str, str] | None = None, model: str = "model", dtype: str | None = None,
                base_model_name_or_path: str | None = None) -> PeftReport:
    """Export the LoRA adapters of step ``step`` (None: latest) of ``url`` as a PEFT adapter
    directory (``adapter_model.safetensors`` + ``adapter_config.json``) for a Llama-family base
    laid out as ``hf_llama_from_nnx`` reads it (``config``: the HF config, a dict or a path;
    ``names``: the preset's name table overrides); or, ``merge=True``, the base weights with the
    adapters merged in, as :func:`bridges.interop.export` writes them (one process) (``model-*.safetensors``).

    ``target_modules``: PEFT module names (``q_proj`` ... ``down_proj``; None: every module whose pair is
    in the checkpoint). ``adapters``: module -> the pair's key prefix (leaves ``lora_a``,
    ``lora_b``) or a (a key, b key) tuple; default ``<kernel's dir>/lora`` (``nnx.LoRALinear``).
    ``alpha``: PEFT's lora_alpha, the JAX forward's scale times r (None: r, nnx.LoRA's unscaled
    forward). ``rank``: asserted when given.

    Fails closed, before anything is written: ValueError for a module name not in
    :data:`LORA_MODULES`; KeyMismatchError naming a missing ``lora_a`` / ``lora_b`` / base kernel;
    ShapeMismatchError naming a tensor whose shape does not fit (or pairs of different ranks, or a
    pair of rank 0); InvalidConfigError for an ``alpha`` that is NaN or infinite (or a
    ``base_model_name_or_path`` JSON cannot hold); OutputExistsError when ``out_dir`` holds safetensors files or the
    adapter files. Later the reader's CheckpointError, or ChecksumMismatchError when a written file
    reads back different; then no file of this export keeps its name but those already published
    (the weights before the config: a directory without ``adapter_config.json`` is not an adapter).
    """
    t0 = time.perf_counter()
    if isinstance(config, (str, os.PathLike)):
        config = read_config(config)
    ckpt = Repository(str(url)).open(step)
    layers = llama_dims(config)["layers"]
    pairs = _pairs(set(ckpt.keys()), config, target_modules, adapters, names, model)
    r = _check_shapes(ckpt, pairs, layers, rank)
    alpha = _finite_alpha(alpha, r)
    modules = tuple(sorted(p.module for p in pairs))
    if merge:
        rep = _merge(str(url), ckpt, out_dir, pairs, alpha / r, config, names, model, dtype)
        return PeftReport(str(out_dir), rep.files, modules, r, alpha, rep.nbytes, int(ckpt.stats.bytes_read) + rep.bytes_read,
                          time.perf_counter() - t0, ckpt.step, True)
    check_out_dir(out_dir, [ADAPTER_FILE, ADAPTER_CONFIG])
    tensors = _peft_tensors(ckpt, pairs, layers, dtype)
    data = _safetensors_bytes(tensors, {"format": "pt"})
    conf = _config_bytes(adapter_config(pairs, r, alpha, base_model_name_or_path))
    files = (_write_verified(out_dir, ADAPTER_FILE, data), _write_verified(out_dir, ADAPTER_CONFIG, conf))
    return PeftReport(str(out_dir), files, modules, r, alpha, sum(v.nbytes for v in tensors.values()),
                      int(ckpt.stats.bytes_read), time.perf_counter() - t0, ckpt.step, False)
