"""FP8 KV-cache scales in every naming vLLM 0.32 loads (reshard.plan.kvscales), planned, re-sharded
and merged. Byte-identity with vLLM itself: tests/against_vllm (the `+...-kv` cases)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import UnsupportedError
from reshard.format import TensorInfo
from reshard.layout import Layout
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART, Slice, build_plan
from reshard.plan.kvscales import vllm_kv_name
from reshard.sources import open_source
from tests.fixtures.quant import convert
from tests.fixtures.saving import save

L = "model.layers.0.self_attn."


@pytest.mark.parametrize(
    "name, fp8, expected",
    [
        ("kv_scale", True, "attn.k_scale"),  # deprecated: k only
        ("k_proj.k_scale", True, "attn.k_scale"),  # ModelOpt
        ("v_proj.v_scale", True, "attn.v_scale"),
        ("k_proj.v_scale", True, "attn.v_scale"),  # ModelOpt's regex takes either proj
        ("qkv_proj.k_scale", True, "attn.k_scale"),
        ("qkv_proj.v_scale", True, "attn.v_scale"),
        ("q_scale", False, "attn.q_scale"),  # the default
        ("k_scale", False, "attn.k_scale"),
        ("attn.v_scale", False, "attn.v_scale"),  # already vLLM's own name
        ("k_zero_point", False, "attn.k_zero_point"),
        ("k_proj.output_scale", True, "attn.k_scale"),  # Fp8Config only
        ("q_proj.output_scale", True, "attn.q_scale"),
        ("prob_output_scale", True, "attn.prob_scale"),
        ("k_proj.output_scale", False, None),
        ("q_proj.weight_scale", True, None),
        ("q_proj.input_scale", True, None),
    ],
)
def test_vllm_kv_name_follows_vllms_cache_scale_mapper(name, fp8, expected):
    assert vllm_kv_name(L + name, fp8_config=fp8) == (L + expected if expected else None)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """quantized(arch, scheme) -> a tiny checkpoint converted by tests/fixtures/quant.py."""
    from tests.fixtures.tiny import make_tiny

    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, scheme: str) -> Path:
        if (arch, scheme) not in cache:
            root = tmp_path_factory.mktemp(f"{arch}-{scheme}")
            cache[(arch, scheme)] = convert(make_tiny(arch, root / "bf16"), root / "q", scheme)
        return cache[(arch, scheme)]

    return get


def attn(plan, layer: int, rank: int = 0) -> dict:
    prefix = f"model.layers.{layer}.self_attn.attn."
    f = [f for f in plan.files if f.tp_rank == rank]
    return {t.name[len(prefix) :]: t for file in f for t in file.tensors if t.name.startswith(prefix)}


def source_of(t) -> str | float:
    (p,) = t.pieces
    return p.source if isinstance(p, Slice) else p.value


def test_fp8_dense_namings_fill_k_v_q_prob(quantized):
    plan = build_plan(open_source(str(quantized("llama", "fp8-tensor-kv"))).checkpoint, Layout(tp=2))
    p = "model.layers.{}.self_attn."
    expect = {
        0: {"k_scale": "k_scale", "v_scale": "v_scale", "q_scale": "q_scale", "prob_scale": -1.0},
        1: {"k_scale": "k_proj.k_scale", "v_scale": "v_proj.v_scale", "q_scale": "attn.q_scale", "prob_scale": -1.0},
        2: {"k_scale": "qkv_proj.k_scale", "v_scale": "qkv_proj.v_scale", "q_scale": -1.0, "prob_scale": -1.0},
        3: {
            "k_scale": "k_proj.output_scale",
            "v_scale": "v_proj.output_scale",
            "q_scale": "q_proj.output_scale",
            "prob_scale": "prob_output_scale",
        },
    }
    for layer, params in expect.items():
        for rank in (0, 1):
            got = attn(plan, layer, rank)
            for param, src in params.items():
                t = got[param]
                assert (t.dtype, t.shape) == ("BF16", ()), (layer, param)  # KVCacheScaleParameter: model dtype
                assert source_of(t) == (p.format(layer) + src if isinstance(src, str) else src), (layer, param)
            assert {k: source_of(got[k]) for k in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")} == dict.fromkeys(
                ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"), 1.0
            )  # vLLM sets the buffers only after loading


def test_fp8_moe_deprecated_kv_scale_loads_k_only(quantized):
    plan = build_plan(open_source(str(quantized("qwen3-moe", "fp8-tensor-kv-alt"))).checkpoint, Layout(tp=2, ep=True))
    got = attn(plan, 0, 1)
    assert source_of(got["k_scale"]) == "model.layers.0.self_attn.kv_scale"
    assert source_of(got["v_scale"]) == -1.0  # vLLM duplicates k into v only after loading


def test_compressed_tensors_kv_cache_scheme_tensor(quantized):
    plan = build_plan(open_source(str(quantized("llama", "ct-tensor-kv"))).checkpoint, Layout(tp=2))
    got = attn(plan, 0, 1)
    assert plan.layout.quantization["kv_cache_scheme"] == "tensor"
    assert (got["k_scale"].dtype, got["k_scale"].shape) == ("F32", (1,))
    assert source_of(got["q_scale"]) == "model.layers.0.self_attn.q_scale"
    assert source_of(got["k_zero_point"]) == "model.layers.0.self_attn.k_zero_point"
    assert (got["v_zero_point"].dtype, source_of(got["v_zero_point"])) == ("BF16", 0.0)
    assert source_of(attn(plan, 1, 0)["q_scale"]) == 1.0


def test_compressed_tensors_attn_head_scales_follow_kv_heads(quantized):
    ckpt = open_source(str(quantized("llama", "ct-channel-kv-head"))).checkpoint  # 2 KV heads
    for tp, heads in ((1, [(0, 2)]), (2, [(0, 1), (1, 2)]), (4, [(0, 1), (0, 1), (1, 2), (1, 2)])):
        plan = build_plan(ckpt, Layout(tp=tp))
        for r, (a, b) in enumerate(heads):
            k = attn(plan, 2, r)["k_scale"]
            assert k.shape == (b - a,) and k.pieces == (
                Slice("model.layers.2.self_attn.k_scale", (a, 0, 0), (b, 1, 1)),
            ), (tp, r)
            assert source_of(attn(plan, 2, r)["q_scale"]) == 1.0


def _with(ckpt, **extra: tuple[str, tuple[int, ...]]):
    tensors = dict(ckpt.tensors)
    for name, (dtype, shape) in extra.items():
        tensors[name] = TensorInfo(name, dtype, shape, "model.safetensors", 0, 4 * math.prod(shape))
    return dataclasses.replace(ckpt, tensors=tensors)


def test_scales_vllm_drops_are_left_out_as_vllm_leaves_them(quantized):
    """vLLM 0.32 drops these at load; the output matches its state (and says so in a note)."""
    fp8 = open_source(str(quantized("llama", "fp8-tensor-kv"))).checkpoint
    plan = build_plan(_with(fp8, **{L + "k_zero_point": ("F32", ())}), Layout(tp=2))
    assert any("zero point(s) left out" in n for n in plan.notes)
    assert not [t for f in plan.files for t in f.tensors if "zero_point" in t.name]
    mla = open_source(str(quantized("deepseek-v3", "fp8-tensor-kv-mla"))).checkpoint
    plan = build_plan(mla, Layout(tp=2))
    assert any("MLA attention has no FP8 KV-cache scale parameters" in n for n in plan.notes)
    names = {t.name for f in plan.files for t in f.tensors}
    assert not [n for n in names if n.endswith(("k_scale", "v_scale", "q_scale")) and "._" not in n]


def test_namings_vllm_would_not_load_are_refused(quantized, tiny):
    fp8 = open_source(str(quantized("llama", "fp8-tensor-kv"))).checkpoint
    with pytest.raises(
        UnsupportedError, match=re.escape("2 checkpoint tensors are vLLM's model.layers.0.self_attn.attn.k_scale")
    ):
        build_plan(_with(fp8, **{L + "kv_scale": ("F32", ())}), Layout(tp=2))
    with pytest.raises(UnsupportedError, match=re.escape("renames it 'model.layers.0.self_attn.q_proj.attn.q_scale'")):
        build_plan(_with(fp8, **{L + "q_proj.q_scale": ("F32", ())}), Layout(tp=2))
    bf16 = open_source(str(tiny("llama"))).checkpoint
    with pytest.raises(UnsupportedError, match="only for a quantized checkpoint"):
        build_plan(_with(bf16, **{L + "k_scale": ("F32", ())}), Layout(tp=2))
    head = open_source(str(quantized("llama", "ct-channel-kv-head"))).checkpoint
    with pytest.raises(UnsupportedError, match="per-head q scales"):
        build_plan(_with(head, **{L + "q_scale": ("F32", (8, 1, 1))}), Layout(tp=2))


@pytest.mark.parametrize(
    "scheme, problem",
    [
        ({"num_bits": 4, "type": "int", "strategy": "tensor", "symmetric": True}, "only FP8"),
        ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "strategy 'channel'"),
        ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}, "symmetric only"),
    ],
)
def test_kv_cache_schemes_vllm_refuses_are_refused(quantized, scheme, problem):
    ckpt = open_source(str(quantized("llama", "ct-tensor-kv"))).checkpoint
    qc = {**ckpt.config["quantization_config"], "kv_cache_scheme": scheme}
    with pytest.raises(UnsupportedError, match=problem):
        build_plan(dataclasses.replace(ckpt, config={**ckpt.config, "quantization_config": qc}), Layout(tp=2))


@pytest.mark.parametrize(
    "arch, scheme, first, second",
    [
        ("llama", "fp8-tensor-kv", dict(tp=2), dict(tp=4)),
        ("qwen3-moe", "fp8-tensor-kv-alt", dict(tp=4, ep=True), dict(tp=2)),
        ("llama", "ct-tensor-kv", dict(tp=4), dict(tp=1)),
        ("llama", "ct-channel-kv-head", dict(tp=4), dict(tp=2)),
    ],
)
def test_reshard_and_merge_an_output_with_kv_scales(quantized, tmp_path, arch, scheme, first, second):
    src = quantized(arch, scheme)
    save(str(src), tmp_path / "first", max_part_size=DEFAULT_MAX_PART, **first)
    save(str(tmp_path / "first"), tmp_path / "via", max_part_size=DEFAULT_MAX_PART, **second)
    save(str(src), tmp_path / "direct", max_part_size=DEFAULT_MAX_PART, **second)
    for f in sorted((tmp_path / "direct").glob("model-*.safetensors")):
        a, b = load_file(f), load_file(tmp_path / "via" / f.name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a), f.name

    # merge gives back every original name; values the output holds in the model dtype (Fp8Config's
    # k/v/q/prob_scale, compressed-tensors' zero points) come back as vLLM holds them, so lossy
    result = merge(tmp_path / "first", tmp_path / "hf", allow_lossy=True)
    original, merged = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert merged.keys() == original.keys() and result["not_in_output"] == []
    lossy = {e["name"] for e in result["lossy"]}
    for k, t in original.items():
        if k in lossy:
            assert torch.equal(merged[k], t.to(torch.bfloat16).to(t.dtype)), k
        else:
            assert torch.equal(merged[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), k
