"""A folder of output files as `verify` and an output SOURCE read it: a local folder, or a bucket
folder (`reshard.store.view.BucketView`, `s3://bucket/prefix/`).

The checks and the reader are written once against this view: what names the folder holds, a file's
size, its safetensors header, a byte range, a small file whole, a file's digest. Only what a local
folder alone can have (symlinks, FIFOs, staging folders beside it) is checked on `local`.

Errors: a file that is absent raises FileNotFoundError; one that must not be read (a symlink, a FIFO)
NotRegular; other read failures OSError (local) or the view's error class (a bucket: a one-line
ReshardError).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from reshard import settings
from reshard.errors import CorruptError
from reshard.format import TensorInfo, kind, open_inside, open_regular, read_header
from reshard.hashing import hash_fd
from reshard.io.direct import wants_direct

if TYPE_CHECKING:
    from reshard.manifest import Manifest

Header = tuple[dict[str, TensorInfo], dict[str, str], int]


class FolderView:
    """A folder of files (see the module docstring)."""

    display: str  # how messages name the folder
    local: Path | None = None  # the folder, when it is on this machine

    def where(self, name: str) -> str:
        """How messages name the file `name` of the folder."""
        raise NotImplementedError

    def names(self) -> Iterable[str]:
        """Every name in the folder (a bucket's: every key under the prefix, relative, may hold "/")."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def size(self, name: str) -> int:
        """The size of the regular file `name`. Raises FileNotFoundError, NotRegular, OSError."""
        raise NotImplementedError

    def header(self, name: str, *, size: int | None = None) -> Header:
        """`format.read_header` of `name` (a symlink refused); `size`: check offsets against it. SourceError."""
        raise NotImplementedError

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes of `name` from `start` (fewer only at its end)."""
        raise NotImplementedError

    def read_small(self, name: str, limit: int) -> bytes:
        """The whole file, at most `limit` + 1 bytes read (a longer one is the caller's to refuse)."""
        raise NotImplementedError

    def digest(
        self, name: str, algorithm: str, *, size: int, advance: Callable[[int], None] | None = None
    ) -> str | None:
        """The digest of `name`'s bytes, or "" when it is not `size` bytes; reads at most `size` bytes."""
        raise NotImplementedError


class LocalView(FolderView):
    """A local folder: files opened without following symlinks, nothing special read."""

    def __init__(self, folder: Path) -> None:
        self.local = Path(folder)
        self.display = str(folder)

    def where(self, name: str) -> str:
        return str(self.local / name)

    def names(self) -> Iterable[str]:
        assert self.local is not None
        try:
            return [p.name for p in self.local.iterdir()]
        except OSError as e:  # EIO, a stale or disconnected mount: as a file of it that cannot be read
            raise CorruptError(
                f"cannot list {self.local}: {e.strerror or e}", "check the disk or mount it is on, then rerun"
            ) from e

    def exists(self, name: str) -> bool:
        assert self.local is not None
        return os.path.lexists(self.local / name)

    def size(self, name: str) -> int:
        import stat

        from reshard.format import NotRegular

        assert self.local is not None
        st = (self.local / name).lstat()
        if not stat.S_ISREG(st.st_mode):
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else kind(st.st_mode)
            raise NotRegular(0, what, name)
        return st.st_size

    def header(self, name: str, *, size: int | None = None) -> Header:
        assert self.local is not None
        return read_header(self.local / name, size=size, follow=False)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        assert self.local is not None
        fd = open_regular(self.local / name, follow=False)
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def read_small(self, name: str, limit: int) -> bytes:
        assert self.local is not None
        with os.fdopen(open_inside(self.local, name), "rb") as f:
            return f.read(limit + 1)

    def digest(
        self, name: str, algorithm: str, *, size: int, advance: Callable[[int], None] | None = None
    ) -> str | None:
        assert self.local is not None
        fd = open_inside(self.local, name)
        try:
            if os.fstat(fd).st_size != size:
                return ""
            direct = wants_direct(self.local / name, settings.DIRECT_READS.get())  # a cold file: O_DIRECT
            return hash_fd(fd, algorithm, advance=advance, limit=size, direct=direct)
        finally:
            os.close(fd)


def view_manifest(view: FolderView) -> Manifest:
    """The folder's manifest, validated (`manifest.read_manifest` for a local one). Raises CorruptError."""
    from reshard.errors import CorruptError
    from reshard.manifest import MAX_MANIFEST, parse_manifest, read_manifest
    from reshard.names import MANIFEST

    if view.local is not None:
        return read_manifest(view.local)
    try:
        raw = view.read_small(MANIFEST, MAX_MANIFEST)
    except FileNotFoundError:
        raise CorruptError(
            f"{view.display}: no {MANIFEST}: not a complete reshard output",
            "rerun `reshard save`, or check a foreign folder with --against SOURCE --tp T",
        ) from None
    return parse_manifest(raw, view.where(MANIFEST))
