"""`reshard save`: plan, stream into a temporary folder, then publish atomically, manifest last."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import OutputError
from reshard.execute import Executor
from reshard.format import fsync_dir
from reshard.manifest import MANIFEST, build_manifest, write_manifest
from reshard.plan import Plan, build_plan
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
    on_plan: Callable[[Plan], Callable[[int], None] | None] | None = None,
    ckpt: Checkpoint | None = None,
) -> SaveResult:
    """Write every rank's files of `source` into `out_dir`; see `reshard save --help`."""
    ckpt = ckpt or open_checkpoint(source, revision)
    assert ckpt.root is not None
    plan = build_plan(ckpt, tp=tp, pp=pp, ep=ep, dtype=dtype, max_part_size=max_part_size, pp_partition=pp_partition)
    check_out_dir(out_dir, ckpt.root, overwrite)
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < plan.total_bytes:
        raise OutputError(
            f"not enough disk space in {out_dir}: need {plan.total_bytes / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
            "free space or choose another OUT_DIR",
        )
    if device != "cpu":
        _check_device(device)
    progress = on_plan(plan) if on_plan else None
    run_id = uuid.uuid4().hex
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    tmp = out_dir / f"{TMP_PREFIX}{run_id}"
    tmp.mkdir()
    try:
        meta = {"format": "pt", "reshard_run": run_id, "reshard_layout": _layout_tag(plan)}
        written = run_executor(plan, ckpt, tmp, meta, device=device, progress=progress, chunk_bytes=chunk_bytes)
        copied = copy_list(ckpt.root)
        for name in copied:
            src = ckpt.root / name
            if src.is_dir():
                shutil.copytree(src, tmp / name)
            elif name == "config.json" and plan.config_patch:
                config = {**ckpt.config, **plan.config_patch}
                if isinstance(config.get("text_config"), dict):
                    config["text_config"] = {**config["text_config"], **plan.config_patch}
                (tmp / name).write_text(json.dumps(config, indent=2) + "\n")
            else:
                shutil.copy2(src, tmp / name)
        source_tensors = {n: [t.dtype, list(t.shape)] for n, t in sorted(ckpt.tensors.items())}
        manifest = build_manifest(
            plan,
            written,
            run_id=run_id,
            created=created,
            out_dir=str(out_dir),
            copied=copied,
            source_tensors=source_tensors,
        )
        _publish(tmp, out_dir, [f.name for f in plan.files] + copied)
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


def run_executor(
    plan: Plan,
    ckpt: Checkpoint,
    out: Path,
    metadata: dict[str, str],
    *,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int | None = None,
) -> list:
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    executor = Executor(
        plan, ckpt.root, ckpt.tensors, out, metadata=metadata, device=device, progress=progress, **kwargs
    )
    if ckpt.reader_factory:  # SOURCE is a reshard output: read tensors back out of its rank files
        executor.reader = ckpt.reader_factory()
    return executor.run()


def _layout_tag(plan: Plan) -> str:
    return f"tp={plan.tp},pp={plan.pp},ep={int(plan.ep)}"


def _check_device(device: str) -> None:
    import torch

    try:
        torch.empty(1, device=device)
    except Exception as e:
        raise OutputError(f"--device {device} is not available here ({e})", "use --device cpu") from e


def _publish(tmp: Path, out_dir: Path, names: list[str]) -> None:
    """Replace the previous run's files: manifest gone first, so OUT never looks complete mid-way."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for old in list(out_dir.glob("model-rank-*.safetensors")) + list(out_dir.glob("model-pp-*.safetensors")):
        old.unlink()
    for old in out_dir.glob(f"{TMP_PREFIX}*"):
        if old != tmp:
            shutil.rmtree(old, ignore_errors=True)
    for name in names:
        dst = out_dir / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        (tmp / name).replace(dst)
