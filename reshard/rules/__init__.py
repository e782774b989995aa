"""Registry of supported architectures, keyed by config.json `architectures[0]`."""

from __future__ import annotations

from collections.abc import Iterable

from reshard.errors import UnsupportedError
from reshard.rules.deepseek import DEEPSEEK_V2
from reshard.rules.dsa import DSA_CUDA, DSA_PLATFORMS, GLM4_MOE_LITE, sparse_layers_refused
from reshard.rules.gemma import GEMMA2, GEMMA3, GEMMA3_MM
from reshard.rules.glm import GLM4_MOE
from reshard.rules.gptoss import GPT_OSS
from reshard.rules.kimi_k25 import KIMI_K25
from reshard.rules.llama import LLAMA, QWEN2, QWEN3
from reshard.rules.llama4 import LLAMA4, LLAMA4_TEXT
from reshard.rules.llama4_vision import LLAMA4_VL
from reshard.rules.minimax import MINIMAX_M2
from reshard.rules.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from reshard.rules.phi3 import PHI3
from reshard.rules.qwen3_next import QWEN3_5_MOE, QWEN3_5_MOE_TEXT, QWEN3_5_MOE_TEXT_PREFIXED, QWEN3_NEXT
from reshard.rules.qwen_vl import QWEN2_5_VL, QWEN3_5_MOE_VL, QWEN3_VL, QWEN3_VL_MOE
from reshard.rules.spec import Architecture, Mixers, WeightsMapper
from reshard.rules.styles import (
    QKV,
    Attention,
    Column,
    Experts,
    FusedExperts,
    HeadNorm,
    Heads,
    Linear,
    Merged,
    Replicate,
    Row,
    Rule,
    Vocab,
)

ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for name in arch.names:
        ARCHITECTURES[name] = arch
    return arch


for _arch in (
    *(LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, DEEPSEEK_V2, GEMMA2, GEMMA3, PHI3),
    *(GPT_OSS, LLAMA4, LLAMA4_TEXT, QWEN3_NEXT, QWEN3_5_MOE, GLM4_MOE, MINIMAX_M2),  # issue 15
):
    register(_arch)
for _arch in (
    *(QWEN3_5_MOE_TEXT, GLM4_MOE_LITE, DSA_CUDA),  # issue 27: DSA / text-only families
    *(QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, GEMMA3_MM, QWEN3_5_MOE_VL, LLAMA4_VL),  # issue 27: vision towers
    KIMI_K25,  # issue 27: Kimi-K2.5 (MoonViT + DeepSeek-V3)
):
    register(_arch)


# Relatives of supported families that reshard refuses by name: config.json name -> why.
REFUSED: dict[str, str] = {}
REFUSED.update(  # issue 15: neighbours of GLM-4.5/4.6, MiniMax-M2 and Kimi-K2
    {
        "KimiLinearForCausalLM": "Kimi-Linear's linear-attention (KDA) layers have no rule table",
        "MiniMaxText01ForCausalLM": "vLLM removed MiniMax-Text-01's lightning attention in 0.23",
        "MiniMaxM1ForCausalLM": "vLLM removed MiniMax-M1's lightning attention in 0.23",
        "Glm4MoeMTPModel": "a GLM MTP draft model: vLLM loads its layer from the main checkpoint, "
        "there is nothing to pre-shard",
    }
)


# issue 27: architectures whose vLLM class names the weights differently per platform -> per platform,
# the table or why that platform is refused
BY_PLATFORM: dict[str, dict[str, Architecture | str]] = {name: DSA_PLATFORMS for name in DSA_CUDA.names}


def for_platform(name: str, arch: Architecture, config: dict, platform: str | None) -> tuple[Architecture, str | None]:
    """The table of `arch` (config.json's `name`) for vLLM on `platform` (None: CUDA), and the platform the
    folder must record: None where the names do not depend on it."""
    tables = BY_PLATFORM.get(name)
    if tables is None:
        return arch, None
    platform = platform or "cuda"
    table = tables[platform]
    if isinstance(table, str):
        raise UnsupportedError(
            f"--platform {platform} for {name}: {table}",
            f"use --platform {' or --platform '.join(p for p, t in tables.items() if not isinstance(t, str))}, "
            "or serve the original checkpoint with vLLM's default loader",
        )
    why = sparse_layers_refused(arch.text(config))
    if why:
        raise UnsupportedError(f"{name}: {why}", "serve the original checkpoint with vLLM's default loader")
    return table, platform


# issue 27: tables whose checkpoint prefix differs by export -> (the prefix, the table that reads it)
BY_PREFIX: dict[str, tuple[str, Architecture]] = {
    "Qwen3_5MoeForCausalLM": ("model.language_model.", QWEN3_5_MOE_TEXT_PREFIXED),  # vLLM strips it
}


def for_checkpoint(name: str, arch: Architecture, tensors: Iterable[str]) -> Architecture:
    """The table of `arch` (config.json's `name`) that reads this checkpoint's tensor names."""
    prefix, table = BY_PREFIX.get(name, ("", arch))
    return table if prefix and any(n.startswith(prefix) for n in tensors) else arch


def get_architecture(config: dict) -> tuple[str, Architecture]:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    for name in names:
        if name in REFUSED:
            raise UnsupportedError(
                f"{name} is not supported: {REFUSED[name]}",
                "serve the original checkpoint with vLLM's default loader",
            )
    shown = ", ".join(names) if names else "none given in config.json"
    raise UnsupportedError(
        f"unsupported architecture ({shown})",
        "supported: " + ", ".join(sorted(ARCHITECTURES)),
    )


__all__ = [
    "ARCHITECTURES",
    "BY_PLATFORM",
    "QKV",
    "REFUSED",
    "Architecture",
    "Attention",
    "Column",
    "Experts",
    "FusedExperts",
    "HeadNorm",
    "Heads",
    "Linear",
    "Merged",
    "Mixers",
    "Replicate",
    "Row",
    "Rule",
    "Vocab",
    "WeightsMapper",
    "for_checkpoint",
    "for_platform",
    "get_architecture",
    "register",
]
