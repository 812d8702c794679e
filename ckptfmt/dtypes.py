"""The dtypes format v1 knows, by their zarr v3 / numpy names (bfloat16 and float8 via ml_dtypes)."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidManifestError

__all__ = ["DTYPES", "dtype_name", "numpy_dtype", "itemsize_of"]

DTYPES: dict[str, int] = {
    "bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_ML = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def dtype_name(dtype: Any, *, key: str | None = None) -> str:
    """The format's name for a numpy-compatible dtype; InvalidManifestError if unsupported."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise InvalidManifestError("dtype is not supported by format v1", key=key, expected=sorted(DTYPES), found=name)
    return name


def numpy_dtype(name: str) -> np.dtype:
    """Little-endian numpy dtype for a format dtype name."""
    if name in _ML:
        return np.dtype(_ML[name])
    return np.dtype(name).newbyteorder("<")


def itemsize_of(name: str) -> int:
    return DTYPES[name]
