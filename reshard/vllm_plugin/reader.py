"""Read one rank's files straight into its parameters, checksumming on the fly; torch, no vLLM.

Every byte of a file is read once, in large reads (`striped.CHUNK`). A file whose tensors all land in
CPU parameters that are contiguous and of the recorded shape is read straight into them
(`reshard.vllm_plugin.striped`) by several threads at once, each with its own descriptor: the
file's chunks are dealt to them in turn, so the file is read about in order with several reads in
flight (as the parallel page faults of a multi-threaded `copy_` out of safetensors' mmap give
sharded_state). Its checksum covers its bytes in order: a hash thread per file follows the chunks
as they arrive, right behind the reads, hashing from the parameters' memory.

A file mostly not in the page cache (RESHARD_DIRECT_READS, `reshard.io.direct.wants_direct`) is read
with O_DIRECT into a page-aligned buffer per thread (`striped.BOUNCE`) and copied into the parameters
(which torch does not align for O_DIRECT): the copy costs far less CPU than the kernel's allocation
and copy of every page a cold read through the page cache costs, and keeps the disk's queue full
(docs/benchmarks.md: a cold TP 2 load of 2.1 GB per rank in vLLM took 0.75 of the time). A file in
the cache is read out of it.

A file whose parameters are contiguous and of the recorded shape but not in CPU memory (a GPU's) is
read the same way through host buffers, page-locked on a CUDA device, the copies to the device
running while the next chunk is read (`reshard.vllm_plugin.staged`). A file with a LoRA-padded
parameter is read front to back by one thread (here), through a bounce buffer of at most a chunk (a
narrowed LoRA view: one tensor), and hashed as read.

The files come from a local folder, or from a `Source` (the objects of a bucket prefix: each stream
one ranged GET of a contiguous stripe, a LoRA-padded file one GET), read the same way into the same
memory.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch

from reshard.format import open_regular
from reshard.hashing import new_hasher
from reshard.io.direct import wants_direct
from reshard.vllm_plugin import striped
from reshard.vllm_plugin.checks import RankFile, fits_narrowed
from reshard.vllm_plugin.staged import Staged
from reshard.vllm_plugin.striped import Count, Source, Striped, byte_view, read_exact

STRIPE_MIN = 64 * 1024 * 1024  # a file is read by at most size / STRIPE_MIN streams
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long load


@dataclass(frozen=True)
class BadChecksum:
    name: str
    got: str
    want: str


class ReadError(Exception):
    """A rank file could not be read to its end (I/O error, or it shrank since it was checked)."""


def _direct(param: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return param.device.type == "cpu" and param.is_contiguous() and tuple(param.shape) == shape


class _Hasher:
    """Hashes the pieces handed to it, in order, on its own thread."""

    def __init__(self, algorithm: str) -> None:
        self._h = new_hasher(algorithm)
        self._q: queue.Queue = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="reshard-hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (piece := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._h.update(piece)
                except BaseException as e:  # kept for hexdigest; the queue still drains (no reader waits)
                    self._error = e

    def update(self, piece: memoryview | bytes) -> None:
        self._q.put(piece)

    def hexdigest(self) -> str:
        """The digest, once every piece is hashed; the hash's error if it failed."""
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise self._error
        return self._h.hexdigest()


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
    """Read `rf` into `targets` front to back on this thread (any parameter: CPU, GPU, LoRA-padded:
    read_rank sends here the files with a LoRA-padded one); its checksum compared when `algorithm`."""
    hasher = _Hasher(algorithm) if algorithm and rf.digest else None
    try:
        with source.open(rf) if source is not None else _open_local(rf) as f:
            head = bytearray(rf.header_bytes)
            read_exact(f, memoryview(head), hasher, count)
            for info in rf.tensors:
                param = targets[info.name]
                if info.nbytes == 0:
                    continue
                if _direct(param, info.shape):
                    read_exact(f, memoryview(byte_view(param).numpy()), hasher, count)
                elif param.is_contiguous() and tuple(param.shape) == info.shape:
                    _bounce(f, byte_view(param), hasher, count)
                else:  # LoRA padding: the recorded tensor fills the leading corner of the parameter
                    assert fits_narrowed(info.shape, tuple(param.shape)), info.name
                    tmp = torch.empty(info.nbytes, dtype=torch.uint8)
                    read_exact(f, memoryview(tmp.numpy()), hasher, count)
                    # (the hasher's view keeps tmp alive; nothing writes to it again)
                    view = param.data
                    for dim, size in enumerate(info.shape):
                        view = view.narrow(dim, 0, size)
                    view.copy_(tmp.view(param.dtype).reshape(info.shape))
    except BaseException:
        if hasher is not None:
            with contextlib.suppress(BaseException):  # the read's error is the one reported
                hasher.hexdigest()  # end its thread
        raise
    if hasher is None:
        return None
    try:
        got = hasher.hexdigest()
    except Exception as e:
        raise ReadError(f"{_where(rf, source)}: cannot be verified ({e})") from e
    return None if got == rf.digest else BadChecksum(rf.path.name, got, rf.digest or "")


