"""The local-file backend: tensorstore's file kvstore, plus what only a file system has.

- Sizes come from ``stat``, without opening an object (opening a FIFO blocks until a writer
  appears; a device never ends), and a FIFO, device, socket or directory at a key is refused
  before tensorstore opens it.
- Positional vectored reads (``preadv``) straight into the caller's buffers (option
  ``positional_reads``, default True; False reads through the kvstore as every other store does).
- Whole-object writes (:meth:`LocalFileStorage.write_object`) with ``pwritev`` straight from the
  caller's buffers (a save's source arrays), checked by size and renamed into place
  (:mod:`ckptfmt.storage._durable`), then made durable by :meth:`LocalFileStorage.sync`. Option
  ``sync_mode``: "syncfs" (the default on Linux) writes each object's data back with
  ``sync_file_range`` and ``sync`` makes everything durable with one ``syncfs``, on a descriptor
  opened before the first of those writes (one device cache flush, where an ``fsync`` per object
  and per directory cost one each); "fsync" ``fsync``s each object, and ``sync`` every directory
  they were renamed into. Option ``fsync``, default True: False skips all of it.
- Deletes of a prefix and the walks that judge ages go through :mod:`ckptfmt.storage._localfs`, which
  never follows a symbolic link (tensorstore's ``delete_range`` does).
- Lock files (``<key>.__lock``) left by writes that were killed midway are removed once stale.
- A reader never leaves the repository: :meth:`LocalFileStorage.check_no_links` refuses an object
  that is, or lies below, a symbolic link (FORMAT.md 4.2, 9 step 4), judged with ``lstat``.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
import sys
import threading
from typing import Any, Iterable, Sequence

from ckptfmt.storage import _directread, _durable, _localfs
from ckptfmt.storage._kvstore import KvStoreStorage, _check_folder_prefix
from ckptfmt.errors import MissingShardError, SizeMismatchError, StorageError
from ckptfmt.storage import PackWriter, Pending, PositionalFile, StorageOptions
from ckptfmt.storage._kverrors import storage_error

__all__ = ["LocalFileStorage"]

#: preadv2's flag for reads whose new page-cache pages are dropped once copied (Linux 6.14).
_RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)


class LocalFileStorage(KvStoreStorage):
    """A repository in a local directory (``root`` ends with "/")."""

    def __init__(self, url: str, options: StorageOptions, spec: dict[str, Any]) -> None:
        super().__init__(url, options, spec)
        self._dirs: set[str] = set()  # renamed into by write_object since the last sync of their prefix
        self._dirs_lock = threading.Lock()
        mode = options.sync_mode or ("syncfs" if _durable.filesystem_sync_available() else "fsync")
        if mode == "syncfs" and not _durable.filesystem_sync_available():  # known (checked), not here
            raise StorageError("storage option sync_mode 'syncfs' is unavailable on this platform", object=url,
                               expected="'fsync', or 'syncfs' on Linux", found=repr(mode))
        self._syncfs = mode == "syncfs"
        # syncfs: opened before the first write since the last sync, so that its syncfs reports a
        # write-back error of the file system from then on; a failed syncfs fails every sync
        # whose directories were pending when it ran (they shared its descriptor).
        self._sync_fd = -1
        self._sync_failed: tuple[set[str], StorageError] | None = None
        self._sync_dev = -1
        self._writing = 0  # write_object calls between opening the descriptor and recording their directory
        self._other_fs_dirs: set[str] = set()  # written into on another file system: fsync'd as in "fsync"

    @property
    def root(self) -> str:
        return self.spec["path"]

    def _context_config(self) -> dict[str, Any]:
        return dict(super()._context_config(), file_io_sync=self.options.fsync)

    # ------------------------------------------------------------------ special files
    def _stat(self, key: str, tensor: str | None) -> os.stat_result:
        """``stat`` of an object: MissingShardError when absent, StorageError when unreadable."""
        try:
            return os.stat(self.root + key)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError("object is missing", key=tensor, object=key, expected="present", found="missing") from None
        except OSError as e:
            raise StorageError("stat failed", key=tensor, object=key, found=str(e)[:300]) from None

    def _refuse_special(self, key: str) -> None:
        """StorageError if a FIFO, device, socket or directory sits at ``key``, before tensorstore
        opens it (an absent key is left to the read)."""
        try:
            st = os.stat(self.root + key)
        except OSError:
            return
        _require_regular(st.st_mode, key, None)

    def read(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """As every store's, with one buffer: ``os.read`` of at most ``max_bytes + 1`` bytes into
        the returned object, so an object at a size cap costs that cap in memory once (a kvstore
        read holds tensorstore's buffer and the Python copy: about 3x the object at its peak)."""
        self._refuse_special(key)  # by stat, before opening (opening a FIFO or a device has effects)
        fd = self._open_object(key, None, missing=None)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            _require_regular(st.st_mode, key, None)
            want = st.st_size if max_bytes is None else min(st.st_size, max_bytes + 1)
            pieces = [os.read(fd, want)]
            got = len(pieces[0])
            while got < want and (piece := os.read(fd, want - got)):  # a short read of a large file
                pieces.append(piece)
                got += len(piece)
            while max_bytes is None or got <= max_bytes:  # the file grew since fstat: read to its end or past the cap
                piece = os.read(fd, 1 << 20 if max_bytes is None else max_bytes + 1 - got)
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
        except OSError as e:
            raise StorageError("read failed", object=key, found=str(e)[:300]) from None
        finally:
            os.close(fd)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def list(self, prefix: str = "") -> list[str]:
        """As every store's, except that a folder prefix (``manifests/``) that is, or lies below, a
        symbolic link is refused with StorageError before anything is listed (FORMAT.md 4.2, 9 step
        1): discovery does not leave the repository, as no read does."""
        if "/" in prefix:
            bad = _localfs.link_on_path(self.root, prefix[:prefix.rfind("/") + 1], set())
            if bad is not None:
                raise StorageError("cannot list below a symbolic link; a reader does not leave the repository",
                                   object=prefix, expected=f"{bad} a directory", found=f"{bad} a symbolic link")
        return super().list(prefix)

    def larger_than(self, key: str, limit: int) -> bool | None:
        self._refuse_special(key)
        return super().larger_than(key, limit)

    def read_with_generation(self, keys: Sequence[str]) -> list[tuple[bytes | None, bytes]]:
        for k in keys:
            self._refuse_special(k)
        return super().read_with_generation(keys)

    # ------------------------------------------------------------------ objects a manifest names
    def check_no_links(self, key: str, checked: set[str], *, tensor: str | None = None) -> None:
        bad = _localfs.link_on_path(self.root, key, checked)
        if bad is None:
            return
        if bad == key:
            raise StorageError("object is a symbolic link; a reader does not leave the repository", key=tensor,
                               object=key, expected="a regular file", found="a symbolic link")
        raise StorageError("object lies below a symbolic link; a reader does not leave the repository", key=tensor,
                           object=key, expected=f"{bad} a directory", found=f"{bad} a symbolic link")

    def _open_object(self, key: str, tensor: str | None, *, missing: type[MissingShardError] | None) -> int | None:
        """A read-only, non-blocking fd of ``key`` opened without following a link below the root
        (:func:`_localfs.open_beneath`: FORMAT.md 9 step 4, so a link swapped in after
        :meth:`check_no_links` is refused by the open itself). An absent object: None, or
        ``missing`` raised. StorageError naming the link, or when the open fails."""
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
            return _localfs.open_beneath(self.root, key, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise StorageError("open failed", key=tensor, object=key, found=str(e)[:300]) from None
            self.check_no_links(key, set(), tensor=tensor)  # names the link, as the lstat check does
            if e.errno == errno.ELOOP:  # the link is gone again: still not a plain file
                raise StorageError("object is a symbolic link; a reader does not leave the repository", key=tensor,
                                   object=key, expected="a regular file", found="a symbolic link") from None
        if missing is None:  # absent, or a file where a directory on the way should be
            return None
        raise missing("object is missing", key=tensor, object=key, expected="present", found="missing")

    def size_check(self, key: str, nbytes: int, *, tensor: str | None = None) -> Pending[None]:
        """Decided at once from ``stat``: raises here, never from the result."""
        st = self._stat(key, tensor)
        _require_regular(st.st_mode, key, tensor)
        if st.st_size != nbytes:
            raise SizeMismatchError("object size differs from the manifest", key=tensor, object=key,
                                    expected=nbytes, found=st.st_size)
        return Pending.done(None)

    def size_faults(self, objects: Sequence[tuple[str, int]], *, batch: int = 4096) -> list[str]:
        faults: list[str] = []
        for key, n in objects:
            try:
                st = os.stat(self.root + key)
            except OSError as e:
                faults.append(f"{key}: {e.strerror or 'missing'}")
            else:
                if not stat.S_ISREG(st.st_mode) or st.st_size != n:
                    faults.append(f"{key}: {st.st_size if stat.S_ISREG(st.st_mode) else 'not a file'} bytes, expected {n}")
            if len(faults) >= 8:
                break
        return faults

    def stamps(self, objects: Sequence[tuple[str, int]]) -> list[str] | None:
        """From ``stat``: size, inode, mtime and ctime. A write, a replacement or a ``utime`` that
        puts the mtime back all change the ctime, which user space cannot set."""
        out: list[str] = []
        for key, n in objects:
            try:
                st = os.stat(self.root + key)
            except OSError:
                return None
            if not stat.S_ISREG(st.st_mode) or st.st_size != n:
                return None
            out.append(f"{st.st_size}:{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}")
        return out

    @property
    def positional_reads(self) -> bool:
        return self.options.positional_reads

    def open_positional(self, key: str, *, tensor: str | None = None) -> PositionalFile:
        if not self.positional_reads:
            return super().open_positional(key, tensor=tensor)
        fd = self._open_object(key, tensor, missing=MissingShardError)
        assert fd is not None
        try:
            st = os.fstat(fd)
            _require_regular(st.st_mode, key, tensor)
        except BaseException:
            os.close(fd)
            raise
        return _LocalFile(fd, st.st_size, key, tensor, direct=self.options.direct_reads)

    # ------------------------------------------------------------------ writes
    def write_object(self, key: str, buffers: Iterable[Any], *, tensor: str | None = None) -> int:
        """Written to ``<key>.__lock`` (created exclusively), written back (``sync_mode`` "syncfs":
        ``sync_file_range``) or ``fsync``'d ("fsync"), checked by ``fstat`` size and renamed over
        ``key``; durable, its directory entry included, once :meth:`sync` returns. With the option
        ``direct_writes`` (default True) the bytes go through ``O_DIRECT`` where the file system
        takes it: no page-cache pages are allocated for them (FORMAT.md 14.2)."""
        path = self.root + key
        how = ("range" if self._syncfs else "fsync") if self._fsync else "none"
        if how == "range":
            self._open_sync_fd()  # counts this write as pending until its directory is recorded
        d = os.path.dirname(path)
        try:
            n = _durable.write_file(path, buffers, fsync=how, obj=key, tensor=tensor,
                                    direct=self.options.direct_writes)
            if how == "range" and os.stat(d).st_dev != self._sync_dev:  # below a mount point: syncfs misses it
                _durable.fsync_path(path, obj=key, tensor=tensor)
                with self._dirs_lock:
                    self._other_fs_dirs.add(d)
            with self._dirs_lock:
                self._dirs.add(d)
        finally:
            if how == "range":
                with self._dirs_lock:
                    self._writing -= 1
        return n

    packs_in_place = True

    def open_pack(self, key: str) -> "_FilePack":
        """A pack written in place: ``<key>.__lock`` created exclusively, filled with ``pwritev`` at
        the offsets given (from several threads), then written back or ``fsync``'d as
        :meth:`write_object` does, checked by ``fstat`` size and renamed over ``key`` by
        :meth:`_FilePack.finish`; durable once :meth:`sync` returns (FORMAT.md 5.15, 14.2)."""
        return _FilePack(self, key)

    def _open_sync_fd(self) -> None:
        with self._dirs_lock:
            if self._sync_fd < 0:
                self._sync_fd = self._open_root()
                self._sync_dev = os.fstat(self._sync_fd).st_dev
            self._writing += 1

    def _open_root(self) -> int:
        try:
            os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError("cannot open the repository for syncfs", object=self.root, found=str(e)) from None

    def sync(self, prefix: str) -> None:
        """Make every object written under ``prefix`` durable: "syncfs", one ``syncfs`` of the file
        system (objects below a mount point inside the repository were ``fsync``'d one by one, and
        their directories are ``fsync``'d here); "fsync", ``fsync`` every directory an object under
        ``prefix`` was renamed into, and each one above it up to ``prefix``'s own (created on the
        way), concurrently on the writer threads. StorageError when that fails."""
        top = os.path.dirname((self.root + prefix).rstrip("/"))
        with self._dirs_lock:
            mine = {d for d in self._dirs if d.startswith(top)}
            self._dirs -= mine
        if not self._fsync:
            return
        if self._syncfs:
            self._sync_filesystem(mine)
            with self._dirs_lock:
                mine &= self._other_fs_dirs
                self._other_fs_dirs -= mine
            if not mine:
                return
        todo: set[str] = set()
        for d in mine:
            while d.startswith(top) and d != top and d not in todo:
                todo.add(d)
                d = os.path.dirname(d)
        threads = max(1, min(len(todo), self.options.write_threads))
        _durable.fsync_dirs(todo, threads)

    def _sync_filesystem(self, mine: set[str]) -> None:
        """One ``syncfs`` on the descriptor opened before these writes (:meth:`_open_sync_fd`)."""
        with self._dirs_lock:
            failed, fd = self._sync_failed, self._sync_fd
            if failed is not None and mine & failed[0]:
                raise failed[1]
            if fd < 0:
                if not mine:  # nothing written under this prefix since the last sync
                    return
                fd = self._open_root()
            self._sync_fd = -1 if not (self._dirs or self._writing) else fd  # others' pending writes keep it
            try:
                _durable.syncfs(fd)
            except OSError as e:
                err = StorageError("syncfs failed: the save's objects may not be durable", object=self.root,
                                   expected="syncfs returns 0", found=str(e)[:300])
                self._sync_failed = (set(self._dirs), err) if self._dirs else None
                raise err from None
            finally:
                if self._sync_fd != fd:
                    os.close(fd)

    @property
    def _fsync(self) -> bool:
        return self.options.fsync

    # ------------------------------------------------------------------ deletes and walks
    def delete_prefix(self, prefix: str) -> None:
        """A link is removed itself, never what it points to (tensorstore's ``delete_range``
        would empty the directory it points to)."""
        _check_folder_prefix(prefix)
        try:
            _localfs.remove_tree(self.root, prefix)
        except OSError as e:
            raise StorageError("delete failed", object=prefix, found=f"{type(e).__name__}: {e}") from None

    def scan_children(self, prefix: str, *, marker: str | None = None, deep: bool = True) -> list[_localfs.Entry]:
        """From ``lstat``: lock files of killed writes included, which the kvstore listing hides."""
        try:
            return _localfs.scan_children(self.root, prefix, marker, deep)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError("cannot list without following a link", object=prefix,
                               expected="a directory", found=f"{type(e).__name__}: {e.strerror or e}") from None

    def plain_dir(self, prefix: str) -> bool:
        return _localfs.plain_dir(self.root, prefix) is not False

    def remove_stale_locks(self, prefix: str, older_than_unix: float) -> int:
        """Delete ".__lock" files under ``prefix`` last modified before the cutoff (left by writes
        or deletes that were killed midway; the listing hides them), judged with ``lstat`` and
        never through a link."""
        if _localfs.plain_dir(self.root, prefix) is not True:
            return 0
        removed = 0
        try:
            for path, st in _localfs.walk(self.root + prefix):
                if path.endswith(_localfs.LOCK_SUFFIX) and stat.S_ISREG(st.st_mode) and st.st_mtime < older_than_unix:
                    try:
                        os.unlink(path)
                        removed += 1
                    except OSError:
                        pass
        except OSError:
            pass  # a directory that cannot be listed: nothing more to tidy here
        return removed


class _LocalFile(PositionalFile):
    def __init__(self, fd: int, size: int, key: str, tensor: str | None, direct: bool = False) -> None:
        self.fd, self.size, self.key, self.tensor = fd, size, key, tensor
        self.direct = direct  # option direct_reads: large aligned spans through O_DIRECT
        self.dontcache = False  # prefer_uncached(): the page-cache part of a large read with RWF_DONTCACHE

    def prefer_uncached(self) -> None:
        """With option ``direct_reads`` on Linux, the page-cache part of this file's split reads
        goes with ``RWF_DONTCACHE`` (:mod:`ckptfmt.storage._directread`) until the kernel refuses it."""
        self.dontcache = self.direct and sys.platform.startswith("linux")

    def read_into(self, buffers: Sequence[Any], offset: int) -> None:
        """Loops over short reads (Linux moves at most ~2 GiB per call), resuming inside the
        buffer where the last call stopped. With ``direct`` (option ``direct_reads``, FORMAT.md
        14.4) large stretches go through ``O_DIRECT`` (:mod:`ckptfmt.storage._directread`), so
        that no page-cache pages are allocated for them."""
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        if self.direct and sum(v.nbytes for v in views) >= _directread.DIRECT_MIN_BYTES:
            self.direct = _directread.read_split(self.fd, views, offset, self._preadv_all, key=self.key, tensor=self.tensor)
        else:
            self._preadv_all(views, offset)

    def _preadv_all(self, views: list[memoryview], offset: int, raw: bool = False, uncached: bool = False) -> None:
        """Fill ``views`` from ``offset``; SizeMismatchError at an early end; StorageError (the
        OSError itself with ``raw``) when a read fails. ``uncached``: with ``RWF_DONTCACHE``
        (:mod:`ckptfmt.storage._directread`) while this file takes it."""
        want = sum(v.nbytes for v in views)
        got = 0
        while views:
            flags = _RWF_DONTCACHE if uncached and self.dontcache else 0
            try:
                n = os.preadv(self.fd, views, offset + got, flags)
            except OSError as e:
                if flags and e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    self.dontcache = False  # an older kernel or a file system without it
                    continue
                if raw:
                    raise
                raise StorageError("read failed", key=self.tensor, object=self.key, found=str(e)) from None
            if n == 0:
                raise SizeMismatchError("object is shorter than the manifest records", key=self.tensor, object=self.key,
                                        expected=f"bytes [{offset}, {offset + want})", found=f"{got} bytes")
            got += n
            _localfs.advance(views, n)

    def map(self) -> Any:
        if self.size == 0:
            return None
        try:
            return mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):  # a file system that cannot map: the caller reads instead
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _require_regular(mode: int, key: str, tensor: str | None) -> None:
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}.get(stat.S_IFMT(mode), "not a regular file")
        raise StorageError("object is not a regular file", key=tensor, object=key, expected="a regular file",
                           found=kind)


