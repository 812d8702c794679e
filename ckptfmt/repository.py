"""A checkpoint repository: committed steps, opening, verification, deletion and gc."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import CheckpointError, InvalidManifestError, ManifestTooLargeError, StepNotFoundError
from .manifest import MAX_MANIFEST_BYTES, Manifest, manifest_key, parse_manifest
from .reader import DEFAULT_READ_WINDOW, Checkpoint, Progress, ReadStats
from .storage import Storage

__all__ = ["Repository", "GcReport"]

_MANIFEST_RE = re.compile(r"^manifests/([0-9]{20})\.json$")
_SAVE_ID_STEP_RE = re.compile(r"^([0-9]{12,})-[0-9]{8}T[0-9]{6}-[0-9a-f]{8}$")
DEFAULT_LEASE_GRACE_S = 600.0  # FORMAT.md 10.2


@dataclass
class GcReport:
    """What gc did: steps removed by retention, private saves removed, saves left alone."""

    removed_steps: list[int] = field(default_factory=list)
    removed_saves: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    objects_removed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"removed_steps": self.removed_steps, "removed_saves": self.removed_saves,
                "in_progress": self.in_progress, "objects_removed": self.objects_removed}


class Repository:
    """A ckptfmt repository at ``url`` (local path, file://, memory://, s3://, gs://).

    ``options``: ``read_window_bytes`` (bytes of reads in flight per reader, default 256 MiB),
    ``read_threads`` (local-file reader threads, default 32), ``positional_reads`` (file driver: read
    shards with preadv straight into the outputs, default True; False reads through tensorstore's
    kvstore as on every other store), ``fsync`` (file driver, default True),
    ``io_concurrency``, ``copy_concurrency``, and
    ``kvstore`` (extra kvstore options such as an S3 endpoint).

    Only committed manifests are visible: a save that has not committed is never listed.
    """

    def __init__(self, url: str, *, options: Mapping[str, Any] | None = None,
                 max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> None:
        self.url = str(url)
        self.storage = Storage(self.url, options)
        self.max_manifest_bytes = max_manifest_bytes

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(int(m.group(1)) for k in self.storage.list("manifests/") if (m := _MANIFEST_RE.fullmatch(k)))

    def latest(self) -> int | None:
        """The newest committed step, or None when there is none."""
        s = self.steps()
        return s[-1] if s else None

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of a committed step. StepNotFoundError / InvalidManifestError on failure."""
        key = manifest_key(int(step))
        data = self._read_manifest_bytes(key)
        if data is None:
            raise StepNotFoundError("step is not committed", object=key, expected="a committed manifest", found="none")
        try:
            m = parse_manifest(data, max_bytes=self.max_manifest_bytes)
        except CheckpointError as e:
            e.object = e.object or key
            raise
        if m.step != int(step):
            raise InvalidManifestError("manifest names a different step than its key", object=key,
                                       expected=int(step), found=m.step)
        return m

    def _read_manifest_bytes(self, key: str) -> bytes | None:
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
        m = self.manifest(step)
        stats.add_time("manifest", time.perf_counter() - t0)
        window = int(self.storage.options.get("read_window_bytes", DEFAULT_READ_WINDOW))
        return Checkpoint(self.storage, m, stats=stats, max_inflight_bytes=window)

    def verify(self, step: int | None = None, progress: Progress | None = None) -> int:
        """Check every byte of a step against its manifest; raise on the first fault. Returns bytes checked."""
        return self.open(step).verify(progress)

    def delete(self, step: int) -> None:
        """Un-commit a step (its manifest goes first, atomically), then remove its objects."""
        m = self.manifest(step)
        self.storage.delete(manifest_key(step))
        self.storage.delete_prefix(f"saves/{m.save_id}/")

    def gc(self, *, grace_s: float | None = None, keep_last: int | None = None,
           keep_every: int | None = None) -> GcReport:
        """Apply retention, then remove private objects of saves that no committed manifest references.

        Retention keeps the newest ``keep_last`` steps (and every step divisible by ``keep_every``);
        it only ever removes steps older than a committed newer one. A save whose lease was
        refreshed within ``grace_s`` seconds is in progress and is never touched. Nothing a
        committed manifest references is removed, even when that manifest is unreadable.
        """
        grace_s = DEFAULT_LEASE_GRACE_S if grace_s is None else float(grace_s)
        report = GcReport()
        steps = self.steps()
        if keep_last is not None and keep_last >= 1 and len(steps) > keep_last:
            for s in steps[:-keep_last]:
                if keep_every and s % keep_every == 0:
                    continue
                self.delete(s)
                report.removed_steps.append(s)
        # Order matters: list private saves and read their leases FIRST, then read the manifests.
        # A save commits before it drops its lease, so every candidate that committed in between
        # is seen as referenced below and survives.
        by_save: dict[str, int] = {}
        for k in self.storage.list("saves/"):
            parts = k.split("/")
            if len(parts) >= 3:
                by_save[parts[1]] = by_save.get(parts[1], 0) + 1
        for sid in self.storage.children("saves/"):  # saves that hold only hidden lock files
            by_save.setdefault(sid, 0)
        lease_keys = [f"saves/{sid}/LEASE" for sid in by_save]
        leases_gen = dict(zip(by_save, self.storage.read_with_generation(lease_keys)))
        leases = {sid: value for sid, (value, _gen) in leases_gen.items()}
        referenced: set[str] = set()
        raw_manifests: list[bytes] = []
        for s in self.steps():
            try:
                referenced.add(self.manifest(s).save_id)
            except CheckpointError:
                data = self.storage.read(manifest_key(s))
                if data:
                    raw_manifests.append(data)
        now = time.time()
        for sid, count in sorted(by_save.items()):
            if sid in referenced or any(sid.encode() in raw for raw in raw_manifests):
                lease = leases.get(sid)  # a committed save whose writer died before dropping its lease
                if lease is not None and now - _heartbeat(lease) >= grace_s:
                    self.storage.write_if(f"saves/{sid}/LEASE", None, leases_gen[sid][1])
                # ...or died while dropping it: the file driver's lock file of that delete remains
                report.objects_removed += self.storage.remove_stale_locks(f"saves/{sid}/", now - grace_s)
                continue
            if count == 0:  # only lock files of interrupted writes: judge by their age
                newest = self.storage.newest_mtime(f"saves/{sid}/")
                if newest is not None and now - newest < grace_s:
                    report.in_progress.append(sid)
                    continue
            m = _SAVE_ID_STEP_RE.match(sid)
            if m is not None:
                # Confirm with a point read of the manifest its step would have: on a store whose
                # LIST lags behind PUT, a save that committed a moment ago may be missing from the
                # manifests/ listing above (docs/OBJECT_STORAGE.md, "gc and a lagging list").
                data = self.storage.read(manifest_key(int(m.group(1))))
                if data is not None and sid.encode() in data:
                    continue
            lease = leases.get(sid)
            if lease is not None:
                if now - _heartbeat(lease) < grace_s:
                    report.in_progress.append(sid)
                    continue
                # Delete the lease only if it is still the one judged stale: a writer that refreshed it
                # since keeps its save (and a writer never re-creates a lease gc removed).
                if not self.storage.write_if(f"saves/{sid}/LEASE", None, leases_gen[sid][1]):
                    report.in_progress.append(sid)
                    continue
            self.storage.delete_prefix(f"saves/{sid}/")
            report.removed_saves.append(sid)
            report.objects_removed += count
        return report


def _heartbeat(lease: bytes) -> float:
    try:
        return float(json.loads(lease)["heartbeat_unix"])
    except (ValueError, KeyError, TypeError):
        return 0.0
