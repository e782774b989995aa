"""Planning from headers alone: real model shapes, divisibility rules, and refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.errors import SourceError, UnsupportedError
from reshard.layout import Layout
from reshard.plan import Fill, build_plan, flat, pp_ranges
from reshard.sources import open_source
from tests.fixtures.synthetic import LLAMA_3_70B, QWEN3_235B_A22B_FP8, synthetic_checkpoint


def rank_tensors(plan, tp_rank, pp_rank=0):
    return {t.name: t for f in plan.files if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank) for t in f.tensors}


def test_llama_70b_tp8_plans_from_headers():
    # how long this takes is a figure of scripts/bench.py, not a test
    plan = build_plan(synthetic_checkpoint(LLAMA_3_70B, files=30), Layout(tp=8))
    r3 = rank_tensors(plan, 3)
    # 80 layers x (2 norms + qkv + o + gate_up + down + 4 attention buffers) + embed + norm + lm_head
    assert len(r3) == 80 * 10 + 3
    assert r3["model.layers.0.self_attn.qkv_proj.weight"].shape == (1024 + 128 + 128, 8192)
    assert r3["model.layers.0.self_attn.o_proj.weight"].shape == (8192, 1024)
    assert r3["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 3584, 8192)
    assert r3["model.layers.0.mlp.down_proj.weight"].shape == (8192, 3584)
    assert r3["lm_head.weight"].shape == (16032, 8192)
    assert r3["model.layers.7.self_attn.attn._k_scale"].shape == ()
    # every rank holds an eighth of the sharded bytes plus the replicated ones
    sizes = {sum(t.nbytes for t in rank_tensors(plan, r).values()) for r in range(8)}
    assert len(sizes) == 1
    # 5 GiB parts
    assert max(f.data_bytes for f in plan.files) <= 5 * 1024**3


def test_planning_imports_no_torch():
    code = "import sys, reshard.plan, reshard.rules; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    root = Path(__file__).resolve().parents[1]  # `-c` puts the working directory first on sys.path
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr or "importing reshard.plan imported torch or numpy"


def test_kv_heads_replicated_when_tp_exceeds_them():
    cfg = {**LLAMA_3_70B, "num_hidden_layers": 1, "num_key_value_heads": 4}
    plan = build_plan(synthetic_checkpoint(cfg), Layout(tp=8))
    for r in range(8):
        q, k, v = rank_tensors(plan, r)["model.layers.0.self_attn.qkv_proj.weight"].pieces
        assert (q.start[0], q.stop[0]) == (r * 1024, (r + 1) * 1024)
        kv = r // 2  # 8 ranks, 4 KV heads: ranks 2j and 2j+1 share head j
        assert (k.start[0], k.stop[0]) == (kv * 128, (kv + 1) * 128)
        assert (v.start[0], v.stop[0]) == (kv * 128, (kv + 1) * 128)


def test_vocab_padded_to_64_then_split_with_zero_rows():
    cfg = {**LLAMA_3_70B, "num_hidden_layers": 1, "vocab_size": 32001}
    plan = build_plan(synthetic_checkpoint(cfg), Layout(tp=8))
    last = rank_tensors(plan, 7)["model.embed_tokens.weight"]
    assert last.shape == (4008, 8192)  # 32064 / 8
    real, pad = last.pieces
    assert (real.start[0], real.stop[0]) == (7 * 4008, 32001)
    assert isinstance(pad, Fill) and pad.value == 0 and pad.count == 63 * 8192


def test_tied_embeddings_stored_only_as_lm_head():
    cfg = {**LLAMA_3_70B, "num_hidden_layers": 1, "tie_word_embeddings": True}
    plan = build_plan(synthetic_checkpoint(cfg), Layout(tp=2))
    names = rank_tensors(plan, 0)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert names["lm_head.weight"].pieces[0].source == "model.embed_tokens.weight"


@pytest.mark.parametrize(
    "changes, tp, message",
    [
        ({"num_attention_heads": 64}, 3, "num_attention_heads=64 is not divisible by --tp 3"),
        ({"num_key_value_heads": 8}, 16, None),
        ({"num_key_value_heads": 6, "num_attention_heads": 48}, 4, "do not divide"),
        ({"architectures": ["GPTBigCodeForCausalLM"]}, 2, "supported: .*LlamaForCausalLM"),
    ],
    ids=["heads", "kv-ok", "kv-bad", "unknown-arch"],
)
def test_refusals(changes, tp, message):
    cfg = {**LLAMA_3_70B, "num_hidden_layers": 1, **changes}
    if message is None:
        build_plan(synthetic_checkpoint({**cfg, "intermediate_size": 28672}), Layout(tp=tp))
        return
    with pytest.raises(UnsupportedError, match=message):
        build_plan(synthetic_checkpoint(cfg), Layout(tp=tp))


def test_missing_tensor_is_named():
    ckpt = synthetic_checkpoint({**LLAMA_3_70B, "num_hidden_layers": 2})
    del ckpt.tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(SourceError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        build_plan(ckpt, Layout(tp=2))


@pytest.mark.parametrize("proj", ["gate_proj", "down_proj"])
def test_an_expert_of_the_wrong_shape_is_named(proj):
    """A layer's experts are checked at once (plan/experts.py `_weights`); one off is still named."""
    cfg = {k: v for k, v in QWEN3_235B_A22B_FP8.items() if k != "quantization_config"}
    ckpt = synthetic_checkpoint({**cfg, "num_hidden_layers": 2})
    name = f"model.layers.1.mlp.experts.77.{proj}.weight"
    info = ckpt.tensors[name]
    ckpt.tensors[name] = info._replace(shape=info.shape[::-1])  # same bytes, transposed
    with pytest.raises(SourceError, match=rf"experts\.77\.{proj}\.weight has shape"):
        build_plan(ckpt, Layout(tp=2))
    with pytest.raises(SourceError, match=rf"experts\.77\.{proj}\.weight has shape"):
        build_plan(ckpt, Layout(tp=2, ep=True))


