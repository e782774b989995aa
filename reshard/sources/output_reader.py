"""Reading source tensors back out of a reshard output's rank files (`OutputSource.open_reader`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.errors import CorruptError
from reshard.format import ITEMSIZE, TensorInfo, open_regular

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class Region:
    """Part of a source tensor stored contiguously (row-major) in one output file."""

    file: str
    offset: int  # absolute byte offset in the file
    start: tuple[int, ...]  # in the (possibly up-sampled) source coordinates
    stop: tuple[int, ...]
    up: tuple[int, ...] | None
    pad: tuple[int, ...] | None = None  # stored padded to this extent (plan.model.Slice.pad)
    stride: int = 0  # bytes from one stored row to the next when other parts sit beside it (plan.model.Cols)


class OutputReader:
    """A `Reader` over an output folder's regions: a source tensor's rows, gathered from the rank files."""

    def __init__(self, root: Path, regions: dict[str, list[Region]]) -> None:
        self.root = root
        self.regions = regions
        self.fds: dict[str, int] = {}

    def _pread(self, file: str, offset: int, nbytes: int) -> bytes:
        if file not in self.fds:
            self.fds[file] = open_regular(self.root / file, follow=False)
        data = os.pread(self.fds[file], nbytes, offset)
        if len(data) != nbytes:
            raise CorruptError(f"{self.root / file}: truncated", "the output is damaged")
        return data

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        import numpy as np  # here: planning from an output never needs it

        shape = t.shape if t.shape else (1,)
        item = ITEMSIZE[t.dtype]
        row_bytes = t.nbytes // shape[0]
        r0, r1 = start // row_bytes, (start + nbytes) // row_bytes
        out = np.empty((r1 - r0, *shape[1:], item), np.uint8)
        regs = self.regions[t.name]
        if any(r.up for r in regs):
            whole = self._paint(t, shape, item, regs)
            out[...] = whole[r0:r1]
        else:
            for r in regs:
                a, b = (r.start, r.stop) if r.start else ((0,), (1,))
                lo, hi = max(a[0], r0), min(b[0], r1)
                if hi <= lo:
                    continue
                inner = tuple(y - x for x, y in zip(a[1:], b[1:], strict=True))
                stored = r.pad[1:] if r.pad else inner  # a padded region: its rows are wider in the file
                rb = math.prod(stored) * item
                if r.stride:  # rows beside other parts': read the span, keep this part's bytes of each row
                    span = self._pread(r.file, r.offset + (lo - a[0]) * r.stride, (hi - lo - 1) * r.stride + rb)
                    rows_ = np.frombuffer(span + bytes(r.stride - rb), np.uint8).reshape(hi - lo, r.stride)
                    data = rows_[:, :rb].tobytes()
                else:
                    data = self._pread(r.file, r.offset + (lo - a[0]) * rb, (hi - lo) * rb)
                block = np.frombuffer(data, np.uint8).reshape((hi - lo, *stored, item))
                block = block[(slice(None), *(slice(0, n) for n in inner))]
                idx = (slice(lo - r0, hi - r0), *(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
                out[idx] = block
        view = memoryview(out).cast("B")
        if buf is not None:
            memoryview(buf)[:nbytes] = view
            return memoryview(buf)[:nbytes]
        return view

    def _paint(self, t: TensorInfo, shape: tuple[int, ...], item: int, regs: list[Region]) -> np.ndarray:
        import numpy as np

        whole = np.zeros((*shape, item), np.uint8)
        for r in regs:
            assert r.pad is None, "up-sampled pieces are never padded"
            up = r.up or (1,) * len(shape)
            dims = [b - a for a, b in zip(r.start, r.stop, strict=True)]
            data = self._pread(r.file, r.offset, math.prod(dims) * item)
            block = np.frombuffer(data, np.uint8).reshape((*dims, item))
            index = np.ix_(*[np.arange(a, b) // k for a, b, k in zip(r.start, r.stop, up, strict=True)])
            whole[index] = block
        return whole

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
