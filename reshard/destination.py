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
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.console import log_line
from reshard.errors import OutputError, ReshardError, UnsupportedError
from reshard.io.writer import FileWriter, Sink
from reshard.manifest import Manifest, manifest_bytes, read_manifest, write_manifest
from reshard.names import BUCKET_HANDOVER, BUCKET_HANDOVER_GLOB, MANIFEST, PIECE_MANIFEST_GLOB, is_rank_file_name
from reshard.publish import staged, swap_in
from reshard.scratch import scratch_dir
from reshard.sidefiles import side_files
from reshard.store import BucketURL, is_bucket_url, parse_bucket_url

if TYPE_CHECKING:
    from reshard.plan import OutFile, Plan
    from reshard.store.publish import BucketPublisher, Prior
    from reshard.store.upload import OpenUpload, Uploads


@dataclass(frozen=True)
class Run:
    """What a destination needs to know of the run that stages into it."""

    tag: str  # the run id (and, for a piece, its ranks): staging and lock names
    source: Path | None  # the source folder (an output may not go inside it; its side files)
    overwrite: bool
    need: int  # bytes the rank files take
    plan: Plan
    max_part: int  # --max-part-size (for the hint when a bucket's listing would be too long)


class Staging:
    """A run's output while it is written: `folder` (local) holds the side files before publishing."""

    folder: Path

    def sink(self, f: OutFile, header: bytes, checksum: str) -> Sink:
        raise NotImplementedError

    def publish(self, plan: Plan, manifest: Manifest) -> None:
        raise NotImplementedError

    def hand_over(self) -> None:
        """A torchrun process other than 0 has written its files: process 0 publishes them."""

    def close(self) -> None:
        """The run is over (published or failed): free what the staging holds."""


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

    def stage(self, held: contextlib.ExitStack, run: Run) -> Staging:
        raise NotImplementedError


class Folder(Destination):
    def __init__(self, out_dir: Path) -> None:
        self.local = out_dir
        self.display = str(out_dir)

    def stage(self, held: contextlib.ExitStack, run: Run) -> Staging:
        assert self.local is not None
        folder = held.enter_context(
            staged(self.local, run.tag, source=run.source, overwrite=run.overwrite, need=run.need)
        )
        if stray := foreign_rank_files(self.local):
            raise OutputError(
                f"OUT_DIR {self.local} holds {stray[0]}{f' (and {len(stray) - 1} more)' if len(stray) > 1 else ''}, "
                "which the output there does not list: vLLM's sharded_state would load it with the new rank files, "
                "and --overwrite would delete it",
                "move it out of OUT_DIR (or delete it), then rerun",
            )
        return FolderStaging(folder, self.local)


class Bucket(Destination):
    def __init__(self, url: BucketURL) -> None:
        self.url = url
        self.display = str(url)

    def stage(self, held: contextlib.ExitStack, run: Run) -> Staging:
        from reshard.store.bucket import Bucket as Objects
        from reshard.store.publish import BucketPublisher
        from reshard.store.upload import Uploads

        objects = Objects(self.url)
        objects.check_access()
        publisher = BucketPublisher(objects)
        held.enter_context(publisher.locked(run.tag))
        publisher.recover()
        if publisher.recovered:  # an interrupted run's commit, finished before this run's checks
            log_line(f"reshard: {self.url}: {publisher.recovered}")
        plan = run.plan
        sides = side_files(run.source) if run.source is not None else []
        rank_bytes: dict[int, int] = {}
        for f in plan.files:
            rank_bytes[plan.engine_rank(f)] = rank_bytes.get(plan.engine_rank(f), 0) + f.data_bytes
        prior = publisher.check(
            overwrite=run.overwrite,
            new_names=[f.name for f in plan.files] + sides,
            rank_bytes=list(rank_bytes.values()),
            max_part=run.max_part,
        )
        publisher.abort_leftovers(prior)  # a killed run's, once this run is let to write here
        uploads = Uploads(objects)
        staging = BucketStaging(
            held.enter_context(scratch_dir("side")),  # a killed run's: removed by the next (reshard.scratch)
            publisher,
            uploads,
            prior,
            run.tag,
        )
        held.callback(staging.close)
        return staging


