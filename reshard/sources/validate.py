"""Check what a source's JSON says before anything trusts it: config.json and the shard index.

Every malformed value becomes a SourceError (exit 4) naming the file, the key and what was found,
so the planner can take types for granted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath

from reshard.errors import SourceError

Check = Callable[[object], bool]


MAX_DIM = 1 << 31  # no real model comes near: a larger value is damage, and would be planned for ever


def _int(least: int) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and least <= v <= MAX_DIM


def _list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _is(*types: type) -> Check:
    return lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


POSITIVE, COUNT, FLAG, NAME, NAMES, OBJECT = _int(1), _int(0), _is(bool), _is(str), _list_of(_is(str)), _is(dict)
# true, false, or "local" (llm-compressor's NVFP4 input activations: per-group scales computed at run time
# under a static global scale; vLLM 0.32 reads it)
DYNAMIC: Check = lambda v: isinstance(v, bool) or v == "local"  # noqa: E731
WHAT = {
    DYNAMIC: 'true, false or "local"',
    OBJECT: "an object",
    POSITIVE: f"a positive integer (at most {MAX_DIM})",
    COUNT: f"a non-negative integer (at most {MAX_DIM})",
    FLAG: "true or false",
    NAME: "a string",
    NAMES: "a list of strings",
}

# every config.json key the planner reads, and what it must be where present (null = absent)
CONFIG_SCHEMA: dict[str, Check] = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                     "vocab_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                     "num_local_experts", "n_routed_experts", "head_dim", "num_experts_per_tok",
                     "decoder_sparse_step", "moe_layer_freq", "full_attention_interval"), POSITIVE),
    **dict.fromkeys(("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "shared_expert_intermediate_size", "interleave_moe_layer_step"), COUNT),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), FLAG),
    **dict.fromkeys(("torch_dtype", "dtype", "topk_method", "scoring_func"), NAME),
    "architectures": NAMES,
    "layer_types": NAMES,
    "mlp_only_layers": _list_of(COUNT),
    "compression_config": OBJECT,
}  # fmt: skip
QUANT_SCHEMA: dict[str, Check] = {
    "quant_method": NAME,
    "activation_scheme": NAME,
    "weight_block_size": _list_of(POSITIVE),
    "ignored_layers": NAMES,
    "modules_to_not_convert": NAMES,
    "ignore": NAMES,
    "config_groups": _is(dict),
    "kv_cache_scheme": _is(dict),
}
GROUP_SCHEMA: dict[str, Check] = {"weights": _is(dict), "input_activations": _is(dict), "targets": NAMES}
ARGS_SCHEMA: dict[str, Check] = {
    "type": NAME,
    "num_bits": POSITIVE,
    "strategy": NAME,
    "dynamic": DYNAMIC,
    "block_structure": _list_of(POSITIVE),
}
_REFETCH = "the checkpoint's config.json is damaged: download it again or fix it"


def check_config(config: object, where: str) -> dict:
    """config.json must be an object whose keys the planner reads are well typed; returns it."""
    if not isinstance(config, dict):
        raise SourceError(f"{where}: config.json is a JSON {type(config).__name__}, not an object", _REFETCH)
    _check(config, CONFIG_SCHEMA, where, "")
    text = config.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise SourceError(f"{where}: config.json text_config must be an object, found {text!r}", _REFETCH)
        _check(text, CONFIG_SCHEMA, where, "text_config.")
    for prefix, obj in (("", config), ("text_config.", text or {})):
        types, layers = obj.get("layer_types"), obj.get("num_hidden_layers")
        if types and isinstance(layers, int) and len(types) < layers:
            raise SourceError(
                f"{where}: config.json {prefix}layer_types lists {len(types)} layers, num_hidden_layers is {layers}",
                _REFETCH,
            )
    quant = config.get("quantization_config")
    if quant is not None:
        if not isinstance(quant, dict):
            raise SourceError(f"{where}: config.json quantization_config must be an object, found {quant!r}", _REFETCH)
        _check(quant, QUANT_SCHEMA, where, "quantization_config.")
        for name, group in (quant.get("config_groups") or {}).items():
            prefix = f"quantization_config.config_groups.{name}."
            if not isinstance(group, dict):
                raise SourceError(f"{where}: config.json {prefix[:-1]} must be an object, found {group!r}", _REFETCH)
            _check(group, GROUP_SCHEMA, where, prefix)
            for part in ("weights", "input_activations"):
                if group.get(part):
                    _check(group[part], ARGS_SCHEMA, where, f"{prefix}{part}.")
    return config


def _check(obj: dict, schema: dict[str, Check], where: str, prefix: str) -> None:
    for key, ok in schema.items():
        value = obj.get(key)
        if value is not None and not ok(value):
            want = WHAT.get(ok, "an object" if key in ("config_groups", "kv_cache_scheme") else "a list of integers")
            raise SourceError(f"{where}: config.json {prefix}{key} must be {want}, found {value!r}"[:300], _REFETCH)


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
        if type(file) is str and file in files:
            continue  # checked at its first tensor: each shard once, not once per tensor (issue 28)
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise SourceError(f"{where}: weight_map[{name!r}] is {file!r}, not a .safetensors file name")
        path = PurePosixPath(file)
        if path.is_absolute() or ".." in path.parts:
            raise SourceError(f"{where}: weight_map[{name!r}] = {file!r} points outside the checkpoint folder")
        if len(path.parts) != 1 or "\\" in file:
            raise SourceError(
                f"{where}: weight_map[{name!r}] = {file!r} names a file in a subfolder",
                "vLLM loads only the folder's own *.safetensors: put the shards beside the index",
            )
        files.setdefault(file)
    return list(files)
