"""One weight file of a Hub repo in huggingface_hub's cache, filled at the offsets the save reads
(`blobs/<name>.reshard-partial`, the ranges it holds listed in `<name>.reshard-ranges`), renamed to
`blobs/<name>` and linked from the snapshot once it is complete and checked (reshard.sources.hubsource).

One process fills a partial blob at a time: it holds an exclusive `flock` on it until the blob is
published, discarded or closed. Another run reading the same commit into the same cache at once (the
processes of a torchrun save, `--ranks` pieces on one machine, two saves) finds it `busy` and stores
nothing of that file: it fetches what it needs and checks it as `--stream` does, and for the rest of
the file's sha256 it reads the blob the other run publishes (`published_by_another`) rather than
fetching the whole file too. Two writers of one blob renamed it into place twice (the second rename
failed: exit 4) and one could write its bytes through the blob the other had published, unchecked.

A run can store a range twice, the second copy over the first: a span of bytes several reads use,
not kept in memory and fetched again in one request with the bytes before it (reshard.sources.hubshare),
or two reader threads fetching the same bytes at once. The blob is published under the sha256 checked,
so it must hold the bytes hashed, whichever copy was stored last: each copy stored is fed to the file's
PrefixHasher or compared by digest with a copy that was (hubshare, hubgroups), and the hasher proves
every copy fed of a byte equal to the byte it hashed (reshard.sources.prefixhash), else exit 4 before
the rename (tests/test_hub_blob_twice.py). A copy stored from a fetch that failed part-way is never fed,
and the run fails with it: the next run reads it back from the blob and hashes it.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from reshard.console import note
from reshard.errors import SourceError


class Blob:
    """One weight file of the cache, being filled at the offsets it is read from (any order)."""

    def __init__(self, final: Path, size: int) -> None:
        self.final = final
        self.size = size
        self.partial = final.with_name(final.name + ".reshard-partial")
        self.log = final.with_name(final.name + ".reshard-ranges")
        self.lock = threading.Lock()
        self.starts: list[int] = []  # disjoint held ranges [starts[i], ends[i]), sorted
        self.ends: list[int] = []
        self.fd: int | None = None
        self.log_fd: int | None = None  # a partial blob's range log (a complete one has none)
        self.busy = False  # another process is filling the partial blob: this run stores nothing of the file
        while True:
            if _complete(final, size):
                self.starts, self.ends, self.fd = [0], [size], os.open(final, os.O_RDONLY)
                return
            self.fd = _claim(self.partial)
            if self.fd is not None:
                break
            if self.partial.exists():  # locked by another process
                self.busy = True
                return
            # else renamed into place by the process that held it: look again
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)
            self.log.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            for line in self.log.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    a, b = map(int, line.split())
                    if 0 <= a < b <= size:
                        self._add(a, b)
        self.log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def put_head(self, head: bytes) -> bool:
        """The file's first bytes as this run fetched them (its length and header: what the plan is
        made of, and what its hasher is fed) written over whatever a partial blob holds there, an
        earlier run's, maybe from a server that lied then: the blob holds the bytes hashed. A complete
        blob is not written: False where it holds other bytes there."""
        if self.log_fd is None:
            held = memoryview(bytearray(len(head)))
            self.pread(held, 0)
            return held == head
        self.store(memoryview(head), 0)
        return True

    def _add(self, a: int, b: int) -> None:
        i = bisect.bisect_left(self.ends, a)  # first range that ends at or after a
        j = bisect.bisect_right(self.starts, b)  # ranges before j start at or before b
        if i < j:
            a, b = min(a, self.starts[i]), max(b, self.ends[j - 1])
        self.starts[i:j] = [a]
        self.ends[i:j] = [b]

    def has(self, a: int, b: int) -> bool:
        return self.held_from(a) >= b

    def held_from(self, a: int) -> int:
        """Where the bytes it holds from `a` on stop (`a` when it does not hold byte a)."""
        with self.lock:
            i = bisect.bisect_right(self.starts, a) - 1
            return max(a, self.ends[i]) if i >= 0 else a

    def missing(self) -> int:
        with self.lock:
            return self.size - sum(e - s for s, e in zip(self.starts, self.ends, strict=True))

    def gaps(self) -> list[tuple[int, int]]:
        with self.lock:
            edges = [0, *[x for se in zip(self.starts, self.ends, strict=True) for x in se], self.size]
        return [(edges[k], edges[k + 1]) for k in range(0, len(edges), 2) if edges[k] < edges[k + 1]]

    def pread(self, out: memoryview, pos: int) -> None:
        assert self.fd is not None
        got = 0
        while got < len(out):
            n = os.preadv(self.fd, [out[got:]], pos + got)
            if n == 0:
                raise SourceError(f"{self.partial}: truncated", "delete it and run again")
            got += n

    def store(self, data: memoryview, pos: int) -> None:
        """`data` at `pos`, over whatever the blob held there. The caller feeds it to the file's hash or
        compares it with a copy that was (the module docstring): a copy nobody checked is never published."""
        assert self.fd is not None
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], pos + done)
        # start writing it back now (the source is not read again): the final fsync has little left
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self.fd, pos, len(data), os.POSIX_FADV_DONTNEED)
        with self.lock:
            os.write(self.log_fd, f"{pos} {pos + len(data)}\n".encode())
            self._add(pos, pos + len(data))

    def publish(self, link: Path) -> None:
        """The complete blob under its final name, and the snapshot's link to it."""
        if self.log_fd is not None:  # a partial blob, ours
            assert self.fd is not None
            os.fsync(self.fd)
            os.replace(self.partial, self.final)
            self.log.unlink(missing_ok=True)
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.symlink(os.path.relpath(self.final, link.parent), link)

    def discard(self) -> None:
        """Delete a partial blob (reshard's own file); a complete one is left for the user to judge."""
        if self.log_fd is not None:  # ours (locked): removed before the lock goes with the descriptor
            self.partial.unlink(missing_ok=True)
            self.log.unlink(missing_ok=True)
            self.close()

    def __del__(self) -> None:  # a save that failed before `finish`: its descriptors, and the lock, go with it
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        for fd in (self.fd, self.log_fd):
            if fd is not None:
                os.close(fd)
        self.fd = None
        self.log_fd = None