def _bounce(f, dest: torch.Tensor, hasher: _Hasher | None, count: Count) -> None:
    """Read into a host buffer in chunks and copy each to `dest` (a byte view on another device).
    Chunks are hashed before the buffer is reused."""
    buf = torch.empty(min(striped.CHUNK, dest.numel()), dtype=torch.uint8)
    arr = memoryview(buf.numpy())
    pos = 0
    while pos < dest.numel():
        n = min(len(arr), dest.numel() - pos)
        read_exact(f, arr[:n], None, count)
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
    whose parameters are contiguous and of the recorded shape is read by up to `threads` streams,
    straight into CPU parameters or through host buffers into a GPU's: locally its chunks dealt to
    them in turn, from a source a contiguous stripe each). Returns (bytes, seconds, files
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

    striped: list[Striped | Staged] = []
    jobs: list[tuple[RankFile, Callable[[], BadChecksum | None]]] = []
    for rf in sorted(files, key=lambda f: -f.size):
        params = [(targets[t.name], t.shape) for t in rf.tensors if t.nbytes]
        streams = max(1, min(threads, rf.size // STRIPE_MIN))
        cold = source is None and wants_direct(rf.path, direct_reads)
        if all(_direct(p, shape) for p, shape in params):
            s: Striped | Staged = Striped(rf, targets, algorithm, streams, source, cold)
        elif all(p.is_contiguous() and tuple(p.shape) == shape for p, shape in params):  # on a GPU
            s = Staged(rf, targets, algorithm, streams, source, cold)
        else:  # LoRA padding
            jobs.append((rf, lambda rf=rf: read_file(rf, targets, algorithm=algorithm, count=count, source=source)))
            continue
        striped.append(s)
        jobs += [(rf, lambda s=s, j=j: s.read_stripe(j, count)) for j in s.stripes()]

    def run(job: tuple[RankFile, Callable[[], BadChecksum | None]]) -> BadChecksum | None:
        rf, fn = job
        try:
            return fn()
        except (OSError, EOFError) as e:
            raise ReadError(f"{_where(rf, source)}: cannot read ({getattr(e, 'strerror', None) or e})") from e

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs))), thread_name_prefix="reshard-read") as pool:
            results = list(pool.map(run, jobs))
    finally:
        for s in striped:  # a failed stream has released its file's hash thread
            if s.hash_thread is not None and any(not e.is_set() for e in s.ready):
                s.fail()
            if s.hash_thread is not None and s.failed:
                s.hash_thread.join()  # released: it ends at once; none outlives a failed read
    bad = [r for r in results if r is not None] + [b for s in striped if (b := _checked(s, source)) is not None]
    return done[0], time.perf_counter() - t0, bad


def _checked(s: Striped | Staged, source: Source | None) -> BadChecksum | None:
    """A file's checksum against the manifest's, once its streams are done."""
    try:
        got = s.digest()
    except Exception as e:
        raise ReadError(f"{_where(s.rf, source)}: cannot be verified ({e})") from e
    return None if got is None or got == s.rf.digest else BadChecksum(s.rf.path.name, got, s.rf.digest or "")


def _where(rf: RankFile, source: Source | None) -> str:
    """`rf` as messages name it."""
    return source.where(rf) if source is not None else str(rf.path)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
