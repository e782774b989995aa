"""HubRepo.fetch lands a range's bytes exactly, whichever way each received chunk is copied into the
buffer (numpy from NUMPY_COPY bytes, which lets go of the GIL; a memoryview below)."""

from __future__ import annotations

import os

import pytest

import reshard.sources.hubhttp as hubhttp
from reshard.io.memory import aligned_buffer
from tests.fixtures.hubrun import REPO, serving

MIB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fetch")
    data = os.urandom(3 * MIB + 12345)
    (folder / "blob.bin").write_bytes(data)
    with serving(folder) as server:
        yield server, data


@pytest.mark.parametrize("numpy_from", [1, 1 << 40], ids=["numpy", "memoryview"])
def test_fetched_ranges_are_the_files_bytes(served, monkeypatch, numpy_from):
    import huggingface_hub.constants as constants

    server, data = served
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(hubhttp, "NUMPY_COPY", numpy_from)
    monkeypatch.setenv("RESHARD_HUB_RETRIES", "0")  # a wrong copy fails at once, not after backoffs
    repo = hubhttp.HubRepo(REPO, None)
    buf = aligned_buffer(4 * MIB)
    try:
        for pos, n in ((0, len(data)), (7, 2 * MIB + 3), (len(data) - 100, 100), (MIB, 1)):
            out = memoryview(buf)[4096 : 4096 + n]
            repo.fetch("blob.bin", pos, out)
            assert bytes(out) == data[pos : pos + n]
            del out
    finally:
        buf.close()
