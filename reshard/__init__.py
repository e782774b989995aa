"""reshard: pre-shard Hugging Face checkpoints into vLLM's per-rank `sharded_state` layout."""

__version__ = "0.1.0"

# The vLLM release whose `ShardedStateLoader` layout the output targets.
VLLM_LAYOUT = "0.32"

# The vLLM releases that load that layout unchanged (docs/vllm-versions.md says how this was
# checked, and how to check a new release). Recorded in every manifest as `vllm_versions`;
# `reshard verify` warns when the vLLM installed beside it is outside. Clauses joined by commas,
# each an operator (>=, >, <=, <, ==, !=) and a release.
VLLM_VERSIONS = ">=0.32,<0.34"
