"""Where the reads of uniform steps are made: by the main thread as it uses them, or read ahead.

A uniform step (reshard.batch: an MoE layer's experts, hundreds of reads of one shape) whose files
are in the page cache (`AlignedReader.inline`) is read by the main thread straight into the batch
buffer, not read ahead by the reader threads: at 200k reads of a few KB their hand-over of each read
cost more than the read (`InlineReads`).

An MoE layer's experts lie side by side in their file (by name: each expert's down, gate and up
projections), and the layer's uniform steps (the stacked gate and up projections, then the down
projections) read all of them, each step every other tensor. Read step by step, that was a
`preadv` per expert's gate and up pair and one per down projection: 132k system calls and 1.1 s of
the main thread at 200k tensors of 4 KB (issue 28); not in the page cache, an O_DIRECT read of a
page or two per tensor, ~50 us of system time each: 19 s where `cp` takes 1.7. Where consecutive
uniform steps, of cached files or of small reads, read between them every byte of one stretch of
one file exactly once, and the stretch fits in a batch buffer, it is one read (with O_DIRECT where
the file is read so), made ahead by the reader threads like any other, and each step copies its
reads out of it: a span. Every source byte is still read once; a stretch with a byte no step reads,
or one read twice, is not a span. A real release's layer (GBs of experts) is no span: its reads are
large, read ahead as before. (The main thread read the spans itself until session 25: 0.25-0.5 s of
its time in a 200k-tensor save at EP, and one O_DIRECT read in flight at a time where not cached.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise
from operator import add
from typing import NamedTuple

from reshard.io.memory import Lease
from reshard.io.prefetch import SMALL_READ
from reshard.io.reader import AlignedReader, files, offsets, runs, sizes
from reshard.schedule import Read, Step

ReadBatch = Callable[[Sequence[Read], memoryview, int], None]  # AlignedReader.read_batch's contract

MAX_STEPS = 8  # steps one span may serve (a layer's experts: 2 to 4 steps)


class Span(NamedTuple):
    """Bytes [lo, hi) of the file of `first` (the read at lo: what an error names), read by `steps`
    consecutive steps."""

    first: Read
    lo: int
    hi: int
    steps: int

    @property
    def read(self) -> Read:
        """The stretch as one read (the reader threads')."""
        return Read(self.first.info, self.first.start, self.hi - self.lo, None)


def spans(steps: Sequence[Step], eligible: Sequence[bool], limit: int) -> dict[int, Span]:
    """The spans of `steps` (of those `eligible` marks), by the index of the first step each serves:
    from each eligible step, the most consecutive eligible steps (at most MAX_STEPS, at most `limit`
    bytes) whose reads tile one stretch of one file."""
    extents = [_extent(step) if e else None for step, e in zip(steps, eligible, strict=True)]
    out: dict[int, Span] = {}
    k, n = 0, len(steps)
    while k < n:
        best, m = None, k
        first = extents[k]
        if first is not None:
            file, lo, hi, total = first[0], first[1], first[2], 0
            while m < n and m - k < MAX_STEPS and (e := extents[m]) is not None and e[0] == file:
                lo, hi, total = min(lo, e[1]), max(hi, e[2]), total + e[3]
                if total > limit:
                    break
                if hi - lo == total and _tiled(steps[k : m + 1]):
                    best = Span(_read_at(steps[k : m + 1], lo), lo, hi, m - k + 1)
                m += 1
        if best is None:
            k += 1
        else:
            out[k] = best
            k += best.steps
    return out


def _read_at(steps: Sequence[Step], pos: int) -> Read:
    """The read of `steps` that begins at file position `pos`."""
    for step in steps:
        begins = offsets(step.reads)
        if pos in begins:
            return step.reads[begins.index(pos)]
    raise AssertionError(f"no read begins at {pos}")


def _extent(step: Step) -> tuple[str, int, int, int] | None:
    """The one file a step reads, the stretch [lo, hi) its reads span and their bytes; None where it
    reads more than one file."""
    reads = step.reads
    names = set(files(reads))
    if len(names) != 1:
        return None
    begins, lengths = offsets(reads), sizes(reads)
    return names.pop(), min(begins), max(map(add, begins, lengths)), sum(lengths)


def _tiled(steps: Sequence[Step]) -> bool:
    """Whether the steps' reads (as many bytes as their stretch holds) overlap nowhere: then each
    byte of it is read exactly once."""
    ranges = sorted(x for s in steps for x in zip(offsets(s.reads), sizes(s.reads), strict=True))
    return all(a + size <= b for (a, size), (b, _) in pairwise(ranges))


def copy_reads(span: memoryview, lo: int, reads: Sequence[Read], out: memoryview, nbytes: int) -> None:
    """Reads of `nbytes` each, out of `span` (the file's bytes from `lo`), one after the other into
    `out` (`AlignedReader.read_batch`'s contract); reads that follow each other in the file in one copy."""
    begins = offsets(reads)
    for i, j in runs(begins, nbytes):
        a = begins[i] - lo
        out[i * nbytes : j * nbytes] = span[a : a + (j - i) * nbytes]


class InlineReads:
    """Which of `steps` the main thread reads itself, and how: `uniform[k]` says whether step k is
    uniform; `reader`'s `inline` which files are in the page cache. A uniform step of cached files is
    read by the main thread (`AlignedReader.read_batch`). Consecutive uniform steps of cached files,
    or of small reads (an expert of a few KB) of a file not in the cache (with O_DIRECT: one read per
    4 KB tensor cost ~50 us of system time each, 10x `cp` at 200k tensors), whose reads tile a stretch
    are a span: read whole, ahead, by the reader threads, and copied out of their buffer by the main
    thread (read there, the stretches were 40% of its time in a 200k-tensor save at EP).

    Call `plan` (the largest span), then `at(k)` for every step in order: how step k is read (None:
    by the reader threads, which read `ahead`, spans included); `get` (the reader threads' hand-out)
    must be set before. `close` gives back the span being served."""

    def __init__(self, reader: object, steps: Sequence[Step], uniform: Sequence[bool]) -> None:
        self.reader = reader if isinstance(reader, AlignedReader) else None
        self.steps = steps
        self.inline = [u and self._inline(step) for step, u in zip(steps, uniform, strict=True)]
        spanning = self.reader is not None and self.reader.reads_spans
        self.spannable = [
            i or (u and spanning and _small(step)) for step, u, i in zip(steps, uniform, self.inline, strict=True)
        ]
        self.spans: dict[int, Span] = {}
        self.get: Callable[[], tuple[memoryview, Lease]] | None = None
        self.span: tuple[memoryview, int] | None = None  # the stretch being served, and where it starts
        self.lease: Lease | None = None  # ... its memory
        self.left = 0  # steps it still serves

    def _inline(self, step: Step) -> bool:
        return self.reader is not None and all(map(self.reader.inline, set(files(step.reads))))

    def plan(self, limit: int) -> None:
        """The spans, of at most `limit` bytes each."""
        if any(self.spannable):
            self.spans = spans(self.steps, self.spannable, limit)

    @property
    def ahead(self) -> list[Read]:
        """The reads the reader threads make, in order: each span (where its first step is), and the
        reads of the steps the main thread neither reads nor serves from a span."""
        served = {k + d for k, s in self.spans.items() for d in range(s.steps)}
        out: list[Read] = []
        for k, step in enumerate(self.steps):
            if k in self.spans:
                out.append(self.spans[k].read)
            elif not (self.inline[k] or k in served):
                out.extend(step.reads)
        return out

    def at(self, k: int) -> ReadBatch | None:
        if not self.left and self.lease is not None:
            self.close()  # the span's steps are done: its memory back before this step's reads
        if k in self.spans:
            assert self.get is not None
            view, self.lease = self.get()
            self.span, self.left = (view, self.spans[k].lo), self.spans[k].steps
        if self.left:
            assert self.span is not None
            self.left -= 1
            return partial(copy_reads, *self.span)
        if self.inline[k]:
            assert self.reader is not None
            return self.reader.read_batch
        return None

    def close(self) -> None:
        """Give back the memory of the span being served."""
        lease, self.lease, self.span = self.lease, None, None
        if lease is not None:
            lease.release()


def _small(step: Step) -> bool:
    """Reads small enough that one each costs more than the bytes (reshard.io.prefetch's runs)."""
    return sum(sizes(step.reads)) <= SMALL_READ * len(step.reads)
