"""`reshard merge`: rebuild a Hugging Face checkpoint from a reshard output.

Original names, shapes and dtypes (from the manifest), FP8 scales back on their original blocks,
shards with an index as the Hub lays them out, config and tokenizer copied.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError
from reshard.format import ITEMSIZE
from reshard.layout import INDEX, MANIFEST, hf_shard_name
from reshard.plan import OutFile, OutTensor, Plan, Slice, natural_key, split_by_size
from reshard.publish import (
    check_free_space,
    check_out_dir,
    copy_files,
    lock,
    make_dir,
    recover,
    side_files,
    staging_dir,
    swap_in,
    write_error,
)
from reshard.save import run_executor
from reshard.sources import OutputSource

DEFAULT_SHARD = 5 * 1024**3


def merge_plan(ckpt: Checkpoint, max_shard_size: int) -> Plan:
    """One whole tensor per source tensor the output holds, in Hub-style shards."""
    manifest = ckpt.manifest
    assert manifest is not None
    tensors = []
    for name in sorted(ckpt.tensors, key=natural_key):
        dtype, shape = manifest["source_tensors"][name]
        shape = tuple(shape)
        tensors.append(OutTensor(name, dtype, shape, (Slice(name, (0,) * len(shape), shape),)))
    shards = split_by_size(tensors, max_shard_size)
    files = []
    for i, chunk in enumerate(shards):
        # widest dtypes first keeps tensors aligned; the executor writes in that order
        chunk.sort(key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))
        files.append(OutFile(hf_shard_name(i, len(shards)), 0, 0, i, tuple(chunk)))
    layout = manifest["layout"]
    return Plan(
        source=ckpt.ref,
        architecture=layout["architecture"],
        tp=1,
        pp=1,
        ep=False,
        dtype="BF16",
        quant=None,
        files=files,
        layer_ranges=[],
    )


def merge(
    out_dir: Path,
    hf_dir: Path,
    *,
    max_shard_size: int = DEFAULT_SHARD,
    overwrite: bool = False,
    on_plan: Callable[[Plan], Callable[[int], None] | None] | None = None,
) -> dict:
    """Write the Hugging Face checkpoint that `out_dir` was made from into `hf_dir`."""
    if not (out_dir / MANIFEST).is_file():
        raise SourceError(f"{out_dir} has no {MANIFEST}: not a complete reshard output")
    source = OutputSource(out_dir)
    ckpt = source.checkpoint
    plan = merge_plan(ckpt, max_shard_size)
    with lock(hf_dir):
        recover(hf_dir)
        check_out_dir(hf_dir, out_dir, overwrite)
        make_dir(hf_dir.resolve().parent)
        check_free_space(hf_dir.resolve().parent, plan.total_bytes)
        progress = on_plan(plan) if on_plan else None
        staged = staging_dir(hf_dir, uuid.uuid4().hex)
        make_dir(staged)
        try:
            written = run_executor(plan, source, staged, {"format": "pt"}, progress=progress)
            if len(plan.files) > 1:
                index = {
                    "metadata": {"total_size": plan.total_bytes},
                    "weight_map": {t.name: f.name for f in plan.files for t in f.tensors},
                }
                (staged / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            copy_files(out_dir, side_files(out_dir), staged)
            swap_in(staged, hf_dir, ours=lambda name: name == INDEX or fnmatch(name, "model*.safetensors"))
        except OSError as e:
            raise write_error(hf_dir, e) from e
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return {
        "ok": True,
        "hf_dir": str(hf_dir),
        "files": [w.name for w in written],
        "tensors": len(ckpt.tensors),
        "bytes": plan.total_bytes,
        "not_in_output": ckpt.missing,
    }
