"""Llama-4 Scout / Maverick, text part (vLLM llama4.py, mllama4.py).

`Llama4ForConditionalGeneration` checkpoints (the Meta releases) keep the text model under
`language_model.` and its sizes in config.json's `text_config`; reshard writes the text weights only
and pins `--language-model-only`, under which vLLM builds no vision tower or projector
(`SupportsMultiModal._mark_tower_model`) and skips their tensors. `Llama4ForCausalLM` checkpoints
are the text model alone. MoE on every `interleave_moe_layer_step`-th layer: a sigmoid router
(`feed_forward.router`, not handed to the fused-MoE runner), experts fused per layer
(reshard.plan.fusedexperts) and one shared expert, kept under the runner's
`experts._shared_experts._layer` alias; dense layers use `intermediate_size_mlp`. QK norm has no
weight, chunked local attention no parameter.
"""

from dataclasses import replace

from reshard.rules.llama import FROM_HIDDEN, NORMS, QKV
from reshard.rules.spec import Architecture, Kind, Module, replicate

SHARED = "feed_forward.experts._shared_experts._layer."
DENSE_UP = ("intermediate_size_mlp", "hidden_size")
MOE_UP = ("intermediate_size", "hidden_size")


def moe_layer(config: dict, layer: int) -> bool:
    """Llama4DecoderLayer: MoE where (layer + 1) % interleave_moe_layer_step == 0."""
    step = int(config.get("interleave_moe_layer_step") or 0)
    return step > 0 and (layer + 1) % step == 0


LLAMA4_TEXT = Architecture(
    names=("Llama4ForCausalLM",),
    top=(
        Module("model.embed_tokens", Kind.VOCAB, quant=False),
        replicate("model.norm"),
        Module("lm_head", Kind.VOCAB, quant=False, tied="model.embed_tokens"),
    ),
    layer=(
        *NORMS,
        # q and k rows reordered per head for vLLM's rotary (permute_qk_weight_for_rotary, every layer)
        Module("self_attn.qkv_proj", Kind.QKV, QKV, bias="attention_bias", dims=FROM_HIDDEN, deinterleave=(0, 1)),
        Module("self_attn.o_proj", Kind.ROW, bias="attention_bias"),
        Module("self_attn.attn", Kind.ATTENTION),
    ),
    dense_mlp=(
        Module(
            "feed_forward.gate_up_proj", Kind.MERGED, ("feed_forward.gate_proj", "feed_forward.up_proj"), dims=DENSE_UP
        ),
        Module("feed_forward.down_proj", Kind.ROW, dims=("hidden_size", "intermediate_size_mlp")),
    ),
    moe_mlp=(
        replicate("feed_forward.router"),
        Module(
            "feed_forward.experts.routed_experts",
            Kind.FUSED_EXPERTS,
            ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
            gate_up_halves=True,
        ),
        Module(
            SHARED + "gate_up_proj",
            Kind.MERGED,
            ("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
            dims=MOE_UP,
        ),
        Module(
            SHARED + "down_proj",
            Kind.ROW,
            ("feed_forward.shared_expert.down_proj",),
            dims=("hidden_size", "intermediate_size"),
        ),
    ),
    is_moe_layer=moe_layer,
    experts_key=("num_local_experts",),
    moe_intermediate_key="intermediate_size",
)

LM = "language_model."

LLAMA4 = replace(
    LLAMA4_TEXT,
    names=("Llama4ForConditionalGeneration",),
    top=(
        Module(LM + "model.embed_tokens", Kind.VOCAB, quant=False),
        replicate(LM + "model.norm"),
        Module(LM + "lm_head", Kind.VOCAB, quant=False, tied=LM + "model.embed_tokens"),
    ),
    layer_prefix=LM + "model.layers.{layer}.",
    embedding=LM + "model.embed_tokens",
    lm_head=LM + "lm_head",
    text_config="text_config",
    skip_prefixes=("vision_model.", "multi_modal_projector."),
    serve_flags=("--language-model-only",),
)
