"""Local file system walks and deletes that never follow a symbolic link (file driver only).

tensorstore's file kvstore follows links: ``delete_range`` over ``saves/evil/``, where ``evil`` is
a link to a directory, empties that directory, and ``stat`` judges the age of the link's target.
Collectors use these functions instead (FORMAT.md 4.4, 10.3). Every walk is iterative, so a
deeply nested hostile tree raises OSError (too many open files, a path too long) rather than
RecursionError, and a caller reports it.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Entry", "scan_children", "walk", "remove_tree", "plain_dir", "link_on_path", "open_beneath", "LOCK_SUFFIX"]

LOCK_SUFFIX = ".__lock"  # tensorstore's file driver: the temporary file of a write in flight


@dataclass(frozen=True)
class Entry:
    """One name directly under a prefix, judged with ``lstat``."""

    name: str
    kind: str                    # "dir" | "link" | "file" | "other" (fifo, socket, device)
    objects: int = 0             # files below a directory, lock files of writes in flight excluded
    newest_mtime: float | None = None  # newest lstat mtime of the entry and of everything below it
    marker: str | None = None    # kind of ``<name>/<marker>`` ("file", "link", ...), None when absent
    error: str | None = None     # why the walk below this directory stopped early


def _why(e: OSError) -> str:
    """An ``Entry.error``: the exception's type and the system's words for it."""
    return f"{type(e).__name__}: {e.strerror or e}"


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


def _open_dir(root: str, rel: str) -> int:
    """An fd of ``root/rel``, opened one component at a time with O_NOFOLLOW below ``root``.

    Raises OSError: ELOOP or ENOTDIR when a component is a link or not a directory."""
    cloexec = getattr(os, "O_CLOEXEC", 0)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | cloexec)
    try:
        for part in (p for p in rel.split("/") if p):
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | cloexec, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def plain_dir(root: str, rel: str) -> bool | None:
    """True when ``root/rel`` is a directory reached without a link, None when it is absent,
    False when it (or a component on the way) is a link or not a directory."""
    try:
        os.close(_open_dir(root, rel))
    except FileNotFoundError:
        return None
    except OSError:
        return False
    return True


def open_beneath(root: str, key: str, flags: int) -> int:
    """An fd of the object ``root/key`` opened without following any link below ``root``: each
    directory with ``openat(O_DIRECTORY | O_NOFOLLOW)`` relative to its parent's fd, the object
    itself with ``O_NOFOLLOW`` (FORMAT.md 9 step 4). A link swapped in after a check cannot
    redirect the open: the open itself refuses it.

    Raises OSError: FileNotFoundError when absent; ELOOP when the object is a link; ENOTDIR when a
    directory on the way is a link or not a directory (:func:`link_on_path` tells which)."""
    cut = key.rfind("/")
    fd = _open_dir(root, key[:cut]) if cut > 0 else os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.open(key[cut + 1:], flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
    finally:
        os.close(fd)


def link_on_path(root: str, key: str, checked: set[str]) -> str | None:
    """The first component of ``key`` below ``root`` (which ends with "/") that is a symbolic
    link, as a key ("saves/<id>/" for a directory), or None. Judged with ``lstat``: the object, and
    each directory on the way that is not in ``checked`` (keys ending in "/"), top down; each one
    found to be a plain directory is added, so a caller that keeps ``checked`` pays one ``lstat``
    per directory and one per object. An absent or unreadable component ends the walk with None:
    the read that follows reports it."""
    todo = []
    cut = key.rfind("/")
    while cut >= 0 and key[:cut + 1] not in checked:  # up to the deepest directory known plain
        todo.append(cut)
        cut = key.rfind("/", 0, cut)
    for cut in reversed(todo):
        try:
            mode = os.lstat(root + key[:cut]).st_mode  # no trailing "/": with one, lstat follows a link
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            return key[:cut + 1]
        if not stat.S_ISDIR(mode):
            return None
        checked.add(key[:cut + 1])
    try:
        return key if stat.S_ISLNK(os.lstat(root + key).st_mode) else None
    except OSError:
        return None


def walk(top: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path, lstat) of ``top`` and of everything below it; links and special files are yielded,
    never followed or opened. Raises OSError when a directory cannot be listed."""
    st = os.lstat(top)
    yield top, st
    if not stat.S_ISDIR(st.st_mode):
        return
    stack = [top]
    while stack:
        path = stack.pop()
        with os.scandir(path) as it:
            for e in it:
                try:
                    est = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we walk
                yield e.path, est
                if stat.S_ISDIR(est.st_mode):
                    stack.append(e.path)


