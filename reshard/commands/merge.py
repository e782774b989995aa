"""`reshard merge OUT_DIR HF_DIR`."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import click

from reshard.commands.options import ByteSize, json_option
from reshard.console import byte_progress, emit_json, human_bytes, stdout


@click.command("merge")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("hf_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--max-shard-size", type=ByteSize(), default="5GiB", show_default=True,
              help="Size of the Hugging Face shards written.")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Replace the weights of a non-empty HF_DIR.")
@json_option
def merge_cmd(out_dir, hf_dir, max_shard_size, overwrite, as_json):
    """Rebuild the Hugging Face checkpoint a reshard output was made from.

    Original tensor names, shapes and dtypes (FP8 scales on their original blocks), shards with a
    model.safetensors.index.json as the Hub lays them out, config and tokenizer copied. The output's
    checksums are checked first.
    """
    from reshard.merge import merge

    with ExitStack() as stack:

        def on_plan(plan):
            return stack.enter_context(byte_progress(plan.total_bytes, "merging", quiet=as_json))

        result = merge(out_dir, hf_dir, max_shard_size=max_shard_size, overwrite=overwrite, on_plan=on_plan)
    if as_json:
        emit_json(result)
        return
    stdout.print(
        f"wrote {len(result['files'])} files, {result['tensors']} tensors, {human_bytes(result['bytes'])} to {hf_dir}"
    )
    for name in result["not_in_output"]:
        stdout.print(f"note: {name} is not in the sharded output (vLLM does not load it) and was not written")
