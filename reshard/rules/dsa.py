"""DeepSeek Sparse Attention: DeepSeek-V3.2 and GLM-5 (`DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM`), and
GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`), whose latent attention is DeepSeek's.

DSA is DeepSeek-V3's MLA and MoE plus, on every attention layer that builds one (all by default), a
"lightning indexer" whose parameters are REPLICATED on every rank (vLLM deepseek_v2.py `Indexer`,
models/deepseek_v32/attention.py `DeepseekV32Indexer`):
- `indexer.wq_b`: a ReplicatedLinear [index_n_heads * index_head_dim, q_lora_rank] built with the
  model's quant config (block-FP8 releases: weight + weight_scale_inv);
- `indexer.wk_weights_proj`: a MergedColumnParallelLinear(disable_tp, quant_config=None) of the
  checkpoint's `wk` [index_head_dim, H] and `weights_proj` [index_n_heads, H], in the model dtype;
  an FP8 `wk` is dequantised at load (fp8 x weight_scale_inv in float32, rounded to bfloat16), as reshard
  writes it (plan.linear._plain_rows, Slice.scale);
- `indexer.k_norm`: a LayerNorm(dtype=float32): weight and bias F32 [index_head_dim].

The key names depend on vLLM's platform (models/deepseek_v32/__init__.py): on CUDA the model is
models/deepseek_v32/nvidia/model.py, whose `DeepseekV32Attention` IS vLLM's MLAAttention, so every
MLA module sits on `self_attn.` (`self_attn.q_b_proj`, `self_attn.o_proj`, `self_attn._k_scale`); on
CPU/XPU it is deepseek_v2.py's generic class, whose `MultiHeadLatentAttentionWrapper` keeps q_a_layernorm,
q_b_proj and o_proj under `self_attn.mla_attn.` and the scales under `self_attn.mla_attn.mla_attn.`
(as DeepSeek-V3: rules.deepseek). ROCm's class (models/deepseek_v32/amd) subclasses the CUDA
attention; it is not checked here and `--platform rocm` is refused. Shapes are the same everywhere.

vLLM skips layers whose indexer `index_topk_freq` / `index_topk_pattern` turn off (the checkpoint
still ships their weights); reshard refuses such configs (its rules are per config, not per layer).
MTP layers (`model.layers.{num_hidden_layers}.*`) belong to the draft model and are skipped, as for V3.

GLM-4.7-Flash (glm4_moe_lite.py): the decoder layer is DeepSeek's (DeepseekV2MLAAttention: the
same MLA modules and names as rules.deepseek, q_lora_rank set; no indexer) with GLM-4.5's MoE block
(Glm4MoE: an F32 router kept at `mlp.gate`, its F32 e_score_correction_bias handed to the runner, one
shared expert) and GLM's dense MLP (merged gate_up, down); an untied lm_head and an MTP layer.
"""

from reshard.rules.deepseek import DEEPSEEK_V2, DENSE_MLP, MAPPER, MLA_ATTENTION, moe_layer
from reshard.rules.glm import GLM4_MOE
from reshard.rules.llama import FROM_HIDDEN, NORMS
from reshard.rules.spec import Architecture, WeightsMapper, stacked_params_mapping
from reshard.rules.styles import Attention, Column, Merged, Replicate, Row

IDX = "self_attn.indexer."

# vLLM DeepseekV2Model.load_weights: indexer_fused_mapping (also DeepseekV32Model's stacked_params_mapping)
DSA_MAPPER = MAPPER | WeightsMapper(
    orig_to_new_stacked=stacked_params_mapping([("wk_weights_proj", "wk", 0), ("wk_weights_proj", "weights_proj", 1)])
)

INDEXER = (
    Replicate(IDX + "wq_b", quant=True, dims=(None, "q_lora_rank")),
    # an FP8 wk (slot 0) is dequantised to bf16 at load (deepseek_v2._try_load_fp8_indexer_wk)
    Merged(IDX + "wk_weights_proj", quant=False, disable_tp=True, dims=FROM_HIDDEN, dequant=(0,)),
    Replicate(IDX + "k_norm", dtype="F32", shape=("index_head_dim",)),
    Replicate(IDX + "k_norm", param="bias", dtype="F32", shape=("index_head_dim",)),
)

# models/deepseek_v32/attention.py DeepseekV32Attention (an MLAAttention): every module on self_attn
CUDA_ATTENTION = (
    Merged("self_attn.fused_qkv_a_proj", disable_tp=True, dims=FROM_HIDDEN),
    Replicate("self_attn.q_a_layernorm", shape=("q_lora_rank",)),
    Column("self_attn.q_b_proj", dims=(None, "q_lora_rank")),
    Replicate("self_attn.kv_a_layernorm", shape=("kv_lora_rank",)),
    Column("self_attn.kv_b_proj", dims=(None, "kv_lora_rank")),
    Row("self_attn.o_proj"),
    Attention("self_attn", kv_cache=False),
)

NAMES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def _dsa(layer: tuple) -> Architecture:
    return Architecture(
        names=NAMES,
        hf_to_vllm=DSA_MAPPER,
        top=DEEPSEEK_V2.top,
        layer=(*NORMS, *layer, *INDEXER),
        dense_mlp=DENSE_MLP,
        moe_mlp=DEEPSEEK_V2.moe_mlp,
        is_moe_layer=moe_layer,
        experts_key=("n_routed_experts",),
        spec_layers_key=("num_nextn_predict_layers",),
    )


DSA_CUDA = _dsa(CUDA_ATTENTION)
DSA_CPU = _dsa(MLA_ATTENTION)

# the names vLLM's model class gives the weights on each platform, or why a platform is refused
DSA_PLATFORMS: dict[str, Architecture | str] = {
    "cuda": DSA_CUDA,
    "cpu": DSA_CPU,
    "rocm": "vLLM's ROCm DSA class (models/deepseek_v32/amd) is not checked by reshard: its attention "
    "subclasses the CUDA one, but its AITER shared-expert fusion lays the experts out differently",
}


def sparse_layers_refused(config: dict) -> str | None:
    """Why a DSA config is refused: some layers build no indexer (vLLM's IndexCache settings)."""
    freq = config.get("index_topk_freq")
    pattern = config.get("index_topk_pattern")
    if (freq not in (None, 1)) or (isinstance(pattern, (list, str)) and "S" in pattern):
        return (
            "config.json's index_topk_freq / index_topk_pattern leave some layers without an indexer, "
            "which vLLM then skips (deepseek_v2.py); reshard's DSA rules give every layer one"
        )
    return None


GLM4_MOE_LITE = Architecture(
    names=("Glm4MoeLiteForCausalLM",),
    hf_to_vllm=MAPPER,  # glm4_moe_lite.py load_weights: gate/up and the MLA fused_qkv_a_proj
    top=DEEPSEEK_V2.top,  # lm_head never tied
    layer=(*NORMS, *MLA_ATTENTION),
    dense_mlp=DENSE_MLP,
    moe_mlp=GLM4_MOE.moe_mlp,
    is_moe_layer=moe_layer,  # first_k_dense_replace, moe_layer_freq
    experts_key=("n_routed_experts",),
    spec_layers_key=("num_nextn_predict_layers",),
)
