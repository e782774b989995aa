"""The `vllm serve` lines that load an output as written, and the load format of reshard's own loader."""

from __future__ import annotations

import shlex

from reshard.layout import Layout

# the --load-format of reshard's vLLM loader plugin (reshard.vllm_plugin): strict and checksum-verified
PLUGIN_LOAD_FORMAT = "reshard"
PLUGIN_NOTE = (
    "or `--load-format reshard` (reshard's vLLM plugin, installed with reshard): it checks the folder against "
    "the engine before reading and verifies every checksum while loading"
)


def serve_command(
    out_dir: str,
    layout: Layout,
    *,
    load_format: str = "sharded_state",
    extra: tuple[str, ...] = (),
    trust_remote_code: bool = False,
) -> str:
    """The `vllm serve` line that loads `out_dir` as written: the planned `layout` (its dtype, and the
    MoE backend pinned where the experts' layout depends on it); trust_remote_code: the checkpoint
    ships its own config/tokenizer code and `save --trust-remote-code` was asked (Kimi-K2's tokenizer).
    The folder is shell-quoted: the line pastes into a shell as it is, spaces and all."""
    parts = [f"vllm serve {shlex.quote(out_dir)} --load-format {load_format}", f"--tensor-parallel-size {layout.tp}"]
    if layout.pp > 1:
        parts.append(f"--pipeline-parallel-size {layout.pp}")
    if layout.ep:
        parts.append("--enable-expert-parallel")
    parts.append(f"--dtype {layout.dtype}")
    if layout.moe_pin:
        parts.append(f"--moe-backend {layout.moe_pin}")
    parts.extend(extra)  # e.g. --language-model-only: the files hold no vision tower
    if trust_remote_code:
        parts.append("--trust-remote-code")
    return " ".join(parts)
