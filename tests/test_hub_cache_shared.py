"""Two runs reading one commit into one Hugging Face cache at once (the processes of a torchrun save,
`--ranks` pieces on one machine, two saves): one fills each partial blob, the other stores nothing of
that file and checks what it reads as `--stream` does (reshard.sources.hubblob). In process, against the
project's Hub server (tests/fixtures/hubserver.py), huggingface_hub pointed at a cache of the test's own.
"""

from __future__ import annotations

import hashlib

import pytest

from reshard.errors import SourceError
from reshard.sources import open_source
from tests.fixtures.hubrun import REPO, serving, tiny_with_reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_with_reference(tmp_path_factory.mktemp("hubshared"), shards=2)[0]


@pytest.fixture
def hub(checkpoint, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("RESHARD_HUB_BACKOFF", "0.01")
    monkeypatch.setenv("RESHARD_HUB_RETRIES", "1")
    monkeypatch.setenv("RESHARD_HUB_TIMEOUT", "2")  # how long a run waits for another that stores nothing more
    with serving(checkpoint) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        yield server


def read_all(source, reader) -> None:
    try:
        for t in source.checkpoint.tensors.values():
            reader.read(t, 0, t.nbytes)
    finally:
        reader.close()


def weight_blobs(tmp_path) -> dict[str, str]:
    """Each complete weight blob's name -> the sha256 of its bytes."""
    blobs = (tmp_path / "hf" / "hub").rglob("blobs/*")
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in blobs if len(p.name) == 64}


def test_a_run_never_writes_into_a_blob_another_run_fills(hub, tmp_path):
    """Runs A and B open the commit together. A reads everything and publishes the blobs; then the CDN
    lies to B. B must not have written what it got into A's blob (by then `blobs/<sha256>`, published
    and linked): B fails (exit 4) and the cache still holds the Hub's bytes under their sha256."""
    a, b = open_source(REPO), open_source(REPO)
    reader_a, reader_b = a.open_reader(), b.open_reader()  # A's blobs, being filled when B opens them
    read_all(a, reader_a)
    a.finish()
    published = weight_blobs(tmp_path)
    assert len(published) == 2 and all(name == digest for name, digest in published.items())
    hub.corrupt = lambda name, start, end: True
    read_all(b, reader_b)
    with pytest.raises(SourceError, match="is not the LFS sha256 the Hub commits to"):
        b.finish()
    assert weight_blobs(tmp_path) == published


def test_two_runs_filling_one_cache_both_check_every_file_and_leave_it_complete(hub, tmp_path):
    a, b = open_source(REPO), open_source(REPO)
    reader_a, reader_b = a.open_reader(), b.open_reader()
    read_all(a, reader_a)
    read_all(b, reader_b)
    b.finish()  # B first: it stored nothing and must not rename A's partial blobs
    a.finish()
    for run in (a, b):
        assert [r.check for r in run.checkpoint.checked] == ["hub-lfs-sha256 verified"] * 2
        assert [r.name for r in run.checkpoint.checked] == run.checkpoint.files
    blobs = weight_blobs(tmp_path)
    assert len(blobs) == 2 and all(name == digest for name, digest in blobs.items())
    assert not list((tmp_path / "hf").rglob("*.reshard-partial"))


def read_half(source, reader) -> list:
    """Every other tensor read (a run whose ranks need only some of each file); those not read."""
    tensors = sorted(source.checkpoint.tensors.values(), key=lambda t: (t.file, t.offset))
    try:
        for t in tensors[::2]:
            reader.read(t, 0, t.nbytes)
    finally:
        reader.close()
    return tensors[1::2]


@pytest.mark.parametrize("changed", [False, True], ids=["published", "changed-after"])
def test_a_run_reads_the_rest_of_a_file_another_run_fills_from_its_published_blob(hub, tmp_path, monkeypatch, changed):
    """B stores nothing of the files A fills and reads only half their tensors; for their sha256 it reads the
    rest from the blobs A publishes, not from the Hub again: once A has finished, B's `finish` downloads
    nothing. B still checks every file against the LFS sha256: a byte of A's blob changed after A published
    it, where B read nothing, is exit 4."""
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")  # each tensor its own range: the unread ones not fetched with others
    a, b = open_source(REPO), open_source(REPO)
    reader_a, reader_b = a.open_reader(), b.open_reader()
    read_all(a, reader_a)
    unread = read_half(b, reader_b)
    a.finish()
    if changed:
        t = unread[0]
        blob = next(
            p
            for p in (tmp_path / "hf" / "hub").rglob("blobs/*")
            if len(p.name) == 64 and t.file in b.others and b.others[t.file].final == p
        )
        data = bytearray(blob.read_bytes())
        data[t.offset] ^= 1
        blob.write_bytes(bytes(data))
    served = hub.served
    if changed:
        with pytest.raises(SourceError, match="is not the LFS sha256 the Hub commits to"):
            b.finish()
    else:
        b.finish()
        assert [r.check for r in b.checkpoint.checked] == ["hub-lfs-sha256 verified"] * 2
    assert hub.served == served
