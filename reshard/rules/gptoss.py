"""gpt-oss (vLLM gpt_oss.py): attention with biases and per-head sinks, every layer MoE with biased
experts stored fused per layer (reshard.plan.fusedexperts), bf16 or MXFP4.

vLLM renames on load (`GptOssForCausalLM.hf_to_vllm_mapper`): `.self_attn.` -> `.attn.`,
`embed_tokens` -> `embedding`; q/k/v are stacked into `attn.qkv_proj`. The router is a `GateLinear`
with a bias, not handed to the fused-MoE runner. Sliding-window attention on every other layer adds
no parameter. Embedding, final norm and lm_head are built on every pipeline stage.
"""

from reshard.rules.llama import FROM_HIDDEN, NORMS, QKV
from reshard.rules.spec import Architecture, Kind, Module, replicate

GPT_OSS = Architecture(
    names=("GptOssForCausalLM",),
    top=(
        Module("model.embedding", Kind.VOCAB, ("model.embed_tokens",), quant=False),
        replicate("model.norm"),
        Module("lm_head", Kind.VOCAB, quant=False),  # vLLM's ParallelLMHead is never tied here
    ),
    layer=(
        *NORMS,
        Module("attn.qkv_proj", Kind.QKV, QKV, bias=True, dims=FROM_HIDDEN),
        Module("attn.o_proj", Kind.ROW, ("self_attn.o_proj",), bias=True),
        Module("attn", Kind.HEADS, ("self_attn",), param="sinks", quant=False),
        Module("attn.attn", Kind.ATTENTION),
    ),
    moe_mlp=(
        replicate("mlp.router", param="weight"),
        replicate("mlp.router", param="bias"),
        Module(
            "mlp.experts.routed_experts",
            Kind.FUSED_EXPERTS,
            ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        ),
    ),
    is_moe_layer=lambda config, layer: True,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
    top_on_every_stage=True,
    kv_heads_split_only=True,  # OAIAttention: num_key_value_heads // tp_size
    embedding="model.embedding",
)
