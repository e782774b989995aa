"""The manifest `reshard.json`: what a run wrote, with checksums and the layout. Written last."""

from __future__ import annotations

import json
import os
from pathlib import Path

from reshard import __version__
from reshard.errors import CorruptError
from reshard.layout import parse_rank_file

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
    problems = manifest_problems(obj)
    if problems:
        raise CorruptError(f"{path}: malformed manifest ({problems[0]})", "rerun `reshard save`")
    return obj


def manifest_problems(m: dict) -> list[str]:
    """What is wrong with a manifest's fields (types, ranges, file names), in order; [] when valid."""
    lay = m.get("layout")
    if not isinstance(lay, dict):
        return ["layout is not an object"]
    out = _layout_problems(lay)
    if not isinstance(m.get("run_id"), str):
        out.append("run_id is not a string")
    files = m.get("files")
    if not isinstance(files, list):
        return [*out, "files is not a list"]
    seen: set[str] = set()
    for i, e in enumerate(files):
        out += _file_problems(i, e, seen)
    src = m.get("source_tensors")
    if src is not None and not isinstance(src, dict):
        out.append("source_tensors is not an object")
    return out


def _layout_problems(lay: dict) -> list[str]:
    out = []
    for k in ("tp", "pp"):
        if not isinstance(lay.get(k), int) or lay[k] < 1:
            out.append(f"layout.{k} is {lay.get(k)!r}")
    if not isinstance(lay.get("ep"), bool):
        out.append(f"layout.ep is {lay.get('ep')!r}")
    part = lay.get("pp_layer_partition")
    if part is not None and (not isinstance(part, list) or not all(isinstance(x, int) for x in part)):
        out.append(f"layout.pp_layer_partition is {part!r}")
    return out


def _file_problems(i: int, e: object, seen: set[str]) -> list[str]:
    """Problems of the manifest's files[i]; adds its name to `seen` (a name listed twice is one)."""
    if not isinstance(e, dict):
        return [f"files[{i}] is not an object"]
    out = []
    name = e.get("name")
    if not isinstance(name, str) or parse_rank_file(name) is None:
        out.append(f"files[{i}].name {name!r} is not a rank file name")
    elif name in seen:
        out.append(f"{name} is listed twice")
    else:
        seen.add(name)
    for k in ("tp_rank", "pp_rank", "part", "size"):
        if not isinstance(e.get(k), int) or e[k] < 0:
            out.append(f"files[{i}].{k} is {e.get(k)!r}")
    if not isinstance(e.get("sha256"), str):
        out.append(f"files[{i}].sha256 is {e.get('sha256')!r}")
    ts = e.get("tensors")
    if not isinstance(ts, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list) for t in ts
    ):  # fmt: skip
        out.append(f"files[{i}].tensors is malformed")
    return out
