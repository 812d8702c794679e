"""The generic backend: any tensorstore kvstore (S3, GCS; memory with a shared context).

tensorstore raises plain exceptions whose text carries an absl status code and, for file I/O, the
errno. They are classified in :mod:`ckptfmt.storage._kverrors` (:func:`classify`, :func:`kv_errors`) and
nowhere else: on a ranged read OUT_OF_RANGE (a byte range past the object's end) becomes
:class:`OutOfRange`, which those callers catch; everything else becomes a StorageError whose
message says what kind of failure it was (disk full, file too large, permission denied, not found).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Iterable, Mapping, Sequence

import tensorstore as ts

from ckptfmt.storage._localfs import Entry
from ckptfmt.storage._kverrors import OutOfRange as OutOfRange
from ckptfmt.storage._kverrors import classify as classify
from ckptfmt.storage._kverrors import kv_errors as kv_errors
from ckptfmt.storage._kverrors import storage_error as storage_error
from ckptfmt.errors import MissingShardError, SizeMismatchError, StorageError
from ckptfmt.storage import NO_VALUE, Pending, Storage, StorageOptions

__all__ = ["KvStoreStorage", "MemoryStorage", "OutOfRange", "classify", "kv_errors", "zarr_json"]


def _value(r: Any) -> bytes | None:
    return r.value if r.state == "value" else None


class KvStoreStorage(Storage):
    """A repository on a tensorstore kvstore. ``spec`` is its kvstore spec (from the URL);
    ``options`` were checked by :func:`ckptfmt.storage.open_storage`."""

    def __init__(self, url: str, options: StorageOptions, spec: dict[str, Any]) -> None:
        self.url = url
        self.options = options
        self.spec = spec
        self.context = self._make_context()
        with kv_errors("cannot open repository", object=url):
            self.kv = ts.KvStore.open(self.spec, context=self.context).result()

    def _context_config(self) -> dict[str, Any]:
        return {"cache_pool": {"total_bytes_limit": 0},
                "file_io_concurrency": {"limit": self.options.io_concurrency},
                "data_copy_concurrency": {"limit": self.options.copy_concurrency}}

    def _make_context(self) -> ts.Context:
        return ts.Context(self._context_config())

    # ------------------------------------------------------------------ whole objects
    def read(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        with kv_errors("read failed", object=key):
            if max_bytes is not None:
                try:
                    return _value(self.kv.read(key, byte_range=slice(0, max_bytes + 1)).result())
                except Exception as e:
                    if classify(e) != "out_of_range":
                        raise
                    # shorter than max_bytes + 1: a whole read is bounded
            return _value(self.kv.read(key).result())

    def read_upto(self, key: str, start: int, n: int) -> bytes | None:
        try:
            with kv_errors("read failed", object=key, ranged=True):
                return _value(self.kv.read(key, byte_range=slice(start, start + n)).result())
        except OutOfRange:
            pass
        try:  # the object ends before start + n: the rest is shorter than n
            with kv_errors("read failed", object=key, ranged=True):
                return _value(self.kv.read(key, byte_range=slice(start, None)).result())
        except OutOfRange:
            return b""  # it ends before start

    def larger_than(self, key: str, limit: int) -> bool | None:
        try:
            with kv_errors("read failed", object=key, ranged=True):
                r = self.kv.read(key, byte_range=slice(limit, limit + 1)).result()
        except OutOfRange:
            return False
        return True if r.state == "value" else None

    def read_with_generation(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        futs = [self.kv.read(k) for k in keys]
        out: list[tuple[bytes | None, bytes]] = []
        for k, f in zip(keys, futs):
            with kv_errors("read failed", object=k):
                r = f.result()
            out.append((_value(r), bytes(r.stamp.generation)))
        return out

    def read_each_with_generation(self, keys: Sequence[str],
                                  max_bytes: int) -> list[tuple[bytes | None, bytes] | StorageError]:
        futs = [self.kv.read(k, byte_range=slice(0, max_bytes + 1)) for k in keys]
        out: list[tuple[bytes | None, bytes] | StorageError] = []
        for k, f in zip(keys, futs):
            try:
                try:
                    with kv_errors("read failed", object=k, ranged=True):
                        r = f.result()
                except OutOfRange:  # shorter than the bound: a whole read is bounded
                    with kv_errors("read failed", object=k):
                        r = self.kv.read(k).result()
                out.append((_value(r), bytes(r.stamp.generation)))
            except StorageError as e:
                out.append(e)
        return out

    # ------------------------------------------------------------------ objects a manifest names
    def read_range(self, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> Pending[bytes]:
        fut = self.kv.read(key, byte_range=slice(start, stop))

        def finish() -> bytes:
            try:
                with kv_errors("read failed", object=key, key=tensor, ranged=True):
                    r = fut.result()
            except OutOfRange as e:
                raise SizeMismatchError("object is shorter than the manifest records", key=tensor, object=key,
                                        expected=f"bytes [{start}, {stop})", found=str(e.found)[:200]) from None
            if r.state != "value":
                raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing")
            return r.value
        return Pending(finish)

    def size_check(self, key: str, nbytes: int, *, tensor: str | None = None) -> Pending[None]:
        fut = self.kv.read(key, byte_range=slice(nbytes, nbytes + 1))

        def finish() -> None:
            try:
                with kv_errors("read failed", object=key, key=tensor, ranged=True):
                    r = fut.result()
            except OutOfRange:
                return  # no byte at nbytes: not longer than recorded
            if r.state != "value":
                raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing")
            raise SizeMismatchError("object is longer than the manifest records", key=tensor, object=key,
                                    expected=nbytes, found=f"more than {nbytes} bytes")
        return Pending(finish)

    def size_faults(self, objects: Sequence[tuple[str, int]], *, batch: int = 4096) -> list[str]:
        """Two one-byte range reads per object: the last byte must exist, the next must not."""
        faults: list[str] = []
        for i in range(0, len(objects), batch):
            part = objects[i:i + batch]
            futs = [(k, n, self.kv.read(k, byte_range=slice(n - 1, n)) if n else None,
                     self.kv.read(k, byte_range=slice(n, n + 1))) for k, n in part]
            for key, n, last, past in futs:
                got = _probe(last) if last is not None else "value"
                if got == "value":  # exactly n bytes: then a byte at offset n is out of range
                    got = _probe(past)
                    got = "ok" if got == "out_of_range" else f"longer than {n} bytes" if got == "value" else got
                elif got == "out_of_range":
                    got = f"shorter than {n} bytes"
                if got != "ok":
                    faults.append(f"{key}: {got}")
                if len(faults) >= 8:
                    return faults
        return faults

    def stamps(self, objects: Sequence[tuple[str, int]], *, batch: int = 4096) -> list[str] | None:
        """The storage generation (an S3 ETag, a memory counter) from a one-byte read of each
        object's last byte, with its size; None when one is missing or shorter."""
        out: list[str] = []
        for i in range(0, len(objects), batch):
            part = objects[i:i + batch]
            futs = [self.kv.read(k, byte_range=slice(n - 1, n)) if n else self.kv.read(k) for k, n in part]
            for (k, n), f in zip(part, futs):
                try:
                    r = f.result()
                except Exception:  # noqa: BLE001 - out of range, unreadable: no stamp, never trusted
                    return None
                if r.state != "value":
                    return None
                out.append(f"{n}:{bytes(r.stamp.generation).hex()}")
        return out

    # ------------------------------------------------------------------ writes
    def write(self, key: str, data: bytes) -> None:
        with kv_errors("write failed", object=key):
            self.kv.write(key, data).result()

    def write_object(self, key: str, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
        data = b"".join(buffers)
        with kv_errors("write failed", key=tensor, object=key):
            self.kv.write(key, data).result()
        return len(data)

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        futs = [(k, self.kv.write(k, v)) for k, v in items]
        for k, f in futs:
            with kv_errors("write failed", object=k):
                f.result()

    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        with kv_errors("conditional write failed", object=key):
            return bytes(self.kv.write(key, data, if_equal=if_equal).result().generation)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        with kv_errors("conditional write failed", object=key):
            return bool(self.kv.write(key, data, if_equal=NO_VALUE).result().generation)

    def delete(self, key: str) -> None:
        with kv_errors("delete failed", object=key):
            self.kv.write(key, None).result()

    def delete_prefix(self, prefix: str) -> None:
        _check_folder_prefix(prefix)
        with kv_errors("delete failed", object=prefix):
            self.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord("/") + 1))).result()

    # ------------------------------------------------------------------ listing
    def list(self, prefix: str = "") -> list[str]:
        with kv_errors("list failed", object=prefix or "/"):
            if prefix:
                end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
                keys = self.kv.list(ts.KvStore.KeyRange(prefix, end)).result()
            else:
                keys = self.kv.list().result()
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    def scan_children(self, prefix: str, *, marker: str | None = None, deep: bool = True) -> list[Entry]:
        """From the listing (``deep`` changes nothing: one listing finds the markers): no links
        here, and no modification times."""
        counts: dict[str, int] = {}
        plain: set[str] = set()
        marked: set[str] = set()
        for k in self.list(prefix):
            name, sep, rest = k[len(prefix):].partition("/")
            if sep:
                counts[name] = counts.get(name, 0) + 1
                if marker is not None and rest == marker:
                    marked.add(name)
            else:
                plain.add(name)
        out = [Entry(n, "dir", c, None, "file" if n in marked else None) for n, c in counts.items()]
        out += [Entry(n, "file") for n in plain if n not in counts]
        return sorted(out, key=lambda e: e.name)

    def plain_dir(self, prefix: str) -> bool:
        return True  # object stores have no links and no folders to replace by one

    def remove_stale_locks(self, prefix: str, older_than_unix: float) -> int:
        return 0  # only the file driver leaves lock files behind

    # ------------------------------------------------------------------ zarr arrays
    def open_array(self, path: str, metadata: Mapping[str, Any], *, create: bool) -> Any:
        kv = dict(self.spec, path=self.spec.get("path", "") + path + "/")
        spec = {"driver": "zarr3", "kvstore": kv, "metadata": dict(metadata), "store_data_equal_to_fill_value": True}
        kwargs: dict[str, Any] = {"context": self.context}
        kwargs.update({"create": True} if create else {"open": True, "assume_metadata": True})
        return ts.open(spec, **kwargs)


