"""Bytes read ahead of a file's sha256 wait on disk (reshard.sources.spill) rather than being fetched again:
a `--stream` save of an MoE (experts stored by name, read by number) downloads each byte once, within
RESHARD_STREAM_SPILL; the start-of-run estimate (`prefixhash.taken_again`) counts the spill exactly; a
spill that cannot be written, or a temp folder in memory, falls back to fetching again."""

from __future__ import annotations

import hashlib
import random
import resource
import signal
import tempfile
from pathlib import Path

import pytest

from reshard.console import human_bytes
from reshard.sources import prefixhash, spill
from reshard.sources.prefixhash import PrefixHasher, taken_again
from reshard.sources.spill import Spill
from tests.fixtures.cli import run
from tests.fixtures.hubrun import REPO, rank_bytes
from tests.test_hub_stream_hash import hub  # noqa: F401  (the fixture)


def shuffled(size: int, n: int, swaps: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, size), n))
    order = list(zip([0, *cuts], [*cuts, size], strict=True))
    for _ in range(swaps):
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        order[i], order[j] = order[j], order[i]
    return order


@pytest.mark.parametrize("limit", [None, 8 << 10])
@pytest.mark.parametrize("budget", [0, 64 << 10, 256 << 10, 4 << 20])
def test_a_hasher_with_a_spill_takes_in_again_what_taken_again_says(monkeypatch, tmp_path, budget, limit):
    """Out-of-order ranges fed to a hasher that holds `limit` (default PENDING, 32 KiB here) in memory, spills up
    to `budget`, then holds up to PENDING in memory: the digest is the file's, the bytes `rest` reads again are
    exactly `taken_again(..., spill=budget)`, the spill never holds more than its budget, and its files are gone
    at `close`."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(prefixhash, "PENDING", 32 << 10)
    rng = random.Random(budget)
    size = 1 << 20
    for trial in range(8):
        order = shuffled(size, 200, 40 * trial, rng)
        data = rng.randbytes(size)
        taken = []

        def read(pos, out, data=data, taken=taken):
            out[:] = data[pos : pos + len(out)]
            taken.append(len(out))

        store = Spill(budget)
        hasher = PrefixHasher(size, "f", pending=limit, spill=store)
        for a, b in order:
            hasher.feed(a, data[a:b])
            assert store.used <= budget and hasher.held <= prefixhash.PENDING
        assert hasher.rest(read) == hashlib.sha256(data).hexdigest()
        assert sum(taken) == taken_again((("f", a, b) for a, b in order), limit, spill=budget)
        if trial and budget >= size:
            assert not taken  # everything waited on disk
        store.close()
        assert not list(tmp_path.iterdir())


def test_spilled_bytes_are_the_bytes_used(monkeypatch, tmp_path):
    """A range spilled with other bytes than the file's (a CDN's lie on the only fetch) gives a wrong sha256:
    the hash reads the spill back, not the file again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(prefixhash, "PENDING", 0)
    data = random.Random(1).randbytes(1 << 16)
    store = Spill(1 << 20)
    hasher = PrefixHasher(len(data), "f", spill=store)
    lie = bytearray(data[40000:50000])
    lie[7] ^= 1
    hasher.feed(40000, lie)  # ahead of the hash: spilled
    assert store.used == len(lie)
    hasher.feed(0, data[:40000])
    assert hasher.rest(lambda pos, out: out.__setitem__(slice(None), data[pos : pos + len(out)])) != (
        hashlib.sha256(data).hexdigest()
    )
    store.close()


