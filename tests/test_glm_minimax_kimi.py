"""GLM-4.5/4.6 MoE, MiniMax-M2 and Kimi-K2 (issue 15): plans of the tiny checkpoints, written bytes
against an independent torch reading of vLLM's loaders, the MTP layers vLLM skips, Kimi's side files.

Byte-identity with vLLM itself is tests/against_vllm/test_vllm.py (STATE_CASES for glm4-moe,
minimax-m2, minimax-m2-fp8, kimi-k2); the releases' shapes at TP 8 are tests/test_releases.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.rules import REFUSED
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.reference import assert_streamed_files_equal_plan, load_source
from tests.fixtures.saving import save
from tests.fixtures.tiny import KIMI_SIDE_FILES


def shapes(plan, tp_rank, pp_rank=0):
    return {
        t.name: (t.dtype, t.shape)
        for f in plan.files
        if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank)
        for t in f.tensors
    }


def rank_tensors(plan, tp_rank):
    return {t.name: t for f in plan.files if f.tp_rank == tp_rank for t in f.tensors}


# ---- GLM-4.5 / 4.6 ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glm4_moe_tiny(tiny, tp):
    plan = build_plan(open_source(str(tiny("glm4-moe"))).checkpoint, Layout(tp=tp))
    kv = max(1, 2 // tp)  # 2 KV heads of 32: replicated at TP 4
    for r in range(tp):
        s = shapes(plan, r)
        a, m = "model.layers.2.self_attn.", "model.layers.2.mlp."
        assert s[a + "qkv_proj.weight"] == ("BF16", ((8 // tp + 2 * kv) * 32, 64))
        assert s[a + "qkv_proj.bias"] == ("BF16", ((8 // tp + 2 * kv) * 32,))  # attention_bias
        assert s[a + "o_proj.weight"] == ("BF16", (64, 256 // tp))
        assert "model.layers.2.self_attn.o_proj.bias" not in s
        assert s[a + "q_norm.weight"] == s[a + "k_norm.weight"] == ("BF16", (32,))  # per head: whole
        # layer 0 dense (first_k_dense_replace), 1-3 MoE
        assert s["model.layers.0.mlp.gate_up_proj.weight"] == ("BF16", (2 * 128 // tp, 64))
        assert s[m + "gate.weight"] == ("F32", (8, 64))  # GateLinear(params_dtype=float32)
        assert s[m + "experts.routed_experts.e_score_correction_bias"] == ("F32", (8,))
        assert s[m + "experts.routed_experts.w13_weight"] == ("BF16", (8, 2 * 32 // tp, 64))
        assert s[m + "experts._shared_experts._layer.gate_up_proj.weight"] == ("BF16", (2 * 32 // tp, 64))
        assert s["lm_head.weight"] == s["model.embed_tokens.weight"] == ("BF16", (1024 // tp, 64))
        # 3 top + 4 x (2 norms, qkv w+b, o, q/k norm, 4 buffers) + dense 2 + 3 MoE x 6
        assert len(s) == 3 + 4 * 11 + 2 + 3 * 6
        assert not any(k.startswith("model.layers.4.") for k in s)  # the MTP layer
    t = rank_tensors(plan, tp - 1)
    (bias,) = t["model.layers.3.mlp.experts.routed_experts.e_score_correction_bias"].pieces
    assert bias.source == "model.layers.3.mlp.gate.e_score_correction_bias"


def test_glm4_moe_without_qk_norm_or_bias(tiny):
    """GLM-4.5-Air: use_qk_norm false, and a checkpoint without q/k norm tensors plans without them."""
    ckpt = open_source(str(tiny("glm4-moe"))).checkpoint
    ckpt.config = {**ckpt.config, "use_qk_norm": False}
    for name in [n for n in ckpt.tensors if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        del ckpt.tensors[name]
    s = shapes(build_plan(ckpt, Layout(tp=2)), 0)
    assert not any("q_norm" in k or "k_norm" in k for k in s)


def test_glm4_moe_mtp_layer_skipped_only_when_announced(tiny):
    ckpt = open_source(str(tiny("glm4-moe"))).checkpoint
    assert ckpt.config["num_nextn_predict_layers"] == 1 and "model.layers.4.eh_proj.weight" in ckpt.tensors
    build_plan(ckpt, Layout(tp=2))
    ckpt.config = {**ckpt.config, "num_nextn_predict_layers": 0}
    with pytest.raises(SourceError, match="match no rule"):
        build_plan(ckpt, Layout(tp=2))


def test_glm4_moe_pp_and_ep(tiny):
    ckpt = open_source(str(tiny("glm4-moe"))).checkpoint
    plan = build_plan(ckpt, Layout(tp=1, pp=2))
    first, last = shapes(plan, 0, 0), shapes(plan, 0, 1)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {"lm_head.weight", "model.norm.weight"} <= set(last) and "model.embed_tokens.weight" not in last
    plan = build_plan(ckpt, Layout(tp=4, ep=True))
    s = shapes(plan, 3)
    assert s["model.layers.1.mlp.experts.routed_experts.w13_weight"] == ("BF16", (2, 64, 64))  # experts 6, 7
    assert s["model.layers.1.mlp.experts._shared_experts._layer.down_proj.weight"] == ("BF16", (64, 8))  # TP


# ---- MiniMax-M2 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_minimax_m2_tiny(tiny, tp):
    plan = build_plan(open_source(str(tiny("minimax-m2"))).checkpoint, Layout(tp=tp))
    for r in range(tp):
        s = shapes(plan, r)
        a, m = "model.layers.3.self_attn.", "model.layers.3.block_sparse_moe."
        assert s[a + "q_norm.weight"] == ("BF16", (256 // tp,))  # over all 8 heads, split like them
        assert s[a + "k_norm.weight"] == ("BF16", (64 // min(tp, 2),))  # 2 KV heads: replicated at TP 4
        assert s[m + "gate.weight"] == ("F32", (8, 64))
        assert s[m + "e_score_correction_bias"] == ("F32", (8,))
        assert s[m + "experts.routed_experts.w13_weight"] == ("BF16", (8, 2 * 32 // tp, 64))
        assert s[m + "experts.routed_experts.w2_weight"] == ("BF16", (8, 64, 32 // tp))
        assert not any(k.startswith("model.layers.4.") for k in s)  # num_mtp_modules: dropped by vLLM
        assert len(s) == 3 + 4 * (2 + 2 + 2 + 4 + 4)
    k_norm = [rank_tensors(plan, r)["model.layers.0.self_attn.k_norm.weight"].pieces[0] for r in range(tp)]
    n = 64 // min(tp, 2)
    want = [(r // max(1, tp // 2)) * n for r in range(tp)]
    assert [p.start[0] for p in k_norm] == want and {p.stop[0] - p.start[0] for p in k_norm} == {n}


def test_minimax_m2_refuses_more_ranks_than_experts(tiny):
    ckpt = open_source(str(tiny("minimax-m2"))).checkpoint
    ckpt.config = {**ckpt.config, "num_attention_heads": 16, "num_local_experts": 8}
    with pytest.raises(UnsupportedError, match="greater than the number of experts"):
        build_plan(ckpt, Layout(tp=16))


@pytest.mark.parametrize("tp, ep", [(1, False), (2, False), (4, False), (2, True)])
def test_minimax_m2_fp8_tiny(tiny, tp, ep):
    plan = build_plan(open_source(str(tiny("minimax-m2-fp8"))).checkpoint, Layout(tp=tp, ep=ep))
    s = shapes(plan, 0)
    a, m = "model.layers.1.self_attn.", "model.layers.1.block_sparse_moe."
    # modules_to_not_convert ["gate", "e_score_correction_bias", "lm_head"] match no vLLM prefix
    # exactly: every linear stays FP8; the router is never built with the quant config
    assert s[a + "qkv_proj.weight"] == ("F8_E4M3", ((4 // tp + 2 * max(1, 2 // tp)) * 128, 256))
    assert s[a + "o_proj.weight_scale_inv"] == ("F32", (2, 4 // tp))
    assert s[m + "gate.weight"] == ("F32", (4, 256))
    assert s["lm_head.weight"] == ("BF16", (1024 // tp, 256))
    ip = 384 if ep else 384 // tp
    blk = {384: 128, 192: 64, 96: 32}[ip]  # vLLM refines the block grid to the per-rank size
    n = 2 if ep else 4
    assert s[m + "experts.routed_experts.w13_weight"] == ("F8_E4M3", (n, 2 * ip, 256))
    assert s[m + "experts.routed_experts.w13_weight_scale_inv"] == ("F32", (n, 2 * ip // blk, 256 // blk))
    assert s[m + "experts.routed_experts.w2_weight_scale_inv"] == ("F32", (n, 256 // blk, ip // blk))


@pytest.mark.parametrize(
    "arch, tp, ep",
    [
        ("glm4-moe", 2, False),
        ("glm4-moe", 4, True),
        ("minimax-m2", 4, False),
        ("minimax-m2-fp8", 2, False),
        ("kimi-k2", 2, True),
    ],
)
def test_streamed_files_equal_plan(tiny, tmp_path, arch, tp, ep):
    trust = arch == "kimi-k2"  # its tokenizer runs tokenization_kimi.py
    assert_streamed_files_equal_plan(tiny(arch, shards=2), tmp_path / "out", tp=tp, ep=ep, trust_remote_code=trust)


def test_minimax_norms_equal_vllm_weight_loader_reading(tiny, tmp_path):
    """q_norm/k_norm against MiniMaxText01RMSNormTP.weight_loader read independently: shard_size =
    rows // world, world = tp for q (and k when num_kv_heads >= tp), else num_kv_heads with rank
    tp_rank // (tp // num_kv_heads); the gate cast to float32 as GateLinear(params_dtype=float32)."""
    src = tiny("minimax-m2")
    save(str(src), tmp_path / "out", tp=4, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    p = "model.layers.2."
    for r in range(4):
        with safe_open(str(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors"), "pt") as h:
            assert torch.equal(
                h.get_tensor(p + "self_attn.q_norm.weight"), hf[p + "self_attn.q_norm.weight"].chunk(4)[r]
            )
            assert torch.equal(
                h.get_tensor(p + "self_attn.k_norm.weight"), hf[p + "self_attn.k_norm.weight"].chunk(2)[r // 2]
            )
            gate = h.get_tensor(p + "block_sparse_moe.gate.weight")
            assert gate.dtype == torch.float32 and torch.equal(gate, hf[p + "block_sparse_moe.gate.weight"].float())


# ---- Kimi-K2 ------------------------------------------------------------------------------------


def test_kimi_k2_saves_with_its_side_files(tiny, tmp_path):
    src = tiny("kimi-k2")
    out = tmp_path / "out"
    code, stdout, stderr = run("save", str(src), str(out), "--tp", "4", "--ep", "--json", "--trust-remote-code")
    assert code == 0, stderr
    result = json.loads(stdout)
    for name, text in KIMI_SIDE_FILES.items():
        assert (out / name).read_text() == text, name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["auto_map"]["AutoConfig"].startswith("configuration_deepseek")
    # asked for: the remote code is copied and the serve line trusts it, as Kimi-K2's own instructions do
    assert result["serve"].endswith("--trust-remote-code")
    manifest = json.loads((out / "reshard.json").read_text())
    assert set(KIMI_SIDE_FILES) <= {f["name"] for f in manifest["copied_files"]}
    assert run("verify", str(out))[0] == 0
    plan = build_plan(open_source(str(src)).checkpoint, Layout(tp=4, ep=True))
    s = shapes(plan, 3)
    assert s["model.layers.1.mlp.experts.routed_experts.w13_weight"] == ("BF16", (12, 64, 64))  # 48 / 4
    assert s["model.layers.1.mlp.experts.gate.e_score_correction_bias"] == ("F32", (48,))


def test_hub_downloads_remote_code():
    from reshard.names import HUB_PATTERNS

    assert "*.py" in HUB_PATTERNS  # tokenization_kimi.py, configuration_deepseek.py
    assert "*.model" in HUB_PATTERNS  # tiktoken.model


@pytest.mark.parametrize("command", ["save", "plan"])
def test_kimi_k2_tokenizer_code_needs_the_opt_in(tiny, tmp_path, command):
    """Kimi-K2's tokenizer only loads through tokenization_kimi.py: refused (exit 3) unless asked."""
    out = tmp_path / "out"
    args = [command, str(tiny("kimi-k2")), *([str(out)] if command == "save" else []), "--tp", "4", "--ep"]
    code, _, stderr = run(*args)
    assert code == 3, stderr
    assert "pass --trust-remote-code to copy and run tokenization_kimi.py" in stderr
    assert not out.exists()


def _with_config_code(tiny, tmp_path):
    """glm4-moe (native in vLLM) with an auto_map in config.json and the code it names."""
    src = tmp_path / "src"
    shutil.copytree(tiny("glm4-moe"), src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_glm.GlmConfig"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "configuration_glm.py").write_text("raise SystemExit('ran remote code')\n")
    return src


def test_config_auto_map_dropped_without_the_opt_in(tiny, tmp_path):
    src, out = _with_config_code(tiny, tmp_path), tmp_path / "out"
    code, stdout, stderr = run("save", str(src), str(out), "--tp", "2", "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert "--trust-remote-code" not in result["serve"] and "--trust-remote-code" not in result["serve_reshard"]
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    assert not (out / "configuration_glm.py").exists()
    assert any("auto_map" in n and "configuration_glm.py" in n for n in result["notes"]), result["notes"]
    manifest = json.loads((out / "reshard.json").read_text())
    assert "configuration_glm.py" not in manifest["copied"]
    assert run("verify", str(out))[0] == 0
    assert (src / "configuration_glm.py").exists() and "auto_map" in json.loads((src / "config.json").read_text())


def test_config_auto_map_kept_with_the_opt_in(tiny, tmp_path):
    src, out = _with_config_code(tiny, tmp_path), tmp_path / "out"
    code, stdout, stderr = run("save", str(src), str(out), "--tp", "2", "--json", "--trust-remote-code")
    assert code == 0, stderr
    assert json.loads(stdout)["serve"].endswith("--trust-remote-code")
    assert json.loads((out / "config.json").read_text())["auto_map"]
    manifest = json.loads((out / "reshard.json").read_text())
    assert "configuration_glm.py" in {f["name"] for f in manifest["copied_files"]}  # its digest recorded
    assert run("verify", str(out))[0] == 0


def test_no_trust_remote_code_without_auto_map(tiny):
    plan = build_plan(open_source(str(tiny("glm4-moe"))).checkpoint, Layout(tp=2))
    assert "--trust-remote-code" not in plan.serve_command("OUT")


# ---- refused by name ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_neighbours_refused_by_name_with_reason(name):
    ckpt = Checkpoint(None, {"architectures": [name]}, {}, [], {"path": "x"})
    with pytest.raises(UnsupportedError) as e:
        build_plan(ckpt, Layout(tp=1))
    assert str(e.value).startswith(f"{name} is not supported: {REFUSED[name]}")
    assert e.value.exit_code == 3
