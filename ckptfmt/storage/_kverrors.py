"""The typed errors of failed store calls: one classification of tensorstore's and the OS's
failure texts (disk full, file too large, permission denied, not found), free of tensorstore
itself, so that the file writer and the scheduler need not import it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ckptfmt.errors import CheckpointError, StorageError

__all__ = ["OutOfRange", "classify", "storage_error", "kv_errors"]


class OutOfRange(StorageError):
    """A byte range past the end of an object (tensorstore's OUT_OF_RANGE)."""


#: (kind, the lower-case texts that mark it, what the message says). The first match wins: a write
#: past RLIMIT_FSIZE (EFBIG) is reported as OUT_OF_RANGE too, so the errno kinds come first.
_KINDS = (
    ("no_space", ("no space", "space left", "not enough space", "enospc", "errno=28", "os_error_code='28'"), "disk full"),
    ("too_large", ("file too large", "efbig", "errno=27", "os_error_code='27'"), "file too large"),
    ("permission", ("permission_denied", "permission denied", "eacces", "access denied"), "permission denied"),
    ("out_of_range", ("out_of_range",), "byte range past the end of the object"),
    ("not_found", ("not_found",), "not found"),
    ("unreachable", ("could not resolve", "could not connect", "failed to connect", "connection refused",
                     "unavailable"), "the store could not be reached"),
    ("credentials", ("unauthenticated", "invalidaccesskeyid", "signaturedoesnotmatch", "expiredtoken",
                     "no credentials", "credentials"), "the store refused the credentials"),
)
#: What to do next, by kind (the message's last part).
_NEXT = {
    "no_space": "free space on the store, or save somewhere else",
    "too_large": "raise the process's file size limit (ulimit -f), or save with smaller shards",
    "permission": "check the folder's or bucket's permissions for this user",
    "unreachable": "check the URL's bucket and the endpoint (AWS_ENDPOINT_URL, ?endpoint=) and the network "
                   "(docs/OBJECT_STORAGE.md)",
    "credentials": "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile (docs/OBJECT_STORAGE.md)",
}


def classify(e: BaseException) -> str:
    """The kind of a tensorstore failure: "no_space", "too_large", "permission", "out_of_range",
    "not_found", "unreachable", "credentials" or "other"."""
    text = str(e).lower()
    for kind, marks, _ in _KINDS:
        if any(m in text for m in marks):
            return kind
    return "other"


def storage_error(what: str, e: BaseException, *, object: str, key: str | None = None,
                  ranged: bool = False) -> StorageError:
    """The typed error of a failed tensorstore call: OutOfRange for a ``ranged`` read past the
    object's end, else a StorageError whose message names the kind of failure; ``found`` keeps
    tensorstore's own text."""
    kind = classify(e)
    if kind == "out_of_range" and ranged:
        return OutOfRange(what, key=key, object=object, found=str(e)[:300])
    note = next((n for k, _, n in _KINDS if k == kind), None)
    message = f"{what} ({note})" if note else what
    if kind in _NEXT:
        message += f": {_NEXT[kind]}"
    return StorageError(message, key=key, object=object, found=str(e)[:300])


@contextmanager
def kv_errors(what: str, *, object: str, key: str | None = None, ranged: bool = False) -> Iterator[None]:
    """Re-raise any tensorstore failure inside the block as :func:`storage_error` does (``ranged``:
    the block is a byte-range read whose caller catches OutOfRange); a CheckpointError passes
    through unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # tensorstore raises plain exceptions (ValueError, OSError, ...)
        raise storage_error(what, e, object=object, key=key, ranged=ranged) from None
