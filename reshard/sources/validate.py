"""Check what a source's JSON says before anything trusts it: config.json and the shard index.

Every malformed value becomes a SourceError (exit 4) naming the file, the key and what was found,
so the planner can take types for granted.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from reshard.errors import SourceError

# config keys that, where present, must be positive integers (top level and in text_config)
_POSITIVE = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "head_dim",
    "num_experts_per_tok",
)
# keys that, where present, must be non-negative integers (0 is meaningful)
_COUNTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "q_lora_rank",
           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "shared_expert_intermediate_size",
           "decoder_sparse_step")  # fmt: skip
_REFETCH = "the checkpoint's config.json is damaged: download it again or fix it"


def check_config(config: object, where: str) -> dict:
    """config.json must be an object with well-typed model dimensions; returns it."""
    if not isinstance(config, dict):
        raise SourceError(f"{where}: config.json is a JSON {type(config).__name__}, not an object", _REFETCH)
    arch = config.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        raise SourceError(f"{where}: config.json 'architectures' must be a list of names, found {arch!r}", _REFETCH)
    _check_numbers(config, where, "")
    text = config.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise SourceError(f"{where}: config.json 'text_config' must be an object, found {text!r}", _REFETCH)
        _check_numbers(text, where, "text_config.")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise SourceError(f"{where}: config.json 'quantization_config' must be an object, found {quant!r}", _REFETCH)
    return config


def _check_numbers(config: dict, where: str, prefix: str) -> None:
    for key, least in [*((k, 1) for k in _POSITIVE), *((k, 0) for k in _COUNTS)]:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            want = "a positive integer" if least else "a non-negative integer"
            raise SourceError(f"{where}: config.json {prefix}{key} must be {want}, found {value!r}", _REFETCH)


def check_index(index: object, where: str) -> list[str]:
    """model.safetensors.index.json's weight map: tensor name -> shard file inside the folder.
    Returns the shard files in order of first appearance."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        found = type(weight_map).__name__ if isinstance(index, dict) else f"a JSON {type(index).__name__}"
        raise SourceError(
            f"{where}: not a safetensors index (needs an object with a non-empty 'weight_map' object, found {found})",
            "download the checkpoint again",
        )
    files: dict[str, None] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise SourceError(f"{where}: weight_map[{name!r}] is {file!r}, not a .safetensors file name")
        path = PurePosixPath(file)
        if path.is_absolute() or ".." in path.parts:
            raise SourceError(f"{where}: weight_map[{name!r}] = {file!r} points outside the checkpoint folder")
        files.setdefault(file)
    return list(files)
