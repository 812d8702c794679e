"""Fault injection through a storage wrapper: a writer's save goes through :class:`FaultyStorage`.

The wrapper is passed to ``ckptfmt.Repository(url, storage=...)``; the library itself is never
patched. It delegates every call to the real storage and changes only the two commit moments of
the protocol (FORMAT.md 8.3), which it recognises by what is written, not by which code writes it:

* the **commit fence**: a conditional write of a save's ``LEASE`` whose body says
  ``"state": "committing"``;
* the **commit**: the conditional create of a manifest (``manifests/<20 digits>.json``).

Weakenings (broken controls, tests only): ``no_conditional_create`` turns every conditional create
into a plain write (a second save of a step overwrites the first); ``no_commit_fence`` turns the
fence into the old check-then-create (read the lease, compare its generation, write nothing).
Freeze points: ``before_fence`` and ``before_create`` call ``freeze()`` at that moment (with
``no_commit_fence``, ``before_fence`` freezes between the check and the create).
"""
from __future__ import annotations

import json
from typing import Any, Callable

from ckptfmt.layout import step_of_manifest_key
from ckptfmt.storage import DelegatingStorage

__all__ = ["FaultyStorage", "WEAKEN", "FREEZE_POINTS"]

#: Broken controls: each name disables one guarantee of the commit protocol in this process.
WEAKEN = {
    "no_conditional_create": "the commit's conditional create becomes an unconditional write",
    "no_commit_fence": "the commit fence becomes the old check-then-create (a lease read, no conditional write)",
}
FREEZE_POINTS = ("before_fence", "before_create")


def _is_fence(key: str, data: bytes | None) -> bool:
    if data is None or not key.endswith("/LEASE"):
        return False
    try:
        body = json.loads(data)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("state") == "committing"


class FaultyStorage(DelegatingStorage):
    """The storage interface of ``inner``, with one weakening and/or one freeze point applied.

    A freeze at the fence happens inside the heartbeat's lock (the fence is written under it), so
    no lease refresh is in flight when the process stops. Raises ValueError at construction for an
    unknown weakening or freeze point.
    """

    def __init__(self, inner: Any, *, weaken: str | None = None, freeze: str | None = None,
                 on_freeze: Callable[[], None] | None = None) -> None:
        if weaken is not None and weaken not in WEAKEN:
            raise ValueError(f"unknown weakening {weaken!r}; known: {sorted(WEAKEN)}")
        if freeze is not None and freeze not in FREEZE_POINTS:
            raise ValueError(f"unknown freeze point {freeze!r}; known: {list(FREEZE_POINTS)}")
        if freeze is not None and on_freeze is None:
            raise ValueError("a freeze point needs on_freeze")
        super().__init__(inner)
        self._weaken, self._freeze, self._on_freeze = weaken, freeze, on_freeze

    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        if not _is_fence(key, data):
            return self.inner.write_if(key, data, if_equal)
        if self._weaken == "no_commit_fence":
            # The old protocol: check that the lease is still ours, then go on to create the
            # manifest; nothing stops a collector that claims the lease in between.
            value, generation = self.inner.read_with_generation([key])[0]
            held = value is not None and generation == if_equal
            if self._freeze == "before_fence":
                self._on_freeze()  # type: ignore[misc]
            return if_equal if held else b""
        if self._freeze == "before_fence":
            self._on_freeze()  # type: ignore[misc]
        return self.inner.write_if(key, data, if_equal)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        if self._freeze == "before_create" and step_of_manifest_key(key) is not None:
            self._on_freeze()  # type: ignore[misc]
        if self._weaken == "no_conditional_create":
            self.inner.write(key, data)
            return True
        return self.inner.create_if_absent(key, data)
