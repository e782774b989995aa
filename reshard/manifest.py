"""The manifest `reshard.json`: what a run wrote, with checksums and the layout. Written last.

One home for its schema (`Manifest`, `FileEntry`), reading, validating and writing it, and for the
partial manifests of `save --ranks` pieces and their assembly into the whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypedDict

from reshard import VLLM_VERSIONS, __version__
from reshard.errors import CorruptError, OutputError, SourceError
from reshard.format import fsync_dir
from reshard.hashing import FIELD, NONE, entry_digest, hash_file, manifest_algorithm
from reshard.names import MANIFEST, PIECE_MANIFEST_GLOB, parse_rank_file
from reshard.serve import PLUGIN_LOAD_FORMAT

FORMAT = "reshard-sharded-state"
FORMAT_VERSION = 1


class TensorEntry(TypedDict):
    name: str
    dtype: str  # safetensors code
    shape: list[int]


class Digests(TypedDict, total=False):
    """A file's digest, under the name of the manifest's `checksum` algorithm (none: no digest)."""

    blake3: str
    sha256: str


class FileEntry(Digests):
    name: str
    tp_rank: int
    pp_rank: int
    part: int
    size: int
    tensors: list[TensorEntry]


class SideFile(Digests):
    """A file reshard copied (config, tokenizer, ...), path relative to the output folder."""

    name: str
    size: int


class Manifest(TypedDict, total=False):
    format: str
    format_version: int
    reshard_version: str
    # the algorithm of every digest in it (reshard.hashing.ALGORITHMS); absent: sha256 (manifests
    # written before it was recorded)
    checksum: str
    run_id: str
    created: str
    source: dict  # {"path"} or {"repo_id", "revision", "commit"}; re-shards add "resharded_from"
    layout: dict  # Plan.layout(): vllm_layout, architecture, tp, pp, ep, dtype, quantization, pattern, ...
    # the vLLM releases that load this layout (reshard.VLLM_VERSIONS when written), e.g. ">=0.32,<0.34";
    # absent from manifests written before it was recorded (their layout.vllm_layout says)
    vllm_versions: str
    total_bytes: int
    files: list[FileEntry]
    copied: list[str]  # config, tokenizer and generation files copied from the source
    copied_files: list[SideFile]  # every file under `copied`, with its checksum (verify checks them)
    # the source's headers (name -> [dtype, shape]): with the copied config.json, enough to plan
    # this layout again and derive the expected keys (verify), without the source
    source_tensors: dict[str, list]
    serve: str
    serve_reshard: str  # the same with --load-format reshard (reshard.vllm_plugin); absent from older manifests
    notes: list[str]
    # a `save --ranks` piece's partial manifest only:
    ranks: list[int]
    all_files: list[str]


def with_digest(entry: dict, algorithm: str, digest: str | None) -> dict:
    """`entry` with `digest` under the algorithm's name (nothing added for `none`)."""
    if algorithm != NONE and digest is not None:
        entry[algorithm] = digest
    return entry


def side_file_entries(folder: Path, copied: list[str], algorithm: str) -> list[SideFile]:
    """Size and checksum of every regular file under the copied names (folders walked), sorted."""
    out: list[SideFile] = []
    for name in copied:
        top = folder / name
        paths = [top] if not top.is_dir() else [p for p in sorted(top.rglob("*")) if p.is_file()]
        for p in paths:
            if p.is_symlink():
                continue
            entry = {"name": p.relative_to(folder).as_posix(), "size": p.stat().st_size}
            out.append(with_digest(entry, algorithm, hash_file(p, algorithm)))  # type: ignore[arg-type]
    return out


def build_manifest(
    plan,
    written,
    *,
    run_id: str,
    created: str,
    out_dir: str,
    copied: list[str],
    source_tensors: dict,
    checksum: str,
    copied_files: list[SideFile] | None = None,
) -> Manifest:
    """The manifest of `written` (name, size, digest of each file, by `checksum`) for `plan` (a
    `reshard.plan.Plan`)."""
    sums = {w.name: w for w in written}
    files: list[FileEntry] = []
    for f in plan.files:
        if f.name not in sums:  # a --ranks piece holds only its own ranks' files
            continue
        w = sums[f.name]
        tensors: list[TensorEntry] = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in f.tensors]
        entry = {"name": f.name, "tp_rank": f.tp_rank, "pp_rank": f.pp_rank, "part": f.part, "size": w.size}
        files.append(with_digest({**entry, "tensors": tensors}, checksum, w.digest))  # type: ignore[arg-type]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "reshard_version": __version__,
        FIELD: checksum,  # type: ignore[misc]
        "run_id": run_id,
        "created": created,
        "source": plan.source,
        "layout": plan.layout(),
        "vllm_versions": VLLM_VERSIONS,
        "total_bytes": sum(w.size for w in written),
        "files": files,
        "copied": copied,
        "copied_files": copied_files or [],
        "source_tensors": source_tensors,
        "serve": plan.serve_command(out_dir),
        "serve_reshard": plan.serve_command(out_dir, load_format=PLUGIN_LOAD_FORMAT),
        "notes": plan.notes,
    }


