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
one file exactly once, and the stretch fits in the span buffer, it is read in one go (with O_DIRECT
where the file is read so) and each step copies its reads out of it: a span. Every source byte is
still read once; a stretch with a byte no step reads, or one read twice, is not a span. A real
release's layer (GBs of experts) is no span: its reads are large, read ahead as before.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import pairwise, repeat
from operator import add, attrgetter
from typing import NamedTuple

from reshard.io.memory import ALIGN, aligned_buffer
from reshard.io.prefetch import SMALL_READ
from reshard.io.reader import AlignedReader, files, offsets, runs
from reshard.schedule import Group, Read, Step

ReadBatch = Callable[[Sequence[Read], memoryview, int], None]  # AlignedReader.read_batch's contract

MAX_STEPS = 8  # steps one span may serve (a layer's experts: 2 to 4 steps)


class Span(NamedTuple):
    """Bytes [lo, hi) of the file of `first` (a read of it: what an error names), read by `steps`
    consecutive steps."""

    first: Read
    lo: int
    hi: int
    steps: int


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
                    best = Span(steps[k].reads[0], lo, hi, m - k + 1)
                m += 1
        if best is None:
            k += 1
        else:
            out[k] = best
            k += best.steps
    return out


def _extent(step: Step) -> tuple[str, int, int, int] | None:
    """The one file a step reads, the stretch [lo, hi) its reads span and their bytes; None where it
    reads more than one file."""
    reads = step.reads
    names = set(files(reads))
    if len(names) != 1:
        return None
    begins = offsets(reads)
    if type(reads) is Group:  # each of `nbytes`
        return names.pop(), min(begins), max(begins) + reads.nbytes, len(reads) * reads.nbytes
    sizes = [r.nbytes for r in reads]
    return names.pop(), min(begins), max(map(add, begins, sizes)), sum(sizes)


def _tiled(steps: Sequence[Step]) -> bool:
    """Whether the steps' reads (as many bytes as their stretch holds) overlap nowhere: then each
    byte of it is read exactly once."""
    ranges = sorted(x for s in steps for x in zip(offsets(s.reads), _sizes(s.reads), strict=True))
    return all(a + size <= b for (a, size), (b, _) in pairwise(ranges))


def _sizes(reads: Sequence[Read]) -> Iterable[int]:
    return repeat(reads.nbytes, len(reads)) if type(reads) is Group else map(_NBYTES, reads)


_NBYTES = attrgetter("nbytes")


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
    read by the main thread (`AlignedReader.read_batch`); so is one of small reads (an expert of a few
    KB) of a file not in the cache, where its stretch is a span (read whole, with O_DIRECT: one read
    per 4 KB tensor cost ~50 us of system time each, 10x `cp` at 200k tensors). Call `plan` (the
    span buffer's largest size), then `at(k)` for every step in order: how step k is read (None: by
    the reader threads, which read `ahead`)."""

    def __init__(self, reader: object, steps: Sequence[Step], uniform: Sequence[bool]) -> None:
        self.reader = reader if isinstance(reader, AlignedReader) else None
        self.steps = steps
        self.inline = [u and self._inline(step) for step, u in zip(steps, uniform, strict=True)]
        spanning = self.reader is not None and self.reader.reads_spans
        self.spannable = [
            i or (u and spanning and _small(step)) for step, u, i in zip(steps, uniform, self.inline, strict=True)
        ]
        self.spans: dict[int, Span] = {}
        self.limit = 0
        self.buf: mmap.mmap | None = None
        self.span: tuple[memoryview, int] | None = None  # the stretch read last, and where it starts
        self.left = 0  # steps it still serves

    def _inline(self, step: Step) -> bool:
        return self.reader is not None and all(map(self.reader.inline, set(files(step.reads))))

    def plan(self, limit: int) -> bool:
        """The spans, for a buffer of `limit` bytes (a stretch read with O_DIRECT takes up to a page
        more at each end); whether there are any (the buffer is needed)."""
        self.limit = limit
        if any(self.spannable):
            self.spans = spans(self.steps, self.spannable, limit - 2 * ALIGN)
        return bool(self.spans)

    @property
    def ahead(self) -> list[Read]:
        """The reads the reader threads make, in order: those of the steps the main thread does not read."""
        served = {k + d for k, s in self.spans.items() for d in range(s.steps)}
        mine = [i or k in served for k, i in enumerate(self.inline)]
        return [r for step, m in zip(self.steps, mine, strict=True) if not m for r in step.reads]

    def at(self, k: int) -> ReadBatch | None:
        if k in self.spans:
            self.span, self.left = self._read(self.spans[k]), self.spans[k].steps
        if self.left:
            assert self.span is not None
            self.left -= 1
            return partial(copy_reads, *self.span)
        if self.inline[k]:
            assert self.reader is not None
            return self.reader.read_batch
        return None

    def _read(self, span: Span) -> tuple[memoryview, int]:
        """The stretch read into the span buffer (made when first needed): its view, where it starts."""
        assert self.reader is not None
        if self.buf is None:
            self.buf = aligned_buffer(self.limit)
        view = self.reader.read_span(span.first.info, span.lo, span.hi - span.lo, memoryview(self.buf))
        return view, span.lo


def _small(step: Step) -> bool:
    """Reads small enough that one each costs more than the bytes (reshard.io.prefetch's runs)."""
    return sum(_sizes(step.reads)) <= SMALL_READ * len(step.reads)
