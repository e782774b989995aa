"""PrefixHasher (reshard.sources.prefixhash): the sha256 of a file fed in any order is the sha256 of the
bytes that were fed, and every byte fed is either hashed or proven equal to a byte that was; the bytes
`rest` reads are only those never fed (a second pass over the file only for a range fed after the hash
had passed it)."""

from __future__ import annotations

import hashlib
import random

import pytest

from reshard.errors import SourceError
from reshard.sources import prefixhash
from reshard.sources.prefixhash import PrefixHasher

DATA = random.Random(0).randbytes(64 * 1024)
SHA = hashlib.sha256(DATA).hexdigest()


class Reads:
    """`rest`'s reader over `data`, counting the bytes it reads."""

    def __init__(self, data: bytes = DATA) -> None:
        self.data = data
        self.bytes = 0

    def __call__(self, pos: int, out: memoryview) -> None:
        out[:] = self.data[pos : pos + len(out)]
        self.bytes += len(out)


def lie(data: bytes) -> bytes:
    return bytes(b ^ 0x01 for b in data)


def ranges(seed: int, n: int = 200) -> list[tuple[int, int]]:
    """`n` ranges over DATA, some overlapping, some repeated, not all of it covered."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a = r.randrange(len(DATA))
        out.append((a, min(len(DATA), a + r.choice((1, 7, 100, 1000, 5000)))))
    return out


@pytest.mark.parametrize("pending", [0, 3000, 1 << 30])
@pytest.mark.parametrize("seed", range(5))
def test_any_order_any_overlap_hashes_to_the_files_sha256(monkeypatch, seed, pending):
    monkeypatch.setattr(prefixhash, "PENDING", pending)
    h = PrefixHasher(len(DATA))
    for a, b in ranges(seed):
        h.feed(a, memoryview(DATA)[a:b])
    assert h.rest(Reads()) == SHA


def test_in_order_reads_need_no_read_at_the_end():
    h, reads = PrefixHasher(len(DATA)), Reads()
    for a in range(0, len(DATA), 1000):
        h.feed(a, DATA[a : a + 1000])
    assert (h.rest(reads), reads.bytes) == (SHA, 0)


def test_held_ranges_are_hashed_from_their_own_bytes_and_only_gaps_are_read():
    """An unused range first (never fed), then used ones held: `rest` reads the gap only, and hashes
    what was held, so bytes that were used wrong cannot hash right (they were once read again)."""
    h, reads = PrefixHasher(len(DATA)), Reads()
    h.feed(0, DATA[:100])
    h.feed(1000, DATA[1000:])
    assert (h.rest(reads), reads.bytes) == (SHA, 900)

    h = PrefixHasher(len(DATA))
    h.feed(0, DATA[:100])
    h.feed(1000, lie(DATA[1000:2000]))
    h.feed(2000, DATA[2000:])
    assert h.rest(Reads()) != SHA


def test_a_range_too_far_ahead_to_hold_must_equal_its_bytes_read_again(monkeypatch):
    monkeypatch.setattr(prefixhash, "PENDING", 1000)
    h, reads = PrefixHasher(len(DATA), "acme/x/model.safetensors@0123"), Reads()
    h.feed(0, DATA[:100])
    h.feed(1000, DATA[1000:1500])  # held
    h.feed(5000, DATA[5000:20000])  # too large to hold: its digest kept
    assert (h.rest(reads), reads.bytes) == (SHA, len(DATA) - 100 - 500)

    h = PrefixHasher(len(DATA), "acme/x/model.safetensors@0123")
    h.feed(0, DATA[:100])
    h.feed(5000, lie(DATA[5000:20000]))
    with pytest.raises(SourceError) as e:
        h.rest(Reads())  # honest now: the bytes used were other bytes
    assert str(e.value) == (
        "acme/x/model.safetensors@0123: the download served other bytes for bytes 5000-20000 than it served before "
        "(run again later; if it persists, the Hub's CDN serves a changed file: report it (nothing was published))"
    )
    assert e.value.exit_code == 4


def test_a_second_range_at_a_held_offset_is_checked_too():
    h = PrefixHasher(len(DATA))
    h.feed(1000, DATA[1000:2000])
    h.feed(1000, lie(DATA[1000:1500]))
    with pytest.raises(SourceError, match="other bytes for bytes 1000-1500 "):
        h.feed(0, DATA[:1000])


def test_a_held_range_overtaken_by_another_read_is_compared_with_it():
    h = PrefixHasher(len(DATA))
    h.feed(1000, lie(DATA[1000:2000]))
    with pytest.raises(SourceError, match="other bytes for bytes 1000-1500 "):
        h.feed(0, DATA[:1500])

    h = PrefixHasher(len(DATA))
    h.feed(1000, DATA[1000:2000])
    h.feed(0, DATA[:1500])  # the held range's end is hashed from its own bytes
    assert h.rest(Reads()) == SHA


def test_a_range_fed_after_the_hash_passed_it_costs_a_second_pass_that_must_agree():
    h, reads = PrefixHasher(len(DATA)), Reads()
    h.feed(0, DATA[:5000])
    h.feed(1000, DATA[1000:2000])  # read again (the same bytes)
    assert (h.rest(reads), reads.bytes) == (SHA, (len(DATA) - 5000) + len(DATA))

    h = PrefixHasher(len(DATA))
    h.feed(0, DATA[:5000])
    h.feed(1000, lie(DATA[1000:2000]))  # used, never hashed
    with pytest.raises(SourceError, match="other bytes for bytes 1000-2000 "):
        h.rest(Reads())

    h = PrefixHasher(len(DATA))
    h.feed(0, DATA[:5000])
    h.feed(1000, DATA[1000:2000])
    other = DATA[:3000] + lie(DATA[3000:3001]) + DATA[3001:]  # what the second pass is served
    second = []

    def read(pos: int, out: memoryview) -> None:
        second.append(pos == 0 or bool(second and second[-1]))  # the second pass starts at 0
        out[:] = (other if second[-1] else DATA)[pos : pos + len(out)]

    with pytest.raises(SourceError, match=f"other bytes for bytes 0-{len(DATA)} "):
        h.rest(read)


def test_memory_held_is_bounded(monkeypatch):
    monkeypatch.setattr(prefixhash, "PENDING", 4096)
    h = PrefixHasher(len(DATA))
    for a in range(len(DATA) - 1000, 1000, -1000):  # backwards: nothing can be hashed until the start
        h.feed(a, DATA[a : a + 1000])
        assert h.held <= 4096
    assert h.rest(Reads()) == SHA


def test_random_lies_are_never_hashed_right(monkeypatch):
    """Random reads, one of them served wrong: whatever the order, the digest is wrong or the check
    fails; never SHA."""
    monkeypatch.setattr(prefixhash, "PENDING", 3000)
    for seed in range(20):
        rs = ranges(seed, 60)
        bad = random.Random(seed).randrange(len(rs))
        h = PrefixHasher(len(DATA))
        try:
            for i, (a, b) in enumerate(rs):
                h.feed(a, lie(DATA[a:b]) if i == bad else DATA[a:b])
            got = h.rest(Reads())
        except SourceError:
            continue
        assert got != SHA, seed


def test_feeds_from_threads(monkeypatch):
    import threading

    monkeypatch.setattr(prefixhash, "PENDING", 8192)
    h = PrefixHasher(len(DATA))
    order = list(range(0, len(DATA), 512))
    random.Random(1).shuffle(order)
    parts = [order[i::4] for i in range(4)]
    threads = [threading.Thread(target=lambda p=p: [h.feed(a, DATA[a : a + 512]) for a in p]) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.rest(Reads()) == SHA


@pytest.mark.parametrize("pending", [0, 3000, 1 << 30])
def test_another_hash_and_error_are_taken_as_given(monkeypatch, pending):
    """A bucket output's rank file is hashed with its manifest's algorithm (BLAKE3 by default) and a failed
    comparison is its source's error (exit 7): the same custody, the hash and the error given."""
    from reshard.errors import CorruptError
    from reshard.hashing import hash_bytes, new_hasher

    def fail(where: str, start: int, end: int) -> CorruptError:
        return CorruptError(f"{where} {start}-{end}")

    monkeypatch.setattr(prefixhash, "PENDING", pending)
    h = PrefixHasher(len(DATA), "f", lambda: new_hasher("blake3"), fail)
    for a, b in ranges(1):
        h.feed(a, memoryview(DATA)[a:b])
    assert h.rest(Reads()) == hash_bytes(DATA, "blake3")

    h = PrefixHasher(len(DATA), "f", lambda: new_hasher("blake3"), fail)
    h.feed(0, DATA[:100])
    h.feed(5000, lie(DATA[5000:20000]))
    if pending >= 15000:  # held: hashed from the bytes used, so the digest is not the file's
        assert h.rest(Reads()) == hash_bytes(DATA[:5000] + lie(DATA[5000:20000]) + DATA[20000:], "blake3")
        return
    with pytest.raises(CorruptError) as e:
        h.rest(Reads())
    assert (str(e.value).split(" (")[0], e.value.exit_code) == ("f 5000-20000", 7)


