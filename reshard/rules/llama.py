"""Dense decoder families: Llama, Mistral, Qwen2, Qwen3 (vLLM llama.py, qwen2.py, qwen3.py)."""

from reshard.rules.spec import Architecture, Kind, Module, replicate

TOP = (
    Module("model.embed_tokens", Kind.VOCAB, quant=False),
    replicate("model.norm"),
    Module("lm_head", Kind.VOCAB, quant=False, tied="model.embed_tokens"),
)

NORMS = (replicate("input_layernorm"), replicate("post_attention_layernorm"))

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# (rows, columns) of each HF weight, as config.json names them
FROM_HIDDEN = (None, "hidden_size")
UP = ("intermediate_size", "hidden_size")
DOWN = ("hidden_size", "intermediate_size")

MLP = (
    Module("mlp.gate_up_proj", Kind.MERGED, ("mlp.gate_proj", "mlp.up_proj"), bias="mlp_bias", dims=UP),
    Module("mlp.down_proj", Kind.ROW, bias="mlp_bias", dims=DOWN),
)

ATTN = Module("self_attn.attn", Kind.ATTENTION)

LLAMA = Architecture(
    names=("LlamaForCausalLM", "MistralForCausalLM"),
    top=TOP,
    layer=(
        *NORMS,
        Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="attention_bias", dims=FROM_HIDDEN),
        Module("self_attn.o_proj", Kind.ROW, bias="attention_bias"),
        ATTN,
    ),
    dense_mlp=MLP,
)

# Qwen2 attention: qkv always has a bias, o_proj none (Qwen2-MoE shares it)
QWEN2_ATTENTION = (
    *NORMS,
    Module("self_attn.qkv_proj", Kind.QKV, QKV, bias=True, dims=FROM_HIDDEN),
    Module("self_attn.o_proj", Kind.ROW),
    ATTN,
)

QWEN2 = Architecture(names=("Qwen2ForCausalLM",), top=TOP, layer=QWEN2_ATTENTION, dense_mlp=MLP)

# Qwen3 attention: qkv bias only with attention_bias, plus per-head q/k RMSNorm.
QWEN3_ATTENTION = (
    *NORMS,
    Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="attention_bias", dims=FROM_HIDDEN),
    Module("self_attn.o_proj", Kind.ROW),
    replicate("self_attn.q_norm"),
    replicate("self_attn.k_norm"),
    ATTN,
)

QWEN3 = Architecture(names=("Qwen3ForCausalLM",), top=TOP, layer=QWEN3_ATTENTION, dense_mlp=MLP)
