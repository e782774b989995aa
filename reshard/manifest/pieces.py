"""`save --ranks` pieces: their partial manifests, validated, and their assembly into `reshard.json`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from reshard.errors import CorruptError, OutputError, SourceError
from reshard.manifest import Manifest, ManifestProblem, parse, piece_paths, read_json, write_manifest
from reshard.names import PIECE_MANIFEST_GLOB


def read_pieces(out_dir: Path) -> list[Manifest]:
    """The partial manifests of the `--ranks` pieces in `out_dir`, by name, each validated: a damaged
    one raises CorruptError (exit 7) naming it."""
    pieces = []
    for p in piece_paths(out_dir):
        try:
            piece = parse(read_json(p))
        except (OSError, ValueError) as e:  # ManifestProblem is a ValueError
            why = str(e) if isinstance(e, ManifestProblem) else f"unreadable: {e}"
            raise CorruptError(
                f"{p}: damaged piece manifest ({why})",
                f"remove it and rerun that `reshard save --ranks` piece (its files are listed in {p.name})",
            ) from None
        if piece.ranks is None or piece.all_files is None:
            raise CorruptError(f"{p}: not a piece manifest (no ranks)", "remove it and rerun that --ranks piece")
        pieces.append(piece)
    return pieces


def same_job(out_dir: Path, run_id: str) -> bool:
    """A --ranks piece may join a folder that holds only other pieces of the same job."""
    if not out_dir.is_dir():
        return True
    pieces = read_pieces(out_dir)
    return bool(pieces) and all(p.run_id == run_id for p in pieces)


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
        if p.run_id != first.run_id:
            raise OutputError(f"{out_dir}: pieces of two different jobs (run ids {first.run_id}, {p.run_id})")
        if p.checksum != first.checksum:
            raise OutputError(
                f"{out_dir}: pieces saved with different --checksum ({first.checksum}, {p.checksum})",
                "rerun the pieces with one --checksum",
            )
    entries = {f.name: f for p in pieces for f in p.files}
    missing = [n for n in first.all_files or () if n not in entries]
    if missing:
        if quiet:
            return None
        raise OutputError(
            f"{out_dir}: {len(missing)} file(s) not written yet, e.g. {missing[0]}", "run the missing --ranks"
        )
    files = tuple(entries[n] for n in first.all_files or ())
    whole = dataclasses.replace(first, files=files, total_bytes=sum(f.size for f in files), ranks=None, all_files=None)
    write_manifest(out_dir, whole)
    for p in piece_paths(out_dir):
        p.unlink()
    return whole
