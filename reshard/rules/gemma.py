"""Gemma 2 and Gemma 3 text models (vLLM gemma2.py, gemma3.py).

GemmaRMSNorm weights are stored raw (vLLM adds 1 at run time). Four norms per layer. Gemma 2 has
no lm_head module at all (the logits use the embedding), so its file keeps
`model.embed_tokens.weight`; Gemma 3's lm_head is tied to the embedding by config and then kept
only as `lm_head.weight`. Embedding, norm and lm_head are built on every pipeline stage.
"""

from reshard.rules.llama import ATTN, DOWN, FROM_HIDDEN, QKV, UP
from reshard.rules.spec import Architecture, Kind, Module, replicate

NORMS = (
    replicate("input_layernorm"),
    replicate("post_attention_layernorm"),
    replicate("pre_feedforward_layernorm"),
    replicate("post_feedforward_layernorm"),
)

ATTENTION = (
    Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="attention_bias", dims=FROM_HIDDEN),
    Module("self_attn.o_proj", Kind.ROW, bias="attention_bias"),
)

# Gemma2MLP / Gemma3MLP: no bias
GEMMA_MLP = (
    Module("mlp.gate_up_proj", Kind.MERGED, ("mlp.gate_proj", "mlp.up_proj"), dims=UP),
    Module("mlp.down_proj", Kind.ROW, dims=DOWN),
)

GEMMA2 = Architecture(
    names=("Gemma2ForCausalLM",),
    top=(Module("model.embed_tokens", Kind.VOCAB, quant=False), replicate("model.norm")),
    layer=(*NORMS, *ATTENTION, ATTN),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)

GEMMA3 = Architecture(
    names=("Gemma3ForCausalLM",),
    top=(
        Module("model.embed_tokens", Kind.VOCAB, quant=False),
        replicate("model.norm"),
        Module("lm_head", Kind.VOCAB, quant=False, tied="model.embed_tokens"),
    ),
    layer=(*NORMS, *ATTENTION, replicate("self_attn.q_norm"), replicate("self_attn.k_norm"), ATTN),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)
