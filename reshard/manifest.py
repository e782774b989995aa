"""The manifest `reshard.json`: what a run wrote, with checksums and the layout. Written last."""

from __future__ import annotations

import json
import os
from pathlib import Path

from reshard import __version__
from reshard.errors import CorruptError

MANIFEST = "reshard.json"
FORMAT = "reshard-sharded-state"
FORMAT_VERSION = 1


def build_manifest(
    plan, written, *, run_id: str, created: str, out_dir: str, copied: list[str], source_tensors: dict
) -> dict:
    sums = {w.name: w for w in written}
    files = []
    for f in plan.files:
        if f.name not in sums:  # a --ranks piece holds only its own ranks' files
            continue
        w = sums[f.name]
        files.append(
            {
                "name": f.name,
                "tp_rank": f.tp_rank,
                "pp_rank": f.pp_rank,
                "part": f.part,
                "size": w.size,
                "sha256": w.sha256,
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in f.tensors],
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "reshard_version": __version__,
        "run_id": run_id,
        "created": created,
        "source": plan.source,
        "layout": plan.layout(),
        "total_bytes": sum(w.size for w in written),
        "files": files,
        "copied": copied,
        # the source's headers (name -> [dtype, shape]): with the copied config.json, enough to
        # plan this layout again and derive the expected keys (verify), without the source
        "source_tensors": source_tensors,
        "serve": plan.serve_command(out_dir),
        "notes": plan.notes,
    }


def write_manifest(out_dir: Path, manifest: dict, name: str = MANIFEST) -> Path:
    path = out_dir / name
    tmp = out_dir / f".{name}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptError(
            f"{out_dir}: no {MANIFEST}: not a complete reshard output",
            "rerun `reshard save`, or check a foreign folder with --against SOURCE --tp T",
        ) from None
    except (OSError, ValueError) as e:
        raise CorruptError(f"{path}: malformed manifest ({e})", "rerun `reshard save`") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CorruptError(f"{path}: not a reshard manifest", "rerun `reshard save`")
    if obj.get("format_version") != FORMAT_VERSION:
        raise CorruptError(f"{path}: manifest format version {obj.get('format_version')} is not {FORMAT_VERSION}")
    for key in ("layout", "files", "run_id", "source"):
        if key not in obj:
            raise CorruptError(f"{path}: malformed manifest (no {key!r})", "rerun `reshard save`")
    return obj
