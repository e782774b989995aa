"""reshard.spans: consecutive uniform steps of cached files that read, between them, every byte of
one stretch of a file exactly once read it in one go; anything else is read step by step."""

from __future__ import annotations

import os

import pytest

from reshard.format import TensorInfo
from reshard.schedule import Read, Step
from reshard.spans import MAX_STEPS, copy_reads, spans

N = 4096  # bytes per tensor


def _read(k: int, file: str = "a.safetensors", start: int = 0, nbytes: int = N) -> Read:
    """Tensor k of `file` (they lie back to back from offset 100), bytes [start, start + nbytes)."""
    return Read(TensorInfo(f"t{k}", "U8", (N,), file, 100 + k * N, N), start, nbytes, None)


def _step(*reads: Read) -> Step:
    return Step("s", (), tuple(reads), ())


def _layer(base: int) -> list[Step]:
    """An MoE layer's experts as stored (down, gate, up of each expert) and as read: the stacked gate
    and up projections first, then the down projections."""
    w13 = _step(*(_read(base + 3 * e + p) for e in range(8) for p in (1, 2)))
    w2 = _step(*(_read(base + 3 * e) for e in range(8)))
    return [w13, w2]


def test_a_layer_whose_steps_read_every_byte_of_its_stretch_once_is_one_span():
    steps = [*_layer(0), *_layer(24)]
    got = spans(steps, [True] * 4, 1 << 20)
    assert {k: (s.lo, s.hi, s.steps) for k, s in got.items()} == {0: (100, 100 + 48 * N, 4)}
    got = spans(steps, [True] * 4, 24 * N)  # room for one layer at a time
    assert {k: (s.lo, s.hi, s.steps) for k, s in got.items()} == {
        0: (100, 100 + 24 * N, 2),
        2: (100 + 24 * N, 100 + 48 * N, 2),
    }


def test_a_stretch_with_a_byte_no_step_reads_or_one_read_twice_is_no_span():
    w13, w2 = _layer(0)
    gap = _step(*w2.reads[:-1])  # the last expert's down projection is read by no step here
    assert spans([w13, gap], [True, True], 1 << 20) == {}
    twice = _step(*w2.reads[:-1], w13.reads[0])  # as many bytes as the stretch, one tensor read twice
    assert spans([w13, twice], [True, True], 1 << 20) == {}
    half = _step(*w2.reads, _read(0, start=0, nbytes=N // 2))  # part of a tensor again
    assert spans([w13, half], [True, True], 1 << 20) == {}


def test_only_consecutive_inline_steps_of_one_file_within_the_limit():
    w13, w2 = _layer(0)
    assert spans([w13, w2], [True, False], 1 << 20) == {}  # the second read ahead by the reader threads
    assert spans([w13, w2], [True, True], 24 * N - 1) == {}  # does not fit
    other = _step(*(r._replace(info=r.info._replace(file="b.safetensors")) for r in w2.reads))
    assert spans([w13, other], [True, True], 1 << 20) == {}
    one = _step(*reversed([_read(k) for k in range(20)]))  # one step reading a stretch, backwards
    assert {k: s.steps for k, s in spans([w13, one], [True, True], 1 << 20).items()} == {1: 1}


def test_a_span_serves_at_most_max_steps():
    steps = [_step(_read(k)) for k in range(MAX_STEPS + 3)]
    got = spans(steps, [True] * len(steps), 1 << 20)
    assert [(k, s.steps) for k, s in got.items()] == [(0, MAX_STEPS), (MAX_STEPS, 3)]


@pytest.mark.parametrize("order", ["stored", "by-number"])
def test_copy_reads_puts_each_read_in_its_place(order):
    data = os.urandom(100 + 24 * N)
    w13, w2 = _layer(0)
    for step in (w13, w2):
        reads = step.reads if order == "stored" else tuple(sorted(step.reads, key=lambda r: -r.info.offset))
        out = memoryview(bytearray(len(reads) * N))
        copy_reads(memoryview(data)[100:], 100, reads, out, N)
        assert bytes(out) == b"".join(data[r.info.offset : r.info.offset + N] for r in reads)
