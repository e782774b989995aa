"""One file's sha256 from the ranges a save reads, in any order, vouching for every byte that was used.

A save reads a Hub file's tensors in its own order, some more than once, some not at all; the sha256
the Hub commits to is of the whole file, in order. `PrefixHasher.feed` is given each range a save
uses; `rest` reads what was never given, and returns the digest. The digest must be of the bytes the
save used, not of other bytes fetched later for the same offsets (a CDN may serve a range differently
the second time). So every range fed is, at the latest by `rest`:

- hashed as it arrives (it starts where the hash has got to), or
- held (at most PENDING bytes per file, or the bound given) and hashed from those same bytes once the hash gets there, or
- spilled: held on disk instead, beyond PENDING, where a `Spill` is given (reshard.sources.spill: a
  `--stream` save), and hashed from the bytes read back from this run's own file, or
- claimed: too far ahead to hold (or a second range at a held offset), its BLAKE3 digest kept, and
  compared with the digest of the bytes the hash takes in for that span (fetched again by `rest`), or
- behind: used after the hash passed its offset (fed by another read of the same bytes). Its BLAKE3
  digest is kept and `rest` proves it by a second pass over the whole file: read again, every behind
  range's digest compared, and that pass's sha256 equal to the first's. The Hub reader feeds no byte
  twice where the schedule foresees it: bytes several reads use are fetched once (reshard.sources.hubshare),
  a small-tensor group fetched again is compared by its own digest (reshard.sources.hubgroups).

A comparison that fails is a SourceError (exit 4): the download served other bytes. `new` and `fail` give
another hash and error (a bucket SOURCE: its manifest's algorithm, exit 7; reshard.sources.bucket_custody).
"""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

import blake3

from reshard.errors import SourceError
from reshard.hashing import Hasher
from reshard.sources.spill import Spill

PENDING = 256 * 1024 * 1024  # bytes held out of order, per file, before ranges are claimed instead
BLOCK = 16 * 1024 * 1024  # bytes per read of `rest`

Read = Callable[[int, memoryview], None]  # read(pos, out): bytes [pos, pos + len(out)) of the file


class Spilled(NamedTuple):
    """A held range kept on disk: `n` bytes at `at` in its file's spill."""

    at: int
    n: int


def digest(data: memoryview | bytes | bytearray) -> bytes:
    """The BLAKE3 digest reshard compares two fetches of a range by."""
    return blake3.blake3(data).digest()


def changed(where: str, start: int, end: int) -> SourceError:
    return SourceError(
        f"{where}: the download served other bytes for bytes {start}-{end} than it served before",
        "run again later; if it persists, the Hub's CDN serves a changed file: report it (nothing was published)",
    )


