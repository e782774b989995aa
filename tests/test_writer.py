"""FileWriter's two ways to the disk give the same file and digest: through its stage (a copy) and
straight from the caller's buffer (large contiguous writes whose memory lines up with the file)."""

from __future__ import annotations

import threading

import blake3
import numpy as np
import pytest
from safetensors import safe_open

import reshard.io.writer as wr
from reshard.format import read_header
from reshard.io.memory import ALIGN, aligned_buffer
from reshard.schedule import page_aligned_header
from tests.fixtures.saving import save


@pytest.fixture(params=[True, False], ids=["o_direct", "buffered"])
def small_through(request, monkeypatch):
    """Through-writes from 8 KiB in segments of 12 KiB, a 16 KiB stage; counts the through-writes."""
    monkeypatch.setenv("RESHARD_O_DIRECT", "1" if request.param else "0")
    # sources read through the page cache, as a just-written tiny source is unless the kernel dropped
    # it (memory pressure): O_DIRECT reads land off the output's page offsets and nothing goes through
    monkeypatch.setenv("RESHARD_DIRECT_READS", "0")
    monkeypatch.setattr(wr, "THROUGH_MIN", 2 * ALIGN)
    monkeypatch.setattr(wr, "THROUGH_SEGMENT", 3 * ALIGN)
    monkeypatch.setattr(wr, "STAGE_BYTES", 4 * ALIGN)
    calls = []
    through = wr.FileWriter._write_through

    def counted(self, view):
        calls.append(view.nbytes)
        return through(self, view)

    monkeypatch.setattr(wr.FileWriter, "_write_through", counted)
    return calls


def test_through_and_staged_writes_give_the_same_file(tmp_path, small_through):
    rng = np.random.default_rng(0)
    slab = aligned_buffer(64 * ALIGN)  # page-aligned, like the executor's read buffers
    arr = np.frombuffer(slab, np.uint8)
    arr[:] = rng.integers(0, 256, arr.size, dtype=np.uint8)
    header = bytes(rng.integers(0, 256, ALIGN - 100, dtype=np.uint8))
    w = wr.FileWriter(tmp_path / "f", header, "blake3")
    expect = [header]

    def put(data):
        expect.append(bytes(data))
        w.write(memoryview(data))

    put(arr[:100])  # the file position is now ALIGN: page offsets of file and memory agree
    put(arr[ALIGN : ALIGN + 9 * ALIGN + 5])  # aligned start: stage flushed, 9 blocks straight, 5 staged
    put(arr[17 : 17 + 5 * ALIGN])  # memory and file out of line: staged under O_DIRECT
    put(arr[ALIGN + 5 : ALIGN + 5 + 3 * ALIGN])  # in line again, mid-block: head staged first
    put(b"small bytes")
    strided = arr[: 40 * 64].reshape(40, 64)[:, 8:40]  # a column slice: gathered into the stage
    expect.append(strided.tobytes())
    w.write_array(strided)
    put(arr[20 * ALIGN : 40 * ALIGN])  # larger than the stage and a segment
    done = w.close(sync=False)
    data = b"".join(expect)
    assert (tmp_path / "f").read_bytes() == data
    assert done.size == len(data) and done.digest == blake3.blake3(data).hexdigest()
    assert len(small_through) >= 2  # the in-line writes went through (all the large ones when buffered)


def test_save_writes_the_same_bytes_through_or_staged(tiny, tmp_path, monkeypatch, small_through):
    """A whole save with small through-writes: every tensor's bytes as the staged save's, and the
    header page-padded so that the data section starts on a page."""
    src = tiny("qwen3-moe-fp8")
    through = save(str(src), tmp_path / "a", tp=2, max_part_size=200_000, chunk_bytes=20_000)
    assert small_through, "no write went through"
    monkeypatch.setattr(wr, "THROUGH_MIN", 1 << 62)
    staged = save(str(src), tmp_path / "b", tp=2, max_part_size=200_000, chunk_bytes=20_000)
    assert through.plan.files == staged.plan.files
    for f in through.plan.files:
        a, b = ((tmp_path / d / f.name).read_bytes() for d in "ab")
        n = int.from_bytes(a[:8], "little")
        assert a[8 + n :] == b[8 + int.from_bytes(b[:8], "little") :], f.name
        with safe_open(str(tmp_path / "a" / f.name), "pt") as st:  # the padded header reads as any
            assert set(st.keys()) == {t.name for t in f.tensors}


