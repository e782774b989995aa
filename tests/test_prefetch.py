"""The reader threads (reshard.io.prefetch): small reads are taken, made and handed over in runs
(issue 28); every read still comes back in order with its own bytes and its own reference to its
memory, a failure surfaces at the read it happened to, and the memory all comes back."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import pytest

from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.io.memory import Memory
from reshard.io.prefetch import RUN_READS, SMALL_READ, Prefetcher
from reshard.io.reader import FileReader


@dataclass(frozen=True)
class R:
    info: TensorInfo
    start: int
    nbytes: int


def _file(tmp_path, sizes: list[int]) -> tuple[list[TensorInfo], bytes]:
    """A file of tensors of `sizes` bytes, back to back from an odd offset (reads off the page)."""
    data = os.urandom(sum(sizes) + 13)
    (tmp_path / "f.bin").write_bytes(data)
    infos, pos = [], 13
    for i, n in enumerate(sizes):
        infos.append(TensorInfo(f"t{i}", "U8", (n,), "f.bin", pos, n))
        pos += n
    return infos, data


def _sizes() -> list[int]:
    """Many small reads (several runs' worth), some large ones between them, odd sizes."""
    small = [4096, 4093, 100, 1, 8192 + 7]
    return [small[i % len(small)] for i in range(3 * RUN_READS)] + [SMALL_READ + 1, 3 << 20] + [777] * 70


class Blob:
    """A plain `Reader` (not an AlignedReader): read on one thread, a region per read."""

    def __init__(self, data: bytes, fail_at: str | None = None) -> None:
        self.data, self.fail_at = data, fail_at

    def read(self, t, start, nbytes, buf=None):
        if t.name == self.fail_at:
            raise SourceError(f"cannot read {t.name}")
        out = memoryview(buf)[:nbytes]
        out[:] = self.data[t.offset + start : t.offset + start + nbytes]
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize("threads", [1, 4])
def test_every_read_comes_back_in_order_with_its_bytes(tmp_path, monkeypatch, direct, threads):
    monkeypatch.setenv("RESHARD_DIRECT_READS", direct)
    infos, data = _file(tmp_path, _sizes())
    reads = [R(t, 0, t.nbytes) for t in infos] + [R(infos[3], 1, 3), R(infos[0], 4000, 96)]
    mem = Memory(16 << 20, 1 << 20)
    reader = FileReader(tmp_path)
    p = Prefetcher(reader, mem, reads, threads=threads)
    try:
        for r in reads:
            view, lease = p.get()
            assert bytes(view) == data[r.info.offset + r.start : r.info.offset + r.start + r.nbytes], r.info.name
            lease.release()
    finally:
        p.stop()
        reader.close()
    assert mem.fresh == 0, "a large read's fresh memory was not given back"
    assert all(s.refs == 0 for s in mem.free), "a slab still has a reference"
    assert len(mem.free) == mem.made, "a slab did not come back"


def test_a_failed_read_surfaces_at_its_place_after_the_reads_before_it(tmp_path):
    infos, data = _file(tmp_path, [4096] * 40)
    reads = [R(t, 0, t.nbytes) for t in infos]
    mem = Memory(16 << 20, 1 << 20)
    p = Prefetcher(Blob(data, fail_at="t17"), mem, reads)
    try:
        for r in reads[:17]:
            view, lease = p.get()
            assert bytes(view) == data[r.info.offset : r.info.offset + r.nbytes]
            lease.release()
        with pytest.raises(SourceError, match="cannot read t17"):
            p.get()
    finally:
        p.stop()
    assert len(mem.free) == mem.made and all(s.refs == 0 for s in mem.free)


def test_a_run_stops_where_its_slab_is_full_and_memory_is_short(tmp_path):
    """With two 1 MiB slabs and reads nobody has taken yet, the readers wait for memory without
    holding a run's unused regions: taking the reads frees the way, in order."""
    infos, data = _file(tmp_path, [200_000] * 30)
    reads = [R(t, 0, t.nbytes) for t in infos]
    mem = Memory(3 << 20, 1 << 20)
    assert mem.count == 2
    p = Prefetcher(Blob(data), mem, reads)
    try:
        time.sleep(0.2)  # the readers fill what memory allows, then wait
        for r in reads:
            view, lease = p.get()
            assert bytes(view) == data[r.info.offset : r.info.offset + r.nbytes]
            del view
            lease.release()
    finally:
        p.stop()


def test_a_reused_buffer_is_taken_again_once_its_writers_let_go():
    mem = Memory(64 << 20, 1 << 20)
    asked = []
    mem.on_short = lambda: asked.append(True)
    a, b = mem.take_reused(4096, 2), mem.take_reused(4096, 2)
    a.hold()  # a writer's view of it
    a.release()  # the main thread's reference
    b.release()
    assert mem.take_reused(4096, 2) is b
    got = []
    t = threading.Thread(target=lambda: got.append(mem.take_reused(4096, 2)))
    t.start()
    time.sleep(0.2)
    assert not got and asked, "took a buffer a writer still holds, or did not ask the writers to flush"
    a.release()
    t.join(5)
    assert got == [a]
