"""DeepSeek-V2/V3 (MLA), Gemma 2/3 and Phi-3: plans from tiny real checkpoints and from headers.

Byte-for-byte agreement with vLLM itself is `tests/against_vllm/test_vllm.py`; here the plans'
keys, shapes, dtypes and pieces are checked against the layout vLLM 0.32 builds (reference doc
sections 9.1, 9.7, 9.8), and the streamed files against an independent torch slicing.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.format import ITEMSIZE, TensorInfo
from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART, Fill, Slice, build_plan, flat
from reshard.rules import ARCHITECTURES
from reshard.sources import open_source
from tests.fixtures.reference import assert_streamed_files_equal_plan, load_source
from tests.fixtures.saving import save

NEW = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM")
BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def rank(plan, tp_rank, pp_rank=0):
    return {t.name: t for f in plan.files if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank) for t in f.tensors}


def shapes(plan, tp_rank, pp_rank=0):
    return {n: (t.dtype, t.shape) for n, t in rank(plan, tp_rank, pp_rank).items()}


def rows(piece: Slice) -> tuple[int, int]:
    return piece.start[0], piece.stop[0]


# ---- registry -----------------------------------------------------------------------------------


def test_unknown_architecture_lists_every_supported_one():
    ckpt = Checkpoint(None, {"architectures": ["GPTBigCodeForCausalLM"]}, {}, [], {"path": "x"})
    with pytest.raises(UnsupportedError) as e:
        build_plan(ckpt, Layout(tp=1))
    assert "unsupported architecture (GPTBigCodeForCausalLM)" in str(e.value)
    assert e.value.hint == "supported: " + ", ".join(sorted(ARCHITECTURES))
    for name in (*NEW, "LlamaForCausalLM", "MistralForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert name in e.value.hint


# ---- DeepSeek-V3 (MLA, noaux_tc, shared expert, first_k_dense_replace, MTP) ----------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_deepseek_v3_tiny(tiny, tp):
    plan = build_plan(open_source(str(tiny("deepseek-v3"))).checkpoint, Layout(tp=tp))
    for r in range(tp):
        s = shapes(plan, r)
        # 3 top + 4 layers x (2 norms + 6 MLA tensors + 4 buffers) + dense MLP 2 + 3 MoE layers x 6
        assert len(s) == 3 + 4 * 12 + 2 + 3 * 6
        assert s["model.embed_tokens.weight"] == ("BF16", (1024 // tp, 64))
        assert s["lm_head.weight"] == ("BF16", (1024 // tp, 64))  # never tied for DeepSeek
        # dense layer 0 (first_k_dense_replace=1)
        assert s["model.layers.0.mlp.gate_up_proj.weight"] == ("BF16", (2 * 128 // tp, 64))
        assert s["model.layers.0.mlp.down_proj.weight"] == ("BF16", (64, 128 // tp))
        assert "model.layers.0.mlp.experts.gate.weight" not in s
        for L in range(4):
            a = f"model.layers.{L}.self_attn."
            assert s[a + "fused_qkv_a_proj.weight"] == ("BF16", (64 + 512 + 64, 64))  # replicated
            assert s[a + "mla_attn.q_a_layernorm.weight"] == ("BF16", (64,))
            assert s[a + "mla_attn.q_b_proj.weight"] == ("BF16", (4 * 96 // tp, 64))
            assert s[a + "kv_a_layernorm.weight"] == ("BF16", (512,))
            assert s[a + "kv_b_proj.weight"] == ("BF16", (4 * 64 // tp, 512))
            assert s[a + "mla_attn.o_proj.weight"] == ("BF16", (64, 4 * 32 // tp))
            for b in BUFFERS:
                assert s[a + "mla_attn.mla_attn." + b] == ("F32", ())
            assert not any(k.startswith(a + "attn.") or k.startswith(a + "q_b_proj") for k in s)
        m = "model.layers.2.mlp.experts."
        assert s[m + "gate.weight"] == ("BF16", (8, 64))
        assert s[m + "gate.e_score_correction_bias"] == ("F32", (8,))
        assert s[m + "routed_experts.w13_weight"] == ("BF16", (8, 2 * 32 // tp, 64))
        assert s[m + "routed_experts.w2_weight"] == ("BF16", (8, 64, 32 // tp))
        assert s[m + "_shared_experts._layer.gate_up_proj.weight"] == ("BF16", (2 * 32 // tp, 64))
        assert s[m + "_shared_experts._layer.down_proj.weight"] == ("BF16", (64, 32 // tp))
        assert not any(k.startswith("model.layers.4.") for k in s)  # the MTP layer is skipped
    t = rank(plan, tp - 1)
    fused = t["model.layers.1.self_attn.fused_qkv_a_proj.weight"].pieces
    assert [(p.source, rows(p)) for p in fused] == [
        ("model.layers.1.self_attn.q_a_proj.weight", (0, 64)),
        ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (0, 576)),
    ]
    (q_b,) = t["model.layers.1.self_attn.mla_attn.q_b_proj.weight"].pieces
    assert q_b.source == "model.layers.1.self_attn.q_b_proj.weight"
    assert rows(q_b) == ((tp - 1) * 384 // tp, 384)
    (bias,) = t["model.layers.3.mlp.experts.gate.e_score_correction_bias"].pieces
    assert bias.source == "model.layers.3.mlp.gate.e_score_correction_bias"


def test_deepseek_v3_tiny_ep(tiny):
    plan = build_plan(open_source(str(tiny("deepseek-v3"))).checkpoint, Layout(tp=4, ep=True))
    s = shapes(plan, 3)
    m = "model.layers.3.mlp.experts."
    assert s[m + "routed_experts.w13_weight"] == ("BF16", (2, 64, 64))  # experts 6, 7 whole
    assert s[m + "routed_experts.w2_weight"] == ("BF16", (2, 64, 32))
    assert s[m + "_shared_experts._layer.gate_up_proj.weight"] == ("BF16", (16, 64))  # still TP
    first = flat(rank(plan, 3)[m + "routed_experts.w13_weight"].pieces)[0]
    assert first.source == "model.layers.3.mlp.experts.6.gate_proj.weight"


def test_deepseek_v3_mtp_layer_ignored_but_strays_refused(tiny):
    ckpt = open_source(str(tiny("deepseek-v3"))).checkpoint
    assert ckpt.config["num_nextn_predict_layers"] == 1
    assert "model.layers.4.eh_proj.weight" in ckpt.tensors
    build_plan(ckpt, Layout(tp=2))
    # without num_nextn_predict_layers the same tensors are strays
    ckpt.config = {**ckpt.config, "num_nextn_predict_layers": 0}
    with pytest.raises(SourceError, match="match no rule"):
        build_plan(ckpt, Layout(tp=2))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_deepseek_v3_fp8_tiny(tiny, tp):
    plan = build_plan(open_source(str(tiny("deepseek-v3-fp8"))).checkpoint, Layout(tp=tp))
    s = shapes(plan, 0)
    a = "model.layers.1.self_attn."
    # [q_lora 128 | kv_lora 512 + rope 64]: the second part is not a block multiple, so vLLM
    # skips the block-shape check; the scale rows are [1 of q_a ; 5 of kv_a]
    assert s[a + "fused_qkv_a_proj.weight"] == ("F8_E4M3", (704, 256))
    assert s[a + "fused_qkv_a_proj.weight_scale_inv"] == ("F32", (6, 2))
    assert s[a + "mla_attn.q_b_proj.weight"] == ("F8_E4M3", (1024 // tp, 128))
    assert s[a + "mla_attn.q_b_proj.weight_scale_inv"] == ("F32", (8 // tp, 1))
    assert s[a + "kv_b_proj.weight_scale_inv"] == ("F32", (8 // tp, 4))
    assert s[a + "mla_attn.o_proj.weight_scale_inv"] == ("F32", (2, 4 // tp))
    assert s[a + "mla_attn.q_a_layernorm.weight"] == ("BF16", (128,))
    # MLAAttention is not an Attention: no FP8 k/v/q/prob_scale parameters, only the buffers
    assert s[a + "mla_attn.mla_attn._k_scale"] == ("F32", ())
    assert not any(k.endswith((".k_scale", ".v_scale", ".q_scale", ".prob_scale")) for k in s)
    m = "model.layers.2.mlp.experts."
    assert s[m + "gate.weight"] == ("BF16", (4, 256))  # router never quantized
    assert s[m + "gate.e_score_correction_bias"] == ("F32", (4,))
    assert s[m + "_shared_experts._layer.gate_up_proj.weight_scale_inv"] == ("F32", (8 // tp, 2))
    ip = 256 // tp
    blk = 64 if tp == 4 else 128  # T4: Ip 64 -> vLLM refines the MoE scales to 64x64
    assert s[m + "routed_experts.w13_weight_scale_inv"] == ("F32", (4, 2 * ip // blk, 256 // blk))
    assert any("to [64, 64]" in n for n in plan.notes) == (tp == 4)
    fused = rank(plan, 0)[a + "fused_qkv_a_proj.weight_scale_inv"].pieces
    assert [(p.source.rsplit(".", 2)[-2], rows(p)) for p in fused] == [
        ("q_a_proj", (0, 1)),
        ("kv_a_proj_with_mqa", (0, 5)),
    ]


@pytest.mark.parametrize("tp", [1, 4])
def test_deepseek_v2_lite_tiny_without_q_lora(tiny, tp):
    plan = build_plan(open_source(str(tiny("deepseek-v2-lite"))).checkpoint, Layout(tp=tp))
    s = shapes(plan, 0)
    a = "model.layers.1.self_attn."
    assert s[a + "kv_a_proj_with_mqa.weight"] == ("BF16", (576, 64))  # replicated, self_attn path
    assert s[a + "mla_attn.q_proj.weight"] == ("BF16", (4 * 96 // tp, 64))  # column, mla_attn path
    assert not any("q_a_" in k or "q_b_proj" in k or "fused_qkv_a_proj" in k for k in s)
    assert "model.layers.1.mlp.experts.gate.e_score_correction_bias" not in s  # greedy top-k
    assert s["model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight"] == ("BF16", (2 * 64 // tp, 64))


def test_deepseek_pp_embedding_first_lm_head_last(tiny):
    plan = build_plan(open_source(str(tiny("deepseek-v3"))).checkpoint, Layout(tp=1, pp=2))
    first, last = shapes(plan, 0, 0), shapes(plan, 0, 1)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    assert {k.split(".")[2] for k in last if k.startswith("model.layers.")} == {"2", "3"}


# ---- Gemma 2 / Gemma 3 --------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gemma2_tiny(tiny, tp):
    plan = build_plan(open_source(str(tiny("gemma2"))).checkpoint, Layout(tp=tp))
    s = shapes(plan, tp - 1)
    # no lm_head module: the embedding keeps its key; 4 norms + qkv + o + 4 buffers + 2 MLP
    assert "lm_head.weight" not in s
    assert s["model.embed_tokens.weight"] == ("BF16", (1024 // tp, 64))
    assert len(s) == 2 + 4 * 12
    for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        assert s[f"model.layers.0.{n}_layernorm.weight"] == ("BF16", (64,))
    kv = 2 // tp if tp <= 2 else 1
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == ("BF16", ((8 // tp + 2 * kv) * 32, 64))


def test_gemma_norms_stored_raw(tiny, tmp_path):
    src = tiny("gemma3")
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    with safe_open(str(tmp_path / "out" / "model-rank-1-part-0.safetensors"), "pt") as h:
        for k in ("model.layers.2.pre_feedforward_layernorm.weight", "model.layers.2.self_attn.q_norm.weight"):
            assert torch.equal(h.get_tensor(k), hf[k])  # GemmaRMSNorm: vLLM adds the 1 at run time


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gemma3_tiny_tied(tiny, tp):
    plan = build_plan(open_source(str(tiny("gemma3"))).checkpoint, Layout(tp=tp))
    t = rank(plan, 0)
    assert "model.embed_tokens.weight" not in t
    assert t["lm_head.weight"].shape == (1024 // tp, 64)
    assert t["lm_head.weight"].pieces[0].source == "model.embed_tokens.weight"
    assert t["model.layers.3.self_attn.q_norm.weight"].shape == (32,)
    assert t["model.layers.3.self_attn.k_norm.weight"].shape == (32,)
    assert len(t) == 2 + 4 * 14


def test_gemma_top_on_every_pp_stage(tiny):
    for arch, head in (("gemma2", "model.embed_tokens.weight"), ("gemma3", "lm_head.weight")):
        plan = build_plan(open_source(str(tiny(arch))).checkpoint, Layout(tp=2, pp=2))
        for p in (0, 1):
            s = shapes(plan, 1, p)
            assert head in s and "model.norm.weight" in s, (arch, p)


# ---- Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint) ------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_phi3_fused_split_with_global_sizes(tiny, tp):
    plan = build_plan(open_source(str(tiny("phi3"))).checkpoint, Layout(tp=tp))
    nh, nkv, hd, inter = 8, 2, 32, 128
    for r in range(tp):
        t = rank(plan, r)
        qkv = t["model.layers.1.self_attn.qkv_proj.weight"]
        q, k, v = qkv.pieces
        assert {p.source for p in qkv.pieces} == {"model.layers.1.self_attn.qkv_proj.weight"}
        qn = nh * hd // tp
        s = r // (tp // nkv) if tp >= nkv else r
        kn = max(1, nkv // tp) * hd
        assert rows(q) == (r * qn, (r + 1) * qn)
        assert rows(k) == (nh * hd + s * kn, nh * hd + (s + 1) * kn)
        assert rows(v) == ((nh + nkv) * hd + s * kn, (nh + nkv) * hd + (s + 1) * kn)
        assert qkv.shape == (qn + 2 * kn, 64)
        gate, up = t["model.layers.1.mlp.gate_up_proj.weight"].pieces
        n = inter // tp
        assert (rows(gate), rows(up)) == ((r * n, (r + 1) * n), (inter + r * n, inter + (r + 1) * n))


def test_phi3_files_equal_torch_slicing(tiny, tmp_path):
    """The streamed bytes against an independent reading of vLLM's _load_fused_module_from_checkpoint."""
    src = tiny("phi3")
    save(str(src), tmp_path / "out", tp=4, max_part_size=DEFAULT_MAX_PART, chunk_bytes=1000)
    hf = load_source(src, open_source(str(src)).checkpoint)
    w = hf["model.layers.2.self_attn.qkv_proj.weight"]
    q, k, v = w.split([256, 64, 64])
    gu = hf["model.layers.2.mlp.gate_up_proj.weight"]
    g, u = gu.chunk(2)
    for r in range(4):
        with safe_open(str(tmp_path / "out" / f"model-rank-{r}-part-0.safetensors"), "pt") as h:
            s = r // 2  # 4 ranks, 2 KV heads
            want = torch.cat([q.chunk(4)[r], k.chunk(2)[s], v.chunk(2)[s]])
            assert torch.equal(h.get_tensor("model.layers.2.self_attn.qkv_proj.weight"), want)
            want = torch.cat([g.chunk(4)[r], u.chunk(4)[r]])
            assert torch.equal(h.get_tensor("model.layers.2.mlp.gate_up_proj.weight"), want)


