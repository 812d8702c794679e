"""A checkpoint repository: committed steps, opening, verification, deletion and gc.

Subpackage ``ckptfmt.repository``. A repository of committed steps: listing and opening steps,
recognising a repository, verification records, garbage collection, retention and the lease fence
between collectors and incremental saves (FORMAT.md 4.4, 4.5, 10). Its modules: ``_gc``,
``_gcfence``, ``_recognise``, ``_retention``, ``_verified``. May import: floor, manifest, storage,
reader. The floor: the top-level modules listed in ``ckptfmt/__init__.py`` (tests/test_layering.py
holds the rules and enforces them). Subpackages that may import it: session, interop, manager.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Mapping

from ckptfmt.repository import _gc, _recognise, _verified
from ckptfmt.repository._gc import DEFAULT_LEASE_GRACE_S as DEFAULT_LEASE_GRACE_S
from ckptfmt.repository._gc import GcChecks as GcChecks
from ckptfmt.repository._gc import GcReport as GcReport
from ckptfmt.errors import CheckpointError, InvalidManifestError, ManifestTooLargeError, StepNotFoundError
from ckptfmt.layout import MANIFESTS, manifest_key, step_of_manifest_key
from ckptfmt.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ckptfmt.reader import BlockChecks, Checkpoint, Progress, ReadStats
from ckptfmt.reader._verifylocal import ReadBuffers
from ckptfmt.storage import Storage, StorageOptions, open_storage

__all__ = ["Repository", "GcReport", "GcChecks"]

#: Parsed manifests a Repository keeps (the newest used), and the most manifest bytes they may hold.
MANIFEST_CACHE_ENTRIES = 8
MANIFEST_CACHE_BYTES = 64 << 20


class Repository:
    """A ckptfmt repository at ``url`` (local path, file://, memory://, s3://, gs://).

    ``options``: a :class:`~ckptfmt.StorageOptions`, or a mapping of its field names (each field's
    docstring gives its meaning and default: ``read_window_bytes``, ``read_threads``,
    ``positional_reads``, ``mapped_reads``, ``direct_reads``, ``write_threads``, ``direct_writes``,
    ``fsync``, ``sync_mode``, ``io_concurrency``, ``copy_concurrency``, ``kvstore``). A key that is
    no option raises InvalidOptionError suggesting the closest name; it is never ignored.

    ``storage``: an object with the storage interface to use instead of opening ``url`` (a
    wrapper around another repository's ``storage``, e.g. the fault fixture's); ``options`` are
    then ignored.

    Only committed manifests are visible: a save that has not committed is never listed.
    """

    def __init__(self, url: str, *, options: StorageOptions | Mapping[str, Any] | None = None,
                 storage: Storage | None = None,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES, checks: BlockChecks | None = None) -> None:
        """``storage``: any object with the :class:`~ckptfmt.storage.Storage` interface to use
        instead of the backend :func:`~ckptfmt.storage.open_storage` picks for ``url`` (such as a
        :class:`~ckptfmt.storage.DelegatingStorage` that injects faults); its own options apply,
        so ``options`` must then be None (ValueError otherwise). Raises InvalidOptionError (a
        ValueError) for an unknown option or a bad value, InvalidURLError for a URL that
        addresses nothing and StorageError when the store cannot be opened.

        ``checks``: the checks of the bytes read against the manifest that every step this
        repository opens or verifies is given (default: a new
        :class:`~ckptfmt.reader.BlockChecks` per step); a test passes a weakened one to build a
        broken control."""
        self.url = str(url)
        if storage is not None and options is not None:
            raise ValueError("pass options to the storage, not to Repository, when giving a storage")
        self.storage: Storage = storage if storage is not None else open_storage(self.url, options)
        self.max_manifest_bytes = max_manifest_bytes
        self.checks = checks
        # Manifests parsed before, by key, with the bytes they were parsed from: a manager's save
        # and retention read the same few manifests up to six times, and parse each once. A hit
        # needs the bytes read now to equal those parsed (a manifest is immutable once committed,
        # but a step may be deleted and committed again).
        self._parsed: OrderedDict[str, tuple[bytes, Manifest]] = OrderedDict()
        self._parsed_lock = threading.Lock()
        # Read buffers kept between verifications: a manager's retention verifies after every save.
        self._read_buffers = ReadBuffers()

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    def steps(self) -> list[int]:
        """Committed steps, ascending. Keys under ``manifests/`` that name no valid step (not 20
        digits, or above 2^63 - 1) are not steps (FORMAT.md 4.2): see :meth:`foreign_manifests`."""
        return sorted(s for k in self.storage.list(MANIFESTS) if (s := step_of_manifest_key(k)) is not None)

    def foreign_manifests(self) -> list[str]:
        """Keys under ``manifests/`` that discovery ignores (FORMAT.md 4.2), for tools to report."""
        return [k for k in self.storage.list(MANIFESTS) if step_of_manifest_key(k) is None]

    def recognise(self) -> None:
        """Return when the URL holds a ckptfmt repository (FORMAT.md 4.5: its marker, or for one
        written before the marker a valid committed manifest), even one with no committed step;
        else raise NotARepositoryError naming the URL. Tools call it first wherever "no committed
        step" would hide a mistyped path. StorageError when the store cannot be read."""
        _recognise.recognise(self, self.steps())

    def latest(self) -> int | None:
        """The newest committed step, or None when there is none."""
        s = self.steps()
        return s[-1] if s else None

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of a committed step. StepNotFoundError / InvalidManifestError on failure."""
        return self.manifest_with_bytes(step)[0]

    def manifest_with_bytes(self, step: int) -> tuple[Manifest, bytes]:
        """:meth:`manifest`, with the bytes read now that it was validated from (a verification
        record binds their digest, FORMAT.md 10.4)."""
        key = manifest_key(int(step))
        data = self._read_manifest_bytes(key)
        if data is None:
            steps = self.steps()
            there = f"the committed steps are {_steps_text(steps)}" if steps else "the repository has no committed step"
            raise StepNotFoundError(f"step {int(step)} is not committed: {there}; ask for one of them, or for the "
                                    "newest (no step)", object=key,
                                    expected=f"one of {_steps_text(steps)}" if steps else "a committed manifest",
                                    found="none")
        with self._parsed_lock:
            hit = self._parsed.get(key)
            if hit is not None and hit[0] == data:
                self._parsed.move_to_end(key)
                return hit[1], hit[0]  # the same bytes validated before (a Manifest is immutable)
        try:
            m = parse_manifest(data, max_bytes=self.max_manifest_bytes)
        except CheckpointError as e:
            e.object = e.object or key
            raise
        if m.step != int(step):
            raise InvalidManifestError("manifest names a different step than its key", object=key,
                                       expected=int(step), found=m.step)
        data = bytes(data)
        self.remember_manifest(key, data, m)
        return m, data

    def remember_manifest(self, key: str, data: bytes, manifest: Manifest) -> None:
        """Keep ``manifest``, validated from ``data`` (the bytes at ``key``), for :meth:`manifest`:
        a save gives the one it committed. At most :data:`MANIFEST_CACHE_ENTRIES` are kept, holding
        at most :data:`MANIFEST_CACHE_BYTES` of manifest bytes; the least recently used go first."""
        with self._parsed_lock:
            self._parsed.pop(key, None)
            if len(data) > MANIFEST_CACHE_BYTES:
                return
            self._parsed[key] = (data, manifest)
            held = sum(len(d) for d, _ in self._parsed.values())
            while len(self._parsed) > MANIFEST_CACHE_ENTRIES or held > MANIFEST_CACHE_BYTES:
                held -= len(self._parsed.popitem(last=False)[1][0])

    def _read_manifest_bytes(self, key: str) -> bytes | None:
        self.storage.check_no_links(key, set())  # a reader does not leave the repository (FORMAT.md 4.2)
        # One byte at the cap first: an oversized manifest is rejected without being read.
        if self.storage.larger_than(key, self.max_manifest_bytes):
            raise ManifestTooLargeError("manifest exceeds the size cap", object=key,
                                        expected=f"<= {self.max_manifest_bytes} bytes", found="larger")
        return self.storage.read(key, max_bytes=self.max_manifest_bytes)

    def open(self, step: int | None = None) -> Checkpoint:
        """Open a committed step for reading (default: the latest)."""
        t0 = time.perf_counter()
        if step is None:
            step = self.latest()
            if step is None:
                raise StepNotFoundError("repository has no committed step", object=self.url, expected=">= 1 step", found=0)
        stats = ReadStats()
        m, data = self.manifest_with_bytes(step)
        stats.add_time("manifest", time.perf_counter() - t0)
        window = self.storage.options.read_window_bytes
        return Checkpoint(self.storage, m, stats=stats, max_inflight_bytes=window, checks=self.checks,
                          manifest_bytes=data)

    def verify(self, step: int | None = None, progress: Progress | None = None) -> int:
        """Check every byte of a step against its manifest; raise on the first fault. Returns bytes checked."""
        return self.open(step).verify(progress, buffers=self._read_buffers)

    def delete(self, step: int) -> None:
        """Un-commit a step (its manifest goes first, atomically), then remove its objects.

        The objects stay when the lease of a save in progress pins the save id (FORMAT.md 8.4),
        when another committed manifest names or mentions it (or one cannot be read: a manifest
        of revision 1.1 names the saves whose objects it references), judged in that order, and
        when this step's manifest is damaged (gc judges them then). Before removing them it
        claims the save and looks at the leases and manifests again (the fence of FORMAT.md
        10.3), so a save that pinned them meanwhile keeps them. Links are never followed
        (FORMAT.md 4.4). Raises StepNotFoundError when the step is not committed, and
        StorageError when the manifest cannot be deleted.
        """
        step = int(step)
        try:
            save_id: str | None = self.manifest(step).save_id
        except StepNotFoundError:
            raise
        except CheckpointError:
            save_id = None  # damaged: it does not name its objects reliably
        self.storage.delete(manifest_key(step))
        if save_id is not None:
            _verified.forget(self.storage, save_id)
            _gc.remove_unreferenced(self, save_id, but=step)

    def gc(self, *, grace_s: float | None = None, keep_last: int | None = None,
           keep_every: int | None = None, dry_run: bool = False, checks: GcChecks | None = None) -> GcReport:
        """Apply retention, then remove the objects of abandoned saves (FORMAT.md 10).

        Retention keeps the newest ``keep_last`` restorable steps (and every step divisible by
        ``keep_every``, and every newer step, restorable or not); it removes a step only while a
        newer kept step has been verified byte for byte (its verification record, FORMAT.md 10.4,
        or a read of every byte), so it never removes the newest verified step. A save whose lease was refreshed within ``grace_s`` seconds (or, with no
        lease on a local disk, whose newest object is that young) is in progress and never
        touched. Nothing a committed manifest names or mentions is removed, even when that manifest
        is damaged; symbolic links are never followed, and names that are not the writer's save
        ids are reported as foreign, never deleted.

        Raises NotARepositoryError, deleting nothing, when the URL holds no repository (FORMAT.md
        4.5), and StorageError when ``manifests/`` cannot be listed. Anything else that gc cannot
        decide is kept and reported in the GcReport (``uncertain``, ``problems``); committed steps
        with a damaged manifest are listed in ``damaged_steps``. ``dry_run=True`` deletes and
        claims nothing and reports what a run would remove (``GcReport.dry_run``). ``checks``: the
        checks gc decides with (default :class:`GcChecks`); a test passes a weakened one to build a
        broken control.
        """
        return _gc.collect(self, grace_s=grace_s, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run,
                           checks=checks)


def _steps_text(steps: list[int], most: int = 8) -> str:
    """Committed steps for a message: all of them, or the first and the newest few around "...".
    """
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:2]))}, ... ({len(steps) - most + 2} more), {', '.join(map(str, steps[-(most - 2):]))}"
