"""Stream the plan: read each source tensor once, write every rank's files header first.

All ranks advance together through one global tensor order, so each output file is written
sequentially (and hashed on the fly) while each source tensor is read once, in row chunks, and its
rows handed to every rank that needs them. Nothing is assembled whole.

Threads overlap so that a save runs at the disk's speed (docs/benchmarks.md):

- READ_THREADS reader threads read the source ranges ahead, in exactly the order they will be
  used (known from the plan), into reused page-aligned buffers; several reads in flight keep the
  device busy, also through the thousands of small tensors of an MoE checkpoint. Reads go through
  the page cache (kernel read-ahead); RESHARD_DIRECT_READS=1 reads with O_DIRECT instead;
- the main thread takes those chunks in order and hands every rank *views* of its rows: no copy;
- one writer thread per open output file gathers its views (strided column slices included) into
  an aligned staging buffer and hashes it (sha256), while that file's I/O thread writes the
  previous stage with O_DIRECT where the filesystem allows it (RESHARD_O_DIRECT=0: buffered).
  File I/O, numpy copies and hashlib release the GIL, so the writers use every core.

Memory is bounded by `max_memory`: a fixed set of reused chunk buffers (one comes back once every
writer is done with the views into it) plus a byte budget for the rare pieces that are fresh
arrays (dtype casts, up-sampled scales, fills), plus two staging buffers per open output file.
Readers wait for buffers, the main thread for budget; writers never wait on memory, so all waits end.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import math
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from reshard.errors import OutputError, SourceError
from reshard.format import ITEMSIZE, TensorInfo, encode_header
from reshard.plan import Fill, OutFile, OutTensor, Plan, Slice, natural_key

DEFAULT_CHUNK = 32 * 1024 * 1024
DEFAULT_MAX_MEMORY = 512 * 1024 * 1024
MIN_SLAB = 1024 * 1024
STAGE_BYTES = 4 * 1024 * 1024  # per output file (x2): staged, hashed and written this many bytes at a time
ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and buffers
WRITEBACK_BYTES = 32 * 1024 * 1024  # buffered writes: start writeback every this many bytes
USE_O_DIRECT = os.environ.get("RESHARD_O_DIRECT", "1") != "0"
DIRECT_READS = os.environ.get("RESHARD_DIRECT_READS", "0") == "1"
READ_THREADS = 4  # source reads in flight


@dataclass(frozen=True)
class Written:
    name: str
    size: int
    sha256: str


class Sink(Protocol):
    """Where one output file's bytes go, in order: a file on disk, or a checker (verify --deep).

    A sink's methods are called in order from one writer thread (not the caller's thread; the sinks
    of different files run at the same time). `write` gets contiguous bytes that stay valid only
    until it returns.
    """

    def begin(self, tensor: OutTensor) -> None: ...
    def write(self, data: memoryview | bytes) -> None: ...
    def close(self, sync: bool) -> Written: ...
    def abort(self) -> None: ...


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


def _buffer(size: int) -> mmap.mmap:
    """Page-aligned private memory (as O_DIRECT needs), faulted in at once: page by page costs
    ~2x more, and buffers are reused, so they are touched in full anyway."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | getattr(mmap, "MAP_POPULATE", 0)
    try:
        return mmap.mmap(-1, size, flags=flags)
    except (OSError, TypeError, ValueError):
        return mmap.mmap(-1, size)


def _no_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


