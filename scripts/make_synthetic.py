#!/usr/bin/env python
"""Write a synthetic Hugging Face checkpoint with a real architecture's tensor names and shapes.

    python -m scripts.make_synthetic OUT --arch llama|qwen3-moe|qwen3-235b [--fp8] --size 4GB

The model is Llama-3-8B (dense) or Qwen3-30B-A3B (MoE) with as many decoder layers as it takes to
reach --size (fewer than the real model for small sizes, more above it). When even one layer plus
the embeddings is larger than --size, the vocabulary is cut down too (config.json says so). --fp8
writes block-FP8 weights (128x128 `weight_scale_inv`, as Qwen's FP8 releases; see
tests/fixtures/synthetic.py `with_fp8`).

The folder looks like a Hub download: `model-0000i-of-0000n.safetensors` shards of at most
--shard-size (default: the checkpoint cut into max(2, ceil(size / 5 GB)) equal-ish shards),
`model.safetensors.index.json` and a complete config.json. Tensors are written in state-dict order
across shards and, inside a shard, in safetensors' own order (wider dtypes first, then by name).

Values are fast, not meaningful: one random pool per dtype (bf16 ~ N(0, 0.02), FP8 bytes without
the NaN patterns 0x7f/0xff, positive fp32 scales) read at a random offset per tensor, so writing is
bound by the disk. Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

from reshard.format import ITEMSIZE, encode_header
from tests.fixtures.synthetic import LLAMA_3_8B, QWEN3_30B_A3B, QWEN3_235B_A22B_FP8, tensor_specs, with_fp8

POOL_BYTES = 32 * 1024 * 1024
WRITE_BLOCK = 16 * 1024 * 1024

# What the real config.json files add to the shapes synthetic.py keeps (so that transformers and
# vLLM can build the model).
ARCHS = {
    "llama": {
        **LLAMA_3_8B,
        "model_type": "llama",
        "head_dim": 128,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "initializer_range": 0.02,
        "use_cache": True,
    },
    "qwen3-moe": {
        **QWEN3_30B_A3B,
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "initializer_range": 0.02,
        "use_cache": True,
    },
}
# Qwen3-235B-A22B's shapes (128 experts of 1536 x 4096 per layer: many small tensors); --fp8 for its FP8 release
ARCHS["qwen3-235b"] = {
    **ARCHS["qwen3-moe"],
    **{k: v for k, v in QWEN3_235B_A22B_FP8.items() if k != "quantization_config"},
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def specs_bytes(specs: list[tuple[str, str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * ITEMSIZE[dtype] for _, dtype, shape in specs)


def make_config(arch: str, size: int, *, fp8: bool, layers: int | None = None) -> dict:
    """The architecture's config with num_hidden_layers (and, if needed, vocab_size) fitted to size."""
    base = dict(ARCHS[arch])

    def cfg(n: int, vocab: int) -> dict:
        c = {**base, "num_hidden_layers": n, "vocab_size": vocab}
        if "max_window_layers" in c:
            c["max_window_layers"] = n
        return with_fp8(c) if fp8 else c

    vocab = base["vocab_size"]
    fixed = specs_bytes(tensor_specs(cfg(1, vocab), layers=0))
    per_layer = specs_bytes(tensor_specs(cfg(1, vocab), layers=1)) - fixed
    if layers is None:
        layers = max(1, math.ceil((size - fixed) / per_layer))  # at least --size
    if layers == 1 and fixed + per_layer > size * 1.1:
        # embeddings + one layer do not fit: shrink the vocabulary (a multiple of 64, >= 1024)
        fixed0 = specs_bytes(tensor_specs(cfg(1, 0), layers=0))  # what does not scale with the vocabulary
        row = (fixed - fixed0) / vocab
        vocab = max(1024, int((size - per_layer - fixed0) / row) // 64 * 64)
    return cfg(layers, vocab)


def pools(seed: int) -> dict[str, np.ndarray]:
    """Per dtype, 2 x POOL_BYTES of plausible bytes (doubled so any window of POOL_BYTES is contiguous)."""
    rng = np.random.default_rng(seed)
    out = {}
    f32 = (rng.standard_normal(POOL_BYTES // 2, dtype=np.float32) * 0.02).view(np.uint32)
    bf16 = ((f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
    out["BF16"] = bf16
    fp8 = rng.integers(0, 256, POOL_BYTES, dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] -= 1  # 0x7f / 0xff are NaN in e4m3fn
    out["F8_E4M3"] = fp8
    out["F32"] = rng.uniform(1e-4, 1e-3, POOL_BYTES // 4).astype(np.float32).view(np.uint8)
    out["F16"] = (rng.standard_normal(POOL_BYTES // 2, dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8)
    return {k: np.concatenate([v, v]) for k, v in out.items()}


def split_shards(specs: list, total: int, shard_size: int | None) -> list[list]:
    n = max(2, math.ceil(total / 5e9)) if shard_size is None else max(1, math.ceil(total / shard_size))
    shards: list[list] = [[] for _ in range(n)]
    pos = 0
    for spec in specs:
        # a tensor goes to the shard where it starts; equal-ish shards in state-dict order
        shards[min(n - 1, pos * n // total)].append(spec)
        pos += math.prod(spec[2]) * ITEMSIZE[spec[1]]
    return [s for s in shards if s]


def write_checkpoint(out: Path, config: dict, *, shard_size: int | None = None, seed: int = 0) -> dict:
    specs = tensor_specs(config)
    total = specs_bytes(specs)
    out.mkdir(parents=True, exist_ok=True)
    data = pools(seed)
    rng = np.random.default_rng(seed + 1)
    shards = split_shards(specs, total, shard_size)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # safetensors' own order inside a file: wider dtypes first, then by name
        shard = sorted(shard, key=lambda s: (-ITEMSIZE[s[1]], s[0]))
        with open(out / name, "wb") as f:
            f.write(encode_header(shard, {"format": "pt"}))
            for tname, dtype, shape in shard:
                weight_map[tname] = name
                pool = memoryview(data[dtype])
                left = math.prod(shape) * ITEMSIZE[dtype]
                align = 4 if dtype == "F32" else 2
                off = int(rng.integers(0, POOL_BYTES // align)) * align
                while left:
                    n = min(left, WRITE_BLOCK, POOL_BYTES)
                    f.write(pool[off : off + n])
                    off = (off + n) % POOL_BYTES
                    left -= n
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n"
    )
    largest = max(specs, key=lambda s: math.prod(s[2]) * ITEMSIZE[s[1]])
    return {
        "path": str(out),
        "layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "tensors": len(specs),
        "bytes": total,
        "shards": len(shards),
        "largest_tensor": largest[0],
        "largest_tensor_bytes": math.prod(largest[2]) * ITEMSIZE[largest[1]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path, help="folder to create (must be empty or absent)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    ap.add_argument("--fp8", action="store_true", help="block FP8 weights (128x128 weight_scale_inv)")
    ap.add_argument("--size", type=parse_size, default=parse_size("4GB"), help="target size, e.g. 4GB (default), 16GiB")
    ap.add_argument("--layers", type=int, help="number of decoder layers (overrides --size)")
    ap.add_argument("--shard-size", type=parse_size, help="max shard size (default: ~size/max(2, size/5GB))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print a JSON summary")
    a = ap.parse_args(argv)
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"{a.out} exists and is not empty")
    config = make_config(a.arch, a.size, fp8=a.fp8, layers=a.layers)
    t0 = time.monotonic()
    info = write_checkpoint(a.out, config, shard_size=a.shard_size, seed=a.seed)
    info["seconds"] = round(time.monotonic() - t0, 2)
    if a.json:
        print(json.dumps(info))
    else:
        print(
            f"{info['path']}: {a.arch}{' fp8' if a.fp8 else ''}, {info['layers']} layers, vocab {info['vocab_size']}, "
            f"{info['tensors']} tensors, {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards "
            f"(largest tensor {info['largest_tensor']}: {info['largest_tensor_bytes'] / 1e9:.2f} GB) "
            f"in {info['seconds']} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
