"""What every source is to the rest of reshard: a `Checkpoint` (metadata, plain data) and a `Reader`.

Planning needs only the metadata (config.json and the safetensors headers); executing needs a
`Reader` for the tensor bytes. A local folder, a Hub repo and a reshard output are three `Source`s
(`reshard.sources`) that give both. Nothing here reads a file or imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from reshard.format import TensorInfo

if TYPE_CHECKING:
    from reshard.manifest import Manifest
    from reshard.manifest.schema import SourceFileRecord


@dataclass
class Checkpoint:
    """A source checkpoint's metadata.

    Attributes:
        root: local folder holding the files; None when only Hub metadata was fetched (`plan`).
        config: parsed config.json.
        tensors: every tensor by name, from the headers.
        files: safetensors file names, in index order.
        ref: where it came from: {"path": ...} or {"repo_id", "revision", "commit"}; recorded in
            the manifest.
        file_sizes: size of each safetensors file in bytes.
        manifest: when the source is a reshard output, its manifest.
        missing: when the source is a reshard output, original tensors it does not hold.
        checked: each safetensors file's sha256 and how it was checked, filled in by the source
            once it has checked them (before the save publishes); empty for a reshard output.
    """

    root: Path | None
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    ref: dict
    file_sizes: dict[str, int] = field(default_factory=dict)
    manifest: Manifest | None = None
    missing: list[str] = field(default_factory=list)
    checked: list[SourceFileRecord] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class Downloads(Protocol):
    """Bytes downloaded so far (`done`) of `total`, updated while a save runs (a Hub source)."""

    done: int
    total: int


class Reader(Protocol):
    """Bytes of source tensors. `read` may be called from several threads at once."""

    def read(self, t: TensorInfo, start: int, nbytes: int, buf: bytearray | memoryview | None = None) -> memoryview:
        """Bytes [start, start + nbytes) of tensor `t` (row-aligned ranges), into `buf` if given."""
        ...

    def close(self) -> None: ...


class Source(Protocol):
    """A checkpoint to read: its metadata, and a way to read its bytes. Sources subclass `Source`;
    `downloads`, `check`, `split` and `finish` are optional, with their defaults here."""

    @property
    def checkpoint(self) -> Checkpoint: ...

    def open_reader(self) -> Reader:
        """A new reader; the caller closes it."""
        ...

    @property
    def downloads(self) -> Downloads | None:
        """What the source downloads during a save, for the progress display. Default: nothing."""
        return None

    def check(self) -> None:
        """Check the files against the sha256 their publisher commits to, before any byte is read,
        filling `checkpoint.checked` (exit 4 on a mismatch). Called by the save before reading (once,
        under torchrun, by process 0), and by `open_reader` where it was not. Default: nothing (a
        source that checks as it reads)."""

    def split(self, rank: int, world: int) -> None:
        """This process is `rank` of the `world` processes of one save reading the source (torchrun,
        before any reads): a source that checks its files after reading them checks its share at
        `finish`. Default: nothing."""

    def finish(self) -> None:
        """Called once a save has read everything it needed: a source that keeps a copy of what it
        reads (a Hub repo in the cache, `HubSource`) completes that copy here. Default: nothing."""
