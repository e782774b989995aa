"""NVFP4, compressed-tensors (nvfp4-pack-quantized) and ModelOpt (quant_algo NVFP4): per-rank layout, the
experts' EP input scales by --moe-backend, refusals, merge back to the original bytes, re-shard of an
output, verify --deep. vLLM's own state for these layouts: tests/against_vllm (test_vllm.py's NVFP4 cases)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import SourceError, UnsupportedError
from reshard.format import ITEMSIZE
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART
from reshard.verify import verify
from tests.fixtures.saving import rank_tensors, save
from tests.test_reshard_merge import assert_same, load_dir

MAX = DEFAULT_MAX_PART
E = "model.layers.1.mlp.experts.routed_experts."  # qwen3-moe's experts on vLLM's side
HF_E = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def nv(quantized):
    """nv(arch, scheme) -> a tiny checkpoint as llm-compressor / ModelOpt write(s) `scheme` (conftest.quantized)."""
    return quantized


_rank = rank_tensors


def _shapes(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, tuple[str, list[int]]]:
    return {k[len(prefix) :]: (str(v.dtype), list(v.shape)) for k, v in sd.items() if k.startswith(prefix)}


def test_ct_w4a4_dense_layout_tp2(nv, tmp_path):
    src = nv("llama", "ct-nvfp4")
    cfg = json.loads((src / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"  # accepted, not "damaged"
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    sd, hf = _rank(tmp_path / "o", 1), load_file(str(src / "model.safetensors"))
    a = "model.layers.0.self_attn."
    # q 256 + k 64 + v 64 rows halved; K = 64: 32 bytes of two e2m1 codes, 4 groups of 16
    assert _shapes(sd, a + "qkv_proj.") == {
        "weight_packed": ("torch.uint8", [192, 32]),
        "weight_scale": ("torch.float8_e4m3fn", [192, 4]),
        "weight_global_scale": ("torch.float32", [3]),
        "input_global_scale": ("torch.float32", [3]),
    }
    # row-parallel o_proj: K = 256 split by whole groups; global scales whole
    assert _shapes(sd, a + "o_proj.") == {
        "weight_packed": ("torch.uint8", [64, 64]),
        "weight_scale": ("torch.float8_e4m3fn", [64, 8]),
        "weight_global_scale": ("torch.float32", [1]),
        "input_global_scale": ("torch.float32", [1]),
    }
    # one slot per shard, in q, k, v order (input scales differ per module in the fixture)
    want = torch.cat([hf[f"{a}{p}_proj.input_global_scale"] for p in "qkv"])
    assert torch.equal(sd[a + "qkv_proj.input_global_scale"], want)
    assert len(set(want.tolist())) == 3
    assert torch.equal(sd[a + "o_proj.weight_packed"], hf[a + "o_proj.weight_packed"][:, 64:])
    assert torch.equal(
        sd[a + "o_proj.weight_scale"].view(torch.uint8), hf[a + "o_proj.weight_scale"][:, 8:].view(torch.uint8)
    )
    # k rows of rank 1: its KV head (32 rows), after q's 128
    assert torch.equal(sd[a + "qkv_proj.weight_packed"][128:160], hf[a + "k_proj.weight_packed"][32:64])
    summary = res.plan.summary()
    for r in (0, 1):
        held = _rank(tmp_path / "o", r)
        assert summary["ranks"][r]["bytes"] == sum(t.numel() * t.element_size() for t in held.values())
        assert summary["ranks"][r]["keys"] == len(held)


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "ct-nvfp4a16"])
def test_ct_moe_layout_tp2_and_ep(nv, tmp_path, scheme):
    src = nv("qwen3-moe", scheme)
    save(str(src), tmp_path / "tp", tp=2, max_part_size=MAX)
    save(str(src), tmp_path / "ep", tp=2, ep=True, max_part_size=MAX)
    tp, ep = _rank(tmp_path / "tp", 1), _rank(tmp_path / "ep", 1)
    assert _shapes(tp, E) == {
        "w13_weight_packed": ("torch.uint8", [8, 32, 32]),  # [E, 2 I_p, H / 2], I_p = 16
        "w2_weight_packed": ("torch.uint8", [8, 64, 8]),  # [E, H, I_p / 2]
        "w13_weight_scale": ("torch.float8_e4m3fn", [8, 32, 4]),
        "w2_weight_scale": ("torch.float8_e4m3fn", [8, 64, 1]),
        "w13_weight_global_scale": ("torch.float32", [8, 2]),
        "w2_weight_global_scale": ("torch.float32", [8]),
        "w13_input_global_scale": ("torch.float32", [8, 2]),
        "w2_input_global_scale": ("torch.float32", [8]),
    }
    assert _shapes(ep, E)["w13_weight_packed"] == ("torch.uint8", [4, 64, 32])  # experts 4..7 whole
    assert _shapes(ep, E)["w13_input_global_scale"] == ("torch.float32", [4, 2])  # the rank's own experts
    hf = load_file(str(src / "model.safetensors"))
    assert torch.equal(tp[E + "w2_weight_packed"][3], hf[HF_E + "3.down_proj.weight_packed"][:, 8:])
    assert torch.equal(ep[E + "w2_weight_packed"][0], hf[HF_E + "4.down_proj.weight_packed"])
    g = ep[E + "w13_weight_global_scale"][1]
    assert g.tolist() == [
        hf[HF_E + "5.gate_proj.weight_global_scale"].item(),
        hf[HF_E + "5.up_proj.weight_global_scale"].item(),
    ]
    if scheme.endswith("a16"):  # registered by vLLM, never loaded: the folder holds 1.0
        assert torch.equal(ep[E + "w13_input_global_scale"], torch.ones(4, 2))
        assert torch.equal(ep[E + "w2_input_global_scale"], torch.ones(4))
    else:
        assert ep[E + "w2_input_global_scale"][2].item() == hf[HF_E + "6.down_proj.input_global_scale"].item()


def test_modelopt_dense_layout(nv, tmp_path):
    save(str(nv("llama", "mo-nvfp4")), tmp_path / "w4a4", tp=2, max_part_size=MAX)
    save(str(nv("llama", "mo-nvfp4a16")), tmp_path / "a16", tp=2, max_part_size=MAX)
    a = "model.layers.2.mlp.gate_up_proj."
    w4a4, a16 = _rank(tmp_path / "w4a4", 0), _rank(tmp_path / "a16", 0)
    assert _shapes(w4a4, a) == {
        "weight": ("torch.uint8", [128, 32]),
        "weight_scale": ("torch.float8_e4m3fn", [128, 4]),
        "weight_scale_2": ("torch.float32", [2]),
        "input_scale": ("torch.float32", [2]),
    }
    hf = load_file(str(nv("llama", "mo-nvfp4") / "model.safetensors"))
    want = torch.stack([hf["model.layers.2.mlp.gate_proj.input_scale"], hf["model.layers.2.mlp.up_proj.input_scale"]])
    assert torch.equal(w4a4[a + "input_scale"], want)
    # W4A16_NVFP4: input_scale registered as NaN per slot (vLLM's _DropInputScale), nothing loaded into it
    assert _shapes(a16, a)["input_scale"] == ("torch.bfloat16", [2])  # torch.full's default dtype: the model's
    assert a16[a + "input_scale"].isnan().all()


def test_modelopt_hf_quant_config_json_is_read_as_vllm_does(nv, tmp_path):
    """ModelOpt <= 0.29 (nvidia/DeepSeek-R1-FP4): the config only in hf_quant_config.json."""
    assert "quantization_config" not in json.loads((nv("llama", "mo-nvfp4-hfq") / "config.json").read_text())
    save(str(nv("llama", "mo-nvfp4-hfq")), tmp_path / "old", tp=2, max_part_size=MAX)
    save(str(nv("llama", "mo-nvfp4")), tmp_path / "new", tp=2, max_part_size=MAX)
    assert_same(load_dir(tmp_path / "old", "model-*.safetensors"), load_dir(tmp_path / "new", "model-*.safetensors"))
    assert (tmp_path / "old" / "hf_quant_config.json").exists()


def _serve_pin(res) -> str | None:
    return res.plan.layout.moe_pin


@pytest.mark.parametrize(
    "backend, experts, pinned",
    [
        ("auto", 8, "flashinfer_trtllm"),  # every expert's input scales, pinned
        ("flashinfer_trtllm", 8, "flashinfer_trtllm"),
        ("flashinfer_cutlass", 8, "flashinfer_cutlass"),
        ("marlin", 4, "marlin"),  # the rank's own
        ("cutlass", 4, "cutlass"),
    ],
)
def test_modelopt_ep_input_scales_follow_the_backend(nv, tmp_path, backend, experts, pinned):
    src = nv("qwen3-moe", "mo-nvfp4")
    res = save(str(src), tmp_path / "o", tp=2, ep=True, moe_backend=backend, max_part_size=MAX)
    sd, hf = _rank(tmp_path / "o", 1), load_file(str(src / "model.safetensors"))
    assert _shapes(sd, E)["w13_weight"] == ("torch.uint8", [4, 64, 32])
    assert _shapes(sd, E)["w13_weight_scale_2"] == ("torch.float32", [4, 2])
    assert _shapes(sd, E)["w13_input_scale"] == ("torch.float32", [experts, 2])
    assert _shapes(sd, E)["w2_input_scale"] == ("torch.float32", [experts])
    first = 0 if experts == 8 else 4
    assert sd[E + "w2_input_scale"][0].item() == hf[f"{HF_E}{first}.down_proj.input_scale"].item()
    assert sd[E + "w13_input_scale"][0].tolist() == [
        hf[f"{HF_E}{first}.gate_proj.input_scale"].item(),
        hf[f"{HF_E}{first}.up_proj.input_scale"].item(),
    ]
    assert _serve_pin(res) == pinned


def test_modelopt_ep_auto_writes_flashinfer_trtllms_bytes(nv, tmp_path):
    src = nv("qwen3-moe", "mo-nvfp4")
    save(str(src), tmp_path / "auto", tp=2, ep=True, max_part_size=MAX)
    save(str(src), tmp_path / "trtllm", tp=2, ep=True, moe_backend="flashinfer_trtllm", max_part_size=MAX)
    assert_same(
        load_dir(tmp_path / "auto", "model-*.safetensors"), load_dir(tmp_path / "trtllm", "model-*.safetensors")
    )


def test_modelopt_without_ep_needs_no_pin(nv, tmp_path):
    res = save(str(nv("qwen3-moe", "mo-nvfp4")), tmp_path / "o", tp=2, max_part_size=MAX)
    assert _serve_pin(res) is None
    assert _shapes(_rank(tmp_path / "o", 0), E)["w13_input_scale"] == ("torch.float32", [8, 2])


def test_modelopt_a16_experts(nv, tmp_path):
    """W4A16: no FlashInfer kernel takes it, so every backend vLLM may pick holds the rank's own experts."""
    res = save(str(nv("qwen3-moe", "mo-nvfp4a16")), tmp_path / "o", tp=2, ep=True, max_part_size=MAX)
    sd = _rank(tmp_path / "o", 0)
    assert torch.equal(sd[E + "w13_input_scale"], torch.ones(4, 2))  # registered, never loaded: 1.0
    assert torch.equal(sd[E + "w2_input_scale"], torch.ones(4))
    assert _serve_pin(res) is None


