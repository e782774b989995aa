"""A cached save can fetch a range twice and store it twice in the cache's partial blob (the second copy
over the first): Llama-4's q/k rows not kept in memory, fetched again with the bytes before them in one
request (reshard.sources.hubshare), a read that starts before bytes the blob holds, two reader threads
fetching overlapping bytes at once. The blob is published under the sha256 the save checked, so it must
hold the bytes hashed: every copy stored is fed to the file's PrefixHasher or compared with one that was
(hubshare, hubgroups), and the hasher proves the copies of a byte equal (reshard.sources.hubblob). A
CDN that serves one of the copies wrong is exit 4, nothing published.

In process, against the project's Hub server (tests/fixtures/hubserver.py); the two threads against a
repo of the test's own that says when each answers.
"""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import pytest

from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.sources import hubblob, hubshare
from reshard.sources.hubblob import Blob
from reshard.sources.hubgroups import Groups
from reshard.sources.hubhttp import Meter
from reshard.sources.hubsource import HubReader
from reshard.sources.prefixhash import PrefixHasher
from tests.fixtures.cli import run
from tests.fixtures.hubrun import REPO, rank_bytes
from tests.test_hub_stream_hash import hub, llama4, times_read  # noqa: F401 (fixtures)

FILE = "model.safetensors"


def stored_over(monkeypatch) -> list[tuple[int, int]]:
    """The stores into a blob over bytes it held already, as (start, end), from now on."""
    over: list[tuple[int, int]] = []
    store = Blob.store

    def spy(self: Blob, data: memoryview, pos: int) -> None:
        with self.lock:
            if any(a < pos + len(data) and pos < b for a, b in zip(self.starts, self.ends, strict=True)):
                over.append((pos, pos + len(data)))
        store(self, data, pos)

    monkeypatch.setattr(hubblob.Blob, "store", spy)
    return over


def cache(tmp_path: Path) -> tuple[dict[str, bytes], list[Path]]:
    """The cache's complete weight blobs (name -> bytes), and its partial ones."""
    root = tmp_path / "hf" / "hub"
    done = {p.name: p.read_bytes() for p in root.rglob("blobs/*") if len(p.name) == 64}
    return done, sorted(root.rglob("*.reshard-partial"))


@pytest.fixture
def twice(llama4, hub, monkeypatch):  # noqa: F811
    """The tiny Llama-4 served (each tensor its own request), its q/k rows not kept: the cached save
    fetches some of them again and stores them twice. (server, folder, reference, reads)."""
    src, ref, reads = llama4
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    monkeypatch.setattr(hubshare, "KEEP", 0)
    return hub(src), src, ref, reads


def test_bytes_stored_twice_honestly_are_published_as_the_file(twice, monkeypatch, tmp_path):
    _, src, ref, _ = twice
    over = stored_over(monkeypatch)
    code, _, err = run("save", REPO, str(tmp_path / "out"), "--tp", "4")
    assert code == 0, err
    assert over  # the premise: bytes of the blob written twice in one run
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    data = (src / FILE).read_bytes()
    assert cache(tmp_path) == ({hashlib.sha256(data).hexdigest(): data}, [])


@pytest.mark.parametrize("lie", ["first", "again"])
def test_bytes_stored_twice_served_wrong_once_are_exit_4_and_not_published(twice, monkeypatch, tmp_path, lie):
    """The CDN flips the bytes of each request that holds bytes the save reads twice, the first time it
    serves them (the blob would hold the honest copy over a wrong one hashed), or the bytes it served
    before, and those only, of each request that holds some (a wrong copy over the honest one hashed)."""
    server, src, _, reads = twice
    shared = times_read(src / FILE, reads)
    served = bytearray(len(shared))
    lies: list[tuple[int, int]] = []
    over = stored_over(monkeypatch)

    def corrupt(name: str, start: int, end: int) -> bool | tuple[int, int]:
        before = [i for i in range(start, end) if served[i]]
        served[start:end] = b"\x01" * (end - start)
        if lie == "again" and before:
            lies.append((before[0], before[-1] + 1))
            return lies[-1]
        if lie == "first" and not before and max(shared[start:end], default=0) > 1:
            lies.append((start, end))
            return True
        return False

    server.corrupt = corrupt
    code, out, err = run("save", REPO, str(tmp_path / "out"), "--tp", "4")
    assert lies and any(a < e and s < b for a, b in lies for s, e in over)  # the premise: a wrong copy stored twice
    assert (code, out) == (4, ""), err
    [line] = err.splitlines()
    assert line.startswith(f"reshard: error: {REPO}/{FILE}@{server.sha[:12]}: ") and "nothing was published" in line
    assert not (tmp_path / "out").exists()
    assert cache(tmp_path)[0] == {}  # no blob under the file's sha256: the next run hashes what the partial holds


# ---- two reader threads fetching the same bytes at once --------------------------------------------------------


class Racing:
    """A Hub repo of one file, `data`, that answers thread "b" once thread "a" has its answer, fed it to the hash
    and stored it, and serves `wrong` ("a" or "b") bits flipped."""

    def __init__(self, data: bytes, wrong: str | None) -> None:
        self.data, self.wrong, self.meter = data, wrong, Meter()
        self.b_asked, self.a_done = threading.Event(), threading.Event()
        self.asked: list[str] = []

    def where(self, name: str) -> str:
        return name

    def fetch(self, name: str, pos: int, out: memoryview, count=None) -> None:
        me = threading.current_thread().name
        self.asked.append(me)
        if me == "a":
            assert self.b_asked.wait(5)
        elif me == "b":
            self.b_asked.set()
            assert self.a_done.wait(5)
        data = self.data[pos : pos + len(out)]
        out[:] = bytes(x ^ 1 for x in data) if me == self.wrong else data


@pytest.mark.parametrize("wrong", [None, "a", "b"], ids=["honest", "hashed-copy-wrong", "stored-last-wrong"])
def test_two_threads_fetching_the_same_bytes_at_once_leave_the_blob_as_hashed(tmp_path, wrong):
    """Both threads find the bytes not in the blob and fetch them; "a" stores and hashes its copy first, then
    "b" stores its copy over it: a copy served wrong is a SourceError before the blob could be renamed into
    place (`HubSource.finish` does what the end of this test does), not a blob that holds unhashed bytes."""
    data = random.Random(0).randbytes(64 * 1024)
    final = tmp_path / hashlib.sha256(data).hexdigest()
    blob, hasher = Blob(final, len(data)), PrefixHasher(len(data), FILE)
    hasher.feed(0, data[:100])
    blob.put_head(data[:100])
    t = TensorInfo("t", "U8", (len(data) - 100,), FILE, 100, len(data) - 100)
    repo = Racing(data, wrong)
    reader = HubReader(repo, {FILE: blob}, Groups({}), {FILE: hasher})  # type: ignore[arg-type]
    failed: list[BaseException] = []

    def read() -> None:
        try:
            reader.read(t, 0, t.nbytes)
        except SourceError as e:
            failed.append(e)
        finally:
            if threading.current_thread().name == "a":
                repo.a_done.set()

    threads = [threading.Thread(target=read, name=name) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(repo.asked) == ["a", "b"] and not failed  # the premise: both fetched, stored, fed
    try:
        got = hasher.rest(lambda pos, buf: blob.pread(buf, pos))
    except SourceError as e:
        assert "the download served other bytes for bytes 0-65536" in str(e)
        got = None
    finally:
        blob.close()
    assert (got == final.name) == (wrong is None)  # a wrong sha256 is exit 4 too (`HubSource._verify`)
    if got == final.name:
        assert blob.partial.read_bytes() == data