def write_manifest(out_dir: Path, manifest: Manifest, name: str = MANIFEST) -> Path:
    """Write durably under a temporary name, then rename into place."""
    path = out_dir / name
    tmp = out_dir / f".{name}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(out_dir)
    return path


def read_manifest(out_dir: Path) -> Manifest:
    """The folder's manifest, validated enough to be used. Raises CorruptError saying what to do."""
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
    return obj  # type: ignore[return-value]


def manifest_problems(m: dict) -> list[str]:
    """What is wrong with a manifest's fields (types, ranges, file names), in order; [] when valid."""
    lay = m.get("layout")
    if not isinstance(lay, dict):
        return ["layout is not an object"]
    out = _layout_problems(lay)
    if not isinstance(m.get("run_id"), str):
        out.append("run_id is not a string")
    if "vllm_versions" in m and not isinstance(m["vllm_versions"], str):
        out.append(f"vllm_versions is {m['vllm_versions']!r}")
    try:
        algorithm = manifest_algorithm(m)
    except ValueError as e:
        return [*out, str(e)]
    files = m.get("files")
    if not isinstance(files, list):
        return [*out, "files is not a list"]
    seen: set[str] = set()
    for i, e in enumerate(files):
        out += _file_problems(i, e, seen, algorithm)
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


def _file_problems(i: int, e: object, seen: set[str], algorithm: str) -> list[str]:
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
    if algorithm != NONE and entry_digest(e, algorithm) is None:
        out.append(f"files[{i}].{algorithm} is {e.get(algorithm)!r}")
    ts = e.get("tensors")
    if not isinstance(ts, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
        and isinstance(t.get("shape"), list) for t in ts
    ):  # fmt: skip
        out.append(f"files[{i}].tensors is malformed")
    return out


# ---- `save --ranks` pieces ------------------------------------------------------------------------


def read_pieces(out_dir: Path) -> list[Manifest]:
    """The partial manifests of the `--ranks` pieces in `out_dir`, by name."""
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob(PIECE_MANIFEST_GLOB))]


def same_job(out_dir: Path, run_id: str) -> bool:
    """A --ranks piece may join a folder that holds only other pieces of the same job."""
    if not out_dir.is_dir():
        return True
    pieces = read_pieces(out_dir)
    return bool(pieces) and all(p.get("run_id") == run_id for p in pieces)


def assemble(out_dir: Path, *, quiet: bool = False) -> Manifest | None:
    """Combine the partial manifests of --ranks pieces into reshard.json once every file is in.

    With `quiet`, a folder that is not complete yet gives None instead of an error.
    """
    pieces = read_pieces(out_dir)
    if not pieces:
        if quiet:
            return None
        raise SourceError(f"{out_dir}: no {PIECE_MANIFEST_GLOB} piece manifests to assemble")
    first = pieces[0]
    for p in pieces[1:]:
        if p["run_id"] != first["run_id"]:
            raise OutputError(f"{out_dir}: pieces of two different jobs (run ids {first['run_id']}, {p['run_id']})")
        if p.get(FIELD) != first.get(FIELD):
            raise OutputError(
                f"{out_dir}: pieces saved with different --checksum ({first.get(FIELD)}, {p.get(FIELD)})",
                "rerun the pieces with one --checksum",
            )
    entries = {f["name"]: f for p in pieces for f in p["files"]}
    missing = [n for n in first["all_files"] if n not in entries]
    if missing:
        if quiet:
            return None
        raise OutputError(
            f"{out_dir}: {len(missing)} file(s) not written yet, e.g. {missing[0]}", "run the missing --ranks"
        )
    manifest: Manifest = {k: v for k, v in first.items() if k not in ("ranks", "all_files")}  # type: ignore[assignment]
    manifest["files"] = [entries[n] for n in first["all_files"]]
    manifest["total_bytes"] = sum(f["size"] for f in manifest["files"])
    write_manifest(out_dir, manifest)
    for p in out_dir.glob(PIECE_MANIFEST_GLOB):
        p.unlink()
    return manifest
