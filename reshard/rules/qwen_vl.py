"""Qwen vision-language models with their vision towers (vLLM qwen2_5_vl.py, qwen3_vl.py).

Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the language model is vLLM's Qwen2 under
`language_model.` (`language_model.model.*`, `language_model.lm_head`); the releases name it `model.*`
and `lm_head` (newer exports `model.language_model.*`), the tower `visual.*` (or `model.visual.*`):
vLLM's `hf_to_vllm_mapper` maps every spelling (qwen2_5_vl.py `Qwen2_5_VLForConditionalGeneration`).

The tower (`Qwen2_5_VisionTransformer`, sizes in config.json's `vision_config`): a Conv3d patch
embedding (a plain parameter, whole on every rank), `depth` blocks of RMSNorm `norm1`/`norm2`, a fused
`attn.qkv` (QKVParallelLinear over `num_heads` heads, the checkpoint's q/k/v stacked in one tensor with
its bias), `attn.proj` (row-parallel, bias), and a gated MLP `mlp.gate_up_proj` (gate_proj + up_proj,
bias) / `mlp.down_proj` (row, bias); the merger's RMSNorm `ln_q`, `mlp.0` (column, bias) and `mlp.2`
(row, bias, out to the text width). Every linear is TP-sharded with `--mm-encoder-tp-mode weights`
and whole with `data` (reshard.plan.towers).
"""

from dataclasses import replace

from reshard.rules.llama import HIDDEN, MAPPER, MLP, QWEN2_ATTENTION, QWEN3_ATTENTION
from reshard.rules.moe import sparse_layer
from reshard.rules.qwen3_next import QWEN3_5_MOE
from reshard.rules.spec import Architecture, Blocks, Tower, WeightsMapper
from reshard.rules.styles import QKV, Column, FusedExperts, Merged, Replicate, Row, Vocab, layer_norm

LM = "language_model.model."

# vLLM qwen2_5_vl.py Qwen2_5_VLForConditionalGeneration.hf_to_vllm_mapper (prefixes) over Qwen2's stacking
QWEN2_5_VL_MAPPER = MAPPER | WeightsMapper(
    orig_to_new_prefix={
        "model.language_model.": "language_model.model.",
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.": "language_model.model.",
    }
)

VIS = "visual."
VISION_UP = ("intermediate_size", "hidden_size")
PATCH = ("hidden_size", "in_channels", "temporal_patch_size", "patch_size", "patch_size")  # the Conv3d's weight

QWEN2_5_VISION = Tower(
    device_normalize=True,  # supports_mm_device_do_normalize (tower_pins)
    config="vision_config",
    top=(
        Replicate(VIS + "patch_embed.proj", shape=PATCH),  # Conv3d [hidden, C, t, p, p], no bias
        Replicate(VIS + "merger.ln_q", shape=HIDDEN),
        Column(VIS + "merger.mlp.0", bias=True),
        Row(VIS + "merger.mlp.2", bias=True, dims=("out_hidden_size", None)),
    ),
    blocks=(
        Blocks(
            VIS + "blocks.{layer}.",
            (
                Replicate("norm1", shape=HIDDEN),
                Replicate("norm2", shape=HIDDEN),
                QKV("attn.qkv", bias=True, fused=("q", "k", "v"), dims=(None, "hidden_size")),
                Row("attn.proj", bias=True),
                Merged("mlp.gate_up_proj", bias=True, dims=VISION_UP),
                Row("mlp.down_proj", bias=True, dims=("hidden_size", "intermediate_size")),
            ),
            "depth",
        ),
    ),
    skip=("visual.", "model.visual."),
)

QWEN2_5_VL = Architecture(
    names=("Qwen2_5_VLForConditionalGeneration",),
    hf_to_vllm=QWEN2_5_VL_MAPPER,
    top=(
        Vocab(LM + "embed_tokens"),
        Replicate(LM + "norm", shape=HIDDEN),
        Vocab("language_model.lm_head", tied=LM + "embed_tokens"),
    ),
    layer=QWEN2_ATTENTION,
    dense_mlp=MLP,
    layer_prefix=LM + "layers.{layer}.",
    embedding=LM + "embed_tokens",
    lm_head="language_model.lm_head",
    text_config="text_config",
    towers=(QWEN2_5_VISION,),
)

