"""The schedule: every source read of a save, in order, and which rank tensors consume it.

Computed once from the plan before any I/O (reshard.execute): one `Step` per tensor name in one
global order shared by every rank, each with its `Read`s of source rows in chunks of about
`chunk_bytes`. The reader threads read ahead through this list and the main thread emits from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import groupby, repeat
from operator import add, attrgetter, itemgetter
from typing import NamedTuple, overload

from reshard.bulk import paused_gc
from reshard.format import ITEMSIZE, TensorInfo, encode_header
from reshard.io.memory import ALIGN
from reshard.plan import Cols, OutFile, OutTensor, Plan, Slice, Stack, flat, natural_key

DEFAULT_CHUNK = 32 * 1024 * 1024
ALL_ROWS = 1 << 62


class Read(NamedTuple):
    """One source read: bytes [start, start + nbytes) of `info`. A named tuple, 2-3x faster to make
    than a frozen dataclass (an MoE layer's experts are a `Group` instead: no record each).

    rows: the source rows [r0, r1) it holds; None: the whole tensor (it is up-sampled).
    piece: None: fed to every rank's copy of the step's tensor (one pass over the source);
        (holder, piece): the one piece it is read for (a tensor one pass cannot serve; a `Cols`
        piece: one read per part, in order).
    scale: the whole block-scale tensor of an FP8 source the step dequantises (`Slice.scale`), kept
        by the executor for the reads of that source, which follow it.
    """

    info: TensorInfo
    start: int
    nbytes: int
    rows: tuple[int, int] | None
    piece: tuple[int, int] | None = None
    scale: bool = False


class Group(Sequence[Read]):
    """The reads of a step whose sources are all read alike: the same bytes [start, start + nbytes)
    (rows `rows`) of each of `infos`, distinct sources of one dtype and shape, each in one chunk. An
    MoE layer's experts, one record for the layer (issue 28: a 200k-tensor save made 197,763 `Read`s,
    and checked them one by one again in `reshard.batch` and `reshard.spans`).

    A sequence of the `Read`s it stands for, made when asked (the reader threads' list, the
    piece-by-piece path); the per-step paths take its columns instead: `names`, `offsets()`, `files()`.
    """

    __slots__ = ("infos", "names", "nbytes", "rows", "start")

    def __init__(
        self, infos: tuple[TensorInfo, ...], names: tuple[str, ...], start: int, nbytes: int, rows: tuple[int, int]
    ) -> None:
        self.infos, self.names, self.start, self.nbytes, self.rows = infos, names, start, nbytes, rows

    def __len__(self) -> int:
        return len(self.infos)

    @overload
    def __getitem__(self, k: int) -> Read: ...
    @overload
    def __getitem__(self, k: slice) -> Group: ...
    def __getitem__(self, k: int | slice) -> Read | Group:
        if isinstance(k, slice):
            return Group(self.infos[k], self.names[k], self.start, self.nbytes, self.rows)
        return Read(self.infos[k], self.start, self.nbytes, self.rows)

    def __iter__(self) -> Iterator[Read]:
        n = len(self.infos)
        args = zip(
            self.infos, repeat(self.start, n), repeat(self.nbytes, n), repeat(self.rows, n), repeat(None), repeat(False)
        )
        return map(partial(tuple.__new__, Read), args)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Group({len(self)} reads of {self.nbytes} bytes from {self.start}, rows {self.rows})"

    def offsets(self) -> list[int]:
        """Where each read begins in its file."""
        return list(map(add, map(_OFFSET, self.infos), repeat(self.start, len(self.infos))))

    def files(self) -> list[str]:
        return list(map(_FILE, self.infos))

    def sizes(self) -> list[int]:
        return [self.nbytes] * len(self.infos)


_OFFSET = attrgetter("offset")
_FILE = attrgetter("file")


@dataclass(frozen=True, slots=True)
class Step:
    """One tensor name: every rank's copy of it (file, tensor), the reads that make them (a tuple,
    or one `Group`), and the files whose last tensor it is."""

    name: str
    slots: tuple[tuple[OutFile, OutTensor], ...]
    reads: tuple[Read, ...] | Group
    closes: tuple[str, ...]


def schedule(plan: Plan, tensors: dict[str, TensorInfo], chunk_bytes: int) -> list[Step]:
    """The plan's tensors in the global write order (widest dtype first, then natural name order),
    each with its reads: source rows in chunks of about `chunk_bytes`."""
    if plan.layout_only:
        raise AssertionError("a layout-only plan (build_plan(pieces=False)) has no pieces to write")
    with paused_gc():  # a read per source tensor, no cycle among them (reshard.bulk)
        return _schedule(plan, tensors, chunk_bytes)


def _schedule(plan: Plan, tensors: dict[str, TensorInfo], chunk_bytes: int) -> list[Step]:
    slots: dict[str, list[tuple[OutFile, OutTensor]]] = {}
    last: dict[str, str] = {}  # file -> name of its last tensor
    for f in plan.files:
        for t in f.tensors:
            slots.setdefault(t.name, []).append((f, t))
        if f.tensors:
            last[f.name] = f.tensors[-1].name
    order = sorted(slots, key=lambda n: (-ITEMSIZE[slots[n][0][1].dtype], natural_key(n)))
    return [
        Step(
            name,
            tuple(slots[name]),
            _reads([t for _, t in slots[name]], tensors, chunk_bytes),
            tuple(f.name for f, _ in slots[name] if last[f.name] == name),
        )
        for name in order
    ]


def _reads(out: list[OutTensor], tensors: dict[str, TensorInfo], chunk_bytes: int) -> tuple[Read, ...] | Group:
    """The reads that make one tensor name's copies (`out`): one pass over each source in row
    chunks, or, where the pieces' order does not allow that, one read per piece. The block scales of
    FP8 sources it dequantises come first, whole. Sources all read alike: one `Group`."""
    scales, sources, streamable = _survey(out)
    if streamable and not scales:
        group = _group_reads(sources, tensors, chunk_bytes)
        if group is not None:
            return group
    reads = [Read(tensors[name], 0, tensors[name].nbytes, None, scale=True) for name in scales]
    if not streamable:
        for h, t in enumerate(out):
            for i, p in enumerate(flat(t.pieces)):
                for q in p.parts if isinstance(p, Cols) else (p,) if isinstance(p, Slice) else ():
                    info = tensors[q.source]
                    (a, *_), (b, *_) = bounds(q)
                    reads.append(_whole(info, (h, i)) if q.up else _rows(info, a, b, (h, i)))
        return tuple(reads)
    return tuple(reads + _stream(sources, tensors, chunk_bytes))


def _group_reads(sources: Sources, tensors: dict[str, TensorInfo], chunk_bytes: int) -> Group | None:
    """`sources` as one `Group`: more than one, all read for the same rows (none up-sampled), of one
    dtype and shape, each in one chunk; else None. (`sources` holds each name once.)"""
    if len(sources) < 2:
        return None
    spans = set(sources.values())
    if len(spans) != 1:
        return None
    ((up, lo, hi),) = spans
    if up:
        return None
    infos = tuple(map(tensors.__getitem__, sources))
    if len(set(map(_GEOMETRY, infos))) != 1:
        return None
    rb, per = _chunks({}, infos[0], chunk_bytes)
    if hi - lo > per:
        return None
    return Group(infos, tuple(sources), lo * rb, (hi - lo) * rb, (lo, hi))


def _stream(sources: Sources, tensors: dict[str, TensorInfo], chunk_bytes: int) -> list[Read]:
    """One pass over each of `sources`, in order: a whole read of those up-sampled, else their rows
    in chunks. A run of sources read for the same rows (a `Stack`'s: a layer's experts), of one
    geometry and each in one chunk, is made at once."""
    reads: list[Read] = []
    # by dtype and shape (an MoE layer's are a few): bytes per row, rows per chunk
    geometry: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    new = tuple.__new__
    infos = map(tensors.__getitem__, sources)
    for (up, lo, hi), run in groupby(zip(sources.values(), infos, strict=True), key=_SPAN):
        run = list(map(_INFO, run))
        if up:
            reads.extend(map(_whole, run))
            continue
        if len(run) > 1 and len(set(map(_GEOMETRY, run))) == 1:
            rb, per = _chunks(geometry, run[0], chunk_bytes)
            if hi - lo <= per:
                args = zip(run, repeat(lo * rb), repeat((hi - lo) * rb), repeat((lo, hi)), repeat(None), repeat(False))
                reads.extend(map(partial(new, Read), args))
                continue
        for info in run:
            rb, per = _chunks(geometry, info, chunk_bytes)
            if hi - lo <= per:  # one chunk: most sources (an expert's tensor)
                reads.append(new(Read, (info, lo * rb, (hi - lo) * rb, (lo, hi), None, False)))
                continue
            for c0 in range(lo, hi, per):
                c1 = min(c0 + per, hi)
                reads.append(new(Read, (info, c0 * rb, (c1 - c0) * rb, (c0, c1), None, False)))
    return reads


_SPAN = itemgetter(0)
_INFO = itemgetter(1)
_GEOMETRY = attrgetter("dtype", "shape")


def _chunks(
    geometry: dict[tuple[str, tuple[int, ...]], tuple[int, int]], info: TensorInfo, chunk_bytes: int
) -> tuple[int, int]:
    """Bytes per row of `info` and rows per chunk, kept in `geometry` by dtype and shape."""
    key = (info.dtype, info.shape)
    got = geometry.get(key)
    if got is None:
        rb = _row_bytes(info)
        got = geometry[key] = (rb, max(1, chunk_bytes // max(rb, 1)))
    return got


if Read._fields != ("info", "start", "nbytes", "rows", "piece", "scale"):  # what `_reads` builds by position
    raise AssertionError("Read's fields changed: update `_reads`")


def _group(out: list[OutTensor]) -> tuple[tuple[str, ...], int, int] | None:
    """Where every copy of the name is one `Stack` of the same distinct sources (a layer's experts
    under TP: every rank takes its rows of each): those sources and the span of rows they are read
    for, all `_survey` needs to know of them (no block scale, no up-sampling, streamable); else None."""
    first = out[0].pieces
    if len(first) != 1 or type(first[0]) is not Stack:
        return None
    names = first[0].sources
    lo, hi = first[0].start[0], first[0].stop[0]
    for t in out[1:]:
        pieces = t.pieces
        if len(pieces) != 1 or type(pieces[0]) is not Stack or pieces[0].sources != names:
            return None
        a, b = pieces[0].start[0], pieces[0].stop[0]
        lo, hi = (lo if lo < a else a), (hi if hi > b else b)
    if not names or len(set(names)) != len(names):
        return None  # sources repeated: not one pass (`_survey` says so)
    return names, lo, hi


def _whole(info: TensorInfo, piece: tuple[int, int] | None = None) -> Read:
    return Read(info, 0, info.nbytes, None, piece)


def _rows(info: TensorInfo, r0: int, r1: int, piece: tuple[int, int] | None = None) -> Read:
    row_bytes = _row_bytes(info)
    return Read(info, r0 * row_bytes, (r1 - r0) * row_bytes, (r0, r1), piece)


Sources = dict[str, tuple[bool, int, int]]


def _survey(tensors: list[OutTensor]) -> tuple[dict[str, None], Sources, bool]:
    """One pass over one name's pieces (issue 28: an MoE layer's name has thousands per rank):

    - the block-scale tensors its FP8 slices dequantise with, in order of first use;
    - its source tensors in order of first use: whether a piece up-samples one, and the span of its
      rows the pieces use;
    - whether one pass over each source, in that order, can emit every tensor's pieces in order: no
      side-by-side parts (each from its own read), no transpose of the source's rows or strided rows
      (each piece from its own read, whole), no source used before one used earlier, no rows read
      again unless the same single row of the previous piece (`Slice.row_of`).
    """
    group = _group(tensors)
    if group is not None:  # an MoE layer's experts, every rank one `Stack` of them (TP): at once
        names, lo, hi = group
        return {}, dict.fromkeys(names, (False, lo, hi)), True
    scales: dict[str, None] = {}
    sources: Sources = {}
    rank: dict[str, int] = {}
    streamable = True
    for t in tensors:
        prev: Slice | None = None
        prev_end = 0  # the previous slice's last row + 1
        for x in t.pieces:
            if type(x) is Stack:
                first = x.sources[0]
                if (
                    streamable
                    and prev is not None
                    and (first == prev.source or rank.get(first, len(rank)) < rank[prev.source])
                ):
                    streamable = False
                streamable = _stack(sources, rank, x) and streamable
                prev, prev_end = Slice(x.sources[-1], x.start, x.stop), x.stop[0]
                continue
            if not isinstance(x, Slice):
                if isinstance(x, Cols):
                    streamable = False
                    for q in x.parts:
                        _use(sources, rank, q)
                continue
            if x.scale:
                scales[x.scale] = None
            start, stop, s = x.start, x.stop, x.source  # `_use`, inline: once per piece of every rank
            a, b = (start[0], stop[0]) if start else (0, 1)
            got = sources.get(s)
            if got is None:
                rank[s] = len(rank)
                sources[s] = (bool(x.up), a, b)
            else:
                up, lo, hi = got
                sources[s] = (up or bool(x.up), lo if lo < a else a, hi if hi > b else b)
            if streamable:
                if (x.perm and x.perm[0] != 0) or x.step > 1:
                    streamable = False
                elif prev is not None:
                    back = x.source == prev.source and (x.up or a < prev_end) and not x.row_of(prev)
                    streamable = not back and rank[x.source] >= rank[prev.source]
            prev, prev_end = x, b
    return scales, sources, streamable


def _stack(sources: Sources, rank: dict[str, int], x: Stack) -> bool:
    """Count a `Stack`'s sources into `sources` and `rank` as its slices would be, a layer's experts
    at once where they are all new (the first rank, or each under --ep) or all share one span (the
    other ranks under TP); whether its sources are distinct and in increasing order of first use."""
    names, a, b = x.sources, x.start[0], x.stop[0]
    seen = rank.keys() & names
    if not seen:
        n = len(rank)
        rank.update(zip(names, range(n, n + len(names)), strict=True))
        sources.update(dict.fromkeys(names, (False, a, b)))
        return len(rank) == n + len(names)
    spans = set(map(sources.__getitem__, names)) if len(seen) == len(names) else ()
    if len(spans) == 1:
        up, lo, hi = next(iter(spans))
        sources.update(dict.fromkeys(names, (up, lo if lo < a else a, hi if hi > b else b)))
    else:
        for p in x.slices():
            _use(sources, rank, p)
    ranks = list(map(rank.__getitem__, names))
    return len(set(names)) == len(names) and all(map(int.__lt__, ranks, ranks[1:]))


def _use(sources: Sources, rank: dict[str, int], p: Slice) -> tuple[int, int]:
    """Count slice `p`'s rows into its source's span; its first row and last row + 1."""
    start, stop = p.start, p.stop
    a, b = (start[0], stop[0]) if start else (0, 1)
    s = p.source
    got = sources.get(s)
    if got is None:
        rank[s] = len(rank)
        sources[s] = (bool(p.up), a, b)
    else:
        up, lo, hi = got
        sources[s] = (up or bool(p.up), lo if lo < a else a, hi if hi > b else b)
    return a, b


def shape_of(t: TensorInfo) -> tuple[int, ...]:
    return t.shape if t.shape else (1,)


def _row_bytes(t: TensorInfo) -> int:
    return t.nbytes // max(1, shape_of(t)[0])  # a tensor of no rows has no bytes


def bounds(p: Slice) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (p.start, p.stop) if p.start else ((0,), (1,))


def file_header(f: OutFile, metadata: dict[str, str]) -> bytes:
    return page_aligned_header([(t.name, t.dtype, t.shape) for t in f.tensors], metadata)


def page_aligned_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """A safetensors header (name, dtype, shape per tensor, back to back) padded so that the page
    offset most of the file's bytes share is 0 in the file: their tensors start where pages start,
    as their bytes do in the read buffers, so they can go through (`FileWriter.write`)."""
    share: dict[int, int] = {}
    pos = 0
    for _, dtype, shape in entries:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if pos % 8 == 0:
            share[pos % ALIGN] = share.get(pos % ALIGN, 0) + nbytes
        pos += nbytes
    anchor = max(share, key=lambda k: (share[k], -k), default=0)
    return encode_header(entries, metadata, align=ALIGN, anchor=anchor)
