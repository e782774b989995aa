"""Qwen3-MoE's dense MLP (`mlp_only_layers`) is fused late: vLLM's Qwen3MoeForCausalLM adds `gate_up_proj` to its
packed_modules_mapping in __init__, after SupportsQuant.__new__ copied the mapping into the quantization config. In
a fresh vLLM process (every `vllm serve` worker) the quantization of `model.layers.N.mlp.gate_up_proj` is then
decided by that fused name alone. A checkpoint that leaves the layer unquantized by naming its parts
(`...mlp.gate_proj`, `...mlp.up_proj`) gets it built quantized: vLLM's default loader copies the bf16 weight into an
FP8 parameter (FP8) or fails (GPTQ, compressed-tensors). reshard refuses it (exit 3) rather than writing a folder
vLLM cannot load; naming the fused module too makes the two agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.fixtures.cli import run

DENSE = "model.layers.0.mlp."  # tiny qwen3-moe: mlp_only_layers [0]


def _dense_layer_left_bf16(quantized, tmp_path: Path, names: list[str]) -> Path:
    """The FP8 (per-tensor) qwen3-moe with layer 0's dense MLP stored bf16, `names` added to modules_to_not_convert."""
    fp8 = quantized("qwen3-moe", "fp8-tensor")
    src = Path(shutil.copytree(fp8, tmp_path / "src"))
    sd = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith(DENSE)}
    bf16 = load_file(str(fp8.parent / "bf16" / "model.safetensors"))
    sd.update({k: v for k, v in bf16.items() if k.startswith(DENSE)})
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    assert config["mlp_only_layers"] == [0]
    config["quantization_config"]["modules_to_not_convert"] += names
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_a_dense_layer_left_unquantized_by_its_parts_names_is_refused(quantized, tmp_path):
    src = _dense_layer_left_bf16(quantized, tmp_path, [DENSE + p for p in ("gate_proj", "up_proj", "down_proj")])
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 3 and err.count("\n") == 1, err
    assert "model.layers.0.mlp.gate_up_proj: vLLM's Qwen3MoeForCausalLM decides" in err
    assert "builds it quantized, while the checkpoint stores it unquantized" in err


def test_naming_the_fused_module_too_is_what_vllm_builds(quantized, tmp_path):
    src = _dense_layer_left_bf16(quantized, tmp_path, [DENSE + p for p in ("gate_proj", "up_proj", "gate_up_proj")])
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(DENSE + "down_proj")
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 0, err
    got = load_file(str(tmp_path / "out" / "model-rank-0-part-0.safetensors"))
    assert str(got[DENSE + "gate_up_proj.weight"].dtype) == "torch.bfloat16"
    assert DENSE + "gate_up_proj.weight_scale" not in got
