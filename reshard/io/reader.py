"""Reading source tensors' bytes from local safetensors files.

`FileReader` is the `reshard.checkpoint.Reader` of a local checkpoint folder. It is also an
`AlignedReader`: it can say ahead of a read how much page-aligned memory the read needs, so that
the prefetching threads (`reshard.io.prefetch`) can read into reused aligned buffers with O_DIRECT.
Other readers (a reshard output as SOURCE) implement `Reader` only.

Which files are read with O_DIRECT (RESHARD_DIRECT_READS): `auto` (default) those mostly not in
the page cache (asked without reading: `reshard.io.direct.cached_share`), `1` all, `0` none. A file
in the cache is copied out of it (the fastest read there is); a file that is not costs, through the
page cache, the kernel's allocation and copy of every page besides the disk's time (on the benchmark
machine 1.5-4 CPU seconds per GB against 0.9 with O_DIRECT, in the same wall time), and evicts the
user's cache.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from reshard import settings
from reshard.errors import SourceError, unreadable_source
from reshard.format import TensorInfo
from reshard.io.direct import ALIGN, cached_share, wants_direct


def runs(begins: Sequence[int], nbytes: int, files: Sequence[str] | None = None) -> Iterator[tuple[int, int]]:
    """[i, j) of each run of reads of `nbytes` each (starting at `begins`, in `files` where given)
    that follow each other in their file: what one read, or one copy, can take."""
    n, i = len(begins), 0
    while i < n:
        j = i + 1
        while j < n and begins[j] == begins[j - 1] + nbytes and (files is None or files[j] == files[i]):
            j += 1
        yield i, j
        i = j


def offsets(reads: Sequence[ByteRange]) -> list[int]:
    """Where each read begins in its file (reads that know their columns, `reshard.schedule.Group`,
    say so without a record each)."""
    own = getattr(reads, "offsets", None)
    return own() if own is not None else [r.info.offset + r.start for r in reads]


def files(reads: Sequence[ByteRange]) -> list[str]:
    """The file each read reads (as `offsets`)."""
    own = getattr(reads, "files", None)
    return own() if own is not None else [r.info.file for r in reads]


def sizes(reads: Sequence[ByteRange]) -> list[int]:
    """The bytes of each read (as `offsets`)."""
    own = getattr(reads, "sizes", None)
    return own() if own is not None else [r.nbytes for r in reads]


class Prepared(NamedTuple):
    """How to make one read: with `fd` (an O_DIRECT descriptor; None: the ordinary read) from
    file offset `offset`, into a region of `size` bytes. (A named tuple: one per read, ~200k in an
    MoE save, and a frozen dataclass costs twice as much to make.)"""

    fd: int | None
    offset: int
    size: int


class ByteRange(Protocol):
    """One read: bytes [start, start + nbytes) of a source tensor."""

    @property
    def info(self) -> TensorInfo: ...
    @property
    def start(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


class AlignedReader(abc.ABC):
    """A `Reader` whose reads can be prepared: sized first, then made into a region the caller
    allocates (page-aligned). Readers declare it by subclassing."""

    threads: int | None = None  # reads in flight it wants (a Hub reader: its connections); None: the prefetcher's

    @abc.abstractmethod
    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        """Bytes [start, start + nbytes) of tensor `t`, into `buf` if given (see `Reader.read`)."""

    @abc.abstractmethod
    def prepare(self, t: TensorInfo, start: int, nbytes: int) -> Prepared:
        """Open what reading these bytes needs; say how to read them and how large a region to give."""

    @abc.abstractmethod
    def read_prepared(
        self, t: TensorInfo, start: int, nbytes: int, prepared: Prepared, region: memoryview
    ) -> memoryview:
        """Read as `prepared` says, into `region` (of `prepared.size` bytes); a view of the bytes."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def inline(self, file: str) -> bool:
        """Whether `file`'s reads are best made by the thread that uses them (`read_batch`), with no
        read-ahead. Default: no."""
        return False

    def read_batch(self, reads: Sequence[ByteRange], out: memoryview, nbytes: int) -> None:
        """Reads of `nbytes` each, of files `inline` said yes to, one after the other into `out`."""
        raise NotImplementedError

    # a read may be a stretch of a file that holds several tensors (`reshard.spans`), read as one
    # (`prepare`, `read_prepared`: its first tensor's, from a start within it, past its end)
    reads_spans = False

    def expect(self, reads: Sequence[ByteRange]) -> None:
        """The reads to come, in order, told before the first is made (a Hub
        reader fetches bytes that several of them use once: reshard.sources.hubshare). Default: nothing."""
        return None


