"""compressed-tensors' integer formats (W4A16 / W8A16 pack-quantized, W8A8-int8): per-rank layout, refusals,
merge back to the original bytes, re-shard of an output, verify --deep. vLLM's own state for these
layouts: tests/against_vllm (test_vllm.py's CT cases)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import UnsupportedError
from reshard.format import ITEMSIZE
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART
from reshard.verify import verify
from tests.fixtures.cli import run
from tests.fixtures.saving import rank_tensors, save
from tests.test_reshard_merge import assert_same, load_dir

MAX = DEFAULT_MAX_PART


@pytest.fixture(scope="module")
def ctq(quantized):
    """ctq(arch, scheme) -> a tiny checkpoint as llm-compressor write(s) `scheme` (conftest.quantized)."""
    return quantized


_rank = rank_tensors


def _config(src: Path, **weights) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (src / "config.json").write_text(json.dumps(cfg))


def test_w4a16_asym_dense_layout_tp2(ctq, tmp_path):
    src = ctq("llama", "ct-w4a16-asym")
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    sd = _rank(tmp_path / "o", 1)
    a = "model.layers.0.self_attn."
    # q 256 + k 64 + v 64 rows, halved; K = 64 packed 8 to an int32; groups of 16
    assert (sd[a + "qkv_proj.weight_packed"].dtype, list(sd[a + "qkv_proj.weight_packed"].shape)) == (
        torch.int32,
        [192, 8],
    )
    assert (sd[a + "qkv_proj.weight_scale"].dtype, list(sd[a + "qkv_proj.weight_scale"].shape)) == (
        torch.bfloat16,
        [192, 4],
    )
    assert list(sd[a + "qkv_proj.weight_zero_point"].shape) == [24, 4]
    # row-parallel: K = 256 split, scales and zero points by groups
    assert list(sd[a + "o_proj.weight_packed"].shape) == [64, 16]
    assert list(sd[a + "o_proj.weight_scale"].shape) == [64, 8]
    assert list(sd[a + "o_proj.weight_zero_point"].shape) == [8, 8]
    # weight_shape: the last shard's (v_proj, up_proj) whole, as vLLM's plain parameter keeps it
    assert sd[a + "qkv_proj.weight_shape"].tolist() == [64, 64]
    assert sd["model.layers.0.mlp.gate_up_proj.weight_shape"].tolist() == [128, 64]
    assert sd[a + "o_proj.weight_shape"].tolist() == [64, 256]
    # rank 1's zero points of k: packed rows [32 / 8, 64 / 8) of k_proj's
    hf = load_file(str(src / "model.safetensors"))
    zp = sd[a + "qkv_proj.weight_zero_point"]
    assert torch.equal(zp[16:20], hf[a + "k_proj.weight_zero_point"][4:8])
    assert torch.equal(sd[a + "o_proj.weight_packed"], hf[a + "o_proj.weight_packed"][:, 16:])
    # plan shows the packed bytes each rank holds
    summary = res.plan.summary()
    for r in (0, 1):
        held = _rank(tmp_path / "o", r)
        assert summary["ranks"][r]["bytes"] == sum(t.numel() * t.element_size() for t in held.values())
        assert summary["ranks"][r]["keys"] == len(held)


def test_w4a16_moe_layout_tp2_and_ep(ctq, tmp_path):
    src = ctq("qwen3-moe", "ct-w4a16-asym")
    save(str(src), tmp_path / "tp", tp=2, max_part_size=MAX)
    save(str(src), tmp_path / "ep", tp=2, ep=True, max_part_size=MAX)
    e = "model.layers.1.mlp.experts.routed_experts."
    tp, ep = _rank(tmp_path / "tp", 1), _rank(tmp_path / "ep", 1)
    shapes = {k[len(e) :]: (str(v.dtype), list(v.shape)) for k, v in tp.items() if k.startswith(e)}
    assert shapes == {
        "w13_weight_packed": ("torch.int32", [8, 32, 8]),  # [E, 2 I_p, H / 8], I_p = 16
        "w2_weight_packed": ("torch.int32", [8, 64, 2]),  # [E, H, I_p / 8]
        "w13_weight_scale": ("torch.bfloat16", [8, 32, 4]),
        "w2_weight_scale": ("torch.bfloat16", [8, 64, 1]),
        "w13_weight_zero_point": ("torch.int32", [8, 4, 4]),
        "w2_weight_zero_point": ("torch.int32", [8, 8, 1]),
        "w13_weight_shape": ("torch.bfloat16", [8, 2]),
        "w2_weight_shape": ("torch.bfloat16", [8, 2]),
    }
    assert tp[e + "w13_weight_shape"].tolist() == [[32.0, 64.0]] * 8
    assert tp[e + "w2_weight_shape"].tolist() == [[64.0, 32.0]] * 8
    assert list(ep[e + "w13_weight_packed"].shape) == [4, 64, 8]  # experts 4..7 whole
    assert list(ep[e + "w2_weight_scale"].shape) == [4, 64, 2]
    hf = load_file(str(src / "model.safetensors"))
    assert torch.equal(tp[e + "w2_weight_packed"][3], hf["model.layers.1.mlp.experts.3.down_proj.weight_packed"][:, 2:])
    assert torch.equal(ep[e + "w2_weight_packed"][0], hf["model.layers.1.mlp.experts.4.down_proj.weight_packed"])


def test_w8a8_static_keeps_the_last_shards_input_scale(ctq, tmp_path):
    src = ctq("llama", "ct-w8a8-static")
    save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    sd, hf = _rank(tmp_path / "o", 0), load_file(str(src / "model.safetensors"))
    a = "model.layers.2."
    assert sd[a + "self_attn.qkv_proj.weight"].dtype == torch.int8
    assert sd[a + "self_attn.qkv_proj.weight_scale"].dtype == torch.float32
    assert list(sd[a + "self_attn.qkv_proj.weight_scale"].shape) == [3]
    assert torch.equal(sd[a + "self_attn.qkv_proj.input_scale"], hf[a + "self_attn.v_proj.input_scale"])
    assert torch.equal(sd[a + "self_attn.qkv_proj.input_zero_point"], hf[a + "self_attn.v_proj.input_zero_point"])
    assert torch.equal(sd[a + "mlp.gate_up_proj.input_scale"], hf[a + "mlp.up_proj.input_scale"])
    assert not torch.equal(hf[a + "mlp.gate_proj.input_scale"], hf[a + "mlp.up_proj.input_scale"])


@pytest.mark.parametrize(
    "arch, scheme, layout, message",
    [
        (
            "qwen3-moe",
            "ct-w4a16",
            dict(tp=4),
            "per-rank intermediate size 8 is not a multiple of the quantization group 16",
        ),
        ("llama", "ct-w4a16-g32", dict(tp=8), "per-rank input size 16 is not a multiple of the quantization group 32"),
        ("qwen3-moe", "ct-w8a8-static", dict(tp=2), "int8 experts with per-tensor weight scales"),
    ],
)
def test_refusals(ctq, tmp_path, arch, scheme, layout, message):
    with pytest.raises(UnsupportedError, match=message) as e:
        save(str(ctq(arch, scheme)), tmp_path / "o", max_part_size=MAX, **layout)
    assert e.value.exit_code == 3


@pytest.mark.parametrize(
    "weights, message",
    [
        (dict(actorder="group"), "actorder 'group'"),
        (dict(num_bits=2), "2-bit weights: vLLM supports"),
    ],
)
def test_config_refusals(ctq, tmp_path, weights, message):
    src = tmp_path / "src"
    src.mkdir()
    for f in ctq("llama", "ct-w4a16").iterdir():
        (src / f.name).symlink_to(f)
    (src / "config.json").unlink()
    (src / "config.json").write_text((ctq("llama", "ct-w4a16") / "config.json").read_text())
    _config(src, **weights)
    with pytest.raises(UnsupportedError, match=message):
        save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)


@pytest.mark.parametrize(
    "arch, scheme, layout",
    [
        ("llama", "ct-w4a16-asym", dict(tp=2)),
        ("llama", "ct-w4a16-channel", dict(tp=4)),
        ("qwen3-moe", "ct-w4a16-asym", dict(tp=2)),
        ("qwen3-moe", "ct-w4a16-b8", dict(tp=2, ep=True)),
        ("qwen3-moe", "ct-w8a8", dict(tp=2)),
    ],
)
def test_merge_round_trips_byte_identical(ctq, tmp_path, arch, scheme, layout):
    src = ctq(arch, scheme)
    save(str(src), tmp_path / "out", max_part_size=MAX, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf")
    assert result["not_in_output"] == []  # weight_shape of the dropped shards rebuilt from weight_packed
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))
    report = verify(tmp_path / "out", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["compared_bytes"] > 0


def test_merge_of_w8a8_static_names_the_input_scales_vllm_drops(ctq, tmp_path):
    src = ctq("llama", "ct-w8a8-static")
    save(str(src), tmp_path / "out", tp=2, max_part_size=MAX)
    result = merge(tmp_path / "out", tmp_path / "hf")
    dropped = {n.rsplit(".", 2)[-2] for n in result["not_in_output"]}
    assert dropped == {"q_proj", "k_proj", "gate_proj"}
    assert len(result["not_in_output"]) == 4 * 3 * 2  # layers x {q, k, gate} x {input_scale, zero point}


def test_reshard_of_a_w8a8_static_output_is_refused_as_lossy(ctq, tmp_path):
    """vLLM keeps one input scale per fused module (the last part's): the output does not hold q's and
    k's, which any layout needs again. Exit 3 saying so, not exit 4 blaming the checkpoint as incomplete."""
    src = ctq("llama", "ct-w8a8-static")
    save(str(src), tmp_path / "out", tp=2, max_part_size=MAX)
    with pytest.raises(UnsupportedError, match=r"does not hold the original's 'model\.layers\.0\.self_attn\.q_proj"):
        save(str(tmp_path / "out"), tmp_path / "again", tp=2, max_part_size=MAX)
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    "arch, scheme, first, second",
    [
        ("llama", "ct-w4a16-asym", dict(tp=4), dict(tp=2, pp=2)),
        ("qwen3-moe", "ct-w4a16-asym", dict(tp=2), dict(tp=2, ep=True)),
        ("qwen3-moe", "ct-w8a8", dict(tp=2, ep=True), dict(tp=4)),
    ],
)
def test_reshard_an_output_equals_resharding_the_original(ctq, tmp_path, arch, scheme, first, second):
    src = ctq(arch, scheme)
    save(str(src), tmp_path / "first", max_part_size=MAX, **first)
    save(str(tmp_path / "first"), tmp_path / "via", max_part_size=MAX, **second)
    save(str(src), tmp_path / "direct", max_part_size=MAX, **second)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))


