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

from reshard.rules.llama import FROM_HIDDEN, HIDDEN, NORMS
from reshard.rules.spec import Architecture, WeightsMapper, stacked_params_mapping
from reshard.rules.styles import QKV, Attention, FusedExperts, Merged, Replicate, Row, Vocab

SHARED = "feed_forward.experts._shared_experts._layer."
DENSE_UP = ("intermediate_size_mlp", "hidden_size")
MOE_UP = ("intermediate_size", "hidden_size")


def moe_layer(config: dict, layer: int) -> bool:
    """Llama4DecoderLayer: MoE where (layer + 1) % interleave_moe_layer_step == 0."""
    step = int(config.get("interleave_moe_layer_step") or 0)
    return step > 0 and (layer + 1) % step == 0


LLAMA4_TEXT = Architecture(
    names=("Llama4ForCausalLM",),
    # vLLM llama4.py Llama4Model.load_weights (mllama4.py's names the same slots under .self_attn.,
    # .shared_expert. and .feed_forward.)
    hf_to_vllm=WeightsMapper(
        orig_to_new_stacked=stacked_params_mapping(
            [
                # (param_name, shard_name, shard_id)
                (".qkv_proj", ".q_proj", "q"),
                (".qkv_proj", ".k_proj", "k"),
                (".qkv_proj", ".v_proj", "v"),
                (".gate_up_proj", ".gate_proj", 0),
                (".gate_up_proj", ".up_proj", 1),
            ]
        )
    ),
    top=(
        Vocab("model.embed_tokens"),
        Replicate("model.norm", shape=HIDDEN),
        Vocab("lm_head", tied="model.embed_tokens"),
    ),
    layer=(
        *NORMS,
        # q and k rows reordered per head for vLLM's rotary (permute_qk_weight_for_rotary, every layer)
        QKV("self_attn.qkv_proj", bias="attention_bias", dims=FROM_HIDDEN, deinterleave=(0, 1)),
        Row("self_attn.o_proj", bias="attention_bias"),
        Attention("self_attn.attn"),
    ),
    dense_mlp=(
        Merged("feed_forward.gate_up_proj", dims=DENSE_UP),
        Row("feed_forward.down_proj", dims=("hidden_size", "intermediate_size_mlp")),
    ),
    moe_mlp=(
        Replicate("feed_forward.router", shape=("num_local_experts", "hidden_size")),
        FusedExperts(
            "feed_forward.experts.routed_experts",
            "feed_forward.experts.gate_up_proj",
            "feed_forward.experts.down_proj",
            halves=True,
        ),
        Merged(SHARED + "gate_up_proj", "feed_forward.shared_expert.gate_up_proj", dims=MOE_UP),
        Row(SHARED + "down_proj", "feed_forward.shared_expert.down_proj", dims=("hidden_size", "intermediate_size")),
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
        Vocab(LM + "model.embed_tokens"),
        Replicate(LM + "model.norm", shape=HIDDEN),
        Vocab(LM + "lm_head", tied=LM + "model.embed_tokens"),
    ),
    layer_prefix=LM + "model.layers.{layer}.",
    embedding=LM + "model.embed_tokens",
    lm_head=LM + "lm_head",
    text_config="text_config",
    skip_prefixes=("vision_model.", "multi_modal_projector."),
    serve_flags=("--language-model-only",),
)
