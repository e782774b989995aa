"""`reshard merge OUT_DIR HF_DIR`."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import click

from reshard.commands.options import ByteSize, Location, json_option
from reshard.console import byte_progress, emit_json, human_bytes, kept_notes, note, stdout
from reshard.errors import SourceError


@click.command(
    "merge",
    epilog="Exit codes: 0 ok, 2 usage, 3 unsupported (a lossy merge without --allow-lossy), 4 bad source, 5 HF_DIR refused or stdout cannot be written, 7 OUT_DIR corrupt or incomplete, 130 interrupted, 141 stdout closed by its reader (`reshard --help`).",
)
@click.argument("out_dir", type=Location())  # a folder, or s3://bucket/prefix/ (a path: shells complete it)
@click.argument("hf_dir", type=Location(path_type=Path))  # a file there: refused (exit 5), as save's OUT_DIR
@click.option(
    "--max-shard-size",
    type=ByteSize(),
    default="5GiB",
    show_default=True,
    help="Size of the Hugging Face shards written.",
)
@click.option("--overwrite", is_flag=True, help="Replace the weights of a non-empty HF_DIR.")
@click.option(
    "--allow-lossy",
    is_flag=True,
    help="Merge even when the output holds tensors in a narrower dtype than the original (e.g. saved "
    "with --dtype float16 from bf16): they are converted back, not restored.",
)
@json_option
def merge_cmd(out_dir, hf_dir, max_shard_size, overwrite, allow_lossy, as_json):
    """Rebuild the Hugging Face checkpoint a reshard output was made from.

    Original tensor names, shapes and dtypes (FP8 scales on their original blocks), shards with a
    model.safetensors.index.json as the Hub lays them out, config and tokenizer copied. The output's
    checksums are checked first.

    OUT_DIR may be s3://bucket/prefix/ (endpoint and credentials from AWS_ENDPOINT_URL, AWS_PROFILE,
    ...): the rank files are read with ranged GETs, nothing of them stored locally; sizes and the
    store's checksums are checked first, and a rank file read whole in order is hashed as it streams;
    one the store reports no checksum for is hashed from the bytes read and a read of the rest (said in
    a note), the others are said to be unhashed. Exit 4 when the bucket cannot be read.
    """
    from reshard.merge import merge
    from reshard.store import is_bucket_url

    if not is_bucket_url(out_dir):
        out_dir = Path(out_dir)
        if not out_dir.is_dir():  # its source: not found is exit 4, as save's and plan's SOURCE
            what = "is not a folder" if out_dir.exists() else "no such folder"
            raise SourceError(f"OUT_DIR {out_dir}: {what}", "give the folder `reshard save` wrote")

    with ExitStack() as stack:

        def on_plan(plan):
            return stack.enter_context(byte_progress(plan.total_bytes, "merging", quiet=as_json))

        result = merge(
            out_dir,
            hf_dir,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            allow_lossy=allow_lossy,
            on_plan=on_plan,
        )
    if as_json:
        emit_json({**result, "notes": kept_notes()})
        return
    stdout.print(
        f"wrote {len(result['files'])} files, {result['tensors']} tensors, {human_bytes(result['bytes'])} to {hf_dir}"
    )
    missing = result["not_in_output"]
    if missing:
        note(
            f"{len(missing)} tensor(s) of the original are not in the sharded output (vLLM does not load "
            f"them, e.g. {missing[0]}) and were not written"
        )
    if result["language_model_only"]:
        note(
            "the output was saved with --language-model-only, so the merged checkpoint holds no vision "
            f"encoder: serve it with `vllm serve {hf_dir} --language-model-only`"
        )
    for key, value in result["config_patch"].items():
        note(f"config.json {key} set to {value}: the merged checkpoint has no such layers")
    if result["lossy"]:
        note(
            f"{len(result['lossy'])} tensor(s) converted back from a narrower dtype: values differ "
            "from the original (--allow-lossy)"
        )
