"""`reshard merge`: rebuild a Hugging Face checkpoint from a reshard output.

Original names, shapes and dtypes (from the manifest), FP8 scales back on their original blocks,
shards with an index as the Hub lays them out, config and tokenizer copied.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

from reshard.checkpoint import Checkpoint
from reshard.errors import ReshardError, SourceError, UnsupportedError
from reshard.execute import WriteOptions, run_executor
from reshard.format import ITEMSIZE
from reshard.hashing import NONE
from reshard.io.memory import DEFAULT_MAX_MEMORY, resident_bytes
from reshard.layout import Layout
from reshard.names import CONFIG, INDEX, MANIFEST, PIECE_MANIFEST_GLOB, hf_shard_name
from reshard.plan import OutFile, OutTensor, Plan, Slice, natural_key, split_by_size
from reshard.plan.gptq import restore_g_idx
from reshard.plan.intquant import weight_shapes
from reshard.publish import staged, swap_in
from reshard.rules import get_architecture
from reshard.sidefiles import copy_files, side_files, write_config
from reshard.sources import OutputSource, check_readable
from reshard.sources.bucket_output import BucketOutputSource
from reshard.sources.output import lossy_tensors
from reshard.store import is_bucket_url, parse_bucket_url

DEFAULT_SHARD = 5 * 1024**3


def merge_plan(ckpt: Checkpoint, max_shard_size: int) -> Plan:
    """One whole tensor per source tensor the output holds, in Hub-style shards."""
    manifest = ckpt.manifest
    assert manifest is not None and manifest.source_tensors is not None  # OutputSource refuses it otherwise
    keys = {name: natural_key(name) for name in ckpt.tensors}  # made once: 200k names cost ~1 s a sort
    tensors = []
    for name in sorted(ckpt.tensors, key=keys.__getitem__):
        dtype, shape = manifest.source_tensors[name]
        tensors.append(OutTensor(name, dtype, shape, (Slice(name, (0,) * len(shape), shape),)))
    restored = restored_tensors(ckpt)
    keys.update((t.name, natural_key(t.name)) for t in restored)
    tensors += restored
    shards = split_by_size(tensors, max_shard_size)
    files = []
    for i, chunk in enumerate(shards):
        # widest dtypes first keeps tensors aligned; the executor writes in that order
        chunk.sort(key=lambda t: (-ITEMSIZE[t.dtype], keys[t.name]))
        files.append(OutFile(hf_shard_name(i, len(shards)), 0, 0, i, tuple(chunk)))
    return Plan(source=ckpt.ref, architecture=manifest.architecture, layout=Layout(), files=files, layer_ranges=[])


def restored_tensors(ckpt: Checkpoint) -> list[OutTensor]:
    """Tensors the output does not hold but whose values follow from those it does: compressed-tensors'
    `weight_shape` of the shards vLLM loads and drops (reshard.plan.intquant.weight_shapes), GPTQ's
    `g_idx` (reshard.plan.gptq.restore_g_idx)."""
    manifest = ckpt.manifest
    assert manifest is not None and manifest.source_tensors is not None
    held = {n: manifest.source_tensors[n] for n in ckpt.tensors}
    missing = {n: manifest.source_tensors[n] for n in ckpt.missing}
    quant = manifest.layout.quantization
    return weight_shapes(missing, held, quant) + restore_g_idx(missing, quant)  # issue 26: GPTQ's g_idx


# (original dtype, stored dtype) pairs that round-trip exactly: the stored one holds every value
def merge(
    out_dir: Path | str,
    hf_dir: Path,
    *,
    max_shard_size: int = DEFAULT_SHARD,
    overwrite: bool = False,
    allow_lossy: bool = False,
    max_memory: int = DEFAULT_MAX_MEMORY,
    on_plan: Callable[[Plan], Callable[[int], None] | None] | None = None,
) -> dict:
    """Write the Hugging Face checkpoint that `out_dir` was made from into `hf_dir`.

    `out_dir`: a local output folder, or `s3://bucket/prefix/` (read with ranged GETs; its side
    files fetched into a temporary folder).

    Refuses (exit 3) when the output holds tensors in a dtype that lost precision against the
    original, unless `allow_lossy`; the result lists them either way.
    """
    rss_base = resident_bytes()  # the metadata read from here on (regions, plan) counts inside max_memory
    source: OutputSource | BucketOutputSource
    if isinstance(out_dir, str) and is_bucket_url(out_dir):
        source = BucketOutputSource(parse_bucket_url(out_dir))
    else:
        out_dir = Path(out_dir)
        check_readable(out_dir)
        if not (out_dir / MANIFEST).is_file():
            raise SourceError(
                f"{out_dir} has no {MANIFEST}: not a complete reshard output",
                "merge reads what `reshard save` wrote; a Hugging Face checkpoint is merged already"
                if (out_dir / "config.json").is_file()
                else "give the folder `reshard save` wrote",
            )
        source = OutputSource(out_dir)
    ckpt = source.checkpoint
    root = ckpt.root
    assert root is not None
    plan = merge_plan(ckpt, max_shard_size)
    lossy = lossy_tensors(ckpt)
    if lossy and not allow_lossy:
        first = lossy[0]
        raise UnsupportedError(
            f"{out_dir} holds {len(lossy)} tensor(s) in a dtype that lost precision against the original "
            f"(e.g. {first['name']}: {first['original']} saved as {first['stored']}); merging cannot give the "
            "original checkpoint back",
            "pass --allow-lossy to write it anyway (converted back to the original dtypes); the original values "
            "are in the original checkpoint only: an output saved with another --dtype loses them, and vLLM holds "
            "some tensors (FP8 KV-cache scales, zero points) in the model's dtype whatever --dtype says",
        )
    config_patch = _spec_layers_patch(ckpt)
    restored = {t.name for t in restored_tensors(ckpt)}
    with staged(
        hf_dir, uuid.uuid4().hex, source=root, overwrite=overwrite, need=plan.total_bytes, label="HF_DIR"
    ) as folder:
        progress = on_plan(plan) if on_plan else None
        # Hub shards record no checksum: hashing them would only cost CPU
        options = WriteOptions(checksum=NONE, max_memory=max_memory, rss_base=rss_base)
        written = run_executor(plan, source, folder, options, {"format": "pt"}, progress)
        if len(plan.files) > 1:
            index = {
                "metadata": {"total_size": plan.total_bytes},
                "weight_map": {t.name: f.name for f in plan.files for t in f.tensors},
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        copy_files(root, side_files(root), folder)
        if config_patch and (folder / CONFIG).is_file():
            write_config(folder, json.loads((folder / CONFIG).read_text()), config_patch)
        swap_in(
            folder,
            hf_dir,
            # a reshard output's manifest there too: kept, it would describe rank files that are gone
            ours=lambda name: (
                name in (INDEX, MANIFEST) or fnmatch(name, "model*.safetensors") or fnmatch(name, PIECE_MANIFEST_GLOB)
            ),
            synced=[f.name for f in plan.files],
        )
    return {
        "ok": True,
        "hf_dir": str(hf_dir),
        "files": [w.name for w in written],
        "tensors": len(ckpt.tensors),
        "bytes": sum(w.size for w in written),  # on disk, as save's, verify's and assemble's
        "tensor_bytes": plan.total_bytes,  # the index's total_size
        "not_in_output": [n for n in ckpt.missing if n not in restored],
        "config_patch": config_patch,
        "lossy": lossy,
        # saved with --language-model-only: no vision encoder here, so vLLM must be told not to build one
        "language_model_only": bool(ckpt.manifest and ckpt.manifest.layout.language_model_only),
    }


MTP_PREFIX, MTP_LAYERS = "mtp.", "mtp_num_hidden_layers"  # Qwen3-Next's draft layers, and its config's count


def _spec_layers_patch(ckpt: Checkpoint) -> dict:
    """The output holds no speculative (MTP) layers (vLLM's main model skips them), so neither does
    the merged checkpoint: its config.json must not announce them."""
    try:
        _, arch = get_architecture(ckpt.config)
    except ReshardError:
        return {}
    text = arch.text(ckpt.config)
    n = text.get("num_hidden_layers")
    patch = {}
    if isinstance(n, int) and any(m.startswith(f"model.layers.{n}.") for m in ckpt.missing):  # DeepSeek, GLM
        patch = {key: 0 for key in arch.spec_layers_key if text.get(key)}
    if text.get(MTP_LAYERS) and any(m.startswith(MTP_PREFIX) for m in ckpt.missing):  # Qwen3-Next, Qwen3.5
        patch[MTP_LAYERS] = 0
    return patch
