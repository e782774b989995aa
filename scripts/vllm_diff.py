"""Compare two vLLM releases' Python in the files that decide the pre-processing layout reshard writes.

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm-new && unzip -q /tmp/vllm-new/*.whl 'vllm/*.py' -d /tmp/vllm-new
    python -m scripts.vllm_diff OLD/vllm NEW/vllm [--diff]

OLD and NEW are `vllm` package folders (an installed site-packages/vllm, or an unzipped wheel).
Prints one line per file: unchanged, changed (with the number of differing lines), or missing;
`--diff` also prints the unified diff of every changed file. A changed file still has to be read:
docs/vllm-versions.md says what to look for. Exit status 1 when any file changed or is missing.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

MODELS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v2",
    "gemma2",
    "gemma3",
    "phi3",
    # families added later, whose constructors also decide what reshard refuses (stages without a MoE layer,
    # TP above the experts, encoders built under --language-model-only)
    "glm4_moe",
    "minimax_m2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen2_5_vl",
    "gemma3_mm",
    "siglip",
    "llama4",
    "mllama4",
    "gpt_oss",
    "kimi_k25",
    "interfaces",
]
FILES = [
    "model_executor/model_loader/sharded_state_loader.py",
    "model_executor/model_loader/base_loader.py",
    "model_executor/model_loader/weight_utils.py",
    "model_executor/model_loader/utils.py",
    "model_executor/parameter.py",
    "model_executor/utils.py",
    "model_executor/layers/linear.py",
    "model_executor/layers/vocab_parallel_embedding.py",
    "model_executor/layers/layernorm.py",
    "model_executor/layers/attention/attention.py",
    "model_executor/layers/attention/mla_attention.py",
    "model_executor/layers/quantization/fp8.py",
    "model_executor/layers/quantization/kv_cache.py",
    "model_executor/layers/quantization/base_config.py",
    "model_executor/layers/quantization/utils/fp8_utils.py",
    "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
    "model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py",
    "model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w8a8_fp8.py",
    "model_executor/layers/fused_moe/layer.py",
    "model_executor/layers/fused_moe/routed_experts.py",
    "model_executor/layers/fused_moe/expert_map_manager.py",
    "model_executor/layers/fused_moe/unquantized_fused_moe_method.py",
    "model_executor/layers/fused_moe/oracle/fp8.py",
    "model_executor/layers/fused_moe/oracle/unquantized.py",
    "model_executor/models/registry.py",
    "distributed/utils.py",
    "config/model.py",
    "config/vllm.py",  # the model dtype against the quantization's get_supported_act_dtypes
    "model_executor/layers/quantization/modelopt.py",
    "model_executor/layers/quantization/mxfp4.py",
    "model_executor/layers/quantization/auto_gptq.py",
    "model_executor/layers/quantization/auto_awq.py",
    "transformers_utils/model_arch_config_convertor.py",
    *[f"model_executor/models/{m}.py" for m in MODELS],
]


def compare(old: Path, new: Path, show_diff: bool) -> int:
    changed = 0
    for rel in FILES:
        a, b = old / rel, new / rel
        if not a.exists() or not b.exists():
            print(f"missing in {'old' if not a.exists() else 'new'}  {rel}")
            changed += 1
            continue
        lines = list(
            difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), rel, rel, lineterm="")
        )
        n = sum(1 for x in lines if x[:1] in "+-" and not x.startswith(("+++", "---")))
        print(f"{'unchanged' if not n else f'changed ({n} lines)':20} {rel}")
        if n:
            changed += 1
            if show_diff:
                print("\n".join(lines))
    return 1 if changed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="the vllm package folder of the release reshard targets")
    ap.add_argument("new", type=Path, help="the vllm package folder of the release to check")
    ap.add_argument("--diff", action="store_true", help="print the diff of every changed file")
    args = ap.parse_args()
    sys.exit(compare(args.old, args.new, args.diff))


if __name__ == "__main__":
    main()