def _edit(src: Path, tmp: Path, edit) -> Path:
    out = tmp / "src"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    for name in ("config.json", "hf_quant_config.json"):
        if (src / name).exists():
            (out / name).unlink()
            data = json.loads((src / name).read_text())
            edit(name, data)
            (out / name).write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    "arch, scheme, layout, message",
    [
        ("qwen3-moe", "ct-nvfp4", dict(tp=4), "per-rank intermediate size 8 is not a multiple of the NVFP4 group 16"),
        ("qwen3-moe", "mo-nvfp4", dict(tp=4), "per-rank intermediate size 8 is not a multiple of the NVFP4 group 16"),
        ("qwen3-moe", "mo-nvfp4", dict(tp=2, ep=True, moe_backend="triton"), "does not run NVFP4 experts"),
        ("qwen3-moe", "ct-nvfp4", dict(tp=2, moe_backend="deep_gemm"), "does not run NVFP4 experts"),
        ("qwen3-moe", "mo-nvfp4a16", dict(tp=2, moe_backend="flashinfer_trtllm"), "take NVFP4 activations only"),
    ],
)
def test_refusals(nv, tmp_path, arch, scheme, layout, message):
    with pytest.raises(UnsupportedError, match=message) as e:
        save(str(nv(arch, scheme)), tmp_path / "o", max_part_size=MAX, **layout)
    assert e.value.exit_code == 3


