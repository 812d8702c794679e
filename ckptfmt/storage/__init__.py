"""Storage: the interface every backend implements, and the choice of backend for a URL.

Backends (one per kind of store, no driver branches inside a class):

- :class:`~ckptfmt.storage._kvstore.KvStoreStorage`: tensorstore's kvstore (S3, GCS), the generic one;
- :class:`~ckptfmt.storage._kvstore.MemoryStorage`: ``memory://`` (repositories of one name share bytes
  within a process);
- :class:`~ckptfmt.storage._filestore.LocalFileStorage`: local files; it owns what only a file system has
  (positional vectored reads, ``stat`` size checks, deletes and walks that never follow a link,
  clean-up of stale lock files).

:func:`open_storage` picks one for a repository URL. ``Repository(url, storage=...)`` takes any
object with this interface instead, such as a :class:`DelegatingStorage` that changes one call
(fault injection, tracing) without patching the library.

Every call either returns or raises a CheckpointError (StorageError, or MissingShardError /
SizeMismatchError for objects a manifest names) naming the object; tensorstore's own exceptions
are classified in one place (:func:`ckptfmt.storage._kvstore.kv_errors`).

Subpackage ``ckptfmt.storage``. Storage: the interface every backend implements, the choice of
backend for a URL and the backends themselves (the tensorstore kvstore, the local-file backend, the
URL grammar, the link-safe local walks) (FORMAT.md 4.1, 14). It knows keys and bytes, never
manifests. Its modules: ``_durable``, ``_filestore``, ``_kverrors``, ``_kvstore``, ``_kvurl``,
``_localfs``, ``_options`` (:class:`StorageOptions`, the repository options). May import: floor. The floor: the top-level modules listed in ``ckptfmt/__init__.py``
(tests/test_layering.py holds the rules and enforces them). Subpackages that may import it: reader,
repository, session, interop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

from ckptfmt.storage._kvurl import kvstore_spec
from ckptfmt.storage._localfs import Entry
from ckptfmt.storage._options import StorageOptions as StorageOptions
from ckptfmt.storage._pack import MemoryPack
from ckptfmt.storage._pack import PackWriter as PackWriter
from ckptfmt.errors import StorageError

__all__ = ["Storage", "StorageOptions", "PackWriter", "Pending", "PositionalFile", "DelegatingStorage", "open_storage", "NO_VALUE"]

NO_VALUE = b"\x02"  # tensorstore's StorageGeneration::NoValue(): "write only if absent"

T = TypeVar("T")


class Pending(Generic[T]):
    """An operation in flight: :meth:`result` waits for it and returns its value or raises its
    typed error. ``requests`` is how many storage requests it issued (0: decided already)."""

    __slots__ = ("_finish", "requests")

    def __init__(self, finish: Callable[[], T], requests: int = 1) -> None:
        self._finish = finish
        self.requests = requests

    @classmethod
    def done(cls, value: T) -> "Pending[T]":
        return cls(lambda: value, 0)

    def result(self) -> T:
        return self._finish()


class PositionalFile(ABC):
    """An open local object for positional reads. Close it (or use it as a context manager)."""

    size: int

    @abstractmethod
    def read_into(self, buffers: Sequence[Any], offset: int) -> None:
        """Fill ``buffers`` in order from ``offset``; SizeMismatchError if the object ends early."""

    @abstractmethod
    def close(self) -> None: ...

    def prefer_uncached(self) -> None:
        """A hint: this read is large, so what it reads through a page cache should not stay
        there (the local-file store: ``RWF_DONTCACHE``). Nothing where a store has no such cache."""

    def map(self) -> Any:
        """The whole object mapped copy-on-write (an ``mmap``: writes through it stay private), or
        None where this store cannot map. The mapping outlives :meth:`close`."""
        return None

    def __enter__(self) -> "PositionalFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Storage(ABC):
    """A repository's objects. Keys are relative to the repository root, "/"-separated.

    ``url`` is the repository URL; ``options`` the repository options, checked and typed (reader
    settings such as ``read_window_bytes`` live there too). Every method raises a CheckpointError
    on failure.
    """

    url: str
    options: StorageOptions

    # ------------------------------------------------------------------ whole objects
    @abstractmethod
    def read(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes, or None when absent. With ``max_bytes``, at most ``max_bytes + 1``
        bytes are read, so a caller can reject an oversized object cheaply. StorageError for a
        special file (FIFO, device) at the key, found without opening it."""

    @abstractmethod
    def read_upto(self, key: str, start: int, n: int) -> bytes | None:
        """At most ``n`` bytes from ``start`` (fewer at the object's end, b"" past it), or None
        when absent. Never reads more than ``n`` bytes of a write-once object."""

    @abstractmethod
    def larger_than(self, key: str, limit: int) -> bool | None:
        """Whether the object holds more than ``limit`` bytes (None when absent), reading one byte."""

    @abstractmethod
    def read_with_generation(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        """(value or None, generation) of each key, read concurrently."""

    @abstractmethod
    def read_each_with_generation(self, keys: Sequence[str],
                                  max_bytes: int) -> list[tuple[bytes | None, bytes] | StorageError]:
        """(value or None, generation) of each key, each value at most ``max_bytes + 1`` bytes; a
        key that cannot be read gets its StorageError in its place."""

    # ------------------------------------------------------------------ objects a manifest names
    # A reader reads at most nbytes + 1 bytes of an object whose manifest says nbytes (FORMAT.md 9,
    # step 4): the ranges it reads end at or before nbytes, and the size is checked apart from them.
    @abstractmethod
    def read_range(self, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> Pending[bytes]:
        """Start reading bytes ``[start, stop)`` (``stop`` None: to the end). The result raises
        MissingShardError when the object is absent, SizeMismatchError when the range runs past
        its end, StorageError otherwise."""

    @abstractmethod
    def size_check(self, key: str, nbytes: int, *, tensor: str | None = None) -> Pending[None]:
        """Start checking that ``key`` holds exactly ``nbytes`` bytes, reading at most one byte.
        The result raises SizeMismatchError when it is longer (a shorter object is caught by the
        caller's own ranges), MissingShardError when absent. A backend that knows the size at
        once (``stat``) raises here instead."""

    @abstractmethod
    def size_faults(self, objects: Sequence[tuple[str, int]]) -> list[str]:
        """Each ``(key, nbytes)`` object that is missing, not a plain object, or not exactly
        ``nbytes`` long, described in a few words (at most the first 8). Reads no data."""

    def check_no_links(self, key: str, checked: set[str], *, tensor: str | None = None) -> None:
        """Raise StorageError (naming ``tensor`` and ``key``) when reading ``key`` would leave the
        repository through a symbolic link, at the object or at a directory on the way to it
        (FORMAT.md 9 step 4). ``checked``: directories (keys ending in "/") the caller already
        found plain; the call adds those it judges, so a reader that keeps one set per open pays
        once per directory. Called before the object is read; an absent object is left to the
        read. A store without links (every store but a file system) has nothing to check."""

    def stamps(self, objects: Sequence[tuple[str, int]]) -> list[str] | None:
        """One token per ``(key, nbytes)`` object that changes whenever the object is written or
        replaced (its size and storage generation), or None when this store cannot tell, or an
        object is missing or not a plain object. A verification record binds these tokens
        (FORMAT.md 10.4): with None it is never trusted. Reads no data."""
        return None

    @property
    def positional_reads(self) -> bool:
        """Whether :meth:`open_positional` is available (local files)."""
        return False

    def open_positional(self, key: str, *, tensor: str | None = None) -> PositionalFile:
        """Open a local object for positional reads: MissingShardError when absent, StorageError
        when it is not a regular file. Only where :attr:`positional_reads` is True."""
        raise StorageError("this store has no positional reads", key=tensor, object=key,
                           expected="a local-file repository", found=type(self).__name__)

    # ------------------------------------------------------------------ writes
    @abstractmethod
    def write(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Write every (key, bytes) concurrently; StorageError naming the first that failed."""

    def write_object(self, key: str, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
        """Write one whole object whose bytes are ``buffers`` (bytes-like, in order), replacing
        any object at ``key``; returns its length as stored. Called from several threads at once.
        The object is durable, with its name, once :meth:`sync` of a prefix above it has returned.
        StorageError (naming ``tensor`` and ``key``) when the write fails; the object is then
        absent or left for gc to remove. Default: one :meth:`write` of the joined bytes."""
        data = b"".join(buffers)
        self.write(key, data)
        return len(data)

    #: Whether :meth:`open_pack` writes in place (local files: a pack costs no more memory than its
    #: writes in flight); False: a pack is gathered in memory, so a writer keeps it within its window.
    packs_in_place: bool = False

    def open_pack(self, key: str) -> "PackWriter":
        """A pack object at ``key`` to fill from several threads and finish once (FORMAT.md 5.15).
        Default: gathered in memory and written whole by :meth:`write_object` when finished."""
        return MemoryPack(self, key)

    def sync(self, prefix: str) -> None:
        """Make every object :meth:`write_object` wrote under ``prefix`` (ending with "/") durable,
        names included. Default: nothing, for stores whose writes are durable when they return."""

    @abstractmethod
    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        """Write (or, with None, delete) ``key`` only if its generation is ``if_equal`` (NO_VALUE:
        only if absent). Returns the new generation, or b"" when the condition failed."""

    @abstractmethod
    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Atomically create ``key``; False if it already exists (the commit primitive)."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix`` (which must end with "/"), never following a
        symbolic link. StorageError for a prefix that is not a folder."""

    # ------------------------------------------------------------------ listing
    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``, sorted."""

    @abstractmethod
    def scan_children(self, prefix: str, *, marker: str | None = None, deep: bool = True) -> list[Entry]:
        """Every name directly under ``prefix`` (ending with "/"), judged without following links;
        for each folder, the kind of the object ``<name>/<marker>`` when ``marker`` is given (the
        caller says what to look for: the collector, a lease). ``deep=False``: the caller needs
        only the markers; a store may then skip each folder's object count and newest time, and
        sets ``error`` on a folder it could not look into. StorageError when the prefix cannot
        be listed or is itself a link."""

    @abstractmethod
    def plain_dir(self, prefix: str) -> bool:
        """False when ``prefix`` (or a folder on its way) is a link or not a folder; True
        otherwise, also when absent and on stores without links."""

    @abstractmethod
    def remove_stale_locks(self, prefix: str, older_than_unix: float) -> int:
        """Delete helper lock objects under ``prefix`` older than the cutoff; returns the count."""

    # ------------------------------------------------------------------ zarr arrays
    @abstractmethod
    def open_array(self, path: str, metadata: Mapping[str, Any], *, create: bool) -> Any:
        """Future of an open zarr3 TensorStore at ``path`` with ``metadata``
        (:func:`ckptfmt.layout.zarr_array_metadata`). ``create`` writes zarr.json; otherwise the
        metadata is assumed."""


class DelegatingStorage(Storage):
    """A storage that forwards every call to ``inner``: subclass it and override the calls to
    change (fault injection, tracing). Never patch the library's classes instead."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # attributes a backend adds (kv, spec, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.inner.url

    @property
    def options(self) -> StorageOptions:  # type: ignore[override]
        return self.inner.options

    def read(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return self.inner.read(key, max_bytes=max_bytes)

    def read_upto(self, key: str, start: int, n: int) -> bytes | None:
        return self.inner.read_upto(key, start, n)

    def larger_than(self, key: str, limit: int) -> bool | None:
        return self.inner.larger_than(key, limit)

    def read_with_generation(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        return self.inner.read_with_generation(keys)

    def read_each_with_generation(self, keys: Sequence[str],
                                  max_bytes: int) -> list[tuple[bytes | None, bytes] | StorageError]:
        return self.inner.read_each_with_generation(keys, max_bytes)

    def read_range(self, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> Pending[bytes]:
        return self.inner.read_range(key, start, stop, tensor=tensor)

    def size_check(self, key: str, nbytes: int, *, tensor: str | None = None) -> Pending[None]:
        return self.inner.size_check(key, nbytes, tensor=tensor)

    def size_faults(self, objects: Sequence[tuple[str, int]]) -> list[str]:
        return self.inner.size_faults(objects)

    def check_no_links(self, key: str, checked: set[str], *, tensor: str | None = None) -> None:
        self.inner.check_no_links(key, checked, tensor=tensor)

    def stamps(self, objects: Sequence[tuple[str, int]]) -> list[str] | None:
        return self.inner.stamps(objects)

    @property
    def positional_reads(self) -> bool:
        return self.inner.positional_reads

    def open_positional(self, key: str, *, tensor: str | None = None) -> PositionalFile:
        return self.inner.open_positional(key, tensor=tensor)

    def write(self, key: str, data: bytes) -> None:
        self.inner.write(key, data)

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        self.inner.write_many(items)

    def write_object(self, key: str, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
        return self.inner.write_object(key, buffers, tensor=tensor)

    def sync(self, prefix: str) -> None:
        self.inner.sync(prefix)

    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        return self.inner.write_if(key, data, if_equal)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.create_if_absent(key, data)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def scan_children(self, prefix: str, *, marker: str | None = None, deep: bool = True) -> list[Entry]:
        return self.inner.scan_children(prefix, marker=marker, deep=deep)

    def plain_dir(self, prefix: str) -> bool:
        return self.inner.plain_dir(prefix)

    def remove_stale_locks(self, prefix: str, older_than_unix: float) -> int:
        return self.inner.remove_stale_locks(prefix, older_than_unix)

    def open_array(self, path: str, metadata: Mapping[str, Any], *, create: bool) -> Any:
        return self.inner.open_array(path, metadata, create=create)


def open_storage(url: str, options: StorageOptions | Mapping[str, Any] | None = None) -> Storage:
    """The backend for a repository URL (see :mod:`ckptfmt.storage._kvurl` for the accepted forms).
    ``options``: a :class:`StorageOptions`, or a mapping of its field names (never changed).
    Raises InvalidOptionError for an unknown option (naming the closest) or a bad value, before
    anything is opened; InvalidURLError for a URL it cannot address and StorageError when the
    store cannot be opened."""
    # The backends import tensorstore: imported here, when a repository is opened, so that
    # `import ckptfmt` stays quick (and they subclass Storage, defined above).
    from ckptfmt.storage._filestore import LocalFileStorage
    from ckptfmt.storage._kvstore import KvStoreStorage, MemoryStorage

    opts = StorageOptions.of(options, url=url)  # the one place options enter: checked here, typed after
    spec = kvstore_spec(url, opts.kvstore)
    backend = {"file": LocalFileStorage, "memory": MemoryStorage}.get(spec.get("driver"), KvStoreStorage)
    return backend(url, opts, spec)
