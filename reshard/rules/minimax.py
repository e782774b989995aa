"""MiniMax-M2 (vLLM minimax_m2.py): every layer a sigmoid-routed MoE under `block_sparse_moe`, and
q/k RMS norms over all heads whose weights vLLM shards like the heads (MiniMaxText01RMSNormTP).

The router is a GateLinear built in float32 without the quant config; the routing bias
(`block_sparse_moe.e_score_correction_bias`, float32) is a parameter of the MoE block itself. The
experts are named w1 (gate), w3 (up), w2 (down) and are as wide as `intermediate_size`. MTP modules
(`num_mtp_modules`, stored after the decoder layers) are dropped by vLLM's weight mapper.
"""

from reshard.rules.deepseek import TOP as UNTIED_TOP
from reshard.rules.llama import ATTN, FROM_HIDDEN, NORMS
from reshard.rules.spec import Architecture, WeightsMapper
from reshard.rules.styles import QKV, Experts, HeadNorm, Replicate, Row

MOE = "block_sparse_moe."

MINIMAX_M2 = Architecture(
    names=("MiniMaxM2ForCausalLM",),
    # vLLM minimax_m2.py MiniMaxM2Model.hf_to_vllm_mapper
    hf_to_vllm=WeightsMapper(
        orig_to_new_stacked={
            # weight_name: (param_name, shard_id)
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        }
    ),
    top=UNTIED_TOP,  # MiniMaxM2ForCausalLM never ties its ParallelLMHead
    layer=(
        *NORMS,
        QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
        Row("self_attn.o_proj"),
        HeadNorm("self_attn.q_norm"),
        HeadNorm("self_attn.k_norm", kv_heads=True),
        ATTN,
    ),
    moe_mlp=(
        Replicate(MOE + "gate", dtype="F32", shape=("num_local_experts", "hidden_size")),
        Replicate(
            "block_sparse_moe",
            param="e_score_correction_bias",
            dtype="F32",
            when="use_routing_bias",
            shape=("num_local_experts",),
        ),
        Experts(
            MOE + "experts.routed_experts",
            MOE + "experts",
            names=("w1", "w3", "w2"),
            # MiniMaxM2MoE: "Tensor parallel size ... is greater than the number of experts"
            tp_at_most_experts=True,
        ),
    ),
    is_moe_layer=lambda config, layer: True,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    spec_layers_key=("num_mtp_modules",),
)
