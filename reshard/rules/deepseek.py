"""DeepSeek-V2 / V3 (vLLM deepseek_v2.py, layers/mla.py): multi-head latent attention and MoE.

vLLM keeps each alias under its smallest state-dict key (sharded_state_loader._filter_subtensors).
MLA modules are registered on the attention layer, on its `mla_attn` wrapper and (kv_b_proj) on
the inner `MLAAttention`, so `fused_qkv_a_proj`, `kv_a_layernorm` and `kv_b_proj` keep their
`self_attn.` path (f, k < m) while `q_a_layernorm`, `q_b_proj`, `q_proj` and `o_proj` are kept
under `self_attn.mla_attn.`. The router and the noaux_tc bias are handed to the fused-MoE runner
(`mlp.experts.gate`), shared experts live under `mlp.experts._shared_experts._layer`.
"""

from reshard.rules.llama import DOWN, FROM_HIDDEN, HIDDEN, NORMS, UP
from reshard.rules.spec import Architecture, WeightsMapper, stacked_params_mapping
from reshard.rules.styles import Attention, Column, Experts, Merged, Replicate, Row, Vocab

# vLLM deepseek_v2.py DeepseekV2Model.load_weights: stacked_params_mapping + mla_params_mapping
# (the indexer's and MHA's mappings name no module of these models)
MAPPER = WeightsMapper(
    orig_to_new_stacked=stacked_params_mapping(
        [
            # (param_name, shard_name, shard_id)
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
            ("fused_qkv_a_proj", "q_a_proj", 0),
            ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
        ]
    )
)

TOP = (
    Vocab("model.embed_tokens"),
    Replicate("model.norm", shape=HIDDEN),
    Vocab("lm_head"),  # never tied by vLLM's DeepseekV2ForCausalLM
)

MLA = "self_attn.mla_attn."

MLA_ATTENTION = (
    # with q_lora_rank (V2, V3): q_a_proj and kv_a_proj_with_mqa fused, disable_tp => whole
    Merged("self_attn.fused_qkv_a_proj", disable_tp=True, when="q_lora_rank", dims=FROM_HIDDEN),
    Replicate(MLA + "q_a_layernorm", "self_attn.q_a_layernorm", when="q_lora_rank", shape=("q_lora_rank",)),
    Column(MLA + "q_b_proj", "self_attn.q_b_proj", when="q_lora_rank", dims=(None, "q_lora_rank")),
    # without q_lora_rank (V2-Lite): a replicated kv_a_proj_with_mqa and a column q_proj
    Replicate("self_attn.kv_a_proj_with_mqa", quant=True, when=lambda c: not c.get("q_lora_rank"), dims=FROM_HIDDEN),
    Column(MLA + "q_proj", "self_attn.q_proj", when=lambda c: not c.get("q_lora_rank")),
    Replicate("self_attn.kv_a_layernorm", shape=("kv_lora_rank",)),
    Column("self_attn.kv_b_proj", dims=(None, "kv_lora_rank")),  # rows per head: [k_nope; v]
    Row(MLA + "o_proj", "self_attn.o_proj"),
    # MLAAttention is not an Attention: Fp8Config gives it no KV-cache method, so only buffers
    Attention(MLA + "mla_attn", kv_cache=False),
)

# DeepseekV2MLP: never a bias
DENSE_MLP = (
    Merged("mlp.gate_up_proj", dims=UP),
    Row("mlp.down_proj", dims=DOWN),
)

SHARED = "mlp.experts._shared_experts._layer."
# the routed experts and the shared expert (merged gate/up, row down) that DeepseekV2MoE-style
# layers hand to the fused-MoE runner (GLM-4.5 too)
ROUTED_AND_SHARED = (
    Experts("mlp.experts.routed_experts", "mlp.experts"),
    Merged(SHARED + "gate_up_proj", "mlp.shared_experts.gate_up_proj", when="n_shared_experts"),
    Row(SHARED + "down_proj", "mlp.shared_experts.down_proj", when="n_shared_experts"),
)


def noaux_tc(config: dict) -> bool:
    return config.get("topk_method") == "noaux_tc"


def moe_layer(config: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer: MoE from first_k_dense_replace on, every moe_layer_freq-th layer."""
    return (
        config.get("n_routed_experts") is not None
        and layer >= int(config.get("first_k_dense_replace") or 0)
        and layer % int(config.get("moe_layer_freq") or 1) == 0
    )


DEEPSEEK_V2 = Architecture(
    names=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    hf_to_vllm=MAPPER,
    top=TOP,
    layer=(*NORMS, *MLA_ATTENTION),
    dense_mlp=DENSE_MLP,
    moe_mlp=(
        # GateLinear without the quant config
        Replicate("mlp.experts.gate", "mlp.gate", shape=("n_routed_experts", "hidden_size")),
        Replicate(
            "mlp.experts.gate",
            "mlp.gate",
            param="e_score_correction_bias",
            shape=("n_routed_experts",),
            dtype="F32",  # torch.empty(E, dtype=torch.float32) whatever the model dtype
            when=noaux_tc,
        ),
        *ROUTED_AND_SHARED,
    ),
    is_moe_layer=moe_layer,
    experts_key=("n_routed_experts",),
    spec_layers_key=("num_nextn_predict_layers",),
)
