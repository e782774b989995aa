"""`reshard save`: plan, stream into a temporary folder, then publish, manifest last.

One job may be split across processes: under torchrun (WORLD_SIZE > 1) each process writes a
disjoint share of the files and process 0 publishes them and writes the manifest once all have
finished; with `ranks`, only those engine ranks' files are written, with a partial manifest (the
full one appears when all pieces are in, `reshard.manifest.assemble`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from pathlib import Path

from reshard import __version__
from reshard.checkpoint import Checkpoint, Source
from reshard.distributed import Group, parse_ranks, ranks_tag, shared_run_id
from reshard.errors import OutputError, ReshardError
from reshard.execute import Executor
from reshard.hashing import DEFAULT as DEFAULT_CHECKSUM
from reshard.manifest import (
    Manifest,
    assemble,
    build_manifest,
    read_manifest,
    same_job,
    side_file_entries,
    write_manifest,
)
from reshard.names import MANIFEST, PIECE_MANIFEST_GLOB, is_rank_file_name, piece_manifest_name
from reshard.plan import OutFile, Plan, build_plan
from reshard.publish import (
    check_free_space,
    check_out_dir,
    copy_files,
    lock,
    make_dir,
    move_into,
    recover,
    side_files,
    staging_dir,
    swap_in,
    write_error,
)
from reshard.sources import open_source

Progress = Callable[[int], None]


@dataclass
class SaveResult:
    plan: Plan
    manifest: Manifest | dict
    out_dir: Path


@dataclass
class _Job:
    """What one save writes: the plan, the files of the chosen ranks, and the run's identity."""

    source: Source
    plan: Plan
    files: list[OutFile]
    chosen: list[int] | None  # --ranks, or None for all
    run_id: str
    source_tensors: dict
    checksum: str = DEFAULT_CHECKSUM

    @property
    def ckpt(self) -> Checkpoint:
        return self.source.checkpoint

    @property
    def piece(self) -> bool:
        return self.chosen is not None and len(self.chosen) < self.plan.tp * self.plan.pp


def save(
    source: str,
    out_dir: Path,
    *,
    tp: int,
    pp: int = 1,
    ep: bool = False,
    dtype: str = "auto",
    max_part_size: int,
    revision: str | None = None,
    device: str = "cpu",
    overwrite: bool = False,
    pp_partition: list[int] | None = None,
    chunk_bytes: int | None = None,
    max_memory: int | None = None,
    ranks: str | None = None,
    on_plan: Callable[[Plan, Source], Progress | None] | None = None,
    moe_backend: str = "auto",
    stream: bool = False,
    checksum: str = DEFAULT_CHECKSUM,
) -> SaveResult:
    """Write every rank's files of `source` into `out_dir`; see `reshard save --help`."""
    group = Group.from_env()
    coordinator = group is None or group.rank == 0
    try:
        src = open_source(source, revision, stream=stream)
        plan = build_plan(
            src.checkpoint,
            tp=tp,
            pp=pp,
            ep=ep,
            dtype=dtype,
            max_part_size=max_part_size,
            pp_partition=pp_partition,
            moe_backend=moe_backend,
        )
        job = replace(_job(src, plan, ranks, group), checksum=checksum)
        staged = staging_dir(out_dir, job.run_id + (f"-{ranks_tag(job.chosen)}" if job.piece and job.chosen else ""))
        with contextlib.ExitStack() as held:  # process 0 holds OUT_DIR's lock until it has published
            _check_output(job, group, out_dir, staged, held, overwrite=overwrite, device=device)
            try:
                mine = job.files
                if group is not None:
                    group.broadcast(None)  # barrier: the staging folder exists
                    mine = [f for f in job.files if _engine_rank(plan, f) % group.size == group.rank]
                progress = on_plan(replace(plan, files=mine), src) if on_plan else None
                written = _write(job, group, mine, staged, device=device, progress=progress,
                                 chunk_bytes=chunk_bytes, max_memory=max_memory)  # fmt: skip
                if group is not None and group.rank != 0:
                    return SaveResult(plan, {}, out_dir)  # process 0 publishes
                manifest = _finish(job, written, staged, out_dir)
            except OSError as e:
                raise write_error(out_dir, e) from e
            finally:
                if coordinator:
                    shutil.rmtree(staged, ignore_errors=True)
        return SaveResult(plan, manifest, out_dir)
    finally:
        if group is not None:
            group.close()


def _job(src: Source, plan: Plan, ranks: str | None, group: Group | None) -> _Job:
    ckpt = src.checkpoint
    world = plan.tp * plan.pp
    chosen = parse_ranks(ranks, world)
    wanted = set(chosen if chosen is not None else range(world))
    files = [f for f in plan.files if _engine_rank(plan, f) in wanted]
    # source headers as the original checkpoint had them, also when re-sharding an output
    source_tensors = (ckpt.manifest or {}).get("source_tensors") or {
        n: [t.dtype, list(t.shape)] for n, t in sorted(ckpt.tensors.items())
    }
    piece = chosen is not None and len(chosen) < world
    if piece or group is not None:  # every process / piece of one job must agree on it
        run_id = shared_run_id(plan.source, plan.layout(), source_tensors, __version__)
    else:
        run_id = uuid.uuid4().hex
    return _Job(src, plan, files, chosen, run_id, source_tensors)


