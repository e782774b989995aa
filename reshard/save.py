"""`reshard save`: plan, stream into a temporary folder, then publish atomically, manifest last."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from reshard import __version__
from reshard.distributed import Group, parse_ranks, ranks_tag, shared_run_id
from reshard.errors import OutputError, ReshardError, SourceError
from reshard.execute import Executor
from reshard.format import fsync_dir
from reshard.io import FileReader
from reshard.manifest import MANIFEST, build_manifest, write_manifest
from reshard.plan import OutFile, Plan, build_plan
from reshard.source import INDEX, Checkpoint, open_checkpoint

TMP_PREFIX = ".reshard-tmp-"
SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


@dataclass
class SaveResult:
    plan: Plan
    manifest: dict
    out_dir: Path


def copy_list(root: Path) -> list[str]:
    """Non-weight files vLLM's example copies: config, tokenizer, generation config, ..."""
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name in (INDEX, MANIFEST) or p.name.endswith(SKIP_SUFFIXES):
            continue
        if p.name.startswith(("model-rank-", "model-pp-")):
            continue
        out.append(p.name)
    return out


def check_out_dir(out_dir: Path, source_root: Path | None, overwrite: bool) -> None:
    out = out_dir.resolve()
    if source_root is not None:
        src = source_root.resolve()
        if out == src or src in out.parents:
            raise OutputError(f"OUT_DIR {out_dir} is inside the source folder {source_root}", "write elsewhere")
        if out in src.parents:
            raise OutputError(f"the source folder {source_root} is inside OUT_DIR {out_dir}", "write elsewhere")
    if out.exists() and not out.is_dir():
        raise OutputError(f"OUT_DIR {out_dir} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"OUT_DIR {out_dir} is not empty", "pass --overwrite to replace its reshard files")


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
    on_plan: Callable[[Plan], Callable[[int], None] | None] | None = None,
    ckpt: Checkpoint | None = None,
) -> SaveResult:
    """Write every rank's files of `source` into `out_dir`; see `reshard save --help`.

    Under torchrun (WORLD_SIZE > 1) each process writes a disjoint share of the files and process 0
    publishes them and writes the manifest once all have finished. With `ranks` only those engine
    ranks' files are written, with a partial manifest; the full one appears when all pieces are in.
    """
    group = Group.from_env()
    try:
        return _save(
            group,
            source,
            out_dir,
            tp=tp,
            pp=pp,
            ep=ep,
            dtype=dtype,
            max_part_size=max_part_size,
            revision=revision,
            device=device,
            overwrite=overwrite,
            pp_partition=pp_partition,
            chunk_bytes=chunk_bytes,
            max_memory=max_memory,
            ranks=ranks,
            on_plan=on_plan,
            ckpt=ckpt,
        )
    finally:
        if group is not None:
            group.close()


