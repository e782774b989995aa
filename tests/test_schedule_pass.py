"""The scheduler's one pass over a name's pieces (issue 28) schedules exactly what the passes it replaced
scheduled: every step's slots, reads (sources, bytes, rows, pieces, block scales) and closed files, for
plans of several architectures and layouts and for hand-made pieces of every kind. `old_*` are verbatim
copies of the scheduler before it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from reshard.format import ITEMSIZE, TensorInfo
from reshard.layout import Layout
from reshard.plan import Cols, Fill, OutFile, OutTensor, Plan, Slice, Stack, build_plan, flat, natural_key
from reshard.schedule import Group, Read, Step, _row_bytes, bounds, schedule
from reshard.sources import open_source
from tests.fixtures.releases import RELEASES, cut, write_header_only
from tests.fixtures.synthetic import QWEN3_235B_A22B_FP8, synthetic_checkpoint


def old_schedule(plan: Plan, tensors: dict[str, TensorInfo], chunk_bytes: int) -> list[Step]:
    """The plan's tensors in the global write order (widest dtype first, then natural name order),
    each with its reads: source rows in chunks of about `chunk_bytes`."""
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
            tuple(old_reads([t for _, t in slots[name]], tensors, chunk_bytes)),
            tuple(f.name for f, _ in slots[name] if last[f.name] == name),
        )
        for name in order
    ]


def old_reads(out: list[OutTensor], tensors: dict[str, TensorInfo], chunk_bytes: int) -> Iterator[Read]:
    """The reads that make one tensor name's copies (`out`): one pass over each source in row
    chunks, or, where the pieces' order does not allow that, one read per piece. The block scales of
    FP8 sources it dequantises come first, whole."""
    scales = dict.fromkeys(p.scale for t in out for p in t.pieces if isinstance(p, Slice) and p.scale)
    for name in scales:
        yield Read(tensors[name], 0, tensors[name].nbytes, None, scale=True)
    sources = old_sources(out)
    if not old_streamable(out, list(sources)):
        for h, t in enumerate(out):
            for i, p in enumerate(t.pieces):
                for q in p.parts if isinstance(p, Cols) else (p,) if isinstance(p, Slice) else ():
                    info = tensors[q.source]
                    (a, *_), (b, *_) = bounds(q)
                    yield _whole(info, (h, i)) if q.up else _rows(info, a, b, (h, i))
        return
    for s, (up, lo, hi) in sources.items():
        info = tensors[s]
        if up:
            yield _whole(info)
            continue
        rows_per_chunk = max(1, chunk_bytes // max(_row_bytes(info), 1))
        for c0 in range(lo, hi, rows_per_chunk):
            yield _rows(info, c0, min(c0 + rows_per_chunk, hi))


def _whole(info: TensorInfo, piece: tuple[int, int] | None = None) -> Read:
    return Read(info, 0, info.nbytes, None, piece)


def _rows(info: TensorInfo, r0: int, r1: int, piece: tuple[int, int] | None = None) -> Read:
    row_bytes = _row_bytes(info)
    return Read(info, r0 * row_bytes, (r1 - r0) * row_bytes, (r0, r1), piece)


def old_sources(tensors: list[OutTensor]) -> dict[str, tuple[bool, int, int]]:
    """Source tensors of these pieces in order of first use: whether a piece up-samples it, and
    the span of its rows the pieces use."""
    out: dict[str, tuple[bool, int, int]] = {}
    for t in tensors:
        for p in (q for x in t.pieces for q in (x.parts if isinstance(x, Cols) else (x,))):
            if isinstance(p, Slice):
                (a, *_), (b, *_) = bounds(p)
                up, lo, hi = out.get(p.source, (False, a, b))
                out[p.source] = (up or bool(p.up), min(lo, a), max(hi, b))
    return out


def old_streamable(tensors: list[OutTensor], sources: list[str]) -> bool:
    """Can one pass over each source, in order, emit every tensor's pieces in order?"""
    rank = {s: i for i, s in enumerate(sources)}
    for t in tensors:
        if any(isinstance(p, Cols) for p in t.pieces):
            return False  # side-by-side parts: each from its own read
        prev: Slice | None = None
        for p in (p for p in t.pieces if isinstance(p, Slice)):
            if p.perm and p.perm[0] != 0:
                return False  # a transpose of the source's rows: each piece from its own read, whole
            if p.step > 1 or (prev is not None and rank[p.source] < rank[prev.source]):
                return False  # strided rows (each piece from its own read), or sources out of order
            back = prev is not None and p.source == prev.source and (p.up or bounds(p)[0][0] < bounds(prev)[1][0])
            if back and not p.row_of(prev):
                return False
            prev = p
    return True


