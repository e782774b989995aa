"""The cases of the vLLM suite (test_vllm.py): each a tiny checkpoint (`arch`, with `+format` for a
quantized copy) and a layout, grouped by the issue that added them. STATE_CASES are compared byte for byte
with vLLM's per-rank state, GEN_CASES' greedy tokens with the default loader's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard.layout import Layout

DENSE = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-fp8"]
MOE = ["qwen3-moe", "mixtral", "qwen2-moe", "qwen3-moe-fp8", "deepseek-v3", "deepseek-v3-fp8", "deepseek-v2-lite"]
HYBRID = ["qwen3-next", "qwen3.5-moe", "qwen3-next-fp8"]  # gated delta net + full attention, MoE (issue 15)


@dataclass(frozen=True)
class Case:
    """A source (arch, split into `shards` files) and the Layout reshard writes and vLLM builds for it.
    `layout.moe_backend` is vLLM's --moe-backend, forced in the harness (vllm_patches.force_moe_backend)."""

    arch: str
    layout: Layout
    shards: int = 1  # source checkpoint split into N files + model.safetensors.index.json

    @property
    def id(self) -> str:
        lay = self.layout
        s = f"{self.arch}-tp{lay.tp}"
        s += "-ep" if lay.ep else ""
        s += f"-pp{lay.pp}" if lay.pp > 1 else ""
        s += f"-{self.shards}files" if self.shards > 1 else ""
        s += f"-{lay.dtype}" if lay.dtype != "auto" else ""
        s += f"-{lay.moe_backend}" if lay.moe_backend != "auto" else ""
        s += f"-{lay.platform}" if lay.platform else ""  # issue 27
        s += f"-mm{lay.mm_encoder_tp_mode}" if lay.mm_encoder_tp_mode else ""  # issue 27
        s += "-lmonly" if lay.language_model_only else ""
        return s

    @property
    def src_key(self) -> tuple[str, int]:
        return (self.arch, self.shards)

    def reshard_args(self, src: Path, out: Path) -> list[str]:
        lay = self.layout
        args = ["save", str(src), str(out), "--tp", str(lay.tp), "--overwrite"]
        if lay.ep:
            args.append("--ep")
        if lay.pp > 1:
            args += ["--pp", str(lay.pp)]
        if lay.dtype != "auto":
            args += ["--dtype", lay.dtype]
        if lay.moe_backend != "auto":
            args += ["--moe-backend", lay.moe_backend]
        if lay.platform:  # issue 27: DSA key names per vLLM platform
            args += ["--platform", lay.platform]
        if lay.mm_encoder_tp_mode:  # issue 27
            args += ["--mm-encoder-tp-mode", lay.mm_encoder_tp_mode]
        if lay.language_model_only:
            args.append("--language-model-only")
        if self.arch == "kimi-k2":  # its tokenizer is tokenization_kimi.py: copied only when asked
            args.append("--trust-remote-code")
        return args

    def marks(self) -> list[pytest.MarkDecorator]:
        m = []
        if self.arch.split("+")[0] in MOE + HYBRID:
            m.append(pytest.mark.moe)
        if any(f in self.arch for f in ("+ct-w", "nvfp4", "+gptq", "+awq")):  # issue 26: integer and FP4 formats
            m.append(pytest.mark.intquant)
        elif "fp8" in self.arch or "+ct" in self.arch:
            m.append(pytest.mark.fp8)
        if self.layout.ep:
            m.append(pytest.mark.ep)
        if self.layout.pp > 1:
            m.append(pytest.mark.pp)
        return m


def case(
    arch: str,
    tp: int,
    *,
    ep: bool = False,
    pp: int = 1,
    shards: int = 1,
    dtype: str = "auto",
    moe_backend: str = "auto",
    platform: str | None = None,
    mm: str | None = None,
    lm_only: bool = False,
) -> Case:
    lay = Layout(
        tp, pp, ep, dtype, None, moe_backend, platform=platform, mm_encoder_tp_mode=mm, language_model_only=lm_only
    )
    return Case(arch, lay, shards)


