"""Typed errors. Every error raised for a bad checkpoint derives from CheckpointError.

Each error names the tensor key path (``key``), the storage object (``object``),
and what was expected against what was found.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "CheckpointError", "InvalidManifestError", "UnsupportedVersionError", "ManifestTooLargeError",
    "StepNotFoundError", "MissingShardError", "SizeMismatchError", "ChecksumMismatchError",
    "DuplicateShardError", "StepAlreadyCommittedError", "StepMismatchError", "IncompleteSaveError",
    "CoordinatorTimeoutError", "CoordinatorLostError", "StorageError", "InvalidStateError",
    "ShapeMismatchError", "TopologyChangedError", "SaveInProgressError", "KeyMismatchError", "RestoreMismatchError",
    "InvalidURLError", "QuantizedWeightError",
    "NotARepositoryError",
    "InvalidDataError", "AllocationError",
    "InvalidSourceError", "ReferenceCycleError",
    "OutputExistsError", "InvalidConfigError", "InvalidOptionError",
]


class CheckpointError(Exception):
    """Base class of every error ckptfmt raises for a bad or unusable checkpoint."""

    def __init__(self, message: str, *, key: str | None = None, object: str | None = None,
                 expected: Any = None, found: Any = None) -> None:
        self.message = message
        self.key = key
        self.object = object
        self.expected = expected
        self.found = found
        parts = [message]
        if key is not None:
            parts.append(f"tensor={key!r}")
        if object is not None:
            parts.append(f"object={object!r}")
        if expected is not None or found is not None:
            parts.append(f"expected={expected!r} found={found!r}")
        super().__init__("; ".join(parts))

    #: Attributes beyond the five above that :meth:`to_json` carries and :meth:`from_json` restores
    #: (a subclass's full lists, e.g. KeyMismatchError's missing and unexpected keys).
    json_fields: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly description (for the CLI's --json output, receipts and the errors one
        rank sends the others); :meth:`from_json` is its inverse."""
        doc = {"error": type(self).__name__, "message": self.message, "key": self.key,
               "object": self.object, "expected": _plain(self.expected), "found": _plain(self.found)}
        for name in self.json_fields:
            doc[name] = _plain(getattr(self, name, None))
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, prefix: str = "") -> "CheckpointError":
        """The error :meth:`to_json` described, as this process raises it (the one inverse).

        The class is looked up by name among CheckpointError's subclasses (ckptfmt.errors first,
        then any loaded subclass, e.g. bridges' MappingError); ``message`` is prefixed with
        ``prefix`` (``"rank 0: "``). A name that is no CheckpointError class (another version's
        class, or a plain exception a peer marked ``"untyped"``) gives a CheckpointError whose
        message names it. Never raises for a malformed ``doc``: missing fields are None.
        """
        if not isinstance(doc, Mapping):
            return CheckpointError(f"{prefix}malformed error description", expected="a map",
                                   found=type(doc).__name__)
        name = str(doc.get("error"))
        found = None if doc.get("untyped") else error_class(name)
        message = f"{prefix}{doc.get('message')}" if found is not None else f"{prefix}{name}: {doc.get('message')}"
        err = (found or CheckpointError)(message, key=doc.get("key"), object=doc.get("object"),
                                         expected=doc.get("expected"), found=doc.get("found"))
        for field in (found.json_fields if found is not None else ()):
            if field in doc:
                setattr(err, field, doc[field])
        return err