class _FileWriter:
    """An output file written in order and hashed on the fly, through two aligned staging buffers.

    The writer thread gathers into one stage and hashes it, while this file's I/O thread writes the
    other: hashing never waits for the disk. With O_DIRECT (where the filesystem takes it) stages go
    from the buffer to the disk with no page-cache copy and no dirty-page throttling; the kernel's
    CPU time for writing drops ~10x, which counts when sha256 already keeps a core busy. The last
    partial block is written padded, then the file is truncated to its size. Elsewhere: buffered
    writes, with writeback started every WRITEBACK_BYTES so that the final fsync has little left.
    """

    def __init__(self, path: Path, header: bytes) -> None:
        self.path = path
        self.fd = -1
        self.direct = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            if USE_O_DIRECT and hasattr(os, "O_DIRECT"):
                with contextlib.suppress(OSError):
                    self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
                    self.direct = True
            if self.fd < 0:
                self.fd = os.open(path, flags, 0o666)
        except OSError as e:
            raise _write_error(path, e) from e
        self.sha = hashlib.sha256()
        self.size = 0  # bytes written or staged
        self.flushed = 0  # bytes handed to writeback (buffered mode)
        self.bufs = [_buffer(STAGE_BYTES), _buffer(STAGE_BYTES)]
        self.views = [memoryview(b) for b in self.bufs]
        self.arrays = [np.frombuffer(b, np.uint8) for b in self.bufs]
        self.cur = 0
        self.stage, self.array = self.views[0], self.arrays[0]
        self.fill = 0
        self.padded = False
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
        self.size += n
        if n < STAGE_BYTES - self.fill:
            self.stage[self.fill : self.fill + n] = view
            self.fill += n
            return
        pos = 0
        while pos < n:
            k = min(n - pos, STAGE_BYTES - self.fill)
            self.stage[self.fill : self.fill + k] = view[pos : pos + k]
            self.fill += k
            pos += k
            if self.fill == STAGE_BYTES:
                self._flush()

    def write_array(self, arr: np.ndarray) -> None:
        """Write a strided uint8 array in C order, gathering it straight into the stage."""
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
            dst = self.array[self.fill : self.fill + k * row].reshape((k, *arr.shape[1:]))
            np.copyto(dst, arr[r : r + k])
            self.fill += k * row
            self.size += k * row
            r += k
            if self.fill == STAGE_BYTES:
                self._flush()

    def _flush(self) -> None:
        """Hash the stage, hand it to the I/O thread and switch to the other one (once it is free).

        Whole blocks, except at the end: padded, and truncated in close()."""
        nbytes = self.fill
        self.sha.update(self.stage[:nbytes])
        if self.direct and nbytes % ALIGN:
            pad = -nbytes % ALIGN
            self.stage[nbytes : nbytes + pad] = bytes(pad)
            nbytes += pad
            self.padded = True
        self._wait()
        self.pending = self.io.submit(self._write_out, self.stage[:nbytes], self.size)
        self.cur ^= 1
        self.stage, self.array = self.views[self.cur], self.arrays[self.cur]
        self.fill = 0

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _write_out(self, rest: memoryview, size: int) -> None:
        """On the I/O thread: write a stage at the file position (the writes are sequential)."""
        try:
            while rest.nbytes:
                try:
                    rest = rest[os.write(self.fd, rest) :]
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL):
                        raise
                    _no_direct(self.fd)  # the filesystem took O_DIRECT at open, not for writes
                    self.direct = False
        except OSError as e:
            raise _write_error(self.path, e) from e
        finally:
            rest.release()
        if not self.direct and _START_WRITEBACK is not None and size - self.flushed >= WRITEBACK_BYTES:
            _START_WRITEBACK(self.fd, self.flushed, size - self.flushed)
            self.flushed = size

    def close(self, sync: bool) -> Written:
        try:
            if self.fill:
                self._flush()
            self._wait()
            if self.padded:
                os.ftruncate(self.fd, self.size)  # drop the last block's padding
            if sync:
                os.fsync(self.fd)
            fd, self.fd = self.fd, -1
            os.close(fd)
        except OSError as e:
            raise _write_error(self.path, e) from e
        finally:
            self._free()
        return Written(self.path.name, self.size, self.sha.hexdigest())

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
        self.io.shutdown(wait=True)
        for v in self.views:
            v.release()
        self.stage = self.array = None
        self.arrays = []
        for b in self.bufs:
            with contextlib.suppress(BufferError):
                b.close()


def _write_error(path: Path, e: OSError) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {path.name}", "free space or choose another OUT_DIR")
    return OutputError(f"cannot write {path}: {e.strerror}")


def file_header(f: OutFile, metadata: dict[str, str]) -> bytes:
    return encode_header([(t.name, t.dtype, t.shape) for t in f.tensors], metadata)


