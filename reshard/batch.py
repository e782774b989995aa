"""Uniform steps: many small sources of one shape, every rank taking the same slice of each.

An MoE layer's experts are hundreds of small tensors of one shape (an expert's gate, up or down
projection), and each rank takes the same rows or columns of every one of them (TP), or whole
tensors of some of them (EP). Emitted piece by piece, such a step costs the executor a few
microseconds per piece and rank in Python (197,763 tensors x 8 ranks: tens of seconds); here the
step's reads are gathered into one batch buffer, a chunk at a time, and every rank's pieces from
that batch are cut out with one numpy `take`: a handful of operations per rank and chunk.

What makes a step uniform (`uniform`): each read is one whole source (or the same rows of each),
all of one dtype and shape, at most `limit` bytes each; every piece of every rank is a plain slice
(no fill, up-sampling, padding, transpose, stride or dequantisation) with the same bounds as that
rank's other pieces, and a rank's pieces use the reads in increasing order. The bytes written are
exactly those of the piece-by-piece path (tests/test_execute_batch.py compares both).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from reshard.format import ITEMSIZE
from reshard.plan import OutTensor, Slice
from reshard.schedule import Step, bounds, shape_of

MIN_READS = 16  # fewer reads than this: the piece-by-piece path is as fast


@dataclass(frozen=True)
class Uniform:
    """How a uniform step's reads map onto its ranks' pieces."""

    shape: tuple[int, ...]  # one read as uint8 array: (rows, *rest, itemsize)
    nbytes: int  # bytes per read
    dtype: str  # the sources' dtype
    index: tuple[np.ndarray, ...]  # per holder: the read each of its pieces comes from, increasing
    sel: tuple[tuple[slice, ...], ...]  # per holder: the slice of a read its pieces take


def uniform(step: Step, tensors: list[OutTensor], limit: int) -> Uniform | None:
    """The step as a `Uniform`, or None where it is not one (see the module docstring)."""
    reads = step.reads
    if len(reads) < MIN_READS:
        return None
    first = reads[0]
    info0 = first.info
    if first.piece is not None or first.scale or first.nbytes > limit:
        return None
    pos: dict[str, int] = {}
    for i, r in enumerate(reads):
        info = r.info
        if (
            r.piece is not None
            or r.scale
            or r.rows != first.rows
            or r.nbytes != first.nbytes
            or info.dtype != info0.dtype
            or info.shape != info0.shape
        ):
            return None
        pos[info.name] = i
    if len(pos) != len(reads):
        return None  # a source read twice (row chunks): not one read per source
    lo = first.rows[0] if first.rows is not None else 0
    full = shape_of(info0)
    rows = first.rows[1] - first.rows[0] if first.rows is not None else full[0]
    index, sel = [], []
    for t in tensors:
        got = _holder(t, pos, lo, rows)
        if got is None:
            return None
        index.append(got[0])
        sel.append(got[1])
    return Uniform((rows, *full[1:], ITEMSIZE[info0.dtype]), first.nbytes, info0.dtype, tuple(index), tuple(sel))


_GEOMETRY = attrgetter("start", "stop", "up", "pad", "perm", "step", "scale")
_PLAIN = (None, None, None, 1, None)  # up, pad, perm, step, scale of a plain slice


def _holder(t: OutTensor, pos: dict[str, int], lo: int, rows: int) -> tuple[np.ndarray, tuple[slice, ...]] | None:
    """One holder's read indices and slice, or None (checked with C-level loops: an MoE layer's
    holder has thousands of pieces)."""
    pieces = t.pieces
    if not pieces or any(type(p) is not Slice for p in pieces):
        return None
    geometry = set(map(_GEOMETRY, pieces))
    if len(geometry) != 1:
        return None
    if next(iter(geometry))[2:] != _PLAIN:
        return None
    try:
        index = np.fromiter(map(pos.__getitem__, map(_SOURCE, pieces)), np.int64, len(pieces))
    except KeyError:
        return None
    if len(index) > 1 and not bool(np.all(index[1:] > index[:-1])):
        return None
    a, b = bounds(pieces[0])
    if a[0] < lo or b[0] > lo + rows:
        return None
    sel = (slice(a[0] - lo, b[0] - lo), *(slice(x, y) for x, y in zip(a[1:], b[1:], strict=True)))
    return index, sel


_SOURCE = attrgetter("source")


def batch_reads(u: Uniform, chunk_bytes: int) -> int:
    """How many reads one batch buffer holds."""
    return max(1, chunk_bytes // max(u.nbytes, 1))


def cut(u: Uniform, batch: np.ndarray, base: int, count: int, holder: int) -> tuple[np.ndarray, int, int] | None:
    """Holder `holder`'s pieces from reads [base, base + count) (`batch`: those reads, shaped
    (count, *u.shape)): a new contiguous array and the [first, last) of its pieces, or None when
    none of its pieces come from these reads."""
    index = u.index[holder]
    s, e = np.searchsorted(index, [base, base + count])
    if s == e:
        return None
    picked = np.take(batch[(slice(None), *u.sel[holder])], index[s:e] - base, axis=0)
    return picked, int(s), int(e)