def _claim(partial: Path) -> int | None:
    """A descriptor of `partial` (created if need be) that this process alone holds (an exclusive
    `flock`, released when it is closed); None while another process holds it, or when the file it
    opened is no longer `partial` (the holder renamed it into place). Where the file system has no
    locks, the descriptor unlocked, as before."""
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        return fd
    try:
        now, held = os.stat(partial), os.fstat(fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def published_by_another(blob: Blob, quiet: float) -> Path | None:
    """`blob` (busy: another run fills it), complete under its final name once that run has published it;
    None where that run ended without publishing it, or stored nothing for `quiet` seconds (its range log
    did not grow): then the caller fetches what it needs itself. Its bytes were checked by that run against
    the sha256 they are named by, and the caller's own hash checks them again."""
    last, since = -1, time.monotonic()
    told = since + 5
    while True:
        if _complete(blob.final, blob.size):
            return blob.final
        try:
            fd = os.open(blob.partial, os.O_RDONLY)
        except FileNotFoundError:  # renamed into place (published) or deleted (discarded)
            return blob.final if _complete(blob.final, blob.size) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return (
                blob.final if _complete(blob.final, blob.size) else None
            )  # not held: that run ended without publishing
        except BlockingIOError:
            pass  # still filled
        except OSError:
            return None  # no locks here: nothing to wait on
        finally:
            os.close(fd)
        try:
            grown = blob.log.stat().st_size
        except OSError:
            grown = last
        now = time.monotonic()
        if grown != last:
            last, since = grown, now
        elif now - since > quiet:
            return None
        if now > told:
            told = float("inf")
            note(
                f"waiting for another run filling {blob.partial} in the Hugging Face cache, to read the rest of "
                "that file for its sha256 from there rather than download it again"
            )
        time.sleep(0.05)


def read_from(path: Path) -> Callable[[int, memoryview], None]:
    """`read(pos, out)`: bytes [pos, pos + len(out)) of the file at `path`."""

    def read(pos: int, out: memoryview) -> None:
        with open(path, "rb", buffering=0) as f:
            f.seek(pos)
            got = 0
            while got < len(out):
                n = f.readinto(out[got:])
                if not n:
                    raise SourceError(f"{path}: truncated while read", "run again")
                got += n

    return read


def _complete(final: Path, size: int) -> bool:
    """Whether the blob's final file is there, of its size (published: it was checked before its rename)."""
    try:
        return final.is_file() and final.stat().st_size == size
    except OSError:
        return False