def test_unexpected_tensor_is_refused():
    ckpt = synthetic_checkpoint({**LLAMA_3_70B, "num_hidden_layers": 1})
    ckpt.tensors["model.extra.weight"] = ckpt.tensors["model.norm.weight"]._replace(name="model.extra.weight")
    with pytest.raises(SourceError, match="match no rule"):
        build_plan(ckpt, Layout(tp=1))


def test_pp_split_as_vllm():
    assert pp_ranges(94, 4) == [(0, 23), (23, 47), (47, 71), (71, 94)]
    assert pp_ranges(4, 2) == [(0, 2), (2, 4)]
    assert pp_ranges(10, 2, [3, 7]) == [(0, 3), (3, 10)]
    with pytest.raises(UnsupportedError):
        pp_ranges(10, 2, [3, 6])


# ---- Qwen3-235B-A22B-FP8 at TP 8 (reference doc section 11) ------------------------------------


@pytest.fixture(scope="module")
def qwen235():
    return synthetic_checkpoint(QWEN3_235B_A22B_FP8, files=48)


def shapes(plan, r):
    return {n: (t.dtype, t.shape) for n, t in rank_tensors(plan, r).items()}


def test_qwen3_235b_fp8_tp8(qwen235):
    plan = build_plan(qwen235, Layout(tp=8))
    L = "model.layers.5."
    for r in (0, 7):
        s = shapes(plan, r)
        assert len(s) == 1977
        assert s["model.embed_tokens.weight"] == ("BF16", (18992, 4096))
        assert s["lm_head.weight"] == ("BF16", (18992, 4096))
        assert s[L + "self_attn.qkv_proj.weight"] == ("F8_E4M3", (1280, 4096))
        assert s[L + "self_attn.qkv_proj.weight_scale_inv"] == ("F32", (10, 32))
        assert s[L + "self_attn.o_proj.weight"] == ("F8_E4M3", (4096, 1024))
        assert s[L + "self_attn.o_proj.weight_scale_inv"] == ("F32", (32, 8))
        assert s[L + "self_attn.attn.k_scale"] == ("BF16", ())
        assert s[L + "self_attn.attn._k_scale"] == ("F32", ())
        assert s[L + "mlp.experts.gate.weight"] == ("BF16", (128, 4096))
        assert s[L + "mlp.experts.routed_experts.w13_weight"] == ("F8_E4M3", (128, 384, 4096))
        assert s[L + "mlp.experts.routed_experts.w13_weight_scale_inv"] == ("F32", (128, 6, 64))
        assert s[L + "mlp.experts.routed_experts.w2_weight"] == ("F8_E4M3", (128, 4096, 192))
        assert s[L + "mlp.experts.routed_experts.w2_weight_scale_inv"] == ("F32", (128, 64, 3))
        assert "model.layers.5.mlp.gate.weight" not in s
    t = rank_tensors(plan, 3)
    qkv = t[L + "self_attn.qkv_proj.weight_scale_inv"].pieces
    assert [(p.start[0], p.stop[0]) for p in qkv] == [(24, 32), (1, 2), (1, 2)]  # q rows 8r.., kv head r//2
    w13s = t[L + "mlp.experts.routed_experts.w13_weight_scale_inv"].pieces
    assert w13s[0].up == (2, 2) and (w13s[0].start, w13s[0].stop) == ((9, 0), (12, 64))
    assert any("refined from [128, 128] to [64, 64]" in n for n in plan.notes)


