"""Read one rank's files straight into its parameters, checksumming on the fly; torch, no vLLM.

Every byte of a file is read once, in large reads (`CHUNK`). A file whose tensors all land in CPU
parameters that are contiguous and of the recorded shape is read straight into them, by several
threads at once, each with its own descriptor: the file's chunks are dealt to them in turn, so the
file is read about in order with several reads in flight (as the parallel page faults of a
multi-threaded `copy_` out of safetensors' mmap give sharded_state). Its checksum covers its bytes
in order: a hash thread per file follows the chunks as they arrive, right behind the reads, hashing
from the parameters' memory.

A file mostly not in the page cache (RESHARD_DIRECT_READS, `reshard.io.direct.wants_direct`) is read
with O_DIRECT into a page-aligned buffer per thread (`BOUNCE`) and copied into the parameters
(which torch does not align for O_DIRECT): the copy costs far less CPU than the kernel's allocation
and copy of every page a cold read through the page cache costs, and keeps the disk's queue full
(docs/benchmarks.md: a cold TP 2 load of 2.1 GB per rank in vLLM took 0.75 of the time). A file in
the cache is read out of it.

Other files (a GPU parameter, a LoRA-padded one) are read front to back by one thread, through a
bounce buffer of at most `CHUNK` bytes (a narrowed LoRA view: one tensor), and hashed as read.

The files come from a local folder, or from a `Source` (the objects of a bucket prefix: each thread
one ranged GET of a contiguous stripe, each other file one GET), read the same way into the same
memory.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import torch

import reshard.io.direct as direct
from reshard.format import open_regular
from reshard.hashing import new_hasher
from reshard.io.direct import ALIGN, wants_direct
from reshard.vllm_plugin.checks import RankFile, fits_narrowed

CHUNK = 32 * 1024 * 1024
STRIPE_MIN = 64 * 1024 * 1024  # a file is read by at most size / STRIPE_MIN streams
BOUNCE = 8 * 1024 * 1024  # an O_DIRECT read's page-aligned buffer, one per stream
IOV_MAX = 1024  # buffers per preadv
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long load


@dataclass(frozen=True)
class BadChecksum:
    name: str
    got: str
    want: str


class ReadError(Exception):
    """A rank file could not be read to its end (I/O error, or it shrank since it was checked)."""


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


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _direct(param: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return param.device.type == "cpu" and param.is_contiguous() and tuple(param.shape) == shape


class _Striped:
    """A file read straight into CPU parameters by `streams` threads, and hashed in order by a
    thread of its own (when `algorithm`). Local: stream j reads chunks j, j + streams, ... (with
    O_DIRECT when `o_direct`); from a `source`: stream j one contiguous stripe (one ranged GET)."""

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
        # the file as (offset, memory) segments, back to back: the header, then every tensor
        self.segments: list[tuple[int, memoryview]] = [(0, memoryview(bytearray(rf.header_bytes)))]
        for info in rf.tensors:
            if info.nbytes:
                self.segments.append((info.offset, memoryview(_byte_view(targets[info.name]).numpy())))
        self.starts = [off for off, _ in self.segments]
        self.chunks = max(1, math.ceil(rf.size / CHUNK))
        self.streams = max(1, min(streams, self.chunks))
        self.bounds = [j * self.chunks // self.streams for j in range(self.streams + 1)]
        self.o_direct = o_direct and source is None and CHUNK % ALIGN == 0
        self.direct_chunks = [0] * self.streams  # per stream: chunks read with O_DIRECT
        self.ready = [threading.Event() for _ in range(self.chunks)]
        self.failed = False
        self.hasher = new_hasher(algorithm) if algorithm and rf.digest else None
        self.digest: str | None = None
        self.hash_thread: threading.Thread | None = None
        if self.hasher is not None:
            self.hash_thread = threading.Thread(target=self._hash, name="reshard-hash", daemon=True)
            self.hash_thread.start()

    def stripes(self) -> list[int]:
        return list(range(self.streams))

    def _views(self, c: int) -> list[memoryview]:
        """The memory of file bytes [c * CHUNK, (c + 1) * CHUNK), in order."""
        a, b = c * CHUNK, min(self.rf.size, (c + 1) * CHUNK)
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
                            end = min(self.rf.size, (c + 1) * CHUNK)
                            direct.read_into(fd, c * CHUNK, end, self._views(c), bounce, self.rf.path.name)
                            count(end - c * CHUNK)
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
            self.failed = True
            for e in self.ready:
                e.set()
            raise

    def _read_chunk(self, fd: int, c: int, count: Count) -> None:
        views, pos = self._views(c), c * CHUNK
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
        with self.source.open(self.rf, first * CHUNK, min(self.rf.size, end * CHUNK)) as f:
            for c in range(first, end):
                if self.failed:
                    return
                for view in self._views(c):
                    _read_exact(f, view, None, count)
                self.ready[c].set()

    def _hash(self) -> None:
        assert self.hasher is not None
        for c in range(self.chunks):
            self.ready[c].wait()
            if self.failed:
                return
            for v in self._views(c):
                self.hasher.update(v)
        self.digest = self.hasher.hexdigest()

    def result(self) -> BadChecksum | None:
        if self.hash_thread is None:
            return None
        self.hash_thread.join()
        if self.failed or self.digest is None:
            return None  # the read failed: that error is the one reported
        return (
            None if self.digest == self.rf.digest else BadChecksum(self.rf.path.name, self.digest, self.rf.digest or "")
        )


class _Hasher:
    """Hashes the pieces handed to it, in order, on its own thread."""

    def __init__(self, algorithm: str) -> None:
        self._h = new_hasher(algorithm)
        self._q: queue.Queue = queue.Queue(maxsize=8)
        self._t = threading.Thread(target=self._run, name="reshard-hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (piece := self._q.get()) is not None:
            self._h.update(piece)

    def update(self, piece: memoryview | bytes) -> None:
        self._q.put(piece)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self._h.hexdigest()


def _read_exact(f, view: memoryview, hasher: _Hasher | None, count: Count) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = f.readinto(view[pos : pos + CHUNK])
        if not got:
            raise EOFError(f"{f.name}: ended early")
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        count(got)
        pos += got


def _open_local(rf: RankFile) -> BinaryIO:
    f = os.fdopen(open_regular(rf.path, follow=False), "rb", buffering=0)
    with contextlib.suppress(AttributeError, OSError):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return f


def read_file(
    rf: RankFile,
    targets: dict[str, torch.Tensor],
    *,
    algorithm: str | None,
    count: Count,
    source: Source | None = None,
) -> BadChecksum | None:
    """Read `rf` into `targets` front to back on this thread (any parameter: CPU, GPU, LoRA-padded);
    its checksum compared when `algorithm`."""
    hasher = _Hasher(algorithm) if algorithm and rf.digest else None
    try:
        with source.open(rf) if source is not None else _open_local(rf) as f:
            head = bytearray(rf.header_bytes)
            _read_exact(f, memoryview(head), hasher, count)
            for info in rf.tensors:
                param = targets[info.name]
                if info.nbytes == 0:
                    continue
                if _direct(param, info.shape):
                    _read_exact(f, memoryview(_byte_view(param).numpy()), hasher, count)
                elif param.is_contiguous() and tuple(param.shape) == info.shape:
                    _bounce(f, _byte_view(param), hasher, count)
                else:  # LoRA padding: the recorded tensor fills the leading corner of the parameter
                    assert fits_narrowed(info.shape, tuple(param.shape)), info.name
                    tmp = torch.empty(info.nbytes, dtype=torch.uint8)
                    _read_exact(f, memoryview(tmp.numpy()), hasher, count)
                    # (the hasher's view keeps tmp alive; nothing writes to it again)
                    view = param.data
                    for dim, size in enumerate(info.shape):
                        view = view.narrow(dim, 0, size)
                    view.copy_(tmp.view(param.dtype).reshape(info.shape))
    except BaseException:
        if hasher is not None:
            hasher.hexdigest()  # end its thread
        raise
    if hasher is None:
        return None
    got = hasher.hexdigest()
    return None if got == rf.digest else BadChecksum(rf.path.name, got, rf.digest or "")


def _bounce(f, dest: torch.Tensor, hasher: _Hasher | None, count: Count) -> None:
    """Read into a host buffer in chunks and copy each to `dest` (a byte view on another device).
    Chunks are hashed before the buffer is reused."""
    buf = torch.empty(min(CHUNK, dest.numel()), dtype=torch.uint8)
    arr = memoryview(buf.numpy())
    pos = 0
    while pos < dest.numel():
        n = min(len(arr), dest.numel() - pos)
        _read_exact(f, arr[:n], None, count)
        if hasher is not None:
            hasher.update(bytes(arr[:n]))  # a copy: the buffer is reused at once
        dest[pos : pos + n].copy_(buf[:n])
        pos += n


def read_rank(
    files: list[RankFile],
    targets: dict[str, torch.Tensor],
    *,
    algorithm: str | None,
    threads: int,
    log: Callable[[str], None],
    label: str,
    source: Source | None = None,
    direct_reads: str = "auto",
) -> tuple[int, float, list[BadChecksum]]:
    """Read every file of a rank with `threads` read streams at a time (largest files first; a file
    that goes straight into CPU parameters is read by up to `threads` streams: locally its chunks
    dealt to them in turn, from a source a contiguous stripe each). Returns (bytes, seconds, files
    whose checksum differs from the manifest's). Logs progress every few seconds.
    `source`: where the files are read from (None: the local paths `files` name). `direct_reads`:
    which local files read into CPU parameters use O_DIRECT (RESHARD_DIRECT_READS' values)."""
    total = sum(f.size for f in files)
    done = [0]
    lock = threading.Lock()
    t0 = time.perf_counter()
    last = [t0]

    def count(n: int) -> None:
        with lock:
            done[0] += n
            now = time.perf_counter()
            if now - last[0] >= PROGRESS_EVERY:
                last[0] = now
                log(f"reshard: {label}: {_gb(done[0])} of {_gb(total)} read ({100 * done[0] // max(total, 1)}%)")

    striped: list[_Striped] = []
    jobs: list[tuple[RankFile, Callable[[], BadChecksum | None]]] = []
    for rf in sorted(files, key=lambda f: -f.size):
        if all(_direct(targets[t.name], t.shape) for t in rf.tensors if t.nbytes):
            streams = max(1, min(threads, rf.size // STRIPE_MIN))
            cold = source is None and wants_direct(rf.path, direct_reads)
            s = _Striped(rf, targets, algorithm, streams, source, cold)
            striped.append(s)
            jobs += [(rf, lambda s=s, j=j: s.read_stripe(j, count)) for j in s.stripes()]
        else:
            jobs.append((rf, lambda rf=rf: read_file(rf, targets, algorithm=algorithm, count=count, source=source)))

    def run(job: tuple[RankFile, Callable[[], BadChecksum | None]]) -> BadChecksum | None:
        rf, fn = job
        try:
            return fn()
        except (OSError, EOFError) as e:
            where = source.where(rf) if source is not None else rf.path
            raise ReadError(f"{where}: cannot read ({getattr(e, 'strerror', None) or e})") from e

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs))), thread_name_prefix="reshard-read") as pool:
            results = list(pool.map(run, jobs))
    finally:
        for s in striped:  # a failed stream has released its file's hash thread
            if s.hash_thread is not None and any(not e.is_set() for e in s.ready):
                s.failed = True
                for e in s.ready:
                    e.set()
            if s.hash_thread is not None and s.failed:
                s.hash_thread.join()  # released: it ends at once; none outlives a failed read
    bad = [r for r in results if r is not None] + [b for s in striped if (b := s.result()) is not None]
    return done[0], time.perf_counter() - t0, bad


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