class SourceReader:
    """Positioned reads from the checkpoint's safetensors files (thread-safe once files are open)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.direct_fds: dict[str, int | None] = {}
        self.stale: list[int] = []
        self.bytes_read = 0
        self.lock = threading.Lock()

    def fd(self, name: str) -> int:
        if name not in self.fds:
            try:
                self.fds[name] = os.open(self.root / name, os.O_RDONLY)
            except OSError as e:
                raise SourceError(f"cannot open {self.root / name}: {e.strerror}") from e
        return self.fds[name]

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        out = memoryview(buf)[:nbytes] if buf is not None else memoryview(bytearray(nbytes))
        self._fill(self.fd(t.file), t, t.offset + start, out, nbytes)
        with self.lock:
            self.bytes_read += nbytes
        return out

    def prepare(self, t: TensorInfo, start: int, nbytes: int) -> tuple[int | None, int, int]:
        """Open what reading these bytes needs; return (O_DIRECT fd or None, file offset, size to
        allocate): with O_DIRECT, the block-aligned span around them, into page-aligned memory."""
        self.fd(t.file)
        fd = self._direct_fd(t.file)
        pos = t.offset + start
        if fd is None:
            return None, pos, nbytes
        a0 = pos // ALIGN * ALIGN
        return fd, a0, -(-(pos + nbytes) // ALIGN) * ALIGN - a0

    def read_prepared(self, t: TensorInfo, start: int, nbytes: int, prepared: tuple, region: memoryview) -> memoryview:
        """Read as `prepare` said, into `region` (of the size it gave); a view of the bytes."""
        fd, a0, _ = prepared
        pos = t.offset + start
        if fd is None:
            return self.read(t, start, nbytes, region)
        try:
            self._fill(fd, t, a0, region, pos + nbytes - a0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise SourceError(f"cannot read {self.root / t.file}: {e.strerror}") from e
            with self.lock:  # O_DIRECT refused for reads: buffered from now on
                if self.direct_fds.get(t.file) == fd:
                    self.direct_fds[t.file] = None
                    self.stale.append(fd)
            return self.read(t, start, nbytes, region[:nbytes])
        with self.lock:
            self.bytes_read += nbytes
        return region[pos - a0 : pos - a0 + nbytes]

    def _direct_fd(self, name: str) -> int | None:
        if name not in self.direct_fds:
            fd = None
            if DIRECT_READS and hasattr(os, "O_DIRECT"):
                with contextlib.suppress(OSError):
                    fd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECT)
            self.direct_fds[name] = fd
        return self.direct_fds[name]

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


def _shape(t: TensorInfo) -> tuple[int, ...]:
    return t.shape if t.shape else (1,)


def _bounds(p: Slice) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (p.start, p.stop) if p.start else ((0,), (1,))


def fill_bytes(value: float, count: int, dtype: str) -> bytes:
    if value == 0.0:
        return bytes(count * ITEMSIZE[dtype])
    if dtype == "F32":
        return np.full(count, value, np.float32).tobytes()
    if dtype == "F16":
        return np.full(count, value, np.float16).tobytes()
    if dtype == "BF16":
        bits = np.full(count, value, np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return rounded.astype(np.uint16).tobytes()
    raise ValueError(f"cannot fill {dtype} with {value}")


class Caster:
    """Converts element bytes between dtypes exactly as torch's `.to()` (what vLLM's copy_ does).

    With device != "cpu" every piece also goes through that device (`--device cuda`).
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._torch = None

    def torch(self):
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def __call__(self, data: np.ndarray, src: str, dst: str) -> np.ndarray:
        if src == dst and self.device == "cpu":
            return data
        if self.device == "cpu" and dst == "F32" and src in ("BF16", "F16"):
            if src == "F16":
                return data.view(np.float16).astype(np.float32).view(np.uint8)
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.uint8)
        torch = self.torch()
        names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip
        t = torch.from_numpy(np.ascontiguousarray(data)).view(names[src])
        if self.device != "cpu":
            t = t.to(self.device)
        t = t.to(names[dst]).contiguous()
        return t.view(torch.uint8).cpu().numpy()


# ---- memory: reused chunk buffers and a budget for fresh arrays ----------------------------------


class _Stopped(Exception):
    """The run is being torn down: a thread waiting for memory gives up."""