def test_packed_bytes_per_rank_add_up(ctq, tmp_path):
    """Every packed tensor of the checkpoint lands on the ranks once under EP (no replica)."""
    src = ctq("qwen3-moe", "ct-w4a16")
    res = save(str(src), tmp_path / "o", tp=2, ep=True, max_part_size=MAX)
    hf = load_file(str(src / "model.safetensors"))
    packed = sum(t.numel() * 4 for n, t in hf.items() if "experts." in n and n.endswith("weight_packed"))
    ranks = [_rank(tmp_path / "o", r) for r in (0, 1)]
    held = sum(
        math.prod(t.shape) * ITEMSIZE["I32"]
        for sd in ranks
        for n, t in sd.items()
        if "w13_weight_packed" in n or "w2_weight_packed" in n
    )
    assert held == packed
    assert res.plan.total_bytes == sum(t.numel() * t.element_size() for sd in ranks for t in sd.values())


def test_narrowed_targets_leave_the_rest_unquantized(ctq, tmp_path):
    """vLLM quantizes the layers the config group's targets match and builds the rest unquantized
    (CompressedTensorsConfig.get_scheme_dict): attention-only targets keep the MLP bf16; experts ignored by an
    entry below their module (matched against expert 0's projections) keep the experts bf16. (vLLM's own
    state_dict: tests/against_vllm, `-tgt-attn`, `-tgt-moe`, `-ign-moe`.)"""
    save(str(ctq("llama", "ct-w4a16-asym-tgt-attn")), tmp_path / "a", tp=2, max_part_size=MAX)
    sd = _rank(tmp_path / "a", 0)
    assert "model.layers.0.self_attn.qkv_proj.weight_packed" in sd
    assert sd["model.layers.0.mlp.gate_up_proj.weight"].dtype == torch.bfloat16
    save(str(ctq("qwen3-moe", "ct-w4a16-asym-ign-moe")), tmp_path / "m", tp=2, max_part_size=MAX)
    sd = _rank(tmp_path / "m", 0)
    assert "model.layers.0.self_attn.qkv_proj.weight_packed" in sd
    assert sd["model.layers.1.mlp.experts.routed_experts.w13_weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "targets, ignore, code, says",
    [
        (["Embedding"], None, 3, "compressed-tensors config group target 'Embedding'"),
        ("Linear", None, 4, "targets must be a list of strings"),
        # gate and up quantized, down not: vLLM's CompressedTensorsMoEMethod refuses mixed projections
        (["Linear"], ["lm_head", "re:.*mlp.gate$", "re:.*experts\\.0\\.down_proj"], 3, "some of expert 0's"),
    ],
)
def test_targets_vllm_does_not_build_are_refused(ctq, tmp_path, targets, ignore, code, says):
    src = tmp_path / "src"
    shutil.copytree(ctq("qwen3-moe", "ct-w4a16-asym"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = targets
    if ignore is not None:
        cfg["quantization_config"]["ignore"] = ignore
    (src / "config.json").write_text(json.dumps(cfg))
    got, _, err = run("plan", str(src), "--tp", "2")
    assert got == code and says in err and err.count("\n") == 1, err