def error_class(name: str) -> type[CheckpointError] | None:
    """The CheckpointError class called ``name``: this module's first, else a unique loaded one."""
    here = globals().get(name)
    if isinstance(here, type) and issubclass(here, CheckpointError):
        return here
    seen: list[type[CheckpointError]] = []
    todo: list[type[CheckpointError]] = [CheckpointError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    named = [c for c in seen if c.__name__ == name]
    return named[0] if len(named) == 1 else None


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


class InvalidURLError(CheckpointError):
    """A repository URL is ambiguous, malformed or of an unsupported scheme (nothing was opened)."""


class InvalidManifestError(CheckpointError):
    """The manifest is not valid JSON, violates the schema, or breaks a format rule."""


class UnsupportedVersionError(InvalidManifestError):
    """The manifest has a format version or a must_understand extension this reader does not know."""


class ManifestTooLargeError(InvalidManifestError):
    """The manifest is larger than the reader's size cap."""


class StepNotFoundError(CheckpointError):
    """No committed manifest exists for the requested step."""


class MissingShardError(CheckpointError):
    """An object that a committed manifest references is absent."""


class SizeMismatchError(CheckpointError):
    """An object is shorter or longer than the manifest records (truncated or appended)."""


class ChecksumMismatchError(CheckpointError):
    """Bytes read do not match the crc32c recorded in the manifest (corrupt or stale)."""


class InvalidDataError(CheckpointError):
    """Tensor data passed its checksums but is not a valid encoding of its dtype (a bool byte other
    than 0x00/0x01)."""


class AllocationError(CheckpointError):
    """A read's outputs cannot be allocated: larger than this host's memory, or the allocation failed."""


class DuplicateShardError(InvalidManifestError):
    """Two shards claim the same region of a tensor, or an object is referenced twice."""


class StepAlreadyCommittedError(CheckpointError):
    """Another save already committed this step; the manifest was not overwritten."""


class StepMismatchError(CheckpointError):
    """Ranks disagree on the step, the tensor inventory, or the ownership of a save."""


class IncompleteSaveError(CheckpointError):
    """A writer failed or did not acknowledge; nothing was committed."""


class CoordinatorTimeoutError(CheckpointError):
    """A collective wait ran past its timeout; some rank did not arrive."""


class CoordinatorLostError(CheckpointError):
    """The connection to the coordinator or a peer was lost."""


class StorageError(CheckpointError):
    """The storage layer failed (I/O error, disk full, permission)."""


class InvalidStateError(CheckpointError):
    """Non-tensor state cannot be encoded, or stored state is hostile or malformed."""


class ReferenceCycleError(InvalidStateError):
    """State to be saved (a pytree, a state dict, ``extra``, per-rank state) contains itself; ``key``
    is the key path where the cycle closes. Raised before anything is written."""


class ShapeMismatchError(CheckpointError):
    """A restore target's shape or dtype does not match the checkpoint."""


class KeyMismatchError(CheckpointError):
    """A restore target has keys missing from the checkpoint, or the checkpoint has unexpected keys.

    Raised by a restore (``ckptfmt.restoreplan``), it carries the full lists: ``missing`` (target
    keys the checkpoint lacks), ``unexpected`` (checkpoint keys the target does not name),
    ``notes`` (why matching mapping rules did not apply) and ``mismatches`` (the ``to_json()`` of
    each value whose shape or dtype does not fit); None where not known."""

    json_fields = ("missing", "unexpected", "notes", "mismatches")
    missing: list[str] | None = None
    unexpected: list[str] | None = None
    notes: list[str] | None = None
    mismatches: list[dict[str, Any]] | None = None


class RestoreMismatchError(KeyMismatchError, ShapeMismatchError):
    """Several mismatches of one restore at once (keys, shapes, dtypes, mapping rules), listed in one
    error: a KeyMismatchError and a ShapeMismatchError, so either ``except`` catches it."""


class TopologyChangedError(CheckpointError):
    """Per-rank state cannot be restored on a different topology without an explicit policy."""


class SaveInProgressError(CheckpointError):
    """A save was started while an earlier asynchronous save is still in flight."""


class NotARepositoryError(CheckpointError):
    """No ckptfmt repository at the URL (FORMAT.md 4.5): a collector deleted nothing, and a tool
    (``ls``, ``inspect``, ``verify``, ``export``) read nothing."""


class InvalidSourceError(CheckpointError):
    """A source of another format (a safetensors header or index, an Orbax or DCP checkpoint) is
    malformed or inconsistent; nothing was read past the check that failed (docs/INTEROP.md)."""


class OutputExistsError(StorageError, FileExistsError):
    """An export's output name (a final or a temporary file) already exists in the output directory,
    as a file or as a link; nothing was written over it or through it (docs/INTEROP.md, section 3).
    Also a FileExistsError, which this refusal was before it was typed."""


class InvalidConfigError(CheckpointError, ValueError):
    """A model config given to an export (``config.json`` or a dict) is not a JSON object within the
    caps (size, nesting), or cannot be written as JSON; checked before anything is written."""


class InvalidOptionError(CheckpointError, ValueError):
    """Repository options (:class:`ckptfmt.StorageOptions`, or the mapping given to ``Repository``)
    name an option that does not exist (the message suggests the closest one) or give one a value
    of the wrong type or out of range; refused before any store is opened. A ValueError too, as
    :class:`ckptfmt.SaveOptions` raises for its own bad values."""


class QuantizedWeightError(ShapeMismatchError):
    """A restore would cast quantized codes without their scales: the checkpoint tensor is float8
    with a recognised scale companion (block-FP8 ``X.weight`` with ``X.weight_scale_inv``) and the
    target asks for another dtype. ``key`` is the target key, ``object`` the companion's key; the
    message says how to dequantize (a ``bridges.mapping.Dequantize`` rule, or
    ``bridges.mapping.dequantized(mapping)``). Nothing is read or cast."""