def _save(
    group: Group | None,
    source: str,
    out_dir: Path,
    *,
    tp: int,
    pp: int,
    ep: bool,
    dtype: str,
    max_part_size: int,
    revision: str | None,
    device: str,
    overwrite: bool,
    pp_partition: list[int] | None,
    chunk_bytes: int | None,
    max_memory: int | None,
    ranks: str | None,
    on_plan: Callable[[Plan], Callable[[int], None] | None] | None,
    ckpt: Checkpoint | None,
) -> SaveResult:
    coordinator = group is None or group.rank == 0
    ckpt = ckpt or open_checkpoint(source, revision)
    assert ckpt.root is not None
    plan = build_plan(ckpt, tp=tp, pp=pp, ep=ep, dtype=dtype, max_part_size=max_part_size, pp_partition=pp_partition)
    world = plan.tp * plan.pp
    chosen = parse_ranks(ranks, world)
    piece = chosen is not None and len(chosen) < world
    wanted = set(chosen if chosen is not None else range(world))
    files = [f for f in plan.files if _engine_rank(plan, f) in wanted]
    # source headers as the original checkpoint had them, also when re-sharding an output
    source_tensors = (ckpt.manifest or {}).get("source_tensors") or {
        n: [t.dtype, list(t.shape)] for n, t in sorted(ckpt.tensors.items())
    }
    if piece or group is not None:
        run_id = shared_run_id(plan.source, plan.layout(), source_tensors, __version__)
    else:
        run_id = uuid.uuid4().hex
    error: BaseException | None = None
    if coordinator:
        try:
            check_out_dir(out_dir, ckpt.root, overwrite or (piece and _same_job(out_dir, run_id)))
            out_dir.mkdir(parents=True, exist_ok=True)
            need = sum(f.data_bytes for f in files)
            free = shutil.disk_usage(out_dir).free
            if free < need:
                raise OutputError(
                    f"not enough disk space in {out_dir}: need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
                    "free space or choose another OUT_DIR",
                )
            if device != "cpu":
                _check_device(device)
        except ReshardError as e:
            error = e
    if group is not None:
        error = group.broadcast(error)
    if error is not None:
        raise error
    tag = f"-{ranks_tag(chosen)}" if piece and chosen else ""
    tmp = out_dir / f"{TMP_PREFIX}{run_id}{tag}"
    if coordinator:
        tmp.mkdir(exist_ok=True)
    if group is not None:
        group.broadcast(None)  # barrier: the temporary folder exists
        mine = [f for f in files if _engine_rank(plan, f) % group.size == group.rank]
    else:
        mine = files
    progress = on_plan(replace(plan, files=mine)) if on_plan else None
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    meta = {"format": "pt", "reshard_run": run_id, "reshard_layout": _layout_tag(plan)}
    try:
        written, failure = [], None
        try:
            written = run_executor(
                replace(plan, files=mine),
                ckpt,
                tmp,
                meta,
                device=device,
                progress=progress,
                chunk_bytes=chunk_bytes,
                max_memory=max_memory,
            )
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
        if not coordinator:
            return SaveResult(plan, {}, out_dir)
        copied = _copy_side_files(ckpt, plan, tmp)
        manifest = build_manifest(
            plan,
            written,
            run_id=run_id,
            created=created,
            out_dir=str(out_dir),
            copied=copied,
            source_tensors=source_tensors,
        )
        if piece:
            manifest["ranks"] = chosen
            manifest["all_files"] = [f.name for f in plan.files]
            _publish(tmp, out_dir, [f.name for f in files] + copied, replace_old=False)
            write_manifest(out_dir, manifest, name=f"reshard.ranks-{ranks_tag(chosen)}.json")
            assembled = assemble(out_dir, quiet=True)
            manifest = assembled or manifest
        else:
            _publish(tmp, out_dir, [f.name for f in files] + copied)
            write_manifest(out_dir, manifest)
        fsync_dir(out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise OutputError(f"disk full while writing {out_dir}", "free space or choose another OUT_DIR") from e
        raise OutputError(f"cannot write {out_dir}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return SaveResult(plan, manifest, out_dir)


def _engine_rank(plan: Plan, f: OutFile) -> int:
    return f.pp_rank * plan.tp + f.tp_rank


def _same_job(out_dir: Path, run_id: str) -> bool:
    """A --ranks piece may join a folder that holds only other pieces of the same job."""
    if not out_dir.is_dir():
        return True
    pieces = list(out_dir.glob("reshard.ranks-*.json"))
    return bool(pieces) and all(json.loads(p.read_text()).get("run_id") == run_id for p in pieces)


def assemble(out_dir: Path, *, quiet: bool = False) -> dict | None:
    """Combine the partial manifests of --ranks pieces into reshard.json once every file is in."""
    pieces = [json.loads(p.read_text()) for p in sorted(out_dir.glob("reshard.ranks-*.json"))]
    if not pieces:
        if quiet:
            return None
        raise SourceError(f"{out_dir}: no reshard.ranks-*.json piece manifests to assemble")
    first = pieces[0]
    for p in pieces[1:]:
        if p["run_id"] != first["run_id"]:
            raise OutputError(f"{out_dir}: pieces of two different jobs (run ids {first['run_id']}, {p['run_id']})")
    entries = {f["name"]: f for p in pieces for f in p["files"]}
    missing = [n for n in first["all_files"] if n not in entries]
    if missing:
        if quiet:
            return None
        raise OutputError(
            f"{out_dir}: {len(missing)} file(s) not written yet, e.g. {missing[0]}", "run the missing --ranks"
        )
    manifest = {k: v for k, v in first.items() if k not in ("ranks", "all_files")}
    manifest["files"] = [entries[n] for n in first["all_files"]]
    manifest["total_bytes"] = sum(f["size"] for f in manifest["files"])
    write_manifest(out_dir, manifest)
    for p in out_dir.glob("reshard.ranks-*.json"):
        p.unlink()
    return manifest


def _copy_side_files(ckpt: Checkpoint, plan: Plan, tmp: Path) -> list[str]:
    assert ckpt.root is not None
    copied = copy_list(ckpt.root)
    for name in copied:
        src = ckpt.root / name
        if src.is_dir():
            shutil.copytree(src, tmp / name, dirs_exist_ok=True)
        elif name == "config.json" and plan.config_patch:
            config = {**ckpt.config, **plan.config_patch}
            if isinstance(config.get("text_config"), dict):
                config["text_config"] = {**config["text_config"], **plan.config_patch}
            (tmp / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copy2(src, tmp / name)
    return copied


def run_executor(
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    metadata: dict[str, str],
    *,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int | None = None,
    max_memory: int | None = None,
) -> list:
    kwargs: dict = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    if max_memory:
        kwargs["max_memory"] = max_memory
    # a reshard output as SOURCE brings its own reader (its tensors are read back out of its rank files)
    reader = ckpt.reader_factory() if ckpt.reader_factory else FileReader(ckpt.root)
    executor = Executor(plan, reader, ckpt.tensors, out, metadata=metadata, device=device, progress=progress, **kwargs)
    return executor.run()


def _layout_tag(plan: Plan) -> str:
    return f"tp={plan.tp},pp={plan.pp},ep={int(plan.ep)}"


def _check_device(device: str) -> None:
    import torch

    try:
        torch.empty(1, device=device)
    except Exception as e:
        raise OutputError(f"--device {device} is not available here ({e})", "use --device cpu") from e


def _publish(tmp: Path, out_dir: Path, names: list[str], *, replace_old: bool = True) -> None:
    """Replace the previous run's files: manifest gone first, so OUT never looks complete mid-way."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    if replace_old:
        for old in [*out_dir.glob("model-rank-*.safetensors"), *out_dir.glob("model-pp-*.safetensors")]:
            old.unlink()
        for old in [*out_dir.glob(f"{TMP_PREFIX}*"), *out_dir.glob("reshard.ranks-*.json")]:
            if old != tmp:
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    for name in names:
        dst = out_dir / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        (tmp / name).replace(dst)
