"""Llama-4's vision tower and projector (vLLM mllama4.py; issue 27), opt-in beside the text model.

`Llama4ForConditionalGeneration` folders were written text-only (`--language-model-only`, its
serve_flags) before the tower had rules, and stay so by default; `--mm-encoder-tp-mode weights|data`
writes the tower too. vLLM builds it without the quant config (`quant_config=None`):
- `vision_model.patch_embedding.linear`: the unfold convolution's ColumnParallelLinear (no bias,
  gather_output: the weight still split by output rows);
- `class_embedding` [hidden] and `positional_embedding_vlm` [patches + 1, hidden]: plain parameters,
  `layernorm_pre` / `layernorm_post` LayerNorms (weight and bias): whole on every rank;
- encoder layers `vision_model.model.layers.{i}`: q/k/v stacked into `self_attn.qkv_proj` (bias; no
  rotary reordering, unlike the text model), `o_proj` (row, bias), `mlp.fc1` (column, bias) /
  `mlp.fc2` (row, bias), LayerNorms;
- `vision_adapter.mlp.fc1` / `fc2` (the pixel-shuffle MLP; bias per `multi_modal_projector_bias`).
With `data` every one of those is whole (ReplicatedLinear, q/k/v concatenated). The projector
`multi_modal_projector.linear_1` is a ColumnParallelLinear without `disable_tp`: split in both modes.
"""

from dataclasses import replace

from reshard.rules.llama import HIDDEN
from reshard.rules.llama4 import LLAMA4
from reshard.rules.spec import Blocks, Tower
from reshard.rules.styles import QKV, Column, Replicate, Row, layer_norm

VM = "vision_model."


LLAMA4_VISION = Tower(
    config="vision_config",
    top=(
        Column(VM + "patch_embedding.linear", dims=("hidden_size", None)),
        Replicate(VM[:-1], param="class_embedding", shape=HIDDEN),
        Replicate(VM[:-1], param="positional_embedding_vlm", shape=(None, "hidden_size")),  # [patches + 1, hidden]
        *layer_norm(VM + "layernorm_pre"),
        *layer_norm(VM + "layernorm_post"),
        Column(VM + "vision_adapter.mlp.fc1", bias="multi_modal_projector_bias"),
        Row(VM + "vision_adapter.mlp.fc2", bias="multi_modal_projector_bias", dims=("projector_output_dim", None)),
    ),
    blocks=(
        Blocks(
            VM + "model.layers.{layer}.",
            (
                *layer_norm("input_layernorm"),
                *layer_norm("post_attention_layernorm"),
                QKV("self_attn.qkv_proj", bias=True, dims=(None, "hidden_size")),
                Row("self_attn.o_proj", bias=True),
                Column("mlp.fc1", bias=True, dims=("intermediate_size", "hidden_size")),
                Row("mlp.fc2", bias=True, dims=("hidden_size", "intermediate_size")),
            ),
            "num_hidden_layers",
        ),
    ),
    skip=("vision_model.",),
    heads="num_attention_heads",
)

# the projector: split across the TP ranks whatever the encoder's mode
LLAMA4_PROJECTOR = Tower(
    config="vision_config",
    top=(Column("multi_modal_projector.linear_1", dims=(None, "vision_output_dim")),),
    blocks=(),
    skip=("multi_modal_projector.",),
    heads="num_attention_heads",
    split_in_data_mode=True,
)

LLAMA4_VL = replace(LLAMA4, towers=(LLAMA4_VISION, LLAMA4_PROJECTOR))
