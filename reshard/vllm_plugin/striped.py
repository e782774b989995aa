"""Rank files read straight into CPU parameters by several streams at once, hashed in order.

(`reshard.vllm_plugin.reader` chooses the files; see its docstring for how and why.)
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import math
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, Protocol

import torch

import reshard.io.direct as direct
from reshard.format import open_regular
from reshard.hashing import new_hasher
from reshard.io.direct import ALIGN

if TYPE_CHECKING:
    from reshard.vllm_plugin.checks import RankFile

CHUNK = 32 * 1024 * 1024  # a file's unit of reading and hashing (also of the front-to-back reads)
BOUNCE = 8 * 1024 * 1024  # an O_DIRECT read's page-aligned buffer, one per stream
IOV_MAX = 1024  # buffers per preadv

Count = Callable[[int], None]


class Source(Protocol):
    """Where rank files are read from when not a local folder."""

    def open(self, rf: RankFile, start: int = 0, end: int | None = None) -> BinaryIO:
        """Bytes [start, end) of `rf` as a stream (readinto, name, a context manager); its failures
        are OSError, a premature end EOFError."""
        ...

    def where(self, rf: RankFile) -> str:
        """`rf` as messages name it."""
        ...


class Hasher(Protocol):
    def update(self, piece: memoryview | bytes) -> None: ...


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class FileRead:
    """A rank file read by `streams` threads (`read_stripe(j)` each, j in `stripes()`) in chunks of
    `chunk_size()` bytes, and hashed in order by a thread of its own when `algorithm`: once chunk c
    is in place its stream sets `ready[c]`, and the hash thread `hash_chunk(c)`s it. Local files:
    stream j reads chunks j, j + streams, ...; from a `source`: stream j the contiguous stripe of
    chunks [bounds[j], bounds[j + 1]) (one ranged GET). Subclasses say where the bytes go (`place`,
    given the parameters by name) and how a chunk is hashed."""

    def __init__(
        self,
        rf: RankFile,
        targets: dict[str, torch.Tensor],
        algorithm: str | None,
        streams: int,
        source: Source | None = None,
        o_direct: bool = False,
    ) -> None:
        self.rf = rf
        self.source = source
        self.chunk = chunk = self.chunk_size()
        self.chunks = max(1, math.ceil(rf.size / chunk))
        self.streams = max(1, min(streams, self.chunks))
        self.bounds = [j * self.chunks // self.streams for j in range(self.streams + 1)]
        self.o_direct = o_direct and source is None and chunk % ALIGN == 0
        self.direct_chunks = [0] * self.streams  # per stream: chunks read with O_DIRECT
        self.ready = [threading.Event() for _ in range(self.chunks)]
        self.failed = False
        self.hasher = new_hasher(algorithm) if algorithm and rf.digest else None
        self.hexdigest: str | None = None
        self.error: BaseException | None = None  # the hash thread's, if it failed
        self.hash_thread: threading.Thread | None = None
        self.place(targets)
        if self.hasher is not None:
            self.hash_thread = threading.Thread(target=self._hash, name="reshard-hash", daemon=True)
            self.hash_thread.start()

    @staticmethod
    def chunk_size() -> int:
        raise NotImplementedError

    def place(self, targets: dict[str, torch.Tensor]) -> None:
        """Say where the file's bytes go: `targets`, the parameters by name."""
        raise NotImplementedError

    def stripes(self) -> list[int]:
        return list(range(self.streams))

    def hash_chunk(self, c: int) -> None:
        raise NotImplementedError

    def _hash(self) -> None:
        assert self.hasher is not None
        try:
            for c in range(self.chunks):
                self.ready[c].wait()
                if self.failed:
                    return
                self.hash_chunk(c)
            self.hexdigest = self.hasher.hexdigest()
        except BaseException as e:  # never a file taken as verified for want of a digest, nor a stream left waiting
            self.error = e
            self.fail()

    def fail(self) -> None:
        """Stop the file's streams and its hash thread (a read failed)."""
        self.failed = True
        for e in self.ready:
            e.set()

    def digest(self) -> str | None:
        """The file's digest once its streams are done (None: not hashed, or a read failed); the
        hash thread's error if it failed."""
        if self.hash_thread is None:
            return None
        self.hash_thread.join()
        if self.error is not None:
            raise self.error
        return None if self.failed else self.hexdigest


