"""The options of a repository (:class:`StorageOptions`), checked once where they enter.

``Repository(url, options=...)`` and :func:`ckptfmt.storage.open_storage` take them as a
:class:`StorageOptions` or as a mapping of its field names; :meth:`StorageOptions.of` turns the
mapping into the one typed value every layer reads (``storage.options.read_threads``), so each
default lives here once. A key that is no field is refused with the closest valid name: a
misspelt option never falls back silently to its default.
"""
from __future__ import annotations

import copy
import difflib
import warnings
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ckptfmt.errors import InvalidOptionError

__all__ = ["StorageOptions", "DEFAULT_READ_WINDOW", "DEFAULT_READ_THREADS", "DEFAULT_WRITE_THREADS",
           "STORAGE_SYNC_MODES"]

#: Bytes of reads kept in flight by one reader (``read_window_bytes``): a fixed memory overhead,
#: independent of state size.
DEFAULT_READ_WINDOW = 256 << 20
#: Local-file reader threads (``read_threads``): enough positional reads in flight to keep a
#: virtual disk's queue full.
DEFAULT_READ_THREADS = 32
#: A save's writer threads (``write_threads``; pwritev, fsync and crc32c release the GIL): enough to
#: keep a disk's queue full.
DEFAULT_WRITE_THREADS = 16
#: ``sync_mode`` values (None: "syncfs" where the platform has it, else "fsync").
STORAGE_SYNC_MODES = ("syncfs", "fsync")

# Options a revision removed: accepted with a DeprecationWarning and ignored, so that code written
# for the older revision keeps running and is told why its option does nothing.
_REMOVED = {"vectored_writes": "the storage option 'vectored_writes' is gone (spec/FORMAT.md 1.2.2): every store "
                               "writes shard objects through one path, with the same bytes; the option is ignored"}


@dataclass(frozen=True)
class StorageOptions:
    """Tuning of a repository's reads, writes and store, one field per option.

    Raises InvalidOptionError (a ValueError) when built with a value of the wrong type or out of
    range, before any store is opened. :meth:`of` also refuses keys that are no field."""

    #: Bytes of reads in flight per reader (a restore's or a verification's window).
    read_window_bytes: int = DEFAULT_READ_WINDOW
    #: Local-file reader threads.
    read_threads: int = DEFAULT_READ_THREADS
    #: File driver: read shards with preadv straight into the outputs; False reads through
    #: tensorstore's kvstore as on every other store.
    positional_reads: bool = True
    #: File driver with positional reads: a requested box that is one whole single-chunk shard is
    #: handed out as a copy-on-write mapping once its index and crc32c are checked (FORMAT.md 14.8).
    mapped_reads: bool = False
    #: File driver: a positional read reads its large aligned spans through O_DIRECT where the
    #: file system takes it (FORMAT.md 14.4).
    direct_reads: bool = True
    #: A save's writer threads (on local files they write with pwritev from the source arrays).
    write_threads: int = DEFAULT_WRITE_THREADS
    #: File driver: a save writes through O_DIRECT where the file system takes it (FORMAT.md 14.2).
    direct_writes: bool = True
    #: File driver: make written objects durable (False skips every flush: tests and scratch only).
    fsync: bool = True
    #: File driver: "syncfs" (one syncfs per save) or "fsync" (each object and directory); None:
    #: "syncfs" where the platform has it, else "fsync".
    sync_mode: str | None = None
    #: tensorstore's file I/O concurrency limit.
    io_concurrency: int = 32
    #: tensorstore's data copy concurrency limit.
    copy_concurrency: int = 8
    #: Extra kvstore spec fields (an S3 endpoint, region, credentials, retries: docs/OBJECT_STORAGE.md),
    #: held as a read-only copy.
    kvstore: Mapping[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for name in ("read_window_bytes", "read_threads", "write_threads", "io_concurrency", "copy_concurrency"):
            v = getattr(self, name)
            # bool is an int in Python: threads=True is a mistake, not 1.
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise _bad(name, "an int >= 1", f"{type(v).__name__} {v!r}")
            if v < 1:
                raise _bad(name, "an int >= 1", v)
            object.__setattr__(self, name, int(v))
        for name in ("positional_reads", "mapped_reads", "direct_reads", "direct_writes", "fsync"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise _bad(name, "True or False", f"{type(v).__name__} {v!r}")
            object.__setattr__(self, name, bool(v))
        if self.sync_mode is not None and self.sync_mode not in STORAGE_SYNC_MODES:
            raise _bad("sync_mode", f"one of {STORAGE_SYNC_MODES} or None", repr(self.sync_mode))
        if self.kvstore is not None:
            if not isinstance(self.kvstore, Mapping):
                raise _bad("kvstore", "a mapping of kvstore spec fields", type(self.kvstore).__name__)
            # A private deep copy: the caller's dict (and its nested credentials) stay theirs.
            object.__setattr__(self, "kvstore", MappingProxyType(copy.deepcopy(dict(self.kvstore))))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in field order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, options: "StorageOptions | Mapping[str, Any] | None", *, url: str | None = None) -> "StorageOptions":
        """``options`` as a StorageOptions: itself, the defaults for None, or one built from a mapping
        of field names (never changed). InvalidOptionError, naming ``url``, for a key that is no
        option (with the closest valid name), a value of the wrong type or out of range, or
        ``options`` that are neither; a removed option warns (DeprecationWarning) and is ignored."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise InvalidOptionError("repository options must be a StorageOptions or a mapping", object=url,
                                     expected="StorageOptions or dict", found=type(options).__name__)
        valid = cls.names()
        kw: dict[str, Any] = {}
        for k, v in options.items():
            if k in _REMOVED:
                warnings.warn(_REMOVED[k], DeprecationWarning, stacklevel=3)
                continue
            if k not in valid:
                close = difflib.get_close_matches(str(k), valid, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidOptionError(f"unknown repository option {k!r}{hint}; valid options: {', '.join(valid)} "
                                         "(the fields of ckptfmt.StorageOptions)",
                                         object=url, expected="a StorageOptions field", found=repr(k))
            kw[k] = v
        try:
            return cls(**kw)
        except InvalidOptionError as e:  # the same error, naming the repository
            raise InvalidOptionError(e.message, object=url, expected=e.expected, found=e.found) from None


def _bad(name: str, expected: str, found: Any) -> InvalidOptionError:
    return InvalidOptionError(f"repository option {name!r} must be {expected}; pass a valid value or leave it out "
                              f"for its default", expected=expected, found=found)