def test_a_bucket_sources_files_share_one_bound_of_held_bytes(monkeypatch):
    """A re-shard from a bucket reads all its rank files at once: their hashers together hold at most
    PENDING bytes out of order (each its share), not PENDING each; what does not fit is claimed and
    still vouched for (the right digest passes, bytes served otherwise fail)."""
    from types import SimpleNamespace

    from reshard.errors import CorruptError
    from reshard.hashing import hash_bytes
    from reshard.sources.bucket_custody import Custody

    monkeypatch.setattr(prefixhash, "PENDING", 4096)
    rng = random.Random(3)
    data = {f"f{i}": rng.randbytes(8192) for i in range(4)}
    files = [SimpleNamespace(name=n, size=len(b), digest=hash_bytes(b, "blake3")) for n, b in data.items()]
    custody = Custody(files, set(data), "blake3", str, "hint")
    for name, b in data.items():
        custody.feed(name, 2048, b[2048:5120])  # 3 KiB ahead of the hash, in each file
    assert sum(h.held for h in custody.hashers.values()) <= 4096
    assert sum(len(h.claims) for h in custody.hashers.values()) == 4
    for name, h in custody.hashers.items():
        assert h.rest(lambda pos, buf, b=data[name]: buf.__setitem__(slice(None), b[pos : pos + len(buf)])) == next(
            f.digest for f in files if f.name == name
        )
    lying = Custody(files, set(data), "blake3", str, "hint")
    for name, b in data.items():
        lying.feed(name, 2048, b[2048:5120])
    with pytest.raises(CorruptError, match="the bucket served other bytes for bytes 2048-5120"):
        lying.hashers["f0"].rest(lambda pos, buf: buf.__setitem__(slice(None), bytes(len(buf))))
