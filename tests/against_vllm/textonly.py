"""Vision-language checkpoints that reshard writes as their text model only (served with
``--language-model-only``): what the vLLM harness must ask of vLLM for them.

vLLM builds ``Qwen3_5MoeForConditionalGeneration``'s vision tower unless every modality's prompt limit
is zero (``SupportsMultiModal._mark_tower_model``); ``language_model_only=True`` makes it a
``StageMissingLayer``, absent from the state dict, as in the serve line reshard prints. vLLM's Qwen3.5
code also needs torchvision importable (``stubs/torchvision``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TEXT_ONLY = frozenset({"Qwen3_5MoeForConditionalGeneration", "Llama4ForConditionalGeneration"})
# issue 27: vision towers built and checked; vLLM's Qwen-VL code imports torchvision too
NEEDS_STUB = TEXT_ONLY | {
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",  # the text-only Qwen3.5-MoE class lives in vLLM's qwen3_5.py too, no tower
}
STUBS = Path(__file__).resolve().parent / "stubs"


def _architectures(model_dir: str | os.PathLike) -> list[str]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return list(config.get("architectures") or [])


def language_model_only(model_dir: str | os.PathLike) -> bool:
    return any(a in TEXT_ONLY for a in _architectures(model_dir))


def env(model_dir: str | os.PathLike, base: dict[str, str]) -> dict[str, str]:
    """``base`` with the torchvision stub first on PYTHONPATH when ``model_dir``'s vLLM code imports it."""
    if not any(a in NEEDS_STUB for a in _architectures(model_dir)):
        return base
    paths = [str(STUBS), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    return {**base, "PYTHONPATH": os.pathsep.join(paths)}
