"""The loader plugin's reads into parameters the reads cannot land in (GPU memory): striped through
host buffers (reshard/vllm_plugin/staged.py). No GPU here: CPU parameters are sent down that path
(`_direct` taken as False for every one), where the copies are synchronous; what differs on a CUDA
device (page-locked buffers, copies on a CUDA stream, an event per buffer) is not run here."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from reshard.hashing import hash_file
from reshard.manifest import read_manifest
from reshard.vllm_plugin import reader, staged, striped
from tests.fixtures.odirect import direct_io_works
from tests.test_vllm_plugin import _files, _spy, _targets


def _staged(monkeypatch) -> list[staged.Staged]:
    """Every parameter taken as one the reads cannot land in; the `Staged` files as read_rank makes them."""
    monkeypatch.setattr(reader, "_direct", lambda param, shape: False)
    return _spy(monkeypatch, staged.Staged)


def _same(files, targets) -> None:
    want = {k: v for f in files for k, v in load_file(f.path).items()}
    assert sorted(want) == sorted(targets)
    for k, v in want.items():
        assert torch.equal(targets[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize(
    ("slot", "depth", "stripe_min", "threads"),
    [(staged.SLOT, 2, reader.STRIPE_MIN, 2), (4096, 1, 4096, 3), (4096, 2, 8192, 4), (8192, 3, 4096, 2)],
)
def test_parameters_off_the_cpu_get_every_byte_through_host_buffers(
    clean, monkeypatch, slot, depth, stripe_min, threads, direct
):
    """Small buffers: many chunks per file, each buffer reused many times (one per stream: a stream
    waits for the hash of its last chunk before reading the next); several streams per file."""
    monkeypatch.setattr(staged, "SLOT", slot)
    monkeypatch.setattr(staged, "DEPTH", depth)
    monkeypatch.setattr(reader, "STRIPE_MIN", stripe_min)
    made = _staged(monkeypatch)
    slots: list[int] = []
    real = staged._Slot.__init__
    monkeypatch.setattr(staged._Slot, "__init__", lambda self, *a: (slots.append(1), real(self, *a))[1])
    files = _files(clean[1])
    targets = _targets(files)
    algo = read_manifest(clean[1]).checksum
    n, _, bad = reader.read_rank(
        files, targets, algorithm=algo, threads=threads, log=print, label="rank 1", direct_reads=direct
    )
    assert bad == [] and n == sum(f.size for f in files)
    assert made and all(s.hash_thread is not None for s in made)
    assert len(slots) == depth * sum(s.streams for s in made)  # per stream, whatever the file's size
    used = direct == "1" and direct_io_works(files[0].path)
    assert all(sum(s.direct_chunks) == (s.chunks if used else 0) for s in made)
    if slot == 4096:
        assert any(s.chunks > 2 * s.streams * depth for s in made)  # buffers were reused
    _same(files, targets)


@pytest.mark.parametrize("slot", [staged.SLOT, 4096])
def test_a_flipped_byte_is_caught_on_the_way_through_host_buffers(out, monkeypatch, slot):
    monkeypatch.setattr(staged, "SLOT", slot)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    _staged(monkeypatch)
    name = "model-rank-1-part-0.safetensors"
    data = bytearray((out / name).read_bytes())
    data[-3] ^= 0x10
    (out / name).write_bytes(bytes(data))
    files = _files(out)
    algo = read_manifest(out).checksum
    _, _, bad = reader.read_rank(files, _targets(files), algorithm=algo, threads=4, log=print, label="rank 1")
    assert [b.name for b in bad] == [name] and bad[0].got == hash_file(out / name, algo)
    _, _, bad = reader.read_rank(files, _targets(files), algorithm=None, threads=2, log=print, label="rank 1")
    assert bad == []


@pytest.mark.parametrize("depth", [1, 2])
def test_a_file_that_shrank_ends_every_stream_and_the_hash_thread(out, monkeypatch, depth):
    """A stream that fails wakes the others, also those waiting for a buffer the hash thread would
    have freed: a read error, and no thread of the read left behind."""
    monkeypatch.setattr(staged, "SLOT", 4096)
    monkeypatch.setattr(staged, "DEPTH", depth)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    _staged(monkeypatch)
    files = _files(out)
    path = files[0].path
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    algo = read_manifest(out).checksum
    before = set(threading.enumerate())
    with pytest.raises(reader.ReadError, match="ended early"):
        reader.read_rank(files, _targets(files), algorithm=algo, threads=4, log=print, label="rank 1")
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("reshard-")]


def test_a_file_system_refusing_direct_reads_is_read_through_the_cache(clean, monkeypatch):
    """O_DIRECT taken at open, refused by a read (EINVAL): that stream reads on through the cache."""
    import errno
    import fcntl
    import os

    monkeypatch.setattr(staged, "SLOT", 4096)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    made = _staged(monkeypatch)
    files = _files(clean[1])
    if not direct_io_works(files[0].path):
        pytest.skip("this file system takes no O_DIRECT reads")
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= 8192:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(staged.os, "preadv", preadv)
    targets = _targets(files)
    algo = read_manifest(clean[1]).checksum
    n, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=2, log=print, label="rank 1", direct_reads="1")
    assert bad == [] and n == sum(f.size for f in files)
    assert all(s.o_direct and 0 < sum(s.direct_chunks) < s.chunks for s in made)
    _same(files, targets)


@pytest.mark.parametrize("path", ["striped", "staged", "front-to-back"])
def test_a_hash_that_fails_is_a_read_error_not_a_file_taken_as_verified(out, monkeypatch, path):
    """The hash thread raising (a bug, memory) ends the read with an error naming the file: the
    file's streams (or its one reader, feeding a bounded queue) are not left waiting for the hash
    thread, and the file is not taken as verified for want of a digest."""
    module = reader if path == "front-to-back" else striped  # striped.FileRead's hash thread: both paths
    monkeypatch.setattr(staged, "SLOT", 4096)
    monkeypatch.setattr(staged, "DEPTH", 1)
    monkeypatch.setattr(striped, "CHUNK", 4096)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    if path == "staged":
        _staged(monkeypatch)
    real = module.new_hasher

    class Failing:
        def __init__(self, algorithm):
            self.h, self.calls = real(algorithm), 0

        def update(self, data):
            self.calls += 1
            if self.calls == 3:
                raise MemoryError("no memory for the hash")
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(module, "new_hasher", Failing)
    files = _files(out)
    targets = _targets(files)
    if path == "front-to-back":  # a LoRA-padded parameter in every file: each read by one thread
        for f in files:
            t = next(t for t in f.tensors if len(t.shape) == 2)
            targets[t.name] = torch.zeros(t.shape[0] + 8, t.shape[1] + 2, dtype=targets[t.name].dtype)
    algo = read_manifest(out).checksum
    before = set(threading.enumerate())
    with pytest.raises(reader.ReadError, match=r"cannot be verified \(no memory for the hash"):
        reader.read_rank(files, targets, algorithm=algo, threads=2, log=print, label="rank 1")
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("reshard-")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run where one is lent)")
@pytest.mark.parametrize("slot", [staged.SLOT, 4096])
def test_cuda_parameters_get_every_byte_through_page_locked_buffers(clean, monkeypatch, slot):
    """The path as a GPU engine takes it: page-locked buffers, copies on each stream's CUDA stream,
    an event per buffer; every byte on the device once read_rank returns, the checksum verified."""
    monkeypatch.setattr(staged, "SLOT", slot)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    files = _files(clean[1])
    targets = {k: v.cuda() for k, v in _targets(files).items()}
    algo = read_manifest(clean[1]).checksum
    n, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=4, log=print, label="rank 1", direct_reads="1")
    assert bad == [] and n == sum(f.size for f in files)
    _same(files, {k: v.cpu() for k, v in targets.items()})
