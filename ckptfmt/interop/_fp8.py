"""Block-FP8 weights for an export: the layout serving engines load (DeepSeek-V3, Qwen3-FP8).

A quantized output ``X.weight`` (2-D or more, floating-point) becomes two tensors of the file:
``X.weight``, float8_e4m3fn codes, and ``X.weight_scale_inv``, float32, one scale per
``block`` (128 x 128) of the last two axes, edge blocks cropped, such that
``codes.astype(float32) * scale`` (repeated over each block) approximates the weight. The scale of
a block is ``amax / 448`` (448: float8_e4m3fn's largest finite value; 1.0 for an all-zero block),
the codes ``round(w / scale)`` to the nearest float8_e4m3fn. ``config.json`` gets
``quantization_config`` (:func:`quantization_config`). Both tensors are produced block by block
from the same verified reads as any exported tensor (:class:`QuantCodes` and :class:`QuantScales`
wrap its :class:`~ckptfmt.interop._stexport.BlockSource`), so memory stays bounded and every block
has its crc32c in the header as before. Each reads the blocks of 128 rows its box touches; the
weight is read twice (once for its codes, once for its scales).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.interop._stexport import BlockSource, ExportTensor
from ckptfmt.restoreplan import SCALE_COMPANIONS

__all__ = ["QuantCodes", "QuantScales", "quantize_fp8", "quantization_config", "FP8_MAX", "FP8_BLOCK",
           "FP8_SKIP"]

FP8_MAX = 448.0
#: DeepSeek-V3's and Qwen3-FP8's block (``weight_block_size``).
FP8_BLOCK = (128, 128)
#: Output names never quantized (embeddings, norms, the head, MoE routers, biases): serving
#: engines keep them in high precision; ``modules_to_not_convert`` lists the Linear ones.
FP8_SKIP = ("*embed*", "*norm*", "lm_head.*", "*.bias", "*.gate.weight", "*router*")
_SUFFIX = SCALE_COMPANIONS[0]


def _aligned(box: Box, shape: Sequence[int], block: Sequence[int]) -> Box:
    """``box`` grown to whole blocks on the last ``len(block)`` axes (cropped at the edge)."""
    lead = len(shape) - len(block)
    off, ext = list(box.offset[:lead]), list(box.shape[:lead])
    for a, b in zip(range(lead, len(shape)), block):
        lo = (box.offset[a] // b) * b
        hi = min(shape[a], -(-(box.offset[a] + box.shape[a]) // b) * b)
        off.append(lo)
        ext.append(hi - lo)
    return Box(tuple(off), tuple(ext))


def _block_amax(w: np.ndarray, block: Sequence[int]) -> np.ndarray:
    """The absolute maximum of each block of ``w`` (whose box starts on a block boundary)."""
    lead = w.ndim - len(block)
    a = np.abs(w.astype(np.float32, copy=False))
    for k, b in enumerate(block):
        ax = lead + k
        n = a.shape[ax]
        starts = np.arange(0, n, b)
        a = np.maximum.reduceat(a, starts, axis=ax)
    return a


def _scales(w: np.ndarray, block: Sequence[int]) -> np.ndarray:
    amax = _block_amax(w, block)
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
    scale[amax == 0] = 1.0
    return scale


def _expand(scale: np.ndarray, shape: Sequence[int], block: Sequence[int]) -> np.ndarray:
    lead = len(shape) - len(block)
    for k, b in enumerate(block):
        ax = lead + k
        scale = np.repeat(scale, b, axis=ax)[(slice(None),) * ax + (slice(0, shape[ax]),)]
    return scale


@dataclass(frozen=True)
class QuantCodes:
    """The float8_e4m3fn codes of the weight ``inner`` assembles (a BlockSource)."""

    inner: BlockSource
    shape: tuple[int, ...]
    block: tuple[int, ...] = FP8_BLOCK

    def reads(self, box: Box) -> list[tuple[str, Box]]:
        return self.inner.reads(_aligned(box, self.shape, self.block))

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        big = _aligned(box, self.shape, self.block)
        w = np.asarray(self.inner.assemble(big, blocks)).astype(np.float32, copy=False)
        q = w / _expand(_scales(w, self.block), w.shape, self.block)
        codes = np.clip(q, -FP8_MAX, FP8_MAX).astype(numpy_dtype("float8_e4m3fn"))
        return codes[tuple(slice(o - bo, o - bo + n) for o, bo, n in zip(box.offset, big.offset, box.shape))]


@dataclass(frozen=True)
class QuantScales:
    """The per-block scales (``weight_scale_inv``) of the weight ``inner`` assembles; boxes are in
    scale coordinates."""

    inner: BlockSource
    shape: tuple[int, ...]  # the weight's
    block: tuple[int, ...] = FP8_BLOCK

    def _weight_box(self, box: Box) -> Box:
        lead = len(self.shape) - len(self.block)
        off, ext = list(box.offset[:lead]), list(box.shape[:lead])
        for a, b in zip(range(lead, len(self.shape)), self.block):
            lo = box.offset[a] * b
            hi = min(self.shape[a], (box.offset[a] + box.shape[a]) * b)
            off.append(lo)
            ext.append(max(0, hi - lo))
        return Box(tuple(off), tuple(ext))

    def reads(self, box: Box) -> list[tuple[str, Box]]:
        return self.inner.reads(self._weight_box(box))

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        w = np.asarray(self.inner.assemble(self._weight_box(box), blocks))
        return _scales(w, self.block)


def scale_shape(shape: Sequence[int], block: Sequence[int] = FP8_BLOCK) -> tuple[int, ...]:
    nb = len(block)
    return tuple(shape[:-nb]) + tuple(-(-n // b) for n, b in zip(shape[-nb:], block))


def quantize_fp8(tensors: Sequence[ExportTensor], *, skip: Sequence[str] = FP8_SKIP,
                 block: Sequence[int] = FP8_BLOCK) -> tuple[list[ExportTensor], list[str]]:
    """``tensors`` with every floating-point ``*.weight`` of 2 dims or more that no ``skip`` glob
    names as block-FP8 codes plus its ``*.weight_scale_inv``; and the module names of the 2-D
    ``*.weight`` tensors left in high precision (for ``modules_to_not_convert``)."""
    block = tuple(int(b) for b in block)
    out: list[ExportTensor] = []
    kept: list[str] = []
    for t in tensors:
        floating = t.dtype.startswith(("float", "bfloat")) and not t.dtype.startswith("float8")
        eligible = t.name.endswith(".weight") and len(t.shape) >= len(block) and floating
        if eligible and not any(fnmatch.fnmatchcase(t.name, g) for g in skip):
            out.append(ExportTensor(t.name, t.shape, "float8_e4m3fn", "float8_e4m3fn", QuantCodes(t.source, t.shape, block)))
            out.append(ExportTensor(t.name + _SUFFIX, scale_shape(t.shape, block), "float32", "float32",
                                    QuantScales(t.source, t.shape, block)))
            continue
        if t.name.endswith(".weight") and len(t.shape) == 2:
            kept.append(t.name[:-len(".weight")])
        out.append(t)
    return out, kept


def quantization_config(kept: Sequence[str], block: Sequence[int] = FP8_BLOCK) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for :func:`quantize_fp8`'s output (the
    fine-grained FP8 layout: transformers' FineGrainedFP8Config, DeepSeek-V3, vLLM, SGLang)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(b) for b in block], "modules_to_not_convert": sorted(kept)}
