"""FileWriter's two ways to the disk give the same file and digest: through its stage (a copy) and
straight from the caller's buffer (large contiguous writes whose memory lines up with the file)."""

from __future__ import annotations

import blake3
import numpy as np
import pytest
from safetensors import safe_open

import reshard.io.writer as wr
from reshard.format import read_header
from reshard.io.memory import ALIGN, aligned_buffer
from reshard.save import save


@pytest.fixture(params=[True, False], ids=["o_direct", "buffered"])
def small_through(request, monkeypatch):
    """Through-writes from 8 KiB in segments of 12 KiB, a 16 KiB stage; counts the through-writes."""
    monkeypatch.setattr(wr, "USE_O_DIRECT", request.param)
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
    w = wr.FileWriter(tmp_path / "f", header)
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
    header = wr.page_aligned_header(entries, {"format": "pt"})
    path = tmp_path / "h.safetensors"
    path.write_bytes(header + bytes(4 + 4 + 24 + 3 * 64 * 1024 * 2))
    tensors, meta, _ = read_header(path)
    assert meta == {"format": "pt"} and len(header) % 8 == 0
    assert [tensors[f"w{i}"].offset % ALIGN for i in range(3)] == [0, 0, 0]
    assert tensors["a.k_scale"].offset % ALIGN != 0
    with safe_open(str(path), "pt") as st:
        assert st.get_tensor("w2").shape == (64, 1024)
