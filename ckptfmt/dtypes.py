"""The dtypes ckptfmt knows, by their zarr v3 / numpy names (bfloat16 and the float8 types via
ml_dtypes): the one table. Tensors (FORMAT.md 5.6) take :data:`DTYPES`; non-tensor state
(FORMAT.md 7.2) takes every name of :data:`STATE_DTYPES`. Bridges map their framework's dtypes
onto these names and keep no table of their own."""
from __future__ import annotations

import functools
from typing import Any

import ml_dtypes

import numpy as np

from .errors import InvalidManifestError

__all__ = ["DTYPES", "STATE_DTYPES", "ML_DTYPES", "dtype_name", "numpy_dtype", "itemsize_of", "same_width_int"]

#: numpy's own numeric dtypes, by name.
_NUMPY_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128")
#: ml_dtypes types, by name. Only types whose every byte pattern is a value; sub-byte types (int4,
#: float4_e2m1fn, ...) pad each element to a byte, and arbitrary padding bits are not something to hand back.
_ML_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
             "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu")
#: The ml_dtypes types format v1 stores as tensors.
_TENSOR_ML_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _table() -> dict[str, np.dtype]:
    # Names are looked up in this table only; an untrusted string never reaches np.dtype().
    table = {name: np.dtype(name) for name in _NUMPY_NAMES}
    for name in _ML_NAMES:
        scalar_type = getattr(ml_dtypes, name, None)
        if scalar_type is not None:
            table[name] = np.dtype(scalar_type)
    return table


#: Every dtype name a state object may hold -> numpy dtype (native byte order).
STATE_DTYPES: dict[str, np.dtype] = _table()
#: The names that are ml_dtypes types (numpy has no such type of its own).
ML_DTYPES: frozenset[str] = frozenset(n for n in _ML_NAMES if n in STATE_DTYPES)
#: The tensor dtypes of format v1 -> itemsize.
DTYPES: dict[str, int] = {n: STATE_DTYPES[n].itemsize for n in _NUMPY_NAMES + _TENSOR_ML_NAMES}


def dtype_name(dtype: Any, *, key: str | None = None) -> str:
    """The format's name for a numpy-compatible dtype; InvalidManifestError if unsupported."""
    try:
        name = _name_of(dtype)
    except TypeError:  # not hashable: asked directly
        name = np.dtype(dtype).name
    if name not in DTYPES:
        raise InvalidManifestError("dtype is not supported by format v1", key=key, expected=sorted(DTYPES), found=name)
    return name


@functools.lru_cache(maxsize=256)
def _name_of(dtype: Any) -> str:
    """numpy's name of a dtype (asked once per shard of a save: numpy builds it each time)."""
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=256)
def numpy_dtype(name: str) -> np.dtype:
    """Little-endian numpy dtype for a format dtype name."""
    if name in ML_DTYPES:
        return STATE_DTYPES[name]
    return np.dtype(name).newbyteorder("<")


def itemsize_of(name: str) -> int:
    return DTYPES[name]


def same_width_int(name: str) -> np.dtype:
    """The signed integer dtype as wide as ``name``: how a framework without the type carries its bytes."""
    return np.dtype(f"int{8 * STATE_DTYPES[name].itemsize}")
