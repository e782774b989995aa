"""Stream the plan: read each source tensor once, write every rank's files header first.

All ranks advance together through one global tensor order, so each output file is written
sequentially (and hashed on the fly) while each source tensor is read once, in row chunks, and its
rows handed to every rank that needs them. Memory is bounded by one chunk plus what one piece of
it becomes; nothing is assembled whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from reshard.errors import OutputError, SourceError
from reshard.format import ITEMSIZE, TensorInfo, encode_header
from reshard.plan import Fill, OutFile, OutTensor, Plan, Slice, natural_key

DEFAULT_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class Written:
    name: str
    size: int
    sha256: str


class Sink(Protocol):
    """Where one output file's bytes go, in order: a file on disk, or a checker (verify --deep)."""

    def begin(self, tensor: OutTensor) -> None: ...
    def write(self, data: memoryview | bytes) -> None: ...
    def close(self, sync: bool) -> Written: ...
    def abort(self) -> None: ...


class _FileWriter:
    def __init__(self, path: Path, header: bytes) -> None:
        self.path = path
        self.f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self.sha = hashlib.sha256()
        self.size = 0
        self.write(header)

    def begin(self, tensor: OutTensor) -> None:
        pass

    def write(self, data: memoryview | bytes) -> None:
        try:
            view = memoryview(data)
            while view.nbytes:
                n = self.f.write(view)
                view = view[n:]
        except OSError as e:
            raise _write_error(self.path, e) from e
        self.sha.update(data)
        self.size += len(data) if isinstance(data, bytes) else memoryview(data).nbytes

    def close(self, sync: bool) -> Written:
        try:
            if sync:
                os.fsync(self.f.fileno())
            self.f.close()
        except OSError as e:
            raise _write_error(self.path, e) from e
        return Written(self.path.name, self.size, self.sha.hexdigest())

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()


def _write_error(path: Path, e: OSError) -> OutputError:
    if e.errno == 28:
        return OutputError(f"disk full while writing {path.name}", "free space or choose another OUT_DIR")
    return OutputError(f"cannot write {path}: {e.strerror}")


def file_header(f: OutFile, metadata: dict[str, str]) -> bytes:
    return encode_header([(t.name, t.dtype, t.shape) for t in f.tensors], metadata)


class SourceReader:
    """Positioned reads from the checkpoint's safetensors files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

    def fd(self, name: str) -> int:
        if name not in self.fds:
            try:
                self.fds[name] = os.open(self.root / name, os.O_RDONLY)
            except OSError as e:
                raise SourceError(f"cannot open {self.root / name}: {e.strerror}") from e
        return self.fds[name]

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | None = None) -> memoryview:
        out = memoryview(buf)[:nbytes] if buf is not None else memoryview(bytearray(nbytes))
        fd, pos, got = self.fd(t.file), t.offset + start, 0
        while got < nbytes:
            n = os.preadv(fd, [out[got:]], pos + got)
            if n == 0:
                raise SourceError(f"{t.file}: truncated while reading {t.name}", "download it again")
            got += n
        self.bytes_read += nbytes
        return out

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


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


class _Holder:
    """One rank's copy of the tensor being written, and how far its pieces have been emitted."""

    __slots__ = ("cursor", "tensor", "writer")

    def __init__(self, tensor: OutTensor, writer: Sink) -> None:
        self.tensor = tensor
        self.writer = writer
        self.cursor = 0


