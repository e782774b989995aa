"""The manifest `reshard.json`: what a run wrote, with checksums and the layout. Written last.

One home for its schema (`schema.py`: typed records, parsed and validated, written back), reading and
writing it durably (here), and the partial manifests of `save --ranks` pieces and their assembly into
the whole (`pieces.py`). Nothing outside this package reads a manifest's keys.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from reshard import VLLM_LAYOUT, VLLM_VERSIONS, __version__
from reshard.bulk import paused_gc
from reshard.errors import CorruptError, OutputError, permission_denied
from reshard.format import fsync_dir, open_regular, read_at_most
from reshard.hashing import hash_file
from reshard.manifest.schema import (
    FORMAT,
    FORMAT_VERSION,
    FileRecord,
    Manifest,
    ManifestProblem,
    SideRecord,
    TensorRecord,
    parse,
)
from reshard.manifest.text import manifest_text
from reshard.names import MANIFEST, PIECE_MANIFEST_GLOB
from reshard.serve import PLUGIN_LOAD_FORMAT

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "FileRecord",
    "Manifest",
    "ManifestProblem",
    "SideRecord",
    "TensorRecord",
    "build_manifest",
    "manifest_bytes",
    "parse",
    "parse_manifest",
    "read_json",
    "read_manifest",
    "side_file_entries",
    "write_manifest",
]


def side_file_entries(folder: Path, copied: list[str], algorithm: str) -> list[SideRecord]:
    """Size and checksum of every regular file under the copied names (folders walked), sorted."""
    out: list[SideRecord] = []
    for name in copied:
        top = folder / name
        paths = [top] if not top.is_dir() else [p for p in sorted(top.rglob("*")) if p.is_file()]
        for p in paths:
            if p.is_symlink():
                continue
            out.append(SideRecord(p.relative_to(folder).as_posix(), p.stat().st_size, hash_file(p, algorithm)))
    return out


def build_manifest(
    plan,
    written,
    *,
    run_id: str,
    created: str,
    out_dir: str,
    copied: list[str],
    source_tensors: dict[str, tuple[str, tuple[int, ...]]],
    checksum: str,
    copied_files: list[SideRecord] | None = None,
) -> Manifest:
    """The manifest of `written` (name, size, digest of each file, by `checksum`) for `plan` (a
    `reshard.plan.Plan`); a `--ranks` piece lists only the files it wrote."""
    sums = {w.name: w for w in written}
    files = []
    for f in plan.files:
        if f.name in sums:
            tensors = tuple(TensorRecord(t.name, t.dtype, tuple(t.shape)) for t in f.tensors)
            files.append(
                FileRecord(f.name, f.tp_rank, f.pp_rank, f.part, sums[f.name].size, sums[f.name].digest, tensors)
            )
    return Manifest(
        run_id=run_id,
        source=plan.source,
        architecture=plan.architecture,
        layout=plan.layout,
        files=tuple(files),
        checksum=checksum,
        reshard_version=__version__,
        created=created,
        vllm_layout=VLLM_LAYOUT,
        vllm_versions=VLLM_VERSIONS,
        total_bytes=sum(w.size for w in written),
        copied=tuple(copied),
        copied_files=tuple(copied_files or ()),
        source_tensors=source_tensors,
        serve=plan.serve_command(out_dir),
        serve_reshard=plan.serve_command(out_dir, load_format=PLUGIN_LOAD_FORMAT),
        notes=tuple(plan.notes),
    )


def write_manifest(out_dir: Path, manifest: Manifest, name: str = MANIFEST) -> Path:
    """Write durably under a temporary name, then rename into place. The temporary file is created
    new (O_EXCL|O_NOFOLLOW): a stale one is removed first (a file, or a link, never what it points
    to), so nothing planted there makes the manifest be written outside `out_dir`."""
    path = out_dir / name
    tmp = out_dir / f".{name}.tmp"
    with os.fdopen(_create_new(tmp), "wb") as f:
        f.write(manifest_bytes(manifest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(out_dir)
    return path


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written to a file or an object: `json.dumps(manifest.to_json(), indent=1)` and a
    line break, its tensors formatted in bulk (reshard.manifest.text)."""
    with paused_gc():
        return (manifest_text(manifest) + "\n").encode()


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _create_new(path: Path) -> int:
    try:
        return os.open(path, _NEW, 0o644)
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
        raise OutputError(f"{path} is in the way (not a file reshard left)", "remove it, then rerun")
    path.unlink()  # a stale temporary file, or a link: the link goes, its target is not touched
    return os.open(path, _NEW, 0o644)


MAX_MANIFEST = 1 << 30  # bytes: a manifest of a million tensors is a few hundred MB


def read_json(path: Path, *, follow: bool = True) -> object:
    """A JSON file (a manifest, config.json): a regular file (a FIFO is refused, not waited on; with
    `follow` False a symlink too: a manifest must lie in its folder) of at most MAX_MANIFEST bytes.
    Raises OSError (FileNotFoundError when absent) or ValueError saying what is wrong."""
    with os.fdopen(open_regular(path, follow=follow), "rb") as f:
        raw = read_at_most(f, MAX_MANIFEST)
    if len(raw) > MAX_MANIFEST:
        raise ValueError(f"larger than {MAX_MANIFEST} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None
    except MemoryError:  # millions of tiny values: what they take in memory is many times their bytes
        raise ValueError(f"{len(raw)} bytes of JSON that do not fit in memory") from None


def read_manifest(out_dir: Path, name: str = MANIFEST) -> Manifest:
    """The folder's manifest, validated. Raises CorruptError saying what to do."""
    path = out_dir / name
    try:
        obj = read_json(path, follow=False)
    except FileNotFoundError:
        raise CorruptError(
            f"{out_dir}: no {MANIFEST}: not a complete reshard output",
            "rerun `reshard save`, or check a foreign folder with --against SOURCE --tp T",
        ) from None
    except PermissionError:
        raise CorruptError(*permission_denied(path)) from None
    except (OSError, ValueError) as e:
        raise CorruptError(f"{path}: malformed manifest ({e})", "rerun `reshard save`") from e
    try:
        return parse(obj)
    except ManifestProblem as e:
        what = "not a reshard manifest" if str(e) == "not a reshard manifest" else f"malformed manifest ({e})"
        raise CorruptError(f"{path}: {what}", "rerun `reshard save`") from None


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A manifest read from elsewhere (an object in a bucket: `where`), validated like `read_manifest`."""
    try:
        if len(raw) > MAX_MANIFEST:
            raise ValueError(f"larger than {MAX_MANIFEST} bytes")
        return parse(json.loads(raw))
    except (ValueError, RecursionError, ManifestProblem) as e:
        raise CorruptError(f"{where}: malformed manifest ({e})", "rerun `reshard save`") from None


def piece_paths(out_dir: Path) -> list[Path]:
    """The partial manifests of `--ranks` pieces in `out_dir`, by name."""
    return sorted(out_dir.glob(PIECE_MANIFEST_GLOB))
