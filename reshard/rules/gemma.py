"""Gemma 2 and Gemma 3 text models (vLLM gemma2.py, gemma3.py).

GemmaRMSNorm weights are stored raw (vLLM adds 1 at run time). Four norms per layer. Gemma 2 has
no lm_head module at all (the logits use the embedding), so its file keeps
`model.embed_tokens.weight`; Gemma 3's lm_head is tied to the embedding by config and then kept
only as `lm_head.weight`. Embedding, norm and lm_head are built on every pipeline stage.
"""

from reshard.rules.llama import ATTN, DOWN, FROM_HIDDEN, MAPPER, UP
from reshard.rules.spec import Architecture
from reshard.rules.styles import QKV, Merged, Replicate, Row, Vocab

NORMS = (
    Replicate("input_layernorm"),
    Replicate("post_attention_layernorm"),
    Replicate("pre_feedforward_layernorm"),
    Replicate("post_feedforward_layernorm"),
)

ATTENTION = (
    QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN),
    Row("self_attn.o_proj", bias="attention_bias"),
)

# Gemma2MLP / Gemma3MLP: no bias
GEMMA_MLP = (
    Merged("mlp.gate_up_proj", dims=UP),
    Row("mlp.down_proj", dims=DOWN),
)

GEMMA2 = Architecture(
    names=("Gemma2ForCausalLM",),
    hf_to_vllm=MAPPER,  # vLLM gemma2.py Gemma2Model.hf_to_vllm_mapper: Llama's
    top=(Vocab("model.embed_tokens"), Replicate("model.norm")),
    layer=(*NORMS, *ATTENTION, ATTN),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)

GEMMA3 = Architecture(
    names=("Gemma3ForCausalLM",),
    hf_to_vllm=MAPPER,  # vLLM gemma3.py Gemma3Model.hf_to_vllm_mapper: Llama's
    top=(Vocab("model.embed_tokens"), Replicate("model.norm"), Vocab("lm_head", tied="model.embed_tokens")),
    layer=(*NORMS, *ATTENTION, Replicate("self_attn.q_norm"), Replicate("self_attn.k_norm"), ATTN),
    dense_mlp=GEMMA_MLP,
    top_on_every_stage=True,
)
