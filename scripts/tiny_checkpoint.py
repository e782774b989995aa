#!/usr/bin/env python
"""Build tiny random Hugging Face checkpoints for reshard's tests.

    python scripts/tiny_checkpoint.py ARCH OUT_DIR [--seed N] [--shards N]
    python scripts/tiny_checkpoint.py --list

or, from Python::

    from tiny_checkpoint import make_tiny
    make_tiny("qwen3-moe", tmp_path / "src", shards=3)

Every checkpoint is built with transformers (``AutoConfig.for_model`` +
``AutoModelForCausalLM.from_config``), every parameter is re-drawn from a
generator seeded by ``(seed, parameter name)`` so that nothing is trivially
zero or one, and the result is written in bfloat16 safetensors.  The
``qwen3-moe-fp8`` checkpoint is then quantised to block FP8 (128x128) the way
the official Qwen FP8 checkpoints are and written with ``safetensors`` directly.

Shapes are chosen so that vLLM's CPU build can also *run* the models: its
attention backend only accepts head sizes >= 32 (``CPUAttentionBackend.
get_supported_head_sizes``), so every model has head_dim 32 (128 for the FP8
one, like Qwen3-235B).  vLLM's Qwen2/Qwen2-MoE ignore ``config.head_dim`` and
use ``hidden_size // num_attention_heads``; those two therefore have
hidden_size 128 and 4 heads while the others keep hidden_size 64, 8 heads
(2 KV heads everywhere, so T=4 replicates KV heads) and an explicit
head_dim of 32 (so ``num_heads * head_dim != hidden_size`` is exercised too).
The vocabulary (1000) is not a multiple of 64, so vLLM pads it.

Works with transformers 5.19 (.venv-vllm) and 5.24 (.venv).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 1000
NUM_LAYERS = 4
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    num_hidden_layers=NUM_LAYERS,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class Arch:
    """One tiny architecture: transformers ``model_type`` + config overrides."""

    model_type: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict)
    fp8: bool = False  # quantise to block FP8 after building (qwen3-moe-fp8)
    moe: bool = False
    # config.json says tie_word_embeddings but the checkpoint also carries its own,
    # different lm_head.weight (vLLM's default loader then unties, config/model.py
    # maybe_untie_word_embeddings; a sharded_state copy must say untied)
    extra_lm_head: bool = False
    mtp: bool = False  # append a DeepSeek-style MTP layer (vLLM's main model skips it)
    keep_none: tuple[str, ...] = ()  # config keys passed as an explicit None

    def config_kwargs(self) -> dict[str, Any]:
        kw = dict(_COMMON)
        kw.update(self.config)
        kw = {k: v for k, v in kw.items() if v is not None or k in self.keep_none}
        return kw


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied": Arch("llama", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-tied-lmhead": Arch("llama", "LlamaForCausalLM", dict(tie_word_embeddings=True), extra_lm_head=True),
    "mistral": Arch("mistral", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # vLLM's qwen2.py uses hidden_size // num_heads as head_dim: 128 / 4 = 32.
    "qwen2": Arch(
        "qwen2",
        "Qwen2ForCausalLM",
        dict(hidden_size=128, num_attention_heads=4, head_dim=None, tie_word_embeddings=False),
    ),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-moe": Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        dict(
            tie_word_embeddings=False,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
        moe=True,
    ),
    # Mixtral's experts use intermediate_size.
    "mixtral": Arch(
        "mixtral",
        "MixtralForCausalLM",
        dict(
            tie_word_embeddings=False,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
        moe=True,
    ),
    "qwen2-moe": Arch(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=4,
            head_dim=None,
            tie_word_embeddings=False,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        ),
        moe=True,
    ),
    # Shaped like Qwen3-235B-A22B-FP8 scaled down: head_dim 128 so that q/k/v
    # parts are block multiples at T<=4; moe_intermediate 384 gives a per-rank
    # Ip of 384 (T1, EP), 192 (T2 -> 64x64 refinement) and 96 (T4 -> 32x32);
    # dense intermediate 512 keeps every dense shard 128-aligned up to T4.
    # 3 layers (layer 0 dense) and 4 experts keep the file at ~4.5 MB.
    "qwen3-moe-fp8": Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=512,
            moe_intermediate_size=384,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        fp8=True,
        moe=True,
    ),
    # MLA with kv_lora_rank 512 + rope 64: the only latent size vLLM's CPU MLA
    # decode kernel runs.  noaux_tc (fp32 e_score_correction_bias), one shared
    # expert, layer 0 dense, one MTP layer (model.layers.4.*) as in V3.
    "deepseek-v3": Arch(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=None,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            tie_word_embeddings=False,
        ),
        moe=True,
        mtp=True,
    ),
    # Block FP8 like DeepSeek-V3: fused_qkv_a_proj [128 | 576] (the second part
    # not a block multiple); 8 heads of 64+64 / 64 keep q_b, kv_b and o_proj
    # shards 128-aligned up to T4; 2 shared experts of 256 (512 = 128 per rank
    # at T4); routed Ip 256/128/64 (T4 refines the MoE scales to 64x64).
    "deepseek-v3-fp8": Arch(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=None,
            intermediate_size=512,
            moe_intermediate_size=256,
            num_hidden_layers=3,
            n_routed_experts=4,
            n_shared_experts=2,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            tie_word_embeddings=False,
        ),
        fp8=True,
        moe=True,
    ),
    # V2-Lite: no q_lora_rank (kv_a_proj_with_mqa + q_proj), greedy top-k (no
    # correction bias), 2 shared experts.
    "deepseek-v2-lite": Arch(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=None,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=2,
            n_group=1,  # as DeepSeek-V2-Lite; vLLM's CPU grouped top-k needs both
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            topk_method="greedy",
            tie_word_embeddings=False,
        ),
        moe=True,
        keep_none=("q_lora_rank",),
    ),
    # Gemma 2: tied, no lm_head tensor; soft-capping and sliding window kept.
    "gemma2": Arch(
        "gemma2",
        "Gemma2ForCausalLM",
        dict(query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True),
    ),
    # Gemma 3 text model (model_type gemma3_text): tied, q/k norms, every
    # other layer sliding.
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        dict(
            query_pre_attn_scalar=32,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
            tie_word_embeddings=True,
        ),
    ),
    # Phi-3: the checkpoint stores fused qkv_proj and gate_up_proj.
    "phi3": Arch("phi3", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    # Block FP8 of the fused tensors: head_dim 128 puts q/k/v and gate/up on
    # the 128-row block grid (as in Phi-3-mini: 3072 = 24 x 128).
    "phi3-fp8": Arch(
        "phi3",
        "Phi3ForCausalLM",
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=512,
            num_hidden_layers=2,
            tie_word_embeddings=False,
        ),
        fp8=True,
    ),
}

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


# --------------------------------------------------------------------------- #
# weights
# --------------------------------------------------------------------------- #
def _generator(seed: int, arch: str, name: str) -> torch.Generator:
    # Seeded per (seed, arch, name): independent of parameter order, so the
    # same checkpoint comes out of transformers 5.19 and 5.24, and llama and
    # mistral (same tensor names) still differ.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{arch}/{name}".encode()))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, arch: str) -> None:
    for name, p in model.named_parameters():
        g = _generator(seed, arch, name)
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name and p.dim() == 1:
            val = 1.0 + 0.1 * noise  # RMSNorm weights: around one, never exactly
        elif "embed_tokens" in name:
            # small next to the layers' outputs, so that a tied lm_head does
            # not just echo the last input token
            val = 0.1 * noise
        elif p.dim() == 1:
            val = 0.1 * noise  # biases
        else:
            fan_in = p.shape[-1]
            val = noise / math.sqrt(fan_in)
        p.copy_(val.to(p.dtype))
    # Buffers (rotary inv_freq) are not persistent and never saved, except
    # DeepSeek-V3's router correction bias.
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            g = _generator(seed, arch, name)
            b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=torch.float32))


def _build_model(name: str, arch: Arch, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch.model_type, **arch.config_kwargs())
    config.architectures = [arch.architecture]
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed, name)
    model = model.to(torch.bfloat16)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


# --------------------------------------------------------------------------- #
# FP8
# --------------------------------------------------------------------------- #
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_block_fp8(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise a 2-D weight: returns (fp8 weight, scale_inv [cdiv(o,bn), cdiv(i,bk)]).

    ``w ~= weight.float() * scale_inv`` blockwise, ``scale = amax / 448``.
    """
    bn, bk = block
    out, inp = w.shape
    w = w.float()
    ro, ri = _cdiv(out, bn), _cdiv(inp, bk)
    padded = torch.zeros(ro * bn, ri * bk, dtype=torch.float32)
    padded[:out, :inp] = w
    blocks = padded.view(ro, bn, ri, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [ro, ri]
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    s = scale.float()[:, None, :, None]
    q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).view(ro * bn, ri * bk)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def _fp8_skip(name: str, gate_fp8: bool) -> bool:
    """True for weights that stay bf16 in the official Qwen FP8 checkpoints."""
    if not name.endswith(".weight"):
        return True
    mod = name[: -len(".weight")]
    if mod == "lm_head" or mod.endswith("embed_tokens") or "norm" in mod:
        return True
    return bool(mod.endswith(".mlp.gate") and not gate_fp8)


