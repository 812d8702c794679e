"""Storage: tensorstore I/O only. No planning, no format rules.

One :class:`Storage` wraps a tensorstore kvstore opened from a repository URL, plus the
zarr v3 array specs used to write tensors. Every call either returns or raises
StorageError (a CheckpointError) naming the object. On the file driver, deletes of a prefix and
the walks that judge ages go through :mod:`ckptfmt._localfs` instead, which never follows a
symbolic link (tensorstore's ``delete_range`` does).
"""
from __future__ import annotations

import functools
import os
import stat
from typing import Any, Iterable, Mapping, Sequence

import tensorstore as ts

from . import _localfs
from ._kvurl import kvstore_spec
from .errors import MissingShardError, SizeMismatchError, StorageError

__all__ = ["Storage", "NO_VALUE"]

NO_VALUE = b"\x02"  # tensorstore's StorageGeneration::NoValue(): "write only if absent"


@functools.lru_cache(maxsize=None)
def _memory_context(name: str) -> ts.Context:
    # memory:// repositories of one name share their bytes within this process.
    return ts.Context()


def _context(spec: Mapping[str, Any], options: Mapping[str, Any]) -> ts.Context:
    if spec.get("driver") == "memory":
        return _memory_context(spec.get("path", ""))
    cfg: dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0},
                           "file_io_concurrency": {"limit": int(options.get("io_concurrency", 32))},
                           "data_copy_concurrency": {"limit": int(options.get("copy_concurrency", 8))}}
    if spec.get("driver") == "file":
        cfg["file_io_sync"] = bool(options.get("fsync", True))
    return ts.Context(cfg)


def _probe(fut: Any) -> str:
    """What a one-byte range read found: "value", "missing", "out_of_range", or the error text."""
    try:
        r = fut.result()
    except Exception as e:
        return "out_of_range" if "OUT_OF_RANGE" in str(e) else str(e)[:120]
    return "value" if r.state == "value" else "missing"


