"""Hybrid linear-attention MoE families: Qwen3-Next and Qwen3.5-MoE (vLLM qwen3_next.py, qwen3_5.py,
layers/mamba/gdn/qwen_gdn_linear_attn.py).

Three layers in four are a gated delta net (`linear_attn`), the fourth full attention whose q_proj
also holds a per-head output gate (vLLM's QKVParallelLinear with 2 x num_attention_heads q heads:
[q_h; gate_h] per head, so a plain q split keeps heads whole). Every layer's MLP is a MoE with one
shared expert and a sigmoid shared_expert_gate.

The gated delta net's TP split (QwenGatedDeltaNetAttention.__init__):
- conv1d: ColumnParallelLinear [conv_dim, 1, kernel] whose loader (mamba_v2_sharded_weight_loader)
  splits each of the q, k, v pieces (key_dim, key_dim, value_dim rows) across ranks on its own;
- A_log (float32) and dt_bias: one value per value head, split by heads (sharded_weight_loader(0));
- out_proj: RowParallelLinear; norm: RMSNormGated over head_v_dim, whole on every rank;
- Qwen3-Next stores in_proj_qkvz and in_proj_ba fused, interleaved by key-head group, and vLLM
  builds them with ONE output size each (gqa_interleaved_layout): a plain row split;
- Qwen3.5 stores in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, fused by vLLM into in_proj_qkvz
  (output sizes key_dim, key_dim, value_dim, value_dim; in_proj_qkv is loaded with the tuple shard
  id (0, 1, 2)) and in_proj_ba ([num_v_heads] * 2): each piece split across ranks.

Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration) is a vision-language model: vLLM keeps the text
model under `language_model.` and builds the vision tower unless told --language-model-only, which
the serve line names; the tower's weights (`model.visual.*`) are not written. MTP weights (`mtp.*`)
belong to vLLM's draft model and are skipped by the main model, as here.
"""

from reshard.rules.llama import ATTN, FROM_HIDDEN, MLP, NORMS, QKV, TOP
from reshard.rules.moe import sparse_layer
from reshard.rules.spec import Architecture, Kind, Module, replicate

KEY = ("linear_num_key_heads", "linear_key_head_dim")  # key_dim
VALUE = ("linear_num_value_heads", "linear_value_head_dim")  # value_dim


def layer_type(config: dict, layer: int) -> str:
    """config.layer_types, or transformers' default: every full_attention_interval-th layer full."""
    types = config.get("layer_types")
    if types:
        return str(types[layer])
    interval = int(config.get("full_attention_interval") or 4)
    return "linear_attention" if (layer + 1) % interval else "full_attention"


# Qwen3NextAttention: gated q (2 x heads), qkv bias only with config.qkv_bias, GemmaRMSNorm q/k norms
FULL_ATTENTION = (
    Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="qkv_bias", dims=FROM_HIDDEN),
    Module("self_attn.o_proj", Kind.ROW),
    replicate("self_attn.q_norm"),
    replicate("self_attn.k_norm"),
    ATTN,
)

LA = "linear_attn."

# what both families' gated delta nets share: conv1d, per-head A_log / dt_bias, gated norm, out_proj
DELTA_NET = (
    Module(LA + "conv1d", Kind.MERGED, (LA + "conv1d",) * 3, quant=False, sizes=(KEY, KEY, VALUE)),
    # parameters of the linear_attn module itself: `linear_attn.A_log` (torch.float32 whatever the
    # model dtype) and `linear_attn.dt_bias`
    Module(LA[:-1], Kind.COLUMN, quant=False, param="A_log", dtype="F32", sizes=(("linear_num_value_heads",),)),
    Module(LA[:-1], Kind.COLUMN, quant=False, param="dt_bias", sizes=(("linear_num_value_heads",),)),
    replicate(LA + "norm"),
    Module(LA + "out_proj", Kind.ROW),
)

