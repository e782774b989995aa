"""Where output bytes go: the `Sink` protocol, and `FileWriter`, the sink that writes a file to disk.

A file is written sequentially and hashed on the fly through two aligned staging buffers per open
file: the writer thread gathers into one and hashes it while the file's I/O thread writes the
other with O_DIRECT where the filesystem allows it (RESHARD_O_DIRECT=0: buffered). Large
contiguous writes whose memory lines up with the file (page offsets equal: the executor's headers
are page-padded and its read buffers page-aligned) skip the stage: hashed and written from the
caller's buffer. Smaller ones that line up (whole experts, row splits of an MoE at TP 8) are held
(`write_held`: the caller's lease keeps their memory) and go to disk with the stage in one
vectored write, again without a copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from reshard import settings
from reshard.hashing import new_hasher
from reshard.io.memory import ALIGN, Lease, aligned_buffer
from reshard.outdir import write_error

if TYPE_CHECKING:
    from reshard.plan import OutTensor

STAGE_BYTES = 4 * 1024 * 1024  # per output file (x2): staged, hashed and written this many bytes at a time
WRITEBACK_BYTES = 32 * 1024 * 1024  # buffered writes: start writeback every this many bytes
THROUGH_MIN = 1024 * 1024  # contiguous writes from this size may skip the stage (see FileWriter.write)
THROUGH_SEGMENT = 8 * 1024 * 1024  # ... hashed and written this many bytes at a time
NUMPY_COPY = 64 * 1024  # copies into the stage from this size go through numpy, which releases the GIL
HELD_MIN = 64 * 1024  # smaller aligned contiguous writes may be held (see FileWriter.write_held) ...
HELD_MAX_IOV = 256  # ... this many pieces at most in one vectored write
IOV_MAX = 1024  # buffers per writev


@dataclass(frozen=True)
class Written:
    """A finished output file: its name, size and digest (None: not hashed, `--checksum none`)."""

    name: str
    size: int
    digest: str | None


class Sink(Protocol):
    """Where one output file's bytes go, in order: a file on disk, or a checker (verify --deep).

    A sink's methods are called in order from one writer thread (not the caller's thread; the sinks
    of different files run at the same time). `write` gets contiguous bytes that stay valid only
    until it returns. Sinks subclass `Sink`: the last three methods are optional capabilities, and
    their defaults here are what a sink that lacks them does.
    """

    def begin(self, tensor: OutTensor) -> None: ...
    def write(self, data: memoryview | bytes) -> None: ...
    def close(self, sync: bool) -> Written: ...
    def abort(self) -> None: ...

    def write_array(self, arr: np.ndarray) -> None:
        """Write a strided array's bytes in C order (uint8, or wider words: reshard.batch.wide). Default: copied out a block of rows at a
        time (STAGE_BYTES, or one row) and each block given to `write`; a sink that gathers straight
        into its own buffer (FileWriter) saves that copy."""
        if not arr.nbytes:
            return
        row = arr[0].nbytes
        step = max(1, STAGE_BYTES // row)
        stage = np.empty(min(step, arr.shape[0]) * row, np.uint8)
        for r0 in range(0, arr.shape[0], step):
            part = arr[r0 : r0 + step]
            dst = stage[: part.nbytes].view(arr.dtype).reshape(part.shape)
            np.copyto(dst, part)
            self.write(memoryview(dst).cast("B"))

    def write_held(self, view: memoryview, lease: Lease) -> None:
        """`write` for contiguous bytes whose memory `lease` keeps: the sink may hold the piece (with
        a reference on `lease`) rather than copy it, until `flush_held` or `close`. Default: `write`."""
        self.write(view)

    def flush_held(self, if_short: bool = False) -> None:
        """Write what is held now (memory is short); `if_short`: only if a thread waits for memory
        now. Default: nothing is ever held."""

    def drop_held(self) -> None:
        """The sink failed: give back the leases of what it holds, unwritten. Default: none held."""


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE): start writeback, don't wait."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; only a hint, failures are ignored

    return start_writeback


_START_WRITEBACK = _sync_file_range()


def _no_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


class FileWriter(Sink):
    """An output file written in order and hashed on the fly, through two aligned staging buffers.

    The writer thread gathers into one stage and hashes it, while this file's I/O thread writes the
    other: hashing never waits for the disk. With O_DIRECT (where the filesystem takes it) stages go
    from the buffer to the disk with no page-cache copy and no dirty-page throttling; the kernel's
    CPU time for writing drops ~10x, which counts when sha256 already keeps a core busy. The last
    partial block is written padded, then the file is truncated to its size. Elsewhere: buffered
    writes, with writeback started every WRITEBACK_BYTES so that the final fsync has little left.
    """

    def __init__(self, path: Path, header: bytes, checksum: str) -> None:
        self.path = path
        self.fd = -1
        self.direct = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            if settings.O_DIRECT.get() and hasattr(os, "O_DIRECT"):
                with contextlib.suppress(OSError):
                    self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
                    self.direct = True
            if self.fd < 0:
                self.fd = os.open(path, flags, 0o666)
        except OSError as e:
            raise write_error(path, e) from e
        self.hasher = new_hasher(checksum)
        self.size = 0  # bytes written or staged
        self.flushed = 0  # bytes handed to writeback (buffered mode)
        self.bufs = [aligned_buffer(STAGE_BYTES), aligned_buffer(STAGE_BYTES)]
        self.views = [memoryview(b) for b in self.bufs]
        self.arrays = [np.frombuffer(b, np.uint8) for b in self.bufs]
        self.cur = 0
        self.stage, self.array = self.views[0], self.arrays[0]
        self.fill = 0
        self.padded = False
        # what the next flush writes before the stage's bytes [seg, fill): held pieces and earlier
        # stage segments, in file order, and the leases that keep the held pieces' memory
        self.iov: list[memoryview] = []
        self.leases: list[Lease] = []
        self.held = 0
        self.seg = 0
        self.io = ThreadPoolExecutor(1, thread_name_prefix="reshard-io")
        self.pending: Future | None = None
        self.write(header)

    def begin(self, tensor: OutTensor) -> None:
        pass

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if n >= THROUGH_MIN and (not self.direct or (_address(view) - self.size) % ALIGN == 0):
            self._write_through(view)
            return
        self._stage_bytes(view)

    def write_held(self, view: memoryview, lease: Lease) -> None:
        """`write`, but a contiguous piece whose memory lines up with the file may be held, not
        copied: `lease` (whose memory `view` is) gets a reference of the writer's until the piece is
        on disk. Held pieces go out with the next flush, or at `flush_held`."""
        n = view.nbytes
        lined_up = n % ALIGN == 0 and self.size % ALIGN == 0 and _address(view) % ALIGN == 0
        if not (self.direct and HELD_MIN <= n < THROUGH_MIN and lined_up):
            self.write(view)
            return
        if self.fill > self.seg:  # the stage's bytes so far go first (they end on a block)
            self.iov.append(self.stage[self.seg : self.fill])
            self.seg = self.fill
        lease.hold()
        self.leases.append(lease)
        self.iov.append(view)
        self.held += n
        self.size += n
        if self.held >= THROUGH_SEGMENT or len(self.iov) >= HELD_MAX_IOV:
            self._flush_held()

    def flush_held(self, if_short: bool = False) -> None:
        """Write what is held now (the executor's memory is short: give its leases back soon);
        `if_short`: only if a thread waits for memory now."""
        if self.leases and (not if_short or self.leases[-1].short()):
            self._flush_held()

    def drop_held(self) -> None:
        """The file failed (it will be aborted): give back the held pieces' leases now."""
        leases, self.leases = self.leases, []
        self.iov, self.held = [], 0
        for lease in leases:
            lease.release()

    def _stage_bytes(self, view: memoryview) -> None:
        """Copy into the stage, flushing every full one: by numpy from NUMPY_COPY bytes (it lets the
        other threads run while it copies; a memoryview copy holds the GIL)."""
        n, pos = view.nbytes, 0
        self.size += n
        while pos < n:
            k = min(n - pos, STAGE_BYTES - self.fill)
            part = view[pos : pos + k] if k < n else view
            if k < NUMPY_COPY:
                self.stage[self.fill : self.fill + k] = part
            else:
                np.copyto(self.array[self.fill : self.fill + k], np.frombuffer(part, np.uint8))
            self.fill += k
            pos += k
            if self.fill == STAGE_BYTES:
                self._flush()

    def _write_through(self, view: memoryview) -> None:
        """Write `view` from its own memory: no copy into a stage.

        With O_DIRECT, `view`'s address and the file position are equal modulo ALIGN: the bytes up
        to the next aligned file position go through the stage, which is then written (it ends at
        an aligned position: no padding), the whole blocks after it straight from `view`, and the
        rest into the next stage. Segments are hashed while the previous one is written; returns
        once all are written (`view`'s memory is the caller's again)."""
        n = view.nbytes
        head = min(n, -self.size % ALIGN) if self.direct else 0
        if head:
            self._stage_bytes(view[:head])
        end = head + (n - head) // ALIGN * ALIGN if self.direct else n
        if end > head and (self.fill or self.iov):
            self._flush()
        for a in range(head, end, THROUGH_SEGMENT):
            part = view[a : min(a + THROUGH_SEGMENT, end)]
            self.hasher.update(part)
            self.size += part.nbytes
            self._wait()
            self.pending = self.io.submit(self._write_out, [part], self.size)
        self._wait()
        if end < n:
            self._stage_bytes(view[end:])

    def write_array(self, arr: np.ndarray) -> None:
        """Write a strided array's bytes (uint8, or wider words) in C order, gathering it straight
        into the stage."""
        if not arr.nbytes:
            return
        rows, row = arr.shape[0], arr[0].nbytes
        r = 0
        while r < rows:
            k = min(rows - r, (STAGE_BYTES - self.fill) // row)
            if k == 0:  # the next row straddles the end of the stage (or is larger than it)
                self.write(np.ascontiguousarray(arr[r]).reshape(-1))
                r += 1
                continue
            dst = self.array[self.fill : self.fill + k * row].view(arr.dtype).reshape((k, *arr.shape[1:]))
            np.copyto(dst, arr[r : r + k])
            self.fill += k * row
            self.size += k * row
            r += k
            if self.fill == STAGE_BYTES:
                self._flush()

    def _flush(self) -> None:
        """Hash what is pending (held pieces, then the stage's bytes), hand it to the I/O thread and
        switch to the other stage (once it is free).

        Whole blocks, except at the end: padded, and truncated in close()."""
        pad = -self.fill % ALIGN if self.direct else 0
        if pad:
            self.stage[self.fill : self.fill + pad] = bytes(pad)
            self.padded = True
        if self.fill > self.seg:
            self.iov.append(self.stage[self.seg : self.fill + pad])
        self._submit(self.size, pad)
        self.cur ^= 1
        self.stage, self.array = self.views[self.cur], self.arrays[self.cur]
        self.fill = self.seg = 0

    def _flush_held(self) -> None:
        """Hash and hand to the I/O thread the held pieces and the stage's bytes before them; the
        stage's later bytes stay (in a region of the stage that this write does not touch)."""
        self._submit(self.size - (self.fill - self.seg))

    def _submit(self, end: int, pad: int = 0) -> None:
        """Hash `self.iov` (the last `pad` bytes are padding) and have it written; `end`: the file
        position after it, unpadded."""
        iov, leases = self.iov, self.leases
        self.iov, self.leases, self.held = [], [], 0
        for v in iov[:-1]:
            self.hasher.update(v)
        if iov:
            self.hasher.update(iov[-1][: iov[-1].nbytes - pad])
        try:
            self._wait()
        except BaseException:  # the previous write failed: these held pieces will never be written
            for lease in leases:
                lease.release()
            raise
        self.pending = self.io.submit(self._write_out, iov, end, leases)

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _write_out(self, bufs: list[memoryview], size: int, leases: Sequence[Lease] = ()) -> None:
        """On the I/O thread: write `bufs` at the file position (the writes are sequential), then
        give back the leases of the held pieces among them."""
        try:
            while bufs:
                try:
                    n = os.writev(self.fd, bufs[:IOV_MAX])
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL):
                        raise
                    _no_direct(self.fd)  # the filesystem took O_DIRECT at open, not for writes
                    self.direct = False
                    continue
                if n == 0:
                    raise OSError(errno.EIO, "write returned 0")
                while bufs and n >= bufs[0].nbytes:
                    n -= bufs.pop(0).nbytes
                if n:
                    bufs[0] = bufs[0][n:]
        except OSError as e:
            raise write_error(self.path, e) from e
        finally:
            for v in bufs:
                v.release()
            for lease in leases:
                lease.release()
        if not self.direct and _START_WRITEBACK is not None and size - self.flushed >= WRITEBACK_BYTES:
            _START_WRITEBACK(self.fd, self.flushed, size - self.flushed)
            self.flushed = size

    def close(self, sync: bool) -> Written:
        try:
            if self.fill or self.iov:
                self._flush()
            self._wait()
            if self.padded:
                os.ftruncate(self.fd, self.size)  # drop the last block's padding
            if sync:
                os.fsync(self.fd)
            fd, self.fd = self.fd, -1
            os.close(fd)
        except OSError as e:
            raise write_error(self.path, e) from e
        finally:
            self._free()
        return Written(self.path.name, self.size, self.hasher.hexdigest())

    def abort(self) -> None:
        with contextlib.suppress(BaseException):
            self._wait()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        self._free()

    def _free(self) -> None:
        self.pending = None
        self.iov = []
        leases, self.leases = self.leases, []
        for lease in leases:  # held pieces never submitted (an abort)
            lease.release()
        self.io.shutdown(wait=True)
        for v in self.views:
            v.release()
        self.stage = self.array = None
        self.arrays = []
        for b in self.bufs:
            with contextlib.suppress(BufferError):
                b.close()


def _address(view: memoryview) -> int:
    """Where a contiguous buffer's first byte lies in memory."""
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0
