"""Getting files into OUT_DIR safely, shared by `save` and `merge`.

A run writes everything into a temporary folder inside OUT_DIR (same filesystem, so publishing is
renames), then moves it into place; `save` writes its manifest last, so a folder without
`reshard.json` never looks complete.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable
from pathlib import Path

from reshard.errors import OutputError
from reshard.format import fsync_dir
from reshard.layout import INDEX, MANIFEST, TMP_PREFIX, WEIGHT_SUFFIXES, is_rank_file_name


def check_out_dir(out_dir: Path, source_root: Path | None, overwrite: bool) -> None:
    """Refuse an OUT_DIR inside the source (or around it), a file, or a non-empty folder unasked."""
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


def check_free_space(out_dir: Path, need: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise OutputError(
            f"not enough disk space in {out_dir}: need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free",
            "free space or choose another OUT_DIR",
        )


def side_files(root: Path) -> list[str]:
    """Non-weight files vLLM's example copies next to the rank files: config, tokenizer, generation
    config, ... (not weights, indexes, manifests or hidden files)."""
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name in (INDEX, MANIFEST) or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        if is_rank_file_name(p.name):
            continue
        out.append(p.name)
    return out


def copy_files(src: Path, names: Iterable[str], dst: Path) -> None:
    """Copy files (and folders) `names` from `src` into `dst`, keeping times and modes."""
    for name in names:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, dst / name, dirs_exist_ok=True)
        else:
            shutil.copy2(path, dst / name)


def publish(tmp: Path, out_dir: Path, names: Iterable[str], *, stale: Iterable[Path] = ()) -> None:
    """Remove `stale` (in order), then move `names` from `tmp` into `out_dir`, replacing what is there."""
    for old in stale:
        if old == tmp or not (old.exists() or old.is_symlink()):
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    for name in names:
        dst = out_dir / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        (tmp / name).replace(dst)
    fsync_dir(out_dir)


def temp_dir(out_dir: Path, tag: str) -> Path:
    """The temporary folder of one run inside OUT_DIR."""
    return out_dir / f"{TMP_PREFIX}{tag}"


def stale_temp_dirs(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob(f"{TMP_PREFIX}*"))


def write_error(out_dir: Path, e: OSError) -> OutputError:
    """An OSError while writing into OUT_DIR, as the user-facing error."""
    if e.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {out_dir}", "free space or choose another OUT_DIR")
    return OutputError(f"cannot write {out_dir}: {e.strerror or e}")
