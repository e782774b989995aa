"""DeepSeek-V3.2 / GLM-5 key names: vLLM's CUDA class (models/deepseek_v32/nvidia, an MLAAttention as
`self_attn`) -> its generic CPU/XPU class (deepseek_v2.py: MultiHeadLatentAttentionWrapper `mla_attn`,
the inner MLAAttention `mla_attn.mla_attn`). Only these names differ; shapes and bytes do not."""

from __future__ import annotations

import re
from pathlib import Path

# self_attn.<module> on CUDA -> its name on CPU (deepseek_v2.py DeepseekV2MLAAttention)
_MODULES = ("q_a_layernorm", "q_b_proj", "o_proj")
_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
_RE = re.compile(r"^(.*\.self_attn\.)(" + "|".join(_MODULES) + r")(\..*)$")
_RE_SCALE = re.compile(r"^(.*\.self_attn\.)(" + "|".join(_SCALES) + r")$")


def cuda_to_cpu(name: str) -> str:
    if m := _RE.match(name):
        return f"{m[1]}mla_attn.{m[2]}{m[3]}"
    if m := _RE_SCALE.match(name):
        return f"{m[1]}mla_attn.mla_attn.{m[2]}"
    return name


def renamed_copy(out: Path, dst: Path) -> tuple[Path, int]:
    """The rank files of `out` with CPU names, in `dst`; and how many keys were renamed."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    changed = 0
    for f in sorted(Path(out).glob("model-*.safetensors")):
        sd = load_file(str(f))
        new = {cuda_to_cpu(k): v for k, v in sd.items()}
        changed += sum(1 for k in sd if cuda_to_cpu(k) != k)
        save_file(new, str(dst / f.name))
    return dst, changed
