"""FileReader: O_DIRECT reads give the same bytes as buffered ones, and `auto` picks O_DIRECT for
files that are not in the page cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard import settings
from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.io import direct as direct_module
from reshard.io.direct import cached_share
from reshard.io.memory import ALIGN, aligned_buffer
from reshard.io.reader import FileReader
from tests.fixtures.odirect import direct_io_works


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (longest mount point that prefixes it)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fs = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(5 * ALIGN + 1234)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize(
    "value, mode", [(None, "auto"), ("auto", "auto"), ("1", "1"), ("true", "1"), ("0", "0"), ("no", "0")]
)
def test_mode_from_environment(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("RESHARD_DIRECT_READS", raising=False)
    else:
        monkeypatch.setenv("RESHARD_DIRECT_READS", value)
    assert settings.DIRECT_READS.get() == mode


@pytest.mark.parametrize("mode", ["1", "0"])
@pytest.mark.parametrize(
    "offset, start, nbytes",
    [(0, 0, ALIGN), (8, 0, 5), (100, 4000, 200), (37, 1, 5 * ALIGN), (0, 2 * ALIGN - 3, 3 * ALIGN + 1234)],
)
def test_prepared_reads_give_the_file_bytes(monkeypatch, data_file, mode, offset, start, nbytes):
    """Unaligned tensors and spans, also up to the end of the file (O_DIRECT reads the whole last
    block, which EOF cuts short)."""
    path, data = data_file
    nbytes = min(nbytes, len(data) - offset - start)
    monkeypatch.setenv("RESHARD_DIRECT_READS", mode)
    reader = FileReader(path.parent)
    info = TensorInfo("w", "U8", (len(data) - offset,), path.name, offset, len(data) - offset)
    try:
        prepared = reader.prepare(info, start, nbytes)
        assert (prepared.fd is not None) == (mode == "1" and direct_io_works(path))
        region = memoryview(aligned_buffer(prepared.size))
        got = reader.read_prepared(info, start, nbytes, prepared, region)
        assert bytes(got) == data[offset + start : offset + start + nbytes]
    finally:
        reader.close()


def test_auto_reads_uncached_files_with_o_direct(monkeypatch, data_file):
    path, data = data_file
    if _fs_type(path) in ("tmpfs", "ramfs", "") or not direct_io_works(path) or cached_share(path) is None:
        pytest.skip("needs a disk-backed filesystem with O_DIRECT, and cachestat(2) or mincore(2)")
    monkeypatch.delenv("RESHARD_DIRECT_READS", raising=False)
    assert path.read_bytes() == data
    assert cached_share(path) == 1.0
    reader = FileReader(path.parent)
    info = TensorInfo("w", "U8", (len(data),), path.name, 0, len(data))
    assert reader.prepare(info, 0, 10).fd is None  # in the page cache: copied out of it
    reader.close()

    for _ in range(10):  # a page another CPU still holds may escape one eviction
        _evict(path)
        share = cached_share(path)
        if share == 0.0:
            break
    assert share == 0.0
    assert cached_share(path) == 0.0  # asking read nothing in: the same answer again
    reader = FileReader(path.parent)
    try:
        prepared = reader.prepare(info, 3, 10)
        assert prepared.fd is not None
        got = reader.read_prepared(info, 3, 10, prepared, memoryview(aligned_buffer(prepared.size)))
        assert bytes(got) == data[3:13]
    finally:
        reader.close()


@pytest.mark.parametrize("how", ["cachestat", "mincore"])
def test_cached_share_asks_without_reading(data_file, how):
    """Either way of asking (cachestat(2), or mincore(2) where the kernel lacks it) tells a read file
    from an evicted one, and asking twice brings nothing into the cache (RWF_NOWAIT reads did)."""
    path, data = data_file
    if _fs_type(path) in ("tmpfs", "ramfs", ""):
        pytest.skip("needs a disk-backed filesystem (tmpfs pages cannot be evicted)")
    ask = getattr(direct_module, f"_{how}")

    def share() -> float | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return ask(fd, len(data))
        finally:
            os.close(fd)

    if share() is None:
        pytest.skip(f"{how} is not available here")
    assert path.read_bytes() == data
    assert share() == 1.0
    for _ in range(10):  # a page another CPU still holds may escape one eviction
        _evict(path)
        if share() == 0.0:
            break
    assert [share(), share(), share()] == [0.0, 0.0, 0.0]


def test_cached_share_of_an_empty_file_is_unknown(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    assert cached_share(tmp_path / "e") is None


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
@pytest.mark.parametrize("direct", ["0", "1"])
def test_a_failing_source_disk_is_a_source_error(tiny, tmp_path, monkeypatch, direct, arch):
    """EIO (or a stale, disconnected mount) reading a source shard is exit 4 naming the shard, through the page
    cache as with O_DIRECT: it was told as `cannot write OUT_DIR` (exit 5), blaming the output's disk. The
    MoE's experts (uniform steps: reshard.batch) are read by the main thread where they are cached
    (reshard.spans), by the reader threads where not."""
    import errno

    import reshard.batch
    from tests.fixtures.cli import run

    monkeypatch.setattr(reshard.batch, "MIN_READS", 2)  # the tiny MoE has 8 experts
    src = tiny(arch)
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors") and str(src) in os.readlink(
            f"/proc/self/fd/{fd}"
        ):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setenv("RESHARD_DIRECT_READS", direct)
    monkeypatch.setattr(os, "preadv", preadv)
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and "cannot read" in err and ".safetensors: Input/output error" in err, err
    assert not (tmp_path / "out").exists()


class _Read:
    """One read (reshard.io.reader.ByteRange): bytes [start, start + nbytes) of tensor `info`."""

    def __init__(self, info: TensorInfo, start: int, nbytes: int) -> None:
        self.info, self.start, self.nbytes = info, start, nbytes


def test_batch_reads_land_in_order_one_preadv_per_run_that_follows_on(tmp_path, monkeypatch):
    """`read_batch` (a uniform step's reads of cached files, made by the main thread): every read's
    bytes in its place, reads that follow each other in one file made with one system call."""
    monkeypatch.setenv("RESHARD_DIRECT_READS", "auto")
    a, b = os.urandom(64 * 256), os.urandom(64 * 256)
    (tmp_path / "a.safetensors").write_bytes(a)
    (tmp_path / "b.safetensors").write_bytes(b)
    info = {
        (f, k): TensorInfo(f"{f}{k}", "U8", (64,), f"{f}.safetensors", 64 * k, 64) for f in "ab" for k in range(256)
    }
    # a run of 3, a gap, a run of 2, the other file (a run of 2), back to the first file (out of order)
    order = [("a", 0), ("a", 1), ("a", 2), ("a", 5), ("a", 6), ("b", 7), ("b", 8), ("a", 3)]
    reads = [_Read(info[key], 0, 64) for key in order]
    monkeypatch.setattr(direct_module, "_cachestat", lambda fd, size: 1.0)  # in the page cache
    reader = FileReader(tmp_path)
    assert reader.inline("a.safetensors") and reader.inline("b.safetensors")
    calls = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, pos: calls.append(pos) or preadv(fd, bufs, pos))
    out = memoryview(bytearray(64 * len(order)))
    reader.read_batch(reads, out, 64)
    want = b"".join((a if f == "a" else b)[64 * k : 64 * k + 64] for f, k in order)
    assert bytes(out) == want
    assert calls == [0, 5 * 64, 7 * 64, 3 * 64]
    reader.close()


def test_batch_reads_only_of_cached_files_read_through_the_cache(tmp_path, monkeypatch, data_file):
    path, _ = data_file
    monkeypatch.setenv("RESHARD_DIRECT_READS", "1")  # every file with O_DIRECT: the reader threads read it
    assert not FileReader(path.parent).inline(path.name)
    monkeypatch.setenv("RESHARD_DIRECT_READS", "0")
    reader = FileReader(path.parent)
    monkeypatch.setattr(direct_module, "_cachestat", lambda fd, size: 0.1)  # mostly not in the cache
    monkeypatch.setattr(direct_module, "_mincore", lambda fd, size: 0.1)
    assert not reader.inline(path.name)  # read ahead by the reader threads, not waited for one at a time
    reader.close()


def test_a_batch_read_of_a_file_cut_short_is_a_source_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_DIRECT_READS", "0")
    (tmp_path / "a.safetensors").write_bytes(os.urandom(64 * 4))
    reads = [_Read(TensorInfo(f"t{k}", "U8", (64,), "a.safetensors", 64 * k, 64), 0, 64) for k in range(4)]
    monkeypatch.setattr(direct_module, "_cachestat", lambda fd, size: 1.0)
    reader = FileReader(tmp_path)
    assert reader.inline("a.safetensors")
    os.truncate(tmp_path / "a.safetensors", 64 * 3)
    with pytest.raises(SourceError, match="truncated while reading t0"):
        reader.read_batch(reads, memoryview(bytearray(64 * 4)), 64)
    reader.close()


def _stretch(reader: FileReader, t: TensorInfo, pos: int, nbytes: int, buf: memoryview) -> memoryview:
    """Bytes [pos, pos + nbytes) of `t`'s file (past `t`'s end), read as the reader threads read a span."""
    prepared = reader.prepare(t, pos - t.offset, nbytes)
    return reader.read_prepared(t, pos - t.offset, nbytes, prepared, buf[: prepared.size])


def test_a_span_read_of_a_file_cut_short_or_failing_is_a_source_error(tmp_path, monkeypatch):
    """A stretch several uniform steps read (reshard.spans), read as one: errors as every other read's."""
    import errno

    (tmp_path / "a.safetensors").write_bytes(os.urandom(64 * 4))
    t = TensorInfo("t0", "U8", (64,), "a.safetensors", 0, 64)
    monkeypatch.setenv("RESHARD_DIRECT_READS", "0")
    reader = FileReader(tmp_path)
    buf = memoryview(aligned_buffer(3 * ALIGN))
    got = _stretch(reader, t, 0, 64 * 4, buf)
    assert bytes(got) == (tmp_path / "a.safetensors").read_bytes()
    os.truncate(tmp_path / "a.safetensors", 64 * 3)
    with pytest.raises(SourceError, match="truncated while reading t0"):
        _stretch(reader, t, 0, 64 * 4, buf)

    def eio(fd, buffers, offset, *flags):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(SourceError, match=r"cannot read .*a\.safetensors: Input/output error"):
        _stretch(reader, t, 0, 64, buf)
    reader.close()


