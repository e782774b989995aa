"""The rank files of a bucket SOURCE that the store cannot vouch for (no SHA256 reported, or none recorded),
checked against the manifest's digests from the bytes the save used (reshard.sources.bucket_output).

A check that reads such a file again whole at the end proves the object as the store serves it then, not
the bytes the tensor reads got: a store that serves other bytes to the first request for a range and the
written ones later would pass it. So every ranged read of such a file is fed, as it is used, to that file's
`PrefixHasher` (computing the manifest's algorithm), which vouches for every byte fed (hashed in order,
held, or claimed by its BLAKE3 digest and compared when it is read again); `check` reads only what was
never fed, and the file's digest must be the manifest's.

Under torchrun each process checks its share of the files (`mine`); of the others it keeps the BLAKE3
digest of every range it used, and `check` reads those ranges again and compares them: the bytes it used
are the ones the store serves now, which the process checking that file hashes.
A mismatch is a CorruptError (exit 7), raised before anything is published.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from reshard.errors import CorruptError
from reshard.hashing import new_hasher
from reshard.manifest import FileRecord
from reshard.sources import prefixhash
from reshard.sources.prefixhash import PrefixHasher, digest

Get = Callable[[str, int, int], bytes]  # get(file, offset, nbytes): bytes read from the store


class Custody:
    """`files` (the unvouched rank files), this process checking those of `mine`; `algorithm` the
    manifest's, `where(name)` a file's address in messages, `hint` the errors' hint."""

    def __init__(
        self, files: list[FileRecord], mine: set[str], algorithm: str, where: Callable[[str], str], hint: str
    ) -> None:
        self.files = {f.name: f for f in files}
        self.hint = hint
        self.where = where
        # a re-shard reads every rank file at once, tensor by tensor: their hashers share one file's bound
        share = prefixhash.PENDING // max(1, len(mine & self.files.keys()))
        self.hashers = {
            f.name: PrefixHasher(f.size, where(f.name), lambda: new_hasher(algorithm), self._changed, share)
            for f in files
            if f.name in mine
        }
        self.used: dict[str, list[tuple[int, int, bytes]]] = {}  # the others': (start, end, BLAKE3) used
        self.lock = threading.Lock()

    def _changed(self, where: str, start: int, end: int) -> CorruptError:
        return CorruptError(
            f"{where}: the bucket served other bytes for bytes {start}-{end} than it served before", self.hint
        )

    def feed(self, name: str, offset: int, data: bytes) -> None:
        """Bytes [offset, offset + len(data)) of `name` as read, to be used."""
        hasher = self.hashers.get(name)
        if hasher is not None:
            hasher.feed(offset, data)
        elif name in self.files:
            d = digest(data)
            with self.lock:
                self.used.setdefault(name, []).append((offset, offset + len(data), d))

    def unread(self) -> int:
        """About the bytes `check` reads."""
        return sum(h.unread() for h in self.hashers.values()) + sum(
            e - s for rs in self.used.values() for s, e, _ in rs
        )

    def jobs(self, get: Get, mismatch: Callable[[str], CorruptError]) -> list[tuple[int, Callable[[], None]]]:
        """(bytes, check) of each file to check: its digest from what was fed and a read of the rest,
        or its used ranges read again; a check raises CorruptError."""
        out: list[tuple[int, Callable[[], None]]] = []
        for name, hasher in self.hashers.items():

            def whole(name: str = name, hasher: PrefixHasher = hasher) -> None:
                def read(pos: int, buf: memoryview) -> None:
                    buf[:] = get(name, pos, len(buf))

                if hasher.rest(read) != self.files[name].digest:
                    raise mismatch(name)

            out.append((self.files[name].size, whole))
        for name, ranges in self.used.items():

            def again(name: str = name, ranges: list[tuple[int, int, bytes]] = ranges) -> None:
                for start, end, want in ranges:
                    if digest(get(name, start, end - start)) != want:
                        raise self._changed(self.where(name), start, end)

            out.append((sum(e - s for s, e, _ in ranges), again))
        return out
