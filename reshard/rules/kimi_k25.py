"""Kimi-K2.5 (`KimiK25ForConditionalGeneration`, vLLM kimi_k25.py, kimi_k25_vit.py; issue 27): the MoonViT
vision tower and its projector beside a DeepSeek-V3 language model.

The language model is vLLM's `DeepseekV2ForCausalLM` under `language_model.` (the release names it so:
`language_model.model.*`, `language_model.lm_head`; old NVFP4 exports `language_model.layers.*`, which vLLM's
mapper renames), its sizes in config.json's `text_config` (Kimi-K2's: MLA, 384 experts; the released
compressed-tensors INT4 routed experts as Kimi-K2-Thinking's, reshard.plan.intquant).

The tower (`MoonViT3dPretrainedModel`, `vision_tower.*`): a Conv2d patch embedding with bias and a learned
`pos_emb.weight` [h, w, hidden], whole on every rank; blocks `encoder.blocks.{i}` of LayerNorms `norm0` /
`norm1` (weight and bias), a fused `wqkv` (QKVParallelLinear over `num_attention_heads` heads, q/k/v stacked
in the checkpoint's one tensor, bias), `wo` (row, bias), `mlp.fc0` (column, bias) / `mlp.fc1` (row, bias);
a `final_layernorm`. The projector (`KimiK25MultiModalProjector`, `mm_projector.*`): a LayerNorm `pre_norm`
and two ReplicatedLinear `linear_1` / `linear_2` (the release's `proj.0` / `proj.2`, vLLM's mapper), whole on
every rank in every mode. With `--mm-encoder-tp-mode data`, or where the vision heads do not divide TP (vLLM's
`is_vit_use_data_parallel(num_heads)`), the blocks' linears are whole too (`disable_tp`).

Under compressed-tensors vLLM builds the tower and projector without the quant config
(`_maybe_ignore_quant_config`): the releases' INT4 ignore list need not name them.

vLLM builds its vision config with transformers' `Kimi_K25VisionConfig`, whose keys are `hidden_size`,
`num_attention_heads`, ...; the hub's config.json (its remote code's schema) spells them `vt_hidden_size`,
`vt_num_attention_heads`, ..., which that class ignores, so vLLM builds the class's defaults (those of the
release). The table reads the same keys with the same defaults (`Tower.defaults`).
"""

from dataclasses import replace

from reshard.rules.deepseek import DEEPSEEK_V2, MAPPER
from reshard.rules.llama import HIDDEN
from reshard.rules.spec import Blocks, Choice, Tower, WeightsMapper
from reshard.rules.styles import QKV, Column, Replicate, Row, Vocab, layer_norm

LM = "language_model."
VT = "vision_tower."

# vLLM kimi_k25.py KimiK25ForConditionalGeneration.hf_to_vllm_mapper (prefixes) over DeepSeek's stacking. The
# first entry maps the release's own names to themselves (vLLM keeps a name no prefix matches), so that they,
# not the old NVFP4 spelling, are the names the checkpoint is read by first (WeightsMapper.hf_names).
KIMI_K25_MAPPER = MAPPER | WeightsMapper(
    orig_to_new_prefix={
        LM + "model.": LM + "model.",
        LM + "layers.": LM + "model.layers.",
        "mm_projector.proj.0": "mm_projector.linear_1",
        "mm_projector.proj.2": "mm_projector.linear_2",
    }
)

# transformers' Kimi_K25VisionConfig defaults (5.19), which vLLM builds where config.json lacks a key, then the
# defaults of the settings vLLM's kimi_k25_vit.py reads with getattr (MoonViT3dPretrainedModel, the projector)
VISION_DEFAULTS = (
    ("hidden_size", 1152),
    ("num_attention_heads", 16),
    ("num_hidden_layers", 27),
    ("intermediate_size", 4304),
    ("norm_type", "layernorm"),
    ("attn_bias", True),
    ("linear_bias", True),
    ("patch_embed_proj_bias", True),
    ("mm_projector_type", "patchmerger"),
    ("mlp_type", "mlp2"),
    ("pos_emb_type", "divided_fixed"),
    ("merge_type", "sd2_tpool"),
    ("qkv_hidden_size", None),
)
VISION_UP = ("intermediate_size", "hidden_size")
VISION_CHOICES = (
    Choice("norm_type", ("layernorm", "rmsnorm")),  # _make_vision_norm
    Choice("mlp_type", ("mlp2",)),
    Choice("pos_emb_type", ("divided_fixed",)),
    Choice("merge_type", ("sd2_tpool",)),
    Choice("mm_projector_type", ("patchmerger", "patchmergerv2")),
    # heads of qkv_hidden_size / heads rather than hidden_size / heads: no rule here yet
    Choice("qkv_hidden_size", (None,), by="reshard", same_as="hidden_size"),
)


