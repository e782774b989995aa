"""Registry of supported architectures, keyed by config.json `architectures[0]`."""

from __future__ import annotations

from reshard.errors import UnsupportedError
from reshard.rules.deepseek import DEEPSEEK_V2
from reshard.rules.gemma import GEMMA2, GEMMA3
from reshard.rules.glm import GLM4_MOE
from reshard.rules.llama import LLAMA, QWEN2, QWEN3
from reshard.rules.minimax import MINIMAX_M2
from reshard.rules.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from reshard.rules.phi3 import PHI3
from reshard.rules.spec import Architecture, Kind, Module

ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for name in arch.names:
        ARCHITECTURES[name] = arch
    return arch


for _arch in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, DEEPSEEK_V2, GEMMA2, GEMMA3, PHI3):
    register(_arch)
for _arch in (GLM4_MOE, MINIMAX_M2):  # issue 15
    register(_arch)


def get_architecture(config: dict) -> tuple[str, Architecture]:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    shown = ", ".join(names) if names else "none given in config.json"
    raise UnsupportedError(
        f"unsupported architecture ({shown})",
        "supported: " + ", ".join(sorted(ARCHITECTURES)),
    )


__all__ = ["ARCHITECTURES", "Architecture", "Kind", "Module", "get_architecture", "register"]
