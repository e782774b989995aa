"""O_DIRECT reads of a file range into memory that is not aligned for it, through a bounce buffer.

O_DIRECT needs the file offset, the length and the memory block-aligned; memory another library
allocated (torch's CPU tensors start 64 bytes into a page) is not. The range is read into a
page-aligned buffer a piece at a time and each piece copied to its destinations: one copy in user
space, against the kernel's allocation and copy of every page a read through the page cache costs.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import numpy as np

from reshard.io.memory import ALIGN


def enable(fd: int, size: int) -> mmap.mmap | None:
    """Turn O_DIRECT on for `fd` and give a page-aligned read buffer of `size` bytes (a multiple of
    ALIGN); None where the file system refuses O_DIRECT (`fd` then reads through the page cache)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return None
    return mmap.mmap(-1, size)


def disable(fd: int) -> None:
    """Turn O_DIRECT off again (its reads were refused after all: EINVAL)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def read_into(fd: int, pos: int, end: int, dests: list[memoryview], bounce: mmap.mmap, name: str) -> None:
    """Bytes [pos, end) of `fd` (O_DIRECT, `pos` aligned) into `dests`, back to back, through
    `bounce` (from `enable`): whole blocks read (the file's last one is a short read past its
    end), then copied by numpy, which lets other threads run. EOFError names `name` if the file
    ends before `end`; OSError as the reads raise it (EINVAL: O_DIRECT refused)."""
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