@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("pos, nbytes", [(0, 5 * ALIGN + 1234), (3, 10), (ALIGN - 1, ALIGN + 2), (2 * ALIGN, ALIGN)])
def test_a_span_read_gives_the_file_bytes_through_the_cache_or_with_o_direct(monkeypatch, data_file, mode, pos, nbytes):
    """A stretch read whole (reshard.spans), with O_DIRECT where the file is read so: the block-aligned
    stretch around it, the bytes a view of it, the file's end cut short."""
    path, data = data_file
    if mode == "1" and not direct_io_works(path):
        pytest.skip("O_DIRECT not supported here")
    monkeypatch.setenv("RESHARD_DIRECT_READS", mode)
    reader = FileReader(path.parent)
    t = TensorInfo("w", "U8", (len(data),), path.name, 0, len(data))
    got = _stretch(reader, t, pos, nbytes, memoryview(aligned_buffer(nbytes + 2 * ALIGN)))
    assert bytes(got) == data[pos : pos + nbytes]
    assert (reader.direct_fds[path.name] is not None) == (mode == "1")
    reader.close()


def test_a_span_read_falls_back_to_the_page_cache_where_o_direct_reads_are_refused(monkeypatch, data_file):
    """A filesystem that opens a file with O_DIRECT but refuses its reads (EINVAL): the span is read
    through the page cache, and so is every later read of that file."""
    import errno

    path, data = data_file
    monkeypatch.setenv("RESHARD_DIRECT_READS", "1")
    reader = FileReader(path.parent)
    reader.fd(path.name)
    direct = os.open(path, os.O_RDONLY)  # stands for the O_DIRECT descriptor
    reader.direct_fds[path.name] = direct
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if fd == direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    t = TensorInfo("w", "U8", (len(data),), path.name, 0, len(data))
    got = _stretch(reader, t, 5, 3 * ALIGN, memoryview(aligned_buffer(5 * ALIGN)))
    assert bytes(got) == data[5 : 5 + 3 * ALIGN]
    assert reader.direct_fds[path.name] is None
    reader.close()
