"""`reshard plan SOURCE`."""

from __future__ import annotations

import click

from reshard import VLLM_VERSIONS
from reshard.commands.options import Location, json_option, layout_options, revision_option, trust_remote_code_option
from reshard.console import emit_json, human_bytes, kept_notes, note, stdout
from reshard.serve import PLUGIN_LOAD_FORMAT, PLUGIN_NOTE
from reshard.vllm_versions import serve_note


@click.command(
    "plan",
    epilog="Exit codes: 0 ok, 2 usage, 3 unsupported model or layout, 4 bad source, 5 stdout cannot be written, 7 an output used as SOURCE is corrupt or incomplete, 130 interrupted, 141 stdout closed by its reader (`reshard --help`).",
)
@click.argument("source", type=Location())  # a folder, a repo id or s3://...: completed as a path
@layout_options
@revision_option
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor of every rank.")
@click.option(
    "--out-dir", default="OUT_DIR", show_default=True, help="Folder (or s3://bucket/prefix/) named in the serve lines."
)
@trust_remote_code_option
@json_option
def plan_cmd(source, layout, revision, show_tensors, out_dir, trust_remote_code, as_json):
    """Show what each rank will hold, without writing or downloading weights.

    For a Hub repo id only config.json and the safetensors headers are fetched, so a model's
    per-GPU footprint is known before it is downloaded.

    Bytes are tensor bytes: `--json`'s `total_bytes` and each rank's `bytes` count the tensors the
    rank holds (its GPU footprint), `source_bytes` the source's tensors; the files `save` writes add
    their safetensors headers (a few KB each), which the manifest's `total_bytes` counts too.
    """
    from reshard.plan import build_plan
    from reshard.sources import open_source

    ckpt = open_source(source, revision, headers_only=True).checkpoint
    plan = build_plan(ckpt, layout, trust_remote_code=trust_remote_code, pieces=False)  # shows no piece
    summary = plan.summary()
    summary["serve"] = plan.serve_command(out_dir)
    summary["serve_reshard"] = plan.serve_command(out_dir, load_format=PLUGIN_LOAD_FORMAT)
    summary["vllm_versions"] = VLLM_VERSIONS
    summary["source_bytes"] = ckpt.total_bytes
    if as_json:
        summary["notes"] = [*kept_notes(), *summary["notes"]]  # reading the source's, then the plan's
        if not show_tensors:
            for r in summary["ranks"]:
                r.pop("tensors")
        emit_json({"ok": True, **summary})  # as every command's --json, success and failure alike
        return
    from rich.table import Table

    q = summary["quantization"]
    quant = "none"
    if q:
        quant = q["method"] + (" block " + str(q["weight_block_size"]) if q["weight_block_size"] else "")
    stdout.print(f"{summary['architecture']}  {plan.layout}  dtype={summary['dtype']}  quantization={quant}")
    table = Table("pp", "tp", "keys", "bytes", "files")
    for r in summary["ranks"]:
        table.add_row(
            str(r["pp_rank"]), str(r["tp_rank"]), str(r["keys"]), human_bytes(r["bytes"]), str(len(r["files"]))
        )
    stdout.print(table)
    if show_tensors:
        for r in summary["ranks"]:
            stdout.print(f"rank pp={r['pp_rank']} tp={r['tp_rank']}:")
            for t in r["tensors"]:
                stdout.print(f"  {t['name']}  {t['dtype']}  {t['shape']}")
    stdout.print(f"source {human_bytes(ckpt.total_bytes)}, output {human_bytes(plan.total_bytes)}")
    for line in [*plan.notes, serve_note(), PLUGIN_NOTE]:
        note(line)
    stdout.print(summary["serve"])
    stdout.print(summary["serve_reshard"])
