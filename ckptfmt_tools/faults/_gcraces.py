"""Faults of kind ``"gc"`` added by issue 24: retention over a flipped newest step, and a delete
racing an incremental save (FORMAT.md 4.4, 10.3, 10.4). Judged by :func:`_gcfaults.judge`.

The race is forced, not waited for: the save of step 3 (step 2's data, so it references step 2's
objects) runs in a thread and stops right before its commit; ``Repository.delete(2)`` runs on a
storage wrapper that lets the save commit, and drop its lease, at delete's first lease read. The
library is never patched.
"""
from __future__ import annotations

import threading
from typing import Any

from ckptfmt.storage import DelegatingStorage, open_storage
from ckptfmt_tools.faults._gcfaults import GcAttempt, _abandoned, _save_dir
from ckptfmt_tools.faults._scene import Scene, flip

__all__ = ["retention_newest_flipped", "delete_racing_a_save"]

_WAIT_S = 120.0


def retention_newest_flipped(s: Scene) -> GcAttempt:
    lay, p = s.shard_layout(2), s.shard_path(2)
    at = flip(p, lay["chunk0_offset"] + 100, 0, single_bit=True)
    stale = _abandoned(s)
    return GcAttempt(f"gc --keep-last 1 while {s.rel(p)} (the newest step, 2) has one flipped data bit ({at}; "
                     "every size unchanged); an abandoned save", keep_last=1,
                     protected=(_save_dir(s, 1), s.manifest_path(1)), collected=(stale,), prior=1, latest=2)


class _PausedSave:
    """A save of ``step`` with the data of ``data_step``, in a thread, stopped before its commit."""

    class _Storage(DelegatingStorage):
        def __init__(self, inner: Any, key: str) -> None:
            super().__init__(inner)
            self.key, self.reached, self.go = key, threading.Event(), threading.Event()

        def create_if_absent(self, key: str, data: bytes) -> bool:
            if key == self.key:
                self.reached.set()
                self.go.wait(_WAIT_S)
            return super().create_if_absent(key, data)

    def __init__(self, url: str, step: int, seed: int, data_step: int) -> None:
        from ckptfmt import Repository, save
        from ckptfmt.layout import manifest_key
        from ckptfmt_tools.faults import _data

        self.storage = self._Storage(open_storage(url), manifest_key(step))
        self.error: BaseException | None = None

        def run() -> None:
            try:
                save(Repository(url, storage=self.storage), step, _data.local_shards(seed, data_step, 0, 1),
                     state=_data.global_state(seed, data_step))
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not self.storage.reached.wait(_WAIT_S):
            raise RuntimeError("fixture error: the racing save never reached its commit")

    def finish(self) -> None:
        self.storage.go.set()
        self.thread.join(_WAIT_S)
        if self.thread.is_alive() or self.error is not None:
            raise RuntimeError(f"fixture error: the racing save did not commit: {self.error!r}")


class _AtFirstLeaseRead(DelegatingStorage):
    """Runs ``fn`` once, right before the first listing of ``saves/`` (a collector's lease read)."""

    def __init__(self, inner: Any, fn: Any) -> None:
        super().__init__(inner)
        self.fn: Any = fn

    def scan_children(self, prefix: str, **kw: Any) -> Any:
        if prefix == "saves/" and self.fn is not None:
            fn, self.fn = self.fn, None
            fn()
        return super().scan_children(prefix, **kw)


def delete_racing_a_save(s: Scene) -> GcAttempt:
    from ckptfmt import Repository

    paused = _PausedSave(s.url, 3, s.seed, 2)
    storage = _AtFirstLeaseRead(open_storage(s.url), paused.finish)

    def operation() -> None:
        Repository(s.url, storage=storage).delete(2)
        if storage.fn is not None:
            raise RuntimeError("fixture error: delete never read the leases")

    return GcAttempt("Repository.delete(2) while a save of step 3 that pinned step 2 (and references its "
                     "objects) commits and drops its lease between delete's checks", operation=operation,
                     prior=3, prior_data=2, latest=3)
