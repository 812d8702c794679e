"""Recognising a repository (FORMAT.md 4.5): the one test that gc, the CLI and every tool share.

A URL holds a repository when its marker ``ckptfmt.json`` is a JSON object whose ``format`` is
``"ckptfmt"`` (at most 4096 bytes), or, for repositories written before the marker, when some
valid step name under ``manifests/`` holds a manifest that passes validation.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

from ckptfmt.errors import CheckpointError, NotARepositoryError
from ckptfmt.layout import MARKER_KEY

if TYPE_CHECKING:  # the package's face imports this module
    from ckptfmt.repository import Repository

__all__ = ["recognise", "foreign_format", "FOREIGN_MARKERS", "MARKER_MAX_BYTES"]

MARKER_MAX_BYTES = 4096  # FORMAT.md 4.5
#: Objects that mark another system's checkpoint at a URL's top, and the ``--from`` of
#: ``ckptfmt import`` that reads it: a URL that is not a repository but holds one is told so.
FOREIGN_MARKERS = ((".metadata", "dcp"), ("_CHECKPOINT_METADATA", "orbax"), ("_METADATA", "orbax"),
                   ("manifest.ocdbt", "orbax"), ("model.safetensors.index.json", "safetensors"),
                   ("model.safetensors", "safetensors"))


def foreign_format(repo: Repository) -> str | None:
    """The ``ckptfmt import --from`` format of another system's checkpoint at ``repo``'s URL
    (FOREIGN_MARKERS, one one-byte probe each), or None."""
    for key, fmt in FOREIGN_MARKERS:
        try:
            if repo.storage.larger_than(key, 0) is not None:
                return fmt
        except CheckpointError:
            continue
    return None


def recognise(repo: Repository, steps: Sequence[int], consequence: str = "") -> None:
    """Return when ``repo`` (a :class:`~ckptfmt.Repository`, whose committed ``steps`` the caller
    listed) holds a repository; else raise NotARepositoryError naming the URL, with
    ``consequence`` (what the caller therefore did not do) appended to its message. Reads the
    marker, and only without one the manifests, newest first, until one validates. StorageError
    when the marker cannot be read."""
    marker = repo.storage.read(MARKER_KEY, max_bytes=MARKER_MAX_BYTES)
    if marker is not None and len(marker) <= MARKER_MAX_BYTES:
        try:
            doc = json.loads(marker)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("format") == "ckptfmt":
            return
    for s in reversed(steps):  # a repository from before the marker: one valid manifest
        try:
            repo.manifest(s)
            return
        except CheckpointError:
            continue
    fmt = foreign_format(repo)
    hint = (f"; this is a {fmt} checkpoint: bring it in with ckptfmt import --from {fmt} {repo.url} REPOSITORY "
            f"(or bridges.interop.import_checkpoint)" if fmt else "")
    raise NotARepositoryError("no ckptfmt repository here" + hint + (f"; {consequence}" if consequence else ""),
                              object=repo.url, expected=f"{MARKER_KEY}, or a valid committed manifest",
                              found="marker invalid" if marker is not None else
                              f"no marker, {len(steps)} manifest name(s), none valid")
