"""Names, shapes and dtypes of real architectures, without weights.

Used by the plan tests (a 70B or 235B model planned from headers alone) and by the benchmark's
checkpoint generator (`make_synthetic.py`). The configs mirror the public config.json files.
"""

from __future__ import annotations

import math

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

LLAMA_3_70B = {
    **LLAMA_3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

QWEN3_235B_A22B_FP8 = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "num_hidden_layers": 94,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def with_fp8(config: dict) -> dict:
    """The same model in block FP8, with the skip list Qwen's FP8 releases use."""
    layers = config["num_hidden_layers"]
    skip = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(layers)]
    return {
        **config,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": skip,
        },
    }


QWEN3_235B_A22B_FP8 = with_fp8(QWEN3_235B_A22B_FP8)


def tensor_specs(config: dict, layers: int | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor of an HF checkpoint of this config."""
    h, n = config["hidden_size"], config["num_hidden_layers"] if layers is None else layers
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    v = config["vocab_size"]
    qc = config.get("quantization_config")
    block = tuple(qc["weight_block_size"]) if qc else None
    skip = set(qc.get("modules_to_not_convert") or []) if qc else set()
    moe = config["architectures"][0] == "Qwen3MoeForCausalLM"
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def linear(prefix: str, rows: int, cols: int) -> None:
        if block and prefix not in skip:
            out.append((f"{prefix}.weight", "F8_E4M3", (rows, cols)))
            scale = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
            out.append((f"{prefix}.weight_scale_inv", "F32", scale))
        else:
            out.append((f"{prefix}.weight", "BF16", (rows, cols)))

    out.append(("model.embed_tokens.weight", "BF16", (v, h)))
    for i in range(n):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", "BF16", (h,)))
        out.append((p + "post_attention_layernorm.weight", "BF16", (h,)))
        linear(p + "self_attn.q_proj", heads * hd, h)
        linear(p + "self_attn.k_proj", kv * hd, h)
        linear(p + "self_attn.v_proj", kv * hd, h)
        linear(p + "self_attn.o_proj", h, heads * hd)
        if moe:
            out.append((p + "self_attn.q_norm.weight", "BF16", (hd,)))
            out.append((p + "self_attn.k_norm.weight", "BF16", (hd,)))
            linear(p + "mlp.gate", config["num_experts"], h)
            inter = config["moe_intermediate_size"]
            for e in range(config["num_experts"]):
                linear(p + f"mlp.experts.{e}.gate_proj", inter, h)
                linear(p + f"mlp.experts.{e}.up_proj", inter, h)
                linear(p + f"mlp.experts.{e}.down_proj", h, inter)
        else:
            inter = config["intermediate_size"]
            linear(p + "mlp.gate_proj", inter, h)
            linear(p + "mlp.up_proj", inter, h)
            linear(p + "mlp.down_proj", h, inter)
    out.append(("model.norm.weight", "BF16", (h,)))
    if not config.get("tie_word_embeddings"):
        out.append(("lm_head.weight", "BF16", (v, h)))
    return out


def synthetic_checkpoint(config: dict, *, files: int = 1):
    """A reshard Checkpoint made of headers only: nothing on disk, so no byte can be read."""
    from reshard.format import ITEMSIZE, TensorInfo
    from reshard.source import Checkpoint

    specs = tensor_specs(config)
    per_file = math.ceil(len(specs) / files)
    tensors, names, offsets = {}, [], {}
    for i, (name, dtype, shape) in enumerate(specs):
        fname = f"model-{i // per_file + 1:05d}-of-{files:05d}.safetensors"
        if fname not in offsets:
            names.append(fname)
            offsets[fname] = 0
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        tensors[name] = TensorInfo(name, dtype, shape, fname, offsets[fname], nbytes)
        offsets[fname] += nbytes
    return Checkpoint(None, config, tensors, names, {"path": "synthetic"})
