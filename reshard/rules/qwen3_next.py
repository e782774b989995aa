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

from dataclasses import replace

from reshard.rules.llama import ATTN, FROM_HIDDEN, HIDDEN, MLP, NORMS, TOP
from reshard.rules.moe import has_shared_expert, sparse_layer
from reshard.rules.spec import Architecture, Mixers, WeightsMapper
from reshard.rules.styles import QKV, Column, Experts, Merged, Replicate, Row, Vocab

KEY = ("linear_num_key_heads", "linear_key_head_dim")  # key_dim
VALUE = ("linear_num_value_heads", "linear_value_head_dim")  # value_dim

# vLLM qwen3_next.py Qwen3NextModel.hf_to_vllm_mapper
NEXT_MAPPER = WeightsMapper(
    orig_to_new_stacked={
        # weight_name: (param_name, shard_id)
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
        ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
    }
)

# vLLM qwen3_5.py Qwen3_5Model.hf_to_vllm_mapper
QWEN35_STACKED = NEXT_MAPPER | WeightsMapper(
    orig_to_new_stacked={
        ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
        ".in_proj_z": (".in_proj_qkvz", 3),
        ".in_proj_b": (".in_proj_ba", 0),
        ".in_proj_a": (".in_proj_ba", 1),
    }
)

# with Qwen3VLForConditionalGeneration's prefixes
QWEN35_MAPPER = QWEN35_STACKED | WeightsMapper(
    orig_to_new_prefix={
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
    }
)


def layer_type(config: dict, layer: int) -> str:
    """config.layer_types, or transformers' default: every full_attention_interval-th layer full."""
    types = config.get("layer_types")
    if types:
        return str(types[layer])
    interval = int(config.get("full_attention_interval") or 4)
    return "linear_attention" if (layer + 1) % interval else "full_attention"


# Qwen3NextAttention: gated q (2 x heads), qkv bias only with config.qkv_bias, GemmaRMSNorm q/k norms
FULL_ATTENTION = (
    QKV("self_attn.qkv_proj", bias="qkv_bias", dims=FROM_HIDDEN),
    Row("self_attn.o_proj"),
    Replicate("self_attn.q_norm", shape=("head_dim",)),
    Replicate("self_attn.k_norm", shape=("head_dim",)),
    ATTN,
)

LA = "linear_attn."

# what both families' gated delta nets share: conv1d, per-head A_log / dt_bias, gated norm, out_proj
DELTA_NET = (
    # conv1d [conv_dim, 1, kernel]: its q, k and v pieces each split across ranks
    Column(LA + "conv1d", quant=False, sizes=(KEY, KEY, VALUE)),
    # parameters of the linear_attn module itself: `linear_attn.A_log` (torch.float32 whatever the
    # model dtype) and `linear_attn.dt_bias`, one value per value head
    Column(LA[:-1], quant=False, param="A_log", dtype="F32", sizes=(("linear_num_value_heads",),)),
    Column(LA[:-1], quant=False, param="dt_bias", sizes=(("linear_num_value_heads",),)),
    Replicate(LA + "norm", shape=("linear_value_head_dim",)),
    Row(LA + "out_proj"),
)

NEXT_LINEAR = (
    Column(LA + "in_proj_qkvz", dims=FROM_HIDDEN),  # one output size: a plain split
    Column(LA + "in_proj_ba", dims=FROM_HIDDEN),
    *DELTA_NET,
)

QWEN35_LINEAR = (
    Merged(LA + "in_proj_qkvz", sizes=(KEY, KEY, VALUE, VALUE), dims=FROM_HIDDEN),
    Merged(LA + "in_proj_ba", dims=FROM_HIDDEN),
    *DELTA_NET,
)

SHARED = "mlp.experts._shared_experts._layer."


