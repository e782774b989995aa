#!/usr/bin/env python
"""Turn a tiny bf16 checkpoint into the FP8 formats quantization tools write, for reshard's tests.

    python scripts/tiny_quant.py SRC OUT --scheme fp8-tensor|fp8-tensor-static|ct-channel|ct-tensor

- fp8-tensor[-static]: `quant_method: fp8` without `weight_block_size` (per-tensor `weight_scale`,
  `input_scale` when static), as e.g. RedHatAI's FP8 Llama releases.
- ct-channel / ct-tensor: compressed-tensors `float-quantized` (llm-compressor's FP8_DYNAMIC and
  FP8 schemes): `weight_scale` [out, 1] per channel with dynamic per-token inputs, or one per
  tensor with a static per-tensor `input_scale`.
Every Linear except lm_head and MoE routers is quantized; values are random-ish, only layout matters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
SKIP = ("lm_head", "embed_tokens", "norm", "mlp.gate.", "block_sparse_moe.gate.", "shared_expert_gate")


def quantizable(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in SKIP)


def convert(src: Path, out: Path, scheme: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not quantizable(name, t):
            result[name] = t
            continue
        w = t.float()
        base = name[: -len(".weight")]
        if scheme == "ct-channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-8)
            result[f"{base}.weight_scale"] = scale.float()
        else:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-8)
            shape = [1] if scheme == "ct-tensor" else []
            result[f"{base}.weight_scale"] = scale.reshape(shape).float()
        result[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if scheme in ("fp8-tensor-static", "ct-tensor"):
            # distinct per module, equal for an expert's gate and up (compressed-tensors requires it)
            key = base.replace("gate_proj", "up_proj").replace(".w1", ".w3")
            result[f"{base}.input_scale"] = torch.tensor(
                0.01 + zlib.crc32(key.encode()) % 97 / 1000, dtype=torch.float32
            )
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if scheme.startswith("fp8-tensor"):
        skipped = sorted({n[: -len(".weight")] for n, t in tensors.items() if n.endswith(".weight")
                          and t.dim() == 2 and not quantizable(n, t) and "embed" not in n})  # fmt: skip
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "static" if scheme.endswith("static") else "dynamic",
            "modules_to_not_convert": skipped,
        }
    else:
        strategy = "channel" if scheme == "ct-channel" else "tensor"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                                "dynamic": False, "group_size": None, "block_structure": None},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                          "strategy": "token" if strategy == "channel" else "tensor",
                                          "dynamic": strategy == "channel"},
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"],
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, out / extra.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--scheme", required=True, choices=["fp8-tensor", "fp8-tensor-static", "ct-channel", "ct-tensor"])
    a = ap.parse_args()
    print(convert(a.src, a.out, a.scheme))


if __name__ == "__main__":
    main()
