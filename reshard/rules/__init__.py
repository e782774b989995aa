"""Registry of supported architectures, keyed by config.json `architectures[0]`."""

from __future__ import annotations

from reshard.errors import UnsupportedError
from reshard.rules.deepseek import DEEPSEEK_V2
from reshard.rules.gemma import GEMMA2, GEMMA3, GEMMA3_MM
from reshard.rules.glm import GLM4_MOE
from reshard.rules.gptoss import GPT_OSS
from reshard.rules.llama import LLAMA, QWEN2, QWEN3
from reshard.rules.llama4 import LLAMA4, LLAMA4_TEXT
from reshard.rules.llama4_vision import LLAMA4_VL
from reshard.rules.minimax import MINIMAX_M2
from reshard.rules.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from reshard.rules.phi3 import PHI3
from reshard.rules.qwen3_next import QWEN3_5_MOE, QWEN3_NEXT
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
for _arch in (QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, GEMMA3_MM, QWEN3_5_MOE_VL, LLAMA4_VL):  # issue 27: vision towers
    register(_arch)


# Relatives of supported families that reshard refuses by name: config.json name -> why.
REFUSED: dict[str, str] = {}
REFUSED.update(  # issue 15: neighbours of GLM-4.5/4.6, MiniMax-M2 and Kimi-K2
    {
        "Glm4MoeLiteForCausalLM": "GLM-4.7-Flash's latent attention (glm4_moe_lite.py) has no rule table "
        "checked against vLLM",
        "GlmMoeDsaForCausalLM": "GLM-5's sparse-attention indexer weights (vLLM deepseek_v32.py) have no rule table",
        "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse-attention indexer weights have no rule table",
        "KimiK25ForConditionalGeneration": "Kimi-K2.5 wraps the text model with a vision tower; "
        "its multimodal layout is not written",
        "KimiLinearForCausalLM": "Kimi-Linear's linear-attention (KDA) layers have no rule table",
        "MiniMaxText01ForCausalLM": "vLLM removed MiniMax-Text-01's lightning attention in 0.23",
        "MiniMaxM1ForCausalLM": "vLLM removed MiniMax-M1's lightning attention in 0.23",
        "Glm4MoeMTPModel": "a GLM MTP draft model: vLLM loads its layer from the main checkpoint, "
        "there is nothing to pre-shard",
    }
)


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
    "get_architecture",
    "register",
]