STATE_CASES: list[Case] = (
    [case(a, t) for a in DENSE for t in (1, 2, 4)]
    + [case(a, t) for a in MOE for t in (1, 2, 4)]
    + [case(a, t, ep=True) for a in MOE for t in (2, 4)]
    + [
        # sharded source checkpoints (index.json), tensors of one layer straddling files
        case("qwen3", 2, shards=3),
        case("qwen3-moe-fp8", 2, shards=3),
        # pipeline parallel: model-pp-<p>-tp-<r>-part-*.safetensors
        case("llama-tied", 2, pp=2),
        case("qwen3-moe", 2, pp=2),
        case("qwen3-moe-fp8", 1, pp=2),
        case("deepseek-v3", 1, pp=2),
        case("gemma2", 1, pp=2),
        case("gemma3", 1, pp=2),
        case("phi3", 1, pp=2),
        # dtype override
        case("qwen2", 2, dtype="float16"),
        # FP8 as quantization tools write it (tests/fixtures/quant.py): per-tensor Fp8Config,
        # compressed-tensors per-channel and per-tensor
        case("llama+fp8-tensor", 2),
        case("phi3+fp8-tensor-static", 1),  # one scale of a fused tensor fills every slot
        case("phi3+fp8-tensor-static", 4),
        case("llama+fp8-tensor-static", 4),
        case("qwen3-moe+fp8-tensor-static", 2),
        case("llama+ct-channel", 2),
        case("llama+ct-tensor", 4),
        case("qwen3-moe+ct-channel", 2),
        case("qwen3-moe+ct-channel", 2, ep=True),
        case("qwen3-moe+ct-tensor", 2),
        # FP8 KV-cache scales in every naming vLLM 0.32 loads (tests/fixtures/quant.py KV_NAMINGS, one
        # per layer): dense: the default .{q,k,v}_scale, ModelOpt {k,v}_proj.{k,v}_scale (+ attn.q_scale),
        # qkv_proj.{k,v}_scale, {k,v,q}_proj.output_scale + prob_output_scale; MoE: the same in reverse
        # with the deprecated .kv_scale (k only); compressed-tensors kv_cache_scheme tensor (with
        # q_scale and zero points) and attn_head (per-head k/v, KV heads replicated at TP 4).
        # MLA (DeepSeek): vLLM drops them at load (no KV-cache scale parameters); so does reshard
        case("deepseek-v3+fp8-tensor-kv-mla", 2),
        case("llama+fp8-tensor-kv", 2),
        case("qwen3-moe+fp8-tensor-kv-alt", 2),
        case("llama+ct-tensor-kv", 2),
        case("llama+ct-channel-kv-head", 4),
        # config says tied, checkpoint has its own lm_head: vLLM unties (config/model.py
        # maybe_untie_word_embeddings), so OUT's config.json must say untied
        case("llama-tied-lmhead", 2),
        # --moe-backend layouts (vLLM's create_weights and loaders, backend selection forced): block FP8
        # with a backend that takes only whole 128-blocks pads the TP shard (TP 2: 192 -> 256, rank 1
        # half real; TP 4: 96 -> 128, rank 3 all zeros and 1.0 scales); bf16 with Blackwell's FlashInfer
        # TRT-LLM rounds the per-rank size up to 128 (16 -> 128, up rows at 128)
        case("qwen3-moe-fp8", 2, moe_backend="deep_gemm"),
        case("qwen3-moe-fp8", 4, moe_backend="deep_gemm"),
        case("qwen3-moe", 2, moe_backend="flashinfer_trtllm"),
    ]
)

