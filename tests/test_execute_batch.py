"""Uniform steps (reshard/batch.py: an MoE layer's experts gathered a chunk at a time and cut per rank
with one numpy take) write exactly the bytes of the piece-by-piece path, and are taken where the plan
is uniform: TP row/column splits, EP whole experts, a dtype cast, batches split across chunks."""

from __future__ import annotations

import pytest

import reshard.batch as batch
import reshard.execute as ex
import reshard.io.writer as wr
import reshard.spans as spans
from reshard.io.reader import FileReader
from reshard.plan import DEFAULT_MAX_PART
from reshard.sources import open_source
from tests.fixtures.saving import save

CASES = [
    ("qwen3-moe", 2, False, "auto"),
    ("qwen3-moe", 4, True, "auto"),
    ("qwen3-moe", 2, False, "float32"),  # cast per batch
    ("qwen3-moe-fp8", 2, False, "auto"),  # FP8 experts: their block scales up-sampled a batch at a time
    ("qwen3-moe-fp8", 4, True, "auto"),
    ("mixtral", 2, True, "auto"),
    ("deepseek-v3", 2, False, "auto"),
]


def _data(path) -> bytes:
    raw = path.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little") :]  # headers differ in their run id


@pytest.mark.parametrize(
    "arch, tp, ep, dtype", CASES, ids=[f"{a}-tp{t}{'-ep' if e else ''}-{d}" for a, t, e, d in CASES]
)
@pytest.mark.parametrize("reads", [3, 4096], ids=["three-reads-a-batch", "one-batch"])
@pytest.mark.parametrize("numpy_copy", [False, True], ids=["memoryview-copies", "numpy-copies"])
@pytest.mark.parametrize("how", ["cached", "not-cached", "read-ahead"])
def test_uniform_steps_write_the_bytes_of_the_piece_path(
    tiny, tmp_path, monkeypatch, arch, tp, ep, dtype, reads, numpy_copy, how
):
    src = str(tiny(arch))
    if numpy_copy:  # reads copied into the batch by numpy (larger reads: NUMPY_COPY), not as memoryviews
        monkeypatch.setattr(wr, "NUMPY_COPY", 1)
    # the source in the page cache: its uniform steps read by the main thread (FileReader.read_batch),
    # or as whole stretches (reshard.spans, read ahead); not in it: stretches of small reads read whole,
    # the rest read by the reader threads one by one; read-ahead: every read on its own
    inline = how == "cached"
    monkeypatch.setattr(FileReader, "inline", lambda self, file: inline)
    if how == "read-ahead":
        monkeypatch.setattr(FileReader, "reads_spans", False)
    batch_reads = []
    read_batch = FileReader.read_batch
    monkeypatch.setattr(FileReader, "read_batch", lambda self, *a: batch_reads.append(1) or read_batch(self, *a))
    span_reads = []  # steps served from stretches read whole (reshard.spans)
    copy_reads = spans.copy_reads
    monkeypatch.setattr(spans, "copy_reads", lambda *a: span_reads.append(1) or copy_reads(*a))
    experts = [t.nbytes for t in open_source(src).checkpoint.tensors.values() if ".experts." in t.name]
    chunk = reads * max(experts)  # a batch holds `reads` of the largest expert tensors
    monkeypatch.setattr(batch, "MIN_READS", 2)  # the tiny models have 8 experts
    used, grown = [], []

    def counting(step, tensors, limit):
        u = batch.uniform(step, tensors, limit)
        used.append(u is not None)
        grown.append(u is not None and u.up is not None)
        return u

    monkeypatch.setattr(ex, "uniform", counting)
    fast = save(src, tmp_path / "a", tp=tp, ep=ep, dtype=dtype, max_part_size=DEFAULT_MAX_PART, chunk_bytes=chunk)
    assert sum(used) >= 2, "no uniform step taken: the test would compare the piece path with itself"
    if how == "cached":
        assert len(batch_reads) + len(span_reads) >= 2
    else:
        assert not batch_reads and (how == "not-cached" or not span_reads)
    if how != "read-ahead" and reads > 3 and arch in ("qwen3-moe", "mixtral"):  # a layer's experts: read whole, once
        assert span_reads
    if arch.endswith("-fp8") and not ep:  # TP: the experts' block scales in the backend's finer blocks
        assert sum(grown) >= 2, "no up-sampled uniform step taken"
    monkeypatch.setattr(ex, "uniform", lambda step, tensors, limit: None)
    slow = save(src, tmp_path / "b", tp=tp, ep=ep, dtype=dtype, max_part_size=DEFAULT_MAX_PART, chunk_bytes=chunk)
    assert [f.name for f in fast.plan.files] == [f.name for f in slow.plan.files]
    for f in fast.plan.files:
        assert _data(tmp_path / "a" / f.name) == _data(tmp_path / "b" / f.name), f.name