def steps_of(steps: list[Step]) -> list[tuple]:
    return [(s.name, [(f.name, t.name) for f, t in s.slots], s.reads, s.closes) for s in steps]


def flat_plan(plan: Plan) -> Plan:
    """The plan with every expert `Stack` as its slices, as the old schedule took it."""
    files = [replace(f, tensors=tuple(replace(t, pieces=flat(t.pieces)) for t in f.tensors)) for f in plan.files]
    return replace(plan, files=files)


def same(plan: Plan, tensors: dict[str, TensorInfo], chunk: int) -> int:
    """The schedule equals the old one's of the same plan, its stacks as slices (a `Group` as the
    reads it stands for, its columns as theirs); how many reads."""
    steps = schedule(plan, tensors, chunk)
    new = steps_of(steps)
    old = steps_of(old_schedule(flat_plan(plan), tensors, chunk))
    assert [(n, s, tuple(r), c) for n, s, r, c in new] == old
    for step in steps:
        reads = step.reads
        if type(reads) is Group:  # since session 25: a layer's experts, one record
            listed = list(reads)
            assert reads.offsets() == [r.info.offset + r.start for r in listed]
            assert reads.files() == [r.info.file for r in listed]
            assert reads.sizes() == [r.nbytes for r in listed]
            assert reads.names == tuple(r.info.name for r in listed)
            assert [reads[k] for k in range(len(reads))] == listed
            assert list(reads[1:-1:2]) == listed[1:-1:2] and type(reads[1:]) is Group
    return sum(len(s[2]) for s in new)


def experts_grouped(plan: Plan, tensors: dict[str, TensorInfo]) -> bool:
    """Whether every layer's experts' weights (w13, w2) are read as one `Group` each."""
    steps = [
        s for s in schedule(plan, tensors, 32 << 20) if s.name.endswith(("experts.w13_weight", "experts.w2_weight"))
    ]
    return bool(steps) and all(type(s.reads) is Group for s in steps)


