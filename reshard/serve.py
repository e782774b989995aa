"""The `vllm serve` lines that load an output as written, and the load format of reshard's own loader."""

from __future__ import annotations

# the --load-format of reshard's vLLM loader plugin (reshard.vllm_plugin): strict and checksum-verified
PLUGIN_LOAD_FORMAT = "reshard"
PLUGIN_NOTE = (
    "or `--load-format reshard` (reshard's vLLM plugin, installed with reshard): it checks the folder against "
    "the engine before reading and verifies every checksum while loading"
)


def serve_command(
    out_dir: str,
    *,
    tp: int,
    pp: int,
    ep: bool,
    dtype: str,
    load_format: str = "sharded_state",
    moe_backend: str | None = None,
    extra: tuple[str, ...] = (),
    trust_remote_code: bool = False,
) -> str:
    """The `vllm serve` line that loads `out_dir` as written (dtype: torch's name, e.g. bfloat16;
    moe_backend: pinned where the experts' layout depends on vLLM's MoE backend;
    trust_remote_code: the checkpoint ships its own config/tokenizer code, e.g. Kimi-K2's)."""
    parts = [f"vllm serve {out_dir} --load-format {load_format}", f"--tensor-parallel-size {tp}"]
    if pp > 1:
        parts.append(f"--pipeline-parallel-size {pp}")
    if ep:
        parts.append("--enable-expert-parallel")
    parts.append(f"--dtype {dtype}")
    if moe_backend:
        parts.append(f"--moe-backend {moe_backend}")
    parts.extend(extra)  # e.g. --language-model-only: the files hold no vision tower
    if trust_remote_code:
        parts.append("--trust-remote-code")
    return " ".join(parts)
