"""`save --ranks` pieces: their partial manifests, validated, and their assembly into `reshard.json`."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from reshard.errors import CorruptError, OutputError, SourceError
from reshard.format import read_header
from reshard.manifest import (
    FileRecord,
    Manifest,
    ManifestProblem,
    parse,
    piece_paths,
    read_json,
    read_manifest,
    write_manifest,
)
from reshard.manifest.schema import SourceFileRecord
from reshard.names import MANIFEST, PIECE_MANIFEST_GLOB, unlisted_rank_files
from reshard.serve import serve_in


def read_pieces(out_dir: Path) -> list[Manifest]:
    """The partial manifests of the `--ranks` pieces in `out_dir`, by name, each validated: a damaged
    one raises CorruptError (exit 7) naming it."""
    return [m for _, m in _read_pieces(out_dir)]


def _read_pieces(out_dir: Path) -> list[tuple[Path, Manifest]]:
    pieces = []
    for p in piece_paths(out_dir):
        try:
            piece = parse(read_json(p, follow=False))
        except (OSError, ValueError) as e:  # ManifestProblem is a ValueError
            why = str(e) if isinstance(e, ManifestProblem) else f"unreadable: {e}"
            raise CorruptError(
                f"{p}: damaged piece manifest ({why})",
                f"remove it and rerun that `reshard save --ranks` piece (its files are listed in {p.name})",
            ) from None
        if piece.ranks is None or piece.all_files is None:
            raise CorruptError(f"{p}: not a piece manifest (no ranks)", "remove it and rerun that --ranks piece")
        pieces.append((p, piece))
    return pieces


def same_job(out_dir: Path, run_id: str) -> bool:
    """A --ranks piece may join a folder that holds only other pieces of the same job."""
    if not out_dir.is_dir():
        return True
    pieces = read_pieces(out_dir)
    return bool(pieces) and all(p.run_id == run_id for p in pieces)


class Incomplete(CorruptError):
    """A piece lists a file that is not in the folder as it wrote it: the set is not complete."""


def assemble(out_dir: Path, *, quiet: bool = False) -> Manifest | None:
    """Combine the partial manifests of --ranks pieces into reshard.json once every file is in.

    Before anything is written or removed, every file a piece lists must be in the folder as that
    piece wrote it: a regular file of the recorded size whose header holds the job's run id. With
    `quiet`, a folder that is not complete yet gives None instead of an error.
    """
    pieces = _read_pieces(out_dir)
    if not pieces and not quiet and (out_dir / MANIFEST).exists():
        return read_manifest(out_dir)  # assembled already (a rerun after a kill that came just after it)
    if not pieces:
        if quiet:
            return None
        raise SourceError(
            f"{out_dir}: no {PIECE_MANIFEST_GLOB} piece manifests to assemble",
            "copy the folders `reshard save --ranks` wrote (files and piece manifests) into this one first",
        )
    first = pieces[0][1]
    if (out_dir / MANIFEST).exists():  # assembled already, its piece manifests not all removed (a kill between)
        whole = read_manifest(out_dir)
        if all(p.run_id == whole.run_id for _, p in pieces):
            for path, _ in pieces:
                path.unlink()
            return whole
    for path, p in pieces[1:]:
        if p.run_id != first.run_id:
            raise CorruptError(
                f"{out_dir}: pieces of two different jobs (run ids {first.run_id} in {pieces[0][0].name}, "
                f"{p.run_id} in {path.name})",
                "remove the other job's piece manifest and the files it lists, or rerun its ranks with this job's arguments",
            )
        if p.checksum != first.checksum:
            raise CorruptError(
                f"{out_dir}: pieces saved with different --checksum ({first.checksum}, {p.checksum} in {path.name})",
                "rerun the pieces with one --checksum",
            )
    source_files = _one_source(out_dir, pieces)
    try:
        entries = _entries(out_dir, pieces)
        missing = [n for n in first.all_files or () if n not in entries]
        if missing:
            raise _missing(out_dir, missing)
        _check_present(out_dir, first, entries)
        _check_unlisted(out_dir, first)
    except (OutputError, Incomplete):
        if quiet:
            return None
        raise
    files = tuple(entries[n][1] for n in first.all_files or ())
    whole = dataclasses.replace(
        first,
        files=files,
        total_bytes=sum(f.size for f in files),
        ranks=None,
        all_files=None,
        source_files=source_files,
        serve=serve_in(first.serve, str(out_dir)),
        serve_reshard=serve_in(first.serve_reshard, str(out_dir)) if first.serve_reshard else first.serve_reshard,
    )
    write_manifest(out_dir, whole)
    for p, _ in pieces:
        p.unlink()
    return whole


def _one_source(out_dir: Path, pieces: list[tuple[Path, Manifest]]) -> tuple[SourceFileRecord, ...] | None:
    """The pieces read one source: each source file of one size, and of one sha256 where pieces hashed it
    (the run id names the job's arguments and tensors, not their bytes: a piece made on a machine whose
    copy of the checkpoint differs would mix two models). The record of each file is its checked one."""
    seen: dict[str, tuple[Path, SourceFileRecord]] = {}
    for path, p in pieces:
        for f in p.source_files or ():
            was = seen.get(f.name)
            if was is not None and was[1].size != f.size:
                raise _two_sources(out_dir, f.name, f"{was[1].size} bytes", was[0], f"{f.size}", path)
            if was is not None and None not in (f.sha256, was[1].sha256) and f.sha256 != was[1].sha256:
                raise _two_sources(out_dir, f.name, f"sha256 {was[1].sha256}", was[0], f"{f.sha256}", path)
            if was is None or (was[1].sha256 is None and f.sha256 is not None):
                seen[f.name] = (path, f)
    if all(p.source_files is None for _, p in pieces):
        return None
    return tuple(f for _, f in seen.values())


def _two_sources(out_dir: Path, name: str, one: str, where: Path, other: str, there: Path) -> CorruptError:
    return CorruptError(
        f"{out_dir}: pieces of two different sources: {name} has {one} in {where.name}, {other} in {there.name}",
        "make every --ranks piece from the same copy of the checkpoint (check it with --source-sha256)",
    )


def _check_unlisted(out_dir: Path, first: Manifest) -> None:
    """No rank file the job does not list lies in the folder: vLLM would load it with its rank, and
    verify fails it (a stale part, another job's file)."""
    lay = first.layout
    unlisted = unlisted_rank_files(os.listdir(out_dir), set(first.all_files or ()), tp=lay.tp, pp=lay.pp)
    if unlisted:
        raise OutputError(
            f"{out_dir / unlisted[0]} is not a file of this job (no piece manifest lists it): vLLM would load it",
            "remove it, then assemble again",
        )


def _entries(out_dir: Path, pieces: list[tuple[Path, Manifest]]) -> dict[str, tuple[Path, FileRecord]]:
    """Each listed file with the piece manifest that lists it; two pieces that list one file
    differently: one of them is stale (an earlier run of that piece)."""
    entries: dict[str, tuple[Path, FileRecord]] = {}
    for path, piece in pieces:
        for f in piece.files:
            if f.name in entries and entries[f.name][1] != f:
                other = entries[f.name][0]
                raise Incomplete(
                    f"{out_dir}: {other.name} and {path.name} both list {f.name}, differently: one is stale",
                    "remove the stale piece manifest and rerun its --ranks piece",
                )
            entries.setdefault(f.name, (path, f))
    return entries


def _missing(out_dir: Path, missing: list[str]) -> OutputError:
    there = [n for n in missing if (out_dir / n).exists()]
    if there:
        return OutputError(
            f"{out_dir}: {there[0]} is in the folder but no piece manifest lists it"
            f" ({len(missing)} file(s) unlisted): the piece manifest that wrote it is missing",
            "rerun the --ranks piece that writes it",
        )
    return OutputError(
        f"{out_dir}: {len(missing)} file(s) not written yet, e.g. {missing[0]}", "run the missing --ranks"
    )


def _check_present(out_dir: Path, first: Manifest, entries: dict[str, tuple[Path, FileRecord]]) -> None:
    """Every listed rank file a regular file of its recorded size and run id; every copied file there."""
    for name, (piece, f) in entries.items():
        why = _differs(out_dir / name, f.size, first.run_id)
        if why:
            raise Incomplete(f"{out_dir}: {name}, listed by {piece.name}, {why}", "rerun that --ranks piece")
    for side in first.copied_files:
        why = _differs(out_dir / side.name, side.size, None)
        if why:
            raise Incomplete(f"{out_dir}: copied file {side.name} {why}", "rerun a --ranks piece: it copies them")


def _differs(path: Path, size: int, run_id: str | None) -> str | None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return "is missing"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size != size:
        return f"has {st.st_size} bytes, {size} recorded"
    if run_id is not None:
        try:
            _, meta, _ = read_header(path)
        except SourceError as e:
            return f"is damaged ({e.message})"
        if meta.get("reshard_run") != run_id:
            return f"belongs to another run ({meta.get('reshard_run')}, not {run_id})"
    return None
