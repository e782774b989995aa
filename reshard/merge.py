"""`reshard merge`: rebuild a Hugging Face checkpoint from a reshard output.

Original names, shapes and dtypes (from the manifest), FP8 scales back on their original blocks,
shards with an index as the Hub lays them out, config and tokenizer copied.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from reshard.errors import OutputError, SourceError
from reshard.format import ITEMSIZE, fsync_dir
from reshard.inverse import open_output
from reshard.plan import OutFile, OutTensor, Plan, Slice, natural_key, split_by_size
from reshard.save import TMP_PREFIX, check_out_dir, copy_list, run_executor
from reshard.source import INDEX

DEFAULT_SHARD = 5 * 1024**3


def merge_plan(ckpt, max_shard_size: int) -> Plan:
    manifest = ckpt.manifest
    tensors = []
    for name in sorted(ckpt.tensors, key=natural_key):
        dtype, shape = manifest["source_tensors"][name]
        shape = tuple(shape)
        tensors.append(OutTensor(name, dtype, shape, (Slice(name, (0,) * len(shape), shape),)))
    shards = split_by_size(tensors, max_shard_size)
    files = []
    for i, chunk in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # widest dtypes first keeps tensors aligned; the executor writes in that order
        chunk.sort(key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))
        files.append(OutFile(name, 0, 0, i, tuple(chunk)))
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
    if not (out_dir / "reshard.json").is_file():
        raise SourceError(f"{out_dir} has no reshard.json: not a complete reshard output")
    ckpt = open_output(out_dir)
    plan = merge_plan(ckpt, max_shard_size)
    check_out_dir(hf_dir, out_dir, overwrite)
    hf_dir.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(hf_dir).free < plan.total_bytes:
        raise OutputError(f"not enough disk space in {hf_dir}", "free space or choose another folder")
    progress = on_plan(plan) if on_plan else None
    tmp = hf_dir / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        written = run_executor(plan, ckpt, tmp, {"format": "pt"}, progress=progress)
        if len(plan.files) > 1:
            index = {
                "metadata": {"total_size": plan.total_bytes},
                "weight_map": {t.name: f.name for f in plan.files for t in f.tensors},
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        copied = copy_list(out_dir)
        for name in copied:
            src = out_dir / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / name)
        names = [f.name for f in plan.files] + copied + ([INDEX] if len(plan.files) > 1 else [])
        for old in [*hf_dir.glob("model*.safetensors"), hf_dir / INDEX]:
            if old.exists() and old.name not in names:
                old.unlink()
        for name in names:
            dst = hf_dir / name
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            (tmp / name).replace(dst)
        fsync_dir(hf_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "ok": True,
        "hf_dir": str(hf_dir),
        "files": [w.name for w in written],
        "tensors": len(ckpt.tensors),
        "bytes": plan.total_bytes,
        "not_in_output": ckpt.missing,
    }
