"""`reshard save SOURCE OUT_DIR`."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import click

from reshard.commands.options import (
    ByteSize,
    dtype_option,
    ep_option,
    json_option,
    moe_backend_option,
    partition_option,
    pp_option,
    revision_option,
    tp_option,
)
from reshard.console import byte_progress, emit_json, human_bytes, stdout
from reshard.hashing import ALGORITHMS
from reshard.hashing import DEFAULT as DEFAULT_CHECKSUM
from reshard.names import DEFAULT_MAX_PART, MANIFEST
from reshard.serve import PLUGIN_NOTE
from reshard.vllm_versions import serve_note


@click.command("save")
@click.argument("source")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@tp_option
@pp_option
@ep_option
@dtype_option
@partition_option
@moe_backend_option
@click.option("--max-part-size", type=ByteSize(), default=DEFAULT_MAX_PART, show_default="5GiB",
              help="Split each rank's tensors into files of at most this size.")  # fmt: skip
@click.option("--max-memory", type=ByteSize(), default="512MiB", show_default=True,
              help="Bound on tensor data held in memory (read-ahead and write buffers); each open "
                   "output file adds 8 MiB.")  # fmt: skip
@click.option("--checksum", type=click.Choice(ALGORITHMS), default=DEFAULT_CHECKSUM, show_default=True,
              help="Each file's digest in reshard.json, computed while writing (verify checks it): blake3 is "
                   "fast; sha256 for `sha256sum -c`; none records sizes only.")  # fmt: skip
@revision_option
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where each piece is materialised before writing; cpu needs no GPU.")  # fmt: skip
@click.option("--stream", is_flag=True,
              help="Repo ids: store nothing of the source; its bytes go from the Hub into the rank files "
                   "through the --max-memory window (default: kept once in the HF cache as they arrive).")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Replace the reshard files of a non-empty OUT_DIR.")
@click.option("--ranks", metavar="LIST",
              help="Write only these engine ranks (e.g. 0-3 or 0,2,5-7; rank = pp_rank * tp + tp_rank) with a "
                   "partial manifest; reshard.json appears when every piece is in (see `reshard assemble`).")  # fmt: skip
@json_option
def save_cmd(
    source,
    out_dir,
    tp,
    pp,
    ep,
    dtype,
    pp_partition,
    moe_backend,
    max_part_size,
    max_memory,
    checksum,
    revision,
    device,
    overwrite,
    ranks,
    as_json,
    stream,
):
    """Write every rank's vLLM sharded_state files for SOURCE into OUT_DIR.

    SOURCE is a local checkpoint folder, a Hugging Face repo id (fetched as the rank files are
    written, kept once in the HF cache unless --stream; HF_HOME, HF_TOKEN, HF_ENDPOINT and
    HF_HUB_OFFLINE apply), or an earlier reshard output (re-shard to another layout
    without the original). Files are written under temporary names and published at the end, the
    manifest reshard.json last: a folder without it is incomplete.

    Under torchrun (e.g. `torchrun --nproc-per-node 4 -m reshard save ...`) the processes split the
    files between them and process 0 writes the manifest once all have finished.
    """
    from reshard.save import save

    t0 = time.monotonic()
    with ExitStack() as stack:

        def on_plan(plan, source=None):
            meter = source.downloads if source is not None else None  # a Hub source's, on the same display
            return stack.enter_context(byte_progress(plan.total_bytes, "writing", quiet=as_json, downloads=meter))

        result = save(
            source, out_dir, tp=tp, pp=pp, ep=ep, dtype=dtype, max_part_size=max_part_size,
            revision=revision, device=device, overwrite=overwrite, ranks=ranks, max_memory=max_memory,
            pp_partition=pp_partition, on_plan=on_plan, moe_backend=moe_backend, stream=stream,
            checksum=checksum,
        )  # fmt: skip
    seconds = time.monotonic() - t0
    m = result.manifest
    if not m:  # a torchrun worker other than process 0: process 0 reports
        return
    if "ranks" in m:
        done = len(m["files"])
        msg = f"wrote ranks {ranks} ({done} files) of {m['all_files'].__len__()}; {MANIFEST} appears when all pieces are in"
        if as_json:
            emit_json({"ok": True, "complete": False, "out_dir": str(out_dir), "ranks": m["ranks"], "files": done})
        else:
            stdout.print(msg)
        return
    if as_json:
        emit_json({
            "ok": True, "out_dir": str(out_dir), "manifest": str(out_dir / MANIFEST),
            "layout": m["layout"], "files": len(m["files"]), "bytes": m["total_bytes"],
            "seconds": round(seconds, 3), "serve": m["serve"], "serve_reshard": m["serve_reshard"], "vllm_versions": m["vllm_versions"],
            "run_id": m["run_id"], "notes": m.get("notes", []),
        })  # fmt: skip
        return
    stdout.print(
        f"wrote {len(m['files'])} files, {human_bytes(m['total_bytes'])} in {seconds:.1f} s "
        f"({result.plan.tp * result.plan.pp} ranks) to {out_dir}"
    )
    for note in m.get("notes", []):
        stdout.print(f"note: {note}")
    stdout.print(f"note: {serve_note(m['vllm_versions'])}")
    stdout.print(f"note: {PLUGIN_NOTE}")
    stdout.print(m["serve"])
    stdout.print(m["serve_reshard"])
