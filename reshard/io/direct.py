"""O_DIRECT reads: a file's blocks read ahead by a thread of their own, or a range copied into memory
that is not aligned for O_DIRECT through a bounce buffer.

O_DIRECT needs the file offset, the length and the memory block-aligned (ALIGN). A cold file read
this way costs no page-cache allocation and copy of every page in the kernel (on this project's VM
about 1 CPU s per GB, more than the hash), and evicts nothing; without the kernel's read-ahead, the
reads must be kept in flight by the reader (`blocks`: `depth` ahead).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Iterator

from reshard.io.memory import ALIGN


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