# Qwen3-Next / Qwen3.5-MoE (issue 15): a representative set, one vLLM process per source. The gated
# delta net's split (conv1d and in_proj_qkv pieces, per-head A_log/dt_bias) at TP 1, 2 and 4, EP,
# PP (embed_tokens on every stage; lm_head too for Qwen3-Next, last stage only for Qwen3.5).
# (Also seen identical, left out to keep the suite's time: qwen3-next TP 1, qwen3.5-moe TP 2, FP8 TP 1.)
STATE_CASES += [
    case("qwen3-next", 2),
    case("qwen3-next", 4, ep=True),
    case("qwen3-next", 1, pp=2),
    case("qwen3.5-moe", 4),  # KV heads replicated; vLLM builds the vision tower's TP split, then drops it
    case("qwen3.5-moe", 2, ep=True),
    case("qwen3.5-moe", 1, pp=2),
    # block FP8 (in_proj_ba, router and shared_expert_gate bf16); TP 2 refines the experts' blocks
    case("qwen3-next-fp8", 2),
    case("qwen3-next-fp8", 2, ep=True),
    # no shared expert (size 0): its gate alone, handed to the fused-MoE runner (Qwen2-MoE: under mlp.)
    case("qwen3-next-noshared", 2),
    case("qwen2-moe-noshared", 2),
]
MOE += ["qwen3-next-noshared", "qwen2-moe-noshared"]  # marks only

# Generation: what the CPU build can run (no PP, no EP MoE, no refined-FP8 MoE).
GEN_CASES: list[Case] = [case(a, 2) for a in DENSE if "fp8" not in a] + [
    case("llama-tied-lmhead", 2),
    case("qwen3-moe", 2),
    case("mixtral", 2),
    case("qwen2-moe", 2),
    case("qwen3-moe-fp8", 1),  # per-rank block stays 128x128 only at T=1 (or EP)
    case("deepseek-v3", 2),  # MLA runs on the CPU_MLA backend
    case("deepseek-v2-lite", 2),
]
# CPU gated-delta-net kernels run head dims 64/128; Qwen3.5 served --language-model-only. (qwen3-next TP 2
# also generates the same tokens from both loaders; left out to keep the suite's time.)
GEN_CASES += [case("qwen3.5-moe", 2)]


# gpt-oss (issue 15): bf16 (experts transposed from [E, in, out]) and the released MXFP4 format.
# MXFP4 allocations depend on the MoE backend; reshard writes Triton's and pins it. This CPU has no
# MXFP4 kernel (the CPU backend needs AMX), so the MXFP4 cases force the backend's selection in the
# harness (vllm_patches.force_moe_backend) and check vLLM's create_weights + loader: Triton (T2 96
# -> 128; T4 48 -> 64 with rank 3 all padding; EP) and Marlin (hidden 64 -> 256 too). bf16 at T4 (48
# per rank) is not built by the CPU build (its MoE kernel needs per-rank sizes divisible by 32). TP 1
# cases (gpt-oss, +mxfp4, llama4) passed too and were left out to keep the suite's time down.
STATE_CASES += [
    case("gpt-oss", 2),
    case("gpt-oss", 2, ep=True),
    case("gpt-oss", 1, pp=2),
    case("gpt-oss+mxfp4", 2, moe_backend="triton"),
    case("gpt-oss+mxfp4", 4, moe_backend="triton"),
    case("gpt-oss+mxfp4", 2, ep=True, moe_backend="triton"),
    case("gpt-oss+mxfp4", 2, moe_backend="marlin"),
]
GEN_CASES += [case("gpt-oss", 2)]
# Llama-4 text (Llama4ForConditionalGeneration, served --language-model-only: the vision tower is skipped)
STATE_CASES += [
    case("llama4", 2),
    case("llama4", 4),
    case("llama4", 2, ep=True),
    case("llama4", 2, pp=2),
    case("llama4-text", 2),  # Llama4ForCausalLM: the text model alone (model.*, no text_config)
    case("llama4-e3", 2, ep=True),  # 3 fused experts over 2 ranks: vLLM's linear placement, 2 then 1
]
GEN_CASES += [case("llama4", 2)]
MOE += ["llama4", "llama4-e3"]
MOE.append("gpt-oss")  # marks only (the generic MOE cases above are built already)