class _Lease:
    """A counted claim on memory: given back to the budget when its last holder releases it."""

    __slots__ = ("mem", "refs")

    mem: _Memory
    refs: int

    def hold(self) -> None:
        with self.mem.cond:
            self.refs += 1

    def release(self) -> None:
        with self.mem.cond:
            self.refs -= 1
            if self.refs == 0:
                self._give_back()
                self.mem.cond.notify_all()

    def _give_back(self) -> None:
        raise NotImplementedError


class _Slab(_Lease):
    """A reused page-aligned buffer; free again once every holder of a view into it let go."""

    __slots__ = ("buf",)

    def __init__(self, mem: _Memory, size: int) -> None:
        self.mem = mem
        self.buf = _buffer(size)
        self.refs = 0

    def _give_back(self) -> None:
        self.mem.free.append(self)


class _Fresh(_Lease):
    """The budget share of one fresh array, given back when its last holder is done with it."""

    __slots__ = ("nbytes",)

    def __init__(self, mem: _Memory, nbytes: int) -> None:
        self.mem = mem
        self.nbytes = nbytes
        self.refs = 1

    def _give_back(self) -> None:
        self.mem.fresh -= self.nbytes


Lease = _Slab | _Fresh


class _Memory:
    """`count` slabs of `slab` bytes handed out as an arena (by the reader thread only), and a
    budget of `fresh_limit` bytes for fresh arrays (main thread and reader).

    Only writers free memory and they never wait for any, so every wait here ends; an oversized
    request waits only until nothing fresh is in flight.
    """

    def __init__(self, max_memory: int, chunk_bytes: int) -> None:
        self.slab = -(-max(chunk_bytes, MIN_SLAB) // ALIGN) * ALIGN + 2 * ALIGN  # + room to align reads
        self.fresh_limit = max(self.slab, max_memory // 4)
        self.count = max(2, (max_memory - self.fresh_limit) // self.slab)
        self.cond = threading.Condition()
        self.free: list[_Slab] = []
        self.made = 0
        self.fresh = 0
        self.stopped = False
        self.cur: _Slab | None = None  # the arena's slab; the allocating thread holds one reference
        self.off = 0

    def alloc(self, nbytes: int) -> tuple[memoryview, Lease]:
        """A page-aligned region; its holder owns one reference to the returned lease."""
        if nbytes > self.slab:
            fresh = self.account(nbytes)
            return memoryview(_buffer(nbytes)), fresh
        if self.cur is None or self.off + nbytes > self.slab:
            if self.cur is not None:
                self.cur.release()
                self.cur = None
            self.cur = self._take()
            self.cur.refs = 1
            self.off = 0
        start = self.off
        self.off += -(-nbytes // ALIGN) * ALIGN
        self.cur.hold()
        return memoryview(self.cur.buf)[start : start + nbytes], self.cur

    def _take(self) -> _Slab:
        with self.cond:
            while not self.free and self.made >= self.count:
                if self.stopped:
                    raise _Stopped
                self.cond.wait()
            if self.free:
                return self.free.pop()
            self.made += 1
        return _Slab(self, self.slab)

    def account(self, nbytes: int) -> _Fresh:
        """Count a fresh array against the budget, first waiting for writers to free some if needed."""
        nbytes = max(nbytes, 256)  # a queued write costs something even when tiny
        with self.cond:
            while self.fresh and self.fresh + nbytes > self.fresh_limit:
                if self.stopped:
                    raise _Stopped
                self.cond.wait()
            self.fresh += nbytes
        return _Fresh(self, nbytes)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def close(self) -> None:
        if self.cur is not None:
            self.cur.release()
            self.cur = None
        self.free.clear()


# ---- the reader threads ----------------------------------------------------------------------------


Read = tuple[TensorInfo, int, int]  # tensor, first byte, bytes


class _Prefetcher:
    """Reads `reads` ahead of their use, in order, on `threads` threads, as far as memory allows.

    Several reads in flight keep the device busy through the many small reads of MoE checkpoints
    (one per expert and scale tensor). Reads are allocated in order, so the arena stays sequential.
    """

    def __init__(self, reader: SourceReader, mem: _Memory, reads: list[Read], threads: int) -> None:
        self.reader = reader
        self.mem = mem
        self.reads = reads
        self.prepare = getattr(reader, "prepare", None)  # another reader (inverse.py): read() only
        self.lock = threading.Lock()  # hands out reads and their memory, in order
        self.cond = threading.Condition()  # results
        self.next = 0
        self.want = 0
        self.done: dict[int, tuple | BaseException] = {}
        self.stopped = False
        n = max(1, min(threads if self.prepare is not None else 1, len(reads)))
        self.threads = [threading.Thread(target=self._run, name="reshard-reader", daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def get(self, info: TensorInfo, start: int, nbytes: int) -> tuple[memoryview, Lease]:
        with self.cond:
            while self.want not in self.done:
                self.cond.wait()
            item = self.done.pop(self.want)
            self.want += 1
        if isinstance(item, BaseException):
            raise item
        key, view, lease = item
        if key != (info.name, start, nbytes):  # the read order is derived from the plan: a bug
            raise AssertionError(f"read order: expected {key}, asked for {(info.name, start, nbytes)}")
        return view, lease

    def _run(self) -> None:
        while True:
            i = -1
            try:
                with self.lock:
                    if self.stopped or self.next >= len(self.reads):
                        return
                    i = self.next
                    self.next += 1
                    info, start, nbytes = self.reads[i]
                    if self.prepare is not None:
                        prepared = self.prepare(info, start, nbytes)
                        region, lease = self.mem.alloc(prepared[2])
                    else:
                        region, lease = self.mem.alloc(nbytes)
                try:
                    if self.prepare is not None:
                        view = self.reader.read_prepared(info, start, nbytes, prepared, region)
                    else:
                        view = self.reader.read(info, start, nbytes, region)
                except BaseException:
                    lease.release()
                    raise
                item: tuple | BaseException = ((info.name, start, nbytes), view, lease)
            except _Stopped:
                return
            except BaseException as e:
                item = e
                with self.lock:
                    self.stopped = True
            if i < 0:  # failed before taking a read: report it as the next one
                with self.cond:
                    i = self.want
            with self.cond:
                self.done[i] = item
                self.cond.notify_all()
            if isinstance(item, BaseException):
                return

    def stop(self) -> None:
        """End the threads; what was read but not used is dropped."""
        with self.lock:
            self.stopped = True
        self.mem.stop()
        for t in self.threads:
            t.join()
        with self.lock:
            if self.mem.cur is not None:
                self.mem.cur.release()  # the arena's own reference
                self.mem.cur = None
        with self.cond:
            for item in self.done.values():
                if not isinstance(item, BaseException):
                    item[2].release()
            self.done.clear()


# ---- writer threads ----------------------------------------------------------------------------

_BEGIN, _WRITE, _CLOSE, _ABORT = range(4)


class _Worker:
    """Feeds one sink from its own thread, in submission order."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.gather = getattr(sink, "write_array", None)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.aborting = False
        self.result: Written | None = None
        self.stage: np.ndarray | None = None
        self.thread = threading.Thread(target=self._run, name="reshard-writer", daemon=True)
        self.thread.start()

    # main thread
    def begin(self, tensor: OutTensor) -> None:
        self._check()
        self.q.put((_BEGIN, tensor, None))

    def write(self, data: np.ndarray | bytes, lease: Lease) -> None:
        """Queue `data`; `lease` (one reference, owned by the caller) is released once written."""
        if self.error is not None:
            lease.release()
            self._check()
        self.q.put((_WRITE, data, lease))

    def close(self, sync: bool) -> None:
        self._check()
        self.q.put((_CLOSE, sync, None))

    def abort(self) -> None:
        self.aborting = True  # queued writes are dropped, not written
        self.q.put((_ABORT, None, None))

    def join(self) -> Written:
        self.thread.join()
        self._check()
        assert self.result is not None
        return self.result

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    # writer thread
    def _run(self) -> None:
        while True:
            op, arg, lease = self.q.get()
            if op == _WRITE:
                try:
                    if self.error is None and not self.aborting:
                        self._write(arg)
                except BaseException as e:
                    self.error = e
                finally:
                    del arg
                    lease.release()
            elif op == _BEGIN:
                if self.error is None:
                    try:
                        self.sink.begin(arg)
                    except BaseException as e:
                        self.error = e
            elif op == _CLOSE:
                if self.error is None and not self.aborting:
                    try:
                        self.result = self.sink.close(arg)
                    except BaseException as e:
                        self.error = e
                if self.result is None:
                    with contextlib.suppress(Exception):
                        self.sink.abort()
                return
            else:
                with contextlib.suppress(Exception):
                    self.sink.abort()
                return

    def _write(self, data: np.ndarray | bytes) -> None:
        if isinstance(data, bytes):
            self.sink.write(data)
        elif data.flags.c_contiguous:
            self.sink.write(memoryview(data).cast("B"))
        elif self.gather is not None:
            self.gather(data)
        else:  # a strided slice for a sink that takes bytes only: gather row blocks here
            row = data[0].nbytes
            step = max(1, STAGE_BYTES // row)
            if self.stage is None or self.stage.nbytes < min(step, data.shape[0]) * row:
                self.stage = np.empty(max(STAGE_BYTES, row), np.uint8)
            for r0 in range(0, data.shape[0], step):
                part = data[r0 : r0 + step]
                dst = self.stage[: part.nbytes].reshape(part.shape)
                np.copyto(dst, part)
                self.sink.write(memoryview(dst).cast("B"))


class _Holder:
    """One rank's copy of the tensor being written, and how far its pieces have been emitted."""

    __slots__ = ("cursor", "tensor", "writer")

    def __init__(self, tensor: OutTensor, writer: _Worker) -> None:
        self.tensor = tensor
        self.writer = writer
        self.cursor = 0


class Executor:
    """Writes a plan's files (see the module docstring for how).

    chunk_bytes: source rows are read this many bytes at a time (the reused buffers' size).
    max_memory: about how many bytes of tensor data may be in memory at once: reused buffers and
        fresh arrays (at least 2 chunks); each open output file adds STAGE_BYTES on top.
    """

    def __init__(
        self,
        plan: Plan,
        source_root: Path,
        tensors: dict[str, TensorInfo],
        out_dir: Path,
        *,
        metadata: dict[str, str],
        device: str = "cpu",
        chunk_bytes: int = DEFAULT_CHUNK,
        progress: Callable[[int], None] | None = None,
        sync: bool = True,
        sink: Callable[[OutFile, bytes], Sink] | None = None,
        max_memory: int | None = None,
        reader: SourceReader | None = None,
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.out_dir = out_dir
        self.metadata = metadata
        # a reshard output as SOURCE brings its own reader (inverse.OutputReader), same interface
        self.reader = reader or SourceReader(source_root)
        self.cast = Caster(device)
        max_memory = max_memory or DEFAULT_MAX_MEMORY
        self.chunk_bytes = max(1, min(chunk_bytes, max_memory // 4))  # leave room for a few in flight
        self.mem = _Memory(max_memory, self.chunk_bytes)
        self.progress = progress or (lambda n: None)
        self.sync = sync
        self.sink = sink or (lambda f, header: _FileWriter(self.out_dir / f.name, header))
        self.open: dict[str, _Worker] = {}
        self.closing: list[_Worker] = []
        self.done: list[Written] = []
        self.prefetch: _Prefetcher | None = None

    def run(self) -> list[Written]:
        # tensor name -> [(file, tensor)] over every rank; file -> name of its last tensor
        slots: dict[str, list[tuple[OutFile, OutTensor]]] = {}
        last: dict[str, str] = {}
        for f in self.plan.files:
            for t in f.tensors:
                slots.setdefault(t.name, []).append((f, t))
            if f.tensors:
                last[f.name] = f.tensors[-1].name
            else:
                self.done.append(self.sink(f, file_header(f, self.metadata)).close(self.sync))
        order = sorted(slots, key=lambda n: (-ITEMSIZE[slots[n][0][1].dtype], natural_key(n)))
        reads = [r for name in order for r in self._reads([t for _, t in slots[name]])]
        try:
            self.prefetch = _Prefetcher(self.reader, self.mem, reads, READ_THREADS)
            for name in order:
                holders = [_Holder(t, self._writer(f)) for f, t in slots[name]]
                for h in holders:
                    h.writer.begin(h.tensor)
                self._emit(holders)
                for f, _ in slots[name]:
                    if last[f.name] == name:
                        w = self.open.pop(f.name)
                        w.close(self.sync)
                        self.closing.append(w)
            for w in self.closing:
                self.done.append(w.join())
        except BaseException:
            workers = [*self.open.values(), *self.closing]
            for w in workers:
                w.abort()
            if self.prefetch is not None:
                self.prefetch.stop()
            for w in workers:
                w.thread.join()
            raise
        finally:
            if self.prefetch is not None:
                self.prefetch.stop()
            self.reader.close()
            self.mem.close()
        return self.done

    def _writer(self, f: OutFile) -> _Worker:
        if f.name not in self.open:
            self.open[f.name] = _Worker(self.sink(f, file_header(f, self.metadata)))
        return self.open[f.name]

    # ---- reads: planned ahead, in the order _emit makes them -----------------------------------

    def _reads(self, tensors: list[OutTensor]) -> Iterator[Read]:
        """The reads `_emit` makes for one tensor name (all ranks' copies), in order."""
        sources = _sources(tensors)
        if not _streamable(tensors, list(sources)):
            for t in tensors:
                for p in t.pieces:
                    if isinstance(p, Slice):
                        info = self.tensors[p.source]
                        if p.up:
                            yield info, 0, info.nbytes
                        else:
                            (a, *_), (b, *_) = _bounds(p)
                            row = info.nbytes // _shape(info)[0]
                            yield info, a * row, (b - a) * row
            return
        for s, (up, lo, hi) in sources.items():
            info = self.tensors[s]
            if up:
                yield info, 0, info.nbytes
                continue
            row_bytes = info.nbytes // _shape(info)[0]
            rows_per_chunk = max(1, self.chunk_bytes // max(row_bytes, 1))
            for c0 in range(lo, hi, rows_per_chunk):
                c1 = min(c0 + rows_per_chunk, hi)
                yield info, c0 * row_bytes, (c1 - c0) * row_bytes

    def _read(self, info: TensorInfo, start: int, nbytes: int) -> tuple[memoryview, Lease]:
        assert self.prefetch is not None
        return self.prefetch.get(info, start, nbytes)

    # ---- one tensor, all ranks ---------------------------------------------------------------

    def _emit(self, holders: list[_Holder]) -> None:
        tensors = [h.tensor for h in holders]
        sources = _sources(tensors)
        if not _streamable(tensors, list(sources)):
            for h in holders:
                self._emit_direct(h)
            return
        for s, (up, lo, hi) in sources.items():
            info = self.tensors[s]
            if up:
                arr, lease = self._whole(info)
                self._feed(holders, s, arr, 0, 1 << 62, lease)
                lease.release()
                continue
            shape = _shape(info)
            row_bytes = info.nbytes // shape[0]
            rows_per_chunk = max(1, self.chunk_bytes // max(row_bytes, 1))
            for c0 in range(lo, hi, rows_per_chunk):
                c1 = min(c0 + rows_per_chunk, hi)
                raw, lease = self._read(info, c0 * row_bytes, (c1 - c0) * row_bytes)
                arr = np.frombuffer(raw, np.uint8).reshape((c1 - c0, *shape[1:], ITEMSIZE[info.dtype]))
                self._feed(holders, s, arr, c0, c1, lease)
                del arr, raw
                lease.release()
        for h in holders:
            self._advance_fills(h)
            if h.cursor != len(h.tensor.pieces):
                raise AssertionError(f"{h.tensor.name}: pieces left unwritten")

    def _advance_fills(self, h: _Holder) -> None:
        pieces = h.tensor.pieces
        while h.cursor < len(pieces) and isinstance(pieces[h.cursor], Fill):
            self._write_fill(h, pieces[h.cursor])
            h.cursor += 1

    def _feed(self, holders: list[_Holder], source: str, arr: np.ndarray, c0: int, c1: int, lease: Lease) -> None:
        """Hand rows [c0, c1) of `source` (as uint8 array [rows, ..., itemsize]) to every holder."""
        src_dtype = self.tensors[source].dtype
        for h in holders:
            pieces = h.tensor.pieces
            while True:
                self._advance_fills(h)
                if h.cursor >= len(pieces):
                    break
                p = pieces[h.cursor]
                assert isinstance(p, Slice)
                if p.source != source:
                    break
                a, b = _bounds(p)
                if p.up:
                    part = _upsample(arr, p.up)[tuple(slice(x, y) for x, y in zip(a, b, strict=True))]
                    self._write(h, part, src_dtype, None)
                    h.cursor += 1
                    continue
                if a[0] >= c1:
                    break
                r0, r1 = max(a[0], c0), min(b[0], c1)
                if r1 > r0:
                    idx = (slice(r0 - c0, r1 - c0), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                    self._write(h, arr[idx], src_dtype, lease)
                if b[0] <= c1:
                    h.cursor += 1
                    continue
                break

    def _write(self, h: _Holder, part: np.ndarray, src_dtype: str, lease: Lease | None) -> None:
        """Queue `part` for h's writer; `lease`: what `part` is a view of (None: a fresh array)."""
        out = self.cast(part, src_dtype, h.tensor.dtype)
        if out is part and lease is not None:
            lease.hold()
            h.writer.write(out, lease)
        else:  # cast or up-sampled: a fresh array with its own budget share
            h.writer.write(out, self.mem.account(out.nbytes))
        self.progress(out.nbytes)

    def _write_fill(self, h: _Holder, p: Fill) -> None:
        data = fill_bytes(p.value, p.count, h.tensor.dtype)
        h.writer.write(data, self.mem.account(len(data)))
        self.progress(len(data))

    def _whole(self, info: TensorInfo) -> tuple[np.ndarray, Lease]:
        """A small tensor (block scales), up-sampled by every piece that asks for it."""
        raw, lease = self._read(info, 0, info.nbytes)
        return np.frombuffer(raw, np.uint8).reshape((*_shape(info), ITEMSIZE[info.dtype])), lease

    def _emit_direct(self, h: _Holder) -> None:
        """Fallback for piece orders one pass cannot serve: read each piece on its own."""
        for p in h.tensor.pieces:
            if isinstance(p, Fill):
                self._write_fill(h, p)
                continue
            info = self.tensors[p.source]
            a, b = _bounds(p)
            if p.up:
                whole, lease = self._whole(info)
                arr = _upsample(whole, p.up)
                idx = tuple(slice(x, y) for x, y in zip(a, b, strict=True))
                self._write(h, arr[idx], info.dtype, None)
            else:
                shape = _shape(info)
                row_bytes = info.nbytes // shape[0]
                raw, lease = self._read(info, a[0] * row_bytes, (b[0] - a[0]) * row_bytes)
                arr = np.frombuffer(raw, np.uint8).reshape((b[0] - a[0], *shape[1:], ITEMSIZE[info.dtype]))
                idx = (slice(None), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                self._write(h, arr[idx], info.dtype, lease)
            lease.release()
        h.cursor = len(h.tensor.pieces)


def _sources(tensors: list[OutTensor]) -> dict[str, tuple[bool, int, int]]:
    """Source tensors of these pieces in order of first use: whether a piece up-samples it, and
    the span of its rows the pieces use."""
    out: dict[str, tuple[bool, int, int]] = {}
    for t in tensors:
        for p in t.pieces:
            if isinstance(p, Slice):
                (a, *_), (b, *_) = _bounds(p)
                up, lo, hi = out.get(p.source, (False, a, b))
                out[p.source] = (up or bool(p.up), min(lo, a), max(hi, b))
    return out


def _streamable(tensors: list[OutTensor], sources: list[str]) -> bool:
    """Can one pass over each source, in order, emit every tensor's pieces in order?"""
    rank = {s: i for i, s in enumerate(sources)}
    for t in tensors:
        prev: Slice | None = None
        for p in t.pieces:
            if not isinstance(p, Slice):
                continue
            if prev is not None:
                if rank[p.source] < rank[prev.source]:
                    return False
                if p.source == prev.source and (p.up or _bounds(p)[0][0] < _bounds(prev)[1][0]):
                    return False
            prev = p
    return True


def _upsample(arr: np.ndarray, up: tuple[int, ...]) -> np.ndarray:
    for dim, k in enumerate(up):
        if k > 1:
            arr = np.repeat(arr, k, axis=dim)
    return arr


def total_output_bytes(plan: Plan) -> int:
    return sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for f in plan.files for t in f.tensors)
