"""The options of a save (:class:`SaveOptions`), checked once when built.

A leaf of the save path: it imports none of it. The save protocol (:mod:`ckptfmt.session`) reads the
options and hands each layer below it only the values it needs (the write scheduler's
:class:`ckptfmt.session._shardwriter.WriteSettings` and :class:`ckptfmt.session._shardwriter.PhaseClock`); no
module below the protocol imports this one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.manifest._refs import MANIFEST_COLUMNS
from ckptfmt.plan import DEFAULT_CHUNK_TARGET_BYTES

__all__ = ["SaveOptions", "REUSE_MODES", "MANIFEST_COLUMNS", "CODECS", "LAYOUTS", "DEFAULT_PACK_BYTES"]

#: ``SaveOptions.reuse`` (FORMAT.md 8.4).
REUSE_MODES = ("auto", "compare", "off")
#: ``SaveOptions.codec`` (FORMAT.md 6.3).
CODECS = ("raw", "zstd")
#: ``SaveOptions.layout`` (FORMAT.md 5.15): "packed" (revision 1.3) or "arrays" (an object per shard).
LAYOUTS = ("packed", "arrays")
#: ``SaveOptions.pack_bytes``' default: the most bytes one pack object holds (a larger shard has
#: one of its own). A local file is written in place; an object store's pack is gathered in host
#: memory first, so this also bounds what each writer holds there.
DEFAULT_PACK_BYTES = 1 << 30


@dataclass(frozen=True)
class SaveOptions:
    """Tuning and test knobs of a save. ``save_id``/``created_unix`` exist for reproducible examples.

    Raises ValueError when built with an unknown ``reuse``, ``manifest_columns`` or ``codec``, or
    a ``codec_level`` outside [-7, 22]: a usage error, before any save begins."""

    timeout_s: float = 300.0
    chunk_target_bytes: int = DEFAULT_CHUNK_TARGET_BYTES
    max_inflight_bytes: int = 128 << 20
    heartbeat_s: float = 10.0
    save_id: str | None = None
    created_unix: float | None = None
    #: Bounding storage pressure: at most this many bytes/s written by this process (None: no limit),
    max_write_bytes_per_s: float | None = None
    #: and a random delay in [0, jitter_s) before this rank's first write, so that ranks do not
    #: burst the storage in lock-step. Both apply after the freeze; neither changes the format.
    jitter_s: float = 0.0
    #: Incremental saves (FORMAT.md 8.4): "auto" references a shard of the previous committed step
    #: whose bytes are proven equal instead of writing it again; "compare" proves every such shard
    #: by a full byte comparison; "off" writes every shard (a format 1.0 manifest).
    reuse: str = "auto"
    #: The inner-chunk codec (FORMAT.md 6.3): "raw" (default), or "zstd" at ``codec_level``
    #: (revision 1.1, extension ckptfmt.zstd; crc32c over the encoded bytes).
    codec: str = "raw"
    codec_level: int = 3
    #: The manifest's tensor columns (FORMAT.md 5.14, revision 1.2): "auto" (default) leaves out the
    #: five a tensor's geometry determines when the manifest holds >= 65,536 shard rows, "derived"
    #: always, "explicit" never (readers of revisions 1.0 and 1.1 read only explicit manifests).
    manifest_columns: str = "auto"
    #: Where shards go (FORMAT.md 5.15, revision 1.3): "packed" (default) writes each process's raw
    #: shards back to back into a few pack objects, at most ``pack_bytes`` each (O(processes)
    #: objects per save); "arrays" writes one object per shard plus each array's zarr.json
    #: (revision 1.2, byte for byte: readers of 1.2 read it, zarr opens each array directly).
    #: zstd shards always take one object each (tensorstore encodes them through the array).
    layout: str = "packed"
    pack_bytes: int = DEFAULT_PACK_BYTES
    #: The host-memory budget of a save on this process (None: none), in bytes: at most this many
    #: bytes of host copies made for the save are held at once (docs/failures.md). A blocking save
    #: reads its sources as it writes them, within a window of a quarter of the budget; an
    #: asynchronous save whose sources exceed the budget copies at the call only what fits in half of
    #: it, and the writer copies the rest from the caller's live arrays while the caller waits. A
    #: single source block larger than a quarter of the budget is still copied whole.
    max_staging_bytes: int | None = None
    #: Pause Python's cyclic garbage collector while the save runs (:mod:`ckptfmt.gcpause`): a
    #: save's many small objects are acyclic, and the full collections they triggered walked every
    #: object of the process. An asynchronous save pauses it from before the caller's stage until
    #: the background save ends, and frees what it staged before resuming it. False leaves the
    #: collector alone.
    pause_gc: bool = True
    #: If given, this rank adds the seconds of each save phase into it ("plan", "stage", "write",
    #: "fsync", "verify", "state", "commit"), for profiles and the bench; never changes the save.
    timings: dict[str, float] | None = None

    @property
    def write_window_bytes(self) -> int:
        """The writer's window of bytes in flight: ``max_inflight_bytes``, within a quarter of
        ``max_staging_bytes`` when there is one."""
        if self.max_staging_bytes is None:
            return self.max_inflight_bytes
        return max(1, min(self.max_inflight_bytes, self.max_staging_bytes // 4))

    def __post_init__(self) -> None:
        b = self.max_staging_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"SaveOptions.max_staging_bytes must be an int >= 1 or None, got {b!r}")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"SaveOptions.reuse must be one of {REUSE_MODES}, got {self.reuse!r}")
        if self.manifest_columns not in MANIFEST_COLUMNS:
            raise ValueError(f"SaveOptions.manifest_columns must be one of {MANIFEST_COLUMNS}, "
                             f"got {self.manifest_columns!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"SaveOptions.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if isinstance(self.pack_bytes, bool) or not isinstance(self.pack_bytes, int) or self.pack_bytes < 1:
            raise ValueError(f"SaveOptions.pack_bytes must be a positive int, got {self.pack_bytes!r}")
        level = self.codec_level
        if self.codec not in CODECS or isinstance(level, bool) or not -7 <= int(level) <= 22:
            raise ValueError(f"SaveOptions.codec must be 'raw' or 'zstd' and codec_level in [-7, 22], got "
                             f"{self.codec!r}, {level!r}")
