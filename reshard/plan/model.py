"""The plan as data: every rank's files, their tensors, and the source bytes each tensor is made of.

An output tensor is the concatenation, in row-major order, of its pieces: hyper-rectangular slices
of source tensors (optionally up-sampled, for refined FP8 block scales) and constant fills (vocab
padding rows, attention buffers). Nothing here reads a byte or imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from reshard import __version__, names, serve
from reshard.errors import SourceError
from reshard.format import ITEMSIZE, TensorInfo
from reshard.layout import Layout
from reshard.manifest.layoutjson import layout_json
from reshard.plan.remote import RemoteCode


@dataclass(frozen=True, slots=True)
class Slice:
    """source[start[0]:stop[0], start[1]:stop[1], ...], after up-sampling each dim by `up`.

    `pad`: the piece's extent per dim when larger than the slice (trailing dims only: a padded
    dim 0 is a Fill after it): the slice sits at the origin, `fill` everywhere else (the columns
    past a rank's real intermediate size in vLLM's padded MoE down projections).
    `perm`: the slice's dims are written in this order (a transpose; dim 0 stays first), as
    gpt-oss's bf16 experts [E, in, out] become vLLM's [E, out, in]. `pad` is then in output order.
    """

    source: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    up: tuple[int, ...] | None = None
    pad: tuple[int, ...] | None = None
    fill: float = 0.0
    perm: tuple[int, ...] | None = None
    step: int = 1  # every step-th row of [start[0], stop[0]) (Llama-4's q/k rows, even then odd per head)
    # an FP8 source dequantised with this 2-D block-scale tensor to bf16 (vLLM's scaled_dequantize: fp8 and
    # scale to float32, multiplied, rounded to bfloat16), then cast to the tensor's dtype (issue 27)
    scale: str | None = None

    def row_of(self, other: Slice) -> bool:
        """Both are the same single source row (Llama-4's gate and up halves of an expert): the executor's
        chunks hold whole rows, so one pass over the source serves both."""
        same = self.start[:1] == other.start[:1] and self.stop[:1] == other.stop[:1]
        one = bool(self.start) and self.stop[0] - self.start[0] == 1 and self.step == other.step == 1
        return same and not (self.up or other.up) and one

    @property
    def numel(self) -> int:
        if self.pad is not None:
            return math.prod(self.pad)
        n = [b - a for a, b in zip(self.start, self.stop, strict=True)]
        if n:
            n[0] = -(-n[0] // self.step)
        return math.prod(n)


@dataclass(frozen=True, slots=True)
class Fill:
    """`count` elements equal to `value`."""

    value: float
    count: int

    @property
    def numel(self) -> int:
        return self.count


@dataclass(frozen=True, slots=True)
class Cols:
    """Slices of equal extents in every dim but the last, side by side along it: each row of the
    block is the first part's row, then the second's... (a K-first packed weight of a merged layer,
    GPTQ's qweight [K/8, N]: q's, k's and v's output columns next to each other). Plain slices
    only (no up-sampling, padding, transpose or stride)."""

    parts: tuple[Slice, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)


@dataclass(frozen=True, slots=True)
class Stack:
    """The plain slice [start, stop) of each of `sources` (of one shape and dtype) in turn: one rank's
    share of an MoE layer's experts as one plan entry (issue 28: a 200k-tensor checkpoint at TP 8
    has 1.6M such slices). The same bytes as its `slices()`; the planner makes one only where they
    are plain (no up-sampling, padding, transpose, stride or dequantisation)."""

    sources: tuple[str, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]

    def slices(self) -> list[Slice]:
        return slices(self.sources, self.start, self.stop)

    @property
    def numel(self) -> int:
        return len(self.sources) * math.prod(b - a for a, b in zip(self.start, self.stop, strict=True))


Piece = Slice | Fill | Cols | Stack


def flat(pieces: Sequence[Piece]) -> tuple[Slice | Fill | Cols, ...]:
    """`pieces` with each `Stack` as its slices (for the paths that take a piece at a time)."""
    if not any(type(p) is Stack for p in pieces):
        return tuple(pieces)  # type: ignore[arg-type]
    return tuple(x for p in pieces for x in (p.slices() if isinstance(p, Stack) else (p,)))


def count(pieces: Sequence[Piece]) -> int:
    """How many pieces `flat(pieces)` holds, without making them."""
    return sum(len(p.sources) if type(p) is Stack else 1 for p in pieces)


def side_by_side(parts: list[Slice]) -> Slice | Cols:
    """One Slice, or the Cols of several."""
    return parts[0] if len(parts) == 1 else Cols(tuple(parts))


@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class OutFile:
    name: str
    tp_rank: int
    pp_rank: int
    part: int
    tensors: tuple[OutTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    """What `save` writes. Serialisable; built before any tensor byte is read."""

    source: dict
    architecture: str
    layout: Layout  # resolved: dtype, partition, quantization and the pinned MoE backend filled in
    files: list[OutFile]
    layer_ranges: list[tuple[int, int]]  # per pipeline stage: [first, last) layer
    notes: list[str] = field(default_factory=list)
    config_patch: dict = field(default_factory=dict)  # keys to change in the copied config.json
    serve_flags: tuple[str, ...] = ()  # other flags the layout needs (`--language-model-only`)
    remote_code: RemoteCode = field(default_factory=RemoteCode)  # --trust-remote-code or what is dropped
    layout_only: bool = False  # `build_plan(pieces=False)`: the experts' weights have no pieces; nothing to write

    @property
    def pattern(self) -> str:
        return names.file_pattern(self.layout.pp)

    @property
    def total_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def serve_command(self, out_dir: str, load_format: str = "sharded_state") -> str:
        return serve.serve_command(
            out_dir,
            self.layout,
            extra=self.serve_flags,
            load_format=load_format,
            trust_remote_code=self.remote_code.trust,
        )

    def engine_rank(self, f: OutFile) -> int:
        return self.layout.engine_rank(f.pp_rank, f.tp_rank)

    def layout_json(self) -> dict:
        """The layout as `plan --json` prints it: the manifest's `layout` object."""
        return layout_json(self.layout, self.architecture)

    def ranks(self) -> dict[tuple[int, int], list[OutFile]]:
        out: dict[tuple[int, int], list[OutFile]] = {}
        for f in self.files:
            out.setdefault((f.pp_rank, f.tp_rank), []).append(f)
        return out

    def summary(self) -> dict:
        """Per-rank key count and bytes, plus the layout: what `reshard plan --json` prints."""
        ranks = []
        for (pp_rank, tp_rank), files in sorted(self.ranks().items()):
            tensors = [t for f in files for t in f.tensors]
            ranks.append(
                {
                    "pp_rank": pp_rank,
                    "tp_rank": tp_rank,
                    "files": [f.name for f in files],
                    "keys": len(tensors),
                    "bytes": sum(t.nbytes for t in tensors),
                    "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in tensors],
                }
            )
        return {
            "reshard_version": __version__,
            "source": self.source,
            **self.layout_json(),
            "total_bytes": self.total_bytes,
            "ranks": ranks,
            "notes": self.notes,
        }


