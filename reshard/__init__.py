"""reshard: pre-shard Hugging Face checkpoints into vLLM's per-rank `sharded_state` layout."""

__version__ = "0.1.0"

# The vLLM release whose `ShardedStateLoader` layout the output targets.
VLLM_LAYOUT = "0.32"
