"""Pack objects (FORMAT.md 5.15, revision 1.3): one object that a writer fills with many shards
at offsets it chose, from several threads, then makes durable once.

:class:`PackWriter` is what :meth:`ckptfmt.storage.Storage.open_pack` returns. The default,
:class:`MemoryPack`, gathers the bytes in host memory and writes them as one object with
:meth:`~ckptfmt.storage.Storage.write_object` when finished (object stores take whole objects);
the local-file backend writes in place instead (``ckptfmt.storage._filestore``), so a pack costs
no more memory than its writes in flight.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable

from ckptfmt.errors import StorageError

if TYPE_CHECKING:
    from ckptfmt.storage import Storage

__all__ = ["PackWriter", "MemoryPack"]


class PackWriter:
    """One pack object being written: :meth:`write_at` from any thread (ranges never overlap),
    then :meth:`finish` once, or :meth:`abort`."""

    key: str
    #: Nonzero: runs that start at a multiple of it and own the bytes up to the next multiple after
    #: their end may be written with ``direct=True`` (local files: ``O_DIRECT``, no page cache).
    align: int = 0

    def write_at(self, offset: int, buffers: Iterable[Any], *, tensor: str | None = None, direct: bool = False) -> int:
        """Write ``buffers`` (bytes-like, in order) from ``offset``; the bytes written. ``direct``:
        the run is aligned as :attr:`align` says (a hint: ignored where it does not apply)."""
        raise NotImplementedError

    def finish(self, nbytes: int) -> int:
        """Make the object ``nbytes`` long, durable once the storage's ``sync`` of a prefix above it
        returns, and give it its name; its length as stored. StorageError when that fails (the
        object is then absent, or left for gc)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Give up: nothing is published (best effort; gc removes what remains)."""


class MemoryPack(PackWriter):
    """A pack gathered in host memory and written whole by ``storage.write_object`` at the end."""

    def __init__(self, storage: "Storage", key: str) -> None:
        self.storage, self.key = storage, key
        self._buf = bytearray()
        self._lock = threading.Lock()

    def write_at(self, offset: int, buffers: Iterable[Any], *, tensor: str | None = None, direct: bool = False) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        end = offset + sum(v.nbytes for v in views)
        with self._lock:
            if len(self._buf) < end:
                self._buf.extend(bytes(end - len(self._buf)))
            at = offset
            for v in views:
                self._buf[at:at + v.nbytes] = v
                at += v.nbytes
        return end - offset

    def finish(self, nbytes: int) -> int:
        if len(self._buf) != nbytes:
            raise StorageError("pack object holds other bytes than were placed in it", object=self.key,
                               expected=nbytes, found=len(self._buf))
        n = self.storage.write_object(self.key, [memoryview(self._buf)])
        self._buf = bytearray()
        return n

    def abort(self) -> None:
        self._buf = bytearray()