# ---- pieces of source tensors -------------------------------------------------------------------


def whole(t: TensorInfo) -> Slice:
    return Slice(t.name, (0,) * len(t.shape), t.shape)


def rows(t: TensorInfo, a: int, b: int) -> Slice:
    return Slice(t.name, (a,) + (0,) * (len(t.shape) - 1), (b, *t.shape[1:]))


def padded_rows(name: str, start: int, size: int, width: int, cols: int, fill: float) -> list[Piece]:
    """Rows [start, start + size) of the 2-D tensor `name` ([*, cols]), then `fill` up to `width` rows."""
    out: list[Piece] = [Slice(name, (start, 0), (start + size, cols))] if size else []
    if width > size:
        out.append(Fill(fill, (width - size) * cols))
    return out


def padded_cols(name: str, rows_: int, start: int, size: int, width: int, fill: float) -> Piece:
    """Columns [start, start + size) of the 2-D tensor `name` ([rows_, *]), `fill` up to `width` columns."""
    if not size:
        return Fill(fill, rows_ * width)
    pad = (rows_, width) if width > size else None
    return Slice(name, (0, start), (rows_, start + size), pad=pad, fill=fill)


# ---- an MoE layer's experts in bulk (issue 28: hundreds of thousands of pieces) --------------------


def padded_rows_each(
    names: Sequence[str], start: int, size: int, width: int, cols: int, fill: float
) -> tuple[Piece, ...]:
    """`padded_rows` of each of `names` in turn (every expert's rows of one rank), the bounds and
    the fill shared by all: one `Stack` where nothing is padded."""
    tail = (Fill(fill, (width - size) * cols),) if width > size else ()
    if not size:
        return tail * len(names)
    if not tail and names:
        return (Stack(tuple(names), (start, 0), (start + size, cols)),)
    pieces = slices(names, (start, 0), (start + size, cols))
    return tuple(pieces) if not tail else tuple(x for p in pieces for x in (p, *tail))


def padded_cols_each(
    names: Sequence[str], rows_: int, start: int, size: int, width: int, fill: float
) -> tuple[Piece, ...]:
    """`padded_cols` of each of `names` in turn, the bounds shared by all: one `Stack` where nothing
    is padded."""
    if not size:
        return (Fill(fill, rows_ * width),) * len(names)
    pad = (rows_, width) if width > size else None
    if pad is None and names:
        return (Stack(tuple(names), (0, start), (rows_, start + size)),)
    return tuple(slices(names, (0, start), (rows_, start + size), pad=pad, fill=fill))


_SLICE_FIELDS = ("source", "start", "stop", "up", "pad", "fill", "perm", "step", "scale")
if tuple(f.name for f in fields(Slice)) != _SLICE_FIELDS:
    raise AssertionError("Slice's fields changed: update `slices`")
_SET = tuple(Slice.__dict__[f].__set__ for f in _SLICE_FIELDS)  # the slots, set as __init__ sets them


def slices(
    names: Sequence[str],
    start: tuple[int, ...],
    stop: tuple[int, ...],
    up: tuple[int, ...] | None = None,
    pad: tuple[int, ...] | None = None,
    fill: float = 0.0,
) -> list[Slice]:
    """`Slice(name, start, stop, up, pad, fill)` of each name, every field but the source shared: the
    same objects the dataclass builds, in half the time (its frozen __init__ goes through
    object.__setattr__ field by field; tests/test_plan_pieces.py holds them equal)."""
    s_source, s_start, s_stop, s_up, s_pad, s_fill, s_perm, s_step, s_scale = _SET
    new = object.__new__
    out = []
    for name in names:
        p = new(Slice)
        s_source(p, name)
        s_start(p, start)
        s_stop(p, stop)
        s_up(p, up)
        s_pad(p, pad)
        s_fill(p, fill)
        s_perm(p, None)
        s_step(p, 1)
        s_scale(p, None)
        out.append(p)
    return out


def scalar(t: TensorInfo) -> Slice:
    if t.numel != 1:
        raise SourceError(f"{t.name} should hold one value, has shape {list(t.shape)}")
    return whole(t)
