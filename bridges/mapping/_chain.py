"""A rule's transforms bound to shapes: what one target key reads, how it is assembled, how it is saved.

Call order (the bridges): :meth:`Chain.from_sources` with the checkpoint's shapes (load) or
:meth:`Chain.from_target` with the state's shape (save); then per local box :meth:`Chain.reads`
(the source boxes to read), the core reader, and :meth:`Chain.assemble` (the target block); or,
for a save, :meth:`Chain.writes` (the target block as source boxes and blocks). Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ckptfmt import Box
from ckptfmt.errors import CheckpointError, ShapeMismatchError

from bridges.mapping._joins import Concat, ConcatStacks, Join, Stack, Stacks
from bridges.mapping._transforms import Cast, NotApplicable, NotExact, Transform, _np_dtype
from bridges.mapping._joins import Select

__all__ = ["Chain", "MappingError", "InvalidRuleError", "split_chain"]

Shape = tuple[int, ...]


class MappingError(ShapeMismatchError):
    """A mapping rule matched a key but does not apply to it (which rule, which transform, why)."""


class InvalidRuleError(CheckpointError, ValueError):
    """A rule or mapping is refused as written, before any data is touched: transforms that do not
    compose, or rules a save cannot choose between (which key, which rules, the way out)."""


def split_chain(ops: Sequence[Transform]) -> tuple[tuple[Transform, ...], Join | None, tuple[Transform, ...]]:
    """(per-source transforms, the join or None, transforms after the join). One Concat, or one
    or more adjacent Stacks (several become one :class:`Stacks` join: layer and expert families),
    or a Concat directly followed by Stacks (one :class:`ConcatStacks` join: fused parts of each
    layer, stacked; the Concat must give its ``sizes``); InvalidRuleError (a ValueError) for anything else, naming the joins found."""
    joins = [i for i, op in enumerate(ops) if op.join]
    if not joins:
        return tuple(ops), None, ()
    j = joins[0]
    if len(joins) > 1 and isinstance(ops[j], Concat):  # Concat then Stacks: fused parts of a key family
        pre, stacks, post = split_chain(list(ops[:j]) + list(ops[j + 1:]))
        if not (isinstance(stacks, (Stack, Stacks)) and joins == list(range(j, j + len(joins)))):
            raise InvalidRuleError("a Concat may be followed only by the Stacks of its key family, next to it",
                                   expected="Concat(...), Stack(...)[, Stack(...)]",
                                   found=[f"{i}: {ops[i]}" for i in joins])
        if ops[j].sizes is None:  # type: ignore[attr-defined]
            raise InvalidRuleError("a Concat followed by Stacks needs its sizes (one per source pattern): the "
                                   "stacked keys alone do not say how many parts each layer has",
                                   expected="Concat(axis, sizes=(...))", found=str(ops[j]))
        return pre, ConcatStacks(ops[j], stacks, len(ops[j].sizes)), post  # type: ignore[arg-type, attr-defined]
    if len(joins) > 1:
        stacks = [ops[i] for i in joins]
        adjacent = joins == list(range(j, j + len(joins)))
        if not (adjacent and all(isinstance(op, Stack) for op in stacks)):
            raise InvalidRuleError(
                "a rule may join its sources once: one Concat, or Stacks next to each other (a key family "
                "over several placeholders); split the rule, or move the transforms between the Stacks "
                "before or after them", expected="one Concat or adjacent Stacks",
                found=[f"{i}: {ops[i]}" for i in joins])
        overs = [op.over for op in stacks]  # type: ignore[attr-defined]
        if len(set(overs)) != len(overs):
            raise InvalidRuleError("two Stacks of one rule stack the same placeholder", expected="distinct placeholders",
                                   found=overs)
        return tuple(ops[:j]), Stacks(tuple(stacks)), tuple(ops[joins[-1] + 1:])  # type: ignore[arg-type]
    return tuple(ops[:j]), ops[j], tuple(ops[j + 1:])  # type: ignore[return-value]


def _fail(where: str, key: str, i: int, op: Transform, err: NotApplicable) -> MappingError:
    return MappingError(f"{where} does not apply: transform {i} {op} -- {err.reason}", key=key,
                        expected=err.expected, found=err.found)


@dataclass(frozen=True)
class Chain:
    """One target key's transforms with every intermediate shape known."""

    target_key: str
    source_keys: tuple[str, ...]
    pre: tuple[Transform, ...]
    join: Join | None
    post: tuple[Transform, ...]
    pre_shapes: tuple[tuple[Shape, ...], ...]  # per source: the input of each pre transform, then the output
    post_shapes: tuple[Shape, ...]  # the input of each post transform, then the target shape
    source_dtypes: tuple[np.dtype, ...]
    target_dtype: np.dtype

    @property
    def target_shape(self) -> Shape:
        return self.post_shapes[-1]

    @property
    def source_shapes(self) -> tuple[Shape, ...]:
        return tuple(ps[0] for ps in self.pre_shapes)

    # ------------------------------------------------------------------ binding

    @classmethod
    def from_sources(cls, target_key: str, source_keys: Sequence[str], ops: Sequence[Transform],
                     shapes: Sequence[Shape], dtypes: Sequence[np.dtype], where: str = "the mapping") -> "Chain":
        """Bind to the checkpoint's source shapes (a load). Raises MappingError naming ``where``."""
        pre, join, post = split_chain(ops)
        if join is None and len(source_keys) != 1:
            raise MappingError(f"{where} names {len(source_keys)} sources but has no Concat/Stack to join them",
                               key=target_key, expected=1, found=list(source_keys))
        pre_shapes = []
        for shape in shapes:
            levels = [tuple(int(n) for n in shape)]
            for i, op in enumerate(pre):
                try:
                    levels.append(op.out_shape(levels[-1]))
                except NotApplicable as e:
                    raise _fail(where, target_key, i, op, e) from None
            pre_shapes.append(tuple(levels))
        dts = [np.dtype(d) for d in dtypes]
        outs = []
        for d in dts:
            for op in pre:
                d = op.out_dtype(d)
            outs.append(d)
        mixed = getattr(join, "mixed_dtypes", False)  # Dequantize: float8 codes and float32 scales
        if len(set(outs)) > 1 and not mixed:
            raise MappingError(f"{where}: the joined sources differ in dtype", key=target_key,
                               expected=str(outs[0]), found=[str(d) for d in outs])
        if join is not None:
            try:
                level = join.join_shape([ps[-1] for ps in pre_shapes])
            except NotApplicable as e:
                raise _fail(where, target_key, len(pre), join, e) from None
        else:
            level = pre_shapes[0][-1]
        post_shapes = [level]
        dtype = outs[0]
        if mixed:
            try:
                dtype = join.join_dtype(outs)  # type: ignore[union-attr]
            except NotApplicable as e:
                raise _fail(where, target_key, len(pre), join, e) from None  # type: ignore[arg-type]
        for i, op in enumerate(post):
            try:
                post_shapes.append(op.out_shape(post_shapes[-1]))
            except NotApplicable as e:
                raise _fail(where, target_key, len(pre) + 1 + i, op, e) from None
            dtype = op.out_dtype(dtype)
        return cls(target_key, tuple(source_keys), pre, join, post, tuple(pre_shapes), tuple(post_shapes),
                   tuple(dts), dtype)

    @classmethod
    def from_target(cls, target_key: str, source_keys: Sequence[str], ops: Sequence[Transform],
                    shape: Shape, dtype: np.dtype, where: str = "the mapping") -> "Chain":
        """Bind backward from the state's shape (a save): the source shapes the target implies."""
        pre, join, post = split_chain(ops)
        post_shapes = [tuple(int(n) for n in shape)]
        d = np.dtype(dtype)
        for i in reversed(range(len(post))):
            try:
                post_shapes.insert(0, post[i].in_shape(post_shapes[0]))
            except NotApplicable as e:
                raise _fail(where, target_key, len(pre) + 1 + i, post[i], e) from None
            d = _in_dtype(post[i], d)
        try:
            parts = join.part_shapes(post_shapes[0], len(source_keys)) if join else [post_shapes[0]]
        except NotApplicable as e:
            raise _fail(where, target_key, len(pre), join, e) from None  # type: ignore[arg-type]
        if len(parts) != len(source_keys):
            raise MappingError(f"{where}: the target implies {len(parts)} sources, the rule names {len(source_keys)}",
                               key=target_key, expected=len(parts), found=list(source_keys))
        pre_shapes = []
        for part in parts:
            levels = [part]
            for i in reversed(range(len(pre))):
                try:
                    levels.insert(0, pre[i].in_shape(levels[0]))
                except NotApplicable as e:
                    raise _fail(where, target_key, i, pre[i], e) from None
            pre_shapes.append(tuple(levels))
        src = d
        for op in reversed(pre):
            src = _in_dtype(op, src)
        return cls(target_key, tuple(source_keys), pre, join, post, tuple(pre_shapes), tuple(post_shapes),
                   (src,) * len(source_keys), np.dtype(dtype))

    # ------------------------------------------------------------------ boxes

    def _route(self, box: Box) -> tuple[list[Box], list[tuple[int, list[Box]]]]:
        post_boxes: list[Box] = [box]
        for i in reversed(range(len(self.post))):
            post_boxes.insert(0, self.post[i].in_box(post_boxes[0], self.post_shapes[i]))
        if self.join is not None:
            parts = self.join.part_boxes(post_boxes[0], [ps[-1] for ps in self.pre_shapes])
        else:
            parts = [(0, post_boxes[0])]
        routes = []
        for k, pbox in parts:
            boxes = [pbox]
            for i in reversed(range(len(self.pre))):
                boxes.insert(0, self.pre[i].in_box(boxes[0], self.pre_shapes[k][i]))
            routes.append((k, boxes))
        return post_boxes, routes

    def reads(self, box: Box) -> list[tuple[str, Box]]:
        """The (source key, source box) reads that target ``box`` needs, in assembly order."""
        return [(self.source_keys[k], boxes[0]) for k, boxes in self._route(box)[1]]

    def assemble(self, box: Box, blocks: Sequence[np.ndarray]) -> np.ndarray:
        """The target block at ``box`` from the blocks of :meth:`reads` (same order)."""
        post_boxes, routes = self._route(box)
        outs = []
        for (k, boxes), blk in zip(routes, blocks):
            for i, op in enumerate(self.pre):
                blk = op.apply(blk, boxes[i], boxes[i + 1], self.pre_shapes[k][i])
            outs.append(blk)
        blk = self.join.join_blocks(outs, post_boxes[0]) if self.join is not None else outs[0]
        for i, op in enumerate(self.post):
            blk = op.apply(blk, post_boxes[i], post_boxes[i + 1], self.post_shapes[i])
        return blk

    def writes(self, box: Box, block: np.ndarray) -> list[tuple[str, Box, np.ndarray]]:
        """The target block at ``box`` as (source key, source box, block) pieces tiling its preimage.

        Raises MappingError when a transform's inverse is not exact for these values.
        """
        try:
            pieces = [(box, block)]
            for i in reversed(range(len(self.post))):
                pieces = [p for b, x in pieces for p in self.post[i].pieces(b, x, self.post_shapes[i])]
            if self.join is not None:
                parts = [ps[-1] for ps in self.pre_shapes]
                parted = [q for b, x in pieces for q in self.join.split(b, x, parts)]
            else:
                parted = [(0, b, x) for b, x in pieces]
            out = []
            for k, b, x in parted:
                ps = [(b, x)]
                for i in reversed(range(len(self.pre))):
                    ps = [p for bb, xx in ps for p in self.pre[i].pieces(bb, xx, self.pre_shapes[k][i])]
                out += [(self.source_keys[k], bb, xx) for bb, xx in ps]
            return out
        except NotExact as e:
            raise MappingError(f"cannot save in the checkpoint layout: {e}", key=self.target_key) from None


def _in_dtype(op: Transform, dtype: np.dtype) -> np.dtype:
    if isinstance(op, Cast) and op.source_dtype is not None:
        return _np_dtype(op.source_dtype)
    return dtype


def with_select_size(ops: Sequence[Transform], size: int) -> tuple[Transform, ...]:
    """``ops`` with every unsized :class:`Select` given ``size`` (a save infers it from the layers).
    InvalidRuleError when two are unsized: one inferred length cannot size both (layers, experts)."""
    unsized = [op for op in ops if isinstance(op, Select) and op.size is None]
    if len(unsized) > 1:
        raise InvalidRuleError("a save infers one stacked length, and this rule has several unsized Selects: give "
                               "Select(size=...) to all but one", expected="at most one unsized Select",
                               found=[str(op) for op in unsized])
    return tuple(Select(op.axis, op.index, size) if isinstance(op, Select) and op.size is None else op for op in ops)
