"""The one place that knows how reshard checksums files: the algorithms, and hashing a file fast.

A manifest names its algorithm in the top-level field `checksum` (`ALGORITHMS`); each file entry
then holds its digest under the algorithm's name (`"blake3": "<hex>"`, `"sha256": "<hex>"`), and
none with `none`. Manifests written before the field existed hold `sha256` digests
(reshard.manifest.schema reads them so). `save` hashes on the fly: `new_hasher(name)` gives an incremental
hasher (`update`, `hexdigest`).

BLAKE3 (the `blake3` package) is the default: about 2x sha256's speed per core here even with
SHA-NI (docs/benchmarks.md), which matters when the hash is most of a save's CPU time. It runs
single-threaded: the writer threads already hash several files at once, and its own threads made
a 2-core machine slower. sha256 stays for users who must check files with `sha256sum -c`.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

DEFAULT = "blake3"
LEGACY = "sha256"  # what a manifest without a `checksum` field holds
NONE = "none"
ALGORITHMS = (DEFAULT, "sha256", NONE)
FIELD = "checksum"  # the manifest's top-level field naming the algorithm
READ_BLOCK = 16 * 1024 * 1024
DIRECT_MIN = 64 * 1024 * 1024  # `hash_fd(direct=True)`: smaller files are read through the page cache


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str | None: ...


class _NoHash:
    """`none`: hashes nothing, digests nothing."""

    def update(self, data: bytes | memoryview, /) -> None:
        pass

    def hexdigest(self) -> None:
        return None


def new_hasher(algorithm: str) -> Hasher:
    """An incremental hasher (`update`, `hexdigest`; None for `none`). Both real ones release the
    GIL on large updates, so writer threads hash in parallel. Raises ValueError on an unknown name."""
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == NONE:
        return _NoHash()
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def hash_bytes(data: bytes | memoryview, algorithm: str) -> str | None:
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def hash_file(
    path: Path,
    algorithm: str,
    *,
    advance: Callable[[int], None] | None = None,
    block: int = READ_BLOCK,
) -> str | None:
    """A file's checksum (None for `none`, without reading): large sequential reads into one reused
    buffer. Raises OSError."""
    if algorithm == NONE:
        return None
    with open(path, "rb", buffering=0) as f:
        return hash_fd(f.fileno(), algorithm, advance=advance, block=block)


def hash_fd(
    fd: int,
    algorithm: str = DEFAULT,
    *,
    advance: Callable[[int], None] | None = None,
    block: int = READ_BLOCK,
    limit: int | None = None,
    direct: bool = False,
) -> str | None:
    """`hash_file` of an open file, from its current position: at most `limit` bytes where given (a
    manifest-named file is read no further than its recorded size). `direct`: read with O_DIRECT
    where the file system takes it (`reshard.io.direct.blocks`, a thread reading ahead), for a file
    not in the page cache (`reshard.io.direct.wants_direct`): no kernel copy of every page. Raises
    OSError."""
    h = new_hasher(algorithm)
    if algorithm == NONE:
        return None
    if direct and (limit is None or limit >= DIRECT_MIN):
        done = _hash_direct(fd, h, block, limit, advance)
        if done is None:
            return h.hexdigest()
        if limit is not None:
            limit -= done
    left = os.fstat(fd).st_size - os.lseek(fd, 0, os.SEEK_CUR) if limit is None else limit
    # no larger than the file (+1 to see its end in one read): a tokenizer folder's many small
    # files would each pay for zeroing a 16 MiB buffer
    buf = bytearray(max(1, min(block, left + 1)))
    view = memoryview(buf)
    while left > 0 and (n := os.readv(fd, [view[: min(len(buf), left)]])):
        h.update(view[:n])
        left -= n
        if advance is not None:
            advance(n)
    if limit is None:  # the whole file, also past the size fstat saw
        while n := os.readv(fd, [view]):
            h.update(view[:n])
            if advance is not None:
                advance(n)
    return h.hexdigest()


def _hash_direct(
    fd: int, h: Hasher, block: int, limit: int | None, advance: Callable[[int], None] | None
) -> int | None:
    """Hash `fd` from its position with O_DIRECT: None when done; else how many bytes were hashed
    before O_DIRECT was refused (or could not start: an unaligned position), the position then
    moved past them for the page cache to go on."""
    from reshard.io import direct

    start = os.lseek(fd, 0, os.SEEK_CUR)
    if start % direct.ALIGN or block % direct.ALIGN or not direct.enable(fd):
        return 0
    done = 0
    try:
        for view in direct.blocks(fd, start, limit, block):
            h.update(view)
            done += len(view)
            if advance is not None:
                advance(len(view))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        direct.disable(fd)
        os.lseek(fd, start + done, os.SEEK_SET)
        return done
    os.lseek(fd, start + done, os.SEEK_SET)
    return None