def test_header_pads_the_bulk_of_the_bytes_onto_pages(tmp_path):
    """Small tensors first (KV-cache scales, F32, ahead of the bf16 weights): the header's padding
    puts the large tensors, not the data section's start, on page boundaries."""
    entries = [("a.k_scale", "F32", ()), ("b.v_scale", "F32", ()), ("c.bias", "BF16", (12,))]
    entries += [(f"w{i}", "BF16", (64, 1024)) for i in range(3)]
    header = page_aligned_header(entries, {"format": "pt"})
    path = tmp_path / "h.safetensors"
    path.write_bytes(header + bytes(4 + 4 + 24 + 3 * 64 * 1024 * 2))
    tensors, meta, _ = read_header(path)
    assert meta == {"format": "pt"} and len(header) % 8 == 0
    assert [tensors[f"w{i}"].offset % ALIGN for i in range(3)] == [0, 0, 0]
    assert tensors["a.k_scale"].offset % ALIGN != 0
    with safe_open(str(path), "pt") as st:
        assert st.get_tensor("w2").shape == (64, 1024)


class _Lease:
    """A lease that counts its references; `waiting`: whether memory is short."""

    def __init__(self) -> None:
        self.refs = 0
        self.waiting = False

    def hold(self) -> None:
        self.refs += 1

    def release(self) -> None:
        self.refs -= 1

    def short(self) -> bool:
        return self.waiting


@pytest.fixture
def small_held(monkeypatch):
    """Pieces of 1 to 7 blocks held, at most 3 at once or 16 blocks; a 4-block stage; counts the
    pieces held."""
    monkeypatch.setenv("RESHARD_O_DIRECT", "1")
    monkeypatch.setenv("RESHARD_DIRECT_READS", "0")  # as in small_through: pieces held need page-cache reads
    monkeypatch.setattr(wr, "HELD_MIN", ALIGN)
    monkeypatch.setattr(wr, "THROUGH_MIN", 8 * ALIGN)
    monkeypatch.setattr(wr, "THROUGH_SEGMENT", 16 * ALIGN)
    monkeypatch.setattr(wr, "HELD_MAX_IOV", 3)
    monkeypatch.setattr(wr, "STAGE_BYTES", 4 * ALIGN)
    held = []
    real = wr.FileWriter.write_held

    class Counted:  # the writer's view of the lease: counts the pieces it holds
        def __init__(self, lease, n):
            self.lease, self.n = lease, n

        def hold(self):
            held.append(self.n)
            self.lease.hold()

        def release(self):
            self.lease.release()

        def short(self):
            return self.lease.short()

    def counted(self, view, lease):
        real(self, view, Counted(lease, view.nbytes))

    monkeypatch.setattr(wr.FileWriter, "write_held", counted)
    return held


