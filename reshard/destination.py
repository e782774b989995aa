"""Where a save's output goes, chosen once per run: a local folder or a bucket folder.

- `Folder` (OUT_DIR): rank files are written into a staging folder beside OUT_DIR and swapped in
  with their manifest (reshard.publish).
- `Bucket` (`s3://bucket/prefix/`): rank files stream into multipart uploads kept open until every
  file is in, then are committed with the manifest last (reshard.store.publish); side files are
  gathered in a small local temporary folder first (config patched, checksummed) and uploaded with them.

`Destination.stage` takes the output (its lock, checks, what interrupted runs left) and returns the
run's `Staging`: the sink each output file is written to, the local folder for side files, and
`publish`.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.errors import ReshardError, UnsupportedError
from reshard.io.writer import FileWriter, Sink
from reshard.manifest import Manifest, manifest_bytes, read_manifest, write_manifest
from reshard.names import MANIFEST, PIECE_MANIFEST_GLOB, is_rank_file_name
from reshard.publish import side_files, staged, swap_in
from reshard.store import BucketURL, is_bucket_url, parse_bucket_url

if TYPE_CHECKING:
    from reshard.plan import OutFile, Plan
    from reshard.store.publish import BucketPublisher, Prior
    from reshard.store.upload import OpenUpload, Uploads


class Staging:
    """A run's output while it is written: `folder` (local) holds the side files before publishing."""

    folder: Path

    def sink(self, f: OutFile, header: bytes, checksum: str) -> Sink:
        raise NotImplementedError

    def publish(self, plan: Plan, manifest: Manifest) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class FolderStaging(Staging):
    folder: Path
    out_dir: Path

    def sink(self, f: OutFile, header: bytes, checksum: str) -> Sink:
        return FileWriter(self.folder / f.name, header, checksum)

    def publish(self, plan: Plan, manifest: Manifest) -> None:
        write_manifest(self.folder, manifest)
        swap_in(self.folder, self.out_dir, ours=ours(self.out_dir), synced=[f.name for f in plan.files])


class Destination:
    """An output location; `display` is how messages, manifests and serve lines name it."""

    display: str
    local: Path | None = None  # the folder, for a local destination

    def stage(
        self,
        held: contextlib.ExitStack,
        tag: str,
        *,
        source: Path | None,
        overwrite: bool,
        need: int,
        plan: Plan,
        max_part: int,
    ) -> Staging:
        raise NotImplementedError


class Folder(Destination):
    def __init__(self, out_dir: Path) -> None:
        self.local = out_dir
        self.display = str(out_dir)

    def stage(
        self,
        held: contextlib.ExitStack,
        tag: str,
        *,
        source: Path | None,
        overwrite: bool,
        need: int,
        plan: Plan,
        max_part: int,
    ) -> Staging:
        assert self.local is not None
        folder = held.enter_context(staged(self.local, tag, source=source, overwrite=overwrite, need=need))
        return FolderStaging(folder, self.local)


class Bucket(Destination):
    def __init__(self, url: BucketURL) -> None:
        self.url = url
        self.display = str(url)

    def stage(
        self,
        held: contextlib.ExitStack,
        tag: str,
        *,
        source: Path | None,
        overwrite: bool,
        need: int,
        plan: Plan,
        max_part: int,
    ) -> Staging:
        from reshard.store.bucket import Bucket as Objects
        from reshard.store.publish import BucketPublisher
        from reshard.store.upload import Uploads

        objects = Objects(self.url)
        objects.check_access()
        publisher = BucketPublisher(objects)
        held.enter_context(publisher.locked(tag))
        publisher.recover()
        sides = side_files(source) if source is not None else []
        rank_bytes: dict[int, int] = {}
        for f in plan.files:
            rank_bytes[plan.engine_rank(f)] = rank_bytes.get(plan.engine_rank(f), 0) + f.data_bytes
        prior = publisher.check(
            overwrite=overwrite,
            new_names=[f.name for f in plan.files] + sides,
            rank_bytes=list(rank_bytes.values()),
            max_part=max_part,
        )
        uploads = Uploads(objects)
        staging = BucketStaging(
            Path(held.enter_context(tempfile.TemporaryDirectory(prefix="reshard-side-"))),
            publisher,
            uploads,
            prior,
            tag,
        )
        held.callback(staging.close)
        return staging


class BucketStaging(Staging):
    def __init__(self, folder: Path, publisher: BucketPublisher, uploads: Uploads, prior: Prior, run: str) -> None:
        self.folder = folder
        self.publisher = publisher
        self.uploads = uploads
        self.prior = prior
        self.run = run

    def sink(self, f: OutFile, header: bytes, checksum: str) -> Sink:
        from reshard.store.upload import ObjectWriter

        return ObjectWriter(self.uploads, f.name, header, checksum, len(header) + f.data_bytes)

    def publish(self, plan: Plan, manifest: Manifest) -> None:
        ups: list[OpenUpload] = [self.uploads.open[self.uploads.url.key(f.name)] for f in manifest.files]
        for side in manifest.copied_files:
            ups.append(self.uploads.put_bytes(self.uploads.url.key(side.name), (self.folder / side.name).read_bytes()))
        last = self.uploads.put_bytes(self.uploads.url.key(MANIFEST), manifest_bytes(manifest))
        self.publisher.commit(self.uploads, ups, last, self.prior, self.run)

    def close(self) -> None:
        if not self.publisher.journaled:  # once the journal is written, the uploads are its: never aborted
            self.uploads.abort_all()
        self.uploads.close()


def destination(spec: str | Path) -> Destination:
    """OUT: a local folder, or `s3://bucket/prefix/`."""
    if isinstance(spec, str) and is_bucket_url(spec):
        return Bucket(parse_bucket_url(spec))
    return Folder(Path(spec))


def refuse_on_bucket(dest: Destination, what: str) -> None:
    if isinstance(dest, Bucket):
        raise UnsupportedError(
            f"{what} cannot write to object storage yet ({dest.display})",
            "save to a local folder, or save to the bucket without it",
        )


def ours(out_dir: Path) -> Callable[[str], bool]:
    """The names of OUT_DIR that an earlier reshard run wrote (the rest is kept when overwriting)."""
    copied: set[str] = set()
    with contextlib.suppress(ReshardError, OSError):
        copied = set(read_manifest(out_dir).copied)

    def is_ours(name: str) -> bool:
        return is_rank_file_name(name) or name == MANIFEST or name in copied or fnmatch(name, PIECE_MANIFEST_GLOB)

    return is_ours
