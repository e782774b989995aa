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

from reshard.rules.llama import MAPPER, MLP, QWEN2_ATTENTION
from reshard.rules.spec import Architecture, Tower, WeightsMapper
from reshard.rules.styles import QKV, Column, Merged, Replicate, Row, Vocab

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

QWEN2_5_VISION = Tower(
    config="vision_config",
    top=(
        Replicate(VIS + "patch_embed.proj"),  # Conv3d [hidden, C, t, p, p], no bias
        Replicate(VIS + "merger.ln_q"),
        Column(VIS + "merger.mlp.0", bias=True),
        Row(VIS + "merger.mlp.2", bias=True, dims=("out_hidden_size", None)),
    ),
    block=(
        Replicate("norm1"),
        Replicate("norm2"),
        QKV("attn.qkv", bias=True, fused=("q", "k", "v"), dims=(None, "hidden_size")),
        Row("attn.proj", bias=True),
        Merged("mlp.gate_up_proj", bias=True, dims=VISION_UP),
        Row("mlp.down_proj", bias=True, dims=("hidden_size", "intermediate_size")),
    ),
    block_prefix=VIS + "blocks.{layer}.",
    skip=("visual.", "model.visual."),
)

QWEN2_5_VL = Architecture(
    names=("Qwen2_5_VLForConditionalGeneration",),
    hf_to_vllm=QWEN2_5_VL_MAPPER,
    top=(
        Vocab(LM + "embed_tokens"),
        Replicate(LM + "norm"),
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
