"""gpt-oss (vLLM gpt_oss.py): attention with biases and per-head sinks, every layer MoE with biased
experts stored fused per layer (reshard.plan.fusedexperts), bf16 or MXFP4.

vLLM renames on load (`GptOssForCausalLM.hf_to_vllm_mapper`): `.self_attn.` -> `.attn.`,
`embed_tokens` -> `embedding`; q/k/v are stacked into `attn.qkv_proj`. The router is a `GateLinear`
with a bias, not handed to the fused-MoE runner. Sliding-window attention on every other layer adds
no parameter. Embedding, final norm and lm_head are built on every pipeline stage.
"""

from reshard.rules.llama import FROM_HIDDEN, HIDDEN, NORMS
from reshard.rules.spec import Architecture, WeightsMapper, stacked_params_mapping
from reshard.rules.styles import QKV, Attention, FusedExperts, Heads, Replicate, Row, Vocab

GPT_OSS = Architecture(
    names=("GptOssForCausalLM",),
    # vLLM gpt_oss.py GptOssModel.load_weights (after hf_to_vllm_mapper's `.self_attn.` -> `.attn.`)
    hf_to_vllm=WeightsMapper(
        orig_to_new_stacked=stacked_params_mapping(
            [
                # (param_name, shard_name, shard_id)
                (".qkv_proj", ".q_proj", "q"),
                (".qkv_proj", ".k_proj", "k"),
                (".qkv_proj", ".v_proj", "v"),
            ]
        )
    ),
    top=(
        Vocab("model.embedding", "model.embed_tokens"),
        Replicate("model.norm", shape=HIDDEN),
        Vocab("lm_head"),  # vLLM's ParallelLMHead is never tied here
    ),
    layer=(
        *NORMS,
        QKV("attn.qkv_proj", "self_attn.qkv_proj", bias=True, dims=FROM_HIDDEN),
        Row("attn.o_proj", "self_attn.o_proj", bias=True),
        Heads("attn", "self_attn", param="sinks"),
        Attention("attn.attn", kv_heads_split_only=True),  # OAIAttention: num_key_value_heads // tp_size
    ),
    moe_mlp=(
        Replicate("mlp.router", param="weight", shape=("num_local_experts", "hidden_size")),
        Replicate("mlp.router", param="bias", shape=("num_local_experts",)),
        FusedExperts("mlp.experts.routed_experts", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    ),
    is_moe_layer=lambda config, layer: True,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    top_on_every_stage=True,
    embedding="model.embedding",
)