def test_held_pieces_go_out_in_order_with_the_stage(tmp_path, small_held):
    """Held pieces (no copy) between staged bytes, gathered columns and through-writes: the file and
    its digest are those of the bytes in order, and every lease the writer took is given back."""
    rng = np.random.default_rng(1)
    slab = aligned_buffer(64 * ALIGN)
    arr = np.frombuffer(slab, np.uint8)
    arr[:] = rng.integers(0, 256, arr.size, dtype=np.uint8)
    header = bytes(rng.integers(0, 256, 2 * ALIGN, dtype=np.uint8))  # ends on a block
    w = wr.FileWriter(tmp_path / "f", header, "blake3")
    lease = _Lease()
    expect = [header]

    def hold(a, b):
        expect.append(arr[a:b].tobytes())
        w.write_held(memoryview(arr[a:b]), lease)

    hold(0, 3 * ALIGN)  # held after the header's stage segment
    hold(5 * ALIGN, 6 * ALIGN)  # the header's bytes and two pieces: a write of their own (HELD_MAX_IOV)
    assert not w.leases and w.pending is not None
    strided = arr[: 128 * 64].reshape(128, 64)[:, :32]  # gathered: one block into the stage
    expect.append(strided.tobytes())
    w.write_array(strided)
    hold(8 * ALIGN, 10 * ALIGN)
    assert len(w.leases) == 1 and w.seg == w.fill == 3 * ALIGN  # header and columns: one stage
    expect.append(b"tail bytes")  # the file position is off a block now ...
    w.write(b"tail bytes")
    w.write_held(memoryview(arr[12 * ALIGN : 13 * ALIGN]), lease)  # ... so this one is staged
    expect.append(arr[12 * ALIGN : 13 * ALIGN].tobytes())
    w.write(b"x" * (ALIGN - 10))  # back on a block
    expect.append(b"x" * (ALIGN - 10))
    hold(20 * ALIGN, 22 * ALIGN)
    expect.append(b"partial")
    w.write(b"partial")  # the stage's bytes after a held piece stay when the held ones go out
    w.flush_held(if_short=True)
    assert len(w.leases) == 1  # no thread waits for memory: kept
    lease.waiting = True
    w.flush_held(if_short=True)
    assert not w.leases and w.fill - w.seg == 7
    expect.append(b"y" * (ALIGN - 7))
    w.write(b"y" * (ALIGN - 7))
    hold(30 * ALIGN, 33 * ALIGN)
    expect.append(arr[40 * ALIGN : 50 * ALIGN].tobytes())
    w.write(memoryview(arr[40 * ALIGN : 50 * ALIGN]))  # through: in line with the file
    hold(52 * ALIGN, 53 * ALIGN)  # held last: written by close
    done = w.close(sync=False)
    data = b"".join(expect)
    assert (tmp_path / "f").read_bytes() == data
    assert done.size == len(data) and done.digest == blake3.blake3(data).hexdigest()
    assert lease.refs == 0
    assert small_held == [3 * ALIGN, ALIGN, 2 * ALIGN, 2 * ALIGN, 3 * ALIGN, ALIGN]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_row_blocks_of_a_strided_array_are_held_not_gathered(tmp_path, small_held, monkeypatch, direct):
    """A strided array whose rows are contiguous blocks (a rank's rows of each expert in a batch
    buffer, reshard.batch) goes out block by block like contiguous pieces: held where they line up
    with the file (no copy), staged where not; the same bytes either way, every lease given back."""
    from types import SimpleNamespace

    from reshard.io.worker import Worker

    monkeypatch.setenv("RESHARD_O_DIRECT", "1" if direct else "0")
    rng = np.random.default_rng(2)
    slab = aligned_buffer(24 * ALIGN)
    arr = np.frombuffer(slab, np.uint8)
    arr[:] = rng.integers(0, 256, arr.size, dtype=np.uint8)
    blocks = arr.reshape(6, 4 * ALIGN)[:, ALIGN : 3 * ALIGN]  # rows of 2 blocks, 4 blocks apart
    odd = arr.reshape(6, 4 * ALIGN)[:, 5:9]  # rows too small to hold: gathered
    header = b"h" * ALIGN
    sink = wr.FileWriter(tmp_path / "f", header, "blake3")
    worker = Worker(sink)
    worker.begin(SimpleNamespace(name="t", nbytes=blocks.nbytes + odd.nbytes))
    lease = _Lease()
    lease.refs = 2
    worker.write(blocks, lease)
    worker.write(odd, lease)
    worker.close(sync=False)
    done = worker.join()
    expect = header + blocks.tobytes() + odd.tobytes()
    assert (tmp_path / "f").read_bytes() == expect
    assert done.digest == blake3.blake3(expect).hexdigest() and lease.refs == 0
    assert small_held == ([2 * ALIGN] * 6 if sink.direct else [])


