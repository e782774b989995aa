"""Shares (reshard.sources.hubshare): bytes that several reads use are fetched once, from any number of
threads, and hashed once; the file's sha256 comes out right with no second pass over it; where the
bytes cannot be kept, the reads after the first fetch them again and must match the first fetch."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from reshard.errors import SourceError
from reshard.sources import hubshare
from reshard.sources.hubshare import Shares
from reshard.sources.prefixhash import PrefixHasher

DATA = random.Random(1).randbytes(64 * 1024)
SHA = hashlib.sha256(DATA).hexdigest()
FILE = "model.safetensors"


class Fetch:
    """`get` over DATA, counting each byte it serves; `lie(pos, n, again)` says which requests it
    serves with bits flipped (`again`: the request holds a byte it served before)."""

    def __init__(self, lie=None) -> None:
        self.times = bytearray(len(DATA))
        self.lie = lie

    def __call__(self, file: str, pos: int, out: memoryview) -> None:
        assert file == FILE
        again = any(self.times[pos : pos + len(out)])
        for i in range(pos, pos + len(out)):
            self.times[i] += 1
        data = DATA[pos : pos + len(out)]
        if self.lie is not None and self.lie(pos, len(out), again):
            data = bytes(b ^ 0x01 for b in data)
        out[:] = data


def rest(pos: int, out: memoryview) -> None:
    out[:] = DATA[pos : pos + len(out)]


def reads(seed: int, n: int = 300) -> list[tuple[int, int]]:
    """`n` reads over DATA: Llama-4's even and odd rows of a head (overlapping), the same read again
    (a KV head on two ranks), and reads alone."""
    r = random.Random(seed)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        a = r.randrange(len(DATA) - 2000)
        n_ = r.choice((1, 64, 1000))
        out += r.choice(([(a, a + n_)], [(a, a + n_), (a + 1, a + n_ + 1)], [(a, a + n_)] * 3))
    return out


def union(rs: list[tuple[int, int]]) -> int:
    seen = bytearray(len(DATA))
    for a, b in rs:
        seen[a:b] = b"\x01" * (b - a)
    return sum(seen)


def save(shares: Shares, rs: list[tuple[int, int]], get: Fetch, hasher: PrefixHasher, threads: int = 8) -> None:
    """Every read made (at most `threads` at once, as the prefetcher makes them) and checked."""

    def one(r: tuple[int, int]) -> None:
        out = memoryview(bytearray(r[1] - r[0]))
        shares.read(FILE, r[0], out, get, hasher.feed)
        assert out == DATA[r[0] : r[1]]

    shares.plan((FILE, a, b) for a, b in rs)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, rs))


def test_the_spans_are_the_bytes_two_reads_or_more_cover_cut_at_every_bound():
    shares = Shares()
    shares.plan([(FILE, 0, 10), (FILE, 5, 15), (FILE, 10, 20), (FILE, 30, 40), (FILE, 30, 40), (FILE, 50, 60)])
    shares.plan([("other", 0, 10)])
    starts, spans = shares.files[FILE]
    assert [(s.start, s.end, s.users) for s in spans] == [(5, 10, 2), (10, 15, 2), (30, 40, 2)]
    assert starts == [5, 10, 30] and "other" not in shares.files


@pytest.mark.parametrize("seed", range(4))
def test_overlapping_reads_from_threads_fetch_each_byte_once_and_hash_once(seed):
    rs = reads(seed)
    get, hasher, shares = Fetch(), PrefixHasher(len(DATA)), Shares()
    save(shares, rs, get, hasher)
    assert max(get.times) == 1 and sum(get.times) == union(rs)
    assert hasher.behind == []  # nothing fed twice: no second pass over the file
    left = Fetch()
    assert hasher.rest(lambda pos, out: left(FILE, pos, out)) == SHA
    assert sum(left.times) == len(DATA) - union(rs)  # `rest` reads only what no read used
    assert shares.kept == 0  # each span's bytes dropped after its last read


@pytest.mark.parametrize("seed", range(2))
def test_spans_not_kept_are_fetched_again_checked_and_not_hashed_again(monkeypatch, seed):
    monkeypatch.setattr(hubshare, "KEEP", 0)
    rs = reads(seed)
    get, hasher = Fetch(), PrefixHasher(len(DATA))
    save(Shares(), rs, get, hasher)
    assert sum(get.times) == sum(b - a for a, b in rs)  # each read fetched its bytes
    assert hasher.behind == [] and hasher.rest(rest) == SHA


def test_a_span_served_other_bytes_when_fetched_again_is_a_source_error(monkeypatch):
    monkeypatch.setattr(hubshare, "KEEP", 0)
    rs = [(100, 1100), (101, 1101)]  # a head's even rows, then its odd rows
    get = Fetch(lie=lambda pos, n, again: again)
    with pytest.raises(SourceError, match=r"^x: the download served other bytes for bytes 101-1100 than it served"):
        save(Shares(lambda file: "x"), rs, get, PrefixHasher(len(DATA)), threads=1)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "fetched-again"])
def test_a_span_served_other_bytes_the_first_time_fails_the_hash_or_the_check(monkeypatch, keep):
    """The first fetch is the one hashed: served wrong once and right after, the run fails either way."""
    if not keep:
        monkeypatch.setattr(hubshare, "KEEP", 0)
    rs = [(100, 1100), (101, 1101)]
    get, hasher, shares = Fetch(lie=lambda pos, n, again: not again), PrefixHasher(len(DATA)), Shares()
    shares.plan((FILE, a, b) for a, b in rs)
    out = memoryview(bytearray(1000))
    shares.read(FILE, 100, out, get, hasher.feed)
    if keep:
        shares.read(FILE, 101, out, get, hasher.feed)  # the kept (wrong) bytes: nothing fetched again
        assert sum(get.times) == 1001
        assert hasher.rest(rest) != SHA
    else:
        with pytest.raises(SourceError, match="the download served other bytes for bytes 101-1100"):
            shares.read(FILE, 101, out, get, hasher.feed)


def test_a_failed_first_fetch_leaves_the_span_to_the_next_read():
    rs = [(100, 1100), (101, 1101)]
    fails = [True]

    def get(file: str, pos: int, out: memoryview) -> None:
        if fails.pop() if fails else False:
            raise SourceError("dropped")
        out[:] = DATA[pos : pos + len(out)]

    hasher, shares = PrefixHasher(len(DATA)), Shares()
    shares.plan((FILE, a, b) for a, b in rs)
    with pytest.raises(SourceError, match="dropped"):
        shares.read(FILE, 100, memoryview(bytearray(1000)), get, hasher.feed)
    out = memoryview(bytearray(1000))
    shares.read(FILE, 101, out, get, hasher.feed)  # fetches the span itself (and hashes it)
    assert out == DATA[101:1101]
    out = memoryview(bytearray(1000))
    shares.read(FILE, 100, out, get, hasher.feed)  # the read made again: its own byte fetched
    assert out == DATA[100:1100] and hasher.behind == [] and hasher.rest(rest) == SHA


def test_a_read_the_plan_did_not_foresee_is_fetched_and_fed_as_before():
    """One that cuts a span (or lies in none) is fetched whole and fed: prefixhash vouches for it."""
    get, hasher, shares = Fetch(), PrefixHasher(len(DATA)), Shares()
    shares.plan([(FILE, 100, 1100), (FILE, 101, 1101)])
    for a, b in [(100, 1100), (500, 600), (101, 1101), (3000, 3100)]:
        out = memoryview(bytearray(b - a))
        shares.read(FILE, a, out, get, hasher.feed)
        assert out == DATA[a:b]
    assert hasher.rest(rest) == SHA
