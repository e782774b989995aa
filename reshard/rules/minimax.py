"""MiniMax-M2 (vLLM minimax_m2.py): every layer a sigmoid-routed MoE under `block_sparse_moe`, and
q/k RMS norms over all heads whose weights vLLM shards like the heads (MiniMaxText01RMSNormTP).

The router is a GateLinear built in float32 without the quant config; the routing bias
(`block_sparse_moe.e_score_correction_bias`, float32) is a parameter of the MoE block itself. The
experts are named w1 (gate), w3 (up), w2 (down) and are as wide as `intermediate_size`. MTP modules
(`num_mtp_modules`, stored after the decoder layers) are dropped by vLLM's weight mapper.
"""

from reshard.rules.deepseek import TOP as UNTIED_TOP
from reshard.rules.llama import ATTN, FROM_HIDDEN, NORMS, QKV
from reshard.rules.spec import Architecture, Kind, Module, replicate

MOE = "block_sparse_moe."

MINIMAX_M2 = Architecture(
    names=("MiniMaxM2ForCausalLM",),
    top=UNTIED_TOP,  # MiniMaxM2ForCausalLM never ties its ParallelLMHead
    layer=(
        *NORMS,
        Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="attention_bias", dims=FROM_HIDDEN),
        Module("self_attn.o_proj", Kind.ROW),
        Module("self_attn.q_norm", Kind.HEAD_NORM, quant=False),
        Module("self_attn.k_norm", Kind.HEAD_NORM, quant=False, kv_heads=True),
        ATTN,
    ),
    moe_mlp=(
        replicate(MOE + "gate", dtype="F32"),
        replicate("block_sparse_moe", param="e_score_correction_bias", dtype="F32", when="use_routing_bias"),
        Module(MOE + "experts.routed_experts", Kind.EXPERTS, (MOE + "experts",), expert_names=("w1", "w3", "w2")),
    ),
    is_moe_layer=lambda config, layer: True,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    tp_at_most_experts=True,  # MiniMaxM2MoE: "Tensor parallel size ... is greater than the number of experts"
    spec_layers_key=("num_mtp_modules",),
)