def scan_children(root: str, prefix: str, marker: str | None = None, deep: bool = True) -> list[Entry]:
    """Every name directly under ``root/prefix``, judged without following links; for each
    directory, the kind of ``<name>/<marker>`` (when given) found on the way.

    ``deep=False`` looks at nothing below a directory but its marker (one ``lstat`` through the
    directory opened with ``O_NOFOLLOW``): no object count and no modification time, and a
    directory that cannot be opened (replaced by a link meanwhile, unreadable) comes back with
    ``error`` set. What reads only the markers (the leases, FORMAT.md 10.3) then costs one
    directory per save, not every object of every save.

    Raises FileNotFoundError when the prefix is absent, and OSError (ELOOP, ENOTDIR) when it or a
    component on the way is a link or not a directory."""
    fd = _open_dir(root, prefix)
    try:
        with os.scandir(fd) as it:
            names = sorted(e.name for e in it)
        if not deep:
            return [e for e in (_shallow(fd, name, marker) for name in names) if e is not None]
    finally:
        os.close(fd)
    base = os.path.join(root, prefix)
    out = []
    for name in names:
        path = os.path.join(base, name)
        try:
            kind = _kind(os.lstat(path).st_mode)
        except FileNotFoundError:
            continue
        if kind != "dir":
            out.append(Entry(name, kind))
            continue
        objects, newest, found, error = 0, None, None, None
        mark = os.path.join(path, marker) if marker else None
        try:
            for p, st in walk(path):
                newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
                if not stat.S_ISDIR(st.st_mode) and not p.endswith(LOCK_SUFFIX):
                    objects += 1
                if p == mark:
                    found = _kind(st.st_mode)
        except OSError as e:
            error = _why(e)
        out.append(Entry(name, "dir", objects, newest, found, error))
    return out


def _shallow(parent: int, name: str, marker: str | None) -> Entry | None:
    """``name`` under the directory ``parent`` and, for a directory, its marker's kind; None when
    it is gone."""
    try:
        kind = _kind(os.lstat(name, dir_fd=parent).st_mode)
    except FileNotFoundError:
        return None
    if kind != "dir" or marker is None:
        return Entry(name, kind)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as e:
        return Entry(name, kind, error=_why(e))
    try:
        return Entry(name, kind, marker=_kind(os.lstat(marker, dir_fd=fd).st_mode))
    except FileNotFoundError:
        return Entry(name, kind)
    except OSError as e:
        return Entry(name, kind, error=_why(e))
    finally:
        os.close(fd)


def remove_tree(root: str, prefix: str) -> None:
    """Delete ``root/prefix`` (``saves/<id>/``) without following any link.

    A link is removed itself, never what it points to; nothing below ``root`` is entered through
    a link. An absent prefix is not an error. Files that appear while it runs (a straggling
    writer) may leave a directory behind. Raises OSError when something cannot be removed."""
    parts = [p for p in prefix.split("/") if p]
    if not parts:
        raise ValueError("refusing to remove the repository root")
    try:
        parent = _open_dir(root, "/".join(parts[:-1]))
    except FileNotFoundError:
        return
    try:
        name = parts[-1]
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            return
        _rmtree_at(parent, name)
    finally:
        os.close(parent)


def _rmtree_at(parent: int, name: str) -> None:
    # Post-order, one open fd per level: each directory is opened with O_NOFOLLOW relative to its
    # parent's fd, so swapping a directory for a link mid-walk cannot redirect the deletion.
    stack: list[tuple[int, str, int]] = []
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        try:
            stack.append((parent, name, os.open(name, flags, dir_fd=parent)))
        except FileNotFoundError:
            return  # removed meanwhile by another collector
        while stack:
            pfd, nm, fd = stack[-1]
            sub = None
            with os.scandir(fd) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        sub = e.name
                        break
                    try:
                        os.unlink(e.name, dir_fd=fd)  # a file, a link or a fifo: the entry itself
                    except FileNotFoundError:
                        pass
            if sub is not None:
                try:
                    stack.append((fd, sub, os.open(sub, flags, dir_fd=fd)))
                except FileNotFoundError:
                    pass  # another collector removed it meanwhile: scan this level again
                continue
            stack.pop()
            os.close(fd)
            try:
                os.rmdir(nm, dir_fd=pfd)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                    raise
                if e.errno == errno.ENOTEMPTY:
                    break  # something was written meanwhile: leave the rest for the next gc
    finally:
        for _pfd, _nm, fd in stack:
            os.close(fd)


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers in place (after a short ``preadv`` or
    ``pwritev`` moved ``n`` bytes), so the next call resumes where this one stopped."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views.pop(0)
    if n:
        views[0] = views[0][n:]