LAYOUTS = [Layout(tp=2), Layout(tp=4, ep=True), Layout(tp=2, pp=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("arch", ["qwen3-moe-fp8", "deepseek-v3-fp8", "gpt-oss", "llama4", "phi3", "qwen3-next-fp8"])
def test_tiny_plans_schedule_as_before(tiny, arch, layout):
    ckpt = open_source(str(tiny(arch))).checkpoint
    try:
        plan = build_plan(ckpt, layout)
    except Exception:
        pytest.skip("a layout this tiny model cannot take")
    for chunk in (1000, 1 << 20):
        assert same(plan, ckpt.tensors, chunk) > 0


@pytest.mark.parametrize("layout", [Layout(tp=8), Layout(tp=8, ep=True)], ids=str)
def test_release_and_synthetic_plans_schedule_as_before(tmp_path, layout):
    for ckpt in (
        open_source(str(write_header_only(tmp_path / "k", cut(RELEASES["kimi-k2"], 2)))).checkpoint,
        synthetic_checkpoint({**QWEN3_235B_A22B_FP8, "num_hidden_layers": 2}, files=3),
    ):
        plan = build_plan(ckpt, layout)
        assert same(plan, ckpt.tensors, 32 << 20) > 0
        assert experts_grouped(plan, ckpt.tensors)


def info(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> TensorInfo:
    n = 1
    for d in shape:
        n *= d
    return TensorInfo(name, dtype, shape, "f", 0, n * ITEMSIZE[dtype])


TRICKY = {
    "rows in order": [[Slice("a", (0, 0), (2, 4)), Slice("a", (2, 0), (4, 4))]],
    "rows back": [[Slice("a", (2, 0), (4, 4)), Slice("a", (0, 0), (2, 4))]],
    "same single row twice": [[Slice("a", (1, 0), (2, 2)), Slice("a", (1, 2), (2, 4))]],
    "sources out of order": [[Slice("a", (0, 0), (1, 4)), Slice("b", (0, 0), (1, 4)), Slice("a", (1, 0), (2, 4))]],
    "two ranks, order flips": [
        [Slice("a", (0, 0), (1, 4)), Slice("b", (0, 0), (1, 4))],
        [Slice("b", (1, 0), (2, 4)), Slice("a", (1, 0), (2, 4))],
    ],
    "fills between": [[Fill(0.0, 4), Slice("a", (0, 0), (1, 4)), Fill(1.0, 4), Slice("b", (0, 0), (1, 4))]],
    "up-sampled": [[Slice("s", (0, 0), (1, 2), up=(2, 2)), Slice("s", (1, 0), (2, 2), up=(2, 2))]],
    "transposed": [[Slice("a", (0, 0), (4, 4), perm=(1, 0))]],
    "transposed keeping rows": [[Slice("a", (0, 0), (4, 4), perm=(0, 1))]],
    "strided": [[Slice("a", (0, 0), (4, 4), step=2)]],
    "side by side": [[Cols((Slice("a", (0, 0), (2, 2)), Slice("b", (0, 0), (2, 2))))]],
    "scalar": [[Slice("z", (), ())]],
    "dequantised": [[Slice("q", (0, 0), (2, 4), scale="qs"), Slice("q", (2, 0), (4, 4), scale="qs")]],
    "padded": [[Slice("a", (0, 0), (4, 2), pad=(4, 4))]],
    # experts as `Stack`s (every rank the same sources: made in bulk, `schedule._group`), and what is not that
    "stacks, rows per rank": [[Stack(("a", "b"), (2, 0), (4, 4))], [Stack(("a", "b"), (0, 0), (1, 4))]],
    "stacks, one row each": [[Stack(("b", "a"), (1, 0), (2, 4))], [Stack(("b", "a"), (1, 0), (2, 4))]],
    "stacks of two shapes": [[Stack(("a", "c"), (0, 0), (2, 4))], [Stack(("a", "c"), (2, 0), (4, 4))]],
    "stacks repeating a source": [[Stack(("a", "b", "a"), (0, 0), (2, 4))], [Stack(("a", "b", "a"), (2, 0), (4, 4))]],
    "stacks of other sources": [[Stack(("a", "b"), (0, 0), (4, 4))], [Stack(("c", "d"), (0, 0), (4, 4))]],
    "a stack and a slice": [
        [Stack(("a", "b"), (0, 0), (2, 4))],
        [Stack(("a",), (2, 0), (4, 4)), Slice("b", (2, 0), (4, 4))],
    ],
    "two stacks on a rank": [
        [Stack(("a",), (0, 0), (2, 4)), Stack(("b",), (0, 0), (2, 4))],
        [Stack(("a", "b"), (2, 0), (4, 4))],
    ],
}
INFOS = {
    "a": info("a", (4, 4)), "b": info("b", (4, 4)), "s": info("s", (2, 2), "F32"), "z": info("z", (), "F32"),
    "q": info("q", (4, 4), "F8_E4M3"), "qs": info("qs", (1, 1), "F32"), "c": info("c", (8, 4)), "d": info("d", (4, 4)),
}  # fmt: skip


@pytest.mark.parametrize("case", TRICKY)
def test_hand_made_pieces_schedule_as_before(case):
    files = [
        OutFile(f"r{r}", r, 0, 0, (OutTensor("t", "BF16", (sum(p.numel for p in ps),), tuple(ps)),))
        for r, ps in enumerate(TRICKY[case])
    ]
    plan = Plan({}, "X", Layout(tp=len(files)), files, [(0, 1)])
    for chunk in (8, 1 << 20):
        assert same(plan, INFOS, chunk) > 0