class Striped(FileRead):
    """A file read straight into CPU parameters (see `FileRead`: `targets` the parameters by name,
    contiguous and of the recorded shapes), with O_DIRECT when `o_direct` through a bounce buffer
    per stream."""

    @staticmethod
    def chunk_size() -> int:
        return CHUNK

    def place(self, targets: dict[str, torch.Tensor]) -> None:
        # the file as (offset, memory) segments, back to back: the header, then every tensor
        self.segments: list[tuple[int, memoryview]] = [(0, memoryview(bytearray(self.rf.header_bytes)))]
        for info in self.rf.tensors:
            if info.nbytes:
                self.segments.append((info.offset, memoryview(byte_view(targets[info.name]).numpy())))
        self.starts = [off for off, _ in self.segments]

    def _views(self, c: int) -> list[memoryview]:
        """The memory of file bytes [c * chunk, (c + 1) * chunk), in order."""
        a, b = c * self.chunk, min(self.rf.size, (c + 1) * self.chunk)
        out = []
        for i in range(max(0, bisect.bisect_right(self.starts, a) - 1), len(self.segments)):
            off, mem = self.segments[i]
            if off >= b:
                break
            end = off + len(mem)
            if end > a:
                out.append(mem[max(a, off) - off : min(b, end) - off])
        return out

    def read_stripe(self, j: int, count: Count) -> None:
        try:
            if self.source is not None:
                self._stream_stripe(j, count)
                return
            fd = open_regular(self.rf.path, follow=False)  # what check_files checked, not a link put there since
            bounce = None  # O_DIRECT's read buffer
            try:
                if self.o_direct and direct.enable(fd):
                    bounce = direct.buffer(BOUNCE)
                if bounce is None:
                    with contextlib.suppress(AttributeError, OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for c in range(j, self.chunks, self.streams):
                    if self.failed:
                        return
                    if bounce is not None:
                        try:
                            end = min(self.rf.size, (c + 1) * self.chunk)
                            direct.read_into(fd, c * self.chunk, end, self._views(c), bounce, self.rf.path.name)
                            count(end - c * self.chunk)
                            self.direct_chunks[j] += 1
                            self.ready[c].set()
                            continue
                        except OSError as e:  # O_DIRECT refused here after all: read through the cache
                            if e.errno != errno.EINVAL:
                                raise
                            direct.disable(fd)
                            bounce = None  # (unmapped when the failed read's views are gone)
                    self._read_chunk(fd, c, count)
                    self.ready[c].set()
            finally:
                os.close(fd)
        except BaseException:
            self.fail()
            raise

    def _read_chunk(self, fd: int, c: int, count: Count) -> None:
        views, pos = self._views(c), c * self.chunk
        while views:
            got = os.preadv(fd, views[:IOV_MAX], pos)
            if got <= 0:
                raise EOFError(f"{self.rf.path.name}: ended early")
            count(got)
            pos += got
            while views and got >= len(views[0]):
                got -= len(views.pop(0))
            if got:
                views[0] = views[0][got:]

    def _stream_stripe(self, j: int, count: Count) -> None:
        assert self.source is not None
        first, end = self.bounds[j], self.bounds[j + 1]
        with self.source.open(self.rf, first * self.chunk, min(self.rf.size, end * self.chunk)) as f:
            for c in range(first, end):
                if self.failed:
                    return
                for view in self._views(c):
                    read_exact(f, view, None, count)
                self.ready[c].set()

    def hash_chunk(self, c: int) -> None:
        assert self.hasher is not None
        for v in self._views(c):
            self.hasher.update(v)


def read_exact(f, view: memoryview, hasher: Hasher | None, count: Count) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = f.readinto(view[pos : pos + CHUNK])
        if not got:
            raise EOFError(f"{f.name}: ended early")
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        count(got)
        pos += got