# issue 15: GLM-4.5/4.6 MoE, MiniMax-M2 (bf16 and the released block FP8), Kimi-K2 (DeepSeek-V3 with
# model_type kimi_k2 and remote-code side files). A representative set, one vLLM process per source:
# GLM at TP 2, TP 4 + EP (KV heads replicated) and PP 2 (embedding first, norm/lm_head last, MTP
# layer skipped); MiniMax at TP 4 (k_norm shards replicated on two ranks each); MiniMax FP8 at TP 2
# (MoE blocks refined to 64x64) and TP 2 + EP; Kimi at TP 2 + EP. GLM generates at TP 2; MiniMax
# does not generate on this CPU build (softmax-only CPU router; no CPU FP8 MoE backend).
STATE_CASES += [
    case("glm4-moe", 2),
    case("glm4-moe", 4, ep=True),
    case("glm4-moe", 1, pp=2),
    case("minimax-m2", 4),
    case("minimax-m2-fp8", 2),
    case("minimax-m2-fp8", 2, ep=True),
    case("kimi-k2", 2, ep=True),
]
GEN_CASES += [case("glm4-moe", 2)]
MOE += ["glm4-moe", "minimax-m2", "minimax-m2-fp8", "kimi-k2"]  # marks only: cases are listed above

# issue 26: compressed-tensors' integer formats as llm-compressor writes them (tests/fixtures/intquant.py),
# one vLLM process per source. W4A16 (4-bit, groups of 16) asymmetric: zero points packed along N, cut
# per shard of qkv/gate_up at TP 2 and 4 (k/v replicated), by groups in row layers; experts N-first with
# w*_weight_shape in bf16, TP 2, EP, PP; per-channel scales (whole in row layers) on Qwen3. W8A8-int8
# with per-tensor weight scales and static asymmetric inputs (the last shard's input_scale and
# input_zero_point) dense; per-channel weights with dynamic tokens on MoE. CPU vLLM has no integer MoE
# backend: the harness falls back to Marlin / Triton (vllm_patches.allow_wna16_moe), only the selection.
STATE_CASES += [
    case("llama+ct-w4a16-asym", 2),
    case("llama+ct-w4a16-asym", 4),
    case("llama+ct-w4a16-asym", 1, pp=2),
    case("qwen3+ct-w4a16-channel", 2),
    case("qwen3-moe+ct-w4a16-asym", 2),
    case("qwen3-moe+ct-w4a16-asym", 2, ep=True),
    case("qwen3-moe+ct-w4a16-asym", 2, pp=2),
    # the config group's targets narrowed (vLLM builds what they do not match unquantized), and the experts
    # ignored by an entry below their module (matched against expert 0's projections)
    case("llama+ct-w4a16-asym-tgt-attn", 2),
    case("qwen3-moe+ct-w4a16-asym-tgt-moe", 2),
    case("qwen3-moe+ct-w4a16-asym-ign-moe", 2, ep=True),
    case("llama+ct-w8a8-static", 2),
    case("llama+ct-w8a8-static", 4),
    case("qwen3-moe+ct-w8a8", 2),
    case("qwen3-moe+ct-w8a8", 2, ep=True),
    case("qwen3-moe+ct-w8a8", 1, pp=2),
    # Kimi-K2-Thinking's layout: INT4 g32 routed experts only (its ignore list), MLA attention bf16; TP 2
    # alone cuts a group (I_p 16), which vLLM refuses as reshard does
    case("deepseek-v3+ct-w4a16-g32-experts", 2, ep=True),
]
GEN_CASES += [case("llama+ct-w4a16-asym", 2), case("llama+ct-w8a8-static", 2)]

