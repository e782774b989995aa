"""Bytes a file's sha256 has not reached yet, kept on disk rather than fetched a second time.

A `--stream` save reads a Hub file's tensors in its own order (an MoE release holds expert 10 before
expert 2); its sha256 must take the file in order (reshard.sources.prefixhash). What the hash is not
at yet is held in memory up to prefixhash.PENDING bytes per file; beyond that it was fetched again at
the end. `Spill` keeps those bytes in a scratch folder instead, at most RESHARD_STREAM_SPILL bytes on
disk in all (default 8 GiB; 0: none), and gives them back to the hash when it gets there: the bytes
hashed are the bytes the save used, read back from this run's own file.

Each source file spills into its own append-only file, emptied (truncated) whenever none of its
bytes is waiting, and removed at the end. Nothing spills where the temp folder (TMPDIR) is in memory
(tmpfs: it would count against RAM, not disk), nor beyond half the folder's free space; a write
that fails (ENOSPC) ends spilling (one note). What the spill does not keep is held in memory as
without one (PENDING per file), and beyond that fetched again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

from reshard.console import note
from reshard.errors import SourceError
from reshard.scratch import make_scratch_dir

IN_MEMORY = ("tmpfs", "ramfs")


def filesystem(path: str) -> str | None:
    """The type of the file system holding `path` (/proc/self/mounts' longest mount point above it)."""
    real = os.path.realpath(path)
    best, kind = "", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def usable(budget: int) -> tuple[int, str | None]:
    """The bytes to spill at most (`budget`, within half the temp folder's free space), and why none
    where it is 0 for a reason other than the setting."""
    if budget <= 0:
        return 0, None
    folder = tempfile.gettempdir()
    if filesystem(folder) in IN_MEMORY:
        return 0, f"the temp folder ({folder}) is in memory; set TMPDIR to a folder on disk to keep them there"
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return 0, f"the temp folder ({folder}) cannot be read"
    return min(budget, free // 2), None


class Spill:
    """At most `budget` bytes on disk, in one append-only file per key (a source file's name); `why`:
    why none, where the budget is 0 for a reason (`usable`)."""

    def __init__(self, budget: int, why: str | None = None) -> None:
        self.budget = budget
        self.why = why
        self.used = 0  # bytes in the files, all keys
        self.lock = threading.Lock()
        self.folder: Path | None = None
        self.files: dict[str, tuple[int, int]] = {}  # key: (fd, bytes written)
        self.broken = False
        self.peak = 0

    def put(self, key: str, data: memoryview) -> int | None:
        """Append `data` to `key`'s file: where it lies there, or None where it does not fit (or a write
        failed: then nothing spills from now on)."""
        n = len(data)
        with self.lock:
            if self.broken or self.used + n > self.budget:
                return None
            try:
                if self.folder is None:
                    self.folder = make_scratch_dir("spill")
                    self._removal = weakref.finalize(self, shutil.rmtree, self.folder, True)
                if key not in self.files:
                    fd = os.open(self.folder / f"{len(self.files)}.spill", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    self.files[key] = (fd, 0)
            except OSError as e:
                self._break(e)
                return None
            fd, at = self.files[key]
            self.files[key] = (fd, at + n)
            self.used += n
            self.peak = max(self.peak, self.used)
        try:
            done = 0
            while done < n:
                done += os.pwrite(fd, data[done:], at + done)
        except OSError as e:
            with self.lock:
                self._break(e)  # the bytes not kept: the caller fetches them again
            return None
        return at

    def _break(self, e: OSError) -> None:
        """No more spilling (said once, in a note)."""
        if self.broken:
            return
        self.broken = True
        where = self.folder or tempfile.gettempdir()
        note(
            f"--stream: cannot keep bytes waiting for the sha256 on disk in {where} ({e.strerror or e}): "
            "those read ahead of their file's hash from now on are held in memory (256 MiB per file) or "
            "fetched a second time; set TMPDIR to a folder with more room"
        )

    def get(self, key: str, at: int, n: int) -> bytearray:
        """The `n` bytes put at `at` in `key`'s file."""
        out = bytearray(n)
        view, done = memoryview(out), 0
        try:
            while done < n:
                got = os.preadv(self.files[key][0], [view[done:]], at + done)
                if got <= 0:
                    raise OSError(f"{n - done} bytes short")
                done += got
        except OSError as e:
            raise SourceError(f"cannot read back the spilled bytes of {key} from {self.folder}: {e}") from e
        return out  # not copied again into bytes: a range may be a chunk of 32 MiB

    def empty(self, key: str) -> None:
        """None of `key`'s bytes is waiting any more: its file emptied, its bytes free again."""
        with self.lock:
            fd, at = self.files.get(key, (None, 0))
            if fd is None or not at:
                return
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            self.files[key] = (fd, 0)
            self.used -= at

    def close(self) -> None:
        """Remove the files (and their folder)."""
        with self.lock:
            for fd, _ in self.files.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.files.clear()
            self.used = 0
            if self.folder is not None:
                self._removal()
