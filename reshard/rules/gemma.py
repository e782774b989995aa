"""Gemma 2 and Gemma 3 text models (vLLM gemma2.py, gemma3.py).

GemmaRMSNorm weights are stored raw (vLLM adds 1 at run time). Four norms per layer. Gemma 2 has
no lm_head module at all (the logits use the embedding), so its file keeps
`model.embed_tokens.weight`; Gemma 3's lm_head is tied to the embedding by config and then kept
only as `lm_head.weight`. Embedding, norm and lm_head are built on every pipeline stage.
"""

from dataclasses import replace

from reshard.rules.llama import ATTN, DOWN, FROM_HIDDEN, HIDDEN, MAPPER, UP
from reshard.rules.spec import Architecture, Blocks, Tower, WeightsMapper
from reshard.rules.styles import QKV, Column, Merged, Replicate, Row, Vocab, layer_norm

HEAD = ("head_dim",)  # Gemma3Attention's q_norm / k_norm: GemmaRMSNorm(config.head_dim)

NORMS = (
    Replicate("input_layernorm", shape=HIDDEN),
    Replicate("post_attention_layernorm", shape=HIDDEN),
    Replicate("pre_feedforward_layernorm", shape=HIDDEN),
    Replicate("post_feedforward_layernorm", shape=HIDDEN),
)

ATTENTION = (
    QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
    Row("self_attn.o_proj", bias="attention_bias"),
)

# Gemma2MLP / Gemma3MLP: no bias
GEMMA_MLP = (
    Merged("mlp.gate_up_proj", dims=UP),
    Row("mlp.down_proj", dims=DOWN),
)

GEMMA2 = Architecture(
    names=("Gemma2ForCausalLM",),
    hf_to_vllm=MAPPER,  # vLLM gemma2.py Gemma2Model.hf_to_vllm_mapper: Llama's
    top=(Vocab("model.embed_tokens"), Replicate("model.norm", shape=HIDDEN)),
    layer=(*NORMS, *ATTENTION, ATTN),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)

GEMMA3 = Architecture(
    names=("Gemma3ForCausalLM",),
    hf_to_vllm=MAPPER,  # vLLM gemma3.py Gemma3Model.hf_to_vllm_mapper: Llama's
    top=(
        Vocab("model.embed_tokens"),
        Replicate("model.norm", shape=HIDDEN),
        Vocab("lm_head", tied="model.embed_tokens"),
    ),
    layer=(
        *NORMS,
        *ATTENTION,
        Replicate("self_attn.q_norm", shape=HEAD),
        Replicate("self_attn.k_norm", shape=HEAD),
        ATTN,
    ),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)

# issue 27: Gemma-3 with its SigLIP vision tower (vLLM gemma3_mm.py, siglip.py). The releases name the text
# model `language_model.model.*`, the tower `vision_tower.vision_model.*` and the projector
# `multi_modal_projector.*`, as vLLM does (exports after transformers 4.52 say `model.language_model.*`,
# ...: vLLM's mapper). The tower: a Conv2d patch embedding with bias and a learned position embedding
# (whole on every rank), encoder layers of LayerNorms (weight and bias), q/k/v stacked into
# `self_attn.qkv_proj` (bias), `self_attn.out_proj` (row, bias), `mlp.fc1` (column, bias) / `mlp.fc2`
# (row, bias), a final `post_layernorm`; no pooling head (vision_use_head false). The projector is a plain
# nn.Parameter `mm_input_projection_weight` [vision hidden, text hidden] and a GemmaRMSNorm, replicated.
# vLLM's Gemma3 does not support --mm-encoder-tp-mode data (it falls back to weights).
GEMMA3_MM_MAPPER = MAPPER | WeightsMapper(
    orig_to_new_prefix={
        "model.language_model.": "language_model.model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }
)
SIGLIP = "vision_tower.vision_model."
LM = "language_model."


SIGLIP_TOWER = Tower(
    config="vision_config",
    top=(
        # Conv2d [hidden, C, p, p] with its bias
        Replicate(
            SIGLIP + "embeddings.patch_embedding", shape=("hidden_size", "num_channels", "patch_size", "patch_size")
        ),
        Replicate(SIGLIP + "embeddings.patch_embedding", param="bias", shape=HIDDEN),
        Replicate(SIGLIP + "embeddings.position_embedding", shape=(None, "hidden_size")),  # [patches, hidden]
        *layer_norm(SIGLIP + "post_layernorm"),
        # [vision hidden, text hidden]: the text width is not in the tower's settings
        Replicate("multi_modal_projector", param="mm_input_projection_weight", shape=("hidden_size", None)),
        Replicate("multi_modal_projector.mm_soft_emb_norm", shape=HIDDEN),
    ),
    blocks=(
        Blocks(
            SIGLIP + "encoder.layers.{layer}.",
            (
                *layer_norm("layer_norm1"),
                *layer_norm("layer_norm2"),
                QKV("self_attn.qkv_proj", bias=True, dims=(None, "hidden_size")),
                Row("self_attn.out_proj", bias=True),
                Column("mlp.fc1", bias=True, dims=("intermediate_size", "hidden_size")),
                Row("mlp.fc2", bias=True, dims=("hidden_size", "intermediate_size")),
            ),
            "num_hidden_layers",
        ),
    ),
    skip=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    heads="num_attention_heads",
    data_mode=False,
)

GEMMA3_MM = replace(
    GEMMA3,
    names=("Gemma3ForConditionalGeneration",),
    hf_to_vllm=GEMMA3_MM_MAPPER,
    top=tuple(
        replace(m, name=LM + m.name, tied=LM + m.tied if m.tied else None)
        if isinstance(m, Vocab)
        else replace(m, name=LM + m.name)
        for m in GEMMA3.top
    ),
    layer_prefix=LM + "model.layers.{layer}.",
    embedding=LM + "model.embed_tokens",
    lm_head=LM + "lm_head",
    text_config="text_config",
    towers=(SIGLIP_TOWER,),
    tie_default=True,  # transformers' Gemma3TextConfig; google/gemma-3-*-it leave it out
)
