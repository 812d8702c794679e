"""crc32c (Castagnoli), hardware-accelerated, over any contiguous buffer without copying."""
from __future__ import annotations

from typing import Any

import crc32c as _crc32c
import numpy as np

__all__ = ["crc32c"]


def crc32c(data: Any) -> int:
    """crc32c of a bytes-like object or a numpy array's bytes (made contiguous if needed)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        data = data.reshape(-1).view(np.uint8) if data.size else b""
    return int(_crc32c.crc32c(data))
