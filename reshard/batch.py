"""Uniform steps: many small sources of one shape, every rank taking the same slice of each.

An MoE layer's experts are hundreds of small tensors of one shape (an expert's gate, up or down
projection), and each rank takes the same rows or columns of every one of them (TP), or whole
tensors of some of them (EP). Emitted piece by piece, such a step costs the executor a few
microseconds per piece and rank in Python (197,763 tensors x 8 ranks: tens of seconds); here the
step's reads are copied into one of two reused batch buffers, a chunk at a time, and every rank's
pieces from that batch go to its writer at once, as one view of the buffer (a slice, where the rank
takes consecutive reads: every TP rank, each EP rank) or one numpy `take`: a handful of operations
per rank and chunk.

What makes a step uniform (`uniform`): each read is one whole source (or the same rows of each),
all of one dtype and shape, at most `limit` bytes each; every piece of every rank is a plain slice
(no fill, padding, transpose, stride or dequantisation) with the same bounds as that rank's other
pieces, and a rank's pieces use the reads in increasing order. The pieces may all up-sample their
source by the same factors (an FP8 MoE's block scales in a backend's finer blocks: thousands of
768-byte pieces a layer, each a queued write and a writer's wake-up when emitted one by one): the
batch is then up-sampled at once, and each rank's pieces copied out of it. The bytes written are
exactly those of the piece-by-piece path (tests/test_execute_batch.py compares both).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, lt
from typing import Protocol

import numpy as np

from reshard.format import ITEMSIZE
from reshard.io import writer
from reshard.io.dtypes import Caster, upsample
from reshard.io.memory import ALIGN, Lease, Memory, Reused
from reshard.plan import OutTensor, Slice, Stack, count
from reshard.schedule import Group, Read, Step, bounds, shape_of

MIN_READS = 16  # fewer reads than this: the piece-by-piece path is as fast


@dataclass(frozen=True)
class Uniform:
    """How a uniform step's reads map onto its ranks' pieces."""

    shape: tuple[int, ...]  # one read as uint8 array: (rows, *rest, itemsize)
    nbytes: int  # bytes per read
    dtype: str  # the sources' dtype
    index: tuple[np.ndarray, ...]  # per holder: the read each of its pieces comes from, increasing
    sel: tuple[tuple[slice, ...], ...]  # per holder: the slice of a read its pieces take (up-sampled)
    up: tuple[int, ...] | None = None  # every piece up-samples its read by these factors (whole reads)

    @property
    def grown(self) -> int:
        """Bytes per read once up-sampled."""
        return self.nbytes * math.prod(self.up or ())


def uniform(step: Step, tensors: list[OutTensor], limit: int) -> Uniform | None:
    """The step as a `Uniform`, or None where it is not one (see the module docstring)."""
    reads = step.reads
    if len(reads) < MIN_READS:
        return None
    first = reads[0]
    info0 = first.info
    if first.piece is not None or first.scale or first.nbytes > limit:
        return None
    if type(reads) is Group:  # so by construction: distinct sources, each read alike
        names: Sequence[str] = reads.names
    else:
        # every read as the first: no piece, no scale, the same rows and bytes of sources of one dtype
        # and shape (checked in C-level loops)
        if len(set(map(_READ, reads))) != 1:
            return None
        infos = list(map(_INFO, reads))
        if len(set(map(_TENSOR, infos))) != 1:
            return None
        names = list(map(_NAME, infos))
        if len(set(names)) != len(names):
            return None  # a source read twice (row chunks): not one read per source
    pos = _Positions(names)
    lo = first.rows[0] if first.rows is not None else 0
    full = shape_of(info0)
    rows = first.rows[1] - first.rows[0] if first.rows is not None else full[0]
    index, sel, ups = [], [], set()
    known: dict[tuple[str, ...], np.ndarray | None] = {}  # a Stack's sources (every TP rank's are the same): indices
    for t in tensors:
        got = _holder(t, pos, lo, rows, full, known)
        if got is None:
            return None
        index.append(got[0])
        sel.append(got[1])
        ups.add(got[2])
    if len(ups) != 1:
        return None  # ranks up-sampling differently (or some not at all)
    up = ups.pop()
    u = Uniform((rows, *full[1:], ITEMSIZE[info0.dtype]), first.nbytes, info0.dtype, tuple(index), tuple(sel), up)
    return u if u.grown <= limit else None


_READ = attrgetter("piece", "scale", "rows", "nbytes")
_INFO = attrgetter("info")
_TENSOR = attrgetter("dtype", "shape")
_NAME = attrgetter("name")
_GEOMETRY = attrgetter("start", "stop", "up", "pad", "perm", "step", "scale")
_PLAIN = (None, None, 1, None)  # pad, perm, step, scale of a plain slice


class _Positions:
    """Where each of a step's sources is read (its index among the reads), for the holders' pieces."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = names
        self.by_name: dict[str, int] | None = None

    def of(self, sources: Iterable[str]) -> np.ndarray | None:
        """The read indices of `sources` where they increase; None where they do not, or one is not
        read by the step."""
        if self.by_name is None:
            self.by_name = dict(zip(self.names, range(len(self.names)), strict=True))
        return _increasing(map(self.by_name.__getitem__, sources))

    def of_stack(self, sources: tuple[str, ...]) -> np.ndarray | None:
        """`of` for a `Stack`'s sources: where they are consecutive reads (every TP rank's stack is
        all of them, an EP rank's its experts' run), found with a search and one comparison."""
        names = self.names
        if type(names) is tuple and sources:
            try:
                i = names.index(sources[0])
            except ValueError:
                return None
            if names[i : i + len(sources)] == sources:
                return np.arange(i, i + len(sources), dtype=np.int64)
        return self.of(sources)


