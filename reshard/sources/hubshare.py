"""Bytes of a Hub file that several of a save's reads use, fetched once.

The schedule (reshard.schedule) reads some source bytes more than once, where one pass over a source
cannot make a tensor's pieces: Llama-4's q and k rows are reordered per head (each head an even-rows
and an odd-rows piece, each its own read of nearly the same rows), and a KV head replicated over TP
ranks is read by each rank. Fetched again from the Hub, those bytes would be downloaded twice, and,
fed to the file's hash behind its position, they cost a second pass over the whole file
(reshard.sources.prefixhash): a second download of every file holding them.

`Shares.plan` finds, from the schedule's reads before any is made, the spans of each file that more
than one read covers (cut wherever a read begins or ends). `Shares.read` makes a read: its own bytes
and the first fetch of each of its spans come in as few requests as the spans allow and are fed to
the file's hash; the span's bytes are kept (at most KEEP bytes in all, on top of --max-memory) for
the span's other reads, which copy them; a read that comes while the span's first fetch is under way
waits for it. A span whose bytes could not be kept (over KEEP) keeps the BLAKE3 digest of its first
fetch, and its other reads fetch it again, must match it (else exit 4) and are not fed to the hash.
Either way every byte used is a byte hashed or proven equal to one; a read the plan did not foresee
(one that cuts a span) is fetched and fed as before, its custody prefixhash's.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

from reshard.bulk import paused_gc
from reshard.sources.prefixhash import changed, digest

KEEP = 64 << 20  # bytes of spans kept in memory for their other reads; beyond, digests only

Get = Callable[[str, int, memoryview], None]  # get(file, pos, out): the bytes, fetched (or from the cache)
Feed = Callable[[int, memoryview], None]  # feed(pos, data): to the file's hash


class Span:
    """Bytes [start, end) of a file that `users` reads still to come will use."""

    __slots__ = ("busy", "data", "digest", "end", "start", "users")

    def __init__(self, start: int, end: int, users: int) -> None:
        self.start, self.end, self.users = start, end, users
        self.data: bytes | None = None  # its first fetch, kept for the reads to come
        self.digest: bytes | None = None  # BLAKE3 of its first fetch
        self.busy: threading.Event | None = None  # set when the first fetch under way ends (either way)


FIRST, AGAIN = 0, 1  # a part fetched: its first fetch (fed to the hash), or fetched again (checked)


class Shares:
    def __init__(self, where: Callable[[str], str] = str) -> None:
        self.where = where  # a file's name in messages
        self.files: dict[str, tuple[list[int], list[Span]]] = {}  # each file's spans, by start
        self.lock = threading.Lock()
        self.kept = 0

    def plan(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """The spans that more than one of `ranges` ((file, start, end), the reads to come) covers."""
        with paused_gc():  # a tuple per read, ~70k in an MoE save (reshard.bulk)
            self._plan(ranges)

    def _plan(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        by_file: dict[str, list[tuple[int, int]]] = {}
        for file, a, b in ranges:
            if b > a:
                by_file.setdefault(file, []).append((a, b))
        for file, rs in by_file.items():
            rs.sort()
            spans: list[Span] = []
            i = 0
            while i < len(rs):  # clusters of overlapping reads; most reads are one alone
                j, end = i + 1, rs[i][1]
                while j < len(rs) and rs[j][0] < end:
                    end = max(end, rs[j][1])
                    j += 1
                if j - i > 1:
                    spans.extend(_covered(rs[i:j]))
                i = j
            if spans:
                self.files[file] = ([s.start for s in spans], spans)

    def read(self, file: str, pos: int, out: memoryview, get: Get, feed: Feed) -> None:
        """Bytes [pos, pos + len(out)) of `file` into `out`: fetched by `get` and fed to the hash by
        `feed`, or, for the spans the plan found, shared with their other reads."""
        parts = self._parts(file, pos, pos + len(out))
        if parts is None:
            get(file, pos, out)
            feed(pos, out)
            return
        while parts:
            parts = self._round(file, pos, out, parts, get, feed)

    def _parts(self, file: str, a: int, b: int) -> list[tuple[int, int, Span | None]] | None:
        """[a, b) as its spans and the bytes between them (None: no span in it, or one it cuts)."""
        starts, spans = self.files.get(file, ((), ()))
        i, j = bisect_left(starts, a), bisect_left(starts, b)
        before = bisect_right(starts, a) - 1
        if i == j or (before >= 0 and spans[before].start < a < spans[before].end) or spans[j - 1].end > b:
            return None
        parts: list[tuple[int, int, Span | None]] = []
        at = a
        for s in spans[i:j]:
            if s.start > at:
                parts.append((at, s.start, None))
            parts.append((s.start, s.end, s))
            at = s.end
        if at < b:
            parts.append((at, b, None))
        return parts

    def _round(self, file, pos, out, parts, get: Get, feed: Feed) -> list[tuple[int, int, Span | None]]:
        """Take the kept spans, fetch the rest but those another read is fetching; those returned."""
        fetch: list[tuple[int, int, Span | None, int]] = []
        waits, mine = [], []
        with self.lock:
            for a, b, s in parts:
                if s is None:
                    fetch.append((a, b, s, FIRST))
                elif s.data is not None:
                    out[a - pos : b - pos] = s.data
                    self._used(s)
                elif s.busy is not None:
                    waits.append((a, b, s))
                elif s.digest is not None:
                    fetch.append((a, b, s, AGAIN))
                else:
                    s.busy = threading.Event()
                    mine.append(s)
                    fetch.append((a, b, s, FIRST))
        try:
            for run in _runs(fetch):
                a, b = run[0][0], run[-1][1]
                get(file, a, out[a - pos : b - pos])
                self._settle(file, pos, out, run, feed)
        finally:
            with self.lock:
                for s in mine:  # published, or failed: a waiting read fetches it then
                    assert s.busy is not None
                    s.busy.set()
                    s.busy = None
        for _, _, s in waits:
            event = s.busy
            if event is not None:
                event.wait()
        return waits

    def _settle(self, file, pos, out, run, feed: Feed) -> None:
        """A fetched run of parts: its first fetches fed to the hash (adjacent ones at once), then each
        span's digest kept (and its bytes, for the reads to come), or checked against its first fetch."""
        fed: tuple[int, int] | None = None  # adjacent first fetches not yet fed
        for a, b, _, how in run:
            if how == FIRST:
                fed = (fed[0] if fed else a, b)
            elif fed:
                feed(fed[0], out[fed[0] - pos : fed[1] - pos])
                fed = None
        if fed:
            feed(fed[0], out[fed[0] - pos : fed[1] - pos])
        for a, b, s, how in run:
            if s is None:
                continue
            view = out[a - pos : b - pos]
            got = digest(view)
            with self.lock:
                if how == AGAIN:
                    if got != s.digest:
                        raise changed(self.where(file), a, b)
                else:
                    s.digest = got
                    if s.users > 1 and self.kept + (b - a) <= KEEP:
                        s.data = bytes(view)
                        self.kept += b - a
                self._used(s)

    def _used(self, s: Span) -> None:
        """One read of `s` done (under the lock): its kept bytes dropped after the last."""
        s.users -= 1
        if s.users <= 0 and s.data is not None:
            self.kept -= len(s.data)
            s.data = None


def _covered(rs: list[tuple[int, int]]) -> list[Span]:
    """The spans of one cluster of overlapping reads [a, b) that two or more of them cover, cut at
    every read's bounds (so each read covers whole spans), each with its count of reads."""
    delta: dict[int, int] = {}
    for a, b in rs:
        delta[a] = delta.get(a, 0) + 1
        delta[b] = delta.get(b, 0) - 1
    spans, n, prev = [], 0, None
    for x in sorted(delta):
        if prev is not None and n > 1:
            spans.append(Span(prev, x, n))
        n += delta[x]
        prev = x
    return spans


def _runs(parts: list[tuple[int, int, Span | None, int]]) -> Iterable[list[tuple[int, int, Span | None, int]]]:
    """`parts` in runs of adjacent ones: one request each."""
    run: list[tuple[int, int, Span | None, int]] = []
    for p in parts:
        if run and p[0] != run[-1][1]:
            yield run
            run = []
        run.append(p)
    if run:
        yield run
