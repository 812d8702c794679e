"""The benchmark state: its layout, and data that every system can regenerate.

The state is ``tensors`` float32 matrices, each split by rows. Values are a
pure function of (tensor index, row block), so a writer creates only its own
rows and a reader checks any row range without a full copy anywhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

_COLS_MAX = 1024


@dataclass(frozen=True)
class StateLayout:
    """Shapes of the benchmark state. ``blocks`` = the finest row split."""

    tensors: int
    rows: int
    cols: int
    blocks: int

    @classmethod
    def for_size(cls, size: int, tensors: int, topologies: tuple[int, ...]) -> "StateLayout":
        """The layout closest to ``size`` bytes whose rows divide by every topology."""
        blocks = math.lcm(*topologies)
        per_tensor = max(size // max(tensors, 1) // 4, blocks)
        cols = min(_COLS_MAX, max(1, per_tensor // blocks))
        rows = max(blocks, (per_tensor // cols) // blocks * blocks)
        return cls(tensors=tensors, rows=rows, cols=cols, blocks=blocks)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def tensor_bytes(self) -> int:
        return self.rows * self.cols * 4

    @property
    def nbytes(self) -> int:
        return self.tensors * self.tensor_bytes

    def key(self, i: int) -> str:
        return f"layer{i:03d}/w"

    def keys(self) -> list[str]:
        return [self.key(i) for i in range(self.tensors)]

    def rows_of(self, part: int, parts: int) -> tuple[int, int]:
        """Row range [start, stop) of ``part`` when split ``parts`` ways."""
        n = self.rows // parts
        return (part * n, (part + 1) * n)

    def to_json(self) -> dict:
        return asdict(self) | {"nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: dict) -> "StateLayout":
        return cls(tensors=d["tensors"], rows=d["rows"], cols=d["cols"], blocks=d["blocks"])


def block_data(layout: StateLayout, i: int, block: int) -> np.ndarray:
    """Deterministic float32 rows of one block of tensor ``i`` (incompressible-ish)."""
    n = layout.rows // layout.blocks
    rng = np.random.default_rng((i, block))
    return rng.random((n, layout.cols), dtype=np.float32)


def rows_data(layout: StateLayout, i: int, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of tensor ``i``; start/stop must fall on block edges."""
    n = layout.rows // layout.blocks
    if start % n or stop % n:
        raise ValueError(f"rows {start}:{stop} are not on block edges of {n}")
    out = np.empty((stop - start, layout.cols), dtype=np.float32)
    for b in range(start // n, stop // n):
        out[(b * n - start) : (b * n - start) + n] = block_data(layout, i, b)
    return out


def check_rows(layout: StateLayout, i: int, start: int, stop: int, got: np.ndarray) -> None:
    """Raise AssertionError unless ``got`` equals rows [start, stop) of tensor ``i``."""
    want = rows_data(layout, i, start, stop)
    got = np.asarray(got)
    if got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"{layout.key(i)} rows {start}:{stop}: restored data differs")
