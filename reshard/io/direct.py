"""O_DIRECT reads: which files to read so (`wants_direct`: those mostly not in the page cache, asked
without reading), a file's blocks read ahead by a thread of their own (`blocks`), or a range copied
into memory that is not aligned for O_DIRECT through a bounce buffer (`read_into`); read buffers
faulted in without holding the GIL (`populate`). No other reshard module is imported here: the save's
readers, verify and the vLLM loader plugin all use it.

O_DIRECT needs the file offset, the length and the memory block-aligned (ALIGN). A cold file read
this way costs no page-cache allocation and copy of every page in the kernel (on this project's VM
about 1 CPU s per GB, more than the hash), and evicts nothing; without the kernel's read-ahead, the
reads must be kept in flight by the reader (`blocks`: `depth` ahead).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and buffers


def wants_direct(path: Path, mode: str) -> bool:
    """Whether to read `path` with O_DIRECT, by RESHARD_DIRECT_READS' value `mode`: "auto" where
    the file is mostly not in the page cache, "1" always, "0" never."""
    if mode != "auto":
        return mode == "1"
    share = cached_share(path)
    return share is not None and share < 0.5


PROBES = 16  # pages sampled per file where the whole file cannot be asked about at once (mincore)


def cached_share(path: Path) -> float | None:
    """The share of the file's pages in the page cache; None where the system cannot tell. Asked
    without reading a byte, so that asking changes nothing (a read, even RWF_NOWAIT's, brings the
    page in: asked twice, a cold file looked cached): cachestat(2) of the whole file (Linux 6.5+),
    else mincore(2) of `PROBES` pages spread over a mapping of it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        share = _cachestat(fd, size)
        return share if share is not None else _mincore(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


class _Range(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Stat(ctypes.Structure):
    _fields_ = tuple(
        (n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


_SYS_CACHESTAT = 451  # the same number on every Linux architecture
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
        libc.syscall.restype = ctypes.c_long
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    return _libc


def _cachestat(fd: int, size: int) -> float | None:
    libc = _c()
    if libc is None:
        return None
    rng, st = _Range(0, size), _Stat()
    if libc.syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        return None  # ENOSYS before Linux 6.5, EPERM under some seccomp filters
    return min(1.0, st.nr_cache / -(-size // mmap.PAGESIZE))


def _mincore(fd: int, size: int) -> float | None:
    libc = _c()
    if libc is None:
        return None
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        n = min(PROBES, pages)
        vec = ctypes.create_string_buffer(1)
        hits = 0
        for i in range(n):
            page = (2 * i + 1) * pages // (2 * n)
            if libc.mincore(ctypes.c_void_p(addr + page * mmap.PAGESIZE), mmap.PAGESIZE, vec) != 0:
                return None
            hits += vec.raw[0] & 1
        return hits / n
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


def enable(fd: int) -> bool:
    """Turn O_DIRECT on for `fd`; False where the file system refuses it (`fd` then reads through
    the page cache)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def disable(fd: int) -> None:
    """Turn O_DIRECT off again (its reads were refused after all: EINVAL)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


_MADV_POPULATE_WRITE = 23


def populate(m: mmap.mmap) -> bool:
    """Fault the private mapping `m` in for writing (madvise MADV_POPULATE_WRITE, Linux 5.14+)
    through ctypes, which lets go of the GIL (mmap(2) with MAP_POPULATE holds it); False where the
    kernel or the platform cannot."""
    libc = _c()
    if libc is None:
        return False
    anchor = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(anchor)
    del anchor  # no export of `m` may outlive this (close would refuse)
    return libc.madvise(addr, len(m), _MADV_POPULATE_WRITE) == 0


def buffer(size: int) -> mmap.mmap:
    """`size` bytes of page-aligned memory (a multiple of ALIGN) to read into with O_DIRECT."""
    return mmap.mmap(-1, size)


def blocks(fd: int, pos: int, limit: int | None, size: int, depth: int = 2) -> Iterator[memoryview]:
    """The bytes of `fd` (O_DIRECT on) from `pos` (aligned), at most `limit` (None: to its end), as
    views of up to `size` bytes (a multiple of ALIGN), each valid until the next is asked for; a
    thread reads `depth` blocks ahead. OSError as the reads raise it (EINVAL: O_DIRECT refused)."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(depth + 1):
        free.put(buffer(size))
    full: queue.Queue = queue.Queue()
    stop = threading.Event()

    def read() -> None:
        at, left = pos, limit
        try:
            while not stop.is_set() and (left is None or left > 0):
                buf = free.get()
                if buf is None:
                    return
                want = size if left is None else min(size, -(-left // ALIGN) * ALIGN)
                n = os.preadv(fd, [memoryview(buf)[:want]], at)
                n = n if left is None else min(n, left)
                if n <= 0:
                    break
                full.put((buf, n))
                at += n
                if left is not None:
                    left -= n
                if n < want and left != 0:  # a short read: the end of the file
                    break
        except BaseException as e:  # handed to the consumer
            full.put(e)
            return
        full.put(None)

    t = threading.Thread(target=read, name="reshard-direct-read", daemon=True)
    t.start()
    try:
        while (got := full.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            buf, n = got
            yield memoryview(buf)[:n]
            free.put(buf)
    finally:
        stop.set()
        free.put(None)  # a reader waiting for a buffer wakes and ends
        t.join()


def read_into(fd: int, pos: int, end: int, dests: list[memoryview], bounce: mmap.mmap, name: str) -> None:
    """Bytes [pos, end) of `fd` (O_DIRECT, `pos` aligned) into `dests`, back to back, through
    `bounce` (from `buffer`): whole blocks read (the file's last one is a short read past its
    end), then copied by numpy, which lets other threads run. EOFError names `name` if the file
    ends before `end`; OSError as the reads raise it (EINVAL: O_DIRECT refused)."""
    import numpy as np

    views = [np.frombuffer(d, np.uint8) for d in dests]
    buf, arr = memoryview(bounce), np.frombuffer(bounce, np.uint8)
    while pos < end:
        n = min(len(buf), end - pos)
        got = 0
        while got < n:
            k = os.preadv(fd, [buf[got : -(-n // ALIGN) * ALIGN]], pos + got)
            if k <= 0:
                raise EOFError(f"{name}: ended early")
            got += k
        i = 0
        while i < n:
            v = views[0]
            k = min(len(v), n - i)
            np.copyto(v[:k], arr[i : i + k])
            i += k
            if k == len(v):
                views.pop(0)
            else:
                views[0] = v[k:]
        pos += n
