"""Read one rank's files straight into its parameters, checksumming on the fly; torch, no vLLM.

Each file is read front to back once, in large sequential reads (`CHUNK`), several files at a time.
A CPU parameter that is contiguous and has the recorded shape receives the bytes directly (the read
lands in its memory; nothing is copied after). Others (a GPU parameter, a LoRA-padded one) go through
a bounce buffer of at most `CHUNK` bytes (a narrowed LoRA view: one tensor). The checksum of a file
covers every byte of it in order; a second thread per file hashes the chunks already read while the
next one is being read (hashlib releases the GIL).
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

import torch

from reshard.hashing import new_hasher
from reshard.vllm_plugin.checks import RankFile, fits_narrowed

CHUNK = 32 * 1024 * 1024
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long load


@dataclass(frozen=True)
class BadChecksum:
    name: str
    got: str
    want: str


class ReadError(Exception):
    """A rank file could not be read to its end (I/O error, or it shrank since it was checked)."""


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
            try:
                self._h.update(piece)
            except BaseException as e:  # pragma: no cover - hashlib does not fail on bytes
                self._error = e

    def update(self, piece: memoryview) -> None:
        self._q.put(piece)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise self._error
        return self._h.hexdigest()


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _read_exact(f, view: memoryview, hasher: _Hasher | None, count: Callable[[int], None]) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = f.readinto(view[pos : pos + CHUNK])
        if not got:
            raise EOFError(f"{f.name}: ended early")
        if hasher is not None:
            hasher.update(view[pos : pos + got])
        count(got)
        pos += got


def read_file(
    rf: RankFile, targets: dict[str, torch.Tensor], *, algorithm: str | None, count: Callable[[int], None]
) -> BadChecksum | None:
    """Read `rf` into `targets` (name -> parameter tensor); its checksum compared when `algorithm`."""
    hasher = _Hasher(algorithm) if algorithm and rf.digest else None
    with open(rf.path, "rb", buffering=0) as f:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        head = bytearray(rf.header_bytes)
        _read_exact(f, memoryview(head), hasher, count)
        for info in rf.tensors:
            param = targets[info.name]
            if info.nbytes == 0:
                continue
            if param.device.type == "cpu" and param.is_contiguous() and tuple(param.shape) == info.shape:
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
    if hasher is None:
        return None
    got = hasher.hexdigest()
    return None if got == rf.digest else BadChecksum(rf.path.name, got, rf.digest or "")


def _bounce(f, dest: torch.Tensor, hasher: _Hasher | None, count: Callable[[int], None]) -> None:
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
) -> tuple[int, float, list[BadChecksum]]:
    """Read every file of a rank, `threads` at a time (largest first). Returns (bytes, seconds, files
    whose checksum differs from the manifest's). Logs progress every few seconds of a long load."""
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

    def one(rf: RankFile) -> BadChecksum | None:
        try:
            return read_file(rf, targets, algorithm=algorithm, count=count)
        except (OSError, EOFError) as e:
            raise ReadError(f"{rf.path}: cannot read ({getattr(e, 'strerror', None) or e})") from e

    order = sorted(files, key=lambda f: -f.size)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(order))), thread_name_prefix="reshard-read") as pool:
        results = list(pool.map(one, order))
    return done[0], time.perf_counter() - t0, [r for r in results if r is not None]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