def test_held_writes_fall_back_to_staging_when_buffered(tmp_path, small_held, monkeypatch):
    monkeypatch.setenv("RESHARD_O_DIRECT", "0")
    arr = np.frombuffer(aligned_buffer(4 * ALIGN), np.uint8)
    arr[:] = 7
    w = wr.FileWriter(tmp_path / "f", b"h" * ALIGN, "blake3")
    lease = _Lease()
    w.write_held(memoryview(arr[: 2 * ALIGN]), lease)
    w.close(sync=False)
    assert (tmp_path / "f").read_bytes() == b"h" * ALIGN + bytes([7]) * (2 * ALIGN)
    assert small_held == [] and lease.refs == 0


@pytest.mark.parametrize("max_memory", [None, 40_000], ids=["roomy", "short"])
def test_save_with_held_pieces_writes_the_same_bytes(tiny, tmp_path, monkeypatch, small_held, max_memory):
    """A whole save whose aligned small pieces are held: the same files as a save that stages all;
    with memory so short that readers wait on the writers' held pieces, it still ends (the writers
    let go of what they hold when a reader waits)."""
    src = tiny("qwen3-moe-fp8")
    if max_memory:  # two read buffers of 6 blocks: readers wait for the writers all the time
        monkeypatch.setattr("reshard.io.memory.MIN_SLAB", 4 * ALIGN)
    box: list = []

    def run() -> None:
        try:
            box.append(
                save(str(src), tmp_path / "a", tp=2, max_part_size=200_000, chunk_bytes=4096, max_memory=max_memory)
            )
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the save hung: pieces held by idle writers kept a reader waiting"
    (held,) = box
    assert not isinstance(held, BaseException), held
    assert small_held, "no piece was held"
    monkeypatch.setattr(wr, "HELD_MIN", 1 << 62)
    monkeypatch.setattr(wr, "THROUGH_MIN", 1 << 62)
    staged = save(str(src), tmp_path / "b", tp=2, max_part_size=200_000, chunk_bytes=4096)
    assert held.plan.files == staged.plan.files
    for f in held.plan.files:
        a, b = ((tmp_path / d / f.name).read_bytes() for d in "ab")
        assert a[8 + int.from_bytes(a[:8], "little") :] == b[8 + int.from_bytes(b[:8], "little") :], f.name