def test_a_spill_that_cannot_be_written_falls_back_to_fetching_again(monkeypatch, tmp_path):
    """A write past the disk's room (here the process's file-size limit: EFBIG, as ENOSPC) ends spilling:
    what was not kept is read again by `rest`, and the digest is right."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(prefixhash, "PENDING", 0)
    rng = random.Random(3)
    data = rng.randbytes(1 << 20)
    order = shuffled(len(data), 100, 400, rng)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, old[1]))
    try:
        store = Spill(8 << 20)
        hasher = PrefixHasher(len(data), "f", spill=store)
        for a, b in order:
            hasher.feed(a, data[a:b])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert store.broken and store.peak
    taken = []

    def read(pos, out):
        out[:] = data[pos : pos + len(out)]
        taken.append(len(out))

    assert hasher.rest(read) == hashlib.sha256(data).hexdigest()
    assert sum(taken) > len(data) // 4
    store.close()
    assert not list(tmp_path.iterdir())


def test_a_temp_folder_in_memory_spills_nothing(monkeypatch):
    if spill.filesystem("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")
    budget, why = spill.usable(8 << 30)
    assert budget == 0 and "set TMPDIR to a folder on disk" in why
    monkeypatch.setattr(tempfile, "tempdir", str(Path(__file__).parent))
    assert spill.usable(8 << 30)[0] > 0 and spill.usable(0) == (0, None)


@pytest.fixture
def moe(tmp_path):
    from tests.fixtures.saving import save
    from tests.fixtures.tiny import make_tiny

    src = make_tiny("qwen3-moe", tmp_path / "src")
    save(str(src), tmp_path / "ref", tp=2)
    return src, tmp_path / "ref", sum(f.stat().st_size for f in src.glob("*.safetensors"))


def stream(hub, src, out: Path, monkeypatch, spill_bytes: str | None) -> tuple[int, list[str]]:  # noqa: F811
    """`save REPO --tp 2 --stream` of `src` with a 64 KiB hash buffer, reads fed in order: bytes fetched again
    (served beyond the file) and the --stream notes."""
    monkeypatch.setenv("RESHARD_HUB_CONNECTIONS", "1")
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    monkeypatch.setattr(prefixhash, "PENDING", 64 * 1024)
    if spill_bytes is None:
        monkeypatch.delenv("RESHARD_STREAM_SPILL", raising=False)
    else:
        monkeypatch.setenv("RESHARD_STREAM_SPILL", spill_bytes)
    server = hub(src)
    code, _, err = run("save", REPO, str(out), "--tp", "2", "--stream")
    assert code == 0, err
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    return server.served - size, [line for line in err.splitlines() if line.startswith("note: --stream: ")]


def test_an_moe_streamed_out_of_file_order_fetches_each_byte_once(hub, moe, monkeypatch, tmp_path):  # noqa: F811
    """The tiny Qwen3-MoE, its experts stored by name and read by number: with the default spill every byte is
    served once, nothing is told, the rank files are the folder save's, and no spill is left in TMPDIR.
    With less spill than it needs, it fetches again exactly what its note says, less than with none."""
    src, ref, size = moe
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    none, told = stream(hub, src, tmp_path / "none", monkeypatch, "0")
    assert none > size // 4 and len(told) == 1  # the premise: without a spill, much is fetched again
    again, told = stream(hub, src, tmp_path / "out", monkeypatch, None)
    assert (again, told) == (0, [])
    assert rank_bytes(tmp_path / "out") == rank_bytes(ref)
    some, told = stream(hub, src, tmp_path / "some", monkeypatch, str(none // 64))
    assert 0 < some < none and len(told) == 1
    assert f"about {human_bytes(some)} of its " in told[0] and "at most " in told[0]
    assert rank_bytes(tmp_path / "some") == rank_bytes(ref)
    assert not list(tmp.iterdir())
    blocked = tmp_path / "a-file"  # a temp folder where nothing can be made: fetched again as without a spill
    blocked.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))
    again, told = stream(hub, src, tmp_path / "blocked", monkeypatch, None)
    assert again == none and rank_bytes(tmp_path / "blocked") == rank_bytes(ref)
    assert [line.split(" (")[0] for line in told] == [
        f"note: --stream: cannot keep bytes waiting for the sha256 on disk in {blocked}"
    ]