def test_qwen3_235b_fp8_tp8_ep(qwen235):
    plan = build_plan(qwen235, Layout(tp=8, ep=True))
    L = "model.layers.93."
    s = shapes(plan, 5)
    assert len(s) == 1977
    assert s[L + "mlp.experts.routed_experts.w13_weight"] == ("F8_E4M3", (16, 3072, 4096))
    assert s[L + "mlp.experts.routed_experts.w13_weight_scale_inv"] == ("F32", (16, 24, 32))
    assert s[L + "mlp.experts.routed_experts.w2_weight"] == ("F8_E4M3", (16, 4096, 1536))
    assert s[L + "mlp.experts.routed_experts.w2_weight_scale_inv"] == ("F32", (16, 32, 12))
    assert s[L + "self_attn.qkv_proj.weight"] == ("F8_E4M3", (1280, 4096))  # attention stays TP
    first = flat(rank_tensors(plan, 5)[L + "mlp.experts.routed_experts.w13_weight"].pieces)[0]
    assert first.source == L + "mlp.experts.80.gate_proj.weight"  # rank 5 holds experts 80..95
    assert "--enable-expert-parallel" in plan.serve_command("out")


def test_fp8_moe_split_vllm_refuses():
    # 128 / 8 = 16 per rank: not a multiple of the 128 block, and gcd(128, 16) < 32
    cfg = {**QWEN3_235B_A22B_FP8, "num_hidden_layers": 1, "moe_intermediate_size": 128}
    with pytest.raises(UnsupportedError, match="use --ep, or a smaller --tp"):
        build_plan(synthetic_checkpoint(cfg), Layout(tp=8))
    build_plan(synthetic_checkpoint(cfg), Layout(tp=8, ep=True))


# ---- --moe-backend (reshard.plan.backends) -------------------------------------------------------


def _plan_cli(monkeypatch, ckpt, *args: str) -> str:
    """`reshard plan --tensors ...` on a header-only checkpoint; its stdout."""
    import types

    import reshard.sources
    from tests.fixtures.cli import run

    monkeypatch.setattr(reshard.sources, "open_source", lambda *a, **k: types.SimpleNamespace(checkpoint=ckpt))
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = run("plan", "Qwen/Qwen3-235B-A22B-FP8", "--tp", "8", "--tensors", *args)
    assert code == 0, err
    return out


def test_qwen3_235b_fp8_tp8_moe_backends(qwen235, monkeypatch):
    L = "model.layers.5.mlp.experts.routed_experts."
    padded = {
        "w13_weight": [128, 512, 4096],
        "w13_weight_scale_inv": [128, 4, 32],
        "w2_weight": [128, 4096, 256],
        "w2_weight_scale_inv": [128, 32, 2],
    }
    refined = {
        "w13_weight": [128, 384, 4096],
        "w13_weight_scale_inv": [128, 6, 64],
        "w2_weight": [128, 4096, 192],
        "w2_weight_scale_inv": [128, 64, 3],
    }
    for backend, want in (("deep_gemm", padded), ("auto", refined)):
        out = _plan_cli(monkeypatch, qwen235, "--moe-backend", backend)
        for name, shape in want.items():
            assert f"{L}{name}  " in out and f"  {shape}" in out.split(f"{L}{name}  ", 1)[1].split("\n", 1)[0]
        serve = out.strip().splitlines()[-1]
        assert serve.startswith("vllm serve OUT_DIR")
        assert ("--moe-backend deep_gemm" in serve) == (backend == "deep_gemm")
        assert "--moe-backend" not in serve or backend != "auto"  # FP8 auto refines on every GPU: no pin
    plan = build_plan(qwen235, Layout(tp=8, moe_backend="deep_gemm"))
    assert plan.layout.moe_backend == "deep_gemm" and plan.layout.moe_pin == "deep_gemm"
    r5, r6 = rank_tensors(plan, 5), rank_tensors(plan, 6)
    w13 = r5[L + "w13_weight"].pieces
    assert (w13[0].start, w13[0].stop) == ((1280, 0), (1536, 4096))  # rank 5: rows [1280, 1536), whole blocks
    assert all(isinstance(p, Fill) and p.value == 0.0 for p in r6[L + "w13_weight"].pieces)
    assert all(isinstance(p, Fill) and p.value == 1.0 for p in r6[L + "w2_weight_scale_inv"].pieces)
    assert any("ranks 6-7 hold only zero weights and 1.0 scales" in n for n in plan.notes)


