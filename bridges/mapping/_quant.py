"""Block-scaled quantized weights: the :class:`Dequantize` join (``dequantized`` in ``_mapping``
adds it to a mapping).

Published block-FP8 checkpoints (DeepSeek-V3, Qwen3-FP8; ``quantization_config: {quant_method:
fp8, weight_block_size: [128, 128]}`` in ``config.json``) store each quantized ``X.weight`` as
float8_e4m3fn codes with a float32 companion ``X.weight_scale_inv`` of one scale per 128 x 128
block (edge blocks cropped): ``w = codes.astype(float32) * scale`` repeated over each block. A
restore that would cast the codes without their scale is refused by the core planner
(``ckptfmt.errors.QuantizedWeightError``); a :class:`Dequantize` rule reads both instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ckptfmt import Box
from ckptfmt.interop import FP8_BLOCK
from ckptfmt.restoreplan import SCALE_COMPANIONS

from bridges.mapping._joins import Join
from bridges.mapping._transforms import NotApplicable, Shape, Transform, _np_dtype

__all__ = ["Dequantize", "SCALE_SUFFIX", "FP8_BLOCK"]

#: The block-FP8 scale companion's suffix (``X.weight`` -> ``X.weight_scale_inv``): the core's.
SCALE_SUFFIX = SCALE_COMPANIONS[0]
_CODE_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def _scale_box(box: Box, block: Sequence[int]) -> Box:
    """The box of scales covering ``box`` (its last ``len(block)`` axes blocked)."""
    lead = len(box.offset) - len(block)
    off, shape = list(box.offset[:lead]), list(box.shape[:lead])
    for o, n, b in zip(box.offset[lead:], box.shape[lead:], block):
        lo, hi = o // b, -(-(o + n) // b)
        off.append(lo)
        shape.append(hi - lo)
    return Box(tuple(off), tuple(shape))


def expand_scales(scale: np.ndarray, box: Box, block: Sequence[int]) -> np.ndarray:
    """The scales read at :func:`_scale_box` of ``box``, repeated over their blocks and cropped to
    ``box`` (float32)."""
    s = scale.astype(np.float32, copy=False)
    lead = len(box.offset) - len(block)
    for k, b in enumerate(block):
        a = lead + k
        s = np.repeat(s, b, axis=a)
        start = box.offset[a] - (box.offset[a] // b) * b
        s = s[(slice(None),) * a + (slice(start, start + box.shape[a]),)]
    return s


@dataclass(frozen=True)
class Dequantize(Join):
    """Join a quantized tensor's codes and its per-block scales: the rule's two sources
    ``(X.weight, X.weight_scale_inv)`` become ``codes.astype(float32) * scale`` over blocks of
    ``block`` on the last ``len(block)`` axes (leading axes, e.g. stacked experts, one scale
    each), edge blocks cropped; the result is cast to ``dtype``.

    Box mapping: a target box reads the same box of codes and the covering box of scales (a
    sharded rank reads only its own bytes). A load only: there is no exact inverse (a save
    would have to quantize); export quantized weights with ``bridges.interop.export(...,
    quantize="fp8")``.
    """

    block: tuple[int, ...] = FP8_BLOCK
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        if not self.block or any(b < 1 for b in self.block):
            raise ValueError(f"Dequantize block must be positive sizes, got {self.block}")

    mixed_dtypes = True  # codes and scales differ in dtype (a class attribute, not a field)

    def scale_shape(self, shape: Shape) -> Shape:
        nb = len(self.block)
        return tuple(shape[:-nb]) + tuple(-(-n // b) for n, b in zip(shape[-nb:], self.block))

    def join_shape(self, shapes: Sequence[Shape]) -> Shape:
        if len(shapes) != 2:
            raise NotApplicable("Dequantize joins two sources: the codes and their scales",
                                expected=2, found=len(shapes))
        codes, scale = tuple(shapes[0]), tuple(shapes[1])
        if len(codes) < len(self.block):
            raise NotApplicable(f"Dequantize with block {self.block} needs at least {len(self.block)} dimensions",
                                expected=f">= {len(self.block)} dims", found=codes)
        if scale != self.scale_shape(codes):
            raise NotApplicable(f"the scales' shape does not give one scale per {self.block} block of the codes",
                                expected=self.scale_shape(codes), found=scale)
        return codes

    def join_dtype(self, dtypes: Sequence[np.dtype]) -> np.dtype:
        codes, scale = (np.dtype(d) for d in dtypes)
        if codes.name not in _CODE_DTYPES:
            raise NotApplicable("Dequantize reads float8 codes", expected=sorted(_CODE_DTYPES), found=codes.name)
        if scale.kind != "f":
            raise NotApplicable("Dequantize reads floating-point scales", expected="float32", found=scale.name)
        return _np_dtype(self.dtype)

    def part_shapes(self, shape: Shape, n: int | None) -> list[Shape]:
        raise NotApplicable("Dequantize has no exact inverse: a save cannot write quantized codes through a "
                            "mapping; export them with bridges.interop.export(..., quantize='fp8')")

    def part_boxes(self, box: Box, shapes: Sequence[Shape]) -> list[tuple[int, Box]]:
        return [(0, box), (1, _scale_box(box, self.block))]

    def join_blocks(self, blocks: Sequence[np.ndarray], box: Box) -> np.ndarray:
        codes, scale = blocks
        out = codes.astype(np.float32) * expand_scales(scale, box, self.block)
        want = _np_dtype(self.dtype)
        return out if out.dtype == want else out.astype(want)

    def split(self, box: Box, block: np.ndarray, shapes: Sequence[Shape]) -> list[tuple[int, Box, np.ndarray]]:
        raise NotApplicable("Dequantize has no exact inverse")

    def out_shape(self, shape: Shape) -> Shape:
        raise NotApplicable("Dequantize joins two sources")

    def inverse(self) -> Transform:
        raise ValueError("Dequantize has no exact inverse (a save would quantize): export quantized weights "
                         "with bridges.interop.export(..., quantize='fp8')")

    def inverse_ops(self) -> list[Transform]:
        return [self.inverse()]

