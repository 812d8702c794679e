"""A ckptfmt :class:`~ckptfmt.coord.Coordinator` over a torch.distributed process group.

It uses the c10d key-value store of the default process group (``set`` / ``wait`` / ``get``),
never a collective on pickled objects: every payload is opaque bytes, and each value carries a
small msgpack header ``[kind, name, root]`` so that ranks calling different operations fail
with a :class:`CheckpointError` instead of mixing payloads.

Keys are ``<ns>/<seq>/<rank>``: ``ns`` is unique per coordinator (see :func:`for_group`), ``seq``
counts the operations, which every rank calls in the same order (the coordinator contract).
A rank deletes its own key of operation ``seq - 2`` once operation ``seq`` completes: by then
every rank has posted to ``seq - 1`` and so has finished reading ``seq - 2``.

Failure model: a wait past ``timeout_s`` raises :class:`CoordinatorTimeoutError` naming the
missing ranks; a broken store connection raises :class:`CoordinatorLostError`. A peer that dies
while the store server stays up is seen as a timeout. After any error the coordinator is
unusable (further calls raise :class:`CoordinatorLostError`).
"""
from __future__ import annotations

import itertools
import threading
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist

from ckptfmt.coord import as_bytes
from ckptfmt.errors import CheckpointError, CoordinatorLostError, CoordinatorTimeoutError

__all__ = ["TorchCoordinator", "for_group"]

_instances = itertools.count()
_cache: dict[Any, "TorchCoordinator"] = {}
_cache_lock = threading.Lock()


def for_group(group: Any = None, *, timeout_s: float = 300.0) -> "TorchCoordinator":
    """The shared coordinator of ``group`` (default: the default process group).

    Reusing one coordinator per group keeps its operation counter monotonic, so keys never
    collide across saves. Every rank must create coordinators in the same order.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first "
                           "or pass a ckptfmt coordinator explicitly")
    key = id(group) if group is not None else "default"
    with _cache_lock:
        coord = _cache.get(key)
        if coord is None or coord._broken:
            coord = _cache[key] = TorchCoordinator(group, timeout_s=timeout_s)
        return coord


class TorchCoordinator:
    """Barrier / allgather / broadcast for ckptfmt over the c10d store of the default group.

    ``group``: a sub-group; ranks are then the group ranks. The instance namespace is derived
    from a per-process counter, so every rank must construct coordinators in the same order
    (use :func:`for_group` to share one).
    """

    def __init__(self, group: Any = None, *, store: Any = None, timeout_s: float = 300.0,
                 namespace: str | None = None) -> None:
        self._group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._store = store if store is not None else dist.distributed_c10d._get_default_store()
        gname = "default" if group is None else getattr(group, "group_name", str(id(group)))
        self._ns = namespace or f"ckptfmt/coord/{gname}/{next(_instances)}"
        self._timeout_s = float(timeout_s)
        self._seq = 0
        self._broken = False
        self._lock = threading.Lock()

    # -- the Coordinator protocol ------------------------------------------------------------

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        self._exchange("barrier", name, 0, b"", timeout_s, everyone=True)

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        return self._exchange("allgather", name, 0, as_bytes(payload), timeout_s, everyone=True)

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        if not 0 <= root < self.world:
            raise ValueError(f"broadcast root {root} is out of range for world size {self.world}")
        data = as_bytes(payload) if self.rank == root else b""
        return self._exchange("broadcast", name, root, data, timeout_s, everyone=False)[0]

    def close(self) -> None:
        self._broken = True

    # -- implementation ----------------------------------------------------------------------

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._ns}/{seq}/{rank}"

    def _exchange(self, kind: str, name: str, root: int, data: bytes, timeout_s: float | None,
                  *, everyone: bool) -> list[bytes]:
        if not isinstance(name, str) or not name:
            raise TypeError(f"operation name must be a non-empty str, got {name!r}")
        with self._lock:
            if self._broken:
                raise CoordinatorLostError("coordinator is unusable after an earlier error",
                                           object=f"{kind}:{name}")
            seq = self._seq
            self._seq += 1
            try:
                return self._run(seq, kind, name, root, data, timeout_s, everyone)
            except BaseException:
                self._broken = True
                raise

    def _run(self, seq: int, kind: str, name: str, root: int, data: bytes,
             timeout_s: float | None, everyone: bool) -> list[bytes]:
        timeout = self._timeout_s if timeout_s is None else float(timeout_s)
        header = [kind, name, root]
        # Everyone posts (so the header check covers broadcast too); only the root's data matters.
        value = msgpack.packb([header, data], use_bin_type=True)
        self._call(lambda: self._store.set(self._key(seq, self.rank), value), kind, name)
        keys = [self._key(seq, r) for r in range(self.world)]
        try:
            self._store.wait(keys, timedelta(seconds=timeout))
        except Exception as exc:  # c10d raises DistStoreError / RuntimeError on timeout
            missing = self._missing(keys)
            if not missing:  # the store itself is unreachable (or answered inconsistently)
                raise CoordinatorLostError(f"store failed during {kind} {name!r}: {exc}",
                                           object=f"{kind}:{name}") from exc
            raise CoordinatorTimeoutError(
                f"{kind} {name!r} timed out after {timeout:g}s waiting for ranks {missing}",
                object=f"{kind}:{name}", expected=f"{self.world} ranks", found=f"missing {missing}") from exc
        raw = self._call(lambda: self._multi_get(keys), kind, name)
        out: list[bytes] = []
        for r, blob in enumerate(raw):
            try:
                (hk, hn, hr), payload = msgpack.unpackb(blob, raw=False)
            except Exception as exc:
                raise CoordinatorLostError(f"malformed coordinator value from rank {r}",
                                           object=f"{kind}:{name}") from exc
            if (hk, hn, hr) != (kind, name, root):
                raise CheckpointError("ranks called different coordinator operations",
                                      object=f"{kind}:{name}", expected=header,
                                      found=f"rank {r}: {[hk, hn, hr]}")
            out.append(bytes(payload))
        if seq >= 2:
            try:
                self._store.delete_key(self._key(seq - 2, self.rank))
            except Exception:
                pass  # best effort: a leftover key costs memory only
        return out if everyone else [out[root]]

    def _multi_get(self, keys: list[str]) -> list[bytes]:
        getter = getattr(self._store, "multi_get", None)
        if getter is not None:
            return [bytes(v) for v in getter(keys)]
        return [bytes(self._store.get(k)) for k in keys]

    def _missing(self, keys: list[str]) -> list[int] | None:
        try:
            return [r for r, k in enumerate(keys) if not self._store.check([k])]
        except Exception:
            return None

    def _call(self, fn: Any, kind: str, name: str) -> Any:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CoordinatorLostError(f"store failed during {kind} {name!r}: {exc}",
                                       object=f"{kind}:{name}") from exc


