"""O_DIRECT reads on the local-file positional path (FORMAT.md 14.4, repository option
``direct_reads``): the same bytes as reads through the page cache, no page-cache pages for the
aligned spans they take, and the same typed errors."""
import ctypes
import errno
import mmap
import os
import shutil
import tempfile

import numpy as np
import pytest

from ckptfmt import Repository
from ckptfmt.errors import SizeMismatchError, StorageError
from ckptfmt.storage import _durable
from ckptfmt.storage._directread import read_split
from ckptfmt.storage._directread import split_direct as _split_direct

_BLOCK = _durable.DIRECT_ALIGN


def _aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))


def _spans_cover(views, offset, spans) -> bool:
    """The spans are exactly the views' bytes at their file offsets, nothing twice."""
    want, pos = [], offset
    for v in views:
        want.append((pos, pos + v.nbytes))
        pos += v.nbytes
    got = sorted((at, at + v.nbytes) for v, at in spans)
    merged: list[list[int]] = []
    for lo, hi in got:
        if merged and merged[-1][1] == lo:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    return merged == [[offset, pos]] and sum(v.nbytes for v, _ in spans) == pos - offset


def test_split_takes_only_aligned_spans():
    big = _aligned(1 << 20)
    direct, rest = _split_direct([big], 0)
    assert [(v.nbytes, at) for v, at in direct] == [(1 << 20, 0)] and rest == []
    # Control: the same buffer four bytes into the file agrees with no block boundary.
    direct, rest = _split_direct([big], 4)
    assert direct == [] and [(v.nbytes, at) for v, at in rest] == [(1 << 20, 4)]
    # Address and offset agree modulo a block: a head and a tail through the page cache.
    inner = big[100:100 + (600 << 10)]
    direct, rest = _split_direct([inner], 100)
    assert [(v.nbytes, at) for v, at in direct] == [(((600 << 10) + 100) // _BLOCK * _BLOCK - _BLOCK, _BLOCK)]
    assert _spans_cover([inner], 100, direct + rest)
    # Small buffers never go direct; several buffers back to back keep their offsets.
    tails = memoryview(bytearray(4))
    views = [big, tails, _aligned(1 << 20)]
    direct, rest = _split_direct(views, 0)
    assert [at for _, at in direct] == [0] and _spans_cover(views, 0, direct + rest)


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (mincore)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        arr = np.frombuffer(mm, np.uint8)
        if libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del arr
        return sum(b & 1 for b in vec)
    finally:
        mm.close()


def _file(tmp_path, n: int) -> tuple[str, bytes]:
    data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8).tobytes()
    path = tmp_path / "obj"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: drops them from the cache
    finally:
        os.close(fd)
    return str(path), data


def _uncached_file(tmp_path, n: int) -> tuple[str, bytes]:
    """:func:`_file`, skipping the test where its pages stay cached (page-cache counts mean nothing)."""
    path, data = _file(tmp_path, n)
    if _resident_pages(path) > 2:
        pytest.skip("this file system keeps written pages cached after POSIX_FADV_DONTNEED")
    return path, data


@pytest.mark.parametrize("direct", [True, False])
def test_direct_reads_return_the_bytes_and_skip_the_page_cache(tmp_path, direct):
    """On the test directory's disk the aligned spans bypass the page cache; the buffered read
    (direct=False) is the control that fills it. Both return the file's bytes."""
    n = (3 << 20) + 4 + 96
    path, data = _uncached_file(tmp_path, n)
    repo = Repository(str(tmp_path), options={"direct_reads": direct})
    out, tail, index = _aligned(3 << 20), bytearray(4), bytearray(96)
    with repo.storage.open_positional("obj") as f:
        f.read_into([out, tail, index], 0)
    assert bytes(out) + bytes(tail) + bytes(index) == data
    resident = _resident_pages(path)
    if direct:
        assert resident <= 1, f"{resident} pages cached: the aligned 3 MiB did not go through O_DIRECT"
    else:
        assert resident >= (3 << 20) // mmap.PAGESIZE


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("shift", [0, 1, 4, 4095])
def test_direct_reads_of_unaligned_buffers_and_offsets(tmp_path, direct, shift):
    n = (2 << 20) + 3 * _BLOCK + 7
    path, data = _file(tmp_path, n)
    repo = Repository(str(tmp_path), options={"direct_reads": direct})
    backing = _aligned(2 << 21)
    out = backing[shift:shift + (1 << 20) + 333]
    small = bytearray(17)
    start = _BLOCK + shift
    with repo.storage.open_positional("obj") as f:
        f.read_into([small, out], start)
    assert bytes(small) + bytes(out) == data[start:start + 17 + out.nbytes]


@pytest.mark.parametrize("direct", [True, False])
def test_a_short_object_is_a_size_mismatch_either_way(tmp_path, direct):
    path, data = _file(tmp_path, 1 << 20)
    repo = Repository(str(tmp_path), options={"direct_reads": direct})
    with repo.storage.open_positional("obj", tensor="w") as f:
        f.read_into([_aligned(1 << 20)], 0)  # control: the whole object reads
        with pytest.raises(SizeMismatchError) as e:
            f.read_into([_aligned(1 << 20)], _BLOCK)
    assert e.value.key == "w" and "obj" in str(e.value)


def test_direct_reads_on_tmpfs_fall_back_or_read(tmp_path):
    """/dev/shm: right whether tmpfs takes O_DIRECT (Linux 6.6 and later) or refuses it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        data = np.random.default_rng(5).integers(0, 255, (1 << 20) + 9, dtype=np.uint8).tobytes()
        with open(os.path.join(shm, "obj"), "wb") as f:
            f.write(data)
        repo = Repository(shm, options={"direct_reads": True})
        out, rest = _aligned(1 << 20), bytearray(9)
        with repo.storage.open_positional("obj") as f:
            f.read_into([out, rest], 0)
        assert bytes(out) + bytes(rest) == data
    finally:
        shutil.rmtree(shm)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("addr_shift, at", [(0, 4), (4, 0), (0, 4096 + 4), (100, 8)])
def test_stretches_aligned_differently_in_memory_read_through_the_page_cache(tmp_path, direct, addr_shift, at):
    """A chunk four bytes past a block boundary (behind the previous chunk's trailer) cannot be
    read straight into a page-aligned output: it comes through the page cache (uncached where the
    kernel can), with the file's bytes up to its last, unaligned byte, in both modes."""
    n = (3 << 20) + 100
    path, data = _file(tmp_path, n)
    repo = Repository(str(tmp_path), options={"direct_reads": direct})
    backing = _aligned(4 << 20)
    big = backing[addr_shift:addr_shift + (n - at - 4)]
    trailer = bytearray(4)
    with repo.storage.open_positional("obj") as f:
        f.read_into([big, trailer], at)
    assert bytes(big) + bytes(trailer) == data[at:]


@pytest.mark.parametrize("direct", [True, False])
def test_an_unaligned_read_past_the_end_is_a_size_mismatch(tmp_path, direct):
    n = (2 << 20) + 10
    path, data = _file(tmp_path, n)
    repo = Repository(str(tmp_path), options={"direct_reads": direct})
    with repo.storage.open_positional("obj", tensor="w") as f:
        ok = _aligned(n)[:n - 4]
        f.read_into([ok], 4)  # control: up to the last byte
        assert bytes(ok) == data[4:]
        with pytest.raises(SizeMismatchError) as e:
            f.read_into([_aligned(n)[:n - 3]], 4)
    assert e.value.key == "w"



def _takes_dontcache(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(16)], 0, 0x80)  # RWF_DONTCACHE (Linux 6.14)
        return True
    except (OSError, TypeError, ValueError):
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("uncached", [True, False])
def test_unaligned_stretches_of_a_large_read_leave_no_page_cache_pages(tmp_path, uncached):
    """Revision 1.2.5: when the reader says its read is large (``prefer_uncached``, a restore of
    at least ``UNCACHED_READ_BYTES``), a buffer whose address and file offset disagree (a later
    chunk of a shard) is read with RWF_DONTCACHE, so that the page-cache pages it brings in are
    dropped once copied; without the hint (the control) they stay cached. Both return the file's
    bytes, the unaligned last bytes included."""
    n = (5 << 20) + 4 + 96
    path, data = _uncached_file(tmp_path, n)
    if not _takes_dontcache(path):
        pytest.skip("this kernel or file system has no RWF_DONTCACHE")
    repo = Repository(str(tmp_path), options={"direct_reads": True})
    head = bytearray(4)
    out = _aligned(n)[:n - 4 - 96]  # page-aligned, 4 bytes into the file: never O_DIRECT
    index = bytearray(96)
    with repo.storage.open_positional("obj") as f:
        if uncached:
            f.prefer_uncached()
        f.read_into([head, out, index], 0)
    assert bytes(head) + bytes(out) + bytes(index) == data
    resident = _resident_pages(path)
    if uncached:
        assert resident <= 8, f"{resident} pages cached: the unaligned stretch stayed in the page cache"
    else:
        assert resident >= n // mmap.PAGESIZE - 8


def _preadv(fd: int, refuse: int | None = None):
    """A file's read function for :func:`read_split`: reads ``fd``, or fails every ``O_DIRECT``
    read (``raw``) with ``refuse``, as a device with larger blocks than ours answers (EINVAL)."""
    def read(views, offset, raw=False, uncached=False):
        if raw and refuse is not None:
            raise OSError(refuse, os.strerror(refuse))
        want = sum(v.nbytes for v in views)
        assert os.preadv(fd, views, offset) == want
    return read


@pytest.mark.parametrize("refuse", [None, errno.EINVAL])
def test_read_split_falls_back_where_the_device_refuses_direct_reads(tmp_path, refuse):
    """A device that refuses an ``O_DIRECT`` read (EINVAL) gets the same bytes through the page
    cache, and read_split says the file takes no more direct reads; the control (a device that
    takes them) says it still does. Both return the file's bytes."""
    n = (2 << 20) + 4
    path, data = _file(tmp_path, n)
    fd = os.open(path, os.O_RDONLY)
    try:
        if not _durable.set_direct(fd, True):
            pytest.skip("this file system refuses O_DIRECT")
        _durable.set_direct(fd, False)
        out, tail = _aligned(n - 4), bytearray(4)
        taken = read_split(fd, [out, memoryview(tail)], 0, _preadv(fd, refuse), key="obj", tensor="w")
    finally:
        os.close(fd)
    assert bytes(out) + bytes(tail) == data
    assert taken is (refuse is None)


def test_read_split_names_the_object_when_a_direct_read_fails(tmp_path):
    """Any other failure of an ``O_DIRECT`` read is a StorageError naming the tensor and object."""
    path, _ = _file(tmp_path, 1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        if not _durable.set_direct(fd, True):
            pytest.skip("this file system refuses O_DIRECT")
        _durable.set_direct(fd, False)
        with pytest.raises(StorageError) as e:
            read_split(fd, [_aligned(1 << 20)], 0, _preadv(fd, errno.EIO), key="obj", tensor="w")
    finally:
        os.close(fd)
    assert e.value.key == "w" and "obj" in str(e.value)