def _ct_weights(**kw):
    def edit(name, data):
        if name == "config.json":
            data["quantization_config"]["config_groups"]["group_0"]["weights"].update(kw)

    return edit


def _mo_exclude(name, data):
    if name == "hf_quant_config.json":
        data["quantization"]["exclude_modules"] = "lm_head"


def _mo_group(name, data):
    if name == "hf_quant_config.json":
        data["quantization"]["group_size"] = 32


@pytest.mark.parametrize(
    "scheme, edit, error, message",
    [
        ("ct-nvfp4", _ct_weights(group_size=32, strategy="group"), UnsupportedError, "vLLM reads NVFP4 only"),
        ("ct-nvfp4", _ct_weights(dynamic="sometimes"), SourceError, 'must be true, false or "local"'),
        ("mo-nvfp4-hfq", _mo_group, UnsupportedError, "group_size 32"),
        ("mo-nvfp4-hfq", _mo_exclude, SourceError, "excluded modules must be a list of names"),
    ],
)
def test_config_refusals(nv, tmp_path, scheme, edit, error, message):
    src = _edit(nv("llama", scheme), tmp_path, edit)
    with pytest.raises(error, match=message):
        save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)


@pytest.mark.parametrize(
    "arch, scheme, layout",
    [
        ("llama", "ct-nvfp4", dict(tp=2)),
        ("llama", "ct-nvfp4a16", dict(tp=4)),
        ("qwen3-moe", "ct-nvfp4", dict(tp=2)),
        ("qwen3-moe", "ct-nvfp4a16", dict(tp=2, ep=True)),
        ("llama", "mo-nvfp4", dict(tp=2, pp=2)),
        ("llama", "mo-nvfp4a16", dict(tp=2)),
        ("qwen3-moe", "mo-nvfp4", dict(tp=2, ep=True)),
        ("qwen3-moe", "mo-nvfp4", dict(tp=2, ep=True, moe_backend="marlin")),
        ("qwen3-moe", "mo-nvfp4a16", dict(tp=2)),
    ],
)
def test_merge_round_trips_byte_identical(nv, tmp_path, arch, scheme, layout):
    src = nv(arch, scheme)
    save(str(src), tmp_path / "out", max_part_size=MAX, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf")
    assert result["not_in_output"] == []
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))
    report = verify(tmp_path / "out", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["compared_bytes"] > 0


@pytest.mark.parametrize(
    "arch, scheme, first, second",
    [
        ("llama", "ct-nvfp4", dict(tp=4), dict(tp=2, pp=2)),
        ("qwen3-moe", "ct-nvfp4", dict(tp=2), dict(tp=2, ep=True)),
        ("qwen3-moe", "mo-nvfp4", dict(tp=2, ep=True), dict(tp=2, ep=True, moe_backend="marlin")),
        ("qwen3-moe", "mo-nvfp4a16", dict(tp=2, ep=True, moe_backend="marlin"), dict(tp=2)),
    ],
)
def test_reshard_an_output_equals_resharding_the_original(nv, tmp_path, arch, scheme, first, second):
    src = nv(arch, scheme)
    save(str(src), tmp_path / "first", max_part_size=MAX, **first)
    save(str(tmp_path / "first"), tmp_path / "via", max_part_size=MAX, **second)
    save(str(src), tmp_path / "direct", max_part_size=MAX, **second)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))


@pytest.mark.parametrize("scheme", ["ct-nvfp4", "mo-nvfp4"])
def test_packed_bytes_per_rank_add_up(nv, tmp_path, scheme):
    """Every packed expert byte and FP8 group scale of the checkpoint lands on one rank under EP."""
    src = nv("qwen3-moe", scheme)
    res = save(str(src), tmp_path / "o", tp=2, ep=True, max_part_size=MAX)
    hf = load_file(str(src / "model.safetensors"))
    ranks = [_rank(tmp_path / "o", r) for r in (0, 1)]
    for suffix, dtype in (
        ("weight_scale", "F8_E4M3"),
        ("weight_packed" if scheme.startswith("ct") else "weight", "U8"),
    ):
        packed = sum(t.numel() for n, t in hf.items() if ".experts." in n and n.endswith("." + suffix))
        held = sum(
            math.prod(t.shape) * ITEMSIZE[dtype]
            for sd in ranks
            for n, t in sd.items()
            if n.endswith(("w13_" + suffix, "w2_" + suffix))
        )
        assert held == packed
    assert res.plan.total_bytes == sum(t.numel() * t.element_size() for sd in ranks for t in sd.values())