class _BytesSink(wr.Sink):
    """A sink with the required methods only: the optional ones are `Sink`'s defaults."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def begin(self, tensor) -> None:
        pass

    def write(self, data) -> None:
        self.chunks.append(bytes(data))

    def close(self, sync: bool) -> wr.Written:
        data = b"".join(self.chunks)
        return wr.Written("f", len(data), None)

    def abort(self) -> None:
        pass


def test_a_sink_without_the_optional_methods_gets_every_byte(monkeypatch):
    """The worker calls write_held and write_array on every sink: the defaults write (strided arrays
    a block of rows at a time) and hold nothing."""
    from types import SimpleNamespace

    from reshard.io.worker import Worker

    monkeypatch.setattr(wr, "STAGE_BYTES", 3 * 10)  # row blocks of 3 rows of 10 bytes
    arr = np.arange(20 * 30, dtype=np.uint8).reshape(20, 30)
    strided, contiguous = arr[:, 5:15], arr[3:5]
    sink = _BytesSink()
    worker = Worker(sink)
    worker.begin(SimpleNamespace(name="t", nbytes=strided.nbytes + contiguous.nbytes + 2))
    leases = [_Lease() for _ in range(3)]
    for data, lease in zip([strided, contiguous, b"ab"], leases, strict=True):
        lease.refs = 1
        worker.write(data, lease)
    worker.flush_held()
    worker.close(sync=False)
    done = worker.join()
    assert b"".join(sink.chunks) == strided.tobytes() + contiguous.tobytes() + b"ab"
    assert [len(c) for c in sink.chunks[:7]] == [30] * 6 + [20]
    assert done.size == strided.nbytes + contiguous.nbytes + 2 and [x.refs for x in leases] == [0, 0, 0]


def test_sinks_and_sources_declare_their_protocol():
    from reshard.checkpoint import Source
    from reshard.sources.hubsource import HubSource
    from reshard.sources.local import LocalSource
    from reshard.sources.output import OutputSource
    from reshard.verify.deep import _CompareSink

    # subclassed, not matched by shape: the optional methods' defaults come from the protocol
    assert wr.Sink in wr.FileWriter.__mro__ and wr.Sink in _CompareSink.__mro__
    assert all(Source in s.__mro__ for s in (LocalSource, OutputSource, HubSource))
    assert OutputSource.finish is Source.finish  # LocalSource and HubSource check what they read at the end
    assert LocalSource.finish is not Source.finish and HubSource.finish is not Source.finish


@pytest.mark.parametrize("numpy_copy", [1, 1 << 40], ids=["numpy-copies", "memoryview-copies"])
def test_staged_copies_and_wide_strided_arrays_give_the_same_bytes(tmp_path, monkeypatch, numpy_copy):
    """The stage takes bytes by numpy (from NUMPY_COPY: without the GIL) or as a memoryview, also
    across its end; a strided array of 8-byte words (reshard.batch.wide) is gathered as its bytes."""
    monkeypatch.setattr(wr, "STAGE_BYTES", 4 * ALIGN)
    monkeypatch.setattr(wr, "THROUGH_MIN", 1 << 40)  # everything through the stage
    monkeypatch.setattr(wr, "NUMPY_COPY", numpy_copy)
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, 64 * ALIGN, dtype=np.uint8)
    w = wr.FileWriter(tmp_path / "f", b"h" * 100, "blake3")
    expect = [b"h" * 100]
    for a, n in [(0, 3), (5, 2 * ALIGN + 7), (1, 5 * ALIGN), (9, 11)]:  # the second and third cross the stage's end
        expect.append(arr[a : a + n].tobytes())
        w.write(memoryview(arr[a : a + n]))
    words = arr[: 16 * 64 * 8].view(np.uint64).reshape(16, 64)[:, 3:9]  # each row's 48 bytes: 8-byte runs
    expect.append(words.tobytes())
    w.write_array(words)
    w.close(sync=False)
    assert (tmp_path / "f").read_bytes() == b"".join(expect)


def test_a_failed_write_gives_back_the_held_pieces(tmp_path, small_held):
    """A full disk under held pieces: the pieces handed over with the write that finds the previous
    one failed are given back, not dropped with their leases (the executor waited forever for that
    memory: a hang instead of exit 5), and so is what the failed writer still holds (`drop_held`)."""
    import errno
    from concurrent.futures import Future

    slab = aligned_buffer(16 * ALIGN)
    w = wr.FileWriter(tmp_path / "f", b"h" * (2 * ALIGN), "blake3")
    if not w.direct:
        pytest.skip("no O_DIRECT here: nothing is held")
    failed: Future = Future()
    failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
    lease = _Lease()
    w.write_held(memoryview(slab)[: 2 * ALIGN], lease)
    assert lease.refs == 1
    w.pending = failed  # the write before these held pieces failed on the I/O thread
    with pytest.raises(OSError, match="No space"):
        w.write_held(memoryview(slab)[2 * ALIGN : 4 * ALIGN], lease)  # a third segment: written at once
    assert lease.refs == 0, "the held pieces' leases were dropped with the failed write"
    w.abort()
    w = wr.FileWriter(tmp_path / "g", b"h" * (2 * ALIGN), "blake3")
    w.write_held(memoryview(slab)[: 2 * ALIGN], lease)
    assert lease.refs == 1
    w.drop_held()
    assert lease.refs == 0 and not w.leases
    w.abort()


def test_a_failing_writer_gives_back_what_its_sink_holds():
    """Worker: the sink's first error makes it drop what it holds, at once."""
    from reshard.io.worker import Worker

    class Failing(wr.Sink):
        dropped = 0

        def write(self, data):
            raise OSError(28, "No space left on device")

        def drop_held(self):
            Failing.dropped += 1

    sink = Failing()
    lease = _Lease()
    lease.hold()
    w = Worker(sink)
    w.write(b"x", lease)
    w.close(False)
    with pytest.raises(OSError, match="No space"):
        w.join()
    assert Failing.dropped == 1 and lease.refs == 0