def test_bf16_moe_auto_pins_triton_and_trtllm_rounds_up():
    from tests.fixtures.synthetic import QWEN3_235B_A22B_FP8 as cfg

    bf16 = {k: v for k, v in cfg.items() if k != "quantization_config"}
    ckpt = synthetic_checkpoint({**bf16, "num_hidden_layers": 1})
    L = "model.layers.0.mlp.experts.routed_experts."
    auto = build_plan(ckpt, Layout(tp=8))
    assert rank_tensors(auto, 0)[L + "w13_weight"].shape == (128, 384, 4096)
    assert auto.layout.moe_pin == "triton" and "--moe-backend triton" in auto.serve_command("out")
    assert any("silently wrong" in n for n in auto.notes)
    trt = build_plan(ckpt, Layout(tp=8, moe_backend="flashinfer_trtllm"))
    t = rank_tensors(trt, 3)
    assert t[L + "w13_weight"].shape == (128, 512, 4096) and t[L + "w2_weight"].shape == (128, 4096, 256)
    gate, pad, up = t[L + "w13_weight"].pieces[:3]
    assert (gate.start[0], gate.stop[0], pad.count, up.start[0]) == (576, 768, 64 * 4096, 576)
    down = t[L + "w2_weight"].pieces[0]
    assert (down.start, down.stop, down.pad) == ((0, 576), (4096, 768), (4096, 256))
    assert "--moe-backend flashinfer_trtllm" in trt.serve_command("out")
    # the per-rank size is a multiple of 128 at TP 4 (384): one layout for every backend, nothing pinned
    assert build_plan(ckpt, Layout(tp=4)).layout.moe_pin is None


@pytest.mark.parametrize(
    "arch, pp, partition", [("qwen3-moe", 3, None), ("glm4-moe", 4, None), ("qwen3-moe", 2, (1, 3))]
)
def test_a_stage_without_a_moe_layer_is_refused_as_vllm_does(tiny, arch, pp, partition):
    """Layer 0 is dense in both (mlp_only_layers [0], first_k_dense_replace 1): a stage holding only it makes
    vLLM's Qwen3MoeForCausalLM / Glm4MoeForCausalLM raise "No ... layer found in model.layers" (seen in vLLM 0.32,
    tests/against_vllm); the even split at --pp 2 gives every stage a MoE layer and plans."""
    ckpt = open_source(str(tiny(arch))).checkpoint
    with pytest.raises(UnsupportedError, match="pipeline stage 0 holds layer 0, no MoE layer"):
        build_plan(ckpt, Layout(tp=1, pp=pp, partition=partition))
    assert build_plan(ckpt, Layout(tp=1, pp=2)).layer_ranges == [(0, 2), (2, 4)]


def test_float16_where_vllm_refuses_it(tiny, tmp_path):
    """vLLM's _FLOAT16_NOT_SUPPORTED_MODELS (gemma2, gemma3, gemma3_text, glm4): --dtype float16 refused; auto on
    a float16 config falls back to bfloat16 (seen in vLLM 0.32 by hand: the bfloat16 output equals its state); a
    Llama stays float16."""
    with pytest.raises(UnsupportedError, match="vLLM refuses float16 for model type 'gemma3_text'"):
        build_plan(open_source(str(tiny("gemma3"))).checkpoint, Layout(tp=2, dtype="float16"))
    for arch, want in (("gemma3", "bfloat16"), ("gemma2", "bfloat16"), ("llama", "float16")):
        src = tmp_path / arch
        shutil.copytree(tiny(arch), src)
        config = json.loads((src / "config.json").read_text())
        config.pop("torch_dtype", None)
        config["dtype"] = "float16"
        (src / "config.json").write_text(json.dumps(config))
        assert build_plan(open_source(str(src)).checkpoint, Layout(tp=2)).layout.dtype == want, arch


def test_dtype_is_read_over_torch_dtype_as_transformers_does(tiny, tmp_path):
    """A config with both keys: transformers 5 (vLLM 0.32's; configuration_utils: `self.dtype if
    self.dtype is not None else torch_dtype`) takes `dtype`, and so does --dtype auto."""
    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "float16"}))
    assert build_plan(open_source(str(src)).checkpoint, Layout(tp=2)).layout.dtype == "bfloat16"


def test_dtype_outside_the_quantization_methods_is_refused(tiny):
    """vLLM (config/vllm.py) refuses a model dtype its quantization method does not run in
    (get_supported_act_dtypes: Fp8Config bfloat16/float16; compressed-tensors float32 too), at start-up;
    seen in vLLM 0.32 for fp8, modelopt and gpt-oss MXFP4 at float32 (tests/against_vllm harness, by hand)."""
    ckpt = open_source(str(tiny("qwen3-moe-fp8"))).checkpoint
    with pytest.raises(UnsupportedError, match="vLLM runs fp8 quantization in bfloat16 or float16 only"):
        build_plan(ckpt, Layout(tp=1, dtype="float32"))
    assert build_plan(ckpt, Layout(tp=1, dtype="float16")).layout.dtype == "float16"
