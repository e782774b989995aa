"""Which quantization strategy config.json's `quantization_config` describes (reshard.plan.quant: the
FP8 and MXFP4 schemes; reshard.plan.intquant: compressed-tensors' integer ones)."""

from __future__ import annotations

from dataclasses import replace

from reshard.errors import SourceError, UnsupportedError
from reshard.plan.gptq import awq_from_config, gptq_from_config
from reshard.plan.intquant import int_compressed_tensors
from reshard.plan.kvscales import kv_cache_scheme
from reshard.plan.modelopt import FP8_ALGOS, modelopt_algo, modelopt_fp8
from reshard.plan.nvfp4 import ct_nvfp4, is_modelopt_fp4, modelopt_nvfp4
from reshard.plan.quant import (
    CompressedTensorsBlock,
    CompressedTensorsChannel,
    CompressedTensorsTensor,
    Fp8Block,
    Fp8Tensor,
    Mxfp4,
    Quant,
)


def quant_from_config(config: dict) -> Quant | None:
    """The scheme config.json's quantization_config describes; None when it has none."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", ""))
    algo = modelopt_algo(qc)
    if algo is not None:  # NVIDIA ModelOpt: FP8 (reshard.plan.modelopt), NVFP4 (reshard.plan.nvfp4)
        if is_modelopt_fp4(qc):
            return modelopt_nvfp4(qc)
        if algo in FP8_ALGOS:
            return modelopt_fp8(qc)
        method = f"{method or 'modelopt'} {algo}"
    if method in ("mxfp4", "gpt_oss_mxfp4"):
        if config.get("model_type") != "gpt_oss":
            raise UnsupportedError(
                f"quantization mxfp4 on model_type {config.get('model_type')!r}: reshard writes vLLM's MXFP4 "
                "layout for gpt-oss only (other MXFP4 checkpoints load through other vLLM methods)"
            )
        return Mxfp4(None, False, ())
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    # issue 26: GPTQ / AWQ (vLLM's aliases of AutoGPTQConfig / AutoAWQConfig)
    if method in ("gptq", "gptq_marlin", "auto_gptq"):
        return gptq_from_config(qc)
    if method in ("awq", "awq_marlin", "auto_awq"):
        return awq_from_config(qc)
    if method != "fp8":
        raise UnsupportedError(
            f"quantization {method!r} is not supported",
            "supported: fp8 (block, per-tensor), compressed-tensors FP8 (tensor, channel, block), W4A16 "
            "(pack-quantized), W8A8-int8 (int-quantized) and NVFP4 (nvfp4-pack-quantized), gptq (symmetric "
            "4/8-bit), awq (4-bit), mxfp4 (gpt-oss), modelopt FP8 (FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO) and NVFP4",
        )
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise UnsupportedError(f"weight_block_size must have 2 dimensions, got {block}")
        block = (int(block[0]), int(block[1]))
    static = qc.get("activation_scheme", "dynamic") == "static"
    if block and static:
        raise UnsupportedError("block FP8 with a static activation scheme is refused by vLLM")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    return Fp8Block(block, static, ignored) if block else Fp8Tensor(None, static, ignored)


def _compressed_tensors(qc: dict) -> Quant:
    """Compressed-tensors: one config group (its targets: reshard.plan.quant._CompressedTensors), of FP8
    weights (W8A8, float-quantized) here, integer weights in reshard.plan.intquant, NVFP4 in reshard.plan.nvfp4."""
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedError(f"compressed-tensors with {len(groups)} config groups is not supported")
    targets = groups[0].get("targets")  # its type is checked with the rest of config.json (reshard.sources.validate)
    if targets is None:
        raise SourceError(
            "config.json's compressed-tensors config group has no targets, which vLLM reads to find the layers it "
            "quantizes"
        )
    return replace(_one_group(qc, groups), targets=tuple(targets))


def _one_group(qc: dict, groups: list) -> Quant:
    kv = kv_cache_scheme(qc.get("kv_cache_scheme"))
    weights = groups[0].get("weights") or {}
    inputs = groups[0].get("input_activations") or {}
    if weights.get("type") == "int":
        return int_compressed_tensors(qc, groups[0], kv)
    if weights.get("type") == "float" and weights.get("num_bits") == 4:  # NVFP4 (reshard.plan.nvfp4)
        return ct_nvfp4(qc, groups[0], kv)
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedError(
            "compressed-tensors: only FP8 weights (type float, 8 bits) are supported",
            f"this checkpoint has {weights.get('type')} {weights.get('num_bits')}-bit weights",
        )
    static = bool(inputs) and not inputs.get("dynamic", True)
    ignored = tuple(qc.get("ignore") or [])
    strategy = str(weights.get("strategy"))
    if strategy == "block":
        return CompressedTensorsBlock(tuple(weights["block_structure"]), static, ignored, kv)
    if strategy == "channel":
        return CompressedTensorsChannel(None, static, ignored, kv)
    if strategy == "tensor":
        return CompressedTensorsTensor(None, static, ignored, kv)
    raise UnsupportedError(f"compressed-tensors weight strategy {strategy!r} is not supported")