def _check_output(
    job: _Job, group: Group | None, out_dir: Path, staged: Path, held: contextlib.ExitStack, *, overwrite: bool,
    device: str,
) -> None:  # fmt: skip
    """Process 0 takes OUT_DIR's lock, checks it (and the device) and makes the staging folder; every
    process raises the same error (under torchrun, none is left waiting for the others)."""
    error: BaseException | None = None
    if group is None or group.rank == 0:
        try:
            held.enter_context(lock(out_dir))
            recover(out_dir)  # first: a folder an interrupted swap took away is put back
            check_out_dir(out_dir, job.ckpt.root, overwrite or (job.piece and same_job(out_dir, job.run_id)))
            make_dir(out_dir.resolve().parent)
            check_free_space(out_dir.resolve().parent, sum(f.data_bytes for f in job.files))
            if device != "cpu":
                _check_device(device)
            make_dir(staged)
        except ReshardError as e:
            error = e
    if group is not None:
        error = group.broadcast(error)
    if error is not None:
        raise error


def _write(
    job: _Job, group: Group | None, mine: list[OutFile], tmp: Path, *, device: str, progress: Progress | None,
    chunk_bytes: int | None, max_memory: int | None,
) -> list:  # fmt: skip
    """Stream this process's files; under torchrun, every process's results (or first failure)."""
    meta = {"format": "pt", "reshard_run": job.run_id, "reshard_layout": _layout_tag(job.plan)}
    written, failure = [], None
    try:
        written = run_executor(replace(job.plan, files=mine), job.source, tmp, meta, device=device, progress=progress,
                               chunk_bytes=chunk_bytes, max_memory=max_memory, checksum=job.checksum)  # fmt: skip
    except (ReshardError, OSError) as e:
        failure = e
    if group is not None:
        results = group.gather((written, failure))
        failures = [f for _, f in results if f is not None]
        if failures:
            failure = failure or failures[0]
        written = [w for ws, _ in results for w in ws]
    if failure is not None:
        raise failure
    return written


def _finish(job: _Job, written: list, staged: Path, out_dir: Path) -> Manifest:
    """Copy the side files and the manifest into `staged`, then publish it as OUT_DIR (a piece's
    files join the others' instead; the manifest is assembled once every piece is in)."""
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    copied = _copy_side_files(job.ckpt, job.plan, staged)
    manifest = build_manifest(job.plan, written, run_id=job.run_id, created=created, out_dir=str(out_dir),
                              copied=copied, source_tensors=job.source_tensors, checksum=job.checksum,
                              copied_files=side_file_entries(staged, copied, job.checksum))  # fmt: skip
    if job.piece:
        assert job.chosen is not None
        manifest["ranks"] = job.chosen
        manifest["all_files"] = [f.name for f in job.plan.files]
        make_dir(out_dir)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        move_into(staged, out_dir, [f.name for f in job.files] + copied)
        write_manifest(out_dir, manifest, name=piece_manifest_name(ranks_tag(job.chosen)))
        return assemble(out_dir, quiet=True) or manifest
    write_manifest(staged, manifest)
    swap_in(staged, out_dir, ours=_ours(out_dir), synced=[f.name for f in job.files])
    return manifest


def _ours(out_dir: Path) -> Callable[[str], bool]:
    """The names of OUT_DIR that an earlier reshard run wrote (the rest is kept when overwriting)."""
    copied: set[str] = set()
    with contextlib.suppress(ReshardError, OSError, TypeError, AttributeError):
        copied = set(read_manifest(out_dir).get("copied") or [])

    def ours(name: str) -> bool:
        return is_rank_file_name(name) or name == MANIFEST or name in copied or fnmatch(name, PIECE_MANIFEST_GLOB)

    return ours


def _engine_rank(plan: Plan, f: OutFile) -> int:
    return f.pp_rank * plan.tp + f.tp_rank


def _copy_side_files(ckpt: Checkpoint, plan: Plan, tmp: Path) -> list[str]:
    """Config, tokenizer and generation files; config.json with the plan's patch applied."""
    assert ckpt.root is not None
    copied = side_files(ckpt.root)
    plain = [n for n in copied if not (n == "config.json" and plan.config_patch)]
    copy_files(ckpt.root, plain, tmp)
    if len(plain) < len(copied):
        config = {**ckpt.config, **plan.config_patch}
        if isinstance(config.get("text_config"), dict):
            config["text_config"] = {**config["text_config"], **plan.config_patch}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return copied


def run_executor(
    plan: Plan,
    source: Source,
    out: Path,
    metadata: dict[str, str],
    *,
    device: str = "cpu",
    progress: Progress | None = None,
    chunk_bytes: int | None = None,
    max_memory: int | None = None,
    checksum: str = DEFAULT_CHECKSUM,
) -> list:
    """Write `plan`'s files into `out`, reading through the source's own reader."""
    kwargs: dict = {"chunk_bytes": chunk_bytes, "checksum": checksum} if chunk_bytes else {"checksum": checksum}
    if max_memory:
        kwargs["max_memory"] = max_memory
    ckpt = source.checkpoint
    executor = Executor(plan, source.open_reader(), ckpt.tensors, out, metadata=metadata, device=device,
                        progress=progress, **kwargs)  # fmt: skip
    written = executor.run()
    source.finish()  # a source that stored what it read completes its copy (Source.finish)
    return written


def _layout_tag(plan: Plan) -> str:
    return f"tp={plan.tp},pp={plan.pp},ep={int(plan.ep)}"


def _check_device(device: str) -> None:
    import torch

    try:
        torch.empty(1, device=device)
    except Exception as e:
        raise OutputError(f"--device {device} is not available here ({e})", "use --device cpu") from e
