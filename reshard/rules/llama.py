"""Dense decoder families: Llama, Mistral, Qwen2, Qwen3 (vLLM llama.py, qwen2.py, qwen3.py)."""

from reshard.rules.spec import Architecture, WeightsMapper
from reshard.rules.styles import QKV, Attention, Merged, Replicate, Row, Vocab

# vLLM llama.py LlamaModel.hf_to_vllm_mapper (qwen2.py's Qwen2Model, gemma2/3.py's alike)
MAPPER = WeightsMapper(
    orig_to_new_stacked={
        # weight_name: (param_name, shard_id)
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    }
)

HIDDEN = ("hidden_size",)  # a norm over the residual stream

TOP = (
    Vocab("model.embed_tokens"),
    Replicate("model.norm", shape=HIDDEN),
    Vocab("lm_head", tied="model.embed_tokens"),
)

NORMS = (Replicate("input_layernorm", shape=HIDDEN), Replicate("post_attention_layernorm", shape=HIDDEN))

# (rows, columns) of each HF weight, as config.json names them
FROM_HIDDEN = (None, "hidden_size")
UP = ("intermediate_size", "hidden_size")
DOWN = ("hidden_size", "intermediate_size")

MLP = (
    Merged("mlp.gate_up_proj", bias="mlp_bias", dims=UP),
    Row("mlp.down_proj", bias="mlp_bias", dims=DOWN),
)

ATTN = Attention("self_attn.attn")

LLAMA = Architecture(
    names=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_to_vllm=MAPPER,
    top=TOP,
    layer=(
        *NORMS,
        QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
        Row("self_attn.o_proj", bias="attention_bias"),
        ATTN,
    ),
    dense_mlp=MLP,
)

# Qwen2 attention: qkv always has a bias, o_proj none (Qwen2-MoE shares it)
QWEN2_ATTENTION = (
    *NORMS,
    QKV("self_attn.qkv_proj", bias=True, dims=FROM_HIDDEN),
    Row("self_attn.o_proj"),
    ATTN,
)

QWEN2 = Architecture(names=("Qwen2ForCausalLM",), hf_to_vllm=MAPPER, top=TOP, layer=QWEN2_ATTENTION, dense_mlp=MLP)

# Qwen3 attention: qkv bias only with attention_bias, plus per-head q/k RMSNorm.
QWEN3_ATTENTION = (
    *NORMS,
    QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
    Row("self_attn.o_proj"),
    Replicate("self_attn.q_norm", shape=("head_dim",)),
    Replicate("self_attn.k_norm", shape=("head_dim",)),
    ATTN,
)

QWEN3 = Architecture(names=("Qwen3ForCausalLM",), hf_to_vllm=MAPPER, top=TOP, layer=QWEN3_ATTENTION, dense_mlp=MLP)