class Executor:
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
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.out_dir = out_dir
        self.metadata = metadata
        self.reader = SourceReader(source_root)
        self.cast = Caster(device)
        self.chunk_bytes = chunk_bytes
        self.progress = progress or (lambda n: None)
        self.sync = sync
        self.buf = bytearray(chunk_bytes)
        self.sink = sink or (lambda f, header: _FileWriter(self.out_dir / f.name, header))
        self.open: dict[str, Sink] = {}
        self.done: list[Written] = []

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
                self.done.append(self._writer(f).close(self.sync))
        order = sorted(slots, key=lambda n: (-ITEMSIZE[slots[n][0][1].dtype], natural_key(n)))
        try:
            for name in order:
                holders = [_Holder(t, self._writer(f)) for f, t in slots[name]]
                for h in holders:
                    h.writer.begin(h.tensor)
                self._emit(holders)
                for f, _ in slots[name]:
                    if last[f.name] == name:
                        self.done.append(self.open.pop(f.name).close(self.sync))
        except BaseException:
            for w in self.open.values():
                w.abort()
            raise
        finally:
            self.reader.close()
        return self.done

    def _writer(self, f: OutFile) -> Sink:
        if f.name not in self.open:
            self.open[f.name] = self.sink(f, file_header(f, self.metadata))
        return self.open[f.name]

    # ---- one tensor, all ranks ---------------------------------------------------------------

    def _emit(self, holders: list[_Holder]) -> None:
        sources: list[str] = []
        for h in holders:
            for p in h.tensor.pieces:
                if isinstance(p, Slice) and p.source not in sources:
                    sources.append(p.source)
        if not self._streamable(holders, sources):
            for h in holders:
                self._emit_direct(h)
            return
        for s in sources:
            info = self.tensors[s]
            if any(isinstance(p, Slice) and p.source == s and p.up for h in holders for p in h.tensor.pieces):
                self._feed(holders, s, self._whole(info), 0, 1 << 62)
                continue
            shape = _shape(info)
            row_bytes = info.nbytes // shape[0]
            rows_per_chunk = max(1, self.chunk_bytes // max(row_bytes, 1))
            lo, hi = self._row_span(holders, s)
            for c0 in range(lo, hi, rows_per_chunk):
                c1 = min(c0 + rows_per_chunk, hi)
                nbytes = (c1 - c0) * row_bytes
                buf = self.buf if nbytes <= len(self.buf) else None
                raw = self.reader.read(info, c0 * row_bytes, nbytes, buf)
                arr = np.frombuffer(raw, np.uint8).reshape((c1 - c0, *shape[1:], ITEMSIZE[info.dtype]))
                self._feed(holders, s, arr, c0, c1)
        for h in holders:
            self._advance_fills(h)
            if h.cursor != len(h.tensor.pieces):
                raise AssertionError(f"{h.tensor.name}: pieces left unwritten")

    @staticmethod
    def _streamable(holders: list[_Holder], sources: list[str]) -> bool:
        """Can one pass over each source, in order, emit every holder's pieces in order?"""
        rank = {s: i for i, s in enumerate(sources)}
        for h in holders:
            prev: Slice | None = None
            for p in h.tensor.pieces:
                if not isinstance(p, Slice):
                    continue
                if prev is not None:
                    if rank[p.source] < rank[prev.source]:
                        return False
                    if p.source == prev.source and (p.up or _bounds(p)[0][0] < _bounds(prev)[1][0]):
                        return False
                prev = p
        return True

    def _row_span(self, holders: list[_Holder], source: str) -> tuple[int, int]:
        lo, hi = 1 << 62, 0
        for h in holders:
            for p in h.tensor.pieces:
                if isinstance(p, Slice) and p.source == source:
                    a, b = _bounds(p)
                    lo, hi = min(lo, a[0]), max(hi, b[0])
        return lo, hi

    def _advance_fills(self, h: _Holder) -> None:
        pieces = h.tensor.pieces
        while h.cursor < len(pieces) and isinstance(pieces[h.cursor], Fill):
            p = pieces[h.cursor]
            self._write(h, np.frombuffer(fill_bytes(p.value, p.count, h.tensor.dtype), np.uint8), None)
            h.cursor += 1

    def _feed(self, holders: list[_Holder], source: str, arr: np.ndarray, c0: int, c1: int) -> None:
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
                    self._write(h, part, src_dtype)
                    h.cursor += 1
                    continue
                if a[0] >= c1:
                    break
                r0, r1 = max(a[0], c0), min(b[0], c1)
                if r1 > r0:
                    idx = (slice(r0 - c0, r1 - c0), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                    self._write(h, arr[idx], src_dtype)
                if b[0] <= c1:
                    h.cursor += 1
                    continue
                break

    def _write(self, h: _Holder, part: np.ndarray, src_dtype: str | None) -> None:
        if src_dtype is not None:
            part = self.cast(part, src_dtype, h.tensor.dtype)
        data = np.ascontiguousarray(part)
        h.writer.write(memoryview(data).cast("B"))
        self.progress(data.nbytes)

    def _whole(self, info: TensorInfo) -> np.ndarray:
        """A small tensor (block scales), up-sampled by every piece that asks for it."""
        raw = self.reader.read(info, 0, info.nbytes)
        return np.frombuffer(raw, np.uint8).reshape((*_shape(info), ITEMSIZE[info.dtype]))

    def _emit_direct(self, h: _Holder) -> None:
        """Fallback for piece orders one pass cannot serve: read each piece on its own."""
        for p in h.tensor.pieces:
            if isinstance(p, Fill):
                self._write(h, np.frombuffer(fill_bytes(p.value, p.count, h.tensor.dtype), np.uint8), None)
                continue
            info = self.tensors[p.source]
            a, b = _bounds(p)
            if p.up:
                arr = _upsample(self._whole(info), p.up)
                idx = tuple(slice(x, y) for x, y in zip(a, b, strict=True))
            else:
                shape = _shape(info)
                row_bytes = info.nbytes // shape[0]
                raw = self.reader.read(info, a[0] * row_bytes, (b[0] - a[0]) * row_bytes)
                arr = np.frombuffer(raw, np.uint8).reshape((b[0] - a[0], *shape[1:], ITEMSIZE[info.dtype]))
                idx = (slice(None), *tuple(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
            self._write(h, arr[idx], info.dtype)
        h.cursor = len(h.tensor.pieces)


def _upsample(arr: np.ndarray, up: tuple[int, ...]) -> np.ndarray:
    for dim, k in enumerate(up):
        if k > 1:
            arr = np.repeat(arr, k, axis=dim)
    return arr


def total_output_bytes(plan: Plan) -> int:
    return sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for f in plan.files for t in f.tensors)