class FileReader(AlignedReader):
    """Positioned reads from a checkpoint folder's safetensors files (thread-safe once files are
    open; `prepare` is called by one thread at a time)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.direct_fds: dict[str, int | None] = {}
        self.stale: list[int] = []
        self.lock = threading.Lock()
        self.inlined: dict[str, bool] = {}  # file -> `inline`
        self.mode = settings.DIRECT_READS.get()  # "auto", "1" or "0"

    def fd(self, name: str) -> int:
        if name not in self.fds:
            try:
                self.fds[name] = os.open(self.root / name, os.O_RDONLY)
            except OSError as e:
                raise SourceError(
                    f"cannot open {self.root / name}: {e.strerror}",
                    "the source changed during the run: rerun on a stable copy",
                ) from e
        return self.fds[name]

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        out = memoryview(buf)[:nbytes] if buf is not None else memoryview(bytearray(nbytes))
        try:
            self._fill(self.fd(t.file), t, t.offset + start, out, nbytes)
        except OSError as e:
            raise self._read_error(t, e) from e
        return out

    def _read_error(self, t: TensorInfo, e: OSError) -> SourceError:
        return unreadable_source(self.root / t.file, e)

    def prepare(self, t: TensorInfo, start: int, nbytes: int) -> Prepared:
        """With O_DIRECT: the block-aligned span around the bytes, into page-aligned memory."""
        fd = self.direct_fds.get(t.file, -1)
        if fd == -1:  # the file's first read: open it, and choose
            self.fd(t.file)
            fd = self._direct_fd(t.file)
        pos = t.offset + start
        if fd is None:
            return Prepared(None, pos, nbytes)
        a0 = pos // ALIGN * ALIGN
        return Prepared(fd, a0, -(-(pos + nbytes) // ALIGN) * ALIGN - a0)

    def read_prepared(
        self, t: TensorInfo, start: int, nbytes: int, prepared: Prepared, region: memoryview
    ) -> memoryview:
        fd, a0 = prepared.fd, prepared.offset
        pos = t.offset + start
        if fd is None:  # the ordinary read, inline (most reads of a cached MoE checkpoint: ~200k)
            out = region[:nbytes]
            try:
                if os.preadv(self.fds[t.file], [out], pos) < nbytes:
                    self._fill(self.fds[t.file], t, pos, out, nbytes)
            except OSError as e:  # EIO, a stale or disconnected mount: the source, not OUT_DIR
                raise self._read_error(t, e) from e
            return out
        try:
            self._fill(fd, t, a0, region, pos + nbytes - a0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise self._read_error(t, e) from e
            self._refused(t.file, fd)
            return self.read(t, start, nbytes, region[:nbytes])
        return region[pos - a0 : pos - a0 + nbytes]

    def inline(self, file: str) -> bool:
        """A file read through the page cache and mostly in it: a uniform step's many small reads
        (an MoE layer's experts) are copied out of the cache straight into the batch buffer
        (`read_batch`), without the reader threads' hand-over and second copy: at 200k reads of a
        few KB those, not the bytes, were the save's critical path (issue 28)."""
        if file not in self.inlined:
            self.fd(file)
            share = cached_share(self.root / file)
            self.inlined[file] = self._direct_fd(file) is None and share is not None and share >= 0.5
        return self.inlined[file]

    def read_batch(self, reads: Sequence[ByteRange], out: memoryview, nbytes: int) -> None:
        """One `preadv` per run of reads that follow each other in their file (a layer's experts'
        gate and up projections lie side by side), straight into their places in `out`."""
        begins = offsets(reads)
        for i, j in runs(begins, nbytes, files(reads)):
            info, pos, dst = reads[i].info, begins[i], out[i * nbytes : j * nbytes]
            fd = self.fds[info.file]
            try:
                if os.preadv(fd, [dst], pos) < len(dst):
                    self._fill(fd, info, pos, dst, len(dst))
            except OSError as e:
                raise self._read_error(info, e) from e

    reads_spans = True

    def _refused(self, name: str, fd: int) -> None:
        """O_DIRECT descriptor `fd` of `name` had a read refused (EINVAL): read through the page cache from now on."""
        with self.lock:
            if self.direct_fds.get(name) == fd:
                self.direct_fds[name] = None
                self.stale.append(fd)

    def _direct_fd(self, name: str) -> int | None:
        if name not in self.direct_fds:
            fd = None
            if hasattr(os, "O_DIRECT") and self._wants_direct(name):
                with contextlib.suppress(OSError):
                    fd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECT)
            self.direct_fds[name] = fd
        return self.direct_fds[name]

    def _wants_direct(self, name: str) -> bool:
        return wants_direct(self.root / name, self.mode)

    @staticmethod
    def _fill(fd: int, t: TensorInfo, pos: int, out: memoryview, need: int) -> None:
        """Read into `out` from `pos` until at least `need` bytes (EOF may cut the rest of `out`)."""
        got = 0
        while got < need:
            n = os.preadv(fd, [out[got:]], pos + got)
            if n == 0:
                raise SourceError(f"{t.file}: truncated while reading {t.name}", "download it again")
            got += n

    def close(self) -> None:
        for fd in [*self.fds.values(), *self.direct_fds.values(), *self.stale]:
            if fd is not None:
                os.close(fd)
        self.fds.clear()
        self.direct_fds.clear()
        self.stale.clear()