class _FilePack(PackWriter):
    """One pack object of :class:`LocalFileStorage` (see :meth:`LocalFileStorage.open_pack`)."""

    def __init__(self, store: LocalFileStorage, key: str) -> None:
        self.store, self.key = store, key
        self.path = store.root + key
        self.how = ("range" if store._syncfs else "fsync") if store._fsync else "none"
        if self.how == "range":
            store._open_sync_fd()  # counts this pack as pending until its directory is recorded
        self._pending = self.how == "range"
        self.fd = self.dfd = -1
        self.end = 0  # the end of the furthest byte written
        self._end_lock = threading.Lock()
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path + _localfs.LOCK_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._done()
            raise storage_error("write failed", e, object=key) from None
        # Option direct_writes: a second descriptor with O_DIRECT for the aligned runs a writer
        # places (:attr:`align`); the rest goes through the page cache on the first.
        self.align = 0
        if store.options.direct_writes:
            try:
                self.dfd = os.open(self.path + _localfs.LOCK_SUFFIX, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                self.dfd = -1
            if self.dfd >= 0 and _durable.set_direct(self.dfd, True):
                self.align = _durable.DIRECT_ALIGN

    def write_at(self, offset: int, buffers: Iterable[Any], *, tensor: str | None = None, direct: bool = False) -> int:
        if direct and self.align and offset % self.align == 0:
            buffers = list(buffers)
            try:
                n = _durable.put_direct_at(self.dfd, buffers, offset, name=self.key, tensor=tensor)
                self._wrote(offset + n)
                return n
            except StorageError as e:
                if "Invalid argument" not in str(e) and "EINVAL" not in str(e.found):
                    raise
                self.align = 0  # a device that wants larger blocks: the page cache from now on
        done, iov, held = 0, [], 0
        for b in buffers:
            iov.append(b)
            held += memoryview(b).nbytes
            if held >= _PACK_STAGE_BYTES or len(iov) >= _PACK_IOV:
                done += _durable.pwritev_all(self.fd, iov, offset + done, obj=self.key, tensor=tensor)
                iov, held = [], 0
        n = done + _durable.pwritev_all(self.fd, iov, offset + done, obj=self.key, tensor=tensor)
        self._wrote(offset + n)
        return n

    def _wrote(self, end: int) -> None:
        with self._end_lock:
            self.end = max(self.end, end)

    def finish(self, nbytes: int) -> int:
        tmp, d = self.path + _localfs.LOCK_SUFFIX, os.path.dirname(self.path)
        try:
            try:
                if self.how == "fsync":
                    os.fsync(self.fd)
                elif self.how == "range":
                    _durable.sync_range(self.fd)
                st = os.fstat(self.fd)
            except OSError as e:
                raise storage_error("write failed", e, object=self.key) from None
            if self.dfd >= 0:
                if self.how == "fsync":
                    os.fsync(self.dfd)
                os.close(self.dfd)
                self.dfd = -1
            if self.end <= st.st_size < nbytes:  # a gap a writer left at the end: a hole
                try:
                    os.ftruncate(self.fd, nbytes)
                    st = os.fstat(self.fd)
                except OSError as e:
                    raise storage_error("write failed", e, object=self.key) from None
            if st.st_size != nbytes:
                raise StorageError("written pack object has an unexpected size", object=self.key, expected=nbytes,
                                   found=st.st_size)
            os.close(self.fd)
            self.fd = -1
            try:
                os.rename(tmp, self.path)
            except OSError as e:
                raise storage_error("write failed", e, object=self.key) from None
            if self.how == "range" and os.stat(d).st_dev != self.store._sync_dev:  # below a mount point
                _durable.fsync_path(self.path, obj=self.key)
                with self.store._dirs_lock:
                    self.store._other_fs_dirs.add(d)
            with self.store._dirs_lock:
                self.store._dirs.add(d)
            return nbytes
        except BaseException:
            self.abort()
            raise
        finally:
            self._done()

    def abort(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path + _localfs.LOCK_SUFFIX)
            except OSError:
                pass  # gc removes stale lock files
        self._done()

    def _done(self) -> None:
        if self._pending:
            self._pending = False
            with self.store._dirs_lock:
                self.store._writing -= 1


#: What one pwritev of a pack gathers (bytes, buffers: Linux IOV_MAX).
_PACK_STAGE_BYTES = 8 << 20
_PACK_IOV = 1024