class Storage:
    """A repository's kvstore. Keys are relative to the repository root."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.options = dict(options or {})
        self.spec = kvstore_spec(url, self.options.get("kvstore"))
        self.context = _context(self.spec, self.options)
        try:
            self.kv = ts.KvStore.open(self.spec, context=self.context).result()
        except Exception as e:  # tensorstore raises plain exceptions
            raise StorageError("cannot open repository", object=url, found=str(e)[:300]) from None

    # ------------------------------------------------------------------ whole objects
    def read(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object's bytes, or None when it is absent. With ``max_bytes``, at most
        ``max_bytes + 1`` bytes are read, so a caller can reject an oversized object cheaply.
        StorageError for a special file (FIFO, device) at the key, found without opening it."""
        self._refuse_special(key)
        try:
            r = None
            if max_bytes is not None:
                try:
                    r = self.kv.read(key, byte_range=slice(0, max_bytes + 1)).result()
                except ValueError as e:
                    if "OUT_OF_RANGE" not in str(e):
                        raise
                    # shorter than max_bytes + 1: a whole read is bounded
            if r is None:
                r = self.kv.read(key).result()
        except Exception as e:
            raise StorageError("read failed", object=key, found=str(e)[:300]) from None
        return r.value if r.state == "value" else None

    def read_upto(self, key: str, start: int, n: int) -> bytes | None:
        """At most ``n`` bytes of the object from ``start`` (fewer at its end), or None when it is
        absent. Never reads more than ``n`` bytes of a write-once object."""
        try:
            try:
                r = self.kv.read(key, byte_range=slice(start, start + n)).result()
            except ValueError as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
                try:  # the object ends before start + n: the rest is shorter than n
                    r = self.kv.read(key, byte_range=slice(start, None)).result()
                except ValueError as e2:
                    if "OUT_OF_RANGE" not in str(e2):
                        raise
                    return b""  # it ends before start
        except Exception as e:
            raise StorageError("read failed", object=key, found=str(e)[:300]) from None
        return r.value if r.state == "value" else None

    def larger_than(self, key: str, limit: int) -> bool | None:
        """Whether the object holds more than ``limit`` bytes (None when absent), reading one byte."""
        self._refuse_special(key)
        try:
            r = self.kv.read(key, byte_range=slice(limit, limit + 1)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" in str(e):
                return False
            raise StorageError("read failed", object=key, found=str(e)[:300]) from None
        except Exception as e:
            raise StorageError("read failed", object=key, found=str(e)[:300]) from None
        return True if r.state == "value" else None

    def read_range_future(self, key: str, start: int, stop: int | None) -> Any:
        return self.kv.read(key, byte_range=slice(start, stop))

    # ------------------------------------------------------------------ objects a manifest names
    # A reader reads at most nbytes + 1 bytes of an object whose manifest says nbytes (FORMAT.md 9,
    # step 4): the ranges it reads end at or before nbytes, and the size is checked apart from them.
    def local_size(self, key: str, *, tensor: str | None = None) -> int | None:
        """File driver: the object's length from ``stat``, without opening it (opening a FIFO blocks
        until a writer appears; a device never ends). MissingShardError when absent, StorageError
        when it is not a regular file. None on other stores, whose objects are plain byte strings."""
        if self.spec.get("driver") != "file":
            return None
        try:
            st = os.stat(self.spec["path"] + key)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing") from None
        except OSError as e:
            raise StorageError("stat failed", key=tensor, object=key, found=str(e)[:300]) from None
        _require_regular(st.st_mode, key, tensor)
        return st.st_size

    def start_size_check(self, key: str, nbytes: int, *, tensor: str | None = None) -> Any:
        """Begin checking that ``key`` holds exactly ``nbytes`` bytes, reading at most one byte.

        File driver: ``stat`` decides at once (SizeMismatchError, MissingShardError or StorageError
        raised here) and None is returned. Elsewhere: the future of a read of ``[nbytes, nbytes + 1)``,
        which must fail as out of range; pass it to :meth:`finish_size_check`. A shorter object is
        caught by the caller's own ranges, which end at or before ``nbytes``."""
        size = self.local_size(key, tensor=tensor)
        if size is None:
            return self.kv.read(key, byte_range=slice(nbytes, nbytes + 1))
        if size != nbytes:
            raise SizeMismatchError("object size differs from the manifest", key=tensor, object=key,
                                    expected=nbytes, found=size)
        return None

    @staticmethod
    def finish_size_check(probe: Any, key: str, nbytes: int, *, tensor: str | None = None) -> None:
        """Resolve :meth:`start_size_check`: SizeMismatchError when a byte lies at ``nbytes``."""
        if probe is None:
            return
        try:
            r = probe.result()
        except Exception as e:
            msg = str(e)
            if "OUT_OF_RANGE" in msg:
                return  # no byte at nbytes: not longer than recorded
            raise StorageError("read failed", key=tensor, object=key, found=msg[:300]) from None
        if r.state != "value":
            raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing")
        raise SizeMismatchError("object is longer than the manifest records", key=tensor, object=key,
                                expected=nbytes, found=f"more than {nbytes} bytes")

    def _refuse_special(self, key: str) -> None:
        """File driver: StorageError if a FIFO, device, socket or directory sits at ``key``, before
        tensorstore opens it (an absent key is left to the read)."""
        if self.spec.get("driver") != "file":
            return
        try:
            st = os.stat(self.spec["path"] + key)
        except OSError:
            return
        _require_regular(st.st_mode, key, None)

    @staticmethod
    def range_result(fut: Any, key: str, start: int, stop: int | None, *, tensor: str | None = None) -> bytes:
        """Resolve a byte-range read; MissingShardError / SizeMismatchError / StorageError on failure."""
        try:
            r = fut.result()
        except Exception as e:
            msg = str(e)
            if "OUT_OF_RANGE" in msg:
                raise SizeMismatchError("object is shorter than the manifest records", key=tensor, object=key,
                                        expected=f"bytes [{start}, {stop})", found=msg[:200]) from None
            raise StorageError("read failed", key=tensor, object=key, found=msg[:300]) from None
        if r.state != "value":
            raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing")
        return r.value

    def write(self, key: str, data: bytes) -> None:
        try:
            self.kv.write(key, data).result()
        except Exception as e:
            raise StorageError("write failed", object=key, found=str(e)[:300]) from None

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        futs = [(k, self.kv.write(k, v)) for k, v in items]
        for k, f in futs:
            try:
                f.result()
            except Exception as e:
                raise StorageError("write failed", object=k, found=str(e)[:300]) from None

    def write_if(self, key: str, data: bytes | None, if_equal: bytes) -> bytes:
        """Write (or, with None, delete) ``key`` only if its generation is ``if_equal``
        (NO_VALUE: only if absent). Returns the new generation, or b"" when the condition failed."""
        try:
            return bytes(self.kv.write(key, data, if_equal=if_equal).result().generation)
        except Exception as e:
            raise StorageError("conditional write failed", object=key, found=str(e)[:300]) from None

    def read_with_generation(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        """(value or None, generation) of each key, read concurrently."""
        for k in keys:
            self._refuse_special(k)
        futs = [self.kv.read(k) for k in keys]
        out: list[tuple[bytes | None, bytes]] = []
        for k, f in zip(keys, futs):
            try:
                r = f.result()
            except Exception as e:
                raise StorageError("read failed", object=k, found=str(e)[:300]) from None
            out.append((r.value if r.state == "value" else None, bytes(r.stamp.generation)))
        return out

    def read_each_with_generation(self, keys: Sequence[str], max_bytes: int) -> list[tuple[bytes | None, bytes] | StorageError]:
        """(value or None, generation) of each key, read concurrently and each bounded: a value
        holds at most ``max_bytes + 1`` bytes. A key that cannot be read gets its StorageError
        in its place, so one bad object does not hide the others."""
        futs = [self.kv.read(k, byte_range=slice(0, max_bytes + 1)) for k in keys]
        out: list[tuple[bytes | None, bytes] | StorageError] = []
        for k, f in zip(keys, futs):
            try:
                try:
                    r = f.result()
                except ValueError as e:
                    if "OUT_OF_RANGE" not in str(e):
                        raise
                    r = self.kv.read(k).result()  # shorter than the bound: a whole read is bounded
                out.append((r.value if r.state == "value" else None, bytes(r.stamp.generation)))
            except Exception as e:
                out.append(StorageError("read failed", object=k, found=str(e)[:300]))
        return out

    def size_faults(self, objects: Sequence[tuple[str, int]], *, batch: int = 4096) -> list[str]:
        """Each object of ``(key, nbytes)`` that is missing, not a plain file, or not exactly
        ``nbytes`` long, described in a few words (at most the first 8). File driver: ``stat``;
        other stores: two one-byte range reads per object, never reading more."""
        faults: list[str] = []
        if self.file_root is not None:
            for key, n in objects:
                try:
                    st = os.stat(self.file_root + key)
                except OSError as e:
                    faults.append(f"{key}: {e.strerror or 'missing'}")
                else:
                    if not stat.S_ISREG(st.st_mode) or st.st_size != n:
                        faults.append(f"{key}: {st.st_size if stat.S_ISREG(st.st_mode) else 'not a file'} bytes, expected {n}")
                if len(faults) >= 8:
                    break
            return faults
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

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Atomically create ``key``; False if it already exists (the commit primitive)."""
        try:
            r = self.kv.write(key, data, if_equal=NO_VALUE).result()
        except Exception as e:
            raise StorageError("conditional write failed", object=key, found=str(e)[:300]) from None
        return bool(r.generation)

    def delete(self, key: str) -> None:
        try:
            self.kv.write(key, None).result()
        except Exception as e:
            raise StorageError("delete failed", object=key, found=str(e)[:300]) from None

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose key starts with ``prefix`` (which must end with "/").

        On the file driver nothing is followed through a symbolic link: a link is removed
        itself (tensorstore's ``delete_range`` would empty the directory it points to)."""
        if not prefix.endswith("/") or prefix == "/":
            raise StorageError("refusing to delete a prefix that is not a folder", object=prefix,
                               expected="a prefix ending with '/'", found=prefix)
        if self.file_root is not None:
            try:
                _localfs.remove_tree(self.file_root, prefix)
            except OSError as e:
                raise StorageError("delete failed", object=prefix, found=f"{type(e).__name__}: {e}") from None
            return
        try:
            self.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord("/") + 1))).result()
        except Exception as e:
            raise StorageError("delete failed", object=prefix, found=str(e)[:300]) from None

    @property
    def file_root(self) -> str | None:
        """The directory of a file-driver repository (ends with "/"), or None for other kvstores."""
        return self.spec["path"] if self.spec.get("driver") == "file" else None

    def scan_children(self, prefix: str) -> list[_localfs.Entry]:
        """Every name directly under ``prefix`` (which ends with "/"), each judged without
        following links. File driver: from ``lstat`` (lock files of killed writes included, which
        the kvstore listing hides). Other stores: from the listing, with no modification times.
        Raises StorageError when the prefix cannot be listed, or is itself a link."""
        if self.file_root is not None:
            try:
                return _localfs.scan_children(self.file_root, prefix)
            except FileNotFoundError:
                return []
            except OSError as e:
                raise StorageError("cannot list without following a link", object=prefix,
                                   expected="a directory", found=f"{type(e).__name__}: {e.strerror or e}") from None
        counts: dict[str, int] = {}
        plain: set[str] = set()
        leases: set[str] = set()
        for k in self.list(prefix):
            name, sep, rest = k[len(prefix):].partition("/")
            if sep:
                counts[name] = counts.get(name, 0) + 1
                if rest == "LEASE":
                    leases.add(name)
            else:
                plain.add(name)
        out = [_localfs.Entry(n, "dir", c, None, "file" if n in leases else None) for n, c in counts.items()]
        out += [_localfs.Entry(n, "file") for n in plain if n not in counts]
        return sorted(out, key=lambda e: e.name)

    def plain_dir(self, prefix: str) -> bool:
        """False when ``prefix`` (or a folder on its way) is a symbolic link or not a folder (file
        driver); True otherwise, also when absent and on stores without links."""
        if self.file_root is None:
            return True
        return _localfs.plain_dir(self.file_root, prefix) is not False

    def remove_stale_locks(self, prefix: str, older_than_unix: float) -> int:
        """File driver: delete ".__lock" files under ``prefix`` last modified before the cutoff
        (left by writes or deletes that were killed midway; the listing hides them), judged with
        ``lstat`` and never through a link. Returns the count."""
        if self.file_root is None or _localfs.plain_dir(self.file_root, prefix) is not True:
            return 0
        removed = 0
        try:
            for path, st in _localfs.walk(self.file_root + prefix):
                if path.endswith(".__lock") and stat.S_ISREG(st.st_mode) and st.st_mtime < older_than_unix:
                    try:
                        os.unlink(path)
                        removed += 1
                    except OSError:
                        pass
        except OSError:
            pass  # a directory that cannot be listed: nothing more to tidy here
        return removed

    def list(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix``, sorted."""
        try:
            if prefix:
                end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
                keys = self.kv.list(ts.KvStore.KeyRange(prefix, end)).result()
            else:
                keys = self.kv.list().result()
        except Exception as e:
            raise StorageError("list failed", object=prefix or "/", found=str(e)[:300]) from None
        return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

    # ------------------------------------------------------------------ local fast path
    @property
    def local_root(self) -> str | None:
        """The directory of a file-driver repository (positional reads go straight into the
        caller's buffers, without an intermediate copy), or None for other kvstores."""
        if self.spec.get("driver") != "file" or not self.options.get("positional_reads", True):
            return None
        return self.spec["path"]

    def open_local(self, key: str, *, tensor: str | None = None) -> tuple[int, int]:
        """(fd, size) of a local object; MissingShardError if absent, StorageError if it is not a
        regular file (opened without blocking, then checked). The caller closes fd."""
        assert self.local_root is not None
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
            fd = os.open(self.local_root + key, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing") from None
        except OSError as e:
            raise StorageError("open failed", key=tensor, object=key, found=str(e)) from None
        try:
            st = os.fstat(fd)
            _require_regular(st.st_mode, key, tensor)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    @staticmethod
    def pread_into(fd: int, buffers: list[Any], offset: int, *, key: str, tensor: str | None = None) -> None:
        """Fill ``buffers`` from ``offset``; SizeMismatchError if the object ends early.

        Loops over short reads (Linux moves at most ~2 GiB per call), resuming inside the
        buffer where the last call stopped."""
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        want = sum(v.nbytes for v in views)
        got = 0
        while views:
            try:
                n = os.preadv(fd, views, offset + got)
            except OSError as e:
                raise StorageError("read failed", key=tensor, object=key, found=str(e)) from None
            if n == 0:
                raise SizeMismatchError("object is shorter than the manifest records", key=tensor, object=key,
                                        expected=f"bytes [{offset}, {offset + want})", found=f"{got} bytes")
            got += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    # ------------------------------------------------------------------ zarr arrays
    def array_spec(self, path: str, shape: Sequence[int], dtype: str, shard_shape: Sequence[int],
                   chunk_shape: Sequence[int]) -> dict[str, Any]:
        """The tensorstore zarr3 spec of one tensor's array (sharding_indexed, crc32c, no compression)."""
        kv = dict(self.spec)
        kv["path"] = self.spec.get("path", "") + path + "/"
        bytes_codec = {"name": "bytes", "configuration": {"endian": "little"}} if dtype not in ("bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2") else {"name": "bytes"}
        return {
            "driver": "zarr3", "kvstore": kv,
            "metadata": {
                "shape": list(shape), "data_type": dtype, "fill_value": False if dtype == "bool" else [0.0, 0.0] if dtype.startswith("complex") else 0,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": list(chunk_shape),
                    "codecs": [bytes_codec, {"name": "crc32c"}],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end"}}],
            },
        }

    def open_array(self, spec: Mapping[str, Any], *, create: bool) -> Any:
        """Future of an open zarr3 TensorStore. ``create`` writes zarr.json; otherwise metadata is assumed."""
        kwargs: dict[str, Any] = {"context": self.context}
        if create:
            kwargs.update(create=True)
        else:
            kwargs.update(open=True, assume_metadata=True)
        return ts.open(dict(spec, store_data_equal_to_fill_value=True), **kwargs)


def _require_regular(mode: int, key: str, tensor: str | None) -> None:
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(mode), "not a regular file")
        raise StorageError("object is not a regular file", key=tensor, object=key, expected="a regular file",
                           found=kind)