@pytest.mark.parametrize(
    "arch, tp, ep",
    [
        ("deepseek-v3", 2, False),
        ("deepseek-v3", 4, True),
        ("deepseek-v3-fp8", 4, False),
        ("gemma2", 2, False),
        ("gemma3", 4, False),
        ("phi3", 2, False),
        ("deepseek-v2-lite", 2, False),
    ],
)
def test_streamed_files_equal_plan(tiny, tmp_path, arch, tp, ep):
    assert_streamed_files_equal_plan(tiny(arch, shards=2), tmp_path / "out", tp=tp, ep=ep)


def test_deepseek_bias_written_float32(tiny, tmp_path):
    src = tiny("deepseek-v3")
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    with safe_open(str(tmp_path / "out" / "model-rank-1-part-0.safetensors"), "pt") as h:
        b = h.get_tensor("model.layers.1.mlp.experts.gate.e_score_correction_bias")
    want = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert b.dtype == torch.float32 and torch.equal(b, want.float()) and want.abs().sum() > 0


# ---- headers only: DeepSeek-V3 (671B, block FP8) and fused-FP8 Phi-3 -----------------------------

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def _headers(specs, config) -> Checkpoint:
    tensors, off = {}, 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * ITEMSIZE[dtype]
        tensors[name] = TensorInfo(name, dtype, tuple(shape), "model.safetensors", off, n)
        off += n
    return Checkpoint(None, config, tensors, ["model.safetensors"], {"path": "synthetic"})