def test_a_step_with_a_padded_or_filled_piece_is_not_uniform(tiny, tmp_path):
    """A backend that pads the experts' per-rank size (zeros past the real rows) goes piece by piece."""
    from reshard.layout import Layout
    from reshard.plan import Fill, build_plan
    from reshard.schedule import schedule

    ckpt = open_source(str(tiny("qwen3-moe"))).checkpoint
    plan = build_plan(ckpt, Layout(tp=2))
    steps = schedule(plan, ckpt.tensors, 1 << 20)
    w13 = next(s for s in steps if s.name.endswith("experts.w13_weight"))
    tensors = [t for _, t in w13.slots]
    batch_min = batch.MIN_READS
    try:
        batch.MIN_READS = len(w13.reads) + 1
        assert batch.uniform(w13, tensors, 1 << 20) is None  # too few reads to be worth it
        batch.MIN_READS = 2
        assert batch.uniform(w13, tensors, 1 << 20) is not None
        padded = [t.__class__(t.name, t.dtype, t.shape, (*t.pieces, Fill(0.0, 4))) for t in tensors]
        assert batch.uniform(w13, padded, 1 << 20) is None
        assert batch.uniform(w13, tensors, 16) is None  # a read over the limit
    finally:
        batch.MIN_READS = batch_min


def test_wide_views_hold_the_bytes_take_picks():
    """`batch.wide` (consecutive reads: a slice, in words as wide as the runs allow) holds, in C
    order, numpy's take of the same reads, byte for byte; it is a view of the batch buffer, never a
    copy (what the writers copy from)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for shape in [(5, 8, 6, 2), (5, 8, 4), (5, 16, 1), (5, 6, 2), (7, 4, 3, 5, 2)]:
        reads = rng.integers(0, 255, shape, dtype=np.uint8)
        for _ in range(40):
            sel = []
            for d in shape[1:-1]:
                a = int(rng.integers(0, d))
                sel.append(slice(a, int(rng.integers(a + 1, d + 1))))
            sel = tuple(sel)
            got = batch.wide(reads, sel)
            want = np.take(reads[(slice(None), *sel)], np.arange(shape[0]), axis=0)
            assert got.tobytes() == want.tobytes() and got.nbytes == want.nbytes
            assert np.shares_memory(got, reads)


def test_a_step_with_any_read_unlike_the_first_is_not_uniform(tiny):
    """`uniform` checks its reads in bulk: one read with other rows, bytes, dtype or shape, a piece of
    its own, a block scale, or a source read twice makes the step go piece by piece; so does a rank
    whose experts come out of the reads' order (the ranks' Stacks share their sources' indices)."""
    from dataclasses import replace

    from reshard.layout import Layout
    from reshard.plan import build_plan
    from reshard.schedule import schedule

    ckpt = open_source(str(tiny("qwen3-moe"))).checkpoint
    steps = schedule(build_plan(ckpt, Layout(tp=2)), ckpt.tensors, 1 << 20)
    w13 = next(s for s in steps if s.name.endswith("experts.w13_weight"))
    tensors = [t for _, t in w13.slots]
    batch_min = batch.MIN_READS
    try:
        batch.MIN_READS = 2
        assert batch.uniform(w13, tensors, 1 << 20) is not None
        r = w13.reads[-1]
        (r0, r1), info = r.rows, r.info
        for odd in (
            r._replace(rows=(r0, r1 - 1)),
            r._replace(nbytes=r.nbytes - 2),
            r._replace(info=info._replace(dtype="F16")),
            r._replace(info=info._replace(shape=(info.shape[0] // 2, info.shape[1] * 2))),
            r._replace(piece=(0, 0)),
            r._replace(scale=True),
            r._replace(info=w13.reads[0].info),  # the first source read twice
        ):
            assert batch.uniform(replace(w13, reads=(*w13.reads[:-1], odd)), tensors, 1 << 20) is None, odd
        stack = tensors[1].pieces[0]
        swapped = replace(stack, sources=(stack.sources[1], stack.sources[0], *stack.sources[2:]))
        other = [tensors[0], replace(tensors[1], pieces=(swapped,))]
        assert batch.uniform(w13, other, 1 << 20) is None
    finally:
        batch.MIN_READS = batch_min


def test_small_batches_share_a_buffer_while_they_fit():
    """A layer's experts at EP are a few MB a step, which the writers hold (as views) until their
    stage goes to disk several steps later: consecutive batches go one after the other into the same
    buffer (page-aligned), so that the main thread does not wait for the writers every other step."""
    from reshard.io.dtypes import Caster
    from reshard.io.memory import ALIGN, Memory

    mem = Memory(64 << 20, 1 << 20)
    b = batch.Batches(mem, 1 << 20, Caster("cpu"), lambda n: None)
    b.size = mem.reserve(2 << 20) // 2
    held = []  # the writers' views: none given back during the test
    first, off = b._region(5000)
    assert off == 0
    held.append(first)
    for want in (ALIGN * 2, ALIGN * 4):
        buf, off = b._region(5000)
        assert (buf, off) == (first, want)
        held.append(buf)
    other, off = b._region((1 << 20) - ALIGN)  # does not fit after them: the other buffer
    assert other is not first and off == 0
    held.append(other)
    for buf in held:
        buf.release()
    assert first.refs == 0 and other.refs == 1  # the buffer being filled: held until `close`
    b.close()
    assert other.refs == 0 and len(mem.reused) == 2
