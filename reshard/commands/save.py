"""`reshard save SOURCE OUT_DIR`."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import click

from reshard import VLLM_VERSIONS
from reshard.commands.options import (
    ByteSize,
    Location,
    json_option,
    layout_options,
    revision_option,
    trust_remote_code_option,
)
from reshard.console import byte_progress, emit_json, human_bytes, kept_notes, note, release_notes, stdout
from reshard.distributed import ranks_text
from reshard.hashing import ALGORITHMS
from reshard.hashing import DEFAULT as DEFAULT_CHECKSUM
from reshard.names import DEFAULT_MAX_PART, MANIFEST
from reshard.serve import PLUGIN_NOTE
from reshard.vllm_versions import serve_note


@click.command(
    "save",
    epilog="Exit codes: 0 ok, 2 usage, 3 unsupported model or layout, 4 bad source, 5 output refused (not empty, disk full, locked, store errors) or stdout cannot be written, 7 an output used as SOURCE is corrupt or incomplete, 130 interrupted, 141 stdout closed by its reader (`reshard --help`).",
)
@click.argument("source", type=Location())  # a folder, a repo id or s3://...: completed as a path
@click.argument("out_dir", type=Location())  # a folder (a file: refused, exit 5) or s3://bucket/prefix/
@layout_options
@click.option(
    "--max-part-size",
    type=ByteSize(),
    default=DEFAULT_MAX_PART,
    show_default="5GiB",
    help="Split each rank's tensors into files holding at most this many bytes of tensor data (each "
    "file adds its header, a few KB; vLLM's save_sharded_state counts the same way). A tensor larger "
    "than this gets a file of its own.",
)
@click.option(
    "--max-memory",
    type=ByteSize(
        16 * 2**20, "the least a save can keep to (two read buffers and the metadata); the default is 512MiB"
    ),
    default="512MiB",
    show_default=True,
    help="Bound on what a save holds in memory (at least 16MiB): the checkpoint's metadata (headers, plan) and "
    "tensor data (read-ahead and write buffers, which get what the metadata leaves, at least a quarter); each open "
    "output file adds 8 MiB (to s3://, a part buffer of RESHARD_S3_PART_SIZE, 16 MiB by default, with "
    "RESHARD_S3_CONCURRENCY parts in flight).",
)
@click.option(
    "--checksum",
    type=click.Choice(ALGORITHMS),
    default=DEFAULT_CHECKSUM,
    show_default=True,
    help="Each file's digest in reshard.json, computed while writing (verify checks it): blake3 is "
    "fast; sha256 for `sha256sum -c`; none records sizes only.",
)
@revision_option
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where each piece is materialised before writing; cpu needs no GPU.",
)
@click.option(
    "--stream",
    is_flag=True,
    help="Repo ids: store nothing of the source; its bytes go from the Hub into the rank files "
    "through the --max-memory window (default: kept once in the HF cache as they arrive).",
)
@click.option(
    "--source-sha256",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Local folders: a `sha256sum` file (`<hex>  <name>` lines) every safetensors file is checked "
    "against, by one hashing pass before the save reads it (exit 4 naming a file that differs). "
    "Without it, .cache/huggingface metadata left by `hf download --local-dir` is used, else the "
    "manifest records the files as unchecked. Repo ids are always checked against the Hub's LFS sha256.",
)
@click.option("--overwrite", is_flag=True, help="Replace the reshard files of a non-empty OUT_DIR.")
@click.option(
    "--ranks",
    metavar="LIST",
    help="Write only these engine ranks (e.g. 0-3 or 0,2,5-7; rank = pp_rank * tp + tp_rank) with a "
    "partial manifest; reshard.json appears when every piece is in (see `reshard assemble`).",
)
@trust_remote_code_option
@json_option
def save_cmd(
    source,
    out_dir,
    layout,
    max_part_size,
    max_memory,
    checksum,
    revision,
    device,
    overwrite,
    ranks,
    as_json,
    stream,
    source_sha256,
    trust_remote_code,
):
    """Write every rank's vLLM sharded_state files for SOURCE into OUT_DIR (a folder, or
    s3://bucket/prefix/).

    SOURCE is a local checkpoint folder, a Hugging Face repo id (fetched as the rank files are
    written, kept once in the HF cache unless --stream; HF_HOME, HF_TOKEN, HF_ENDPOINT and
    HF_HUB_OFFLINE apply), or an earlier reshard output (re-shard to another layout
    without the original). Files are written under temporary names and published at the end, the
    manifest reshard.json last: a folder without it is incomplete.

    OUT_DIR s3://bucket/prefix/ (any S3-compatible store; AWS_ENDPOINT_URL, AWS_PROFILE or
    AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY as for the aws CLI): each rank file streams into a
    multipart upload, every part's SHA256 checked by the store, nothing staged on local disk; the
    uploads stay invisible until all are in, then are completed with reshard.json last. Served by
    `vllm serve s3://... --load-format runai_streamer_sharded` (the line is printed). Refused before
    anything is written: a prefix inside another output, other objects vLLM's listing would load, or
    more than the 1000 keys vLLM's listing sees.

    Under torchrun (e.g. `torchrun --nproc-per-node 4 -m reshard save ...`) the processes split the
    files between them and process 0 writes the manifest once all have finished.
    """
    from reshard.execute import WriteOptions
    from reshard.io.memory import resident_bytes
    from reshard.save import PieceSaved, Saved, SaveOptions, save

    # the metadata read from here on (headers, plan, schedule) counts inside --max-memory
    write = WriteOptions(checksum=checksum, max_memory=max_memory, device=device, rss_base=resident_bytes())
    options = SaveOptions(
        write,
        max_part_size,
        overwrite=overwrite,
        revision=revision,
        stream=stream,
        ranks=ranks,
        sha256=source_sha256,
        trust_remote_code=trust_remote_code,
    )
    t0 = time.monotonic()
    with ExitStack() as stack:

        def on_plan(plan, source):
            meter = source.downloads  # a Hub source's, on the same display
            return stack.enter_context(byte_progress(plan.total_bytes, "writing", quiet=as_json, downloads=meter))

        result = save(source, out_dir, layout, options, on_plan=on_plan)
    seconds = time.monotonic() - t0
    if isinstance(result, PieceSaved) and result.manifest is None:
        _piece(result, as_json)
    elif isinstance(result, (Saved, PieceSaved)):  # a piece that was the last one: the whole output
        assert result.manifest is not None
        _saved(result.manifest, result.out_dir, seconds, as_json)
    else:  # a torchrun process other than 0: process 0 reports; what this one noted, on stderr
        release_notes()


def plural(n: int, word: str) -> str:
    """'1 file', '2 files'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _piece(result, as_json: bool) -> None:
    total = len(result.plan.files)
    if as_json:
        emit_json(
            {
                "ok": True,
                "complete": False,
                "out_dir": str(result.out_dir),
                "ranks": result.ranks,
                "files": result.files,
                "notes": kept_notes(),
            }
        )
    else:
        which = f"{'rank' if len(result.ranks) == 1 else 'ranks'} {ranks_text(result.ranks)}"
        stdout.print(
            f"wrote {which} ({plural(result.files, 'file')} of {total}); {MANIFEST} appears when all pieces are in"
        )


def _saved(m, out_dir: str, seconds: float, as_json: bool) -> None:
    if as_json:
        emit_json(
            {
                "ok": True,
                "complete": True,  # a whole output, or the --ranks piece that completed one
                "out_dir": out_dir,
                "manifest": out_dir + MANIFEST if out_dir.endswith("/") else str(Path(out_dir) / MANIFEST),
                "layout": m.to_json()["layout"],
                "files": len(m.files),
                "bytes": m.total_bytes,
                "seconds": round(seconds, 3),
                "serve": m.serve,
                "serve_reshard": m.serve_reshard,
                "vllm_versions": m.vllm_versions,
                "run_id": m.run_id,
                "notes": [*kept_notes(), *m.notes],  # this run's notes, then the output's (the manifest's)
            }
        )
        return
    stdout.print(
        f"wrote {plural(len(m.files), 'file')}, {human_bytes(m.total_bytes)} in {seconds:.1f} s "
        f"({plural(m.layout.world, 'rank')}) to {out_dir}"
    )
    for line in [*m.notes, serve_note(m.vllm_versions or VLLM_VERSIONS), PLUGIN_NOTE]:
        note(line)
    stdout.print(m.serve)
    stdout.print(m.serve_reshard)