def deepseek_headers(config: dict, layers: int | None = None) -> Checkpoint:
    """DeepSeek-V3's HF tensor names (block FP8 where the official checkpoint has it)."""
    c = config
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk, rope, kvl = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
    n = c["num_hidden_layers"] if layers is None else layers
    bn, bk = c["quantization_config"]["weight_block_size"]
    out = []

    def lin(name, o, i):
        out.append((name + ".weight", "F8_E4M3", (o, i)))
        out.append((name + ".weight_scale_inv", "F32", (-(-o // bn), -(-i // bk))))

    def layer(p, moe):
        out.extend(
            [(p + "input_layernorm.weight", "BF16", (h,)), (p + "post_attention_layernorm.weight", "BF16", (h,))]
        )
        a = p + "self_attn."
        lin(a + "q_a_proj", c["q_lora_rank"], h)
        out.append((a + "q_a_layernorm.weight", "BF16", (c["q_lora_rank"],)))
        lin(a + "q_b_proj", nh * qk, c["q_lora_rank"])
        lin(a + "kv_a_proj_with_mqa", kvl + rope, h)
        out.append((a + "kv_a_layernorm.weight", "BF16", (kvl,)))
        lin(a + "kv_b_proj", nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), kvl)
        lin(a + "o_proj", h, nh * c["v_head_dim"])
        if moe:
            i = c["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", "BF16", (c["n_routed_experts"], h)))
            out.append((p + "mlp.gate.e_score_correction_bias", "F32", (c["n_routed_experts"],)))
            for e in range(c["n_routed_experts"]):
                lin(p + f"mlp.experts.{e}.gate_proj", i, h)
                lin(p + f"mlp.experts.{e}.up_proj", i, h)
                lin(p + f"mlp.experts.{e}.down_proj", h, i)
            si = i * c["n_shared_experts"]
            lin(p + "mlp.shared_experts.gate_proj", si, h)
            lin(p + "mlp.shared_experts.up_proj", si, h)
            lin(p + "mlp.shared_experts.down_proj", h, si)
        else:
            lin(p + "mlp.gate_proj", c["intermediate_size"], h)
            lin(p + "mlp.up_proj", c["intermediate_size"], h)
            lin(p + "mlp.down_proj", h, c["intermediate_size"])

    freq = c.get("moe_layer_freq", 1)
    for L in range(n):
        layer(f"model.layers.{L}.", c["first_k_dense_replace"] <= L and L % freq == 0)
    for L in range(n, n + c.get("num_nextn_predict_layers", 0)):  # MTP: a full layer + its extras
        p = f"model.layers.{L}."
        layer(p, True)
        out += [(p + "embed_tokens.weight", "BF16", (c["vocab_size"], h)), (p + "enorm.weight", "BF16", (h,))]
        out += [(p + "hnorm.weight", "BF16", (h,)), (p + "shared_head.norm.weight", "BF16", (h,))]
        out += [(p + "shared_head.head.weight", "BF16", (c["vocab_size"], h))]
        lin(p + "eh_proj", h, 2 * h)
    out += [("model.embed_tokens.weight", "BF16", (c["vocab_size"], h)), ("model.norm.weight", "BF16", (h,))]
    out.append(("lm_head.weight", "BF16", (c["vocab_size"], h)))
    return _headers(out, {**c, "num_hidden_layers": n})


def test_deepseek_v3_671b_fp8_tp8_from_headers():
    plan = build_plan(deepseek_headers(DEEPSEEK_V3, layers=5), Layout(tp=8))
    s = shapes(plan, 7)
    a, m = "model.layers.4.self_attn.", "model.layers.4.mlp.experts."
    assert s[a + "fused_qkv_a_proj.weight"] == ("F8_E4M3", (2112, 7168))
    assert s[a + "fused_qkv_a_proj.weight_scale_inv"] == ("F32", (17, 56))  # 12 + 5 rows
    assert s[a + "mla_attn.q_b_proj.weight"] == ("F8_E4M3", (3072, 1536))
    assert s[a + "mla_attn.q_b_proj.weight_scale_inv"] == ("F32", (24, 12))
    assert s[a + "kv_b_proj.weight"] == ("F8_E4M3", (4096, 512))
    assert s[a + "mla_attn.o_proj.weight"] == ("F8_E4M3", (7168, 2048))
    assert s[a + "mla_attn.o_proj.weight_scale_inv"] == ("F32", (56, 16))
    assert s[m + "gate.weight"] == ("BF16", (256, 7168))
    assert s[m + "gate.e_score_correction_bias"] == ("F32", (256,))
    assert s[m + "routed_experts.w13_weight"] == ("F8_E4M3", (256, 512, 7168))
    assert s[m + "routed_experts.w13_weight_scale_inv"] == ("F32", (256, 4, 56))
    assert s[m + "routed_experts.w2_weight_scale_inv"] == ("F32", (256, 56, 2))
    assert s[m + "_shared_experts._layer.gate_up_proj.weight"] == ("F8_E4M3", (512, 7168))
    assert s[m + "_shared_experts._layer.down_proj.weight_scale_inv"] == ("F32", (56, 2))
    assert s["model.layers.2.mlp.gate_up_proj.weight_scale_inv"] == ("F32", (36, 56))  # dense: 2 x 2304 rows
    assert s["lm_head.weight"] == ("BF16", (16160, 7168))
    # 3 top + 5 layers x 16 (norms, MLA, buffers) + 3 dense x 4 + 2 MoE x 10; no kv-scale params
    assert len(s) == 3 + 5 * 16 + 3 * 4 + 2 * 10
    kv_a = rank(plan, 7)[a + "fused_qkv_a_proj.weight_scale_inv"].pieces
    assert [rows(p) for p in kv_a] == [(0, 12), (0, 5)]


def test_deepseek_moe_layer_freq():
    cfg = {**DEEPSEEK_V3, "first_k_dense_replace": 1, "moe_layer_freq": 2, "n_routed_experts": 4}
    plan = build_plan(deepseek_headers(cfg, layers=5), Layout(tp=2))
    s = shapes(plan, 0)
    moe = {L for L in range(5) if f"model.layers.{L}.mlp.experts.gate.weight" in s}
    dense = {L for L in range(5) if f"model.layers.{L}.mlp.gate_up_proj.weight" in s}
    assert moe == {2, 4} and dense == {0, 1, 3}


def test_deepseek_without_noaux_tc_has_no_correction_bias():
    cfg = {**DEEPSEEK_V3, "topk_method": "group_limited_greedy", "n_routed_experts": 4, "first_k_dense_replace": 0}
    ckpt = deepseek_headers(cfg, layers=1)
    for name in [n for n in ckpt.tensors if n.endswith("e_score_correction_bias")]:
        del ckpt.tensors[name]
    s = shapes(build_plan(ckpt, Layout(tp=2)), 0)
    assert "model.layers.0.mlp.experts.gate.weight" in s
    assert not any(k.endswith("e_score_correction_bias") for k in s)


def _phi3_fp8_headers(*, block: bool, static: bool = False) -> Checkpoint:
    h, nh, nkv, hd, inter, v = 256, 4, 2, 128, 512, 1000
    out = [("model.embed_tokens.weight", "BF16", (v, h)), ("model.norm.weight", "BF16", (h,))]
    out.append(("lm_head.weight", "BF16", (v, h)))
    p = "model.layers.0."
    out += [(p + "input_layernorm.weight", "BF16", (h,)), (p + "post_attention_layernorm.weight", "BF16", (h,))]
    for name, o, i in (
        ("self_attn.qkv_proj", (nh + 2 * nkv) * hd, h),
        ("self_attn.o_proj", h, nh * hd),
        ("mlp.gate_up_proj", 2 * inter, h),
        ("mlp.down_proj", h, inter),
    ):
        out.append((p + name + ".weight", "F8_E4M3", (o, i)))
        if block:
            out.append((p + name + ".weight_scale_inv", "F32", (-(-o // 128), -(-i // 128))))
        else:
            out.append((p + name + ".weight_scale", "F32", ()))
            if static:
                out.append((p + name + ".input_scale", "F32", ()))
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if block:
        qc["weight_block_size"] = [128, 128]
    cfg = {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": h,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,  # not hidden_size / heads: vLLM builds q/k/v with this
        "num_hidden_layers": 1,
        "vocab_size": v,
        "torch_dtype": "bfloat16",
        "quantization_config": qc,
    }
    return _headers(out, cfg)


def test_phi3_per_tensor_fp8_scale_fills_every_slot():
    plan = build_plan(_phi3_fp8_headers(block=False, static=True), Layout(tp=2))
    t = rank(plan, 1)
    for name, n in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2), ("self_attn.o_proj", 1)):
        for param in ("weight_scale", "input_scale"):
            out = t[f"model.layers.0.{name}.{param}"]
            assert out.shape == (n,)
            assert [p.source for p in out.pieces] == [f"model.layers.0.{name}.{param}"] * n


def test_phi3_block_fp8_fused_scales():
    plan = build_plan(_phi3_fp8_headers(block=True), Layout(tp=4))
    for r in range(4):
        t = rank(plan, r)
        qkv = t["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        assert qkv.shape == (3, 2)  # q, k, v: one 128-row block each
        s = r // 2
        assert [rows(p) for p in qkv.pieces] == [(r, r + 1), (4 + s, 5 + s), (6 + s, 7 + s)]
        gu = t["model.layers.0.mlp.gate_up_proj.weight_scale_inv"]
        assert [rows(p) for p in gu.pieces] == [(r, r + 1), (4 + r, 5 + r)]


def test_phi3_block_fp8_slot_off_the_block_grid_refused():
    ckpt = _phi3_fp8_headers(block=True)
    # 96-dim heads: k starts at row 384 (a block boundary), v at 576 (not one)
    ckpt.config = {**ckpt.config, "hidden_size": 256, "head_dim": 96}
    qkv = ckpt.tensors["model.layers.0.self_attn.qkv_proj.weight"]
    ckpt.tensors[qkv.name] = TensorInfo(qkv.name, qkv.dtype, (768, 256), qkv.file, qkv.offset, qkv.nbytes)
    s = ckpt.tensors["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    ckpt.tensors[s.name] = TensorInfo(s.name, s.dtype, (6, 2), s.file, s.offset, s.nbytes)
    with pytest.raises(UnsupportedError, match="not on an FP8 block boundary"):
        build_plan(ckpt, Layout(tp=1))


def test_vocab_padding_rows_zero_for_new_archs(tiny):
    plan = build_plan(open_source(str(tiny("gemma2"))).checkpoint, Layout(tp=4))
    emb = rank(plan, 3)["model.embed_tokens.weight"]
    real, pad = emb.pieces
    assert rows(real) == (768, 1000) and isinstance(pad, Fill) and pad.count == 24 * 64
