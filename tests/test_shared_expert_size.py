"""Qwen2-MoE and Qwen3-Next with `shared_expert_intermediate_size: 0`: vLLM builds no shared expert, but its gate
(`shared_expert_gate`, a ReplicatedLinear) whatever the size (qwen2_moe.py, qwen3_next.py), under
`mlp.shared_expert_gate` (Qwen2-MoE) or handed to the fused-MoE runner, `mlp.experts.shared_expert_gate`
(Qwen3-Next). Checked against vLLM 0.32's own state by a probe (its driver built each model and compared every
rank's keys, shapes and bytes: identical); here the keys. It was exit 4, a shared expert asked for (Qwen2-MoE) or
the gate matching no rule (Qwen3-Next). A checkpoint keeping transformers' zero-size shared-expert tensors is
refused (exit 4), as vLLM refuses it; it crashed (exit 1, a division by its zero rows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.cli import run
from tests.fixtures.saving import rank_tensors


def _without_shared_expert(src: Path, dst: Path, keep_empty: bool) -> Path:
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    sd = load_file(str(f))
    for k in [k for k in sd if ".shared_expert." in k]:
        if keep_empty:  # as transformers writes a size-0 shared expert: tensors of no rows
            sd[k] = torch.empty((0, *sd[k].shape[1:]), dtype=sd[k].dtype)
        else:
            del sd[k]
    save_file(sd, str(f), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "shared_expert_intermediate_size": 0}))
    return dst


@pytest.mark.parametrize(
    "arch, gate",
    [("qwen2-moe", "model.layers.0.mlp.shared_expert_gate.weight"), ("qwen3-next", None)],
)
def test_no_shared_expert_keeps_its_gate(tiny, tmp_path, arch, gate):
    src = _without_shared_expert(tiny(arch), tmp_path / "src", keep_empty=False)
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 0, err
    got = rank_tensors(tmp_path / "out", 1)
    assert not [k for k in got if "shared_expert." in k or "_shared_experts" in k]
    gates = [k for k in got if k.endswith("shared_expert_gate.weight")]
    want = gate or next(k for k in gates if k.endswith("mlp.experts.shared_expert_gate.weight"))
    assert want in gates and got[want].shape == (1, json.loads((src / "config.json").read_text())["hidden_size"])
    hf = load_file(str(next(src.glob("*.safetensors"))))
    layer = want.split(".mlp.")[0]
    assert torch.equal(got[want], hf[f"{layer}.mlp.shared_expert_gate.weight"])


def test_zero_size_shared_expert_tensors_are_refused(tiny, tmp_path):
    src = _without_shared_expert(tiny("qwen2-moe"), tmp_path / "src", keep_empty=True)
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4 and "match no rule" in err and "shared_expert." in err, err
