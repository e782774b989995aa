"""The running vLLM engine as the loader's checks and messages see it (plain data, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from reshard.layout import Layout


@dataclass(frozen=True)
class Engine:
    """What the running vLLM engine is, as far as a folder's layout depends on it: its layout (tp, pp,
    ep, the model dtype and --moe-backend), quantization method and release, and this rank."""

    layout: Layout
    quantization: str | None  # vLLM's quantization method name
    vllm_version: str
    tp_rank: int = 0
    pp_rank: int = 0
    lora: bool = False  # --enable-lora: vLLM pads some parameters and loads into a narrowed view

    @property
    def label(self) -> str:
        return f"pp rank {self.pp_rank} tp rank {self.tp_rank}" if self.layout.pp > 1 else f"rank {self.tp_rank}"
