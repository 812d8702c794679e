"""Positional reads through ``O_DIRECT`` for the local-file store (FORMAT.md 14.4, repository
option ``direct_reads``).

A buffer of at least :data:`DIRECT_MIN_BYTES` whose address and file offset agree modulo a block
(:data:`ckptfmt.storage._durable.DIRECT_ALIGN`) has its whole blocks read straight into it,
without page-cache pages to allocate. Everything else (a chunk four bytes past a block boundary,
behind the previous chunk's crc32c trailer; trailers, indexes, heads and tails of blocks) goes
through the page cache, in one ``preadv`` per run of back-to-back stretches; in a large read
(:meth:`ckptfmt.storage.PositionalFile.prefer_uncached`, revision 1.2.5) with ``RWF_DONTCACHE``
where the kernel and file system take it (Linux 6.14 and later): the page-cache pages such a read
brings in are dropped once copied out, and the next read uses them again instead of taking new
ones. On this 2-core virtual machine a new page costs its first touch, and a restore of 8 GiB
through the page cache touched 8 GiB of new cache pages besides its 8 GiB of outputs: 12.5-22.0 s
against 6.4-7.8 s uncached; at 1 GiB uncached was about 15 % slower (``docs/scaling.md``).
(Staging unaligned chunks through an aligned buffer with ``O_DIRECT`` was measured too: faster
at 8 GiB, 15-25 % slower at 1 GiB; ``docs/profile-save.md`` 7.)
"""
from __future__ import annotations

import errno
from typing import Protocol

import numpy as np

from ckptfmt.errors import StorageError
from ckptfmt.storage import _durable

__all__ = ["DIRECT_MIN_BYTES", "Preadv", "read_split", "split_direct", "runs"]

#: Stretches smaller than this are read through the page cache.
DIRECT_MIN_BYTES = 256 << 10
_ALIGN = _durable.DIRECT_ALIGN

Span = tuple[memoryview, int]  # a buffer and the file offset its first byte comes from


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def split_direct(views: list[memoryview], offset: int) -> tuple[list[Span], list[Span]]:
    """``views`` read back to back from ``offset``, split into the spans ``O_DIRECT`` reads
    straight into (address, file offset and length whole blocks) and the rest."""
    direct: list[Span] = []
    rest: list[Span] = []
    pos = offset
    for v in views:
        n = v.nbytes
        head = (-pos) % _ALIGN
        body = (n - head) // _ALIGN * _ALIGN if n > head else 0
        if body >= DIRECT_MIN_BYTES and (_address(v) - pos) % _ALIGN == 0:
            if head:
                rest.append((v[:head], pos))
            direct.append((v[head:head + body], pos + head))
            if head + body < n:
                rest.append((v[head + body:], pos + head + body))
        else:
            rest.append((v, pos))
        pos += n
    return direct, rest


def runs(spans: list[Span]) -> list[tuple[int, list[memoryview]]]:
    """(file offset, views) of each run of back-to-back spans, in file order (at most IOV_MAX
    views a run: one ``preadv`` takes no more)."""
    out: list[tuple[int, list[memoryview]]] = []
    end = -1
    for view, at in sorted(spans, key=lambda s: s[1]):
        if out and at == end and len(out[-1][1]) < _durable._IOV_MAX:
            out[-1][1].append(view)
        else:
            out.append((at, [view]))
        end = at + view.nbytes
    return out


class Preadv(Protocol):
    """Fills ``views`` from ``offset`` of one open file (``uncached``: with ``RWF_DONTCACHE`` where
    the file takes it); ``raw``: the OSError of a failed read itself, not a StorageError."""

    def __call__(self, views: list[memoryview], offset: int, raw: bool = False, uncached: bool = False) -> None: ...


def read_split(fd: int, views: list[memoryview], offset: int, preadv: Preadv, *, key: str, tensor: str | None) -> bool:
    """Fill ``views`` from ``offset`` of the file open as ``fd`` (object ``key`` of tensor
    ``tensor``): aligned spans through ``O_DIRECT``, the rest (and everything where the file system
    refuses ``O_DIRECT``) through the page cache, with ``preadv``. Returns whether the file still
    takes ``O_DIRECT``: False once the file system or the device refused it (the caller then
    makes no more tries on this file). A failed read raises StorageError."""
    direct, rest = split_direct(views, offset)
    taken = True
    if direct and _durable.set_direct(fd, True):
        try:
            for view, at in direct:
                taken = taken and _read_direct(preadv, view, at, key, tensor)
                if not taken:
                    rest.append((view, at))
        finally:
            _durable.set_direct(fd, False)
    elif direct:
        taken = False  # the file system refuses O_DIRECT
        rest += direct
    for at, run in runs(rest):
        preadv(run, at, uncached=True)
    return taken


def _read_direct(preadv: Preadv, view: memoryview, at: int, key: str, tensor: str | None) -> bool:
    """One ``O_DIRECT`` read; False where the device wants larger blocks than ours (EINVAL)."""
    try:
        preadv([view], at, raw=True)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise StorageError("read failed", key=tensor, object=key, found=str(e)) from None
        return False
