"""GLM-4.5 / 4.6 / 4.7 MoE (vLLM glm4_moe.py): grouped-query attention with q/k/v biases and per-head
q/k norms, DeepSeek-style routing with a shared expert, and an MTP layer the main model skips.

The router is a GateLinear built in float32 (params_dtype=torch.float32) without the quant config,
and it is not handed to the fused-MoE runner: it keeps its `mlp.gate` path. Its
e_score_correction_bias (float32) is handed to the runner, whose key
`mlp.experts.routed_experts.e_score_correction_bias` is the smaller; so is
`mlp.experts._shared_experts._layer` for the shared experts. Partial rotary (0.5) has no weights.
"""

from reshard.rules.deepseek import DENSE_MLP, ROUTED_AND_SHARED
from reshard.rules.deepseek import TOP as UNTIED_TOP
from reshard.rules.llama import ATTN, FROM_HIDDEN, NORMS
from reshard.rules.spec import Architecture, WeightsMapper
from reshard.rules.styles import QKV, Replicate, Row


def moe_layer(config: dict, layer: int) -> bool:
    """Glm4MoeDecoderLayer: MoE from first_k_dense_replace on."""
    return config.get("n_routed_experts") is not None and layer >= int(config.get("first_k_dense_replace") or 0)


GLM4_MOE = Architecture(
    names=("Glm4MoeForCausalLM",),
    # vLLM glm4_moe.py Glm4MoeModel.hf_to_vllm_mapper
    hf_to_vllm=WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            # .experts.gate_up_proj must be handled by MoERunner.load_weights for EP
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0),
            ".shared_experts.up_proj": (".shared_experts.gate_up_proj", 1),
        }
    ),
    top=UNTIED_TOP,  # Glm4MoeForCausalLM never ties its ParallelLMHead
    layer=(
        *NORMS,
        QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
        Row("self_attn.o_proj"),
        Replicate("self_attn.q_norm", when="use_qk_norm", shape=("head_dim",)),
        Replicate("self_attn.k_norm", when="use_qk_norm", shape=("head_dim",)),
        ATTN,
    ),
    dense_mlp=DENSE_MLP,
    moe_mlp=(
        Replicate("mlp.gate", dtype="F32", shape=("n_routed_experts", "hidden_size")),
        # the bias handed to the runner too: its smallest key is the runner's
        Replicate(
            "mlp.experts.routed_experts",
            "mlp.gate",
            param="e_score_correction_bias",
            dtype="F32",
            shape=("n_routed_experts",),
        ),
        *ROUTED_AND_SHARED,
    ),
    is_moe_layer=moe_layer,
    moe_on_every_stage=True,  # Glm4MoeForCausalLM: "No Glm4MoE layer found in model.layers."
    experts_key=("n_routed_experts",),
    spec_layers_key=("num_nextn_predict_layers",),
)
