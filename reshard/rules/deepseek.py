"""DeepSeek-V2 / V3 (vLLM deepseek_v2.py, layers/mla.py): multi-head latent attention and MoE.

vLLM keeps each alias under its smallest state-dict key (sharded_state_loader._filter_subtensors).
MLA modules are registered on the attention layer, on its `mla_attn` wrapper and (kv_b_proj) on
the inner `MLAAttention`, so `fused_qkv_a_proj`, `kv_a_layernorm` and `kv_b_proj` keep their
`self_attn.` path (f, k < m) while `q_a_layernorm`, `q_b_proj`, `q_proj` and `o_proj` are kept
under `self_attn.mla_attn.`. The router and the noaux_tc bias are handed to the fused-MoE runner
(`mlp.experts.gate`), shared experts live under `mlp.experts._shared_experts._layer`.
"""

from reshard.rules.llama import DOWN, FROM_HIDDEN, NORMS, UP
from reshard.rules.spec import Architecture, Kind, Module, replicate

TOP = (
    Module("model.embed_tokens", Kind.VOCAB, quant=False),
    replicate("model.norm"),
    Module("lm_head", Kind.VOCAB, quant=False),  # never tied by vLLM's DeepseekV2ForCausalLM
)

MLA = "self_attn.mla_attn."

MLA_ATTENTION = (
    # with q_lora_rank (V2, V3): q_a_proj and kv_a_proj_with_mqa fused, disable_tp => whole
    Module(
        "self_attn.fused_qkv_a_proj",
        Kind.REPLICATE,
        ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        when="q_lora_rank",
        dims=FROM_HIDDEN,
    ),
    replicate(MLA + "q_a_layernorm", "self_attn.q_a_layernorm", when="q_lora_rank"),
    Module(MLA + "q_b_proj", Kind.COLUMN, ("self_attn.q_b_proj",), when="q_lora_rank", dims=(None, "q_lora_rank")),
    # without q_lora_rank (V2-Lite): a replicated kv_a_proj_with_mqa and a column q_proj
    Module("self_attn.kv_a_proj_with_mqa", Kind.REPLICATE, when=lambda c: not c.get("q_lora_rank")),
    Module(MLA + "q_proj", Kind.COLUMN, ("self_attn.q_proj",), when=lambda c: not c.get("q_lora_rank")),
    replicate("self_attn.kv_a_layernorm"),
    Module("self_attn.kv_b_proj", Kind.COLUMN, dims=(None, "kv_lora_rank")),  # rows per head: [k_nope; v]
    Module(MLA + "o_proj", Kind.ROW, ("self_attn.o_proj",)),
    # MLAAttention is not an Attention: Fp8Config gives it no KV-cache method, so only buffers
    Module(MLA + "mla_attn", Kind.ATTENTION, quant=False),
)

# DeepseekV2MLP: never a bias
DENSE_MLP = (
    Module("mlp.gate_up_proj", Kind.MERGED, ("mlp.gate_proj", "mlp.up_proj"), dims=UP),
    Module("mlp.down_proj", Kind.ROW, dims=DOWN),
)

SHARED = "mlp.experts._shared_experts._layer."
# the routed experts and the shared expert (merged gate/up, row down) that DeepseekV2MoE-style
# layers hand to the fused-MoE runner (GLM-4.5 too)
ROUTED_AND_SHARED = (
    Module("mlp.experts.routed_experts", Kind.EXPERTS, ("mlp.experts",)),
    Module(
        SHARED + "gate_up_proj",
        Kind.MERGED,
        ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        when="n_shared_experts",
    ),
    Module(SHARED + "down_proj", Kind.ROW, ("mlp.shared_experts.down_proj",), when="n_shared_experts"),
)


def noaux_tc(config: dict) -> bool:
    return config.get("topk_method") == "noaux_tc"


def moe_layer(config: dict, layer: int) -> bool:
    """DeepseekV2DecoderLayer: MoE from first_k_dense_replace on, every moe_layer_freq-th layer."""
    return (
        config.get("n_routed_experts") is not None
        and layer >= int(config.get("first_k_dense_replace") or 0)
        and layer % int(config.get("moe_layer_freq") or 1) == 0
    )


DEEPSEEK_V2 = Architecture(
    names=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    top=TOP,
    layer=(*NORMS, *MLA_ATTENTION),
    dense_mlp=DENSE_MLP,
    moe_mlp=(
        replicate("mlp.experts.gate", "mlp.gate"),  # GateLinear without the quant config
        replicate(
            "mlp.experts.gate",
            "mlp.gate",
            param="e_score_correction_bias",
            dtype="F32",  # torch.empty(E, dtype=torch.float32) whatever the model dtype
            when=noaux_tc,
        ),
        *ROUTED_AND_SHARED,
    ),
    is_moe_layer=moe_layer,
    experts_key=("n_routed_experts",),
    spec_layers_key=("num_nextn_predict_layers",),
)
