"""Qwen3-Next and Qwen3.5-MoE (issue 15): plans from tiny real checkpoints, files against torch slicing,
and the releases planned from headers against the shapes vLLM itself builds.

Byte-for-byte agreement with vLLM is `tests/against_vllm/test_vllm.py` (qwen3-next*, qwen3.5-moe);
the release shapes come from `tests/against_vllm/release_shapes.py` (vLLM's own model
code on 8 CPU ranks), recorded in tests/fixtures/qwen_next_releases/*.json.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from reshard.errors import SourceError, UnsupportedError
from reshard.format import ITEMSIZE
from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.sources import open_source
from tests.fixtures.qwen_next_releases import CUT_LAYERS, HERE, RELEASES, cut, headers
from tests.fixtures.saving import save

# tiny sizes (tests/fixtures/tiny.py _QWEN_NEXT): key_dim 4 x 64, value_dim 8 x 64, conv_dim 512
KEY, VALUE, VHEADS, H = 256, 512, 8, 64


def shapes(plan, tp_rank, pp_rank=0):
    return {
        t.name: (t.dtype, t.shape)
        for f in plan.files
        if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank)
        for t in f.tensors
    }


def tensors(plan, tp_rank, pp_rank=0):
    return {t.name: t for f in plan.files if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank) for t in f.tensors}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_next_tiny_shapes(tiny, tp):
    plan = build_plan(open_source(str(tiny("qwen3-next"))).checkpoint, Layout(tp=tp))
    s = shapes(plan, tp - 1)
    la = "model.layers.0.linear_attn."
    # QwenGatedDeltaNetAttention: in_proj_qkvz one output size (gqa_interleaved_layout) of
    # 2*key_dim + 2*value_dim rows; in_proj_ba 2*num_v_heads; conv1d conv_dim/tp x 1 x kernel
    assert s[la + "in_proj_qkvz.weight"] == ("BF16", ((2 * KEY + 2 * VALUE) // tp, H))
    assert s[la + "in_proj_ba.weight"] == ("BF16", (2 * VHEADS // tp, H))
    assert s[la + "conv1d.weight"] == ("BF16", ((2 * KEY + VALUE) // tp, 1, 4))
    assert s[la + "A_log"] == ("F32", (VHEADS // tp,))  # torch.float32 whatever the model dtype
    assert s[la + "dt_bias"] == ("BF16", (VHEADS // tp,))
    assert s[la + "norm.weight"] == ("BF16", (64,))
    assert s[la + "out_proj.weight"] == ("BF16", (H, VALUE // tp))
    a = "model.layers.3.self_attn."
    kv_rows = 64 * max(1, 2 // tp)  # 2 KV heads of 64, replicated at TP 4
    assert s[a + "qkv_proj.weight"] == ("BF16", (2 * 4 * 64 // tp + 2 * kv_rows, H))  # gated q: 2 x heads
    assert s[a + "o_proj.weight"] == ("BF16", (H, 4 * 64 // tp))
    assert not any(".layers.3.linear_attn" in k or ".layers.0.self_attn" in k for k in s)
    m = "model.layers.0.mlp.experts."
    assert s[m + "gate.weight"] == ("BF16", (8, H))
    assert s[m + "routed_experts.w13_weight"] == ("BF16", (8, 2 * 32 // tp, H))
    assert s[m + "_shared_experts._layer.gate_up_proj.weight"] == ("BF16", (2 * 64 // tp, H))
    assert s[m + "_shared_experts._layer.expert_gate.weight"] == ("BF16", (1, H))
    assert s["model.layers.1.mlp.gate_up_proj.weight"] == ("BF16", (2 * 128 // tp, H))  # mlp_only_layers
    assert not any(k.startswith("mtp.") for k in s)
    assert "lm_head.weight" in s and "model.embed_tokens.weight" in s


def test_conv1d_split_per_piece_not_whole(tiny):
    """mamba_v2_sharded_weight_loader: rank r holds the r-th slice of q, of k and of v."""
    plan = build_plan(open_source(str(tiny("qwen3-next"))).checkpoint, Layout(tp=2))
    (conv,) = [t for n, t in tensors(plan, 1).items() if n == "model.layers.0.linear_attn.conv1d.weight"]
    assert [(p.start[0], p.stop[0]) for p in conv.pieces] == [(128, 256), (384, 512), (768, 1024)]
    assert all(p.stop[1:] == (1, 4) for p in conv.pieces)
    (a_log,) = [t for n, t in tensors(plan, 1).items() if n == "model.layers.0.linear_attn.A_log"]
    assert [(p.start, p.stop) for p in a_log.pieces] == [((4,), (8,))]


def test_qwen35_in_proj_pieces(tiny):
    """Qwen3.5: in_proj_qkv is vLLM's shards (0, 1, 2) of in_proj_qkvz, in_proj_z shard 3."""
    plan = build_plan(open_source(str(tiny("qwen3.5-moe"))).checkpoint, Layout(tp=2))
    t = tensors(plan, 1)
    la = "language_model.model.layers.0.linear_attn."
    src = "model.language_model.layers.0.linear_attn."
    qkvz = t[la + "in_proj_qkvz.weight"]
    assert qkvz.shape == ((2 * KEY + 2 * VALUE) // 2, H)
    assert [(p.source, p.start[0], p.stop[0]) for p in qkvz.pieces] == [
        (src + "in_proj_qkv.weight", 128, 256),
        (src + "in_proj_qkv.weight", 384, 512),
        (src + "in_proj_qkv.weight", 768, 1024),
        (src + "in_proj_z.weight", 256, 512),
    ]
    ba = t[la + "in_proj_ba.weight"]
    assert [(p.source, p.start[0], p.stop[0]) for p in ba.pieces] == [
        (src + "in_proj_b.weight", 4, 8),
        (src + "in_proj_a.weight", 4, 8),
    ]
    assert t["language_model.lm_head.weight"].pieces[0].source == "lm_head.weight"
    assert not any(n.startswith(("visual", "model.")) for n in t)
    assert plan.serve_command("OUT").endswith("--language-model-only")


@pytest.mark.parametrize("arch", ["qwen3-next", "qwen3.5-moe"])
def test_files_equal_torch_slicing(tiny, tmp_path, arch):
    src = tiny(arch)
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    sd = load_file(str(src / "model.safetensors"))
    lm = "language_model.model." if arch == "qwen3.5-moe" else "model."
    hf = "model.language_model." if arch == "qwen3.5-moe" else "model."
    for r in range(2):
        with safe_open(str(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors"), "pt") as fh:
            got = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        p = f"{hf}layers.2.linear_attn."
        conv = sd[p + "conv1d.weight"]
        parts = torch.split(conv, [KEY, KEY, VALUE])
        want = torch.cat([x.chunk(2)[r] for x in parts])
        assert torch.equal(got[f"{lm}layers.2.linear_attn.conv1d.weight"], want)
        assert torch.equal(got[f"{lm}layers.2.linear_attn.A_log"], sd[p + "A_log"].float().chunk(2)[r])
        if arch == "qwen3.5-moe":
            q, k, v = torch.split(sd[p + "in_proj_qkv.weight"], [KEY, KEY, VALUE])
            want = torch.cat([x.chunk(2)[r] for x in (q, k, v, sd[p + "in_proj_z.weight"])])
        else:
            want = sd[p + "in_proj_qkvz.weight"].chunk(2)[r]
        assert torch.equal(got[f"{lm}layers.2.linear_attn.in_proj_qkvz.weight"], want)


def test_mtp_and_vision_skipped_but_strays_refused(tiny):
    ckpt = open_source(str(tiny("qwen3.5-moe"))).checkpoint
    assert any(n.startswith("mtp.") for n in ckpt.tensors) and any(n.startswith("model.visual.") for n in ckpt.tensors)
    plan = build_plan(ckpt, Layout(tp=2))
    assert any("under model.visual. left out" in n for n in plan.notes)
    stray = dict(ckpt.tensors)
    stray["model.language_model.layers.0.linear_attn.extra.weight"] = ckpt.tensors["mtp.fc.weight"]
    ckpt.tensors = stray
    with pytest.raises(SourceError, match="match no rule"):
        build_plan(ckpt, Layout(tp=2))


def test_pp_top_modules_as_vllm_builds_them(tiny):
    """Qwen3-Next builds embed_tokens and lm_head on every stage (unconditionally), the norm on the
    last; Qwen3.5 embed_tokens on every stage, norm and lm_head (PPMissingLayer) on the last."""
    nxt = build_plan(open_source(str(tiny("qwen3-next"))).checkpoint, Layout(tp=1, pp=2))
    first, last = shapes(nxt, 0, 0), shapes(nxt, 0, 1)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(first) & set(last)
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    q35 = build_plan(open_source(str(tiny("qwen3.5-moe"))).checkpoint, Layout(tp=1, pp=2))
    first, last = shapes(q35, 0, 0), shapes(q35, 0, 1)
    assert "language_model.model.embed_tokens.weight" in first and "language_model.model.embed_tokens.weight" in last
    assert "language_model.lm_head.weight" in last and "language_model.lm_head.weight" not in first


def test_wrong_piece_sizes_refused(tiny):
    ckpt = open_source(str(tiny("qwen3-next"))).checkpoint
    ckpt.config = {**ckpt.config, "linear_num_value_heads": 4}  # the tensors hold 8
    with pytest.raises(SourceError, match=r"conv1d\.weight has shape"):
        build_plan(ckpt, Layout(tp=2))


def test_fp8_tiny_block_scales(tiny):
    plan = build_plan(open_source(str(tiny("qwen3-next-fp8"))).checkpoint, Layout(tp=2))
    s = shapes(plan, 1)
    la = "model.layers.0.linear_attn."
    # 2*512 + 2*1024 rows / 2 = 1536 = 12 blocks; in_proj_ba kept bf16 (modules_to_not_convert)
    assert s[la + "in_proj_qkvz.weight"] == ("F8_E4M3", (1536, 256))
    assert s[la + "in_proj_qkvz.weight_scale_inv"] == ("F32", (12, 2))
    assert s[la + "in_proj_ba.weight"] == ("BF16", (8, 256))
    assert s[la + "conv1d.weight"] == ("BF16", (1024, 1, 4))
    assert s["model.layers.1.self_attn.attn.k_scale"] == ("BF16", ())  # Fp8Config's KV-cache method
    # the shared expert's TP 4 share (64 rows of gate, 64 of up) would share one 128-row scale block
    with pytest.raises(UnsupportedError):
        build_plan(open_source(str(tiny("qwen3-next-fp8"))).checkpoint, Layout(tp=4))


# ---- the releases, from headers, against the shapes vLLM 0.32 builds -------------------------------


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("ep", [False, True], ids=["tp8", "tp8-ep"])
def test_release_plan_matches_vllm(release, ep):
    recorded = json.loads((HERE / f"{release}.json").read_text())
    assert recorded["num_hidden_layers"] == CUT_LAYERS[release] and recorded["tp"] == 8
    layout = recorded["layouts"]["tp8-ep" if ep else "tp8"]
    plan = build_plan(headers(cut(RELEASES[release], CUT_LAYERS[release])), Layout(tp=8, ep=ep))
    names = {"bfloat16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
    for r in range(8):
        want = {k: (names[d], tuple(shape)) for k, (d, shape) in layout["states"][layout["rank_state"][r]].items()}
        got = shapes(plan, r)
        assert got == want, (
            f"rank {r}: {sorted(set(got) ^ set(want))[:5]} / {[k for k in got if got.get(k) != want.get(k)][:5]}"
        )
        nbytes = sum(math.prod(s) * ITEMSIZE[d] for d, s in want.values())
        assert plan.summary()["ranks"][r]["bytes"] == nbytes
    serve = plan.serve_command("OUT")
    assert ("--enable-expert-parallel" in serve) == ep
    assert serve.endswith("--language-model-only") == ("qwen3.5" in release)


def test_qwen35_397b_fp8_tp8_numbers():
    """The model of vLLM issue #41174 at TP 8: block FP8 on the block grid everywhere (no refinement:
    the experts' and the shared expert's 1024 / 8 = 128), FP8 KV-cache parameters on the four
    full-attention layers' attn, which vLLM's own save_sharded_state drops."""
    plan = build_plan(headers(cut(RELEASES["qwen3.5-397b-a17b-fp8"], 4)), Layout(tp=8))
    s = shapes(plan, 3)
    la, m = "language_model.model.layers.0.linear_attn.", "language_model.model.layers.3.mlp.experts."
    assert s[la + "in_proj_qkvz.weight"] == ("F8_E4M3", ((2 * 2048 + 2 * 8192) // 8, 4096))
    assert s[la + "in_proj_ba.weight"] == ("BF16", (16, 4096))
    assert s[m + "routed_experts.w13_weight"] == ("F8_E4M3", (512, 256, 4096))
    assert s[m + "routed_experts.w13_weight_scale_inv"] == ("F32", (512, 2, 32))
    assert s["language_model.model.layers.3.self_attn.attn.k_scale"] == ("BF16", ())
    assert s["language_model.model.embed_tokens.weight"] == ("BF16", (248320 // 8, 4096))
