"""`reshard save`: plan, stream into a staging folder, then publish, manifest last.

Two choices are made once per run, each a small strategy:

- who writes (`Processes`): this process alone (`Solo`), or, under torchrun (WORLD_SIZE > 1), every
  process a disjoint share of the files while process 0 holds OUT_DIR, checks the source's files
  against their sha256 (once, for all: the others wait and take its records) and publishes (`Torchrun`);
- what is published (`Target`): the whole output, swapped in with its manifest (`Whole`), or, with
  `--ranks`, those engine ranks' files and a partial manifest, moved into OUT_DIR beside the other
  pieces; the full manifest appears when every piece is in (`Piece`, reshard.manifest.pieces).

The result says which happened: `Saved`, `PieceSaved`, or `Helped` (a torchrun process other than 0).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

from reshard import __version__
from reshard.bulk import paused_gc
from reshard.checkpoint import Checkpoint, Source
from reshard.destination import Destination, Run, Staging, destination, refuse_on_bucket, refuse_own_source
from reshard.distributed import Group, parse_ranks, ranks_tag, shared_run_id
from reshard.errors import OutputError, ReshardError, UnsupportedError
from reshard.execute import Progress, WriteOptions, run_executor
from reshard.io.writer import Written
from reshard.layout import Layout
from reshard.manifest import Manifest, build_manifest, side_file_entries, write_manifest
from reshard.manifest.pieces import assemble, read_pieces, same_job
from reshard.names import FILE_NAME_META, MANIFEST, piece_manifest_name
from reshard.optional import import_torch
from reshard.outdir import make_dir, write_error
from reshard.plan import OutFile, Plan, build_plan
from reshard.publish import move_into
from reshard.sidefiles import write_side_files
from reshard.sources import open_source
from reshard.sources.output import check_lossless_reshard


@dataclass(frozen=True)
class SaveOptions:
    """How to save, beside the layout (defaults: the CLI's, reshard.commands.options)."""

    write: WriteOptions
    max_part_size: int
    overwrite: bool = False
    revision: str | None = None
    stream: bool = False
    ranks: str | None = None  # --ranks: these engine ranks only (a piece)
    sha256: Path | None = None  # --source-sha256: what a local folder's safetensors files must hash to
    trust_remote_code: bool = False  # copy the checkpoint's code and trust it in the serve line


@dataclass(frozen=True)
class Saved:
    """A complete output, published in OUT_DIR."""

    plan: Plan
    manifest: Manifest
    out_dir: str  # the folder, or s3://bucket/prefix/


@dataclass(frozen=True)
class PieceSaved:
    """A `--ranks` piece moved into OUT_DIR; `manifest` when it was the last one (assembled)."""

    plan: Plan
    ranks: list[int]
    files: int
    manifest: Manifest | None
    out_dir: str


@dataclass(frozen=True)
class Helped:
    """A torchrun process other than 0: its files are written, process 0 publishes and reports."""

    plan: Plan


SaveResult = Saved | PieceSaved | Helped
T = TypeVar("T")
OnPlan = Callable[[Plan, Source], Progress | None]


def save(
    source: str, out: str | Path, layout: Layout, options: SaveOptions, *, on_plan: OnPlan | None = None
) -> SaveResult:
    """Write every rank's files of `source` for `layout` into `out` (a folder, or s3://bucket/prefix/);
    see `reshard save --help`."""
    dest = destination(out)
    procs = Processes.from_env()
    try:
        if options.ranks is not None:
            refuse_on_bucket(dest, "--ranks")
        refuse_own_source(dest, source)
        src = open_source(source, options.revision, stream=options.stream, sha256_file=options.sha256)
        src.split(*procs.part)
        check_lossless_reshard(src.checkpoint, layout.dtype)
        plan = build_plan(
            src.checkpoint, layout, max_part_size=options.max_part_size, trust_remote_code=options.trust_remote_code
        )
        target = Piece.chosen(plan, options.ranks) or Whole()
        files = target.files(plan)
        tensors = _source_tensors(src.checkpoint)
        run_id = uuid.uuid4().hex
        if target.shared or procs.shared:  # every process / piece of one job must agree on it
            run_id = shared_run_id(plan.source, plan.layout, tensors, __version__, options.max_part_size)
        with contextlib.ExitStack() as held:  # process 0 holds OUT_DIR (its lock) until it has published

            def stage() -> Staging:
                overwrite = options.overwrite or (dest.local is not None and target.joins(dest.local, run_id))
                tag, need = target.tag(run_id), sum(f.data_bytes for f in files)
                run = Run(tag, src.checkpoint.root, overwrite, need, plan, options.max_part_size)
                if dest.local is not None:  # before "not empty": --overwrite would not help a piece there
                    target.check(dest.local, run_id)
                staging = dest.stage(held, run)
                if dest.local is not None:  # again, with the lock held
                    target.check(dest.local, run_id)
                if options.write.device != "cpu":
                    _check_device(options.write.device)
                return staging

            staging = procs.agree(stage)
            if not procs.leader:
                held.callback(staging.close)  # process 0's was registered by `stage`
            src.checkpoint.checked = procs.agree(lambda: _checked(src))  # under torchrun, hashed once
            mine = procs.share(plan, files)
            progress = on_plan(replace(plan, files=mine), src) if on_plan else None
            meta = {"format": "pt", "reshard_run": run_id, "reshard_layout": plan.layout.tag()}

            def write() -> list[Written]:
                done = run_executor(
                    replace(plan, files=mine),
                    src,
                    None,
                    options.write,
                    meta,
                    progress,
                    sink=staging.sink,
                    name_key=FILE_NAME_META,
                )
                if not procs.leader:  # before process 0 hears it is done: it publishes at once
                    staging.hand_over()
                return done

            try:
                written = procs.collect(write)
                if not procs.leader:
                    return Helped(plan)
                manifest = _manifest(
                    src.checkpoint, plan, written, run_id, tensors, staging.folder, dest.display, options.write.checksum
                )
                if src.checkpoint.checked:  # checked by the source before this point (exit 4 otherwise)
                    manifest = replace(manifest, source_files=tuple(src.checkpoint.checked))
                return target.publish(plan, manifest, staging, dest)
            except OSError as e:
                raise write_error(Path(dest.display), e) from e
    finally:
        procs.close()


def _checked(src: Source) -> list:
    """The source's files checked against their sha256 before any is read (exit 4 on a mismatch);
    their records. A source that checks while it reads (a Hub stream) records them at `finish`."""
    src.check()
    return src.checkpoint.checked


def _source_tensors(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The source headers as the original checkpoint had them, also when re-sharding an output."""
    if ckpt.manifest is not None and ckpt.manifest.source_tensors is not None:
        return ckpt.manifest.source_tensors
    names = sorted(ckpt.tensors)  # unique; a record's shape is a tuple. In C loops: 0.13 -> 0.10 s per 200k
    with paused_gc():  # a tuple per tensor, no cycle among them (reshard.bulk)
        return dict(zip(names, map(_DTYPE_SHAPE, map(ckpt.tensors.__getitem__, names)), strict=True))


_DTYPE_SHAPE = attrgetter("dtype", "shape")


def _manifest(
    ckpt: Checkpoint,
    plan: Plan,
    written: list[Written],
    run_id: str,
    tensors: dict,
    folder: Path,
    out_dir: str,
    checksum: str,
) -> Manifest:
    """Copy the side files into the staging folder; the manifest of what was written."""
    copied = write_side_files(ckpt, plan, folder)
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return build_manifest(
        plan,
        written,
        run_id=run_id,
        created=created,
        out_dir=out_dir,
        copied=copied,
        source_tensors=tensors,
        checksum=checksum,
        copied_files=side_file_entries(folder, copied, checksum),
    )


# ---- who writes -------------------------------------------------------------------------------------


class Processes:
    """Who writes the files: this process alone, or the processes of a torchrun group."""

    leader = True  # the process that holds OUT_DIR, publishes and reports
    part = (0, 1)  # (this process, processes)
    shared = False  # several processes must agree on one run id

    @staticmethod
    def from_env() -> Processes:
        group = Group.from_env()
        return Torchrun(group) if group is not None else Solo()

    def agree(self, fn: Callable[[], T]) -> T:
        """Run `fn` (take and check OUT_DIR, make the staging folder; check the source) on the
        leader; every process gets its result or raises its error."""
        return fn()

    def share(self, plan: Plan, files: list[OutFile]) -> list[OutFile]:
        """This process's share of `files`."""
        return files

    def collect(self, write: Callable[[], list[Written]]) -> list[Written]:
        """Run `write` here; the leader gets every process's files (or the first failure)."""
        return write()

    def close(self) -> None:
        pass


class Solo(Processes):
    pass


class Torchrun(Processes):
    shared = True

    def __init__(self, group: Group) -> None:
        self.group = group
        self.leader = group.rank == 0
        self.part = (group.rank, group.size)

    def agree(self, fn: Callable[[], T]) -> T:
        result: T | None = None
        error: BaseException | None = None
        if self.leader:
            try:
                result = fn()
            except ReshardError as e:
                error = e
        # every process raises the same error: none is left waiting for the others
        error, result = self.group.broadcast((error, result))  # type: ignore[misc]
        if error is not None:
            raise error
        assert result is not None
        return result

    def share(self, plan: Plan, files: list[OutFile]) -> list[OutFile]:
        return [f for f in files if plan.engine_rank(f) % self.group.size == self.group.rank]

    def collect(self, write: Callable[[], list[Written]]) -> list[Written]:
        written: list[Written] = []
        failure: BaseException | None = None
        try:
            written = write()
        except (ReshardError, OSError) as e:
            failure = e
        results = self.group.gather((written, failure))
        failure = failure or next((f for _, f in results if f is not None), None)
        if failure is not None:
            raise failure
        return [w for ws, _ in results for w in ws]

    def close(self) -> None:
        self.group.close()


# ---- what is published ------------------------------------------------------------------------------


class Target:
    """What a run publishes into OUT_DIR."""

    shared = False  # several runs (pieces) must agree on one run id

    def files(self, plan: Plan) -> list[OutFile]:
        return list(plan.files)

    def tag(self, run_id: str) -> str:
        """The staging folder's name tag."""
        return run_id

    def joins(self, out_dir: Path, run_id: str) -> bool:
        """OUT_DIR may be written although it is not empty (and without --overwrite)."""
        return False

    def check(self, out_dir: Path, run_id: str) -> None:
        """Refuse OUT_DIR (with the lock held, before anything is written) where this target may not go."""

    def publish(self, plan: Plan, manifest: Manifest, staging: Staging, dest: Destination) -> SaveResult:
        raise NotImplementedError


class Whole(Target):
    def publish(self, plan: Plan, manifest: Manifest, staging: Staging, dest: Destination) -> Saved:
        staging.publish(plan, manifest)
        return Saved(plan, manifest, dest.display)


@dataclass(frozen=True)
class Piece(Target):
    """`--ranks`: some engine ranks' files, beside the other pieces of the same job in OUT_DIR."""

    ranks: list[int]
    shared = True

    @staticmethod
    def chosen(plan: Plan, spec: str | None) -> Piece | None:
        ranks = parse_ranks(spec, plan.layout.world)
        return Piece(ranks) if ranks is not None and len(ranks) < plan.layout.world else None

    def files(self, plan: Plan) -> list[OutFile]:
        return [f for f in plan.files if plan.engine_rank(f) in set(self.ranks)]

    def tag(self, run_id: str) -> str:
        return f"{run_id}-{ranks_tag(self.ranks)}"

    def joins(self, out_dir: Path, run_id: str) -> bool:
        return same_job(out_dir, run_id)

    def check(self, out_dir: Path, run_id: str) -> None:
        """A piece never touches a complete output, nor another job's pieces (even with --overwrite): it could
        only make the one incomplete until every other piece is rerun, and replace the other's copied files."""
        if (out_dir / MANIFEST).exists():
            raise OutputError(
                f"OUT_DIR {out_dir} holds a complete output ({MANIFEST}); a --ranks piece never replaces one",
                "write the pieces into an empty folder, then `reshard assemble` it (--overwrite does not change this)",
            )
        other = [p for p in read_pieces(out_dir) if p.run_id != run_id] if out_dir.is_dir() else []
        if other:
            raise OutputError(
                f"OUT_DIR {out_dir} holds --ranks pieces of another job (run {other[0].run_id}); a piece never "
                "joins another job's",
                "write this job's pieces into another folder, or remove that job's piece manifests and the files "
                "they list first (--overwrite does not change this)",
            )

    def publish(self, plan: Plan, manifest: Manifest, staging: Staging, dest: Destination) -> PieceSaved:
        assert dest.local is not None  # refused for buckets before anything was written
        folder, out_dir = staging.folder, dest.local
        piece = replace(manifest, ranks=tuple(self.ranks), all_files=tuple(f.name for f in plan.files))
        make_dir(out_dir)
        last = write_manifest(folder, piece, name=piece_manifest_name(ranks_tag(self.ranks)))
        move_into(folder, out_dir, [f.name for f in manifest.files] + list(manifest.copied), last=last)
        whole = assemble(out_dir, quiet=True)
        return PieceSaved(plan, self.ranks, len(manifest.files), whole, str(out_dir))


def _check_device(device: str) -> None:
    torch = import_torch(f"--device {device}")
    try:
        torch.empty(1, device=device)
    except Exception as e:
        raise UnsupportedError(f"--device {device} is not available here ({e})", "use --device cpu") from e
