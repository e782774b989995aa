"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE, Mixtral (vLLM qwen3_moe.py, qwen2_moe.py, mixtral.py).

vLLM keeps each alias under its smallest state-dict key, so the router handed to the fused-MoE
runner is `mlp.experts.gate` and shared experts live under `mlp.experts._shared_experts._layer`.
"""

from reshard.rules.llama import ATTN, FROM_HIDDEN, MLP, NORMS, QKV, QWEN2_ATTENTION, QWEN3_ATTENTION, TOP
from reshard.rules.spec import Architecture, Kind, Module, replicate


def sparse_layer(config: dict, layer: int) -> bool:
    """Qwen MoE: layers off `mlp_only_layers` on the `decoder_sparse_step` grid are MoE."""
    step = int(config.get("decoder_sparse_step") or 1)
    return (
        layer not in (config.get("mlp_only_layers") or [])
        and int(config.get("num_experts") or config.get("num_local_experts") or 0) > 0
        and (layer + 1) % step == 0
    )


QWEN3_MOE = Architecture(
    names=("Qwen3MoeForCausalLM",),
    top=TOP,
    layer=QWEN3_ATTENTION,
    dense_mlp=MLP,
    moe_mlp=(
        replicate("mlp.experts.gate", "mlp.gate", quant=True),  # built with the quant config
        Module("mlp.experts.routed_experts", Kind.EXPERTS, ("mlp.experts",)),
    ),
    is_moe_layer=sparse_layer,
    top_on_every_stage=True,
    tp_at_most_experts=True,
)

SHARED = "mlp.experts._shared_experts._layer."

QWEN2_MOE = Architecture(
    names=("Qwen2MoeForCausalLM",),
    top=TOP,
    layer=QWEN2_ATTENTION,
    dense_mlp=MLP,
    moe_mlp=(
        replicate("mlp.gate"),  # not handed to the runner: no alias, never quantized
        Module("mlp.experts.routed_experts", Kind.EXPERTS, ("mlp.experts",)),
        Module(
            SHARED + "gate_up_proj",
            Kind.MERGED,
            ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
            dims=("shared_expert_intermediate_size", "hidden_size"),
        ),
        Module(
            SHARED + "down_proj",
            Kind.ROW,
            ("mlp.shared_expert.down_proj",),
            dims=("hidden_size", "shared_expert_intermediate_size"),
        ),
        replicate(SHARED + "expert_gate", "mlp.shared_expert_gate"),
    ),
    is_moe_layer=sparse_layer,
    tp_at_most_experts=True,
    top_on_every_stage=True,  # checked with vLLM 0.32 (the reference doc's table omits Qwen2-MoE)
)

MIXTRAL = Architecture(
    names=("MixtralForCausalLM",),
    top=TOP,
    layer=(
        *NORMS,
        Module("self_attn.qkv_proj", Kind.QKV, QKV, dims=FROM_HIDDEN),
        Module("self_attn.o_proj", Kind.ROW),
        ATTN,
    ),
    moe_mlp=(
        replicate("block_sparse_moe.gate"),
        Module(
            "block_sparse_moe.experts.routed_experts",
            Kind.EXPERTS,
            ("block_sparse_moe.experts",),
            expert_names=("w1", "w3", "w2"),
        ),
    ),
    is_moe_layer=lambda config, layer: True,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    top_on_every_stage=True,
)