# issue 26: ModelOpt FP8 as NVIDIA's ModelOpt export writes it (tests/fixtures/modelopt.py), one vLLM process
# per source. FP8 per-tensor (weight and static input scale per shard slot, FP8 KV-cache scales named
# k_proj.k_scale / v_proj.v_scale) with the config in hf_quant_config.json only (Llama) or in config.json
# (Qwen3-MoE: per-tensor experts [E, 2] / [E]); FP8_PER_CHANNEL_PER_TOKEN (1-D [N_p] scales) on Llama;
# FP8_PB_WO (4-D [N_p / 128, 1, K_p / 128, 1] block scales) on a 256-wide Llama. ModelOpt's linear
# method picks its FP8 GEMM kernel while building: where this CPU has none the harness lets it build
# (vllm_patches.allow_missing_fp8_linear_kernel), only the kernel.
STATE_CASES += [
    case("llama+mo-fp8", 2),
    case("llama+mo-fp8", 4),
    case("llama+mo-fp8", 1, pp=2),
    case("qwen3-moe+mo-fp8-cfg", 2),
    case("qwen3-moe+mo-fp8-cfg", 2, ep=True),
    case("qwen3-moe+mo-fp8-cfg", 2, pp=2),
    case("llama+mo-fp8-pc", 2),
    case("llama+mo-fp8-pc", 4),
    case("llama-256+mo-fp8-pb", 2),
    case("llama-256+mo-fp8-pb", 4),
]
# tokens: FP8_PB_WO only; per-tensor FP8's static input scales need `_C::static_scaled_fp8_quant`, which the
# CPU build of vLLM 0.32 does not have (the engine fails to start, with or without reshard)
GEN_CASES += [case("llama-256+mo-fp8-pb", 2)]

# issue 26: NVFP4 as llm-compressor (compressed-tensors nvfp4-pack-quantized, W4A4 with `dynamic: "local"`
# inputs, and NVFP4A16) and ModelOpt (quant_algo NVFP4; W4A16 when no group quantizes inputs; -hfq: config
# in hf_quant_config.json only) write it (tests/fixtures/nvfp4.py), one vLLM process per source. vLLM CPU
# has no NVFP4 kernel: the harness replaces only init_nvfp4_linear_kernel / select_nvfp4_moe_backend
# (vllm_patches.allow_nvfp4). ModelOpt experts under EP: input scales of every expert with FlashInfer
# backends (what reshard's auto writes and pins), the rank's own with Marlin. State only: CPU vLLM cannot
# generate NVFP4.
STATE_CASES += [
    case("llama+ct-nvfp4", 2),
    case("llama+ct-nvfp4", 4),
    case("llama+ct-nvfp4", 1, pp=2),
    case("qwen3+ct-nvfp4a16", 2),
    case("qwen3+ct-nvfp4a16", 1, pp=2),
    case("qwen3-moe+ct-nvfp4", 2),
    case("qwen3-moe+ct-nvfp4", 2, ep=True),
    case("qwen3-moe+ct-nvfp4", 1, pp=2),
    case("qwen3-moe+ct-nvfp4a16", 2, ep=True),
    case("llama+mo-nvfp4", 2),
    case("llama+mo-nvfp4", 4),
    case("llama+mo-nvfp4", 1, pp=2),
    case("qwen3+mo-nvfp4a16", 4),
    case("qwen3-moe+mo-nvfp4", 2),
    case("qwen3-moe+mo-nvfp4", 2, ep=True, moe_backend="flashinfer_trtllm"),  # what auto writes and pins
    case("qwen3-moe+mo-nvfp4", 2, ep=True, moe_backend="marlin"),
    case("qwen3-moe+mo-nvfp4", 1, pp=2),
    case("qwen3-moe+mo-nvfp4a16", 2, ep=True),
    case("qwen3-moe+mo-nvfp4-hfq", 2),
    # DeepSeek-V3 (MLA: fused_qkv_a_proj of q_a_proj and kv_a_proj_with_mqa, replicated; kv_b_proj, o_proj)
    case("deepseek-v3+ct-nvfp4", 2),
    case("deepseek-v3+mo-nvfp4", 2, ep=True, moe_backend="flashinfer_trtllm"),
]