def _layer_norm(c: dict) -> bool:
    return c.get("norm_type") != "rmsnorm"


def _merger_v2(c: dict) -> bool:
    return c.get("mm_projector_type") == "patchmergerv2"


def _merger_v1(c: dict) -> bool:
    return not _merger_v2(c)


def _norm(name: str) -> tuple[Replicate, Replicate]:
    """`_make_vision_norm`: an nn.LayerNorm (weight and bias), or with `norm_type: rmsnorm` an nn.RMSNorm (weight)."""
    weight, bias = layer_norm(name)
    return weight, replace(bias, when=_layer_norm)


MOONVIT = Tower(
    config="vision_config",
    top=(
        # Conv2dLayer [hidden, 3, p, p] with its bias
        Replicate(VT + "patch_embed.proj", shape=("hidden_size", None, None, None)),
        Replicate(VT + "patch_embed.proj", param="bias", shape=HIDDEN, when="patch_embed_proj_bias"),
        # nn.Parameter [pos_emb_height, pos_emb_width, hidden]
        Replicate(VT + "patch_embed.pos_emb", shape=(None, None, "hidden_size")),
        *_norm(VT + "encoder.final_layernorm"),
        # KimiK25MultiModalProjector: patchmerger (the release's) or patchmergerv2, ReplicatedLinear in every mode
        *(replace(r, when=_merger_v1) for r in layer_norm("mm_projector.pre_norm")),
        Replicate("mm_projector.linear_1", bias=True, quant=True, when=_merger_v1),
        Replicate("mm_projector.linear_2", bias=True, quant=True, when=_merger_v1),
        Replicate("mm_projector.linear_1", quant=True, when=_merger_v2),
        Replicate("mm_projector.linear_2", quant=True, when=_merger_v2),
        # nn.RMSNorm over the text model's hidden size (not a key of the encoder's settings)
        Replicate("mm_projector.post_norm", shape=(None,), when=_merger_v2),
    ),
    blocks=(
        Blocks(
            VT + "encoder.blocks.{layer}.",
            (
                *_norm("norm0"),
                *_norm("norm1"),
                QKV("wqkv", bias="attn_bias", fused=("q", "k", "v"), dims=(None, "hidden_size")),
                Row("wo", bias="attn_bias"),
                Column("mlp.fc0", bias="linear_bias", dims=VISION_UP),
                Row("mlp.fc1", bias="linear_bias", dims=("hidden_size", "intermediate_size")),
            ),
            "num_hidden_layers",
        ),
    ),
    skip=(VT, "mm_projector."),
    heads="num_attention_heads",
    device_normalize=True,  # supports_mm_device_do_normalize (tower_pins)
    heads_fallback=True,
    unquantized_with=("compressed-tensors",),
    defaults=VISION_DEFAULTS,
    choices=VISION_CHOICES,
)

KIMI_K25 = replace(
    DEEPSEEK_V2,
    names=("KimiK25ForConditionalGeneration",),
    hf_to_vllm=KIMI_K25_MAPPER,
    top=(
        Vocab(LM + "model.embed_tokens"),
        Replicate(LM + "model.norm", shape=HIDDEN),
        Vocab(LM + "lm_head"),  # DeepseekV2ForCausalLM never ties it
    ),
    layer_prefix=LM + "model.layers.{layer}.",
    embedding=LM + "model.embed_tokens",
    lm_head=LM + "lm_head",
    text_config="text_config",
    towers=(MOONVIT,),
)
