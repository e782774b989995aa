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


class _Lease:
    def __init__(self) -> None:
        self.released = 0

    def release(self, n: int = 1) -> None:
        self.released += n


def test_spans_are_read_ahead_whole_and_their_memory_given_back_after_their_last_step(tmp_path, monkeypatch):
    """The reader threads read each span as one read, where its first step is in their order (its
    first byte's tensor named, for errors); the main thread takes it there and gives its memory back
    as soon as its steps are done, before the next step's reads are taken: held longer, a reader
    waiting for that memory to read the next span would wait for ever."""
    from reshard.io.reader import FileReader
    from reshard.spans import InlineReads

    monkeypatch.setattr(FileReader, "inline", lambda self, file: True)
    between = _step(_read(100, file="b.safetensors"))  # not uniform: read ahead as it is
    steps = [*_layer(0), between, *_layer(24)]
    reads = InlineReads(FileReader(tmp_path), steps, [True, True, False, True, True])
    reads.plan(1 << 20)
    first, second = reads.spans[0].read, reads.spans[3].read
    assert (first.info.name, first.start, first.nbytes) == ("t0", 0, 24 * N)  # t0 (expert 0's down): the first byte
    assert (second.info.name, second.nbytes) == ("t24", 24 * N)
    assert reads.ahead == [first, *between.reads, second]
    leases: list[_Lease] = []
    stretch = bytes(range(256)) * (24 * N // 256)

    def get():
        leases.append(_Lease())
        return memoryview(stretch), leases[-1]

    reads.get = get
    out = bytearray(16 * N)
    reads.at(0)(steps[0].reads, memoryview(out), N)  # w13: gate and up of each expert, from the stretch
    assert out == b"".join(stretch[(3 * e + p) * N : (3 * e + p + 1) * N] for e in range(8) for p in (1, 2))
    assert reads.at(1) is not None and [x.released for x in leases] == [0]
    assert reads.at(2) is None and [x.released for x in leases] == [1]  # given back before the next step
    assert reads.at(3) is not None and reads.at(4) is not None and [x.released for x in leases] == [1, 0]
    reads.close()
    assert [x.released for x in leases] == [1, 1]
