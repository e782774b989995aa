"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE, Mixtral (vLLM qwen3_moe.py, qwen2_moe.py, mixtral.py).

vLLM keeps each alias under its smallest state-dict key, so the router handed to the fused-MoE
runner is `mlp.experts.gate` and shared experts live under `mlp.experts._shared_experts._layer`.
"""

from reshard.rules.llama import ATTN, FROM_HIDDEN, MLP, NORMS, QWEN2_ATTENTION, QWEN3_ATTENTION, TOP
from reshard.rules.spec import Architecture, WeightsMapper
from reshard.rules.styles import QKV, Experts, Merged, Replicate, Row

# vLLM qwen3_moe.py Qwen3MoeModel.hf_to_vllm_mapper (qwen2_moe.py's Qwen2MoeForCausalLM alike)
QWEN_MOE_MAPPER = WeightsMapper(
    orig_to_new_stacked={
        # weight_name: (param_name, shard_id)
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        # .experts.gate_up_proj must be handled by MoERunner.load_weights for EP
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
        ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
    }
)


def sparse_layer(config: dict, layer: int) -> bool:
    """Qwen MoE: layers off `mlp_only_layers` on the `decoder_sparse_step` grid are MoE."""
    step = int(config.get("decoder_sparse_step") or 1)
    return (
        layer not in (config.get("mlp_only_layers") or [])
        and int(config.get("num_experts") or config.get("num_local_experts") or 0) > 0
        and (layer + 1) % step == 0
    )


def has_shared_expert(config: dict) -> bool:
    """Qwen2-MoE / Qwen3-Next: a shared expert is built where its size is positive (its gate always is)."""
    return int(config.get("shared_expert_intermediate_size") or 0) > 0


QWEN3_MOE = Architecture(
    names=("Qwen3MoeForCausalLM",),
    hf_to_vllm=QWEN_MOE_MAPPER,
    top=TOP,
    layer=QWEN3_ATTENTION,
    dense_mlp=MLP,
    moe_mlp=(
        Replicate("mlp.experts.gate", "mlp.gate", quant=True, dims=("num_experts", "hidden_size")),  # quant config
        Experts("mlp.experts.routed_experts", "mlp.experts", tp_at_most_experts=True),
    ),
    is_moe_layer=sparse_layer,
    top_on_every_stage=True,
    moe_on_every_stage=True,  # Qwen3MoeForCausalLM: "No Qwen3MoE layer found in the model.layers."
    fused_late=("gate_up_proj",),  # qwen3_moe.py: added to packed_modules_mapping in __init__ (mlp_only_layers)
)

SHARED = "mlp.experts._shared_experts._layer."

QWEN2_MOE = Architecture(
    names=("Qwen2MoeForCausalLM",),
    hf_to_vllm=QWEN_MOE_MAPPER,
    top=TOP,
    layer=QWEN2_ATTENTION,
    dense_mlp=MLP,
    moe_mlp=(
        Replicate("mlp.gate", shape=("num_experts", "hidden_size")),  # no alias, never quantized
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
        # the shared expert's gate: built whatever its size (qwen2_moe.py), an alias of the expert's expert_gate
        Replicate(SHARED + "expert_gate", "mlp.shared_expert_gate", when=has_shared_expert, shape=(1, "hidden_size")),
        Replicate("mlp.shared_expert_gate", when=lambda c: not has_shared_expert(c), shape=(1, "hidden_size")),
    ),
    is_moe_layer=sparse_layer,
    top_on_every_stage=True,  # checked with vLLM 0.32 (the reference doc's table omits Qwen2-MoE)
)

MIXTRAL = Architecture(
    names=("MixtralForCausalLM",),
    # vLLM mixtral.py MixtralModel.hf_to_vllm_mapper
    hf_to_vllm=WeightsMapper(
        orig_to_new_stacked={
            # weight_name: (param_name, shard_id)
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        },
    ),
    top=TOP,
    layer=(
        *NORMS,
        QKV("self_attn.qkv_proj", dims=FROM_HIDDEN),
        Row("self_attn.o_proj"),
        ATTN,
    ),
    moe_mlp=(
        Replicate("block_sparse_moe.gate", shape=("num_local_experts", "hidden_size")),
        Experts("block_sparse_moe.experts.routed_experts", "block_sparse_moe.experts", names=("w1", "w3", "w2")),
    ),
    is_moe_layer=lambda config, layer: True,
    moe_on_every_stage=True,  # MixtralForCausalLM: "No MixtralMoE layer found in model.layers."
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    top_on_every_stage=True,
)
