"""One file's sha256 from the ranges a save reads, in any order.

`PrefixHasher` hashes a file from the ranges a save reads, in any order: what arrives at its
position is hashed at once, what arrives ahead of it waits in a bounded buffer, and the rest is
read again at the end (`rest`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

PENDING = 256 * 1024 * 1024  # bytes held out of order, per file, before they are read again instead
BLOCK = 16 * 1024 * 1024


class PrefixHasher:
    """sha256 of one file fed with (offset, bytes) ranges in any order, from several threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pos = 0
        self.h = hashlib.sha256()
        self.pending: dict[int, bytes] = {}
        self.held = 0
        self.lock = threading.Lock()

    def feed(self, pos: int, data: memoryview | bytes) -> None:
        end = pos + len(data)
        with self.lock:
            if pos <= self.pos < end:
                self.h.update(memoryview(data)[self.pos - pos :])
                self.pos = end
                self._drain()
            elif pos > self.pos and self.held + len(data) <= PENDING and pos not in self.pending:
                self.pending[pos] = bytes(data)
                self.held += len(data)

    def _drain(self) -> None:
        while self.pending:
            ready = [p for p in self.pending if p <= self.pos]
            if not ready:
                return
            for p in ready:
                data = self.pending.pop(p)
                self.held -= len(data)
                if p + len(data) > self.pos:
                    self.h.update(memoryview(data)[self.pos - p :])
                    self.pos = p + len(data)

    def rest(self, read: Callable[[int, memoryview], None]) -> str:
        """The digest, reading what was not fed (from `pos` to the end) by `read(pos, out)`."""
        with self.lock:
            self.pending.clear()
            self.held = 0
            while self.pos < self.size:
                buf = memoryview(bytearray(min(BLOCK, self.size - self.pos)))
                read(self.pos, buf)
                self.h.update(buf)
                self.pos += len(buf)
            return self.h.hexdigest()
