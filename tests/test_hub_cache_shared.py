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