def _holder(
    t: OutTensor,
    pos: _Positions,
    lo: int,
    rows: int,
    full: tuple[int, ...],
    known: dict[tuple[str, ...], np.ndarray | None],
) -> tuple[np.ndarray, tuple[slice, ...], tuple[int, ...] | None] | None:
    """One holder's read indices, slice and up-sampling, or None (checked with C-level loops: an MoE
    layer's holder has thousands of pieces, or one `Stack` of them; `known`: the indices of the
    Stacks' sources met before, or None where they are not increasing reads)."""
    pieces = t.pieces
    up = None
    if len(pieces) == 1 and type(pieces[0]) is Stack:
        names = pieces[0].sources
        a, b = pieces[0].start, pieces[0].stop
        if names not in known:
            known[names] = pos.of_stack(names)
        index = known[names]
        if index is None:
            return None
    else:
        if not pieces or any(type(p) is not Slice for p in pieces):
            return None
        geometry = set(map(_GEOMETRY, pieces))
        if len(geometry) != 1:
            return None
        shape = next(iter(geometry))
        if shape[3:] != _PLAIN:
            return None
        up = shape[2] or None
        if up is not None:
            if len(up) != len(full) or rows != full[0]:
                return None  # up-sampling takes whole reads
            rows = rows * up[0]
        a, b = bounds(pieces[0])
        index = pos.of(map(_SOURCE, pieces))
        if index is None:
            return None
    if a[0] < lo or b[0] > lo + rows:
        return None
    sel = (slice(a[0] - lo, b[0] - lo), *(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
    return index, sel, up


_SOURCE = attrgetter("source")


def _increasing(indices: Iterator[int]) -> np.ndarray | None:
    """The read indices as an array where they increase; None where they do not, or a source is not
    one of the step's reads (KeyError). Checked in Python, not numpy: a comparison of more than a few
    hundred elements lets go of the GIL, and the main thread waits a switch interval to get it back
    from the readers (`cut` says why that counts)."""
    try:
        got = list(indices)
    except KeyError:
        return None
    if not all(map(lt, got, islice(got, 1, None))):
        return None
    return np.array(got, np.int64)


def fill(buf: memoryview, get: Callable[[], tuple[memoryview, Lease]], count: int, nbytes: int) -> None:
    """Copy the next `count` reads (`get`: the prefetcher's, each `nbytes`) into `buf`, one after the
    other, releasing their leases; consecutive reads share one (reshard.io.prefetch's runs), given
    back at once."""
    held, k = None, 0
    # from writer.NUMPY_COPY bytes a read is copied with numpy (without the GIL), as the writers' stages are
    dst = np.frombuffer(buf, np.uint8) if nbytes >= writer.NUMPY_COPY else None
    try:
        for off in range(0, count * nbytes, nbytes):  # ~200k reads in a run: copies, nothing else
            view, lease = get()
            if dst is None:
                buf[off : off + nbytes] = view
            else:  # numpy lets the other threads run while it copies
                np.copyto(dst[off : off + nbytes], np.frombuffer(view, np.uint8))
            del view
            if lease is not held:
                if held is not None:
                    held.release(k)
                held, k = lease, 0
            k += 1
    finally:
        if held is not None:
            held.release(k)


def batch_reads(u: Uniform, chunk_bytes: int) -> int:
    """How many reads one batch takes: a batch buffer's worth (up-sampled: what up-samples to one)."""
    return max(1, chunk_bytes // max(u.grown, 1))


def cut(u: Uniform, batch: np.ndarray, base: int, count: int, holder: int) -> tuple[np.ndarray, bool, int, int] | None:
    """Holder `holder`'s pieces from reads [base, base + count) (`batch`: those reads, shaped
    (count, *u.shape)): their bytes in C order, whether that array is a view of `batch` (consecutive
    reads: every TP rank's, each EP rank's experts) rather than a new one, and the [first, last) of
    its pieces; None when none of its pieces come from these reads."""
    index = u.index[holder]
    # bisect, not np.searchsorted: numpy lets go of the GIL for it, and the main thread (every step's
    # critical path) then waits up to a switch interval (5 ms) for the reader and writer threads to
    # give it back: with 2,048 cuts in a 200k-tensor TP 8 save, ~1 s of its wall time
    s = bisect_left(index, base)
    e = bisect_left(index, base + count, s)
    if s == e:
        return None
    first, last = int(index[s]) - base, int(index[e - 1]) - base
    if last - first == e - s - 1:
        return wide(batch[first : last + 1], u.sel[holder]), True, int(s), int(e)
    picked = np.take(batch[(slice(None), *u.sel[holder])], index[s:e] - base, axis=0)
    return picked, False, int(s), int(e)


def wide(reads: np.ndarray, sel: tuple[slice, ...]) -> np.ndarray:
    """The view `reads[:, *sel]` (uint8 [count, ..., itemsize]) in words as wide as the selection's
    innermost runs allow (the same bytes in C order): a rank's few columns of each row of an
    expert's down projection are 8-byte runs, which byte-wise copies move 2-5x slower."""
    shape = reads.shape  # (count, rows, ..., last, itemsize)
    item = shape[-1]
    x, y = sel[-1].start, sel[-1].stop
    width = shape[-2] * item
    for w, dtype in ((8, np.uint64), (4, np.uint32), (2, np.uint16)):
        if width % w == 0 and (x * item) % w == 0 and (y * item) % w == 0 and reads.ctypes.data % w == 0:
            flat = reads.reshape((*shape[:-2], width)).view(dtype)
            return flat[(slice(None), *sel[:-1], slice(x * item // w, y * item // w))]
    return reads[(slice(None), *sel)]


class Holder(Protocol):
    """One rank's copy of the step's tensor (reshard.execute's): its writer, and how many of its
    pieces are written."""

    tensor: OutTensor
    cursor: int

    @property
    def writer(self) -> Writer: ...


class Writer(Protocol):
    def write(self, data: np.ndarray, lease: Lease) -> None: ...


class Batches:
    """Emits uniform steps for the executor: each holder's pieces from many reads handed to its
    writer at once, as a view of their memory (the writer copies it, without the GIL, while the
    main thread goes on) or, cast or picked, a new array. The reads are copied into one of two
    reused batch buffers of `batch_bytes` a batch at a time (taken out of the fresh budget when
    first needed). (Large reads cut where they were read, without that copy, cost a cold FP8 MoE
    save more CPU, not less: their rank pieces then went to disk as many small writes.)"""

    def __init__(self, mem: Memory, batch_bytes: int, cast: Caster, progress: Callable[[int], None]) -> None:
        self.mem, self.batch_bytes, self.cast, self.progress = mem, batch_bytes, cast, progress
        self.get: Callable[[], tuple[memoryview, Lease]] | None = None  # the prefetcher's, set before the first emit
        self.size: int | None = None
        self.cur: Reused | None = None  # the batch buffer being filled (one reference ours), to `off`
        self.off = 0

    def emit(
        self,
        reads: Sequence[Read],
        holders: Sequence[Holder],
        u: Uniform,
        read_batch: Callable[[Sequence[Read], memoryview, int], None] | None = None,
    ) -> None:
        """Take the step's `reads` from the prefetcher, in order (or read them with `read_batch`
        where given: `AlignedReader.read_batch`), and write every holder's pieces."""
        n, get = len(reads), self.get
        self.reserve()
        assert self.size is not None
        per = batch_reads(u, self.size)
        for base in range(0, n, per):
            k = min(per, n - base)
            buf, off = self._region(k * u.nbytes)
            try:
                if read_batch is None:
                    assert get is not None
                    fill(memoryview(buf.buf)[off:], get, k, u.nbytes)
                else:
                    read_batch(reads[base : base + k], memoryview(buf.buf)[off : off + k * u.nbytes], u.nbytes)
                batch = np.frombuffer(buf.buf, np.uint8, k * u.nbytes, off).reshape((k, *u.shape))
                if u.up is None:
                    self._hand_out(u, batch, base, holders, buf)
                else:
                    self._hand_out_grown(u, batch, base, holders)
            finally:
                buf.release()
        for h in holders:
            if h.cursor != count(h.tensor.pieces):
                raise AssertionError(f"{h.tensor.name}: pieces left unwritten")

    def reserve(self) -> None:
        """Set the two buffers' bytes aside in the fresh budget (once, when first needed)."""
        if self.size is None:  # two buffers for the run, reused: no page faults, no heap to fragment
            self.size = self.mem.reserve(2 * self.batch_bytes) // 2
            assert self.size == self.batch_bytes  # a uniform step's reads are at most batch_bytes each

    def _region(self, nbytes: int) -> tuple[Reused, int]:
        """Where the next batch goes: after the last one in the same buffer while it fits (a page
        boundary apart), else at the start of the other. A layer's experts at EP are a few MB a step,
        and the writers hold their views until a 4 MiB stage goes to disk, ten steps later: a buffer
        per step made the main thread wait for them (and them write early) every other step."""
        assert self.size is not None
        if self.cur is None or self.off + nbytes > self.size:
            if self.cur is not None:
                self.cur.release()
                self.cur = None
            self.cur, self.off = self.mem.take_reused(self.size, 2), 0
        off = self.off
        self.off += -(-nbytes // ALIGN) * ALIGN
        self.cur.hold()
        return self.cur, off

    def close(self) -> None:
        """Give back the buffer being filled (the run's end, or its failure)."""
        if self.cur is not None:
            self.cur.release()
            self.cur = None

    def _hand_out(
        self, u: Uniform, batch: np.ndarray, base: int, holders: Sequence[Holder], lease: Lease, lend: bool = True
    ) -> None:
        """Every holder's pieces from reads [base, base + len(batch)), whose memory `lease` holds;
        `lend`: a holder may be handed a view of it (else every piece is copied out)."""
        same = u.dtype == holders[0].tensor.dtype and self.cast.device == "cpu"
        for hi, h in enumerate(holders):
            got = cut(u, batch, base, len(batch), hi)
            if got is None:
                continue
            picked, view, first, last = got
            assert first == h.cursor, f"{h.tensor.name}: pieces out of order"
            if view and same and lend:
                lease.hold()
                h.writer.write(picked, lease)
            else:
                if view:  # a copy: the cast may give back what it was given (I32 -> U8)
                    shape = (last - first, *(x.stop - x.start for x in u.sel[hi]), u.shape[-1])
                    picked = picked.copy().view(np.uint8).reshape(shape)
                out = self.cast(picked, u.dtype, h.tensor.dtype)
                h.writer.write(out, self.mem.account(out.nbytes))
            self.progress(picked.nbytes)
            h.cursor = last

    def _hand_out_grown(self, u: Uniform, batch: np.ndarray, base: int, holders: Sequence[Holder]) -> None:
        """`_hand_out` for up-sampled pieces: the batch up-sampled at once (at most a batch buffer's
        bytes, counted in the fresh budget while it lives), each holder's pieces copied out of it."""
        assert u.up is not None
        lease = self.mem.account(len(batch) * u.grown)
        try:
            self._hand_out(u, upsample(batch, (1, *u.up, 1)), base, holders, lease, lend=False)
        finally:
            lease.release()