# Qwen3NextSparseMoeBlock: the router (GateLinear, no quant config) and the shared expert are handed
# to the fused-MoE runner, whose aliases (mlp.experts.*) are the smallest state-dict keys
SPARSE_MOE = (
    Replicate("mlp.experts.gate", "mlp.gate", shape=("num_experts", "hidden_size")),
    Experts("mlp.experts.routed_experts", "mlp.experts", tp_at_most_experts=True),
    Merged(
        SHARED + "gate_up_proj",
        "mlp.shared_expert.gate_up_proj",
        when=has_shared_expert,
        dims=("shared_expert_intermediate_size", "hidden_size"),
    ),
    Row(
        SHARED + "down_proj",
        "mlp.shared_expert.down_proj",
        when=has_shared_expert,
        dims=("hidden_size", "shared_expert_intermediate_size"),
    ),
    # ReplicatedLinear(hidden, 1, quant_config=None), built whatever the shared expert's size (qwen3_next.py),
    # the shared expert's expert_gate where there is one, else handed to the fused-MoE runner alone
    Replicate(SHARED + "expert_gate", "mlp.shared_expert_gate", when=has_shared_expert, shape=(1, "hidden_size")),
    Replicate(
        "mlp.experts.shared_expert_gate",
        "mlp.shared_expert_gate",
        when=lambda c: not has_shared_expert(c),
        shape=(1, "hidden_size"),
    ),
)

QWEN3_NEXT = Architecture(
    names=("Qwen3NextForCausalLM",),
    hf_to_vllm=NEXT_MAPPER,
    top=(TOP[0], TOP[1], Vocab("lm_head")),  # vLLM never ties its lm_head
    layer=NORMS,
    mixers=Mixers(layer_type, {"full_attention": FULL_ATTENTION, "linear_attention": NEXT_LINEAR}),
    dense_mlp=MLP,
    moe_mlp=SPARSE_MOE,
    is_moe_layer=sparse_layer,
    moe_on_every_stage=True,  # Qwen3NextForCausalLM: "No Qwen3Next layer found in the model.layers."
    experts_key=("num_experts",),
    every_stage=("model.embed_tokens", "lm_head"),  # built unconditionally; the norm on the last stage only
    skip_prefixes=("mtp.",),
)

LM = "language_model.model."

QWEN3_5_MOE = Architecture(
    names=("Qwen3_5MoeForConditionalGeneration",),
    hf_to_vllm=QWEN35_MAPPER,
    top=(
        Vocab(LM + "embed_tokens"),
        Replicate(LM + "norm", shape=HIDDEN),
        Vocab("language_model.lm_head", tied=LM + "embed_tokens"),
    ),
    layer=NORMS,
    mixers=Mixers(layer_type, {"full_attention": FULL_ATTENTION, "linear_attention": QWEN35_LINEAR}),
    moe_mlp=SPARSE_MOE,
    is_moe_layer=lambda config, layer: True,  # model_type qwen3_5_moe_text: every layer
    moe_on_every_stage=True,  # "No Qwen3_5 layer found in the language_model.model.layers."
    experts_key=("num_experts",),
    layer_prefix=LM + "layers.{layer}.",
    embedding=LM + "embed_tokens",
    lm_head="language_model.lm_head",
    every_stage=(LM + "embed_tokens",),  # built unconditionally; the norm and lm_head on the last stage
    skip_prefixes=("mtp.", "model.visual."),
    text_config="text_config",
    tie_in_text_config=True,  # Qwen3_5ForCausalLMBase: config.tie_word_embeddings of hf_text_config
    serve_flags=("--language-model-only",),
)

# issue 27: the text-only class vLLM 0.32 registers (qwen3_5.py Qwen3_5MoeForCausalLM over
# Qwen3_5ForCausalLMBase): the text model under `model.` and `lm_head` (no `language_model.`), built
# from hf_text_config, no vision tower so no --language-model-only. Its mapper drops `mtp.` and strips a
# leftover `model.language_model.` prefix (community exports): QWEN3_5_MOE_TEXT reads the `model.` names
# transformers' Qwen3_5MoeForCausalLM writes, QWEN3_5_MOE_TEXT_PREFIXED the others (rules.for_checkpoint).
QWEN3_5_MOE_TEXT = Architecture(
    names=("Qwen3_5MoeForCausalLM",),
    hf_to_vllm=QWEN35_STACKED,
    top=TOP,
    layer=NORMS,
    mixers=Mixers(layer_type, {"full_attention": FULL_ATTENTION, "linear_attention": QWEN35_LINEAR}),
    moe_mlp=SPARSE_MOE,
    is_moe_layer=lambda config, layer: True,
    moe_on_every_stage=True,  # QwenNextMixtureOfExperts: "No Qwen3Next layer found in the model.layers."
    experts_key=("num_experts",),
    every_stage=("model.embed_tokens",),
    skip_prefixes=("mtp.",),
)

QWEN3_5_MOE_TEXT_PREFIXED = replace(
    QWEN3_5_MOE_TEXT,
    hf_to_vllm=QWEN35_STACKED | WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."}),
)
