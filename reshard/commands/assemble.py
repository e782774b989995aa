"""`reshard assemble OUT_DIR`."""

from __future__ import annotations

from pathlib import Path

import click

from reshard.commands.options import Location, json_option
from reshard.commands.save import plural
from reshard.console import emit_json, kept_notes, note, stdout
from reshard.names import MANIFEST
from reshard.serve import PLUGIN_NOTE
from reshard.vllm_versions import serve_note


@click.command(
    "assemble",
    epilog="Exit codes: 0 ok, 2 usage, 4 no piece manifest, 5 files missing, a file no piece lists or stdout cannot be written, 7 pieces damaged or of two jobs, 130 interrupted, 141 stdout closed by its reader (`reshard --help`).",
)
@click.argument("out_dir", type=Location(path_type=Path))  # missing: exit 4 (assemble), as a SOURCE
@json_option
def assemble_cmd(out_dir, as_json):
    """Write reshard.json for a folder filled by `save --ranks` pieces, once every file is in.

    Pieces copied together from several machines are checked to belong to one job (same run id).
    """
    from reshard.errors import SourceError
    from reshard.manifest.pieces import assemble
    from reshard.outdir import lock

    if not out_dir.is_dir():  # what it assembles from: not found is exit 4, as a SOURCE
        what = "is not a folder" if out_dir.exists() else "no such folder"
        raise SourceError(f"OUT_DIR {out_dir}: {what}", "give the folder the `save --ranks` pieces were copied into")
    with lock(out_dir):  # not while a `save --ranks` piece is moving its files in
        manifest = assemble(out_dir)
    assert manifest is not None
    spec = manifest.vllm_versions
    if as_json:
        emit_json(
            {
                "ok": True,
                "out_dir": str(out_dir),
                "manifest": str(out_dir / MANIFEST),
                "run_id": manifest.run_id,
                "files": len(manifest.files),
                "bytes": manifest.total_bytes,
                "serve": manifest.serve,
                "serve_reshard": manifest.serve_reshard,
                "vllm_versions": spec,
                "notes": kept_notes(),
            }
        )
        return
    stdout.print(f"assembled {plural(len(manifest.files), 'file')} into {out_dir / MANIFEST}")
    if spec:
        note(serve_note(spec))
    if manifest.serve_reshard:
        note(PLUGIN_NOTE)
    stdout.print(manifest.serve)
    if manifest.serve_reshard:
        stdout.print(manifest.serve_reshard)