# issue 27: DSA / text-only families (tests/fixtures/tiny.py), one vLLM process per source. DeepSeek-V3.2 and
# GLM-5 on this CPU are vLLM's generic deepseek_v2 class: reshard's `--platform cpu` output is compared as
# is; its default (CUDA-named, models/deepseek_v32/nvidia) output through the documented renaming
# (test_dsa_cuda_names_after_renaming). Qwen3_5MoeForCausalLM: text model under model.*, no tower.
# GLM-4.7-Flash: DeepSeek MLA + GLM-4.5 MoE.
STATE_CASES += [
    case("deepseek-v32", 2, platform="cpu"),
    case("deepseek-v32", 2, ep=True, platform="cpu"),
    case("deepseek-v32", 1, pp=2, platform="cpu"),
    case("glm5", 4, platform="cpu"),
    # block FP8 as released: wq_b with its scales, the FP8 wk dequantised as vLLM's loader does
    case("deepseek-v32-fp8", 2, platform="cpu"),
    case("qwen3.5-moe-text", 2),
    case("qwen3.5-moe-text", 4, ep=True),
    case("qwen3.5-moe-text", 1, pp=2),
    case("glm4.7-flash", 2),
    case("glm4.7-flash", 4, ep=True),
    case("glm4.7-flash", 1, pp=2),
]
GEN_CASES += [case("qwen3.5-moe-text", 2), case("glm4.7-flash", 2)]
MOE += ["deepseek-v32", "deepseek-v32-fp8", "glm5", "qwen3.5-moe-text", "glm4.7-flash"]  # marks only
DSA_CUDA_CASES = [case("deepseek-v32", 2), case("glm5", 4)]  # compared with the cpu cases' dumps

# issue 26: GPTQ / AWQ as AutoGPTQ and AutoAWQ write them (tests/fixtures/gptq.py), one vLLM process per
# source. K-first int32 packing: GPTQ qweight [K / 8, N] (4-bit, groups of 32; 8-bit and channelwise
# with row-parallel scales whole), AWQ [K, N / 8]; a merged layer's shards side by side in columns, k/v
# replicated at TP 4. Experts in Marlin's K-first layout with zero w13_bias / w2_bias (qwen3-moe-wide:
# hidden 128, whole groups per rank, so vLLM's own check picks Marlin; only the CPU kernel choice is
# forced, vllm_patches.allow_wna16_moe).
STATE_CASES += [
    case("llama+gptq", 2),
    case("llama+gptq", 4),
    case("llama+gptq", 1, pp=2),
    # lm_head: true: vLLM's ParallelLMHead with the GPTQ method, split over a vocabulary it need not pad
    case("llama-v1024+gptq-lmhead", 2),
    case("llama-v1024+gptq-lmhead", 1, pp=2),
    case("qwen3+gptq-channel", 2),
    case("qwen3+gptq-b8", 2),
    case("llama+awq", 2),
    case("llama+awq", 4),
    case("qwen3-moe-wide+gptq", 2),
    case("qwen3-moe-wide+gptq", 2, ep=True),
    case("qwen3-moe-wide+gptq", 1, pp=2),
    case("qwen3-moe-wide+awq", 2),
    case("qwen3-moe-wide+awq", 2, ep=True),
    # group 64, 32 intermediate rows per rank: vLLM's own check picks MoeWNA16Method (uint8, N-first, scales
    # repeated to group 32); with EP (64 rows) Marlin's
    case("qwen3-moe-wide+gptq-g64", 2),
    case("qwen3-moe-wide+gptq-g64", 2, ep=True),
]
GEN_CASES += [case("llama+gptq", 2), case("llama+awq", 2)]
MOE += ["qwen3-moe-wide"]  # marks only