# Qwen3-VL (`Qwen3VLForConditionalGeneration`, vLLM qwen3_vl.py): the language model is vLLM's Qwen3 under
# `language_model.` (checkpoint `model.language_model.*`, `lm_head`), the tower `model.visual.*`. The tower
# (`Qwen3_VisionTransformer`): a Conv3d patch embedding with bias and a learned `pos_embed` (nn.Embedding),
# both whole on every rank; blocks of LayerNorm `norm1`/`norm2` (weight and bias), the fused `attn.qkv`
# and `attn.proj` as Qwen2.5-VL's, an MLP `mlp.linear_fc1` (column, bias) / `mlp.linear_fc2` (row, bias);
# the merger (LayerNorm `norm`, `linear_fc1` column, `linear_fc2` row) and one deepstack merger per
# `deepstack_visual_indexes` entry, built alike (its norm over the merged width).
QWEN3_VL_MAPPER = MAPPER | WeightsMapper(
    orig_to_new_prefix={
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
    }
)


def _merger(prefix: str, norm: tuple[str | None, ...]) -> tuple:
    """Qwen3_VisionPatchMerger: its LayerNorm over the tower's width, or the deepstack mergers' over
    the merged width (hidden_size x spatial_merge_size^2, use_postshuffle_norm; left unchecked)."""
    return (
        *layer_norm(prefix + "norm", norm),
        Column(prefix + "linear_fc1", bias=True),
        Row(prefix + "linear_fc2", bias=True, dims=("out_hidden_size", None)),
    )


def _deepstack(config: dict) -> int:
    return len(config.get("deepstack_visual_indexes") or [])


QWEN3_VISION = Tower(
    device_normalize=True,  # supports_mm_device_do_normalize (tower_pins)
    config="vision_config",
    top=(
        Replicate(VIS + "patch_embed.proj", shape=PATCH),  # Conv3d [hidden, C, t, p, p] with its bias
        Replicate(VIS + "patch_embed.proj", param="bias", shape=HIDDEN),
        # nn.Embedding [num_position_embeddings, hidden]: not a vocab split
        Replicate(VIS + "pos_embed", shape=("num_position_embeddings", "hidden_size")),
        *_merger(VIS + "merger.", HIDDEN),
    ),
    blocks=(
        Blocks(
            VIS + "blocks.{layer}.",
            (
                *layer_norm("norm1"),
                *layer_norm("norm2"),
                QKV("attn.qkv", bias=True, fused=("q", "k", "v"), dims=(None, "hidden_size")),
                Row("attn.proj", bias=True),
                Column("mlp.linear_fc1", bias=True, dims=VISION_UP),
                Row("mlp.linear_fc2", bias=True, dims=("hidden_size", "intermediate_size")),
            ),
            "depth",
        ),
        Blocks(VIS + "deepstack_merger_list.{layer}.", _merger("", (None,)), _deepstack),
    ),
    skip=("model.visual.",),
)

QWEN3_VL = Architecture(
    names=("Qwen3VLForConditionalGeneration",),
    hf_to_vllm=QWEN3_VL_MAPPER,
    top=QWEN2_5_VL.top,
    layer=QWEN3_ATTENTION,
    dense_mlp=MLP,
    layer_prefix=LM + "layers.{layer}.",
    embedding=LM + "embed_tokens",
    lm_head="language_model.lm_head",
    text_config="text_config",
    towers=(QWEN3_VISION,),
)

# Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, vLLM qwen3_vl_moe.py): the same tower over vLLM's
# Qwen3-MoE (`Qwen3VLMoeDecoderLayer`, `is_fused_checkpoint_transposed`): the checkpoint's experts are
# fused per layer, `mlp.experts.gate_up_proj` [E, hidden, 2I] (gate then up) and `mlp.experts.down_proj`
# [E, I, hidden], transposed and halved as Llama-4's (reshard.plan.fusedexperts); the router
# `mlp.gate` handed to the fused-MoE runner (`mlp.experts.gate`), built with the quant config.
QWEN3_VL_MOE = replace(
    QWEN3_VL,
    names=("Qwen3VLMoeForConditionalGeneration",),
    moe_mlp=(
        Replicate("mlp.experts.gate", "mlp.gate", quant=True, dims=("num_experts", "hidden_size")),
        # vLLM's Qwen3MoeSparseMoeBlock: "Tensor parallel size ... is greater than the number of experts"
        FusedExperts(
            "mlp.experts.routed_experts",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            halves=True,
            tp_at_most_experts=True,
        ),
    ),
    is_moe_layer=sparse_layer,
    top_on_every_stage=True,  # vLLM's Qwen3MoeModel builds embed_tokens, norm and lm_head on every stage
    moe_on_every_stage=True,  # "No Qwen3Moe layer found in the language_model."
)

# Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, vLLM qwen3_5.py) builds the same Qwen3_VisionTransformer
# (`model.visual.*`; deepstack mergers only where vision_config lists deepstack_visual_indexes). Its folders
# were written text-only before the tower had rules, and stay so by default (its serve_flags); the tower is
# written with an explicit --mm-encoder-tp-mode (reshard.plan.towers.resolve_mm).
QWEN3_5_MOE_VL = replace(QWEN3_5_MOE, towers=(QWEN3_VISION,))
