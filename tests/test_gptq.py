"""GPTQ and AWQ (K-first int32-packed weights): per-rank layout against a torch re-statement of vLLM
0.32's loaders, refusals, merge back to the original bytes (g_idx rebuilt), re-shard of an output,
verify --deep. vLLM's own state for these layouts: tests/against_vllm (test_vllm.py's GPTQ / AWQ cases)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.errors import UnsupportedError
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART
from reshard.verify import verify
from tests.fixtures.saving import rank_tensors, save
from tests.test_reshard_merge import assert_same, load_dir

MAX = DEFAULT_MAX_PART


@pytest.fixture(scope="module")
def gq(quantized):
    """gq(arch, scheme) -> a tiny checkpoint as AutoGPTQ / AutoAWQ write(s) `scheme` (conftest.quantized)."""
    return quantized


_rank = rank_tensors


def _copy(src: Path, dst: Path, **qc) -> Path:
    """`src` with its quantization_config changed (tensors linked)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _cols(hf: dict, names: list[str], tp: int, r: int, div: int = 1) -> torch.Tensor:
    """vLLM's column-parallel load of K-first tensors: each slot's rank-r share of its columns, side by side
    (`div`: columns per stored element)."""
    parts = []
    for n in names:
        t = hf[n]
        w = t.shape[1] // tp
        parts.append(t[:, r * w : (r + 1) * w])
    assert all(p.shape[1] * div % 1 == 0 for p in parts)
    return torch.cat(parts, dim=1)


