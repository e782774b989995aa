"""Phi-3 (vLLM phi3.py: LlamaForCausalLM with fused HF tensors).

The checkpoint already fuses `qkv_proj` and `gate_up_proj`. vLLM splits them with the global
q/k/v (head counts) and gate/up sizes, slices each part per rank as for separate tensors and
fuses the rank's parts again; a per-tensor FP8 scale of a fused tensor fills every slot.
"""

from reshard.rules.llama import ATTN, DOWN, FROM_HIDDEN, NORMS, TOP, UP
from reshard.rules.spec import Architecture
from reshard.rules.styles import QKV, Merged, Row

PHI3 = Architecture(
    names=("Phi3ForCausalLM",),
    top=TOP,
    layer=(
        *NORMS,
        QKV("self_attn.qkv_proj", bias="attention_bias", fused=("q", "k", "v"), dims=FROM_HIDDEN),
        Row("self_attn.o_proj", bias="attention_bias"),
        ATTN,
    ),
    dense_mlp=(
        Merged("mlp.gate_up_proj", bias="mlp_bias", fused=("gate", "up"), dims=UP),
        Row("mlp.down_proj", bias="mlp_bias", dims=DOWN),
    ),
)
