"""`hash_fd(direct=True)`: a cold file hashed through O_DIRECT reads a thread keeps in flight
(`reshard.io.direct.blocks`) gives the digest of exactly the bytes the page-cache path hashes."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from pathlib import Path

import pytest

from reshard import hashing
from reshard.io import direct
from reshard.io.memory import ALIGN
from tests.fixtures.odirect import direct_io_works

BLOCK = 2 * ALIGN


@pytest.fixture
def small_direct(monkeypatch):
    monkeypatch.setattr(hashing, "DIRECT_MIN", 0)


def _direct_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    """A file of `size` random bytes on a file system that takes O_DIRECT reads (else the test is skipped)."""
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    if not direct_io_works(path):
        pytest.skip("this file system takes no O_DIRECT reads")
    return path, data


def _digest(path: Path, algorithm: str, **kw) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hashing.hash_fd(fd, algorithm, block=BLOCK, **kw)
    finally:
        os.close(fd)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("size", [1, ALIGN - 1, ALIGN, BLOCK, 5 * BLOCK, 5 * BLOCK + 7, 17 * ALIGN + 3])
@pytest.mark.parametrize("limit", [None, "size", "less", "more"])
def test_direct_and_cached_digests_agree(tmp_path, small_direct, algorithm, size, limit):
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    n = {None: None, "size": size, "less": max(0, size - ALIGN - 5), "more": size + 3 * ALIGN}[limit]
    want = hashing.new_hasher(algorithm)
    want.update(data if n is None else data[:n])
    got = _digest(path, algorithm, limit=n, direct=True)
    assert got == want.hexdigest() == _digest(path, algorithm, limit=n)


def test_the_direct_path_is_taken_and_stops_its_reader(tmp_path, small_direct, monkeypatch):
    path, data = _direct_file(tmp_path, 9 * BLOCK + 11)
    seen = []
    real = direct.blocks

    def spy(*a, **k):
        for v in real(*a, **k):
            seen.append(len(v))
            yield v

    monkeypatch.setattr(direct, "blocks", spy)
    assert _digest(path, "sha256", direct=True) == hashlib.sha256(data).hexdigest()
    assert sum(seen) == len(data) and max(seen) == BLOCK
    # a consumer that stops early: the reading thread ends with it
    fd = os.open(path, os.O_RDONLY)
    try:
        assert direct.enable(fd)
        it = real(fd, 0, None, BLOCK)
        assert bytes(next(it)) == data[:BLOCK]
        it.close()
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t.name == "reshard-direct-read"]


def test_o_direct_refused_mid_file_goes_on_through_the_cache(tmp_path, small_direct, monkeypatch):
    path, data = _direct_file(tmp_path, 6 * BLOCK + 100)
    real = os.preadv
    refused = []

    def preadv(fd, buffers, offset, *flags):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= 3 * BLOCK:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(direct.os, "preadv", preadv)
    for limit in (None, len(data), len(data) - 50):
        refused.clear()
        want = hashlib.sha256(data if limit is None else data[:limit]).hexdigest()
        assert _digest(path, "sha256", limit=limit, direct=True) == want and refused


def test_an_unaligned_position_hashes_through_the_cache(tmp_path, small_direct):
    data = os.urandom(3 * BLOCK)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 5, os.SEEK_SET)
        assert hashing.hash_fd(fd, "sha256", block=BLOCK, direct=True) == hashlib.sha256(data[5:]).hexdigest()
    finally:
        os.close(fd)