def _to_fp8_state(sd: dict[str, torch.Tensor], config: dict, *, gate_fp8: bool, scale_dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if t.dim() == 2 and not _fp8_skip(name, gate_fp8):
            q, s = quantize_block_fp8(t, FP8_BLOCK, scale_dtype)
            out[name] = q
            out[name + "_scale_inv"] = s
        else:
            out[name] = t
    not_convert = ["lm_head"]
    for i in range(config["num_hidden_layers"]):
        not_convert.append(f"model.layers.{i}.input_layernorm")
        if _is_moe_layer(config, i) and not gate_fp8:
            not_convert.append(f"model.layers.{i}.mlp.gate")
        not_convert.append(f"model.layers.{i}.post_attention_layernorm")
    not_convert.append("model.norm")
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "modules_to_not_convert": not_convert,
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    return out


def _add_mtp_layer(sd: dict[str, torch.Tensor], config: dict, seed: int, arch: str) -> None:
    """DeepSeek-V3's multi-token-prediction layer, ``model.layers.<num_hidden_layers>.*``:
    a copy of the last decoder layer plus enorm/hnorm/eh_proj/embed_tokens/shared_head.
    transformers does not build it; vLLM's main model skips it when loading."""
    n = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = 1
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for k in [k for k in sd if k.startswith(last)]:
        sd[mtp + k[len(last) :]] = sd[k].clone()
    h = config["hidden_size"]
    extra = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
    }
    for k, shape in extra.items():
        noise = torch.randn(shape, generator=_generator(seed, arch, mtp + k))
        sd[mtp + k] = (1.0 + 0.1 * noise if len(shape) == 1 else noise / math.sqrt(shape[-1])).to(torch.bfloat16)
    sd[mtp + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[mtp + "shared_head.head.weight"] = sd["lm_head.weight"].clone()


def _is_moe_layer(config: dict, i: int) -> bool:
    if i in (config.get("mlp_only_layers") or []):
        return False
    n = config.get("num_experts") or config.get("num_local_experts") or 0
    step = config.get("decoder_sparse_step", 1) or 1
    return n > 0 and (i + 1) % step == 0


# --------------------------------------------------------------------------- #
# files
# --------------------------------------------------------------------------- #
def _write_weights(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int) -> list[Path]:
    """Write ``model.safetensors`` or N shards + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    meta = {"format": "pt"}
    if shards <= 1:
        path = out_dir / "model.safetensors"
        save_file(tensors, str(path), metadata=meta)
        return [path]
    # contiguous runs of sorted keys with about equal bytes, so that the
    # q/k/v or the experts of one layer may straddle two files
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    total = sum(sizes.values())
    target = total / shards
    groups: list[list[str]] = [[]]
    acc = 0
    for k in tensors:
        if acc >= target * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(k)
        acc += sizes[k]
    while len(groups) < shards:  # tiny inputs: split the largest group
        big = max(range(len(groups)), key=lambda i: len(groups[i]))
        g = groups.pop(big)
        groups[big:big] = [g[: len(g) // 2], g[len(g) // 2 :]]
    n = len(groups)
    weight_map: dict[str, str] = {}
    paths = []
    for i, keys in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(out_dir / fname), metadata=meta)
        weight_map.update({k: fname for k in keys})
        paths.append(out_dir / fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``<pad> <s> </s> <unk> t4 ... t999``. Offline, ~30 KB."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        return
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=256,
    )
    fast.save_pretrained(str(out_dir))


def _legacy_config(cfg: dict) -> dict:
    """Rewrite transformers-5 config keys the way most Hub checkpoints spell them."""
    cfg = dict(cfg)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters", None)
    if isinstance(rope, dict):
        if "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
    if cfg.get("model_type") in ("qwen3_moe", "qwen2_moe") and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    return cfg


def make_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    shards: int = 1,
    tokenizer: bool = True,
    legacy_config: bool | None = None,
    gate_fp8: bool = False,
    scale_dtype: str = "float32",
) -> Path:
    """Build tiny random checkpoint ``arch`` (a key of ``ARCHS``) into ``out_dir``.

    shards: >1 writes ``model-0000i-of-0000N.safetensors`` + index.
    tokenizer: also write a word-level ``tokenizer.json`` (+ config).
    legacy_config: write config.json with Hub-style keys (``torch_dtype``,
        ``rope_theta``, ``num_experts``) instead of transformers-5 ones.
        Default: True for the FP8 checkpoint (mirrors Qwen3-235B-A22B-FP8),
        False otherwise.
    gate_fp8: (FP8 only) do not list the router gates in
        ``modules_to_not_convert``, so they are quantised too.
    scale_dtype: (FP8 only) ``float32`` or ``bfloat16`` for ``weight_scale_inv``.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    spec = ARCHS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        stale.unlink()
    if legacy_config is None:
        legacy_config = spec.fp8

    from safetensors.torch import load_file

    model = _build_model(arch, spec, seed)
    with tempfile.TemporaryDirectory(prefix="tiny-ckpt-") as tmp:
        # Let transformers name the tensors (it converts its fused MoE experts
        # back to the per-expert checkpoint layout on save).
        model.save_pretrained(tmp, safe_serialization=True)
        tmpp = Path(tmp)
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(tmpp.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        cfg = json.loads((tmpp / "config.json").read_text())
        gen = tmpp / "generation_config.json"
        if gen.exists():
            shutil.copy(gen, out / "generation_config.json")
    del model

    if spec.extra_lm_head and "lm_head.weight" not in sd:
        emb = sd["model.embed_tokens.weight"]
        g = _generator(seed, arch, "lm_head.weight")
        sd["lm_head.weight"] = (torch.randn(emb.shape, generator=g) / math.sqrt(emb.shape[1])).to(emb.dtype)
    for k, v in sd.items():
        if k.endswith("e_score_correction_bias"):
            sd[k] = v.float()  # float32, as in the DeepSeek-V3 checkpoints
        elif v.is_floating_point() and v.dtype != torch.bfloat16:
            sd[k] = v.to(torch.bfloat16)
    if spec.mtp:
        _add_mtp_layer(sd, cfg, seed, arch)
    if spec.fp8:
        sd = _to_fp8_state(sd, cfg, gate_fp8=gate_fp8, scale_dtype=getattr(torch, scale_dtype))
    if legacy_config:
        cfg = _legacy_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _write_weights(sd, out, shards)
    if tokenizer:
        _write_tokenizer(out, cfg["vocab_size"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", nargs="?", choices=list(ARCHS))
    ap.add_argument("out_dir", nargs="?", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="split into N files + index")
    ap.add_argument("--no-tokenizer", action="store_true")
    ap.add_argument(
        "--legacy-config",
        action="store_true",
        default=None,
        help="Hub-style config keys (torch_dtype, rope_theta, num_experts)",
    )
    ap.add_argument("--gate-fp8", action="store_true", help="FP8: quantise the router gate too")
    ap.add_argument("--scale-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--list", action="store_true", help="list the architectures")
    a = ap.parse_args(argv)
    if a.list:
        for k, v in ARCHS.items():
            print(f"{k:15s} {v.architecture}")
        return 0
    if a.arch is None or a.out_dir is None:
        ap.error("ARCH and OUT_DIR are required")
    path = make_tiny(
        a.arch,
        a.out_dir,
        seed=a.seed,
        shards=a.shards,
        tokenizer=not a.no_tokenizer,
        legacy_config=a.legacy_config,
        gate_fp8=a.gate_fp8,
        scale_dtype=a.scale_dtype,
    )
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"{a.arch}: wrote {path} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