def zarr_json(metadata: Mapping[str, Any]) -> bytes:
    """The ``zarr.json`` bytes tensorstore's zarr3 driver writes when it creates an array of
    ``metadata`` (FORMAT.md 14.2, revision 1.2.6): the array is created in an in-memory kvstore and
    its ``zarr.json`` copied. Kept for the last 1024 distinct metadata (a training job saves the
    same arrays every time). Raises tensorstore's error for metadata it does not take."""
    return _zarr_json(json.dumps(metadata, sort_keys=True))


@functools.lru_cache(maxsize=1024)
def _zarr_json(metadata: str) -> bytes:
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": json.loads(metadata)},
                    create=True).result()
    return bytes(array.kvstore.read("zarr.json").result().value)


@functools.lru_cache(maxsize=None)
def _memory_context(name: str) -> ts.Context:
    return ts.Context()


class MemoryStorage(KvStoreStorage):
    """``memory://name``: repositories of one name share their bytes within this process."""

    def _make_context(self) -> ts.Context:
        return _memory_context(self.spec.get("path", ""))


def _probe(fut: Any) -> str:
    """What a one-byte range read found: "value", "missing", "out_of_range", or the error text."""
    try:
        r = fut.result()
    except Exception as e:
        return "out_of_range" if classify(e) == "out_of_range" else str(e)[:120]
    return "value" if r.state == "value" else "missing"


def _check_folder_prefix(prefix: str) -> None:
    if not prefix.endswith("/") or prefix == "/":
        raise StorageError("refusing to delete a prefix that is not a folder", object=prefix,
                           expected="a prefix ending with '/'", found=prefix)