class BucketStaging(Staging):
    """Under torchrun, process 0 makes it (lock, checks) and the others get a copy (pickled: the
    folder, URL, prior listing and run) with uploads of their own, which they leave open for
    process 0 to commit: it finds them on the store (`_adopt`)."""

    def __init__(
        self, folder: Path, publisher: BucketPublisher | None, uploads: Uploads, prior: Prior, run: str
    ) -> None:
        self.folder = folder
        self.publisher = publisher
        self.uploads = uploads
        self.prior = prior
        self.run = run
        self.committing = False  # handed over to process 0 (torchrun)

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "url": self.uploads.url, "prior": self.prior, "run": self.run}

    def __setstate__(self, state: dict) -> None:
        from reshard.store.bucket import Bucket as Objects
        from reshard.store.upload import Uploads

        self.__init__(state["folder"], None, Uploads(Objects(state["url"])), state["prior"], state["run"])  # type: ignore[misc]

    def hand_over(self) -> None:
        """A torchrun process other than 0 is done: its uploads are process 0's to commit (their
        parts and checksums in `prefix.reshard/uploads-<process>.json`; stores do not all list part
        checksums)."""
        import json

        from reshard.store.bucket import Bucket as Objects

        self._confirmed()
        ups = [up.to_json() for up in self.uploads.open.values()]
        key = self.uploads.url.work + BUCKET_HANDOVER.format(rank=os.environ.get("RANK", "0"))
        Objects(self.uploads.url, client=self.uploads.client).put(key, json.dumps(ups).encode())
        self.committing = True

    def sink(self, f: OutFile, header: bytes, checksum: str) -> Sink:
        from reshard.store.upload import ObjectWriter

        return ObjectWriter(self.uploads, f.name, header, checksum, len(header) + f.data_bytes)

    def publish(self, plan: Plan, manifest: Manifest) -> None:
        assert self.publisher is not None
        key = self.uploads.url.key
        ups: list[OpenUpload] = self._adopt([key(f.name) for f in manifest.files])
        ups += self.uploads.put_objects(
            [(key(s.name), (self.folder / s.name).read_bytes()) for s in manifest.copied_files]
        )
        # every object's checksum as the store will report it: `verify s3://` then catches an object
        # replaced after the save from a HEAD, without reading it
        sums = {self.uploads.url.name(up.key): up.checksum() for up in ups}
        manifest = replace(manifest, store_sha256=sums)
        [last] = self.uploads.put_objects([(key(MANIFEST), manifest_bytes(manifest))])
        self._confirmed()  # before the commit: the previous output stays as it is
        self.publisher.commit(self.uploads, ups, last, self.prior, self.run)

    def _confirmed(self) -> None:
        """Every part's SHA256 was confirmed by the store (it echoes what it checked)."""
        if self.uploads.unchecked:
            raise OutputError(
                f"the object store did not confirm the SHA256 of the parts of {len(self.uploads.unchecked)} objects "
                f"({sorted(self.uploads.unchecked)[0]}, ...): reshard cannot prove they arrived intact",
                "use a store that checks x-amz-checksum-sha256 (AWS S3, MinIO, SeaweedFS, ...)",
            )

    def _adopt(self, keys: list[str]) -> list[OpenUpload]:
        """This process's open uploads of `keys`, and those the other torchrun processes handed over."""
        import json

        from reshard.store.upload import OpenUpload

        if any(k not in self.uploads.open for k in keys):
            assert self.publisher is not None
            bucket = self.publisher.bucket
            notes = [o.key for o in bucket.list(self.uploads.url.work) if fnmatch(o.key, "*" + BUCKET_HANDOVER_GLOB)]
            for note in notes:
                for obj in json.loads(bucket.get(note, limit=1 << 30) or b"[]"):
                    self.uploads.adopt(OpenUpload.from_json(obj))
            bucket.delete(notes)
        missing = [k for k in keys if k not in self.uploads.open]
        if missing:
            raise OutputError(f"{missing[0]}: no torchrun process handed over its upload", "rerun the save")
        return [self.uploads.open[k] for k in keys]

    def close(self) -> None:
        # once the journal is written the uploads are its (never aborted); a torchrun process's are
        # process 0's once handed over
        journaled = self.publisher is not None and self.publisher.journaled
        if not (journaled or self.committing):
            self.uploads.abort_all()
            if self.publisher is not None:  # process 0 (or alone): the other processes' uploads too
                with contextlib.suppress(Exception):
                    for key, upload_id in self.publisher.bucket.open_uploads(self.uploads.url.prefix):
                        self.publisher.bucket.abort(key, upload_id)
        self.uploads.close()


def destination(spec: str | Path) -> Destination:
    """OUT: a local folder, or `s3://bucket/prefix/`."""
    if isinstance(spec, str) and is_bucket_url(spec):
        return Bucket(parse_bucket_url(spec))
    return Folder(Path(spec))


def refuse_on_bucket(dest: Destination, what: str) -> None:  # for --ranks pieces
    if isinstance(dest, Bucket):
        raise UnsupportedError(
            f"{what} cannot write to object storage yet ({dest.display})",
            "save to a local folder, or save to the bucket without it",
        )


def refuse_own_source(dest: Destination, source: str) -> None:
    """An s3:// output re-sharded into its own prefix: refused, as a folder into itself is
    (outdir.check_apart), before anything is read or written: the commit would replace the source. (A prefix
    inside or around it is refused as lying in or above another output, by the bucket's own checks.)"""
    if isinstance(dest, Bucket) and is_bucket_url(source) and parse_bucket_url(source) == dest.url:
        raise OutputError(f"OUT_DIR {dest.url} is inside the source {dest.url}", "write elsewhere")


def foreign_rank_files(out_dir: Path) -> list[str]:
    """Names in OUT_DIR that vLLM's rank-file globs match and its output's manifest does not list (a user's
    `model-rank-0-part-0.backup.safetensors`); none where there is no readable manifest (then every such
    name is a previous output's, vLLM's own save_sharded_state's included)."""
    try:
        listed = {f.name for f in read_manifest(out_dir).files}
        names = os.listdir(out_dir)
    except (ReshardError, OSError):
        return []
    return sorted(n for n in names if is_rank_file_name(n) and n not in listed)


def ours(out_dir: Path) -> Callable[[str], bool]:
    """The names of OUT_DIR that an earlier reshard run wrote (the rest is kept when overwriting)."""
    copied: set[str] = set()
    with contextlib.suppress(ReshardError, OSError):
        copied = set(read_manifest(out_dir).copied)

    def is_ours(name: str) -> bool:
        return is_rank_file_name(name) or name == MANIFEST or name in copied or fnmatch(name, PIECE_MANIFEST_GLOB)

    return is_ours