def _rows(t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    h = t.shape[0] // tp
    return t[r * h : (r + 1) * h]


@pytest.mark.parametrize("scheme", ["gptq", "awq", "gptq-b8"])
def test_dense_layout_tp2(gq, tmp_path, scheme):
    src = gq("llama", scheme)
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    hf = load_file(str(src / "model.safetensors"))
    a = "model.layers.1.self_attn."
    m = "model.layers.1.mlp."
    for r in (0, 1):
        sd = _rank(tmp_path / "o", r)
        assert not [k for k in sd if k.endswith("g_idx")]
        for p in ("qweight", "scales", "qzeros"):
            # q / k / v: 8 / 2 / 2 heads over 2 ranks, each slot's columns side by side
            qkv = _cols(hf, [f"{a}{s}_proj.{p}" for s in "qkv"], 2, r)
            assert torch.equal(sd[f"{a}qkv_proj.{p}"], qkv), p
            gu = _cols(hf, [f"{m}gate_proj.{p}", f"{m}up_proj.{p}"], 2, r)
            assert torch.equal(sd[f"{m}gate_up_proj.{p}"], gu), p
            # row-parallel: the rank's input rows (packed along K for GPTQ's qweight, groups for the rest)
            assert torch.equal(sd[f"{a}o_proj.{p}"], _rows(hf[f"{a}o_proj.{p}"], 2, r)), p
            assert torch.equal(sd[f"{m}down_proj.{p}"], _rows(hf[f"{m}down_proj.{p}"], 2, r)), p
        assert sd[f"{a}qkv_proj.qweight"].dtype == torch.int32
        assert sd[f"{a}qkv_proj.scales"].dtype == torch.float16
    pk = 4 if scheme == "gptq-b8" else 8
    sd = _rank(tmp_path / "o", 0)
    if scheme.startswith("gptq"):  # [K / pk, N]: K = 64, q 128 + k 32 + v 32 columns per rank
        assert list(sd[f"{a}qkv_proj.qweight"].shape) == [64 // pk, 192]
        assert list(sd[f"{a}qkv_proj.qzeros"].shape) == [2, 192 // pk]
    else:  # AWQ [K, N / 8]
        assert list(sd[f"{a}qkv_proj.qweight"].shape) == [64, 24]
    summary = res.plan.summary()
    for r in (0, 1):
        held = _rank(tmp_path / "o", r)
        assert summary["ranks"][r]["bytes"] == sum(t.numel() * t.element_size() for t in held.values())
        assert summary["ranks"][r]["keys"] == len(held)
        shapes = {t["name"]: t["shape"] for t in summary["ranks"][r]["tensors"]}
        assert shapes == {k: list(v.shape) for k, v in held.items()}


def test_gptq_channelwise_row_parallel_scales_are_whole(gq, tmp_path):
    src = gq("llama", "gptq-channel")
    save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    hf = load_file(str(src / "model.safetensors"))
    a = "model.layers.0.self_attn."
    for r in (0, 1):
        sd = _rank(tmp_path / "o", r)
        assert torch.equal(sd[a + "o_proj.scales"], hf[a + "o_proj.scales"])  # [1, N] on every rank
        assert torch.equal(sd[a + "o_proj.qzeros"], hf[a + "o_proj.qzeros"])
        assert torch.equal(sd[a + "qkv_proj.scales"], _cols(hf, [f"{a}{s}_proj.scales" for s in "qkv"], 2, r))


@pytest.mark.parametrize("scheme", ["gptq", "awq"])
@pytest.mark.parametrize("ep", [False, True])
def test_moe_marlin_layout(gq, tmp_path, ep, scheme):
    src = gq("qwen3-moe-wide", scheme)
    res = save(str(src), tmp_path / "o", tp=2, ep=ep, max_part_size=MAX)
    assert any("Marlin layout" in n for n in res.plan.notes)
    hf = load_file(str(src / "model.safetensors"))
    t = "model.layers.1.mlp.experts.routed_experts."
    h = "model.layers.1.mlp.experts."
    for r in (0, 1):
        sd = _rank(tmp_path / "o", r)
        experts = range(4 * r, 4 * r + 4) if ep else range(8)
        tp, sr = (1, 0) if ep else (2, r)
        for p in ("qweight", "scales", "qzeros"):
            w13 = torch.stack([_cols(hf, [f"{h}{e}.gate_proj.{p}", f"{h}{e}.up_proj.{p}"], tp, sr) for e in experts])
            assert torch.equal(sd[f"{t}w13_{p}"], w13), p
            w2 = torch.stack([_rows(hf[f"{h}{e}.down_proj.{p}"], tp, sr) for e in experts])
            assert torch.equal(sd[f"{t}w2_{p}"], w2), p
        n, ip = len(experts), 64 // tp
        if scheme == "awq":  # [E, H, 2 I_p / 8], [E, I_p, H / 8]; no biases
            assert list(sd[t + "w13_qweight"].shape) == [n, 128, 2 * ip // 8]
            assert list(sd[t + "w2_qweight"].shape) == [n, ip, 128 // 8]
            assert not [k for k in sd if k.endswith("_bias")]
            continue
        assert list(sd[t + "w13_qweight"].shape) == [n, 128 // 8, 2 * ip]
        assert list(sd[t + "w2_qweight"].shape) == [n, ip // 8, 128]
        # zero biases vLLM registers and no checkpoint tensor fills
        assert torch.equal(sd[t + "w13_bias"], torch.zeros(n, 2 * ip, dtype=torch.float16))
        assert torch.equal(sd[t + "w2_bias"], torch.zeros(n, 128, dtype=torch.float16))
        assert "model.layers.1.mlp.experts.gate.weight" in sd  # the router: no qweight, not quantized


@pytest.mark.parametrize("ep", [False, True])
def test_gptq_moe_wna16_layout(gq, tmp_path, ep):
    """Group 64 with 32 intermediate rows per rank: vLLM's MoeWNA16Method, uint8 N-first (int32 qweight
    transposed, viewed as bytes), scales transposed and repeated to group 32; with EP (64 rows) Marlin's."""
    src = gq("qwen3-moe-wide", "gptq-g64")
    res = save(str(src), tmp_path / "o", tp=2, ep=ep, max_part_size=MAX)
    assert any("so vLLM builds MoeWNA16Method" in n for n in res.plan.notes) != ep
    hf = load_file(str(src / "model.safetensors"))
    t = "model.layers.1.mlp.experts.routed_experts."
    h = "model.layers.1.mlp.experts."
    if ep:
        assert _rank(tmp_path / "o", 0)[t + "w13_qweight"].dtype == torch.int32
        return
    for r in (0, 1):
        sd = _rank(tmp_path / "o", r)
        s0, ip = 32 * r, 32

        def nfirst(name: str) -> torch.Tensor:  # vLLM's loaded_weight.T.contiguous().view(torch.uint8)
            return hf[name].T.contiguous().view(torch.uint8)

        def scales(name: str) -> torch.Tensor:  # .T, repeat_interleave(64 / 32, 1)
            return hf[name].T.repeat_interleave(2, 1)

        w13 = torch.stack(
            [torch.cat([nfirst(f"{h}{e}.{p}_proj.qweight")[s0 : s0 + ip] for p in ("gate", "up")]) for e in range(8)]
        )
        assert torch.equal(sd[t + "w13_qweight"], w13)
        w2 = torch.stack([nfirst(f"{h}{e}.down_proj.qweight")[:, s0 // 2 : (s0 + ip) // 2] for e in range(8)])
        assert torch.equal(sd[t + "w2_qweight"], w2)
        s13 = torch.stack(
            [torch.cat([scales(f"{h}{e}.{p}_proj.scales")[s0 : s0 + ip] for p in ("gate", "up")]) for e in range(8)]
        )
        assert torch.equal(sd[t + "w13_scales"], s13)
        s2 = torch.stack([scales(f"{h}{e}.down_proj.scales")[:, s0 // 32 : (s0 + ip) // 32] for e in range(8)])
        assert torch.equal(sd[t + "w2_scales"], s2)
        assert not [k for k in sd if k.startswith(t) and ("qzeros" in k or "bias" in k)]
    report = verify(tmp_path / "o", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    with pytest.raises(UnsupportedError, match="transposed"):  # not read back
        merge(tmp_path / "o", tmp_path / "hf")


@pytest.mark.parametrize(
    "qc, message",
    [
        (dict(sym=False), "asymmetric GPTQ"),
        (dict(desc_act=True), "act-order"),
        (dict(bits=3), "3-bit weights"),
        (dict(checkpoint_format="gptq_v2"), "checkpoint_format 'gptq_v2'"),
        (dict(dynamic={r"+:.*\.1\..*": {"bits": 8}}), "dynamic rule"),
        # a quantized lm_head over a vocabulary vLLM pads (1000 -> 1024): vLLM fails to load it
        (dict(lm_head=True), "quantized lm_head .lm_head: true. over vocab_size 1000"),
    ],
)
def test_gptq_config_refusals(gq, tmp_path, qc, message):
    src = _copy(gq("llama", "gptq"), tmp_path / "src", **qc)
    with pytest.raises(UnsupportedError, match=message) as e:
        save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    assert e.value.exit_code == 3


def test_gptq_channelwise_act_order_is_allowed(gq, tmp_path):
    """desc_act with one group per channel is a no-op to vLLM (normalize_and_validate_gptq_desc_act)."""
    src = _copy(gq("llama", "gptq-channel"), tmp_path / "src", desc_act=True)
    save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)


@pytest.mark.parametrize(
    "arch, scheme, layout, message",
    [
        ("llama", "gptq", dict(tp=8), "per-rank input size 16 is not a multiple of the quantization group 32"),
        ("llama", "awq", dict(tp=8), "per-rank input size 16 is not a multiple of the quantization group 32"),
        # its dense layer 0 (mlp_only_layers): a fresh vLLM process builds gate_up_proj unquantized, its name
        # matching none of the checkpoint's quantized modules (gate_proj, up_proj): tests/test_quant_fused_late.py
        ("qwen3-moe", "gptq", dict(tp=2), "by its fused name .* builds it unquantized, while the checkpoint stores"),
        # vLLM's fallback (MoeWNA16Method) asserts a group of at least 32 dividing I_p
        ("qwen3-moe-wide", "gptq", dict(tp=4), "no group of at least 32 divides the per-rank intermediate size 16"),
        ("qwen3-moe-wide", "awq-g64", dict(tp=2), "32 is not a multiple of the group 64.*MoeWNA16Method"),
    ],
)
def test_refusals(gq, tmp_path, arch, scheme, layout, message):
    with pytest.raises(UnsupportedError, match=message) as e:
        save(str(gq(arch, scheme)), tmp_path / "o", max_part_size=MAX, **layout)
    assert e.value.exit_code == 3


@pytest.mark.parametrize("qc, message", [(dict(bits=8), "AWQ with 8-bit weights"), (dict(version="gemv"), "GEMM")])
def test_awq_config_refusals(gq, tmp_path, qc, message):
    src = _copy(gq("llama", "awq"), tmp_path / "src", **qc)
    with pytest.raises(UnsupportedError, match=message):
        save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)


def test_gptq_output_config_lists_the_quantized_linear_modules(gq, tmp_path):
    """vLLM would otherwise take them from the output's files, where q/k/v and gate/up are fused, and
    build those layers unquantized."""
    src = gq("qwen3-moe-wide", "gptq")
    save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    listed = qc["modules_in_block_to_quantize"]
    assert "model.layers.0.self_attn.q_proj" in listed and "model.layers.1.self_attn.o_proj" in listed
    assert not [m for m in listed if ".experts." in m or m.endswith("mlp.gate")]
    original = json.loads((src / "config.json").read_text())["quantization_config"]
    assert original["modules_in_block_to_quantize"] is None
    assert {**qc, "modules_in_block_to_quantize": None} == original  # nothing else changed


def test_gptq_expert_biases_are_refused(gq, tmp_path):
    """vLLM keeps GPTQ expert biases only through its weight loader; sharded_state would drop them."""
    src = gq("qwen3-moe-wide", "gptq")
    dst = tmp_path / "src"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, dst / f.name)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.1.mlp.experts.0.down_proj.bias"] = torch.zeros(128, dtype=torch.float16)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedError, match="expert biases"):
        save(str(dst), tmp_path / "o", tp=2, max_part_size=MAX)


@pytest.mark.parametrize(
    "arch, scheme, layout",
    [
        ("llama", "gptq", dict(tp=2)),
        ("llama", "gptq-channel", dict(tp=4)),
        ("llama", "awq", dict(tp=4)),
        ("qwen3-moe-wide", "gptq", dict(tp=2)),
        ("qwen3-moe-wide", "gptq-b8", dict(tp=2, ep=True)),
        ("qwen3-moe-wide", "awq", dict(tp=2)),
    ],
)
def test_merge_round_trips_byte_identical(gq, tmp_path, arch, scheme, layout):
    src = gq(arch, scheme)
    save(str(src), tmp_path / "out", max_part_size=MAX, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf")
    assert result["not_in_output"] == []  # g_idx rebuilt as arange(K) // group
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))
    report = verify(tmp_path / "out", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["compared_bytes"] > 0


@pytest.mark.parametrize(
    "arch, scheme, first, second",
    [
        ("llama", "gptq", dict(tp=4), dict(tp=2, pp=2)),
        ("llama", "awq", dict(tp=2), dict(tp=4)),
        ("qwen3-moe-wide", "gptq", dict(tp=2), dict(tp=2, ep=True)),
        ("qwen3-moe-wide", "awq", dict(tp=2, ep=True), dict(tp=2)),
    ],
)
def test_reshard_an_output_equals_resharding_the_original(gq, tmp_path, arch, scheme, first, second):
    src = gq(arch, scheme)
    save(str(src), tmp_path / "first", max_part_size=MAX, **first)
    save(str(tmp_path / "first"), tmp_path / "via", max_part_size=MAX, **second)
    save(str(src), tmp_path / "direct", max_part_size=MAX, **second)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))


def test_verify_deep_names_a_damaged_side_by_side_tensor(gq, tmp_path):
    src = gq("llama", "gptq")
    save(str(src), tmp_path / "out", tp=2, max_part_size=MAX)
    f = tmp_path / "out" / "model-rank-1-part-0.safetensors"
    sd = load_file(str(f))
    name = "model.layers.2.self_attn.qkv_proj.qweight"
    sd[name][3, 150] += 1  # v's columns of one packed row
    save_file(sd, str(f), metadata={"format": "pt"})
    report = verify(tmp_path / "out", against=str(src), deep=True)
    assert report.exit_code != 0
    assert any(name in (x.message or "") for x in report.findings)


def test_gptq_quantized_lm_head_is_split_over_the_vocabulary(gq, tmp_path):
    """`lm_head: true` (GPTQModel): vLLM builds ParallelLMHead with the GPTQ method, its packed [hidden, vocab]
    parameters split over the vocabulary as a column-parallel layer's output (vLLM's own state:
    tests/against_vllm, `llama-v1024+gptq-lmhead`); the copied config lists lm_head among the quantized modules,
    which vLLM reads to build it so from the output. It was exit 4, "checkpoint lacks tensor 'lm_head.weight'"."""
    src = gq("llama-v1024", "gptq-lmhead")
    save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    hf = load_file(str(src / "model.safetensors"))
    for r in range(2):
        sd = _rank(tmp_path / "o", r)
        assert torch.equal(sd["lm_head.qweight"], hf["lm_head.qweight"][:, r * 512 : (r + 1) * 512])
        assert torch.equal(sd["lm_head.scales"], hf["lm_head.scales"][:, r * 512 : (r + 1) * 512])
        assert torch.equal(sd["lm_head.qzeros"], hf["lm_head.qzeros"][:, r * 64 : (r + 1) * 64])
        assert "lm_head.weight" not in sd
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "lm_head" in config["quantization_config"]["modules_in_block_to_quantize"]
    tied = _copy(src, tmp_path / "tied")
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(UnsupportedError, match="tie_word_embeddings") as e:
        save(str(tied), tmp_path / "o2", tp=2, max_part_size=MAX)
    assert e.value.exit_code == 3