class PrefixHasher:
    """sha256 of one file (`size` bytes, `where` in messages) fed with (offset, bytes) ranges in any
    order, from several threads. `new`: another hash to compute (a bucket output's rank file is hashed
    with its manifest's algorithm, reshard.hashing.new_hasher); `fail(where, start, end)`: the error a
    failed comparison raises (default `changed`, exit 4); `pending`: the bytes it may hold (default
    PENDING; several files read at once share a budget so); `spill`: where to hold ranges beyond it,
    on disk (else they are claimed)."""

    def __init__(
        self,
        size: int,
        where: str = "the file",
        new: Callable[[], Hasher] = hashlib.sha256,
        fail: Callable[[str, int, int], Exception] = changed,
        pending: int | None = None,
        spill: Spill | None = None,
    ) -> None:
        self.size = size
        self.limit = pending
        self.where = where
        self.new = new
        self.fail = fail
        self.pos = 0  # bytes [0, pos) hashed
        self.h = new()
        self.pending: dict[int, bytes | Spilled] = {}  # held ranges by start, all after pos
        self.starts: list[int] = []  # heap of pending's keys
        self.held = 0  # bytes held in memory
        self.spill = spill
        self.spilled = 0  # bytes held in the spill
        self.claims: list[tuple[int, int, bytes]] = []  # heap: (start, end, BLAKE3) of ranges not yet hashed
        self.open: list[tuple[int, int, bytes, blake3.blake3]] = []  # claims the hash is inside
        self.behind: list[tuple[int, int, bytes]] = []  # ranges used after their bytes were hashed
        self.lock = threading.Lock()

    def feed(self, pos: int, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        end = pos + len(view)
        with self.lock:
            if pos < self.pos:  # its start hashed already, from another read: proven by `rest`
                cut = min(end, self.pos)
                self.behind.append((pos, cut, digest(view[: cut - pos])))
                view, pos = view[cut - pos :], cut
                if not len(view):
                    return
            if pos == self.pos:
                self._hash(view)
                self._drain()
            elif pos in self.pending or not self._hold(pos, view):
                heapq.heappush(self.claims, (pos, end, digest(view)))

    def _hold(self, pos: int, view: memoryview) -> bool:
        """Hold `view` (at `pos`) in memory within the bound, else in the spill where it has room, else
        in memory within PENDING (a spill full or that cannot be written: as without one)."""
        n = len(view)
        if self.held + n > (PENDING if self.limit is None else self.limit):
            if self.spill is None:
                return False
            if self._put(pos, view):
                return True
            if self.held + n > PENDING:
                return False
        self.pending[pos] = bytes(view)
        heapq.heappush(self.starts, pos)
        self.held += n
        return True

    def _put(self, pos: int, view: memoryview) -> bool:
        """Hold `view` (at `pos`) in the spill, where it fits."""
        assert self.spill is not None
        at = self.spill.put(self.where, view)
        if at is None:
            return False
        self.pending[pos] = Spilled(at, len(view))
        heapq.heappush(self.starts, pos)
        self.spilled += len(view)
        return True

    def _take(self, p: int, n: int | None = None) -> bytes | bytearray:
        """The held range at `p` (its first `n` bytes; the rest held on at p + n), out of `pending`."""
        held = self.pending.pop(p)
        if not isinstance(held, Spilled):
            self.held -= len(held)
            if n is not None and n < len(held):
                self._keep(p + n, held[n:])
                return held[:n]
            return held
        assert self.spill is not None
        n = held.n if n is None else min(n, held.n)
        data = self.spill.get(self.where, held.at, n)
        self.spilled -= n
        if n < held.n:
            if p + n in self.pending:  # another held range starts there: this one's end is claimed instead
                self.spilled -= held.n - n
                rest = self.spill.get(self.where, held.at + n, held.n - n)
                heapq.heappush(self.claims, (p + n, p + held.n, digest(rest)))
            else:
                self.pending[p + n] = Spilled(held.at + n, held.n - n)
                heapq.heappush(self.starts, p + n)
        if not self.spilled:
            self.spill.empty(self.where)
        return data

    def _keep(self, pos: int, data: bytes) -> None:
        """Hold the end of a held range again, from `pos` (claimed where another held range starts there)."""
        if pos in self.pending:
            heapq.heappush(self.claims, (pos, pos + len(data), digest(data)))
        else:
            self.pending[pos] = data
            heapq.heappush(self.starts, pos)
            self.held += len(data)

    def _hash(self, view: memoryview) -> None:
        """Take in bytes [pos, pos + len(view)): into the sha256, the claims over them, and compared
        with the held ranges that start inside them (what is held beyond is kept, from the end)."""
        a, b = self.pos, self.pos + len(view)
        self.h.update(view)
        while self.claims and self.claims[0][0] < b:
            start, end, want = heapq.heappop(self.claims)
            self.open.append((start, end, want, blake3.blake3()))
        if self.open:
            still = []
            for start, end, want, h in self.open:
                h.update(view[max(start, a) - a : min(end, b) - a])
                if end > b:
                    still.append((start, end, want, h))
                elif h.digest() != want:
                    raise self.fail(self.where, start, end)
            self.open = still
        while self.starts and self.starts[0] < b:
            p = heapq.heappop(self.starts)
            data = self._take(p, b - p)
            if view[p - a : p - a + len(data)] != data:
                raise self.fail(self.where, p, p + len(data))
        self.pos = b

    def _drain(self) -> None:
        while self.starts and self.starts[0] == self.pos:
            self._hash(memoryview(self._take(heapq.heappop(self.starts))))

    def unread(self) -> int:
        """Bytes `rest` would read now (the claimed among them; not a second pass for ranges behind)."""
        with self.lock:
            return self.size - self.pos - self.held - self.spilled

    def rest(self, read: Read) -> str:
        """The digest, reading what was neither fed nor held (from `pos` on) by `read(pos, out)`."""
        with self.lock:
            while self.pos < self.size:
                upto = min(self.size, self.pos + BLOCK, self.starts[0] if self.starts else self.size)
                buf = memoryview(bytearray(upto - self.pos))
                read(self.pos, buf)
                self._hash(buf)
                self._drain()
            got = self.h.hexdigest()
            if self.behind:
                again = PrefixHasher(self.size, self.where, self.new, self.fail, self.limit)
                again.claims = sorted(self.behind)
                self.behind = []
                if again.rest(read) != got:
                    raise self.fail(self.where, 0, self.size)
            return got


def taken_again(
    ranges: Iterable[tuple[str, int, int]],
    pending: int | None = None,
    at: dict[str, int] | None = None,
    spill: int | None = None,
) -> int:
    """Bytes `PrefixHasher` would claim, and `rest` take in again, were the save's reads `ranges`
    ((file, start, end), in the order they are made) fed to each file's hasher in that order: with
    `--stream` a second download of them. A read that starts where its file's hash has got to
    advances it (and the held reads it reaches); one ahead is held while the held bytes stay within
    `pending` (default PENDING), then spilled while the spill (`spill` bytes, all files; a file's
    part freed when none of its spilled bytes waits, as `Spill.empty`) has room, then (a spill
    given, even of 0 bytes) held while they stay within PENDING; one beyond is claimed. `at`: where each file's hash is now (its header is fed first). An estimate where reads
    finish out of order on several connections, exact when they are fed in order
    (tests/test_hub_stream_hash.py, tests/test_spill.py)."""
    limit = PENDING if pending is None else pending
    pos: dict[str, int] = dict(at or {})
    held: dict[str, list[tuple[int, int, bool]]] = {}  # per file: a heap of (start, end, spilled) held ahead
    held_bytes: dict[str, int] = {}
    waits: dict[str, int] = {}  # per file: spilled bytes waiting
    written: dict[str, int] = {}  # per file: bytes in its spill
    used = again = 0
    room = spill or 0
    most = limit if spill is None else max(limit, PENDING)
    for file, start, end in ranges:
        here = pos.get(file, 0)
        if start > here:
            n = held_bytes.get(file, 0)
            if used + end - start <= room and n + end - start > limit:
                heapq.heappush(held.setdefault(file, []), (start, end, True))
                used += end - start
                waits[file] = waits.get(file, 0) + end - start
                written[file] = written.get(file, 0) + end - start
            elif n + end - start <= most:
                heapq.heappush(held.setdefault(file, []), (start, end, False))
                held_bytes[file] = n + end - start
            else:
                again += end - start
            continue
        here = max(here, end)
        waiting = held.get(file, [])
        while waiting and waiting[0][0] <= here:
            s, e, spilled = heapq.heappop(waiting)
            if spilled:
                waits[file] -= e - s
                if not waits[file]:
                    used -= written.pop(file)
            else:
                held_bytes[file] -= e - s
            here = max(here, e)
        pos[file] = here
    return again