NEXT_LINEAR = (
    Module(LA + "in_proj_qkvz", Kind.COLUMN, dims=FROM_HIDDEN),  # one output size: a plain split
    Module(LA + "in_proj_ba", Kind.COLUMN, dims=FROM_HIDDEN),
    *DELTA_NET,
)

QWEN35_LINEAR = (
    Module(
        LA + "in_proj_qkvz",
        Kind.MERGED,
        (LA + "in_proj_qkv",) * 3 + (LA + "in_proj_z",),
        sizes=(KEY, KEY, VALUE, VALUE),
        dims=FROM_HIDDEN,
    ),
    Module(LA + "in_proj_ba", Kind.MERGED, (LA + "in_proj_b", LA + "in_proj_a"), dims=FROM_HIDDEN),
    *DELTA_NET,
)

SHARED = "mlp.experts._shared_experts._layer."


def _has_shared_expert(config: dict) -> bool:
    return int(config.get("shared_expert_intermediate_size") or 0) > 0


# Qwen3NextSparseMoeBlock: the router (GateLinear, no quant config) and the shared expert are handed
# to the fused-MoE runner, whose aliases (mlp.experts.*) are the smallest state-dict keys
SPARSE_MOE = (
    replicate("mlp.experts.gate", "mlp.gate"),
    Module("mlp.experts.routed_experts", Kind.EXPERTS, ("mlp.experts",)),
    Module(
        SHARED + "gate_up_proj",
        Kind.MERGED,
        ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        when=_has_shared_expert,
        dims=("shared_expert_intermediate_size", "hidden_size"),
    ),
    Module(
        SHARED + "down_proj",
        Kind.ROW,
        ("mlp.shared_expert.down_proj",),
        when=_has_shared_expert,
        dims=("hidden_size", "shared_expert_intermediate_size"),
    ),
    # ReplicatedLinear(hidden, 1, quant_config=None), also the shared expert's expert_gate
    replicate(SHARED + "expert_gate", "mlp.shared_expert_gate", when=_has_shared_expert),
)

QWEN3_NEXT = Architecture(
    names=("Qwen3NextForCausalLM",),
    top=(TOP[0], TOP[1], Module("lm_head", Kind.VOCAB, quant=False)),  # vLLM never ties its lm_head
    layer=NORMS,
    mixers=(("full_attention", FULL_ATTENTION), ("linear_attention", NEXT_LINEAR)),
    layer_type=layer_type,
    dense_mlp=MLP,
    moe_mlp=SPARSE_MOE,
    is_moe_layer=sparse_layer,
    experts_key=("num_experts",),
    tp_at_most_experts=True,
    every_stage=("model.embed_tokens", "lm_head"),  # built unconditionally; the norm on the last stage only
    skip_prefixes=("mtp.",),
)

LM = "language_model.model."

QWEN3_5_MOE = Architecture(
    names=("Qwen3_5MoeForConditionalGeneration",),
    top=(
        Module(LM + "embed_tokens", Kind.VOCAB, quant=False),
        replicate(LM + "norm"),
        Module("language_model.lm_head", Kind.VOCAB, quant=False, tied=LM + "embed_tokens"),
    ),
    layer=NORMS,
    mixers=(("full_attention", FULL_ATTENTION), ("linear_attention", QWEN35_LINEAR)),
    layer_type=layer_type,
    moe_mlp=SPARSE_MOE,
    is_moe_layer=lambda config, layer: True,  # model_type qwen3_5_moe_text: every layer
    experts_key=("num_experts",),
    tp_at_most_experts=True,
    layer_prefix=LM + "layers.{layer}.",
    embedding=LM + "embed_tokens",
    lm_head="language_model.lm_head",
    every_stage=(LM + "embed_tokens",),  # built unconditionally; the norm and lm_head on the last stage
    skip_prefixes=("mtp.", "model.visual."),
    hf_prefixes=((LM, "model.language_model."), ("language_model.lm_head", "lm_head")),
    text_config="text_config",
    serve_flags=("--language-model-only",),
)