# issue 27: vision towers (tests/fixtures/tiny.py, the releases' tensor names), one vLLM process per source.
# Qwen2.5-VL: the tower TP-sharded (--mm-encoder-tp-mode weights, vLLM's default) at TP 2, 4 and PP 2 (on
# every stage), whole on every rank (data) at TP 2, and left out (--language-model-only) at TP 2.
STATE_CASES += [
    case("qwen2.5-vl", 2),
    case("qwen2.5-vl", 4),
    case("qwen2.5-vl", 2, pp=2),
    case("qwen2.5-vl", 2, mm="data"),
    case("qwen2.5-vl", 2, lm_only=True),
    # Qwen3-VL: LayerNorms with bias, pos_embed and the Conv3d bias whole, deepstack mergers split
    case("qwen3-vl", 2),
    case("qwen3-vl", 4),
    case("qwen3-vl", 2, pp=2),
    # Qwen3-VL-MoE: the checkpoint's fused experts [E, in, out] transposed and halved (gate, up), TP 2 and EP
    case("qwen3-vl-moe", 2),
    case("qwen3-vl-moe", 2, ep=True),
    case("qwen3-vl-moe", 2, pp=2),
]
# Gemma-3: the SigLIP tower split (q/k/v stacked, biases), the projector's nn.Parameter replicated; vLLM's
# Gemma3 has no data mode
STATE_CASES += [case("gemma3-mm", 2), case("gemma3-mm", 4), case("gemma3-mm", 2, pp=2)]
# Qwen3.5-MoE: text-only by default as before; its Qwen3-VL tower with an explicit mode
STATE_CASES += [case("qwen3.5-moe", 2, mm="weights"), case("qwen3.5-moe", 2, ep=True, mm="data")]
# Llama-4: text-only by default as before; the tower with an explicit mode (the projector split in both)
STATE_CASES += [case("llama4", 2, mm="weights"), case("llama4", 2, mm="data")]
MOE.append("qwen3-vl-moe")  # marks only
# no GEN_CASES: CPU vLLM builds these models' processors (image processor, preprocessor_config.json) for
# its profiling, and they need torchvision, which this CPU build lacks (the stub serves the model code only)

# issue 26: other MoE families, one vLLM process per source (tests/fixtures/intquant.py, nvfp4.py on the
# issue-15 tiny archs). Mixtral (block_sparse_moe w1/w3/w2, intermediate 64: 32 per rank at TP 2) in W4A16
# symmetric groups of 32 and NVFP4; GLM-4.5 MoE (layer 0 dense, shared expert, q/k/v bias kept bf16, router
# and e_score_correction_bias whole) in W4A16 asymmetric groups of 16 and NVFP4; MiniMax-M2 NVFP4 under EP; Qwen3-Next NVFP4.
# TP 2 and TP 2 + EP each; the harness forces only the CPU kernel choice as for qwen3-moe above (and, for GLM's
# shared-expert down_proj with 16 inputs per rank, the WNA16 linear's: vllm_patches.allow_small_wna16_linear).
STATE_CASES += [
    case("mixtral+ct-w4a16-g32", 2),
    case("mixtral+ct-w4a16-g32", 2, ep=True),
    case("mixtral+ct-nvfp4", 2),
    case("mixtral+ct-nvfp4", 2, ep=True),
    case("glm4-moe+ct-w4a16-asym", 2),
    case("glm4-moe+ct-w4a16-asym", 2, ep=True),
    case("glm4-moe+ct-nvfp4", 2),
    case("glm4-moe+ct-nvfp4", 2, ep=True),
    case("minimax-m2+ct-nvfp4", 2, ep=True),
    # Qwen3-Next: every Linear NVFP4 but the router and shared_expert_gate (gated delta net in_proj_qkvz / in_proj_ba and out_proj, gated
    # full attention, shared expert; conv1d bf16)
    case("qwen3-next+ct-nvfp4", 2),
    case("qwen3-next+ct-nvfp4", 2, ep=True),
]

