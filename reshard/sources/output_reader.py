"""Reading source tensors back out of a reshard output's rank files (`OutputSource.open_reader`)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.errors import CorruptError, unreadable_source
from reshard.format import ITEMSIZE, TensorInfo, open_regular

if TYPE_CHECKING:
    import numpy as np

GROUP_MAX = 8 * 1024 * 1024  # an expert group (one layer's experts) this small is read whole ...
GROUP_CACHE = 32 * 1024 * 1024  # ... and kept while it is used, up to this many bytes of groups


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


@dataclass(frozen=True, slots=True)
class Group:
    """The sources of one `plan.Stack` (a layer's experts, of one shape and dtype), stored back to
    back wherever a rank holds them: source k's slice of part (file, offset, start, stop, size) lies
    at offset + k * size of that file. One entry per layer and rank instead of one `Region` per
    expert and rank (issue 28: a 200k-tensor output at TP 8 has 1.6M of them)."""

    sources: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]  # every source's
    parts: tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], int], ...]


class Regions(Mapping[str, list[Region]]):
    """Where each source tensor lies in the rank files: a list of `Region`s per name, those of a
    stacked source made when asked for (from its `Group` and its index in it)."""

    def __init__(self, plain: dict[str, list[Region]], stacked: dict[str, tuple[Group, int]]) -> None:
        self.plain = plain
        self.stacked = stacked

    def __getitem__(self, name: str) -> list[Region]:
        got = self.plain.get(name)
        if got is not None:
            return got
        group, k = self.stacked[name]
        return [Region(f, off + k * size, a, b, None, None) for f, off, a, b, size in group.parts]

    def __iter__(self) -> Iterator[str]:
        yield from self.plain
        yield from self.stacked

    def __len__(self) -> int:
        return len(self.plain) + len(self.stacked)

    def __contains__(self, name: object) -> bool:
        return name in self.plain or name in self.stacked

    def strided(self) -> bool:
        """Whether any region is one of several parts side by side (`Region.stride`)."""
        return any(r.stride for regs in self.plain.values() for r in regs)

    def spans(self, item: Callable[[str], int]) -> Iterator[tuple[str, int, int]]:
        """(file, begin, end) of the bytes the regions cover, a group's part as one span; `item`:
        a source's bytes per element."""
        for name, regs in self.plain.items():
            size = item(name)
            for r in regs:
                dims = [b - a for a, b in zip(r.start, r.stop, strict=True)] or [1]
                inner = list(r.pad[1:]) if r.pad else dims[1:]
                yield r.file, r.offset, r.offset + dims[0] * math.prod(inner) * size
        groups = {id(g): g for g, k in self.stacked.values() if not k}  # every group's first source
        for g in groups.values():
            for f, off, _, _, size in g.parts:
                yield f, off, off + len(g.sources) * size


class OutputReader:
    """A `Reader` over an output folder's regions: a source tensor's rows, gathered from the rank files."""

    def __init__(self, root: Path, regions: Mapping[str, list[Region]]) -> None:
        self.root = root
        self.regions = regions
        self.fds: dict[str, int] = {}
        self.stacked = regions.stacked if isinstance(regions, Regions) else {}
        self.groups: dict[int, np.ndarray] = {}  # small groups read whole, least recently used first
        self.cached = 0
        self.group_lock = threading.Lock()  # the prefetcher's threads read at once

    def _pread(self, file: str, offset: int, nbytes: int) -> bytes:
        try:
            fd = self.fds.get(file)
            if fd is None:  # two threads may open it at once: one descriptor is kept
                fd = open_regular(self.root / file, follow=False)
                if self.fds.setdefault(file, fd) != fd:
                    os.close(fd)
                    fd = self.fds[file]
            data = os.pread(fd, nbytes, offset)
        except OSError as e:  # a failing disk or mount: the source's (exit 4), not OUT_DIR's
            raise unreadable_source(self.root / file, e) from e
        if len(data) != nbytes:
            raise CorruptError(f"{self.root / file}: truncated", "the output is damaged")
        return data

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        import numpy as np  # here: planning from an output never needs it

        held = self.stacked.get(t.name)
        if held is not None:
            whole = self._group(held[0])
            if whole is not None:  # a small expert: its bytes out of its layer's group, read whole
                got = whole[held[1]].reshape(-1)[start : start + nbytes]
                if buf is None:
                    return memoryview(got.copy())
                memoryview(buf)[:nbytes] = memoryview(got)
                return memoryview(buf)[:nbytes]
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

    def _group(self, group: Group) -> np.ndarray | None:
        """Every source of `group` as one array (source, its bytes), read a part (a rank's slice of
        all of them) at a time; None for a group over GROUP_MAX bytes (read a source at a time).
        A 200k-tensor output at TP 8 holds 1.6M expert slices of a few hundred bytes: read and
        placed one by one they cost ~20 us each, read as 16 blocks per layer next to nothing."""
        import numpy as np

        with self.group_lock:
            whole = self.groups.pop(id(group), None)
            if whole is None:
                item = ITEMSIZE[group.dtype]
                n, each = len(group.sources), math.prod(group.shape) * item
                if n * each > GROUP_MAX:
                    return None
                whole = np.empty((n, *group.shape, item), np.uint8)
                for f, off, a, b, size in group.parts:
                    dims = [y - x for x, y in zip(a, b, strict=True)]
                    block = np.frombuffer(self._pread(f, off, n * size), np.uint8).reshape((n, *dims, item))
                    whole[(slice(None), *(slice(x, y) for x, y in zip(a, b, strict=True)))] = block
                whole = whole.reshape(n, each)
                self.cached += whole.nbytes
                while self.cached > GROUP_CACHE and self.groups:  # the least recently used go
                    self.cached -= self.groups.pop(next(iter(self.groups))).nbytes
            self.groups[id(group)] = whole  # the most recently used: last
            return whole

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
        self.groups.clear()
        self.cached = 0
