"""Memory for a read: outputs allocated for frameworks to adopt, and typed errors (FORMAT.md 9,
step 3) where a read would need more than the host has, instead of an untyped MemoryError."""
from __future__ import annotations

import math
import mmap
import os
from typing import Sequence

import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import AllocationError

__all__ = ["physical_memory", "check_outputs_fit", "require_memory", "allocate", "allocate_many", "aligned_empty"]

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


#: Outputs smaller than this are cut from one shared allocation per read (:func:`allocate_many`):
#: a restore of tens of thousands of small leaves made an allocation per box.
SLAB_PIECE_BYTES = 64 << 10
_SLAB_ALIGN = 64


def allocate_many(wants: list[tuple[str, Box, np.dtype]]) -> list[np.ndarray]:
    """A fresh output for each ``(key, box, dtype)``, as :func:`allocate` gives; the small ones are
    disjoint, ``_SLAB_ALIGN``-aligned parts of one allocation (which lives as long as any of them)."""
    sizes = [math.prod(b.shape) * dt.itemsize for _, b, dt in wants]
    small = [i for i, n in enumerate(sizes) if n < SLAB_PIECE_BYTES]
    out: list[np.ndarray | None] = [None] * len(wants)
    if len(small) > 1:
        starts, total = [], 0
        for i in small:
            starts.append(total)
            total += -(-sizes[i] // _SLAB_ALIGN) * _SLAB_ALIGN
        try:
            slab = aligned_empty((total,), np.dtype(np.uint8), _SLAB_ALIGN)
        except (MemoryError, ValueError, OverflowError) as e:
            raise AllocationError("cannot allocate the read's outputs", key=wants[small[0]][0],
                                  expected=f"{total} bytes for {len(small)} small outputs",
                                  found=f"{type(e).__name__}: {str(e)[:200]}") from None
        for i, at in zip(small, starts):
            _, box, dt = wants[i]
            out[i] = slab[at:at + sizes[i]].view(dt).reshape(box.shape)
    for i, (key, box, dt) in enumerate(wants):
        if out[i] is None:
            out[i] = allocate(key, box, dt)
    return out  # type: ignore[return-value]


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