# issue 27: Kimi-K2.5 (KimiK25ForConditionalGeneration, tests/fixtures/kimi25.py: the release's names), one vLLM
# process per source. MoonViT's wqkv / wo / fc0 / fc1 split (weights, vLLM's default) at TP 2, 4, with EP and
# PP 2 (on every stage); whole on every rank with data; left out with --language-model-only; 3 vision heads at
# TP 2: vLLM's fallback builds the tower whole (is_vit_use_data_parallel). INT4 as released (compressed-tensors
# W4A16 g32 routed experts, quantization_config in text_config, the tower built without it) at TP 2 and with EP;
# the harness lets only the CPU MoE kernel choice fall back (vllm_patches.allow_wna16_moe), as for Kimi-K2-Thinking.
STATE_CASES += [
    case("kimi-k2.5", 2),
    case("kimi-k2.5", 4),
    case("kimi-k2.5", 2, ep=True),
    case("kimi-k2.5", 2, pp=2),
    case("kimi-k2.5", 2, mm="data"),
    case("kimi-k2.5", 2, lm_only=True),
    case("kimi-k2.5-h3", 2),
    case("kimi-k2.5-v2", 2),  # the encoder variants: RMSNorms, no biases, the patchmergerv2 projector
    case("kimi-k2.5-int4", 2),
    case("kimi-k2.5-int4", 2, ep=True),
]
MOE += ["kimi-k2.5", "kimi-k2.5-h3", "kimi-k2.5-v2", "kimi-k2.5-int4"]  # marks only

# text_config says tied, the top level untied, and the checkpoint has its own lm_head: Qwen3.5 ties by its text
# config (vLLM leaves the lm_head tied: the checkpoint's unused), Qwen3-VL by the top level (untied); a probe of
# option combinations found reshard untying the first (2026-12-07).
STATE_CASES += [case("qwen3.5-moe-tied", 2), case("qwen3.5-moe-tied", 1, pp=2), case("qwen3-vl-tied", 2)]
MOE += ["qwen3.5-moe-tied"]  # marks only

# Eight ranks, the layout the README's pre-bake uses (--tp 8, with EP): KV heads replicated 4x (8 heads, 2 KV),
# experts cut in 8 (Ip 4), experts dealt 1 per rank, and TP 4 x PP 2. Sources built above; one batch of
# 8-rank vLLM processes. (Also seen identical by hand, 2026-12-06: mistral, qwen3, phi3, gemma2, gemma3 and
# qwen3-moe at TP 8, DeepSeek-V3 with 8 heads at TP 8 with and without EP, mixtral TP 8 + EP, Llama FP8
# per-tensor and compressed-tensors at TP 8, block FP8 Qwen3-MoE with 8 heads and 8 experts at TP 2 x PP 2 + EP;
# block FP8 at TP 8 with a per-rank input of 64 is refused by vLLM and reshard alike.)
STATE_CASES += [
    case("llama", 8),
    case("qwen3-moe", 8, ep=True),
    case("mixtral", 8),
    case("qwen3-moe", 4, ep=True, pp=2),
    # vision heads 4 at TP 8: vLLM builds the encoder even with --language-model-only and cannot split its heads;
    # the serve line adds --mm-encoder-tp-mode data (reshard.plan.towers), which the harness then passes to vLLM
    case("qwen2.5-vl", 8, lm_only=True),
    case("llama4", 8),  # text-only by default
    case("qwen2.5-vl-i34", 4, lm_only=True),  # the vision MLP width 34: data mode pinned for another reason
]

# Layouts vLLM cannot build, which reshard must refuse (exit 3) instead of writing them, each with what vLLM
# says: all were written before 2026-12-06, when a sweep of layouts against vLLM found them
# (test_refusals_agree_with_vllm builds each in vLLM).
REFUSED_CASES: list[tuple[Case, str]] = [
    (case("qwen3-moe", 2, pp=3), "No Qwen3MoE layer found"),  # stage 0 holds only the dense layer 0
    (case("glm4-moe", 1, pp=4), "No Glm4MoE layer found"),  # first_k_dense_replace 1, likewise
    (case("qwen3-vl-moe", 8, lm_only=True), "greater than the number of experts"),  # 4 experts
    (case("gemma3-mm", 8, lm_only=True), "is not divisible by 8"),  # SigLIP's 4 heads, built even text-only
    (case("gemma3", 2, dtype="float16"), "does not support float16"),  # _FLOAT16_NOT_SUPPORTED_MODELS
    (case("qwen3-moe-fp8", 1, dtype="float32"), "not supported for quantization method fp8"),
]
