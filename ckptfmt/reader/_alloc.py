"""Memory for a read: outputs allocated for frameworks to adopt, and typed errors (FORMAT.md 9,
step 3) where a read would need more than the host has, instead of an untyped MemoryError."""
from __future__ import annotations

import mmap
import os
from typing import Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import AllocationError

__all__ = ["physical_memory", "check_outputs_fit", "require_memory", "allocate", "aligned_empty"]

#: Outputs at least this large get their own anonymous mapping (see aligned_empty). numpy
#: advises huge pages from 4 MiB up; smaller arrays stay with its allocator (and no process
#: comes near the kernel's mapping limit, 65,530 by default, from its restore outputs).
_MMAP_MIN_BYTES = 4 << 20


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_outputs_fit(sizes: Sequence[tuple[str, int]], where: str) -> None:
    """AllocationError, before anything is allocated, when the outputs of one read (key, bytes) would
    exceed this host's physical memory: a manifest may declare any size up to 2^62 bytes."""
    ram = physical_memory()
    if ram is None:
        return
    total = sum(n for _, n in sizes)
    if total > ram:
        n, key = max((n, key) for key, n in sizes)
        raise AllocationError("the read's outputs are larger than this host's memory", key=key, object=where,
                              expected=f"<= {ram} bytes (physical memory)", found=f"{total} bytes ({key!r}: {n} bytes)")


def require_memory(nbytes: int, key: str, obj: str, what: str) -> None:
    """AllocationError when ``nbytes`` (a buffer a read needs at once) exceed this host's memory."""
    ram = physical_memory()
    if ram is not None and nbytes > ram:
        raise AllocationError(f"a read needs {what} at once, more than this host's memory", key=key, object=obj,
                              expected=f"<= {ram} bytes (physical memory)", found=f"{nbytes} bytes")


def allocate(key: str, box: Box, dtype: np.dtype) -> np.ndarray:
    """A fresh output for ``box``; AllocationError naming ``key`` when it cannot be had."""
    try:
        return aligned_empty(box.shape, dtype)
    except (MemoryError, ValueError, OverflowError) as e:  # ValueError: a shape numpy cannot hold
        raise AllocationError("cannot allocate the read's output", key=key, expected=f"{box.shape} {dtype}",
                              found=f"{type(e).__name__}: {str(e)[:200]}") from None


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an ``align``-byte boundary, so that frameworks
    (XLA on CPU) can adopt the buffer without copying it.

    Large arrays get their own anonymous mapping (page aligned, returned to the OS when the array
    goes). numpy advises huge pages for large arrays; with the kernel's usual ``defrag=madvise``
    the reader threads' page faults into those arrays then compact memory while holding the
    mapping lock, and allocating the next batch waits on them (0.2-0.6 s per GiB restored here)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n >= _MMAP_MIN_BYTES:
        try:
            # Private, like numpy's own memory: a fork()ed child's writes stay in the child.
            buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return np.frombuffer(buf, dtype=dtype).reshape(shape)
        except OSError:  # out of mappings (vm.max_map_count) or address space: numpy's allocator
            pass
    raw = np.empty(n + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + n].view(dtype).reshape(shape)
