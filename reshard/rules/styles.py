"""Split rules as style objects: one small frozen class per way vLLM cuts a module across ranks.

In the manner of torchtitan's `ColwiseParallel` / `RowwiseParallel`: an architecture's table
(reshard.rules.spec.Architecture) lists its vLLM modules, each as the style vLLM builds it with, and
each style carries only its own parameters. The planner maps each class to its slicer
(reshard.plan.slicers.SLICERS), so a new kind of layer, or a layer quantized in a new way, is a new
class here and a slicer there, not new fields on a shared record. Nothing here knows about bytes or torch.

Names: `name` is the vLLM module path, relative to the decoder layer (`self_attn.qkv_proj`) or to the
model root, after vLLM's alias de-duplication (the lexicographically smallest state-dict key wins);
`source` is the checkpoint's path of the same module where it differs (`mlp.shared_expert.down_proj`
for vLLM's `mlp.experts._shared_experts._layer.down_proj`). Fused modules (`Merged`, `QKV`) find
their slots' checkpoint names through the architecture's `WeightsMapper.orig_to_new_stacked`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

When = str | Callable[[dict], bool] | None
ConfigDims = tuple[str | None, str | None]
Sizes = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Rule:
    """One vLLM module (or one parameter of it).

    Attributes:
        name: the vLLM path (see the module docstring).
        when: the module exists only if this config key is truthy, or this predicate of the config
            holds (DeepSeek's q_lora_rank, shared experts, noaux_tc bias).
    """

    name: str
    _: KW_ONLY
    when: When = None

    def present(self, config: dict) -> bool:
        if self.when is None:
            return True
        if isinstance(self.when, str):
            return bool(config.get(self.when))
        return bool(self.when(config))


@dataclass(frozen=True)
class Sourced(Rule):
    """A module read from checkpoint tensors under `source` (default: its vLLM `name`)."""

    source: str | None = None

    @property
    def hf(self) -> str:
        """The module's path in the checkpoint."""
        return self.source or self.name


@dataclass(frozen=True)
class Linear(Sourced):
    """A vLLM linear layer (`*ParallelLinear`, `ReplicatedLinear`).

    Attributes:
        bias: whether it has a bias: a literal, or the config key that says so.
        quant: whether the checkpoint's weight quantization can apply (vLLM builds it with the quant
            config). False for layers built without it (norms, routers, conv1d).
        dims: the config keys of each slot's checkpoint weight shape (rows, columns), checked before
            anything is written; None leaves that side unchecked. `Row` layers always produce
            `hidden_size` rows (the residual stream).
        dtype: the parameter's dtype (safetensors code) when vLLM fixes it, e.g. "F32"; None is the
            model dtype.
    """

    _: KW_ONLY
    bias: bool | str = False
    quant: bool = True
    dims: ConfigDims = (None, None)
    dtype: str | None = None


@dataclass(frozen=True)
class Replicate(Linear):
    """Whole on every rank: norms, routers, replicated linears. Not quantized unless `quant=True`
    (a `ReplicatedLinear` built with the quant config, e.g. Qwen3-MoE's router).

    Attributes:
        param: the parameter's name under both the vLLM and the checkpoint module (not quantized),
            e.g. `e_score_correction_bias`.
        shape: not quantized: the config keys of the tensor's whole shape, one per dimension
            (`("hidden_size",)` for a norm), checked before anything is written: vLLM builds the
            parameter so, and a source tensor of another shape would be copied whole, passing
            verify. An int is a fixed size; None, or a key config.json lacks, leaves its dimension
            unchecked (the number of dimensions still is); () checks nothing.
    """

    _: KW_ONLY
    quant: bool = False
    param: str = "weight"
    shape: tuple[str | int | None, ...] = ()


def layer_norm(name: str, shape: tuple[str | int | None, ...] = ("hidden_size",)) -> tuple[Replicate, Replicate]:
    """An nn.LayerNorm: its weight and bias, whole on every rank, both of `shape` (the encoders' norms)."""
    return Replicate(name, shape=shape), Replicate(name, param="bias", shape=shape)


@dataclass(frozen=True)
class Column(Linear):
    """`ColumnParallelLinear`: output rows split across ranks, the bias alike.

    Attributes:
        param: the parameter's name when not quantized and not `weight` (`A_log`, `dt_bias`: then
            `sizes` gives its rows).
        sizes: the tensor is cut into consecutive pieces, each split across ranks on its own and a
            rank's pieces concatenated (the gated delta net's conv1d [conv_dim, 1, kernel]:
            vLLM's `mamba_v2_sharded_weight_loader`); per piece, the config keys whose product is
            its row count. One piece: a plain split of a tensor of that many rows, of any rank.
    """

    _: KW_ONLY
    param: str = "weight"
    sizes: Sizes = ()


@dataclass(frozen=True)
class Row(Linear):
    """`RowParallelLinear`: input columns split across ranks, the bias whole on every rank."""


@dataclass(frozen=True)
class Merged(Linear):
    """`MergedColumnParallelLinear`: column slots ([gate; up], ...), each split across ranks on its own.

    The slots' checkpoint tensors are those vLLM's `orig_to_new_stacked` stacks into `source`; a
    tuple shard id (Qwen3.5's `in_proj_qkv` -> (0, 1, 2)) names consecutive row ranges of one tensor.

    Attributes:
        fused: the checkpoint stores the slots stacked along the rows of `source` itself (vLLM's
            shard id None, Phi-3's gate_up_proj); these name them. vLLM splits it into equal parts,
            then slices each slot per rank as if it had been separate.
        sizes: per slot, the config keys whose product is its row count (vLLM's `output_sizes`),
            where a tensor holds several slots.
        disable_tp: whole on every rank (vLLM's `disable_tp=True`, DeepSeek's fused_qkv_a_proj).
        dequant: slots whose FP8 (e4m3) checkpoint weight vLLM dequantises at load with its block scale
            (`weight_scale_inv` / `weight_scale`) into this unquantized module (DeepSeek-V3.2's indexer wk).
    """

    _: KW_ONLY
    fused: tuple[str, ...] = ()
    sizes: Sizes = ()
    disable_tp: bool = False
    dequant: tuple[int, ...] = ()


@dataclass(frozen=True)
class QKV(Linear):
    """`QKVParallelLinear`: [q; k; v] rows, q by heads, k and v by KV heads, replicated on
    tp / num_kv_heads ranks when there are fewer KV heads than ranks.

    Attributes:
        fused: ("q", "k", "v") when the checkpoint stores them stacked in `source` (Phi-3); vLLM
            splits it by the head counts.
        deinterleave: slots (0 q, 1 k) whose rows vLLM reorders within every head, even rows then
            odd rows, for its rotary embedding (Llama-4's `permute_qk_weight_for_rotary`).
    """

    _: KW_ONLY
    fused: tuple[str, ...] = ()
    deinterleave: tuple[int, ...] = ()


@dataclass(frozen=True)
class Vocab(Sourced):
    """`VocabParallelEmbedding` / `ParallelLMHead`: rows padded to a multiple of 64, then split.

    Attributes:
        tied: when config.tie_word_embeddings, the module whose weight it shares.
    """

    _: KW_ONLY
    tied: str | None = None


@dataclass(frozen=True)
class Heads(Sourced):
    """A 1-D parameter with one value per attention head, split by heads (gpt-oss `sinks`)."""

    _: KW_ONLY
    param: str = "weight"
    dtype: str | None = None


@dataclass(frozen=True)
class HeadNorm(Sourced):
    """A norm weight over every head, split like the heads (MiniMax-M2's q_norm / k_norm,
    `MiniMaxText01RMSNormTP`): q by TP; k by KV heads, one KV head's slice on tp / num_kv_heads
    ranks when fewer.

    Attributes:
        kv_heads: the weight spans the KV heads (else the query heads).
    """

    _: KW_ONLY
    dtype: str | None = None
    kv_heads: bool = False


@dataclass(frozen=True)
class Attention(Rule):
    """vLLM's attention layer: no checkpoint tensor of its own, only buffers (unit scales, and the
    quantized KV-cache method's parameters).

    Attributes:
        kv_cache: the quant config gives the layer a KV-cache method; False for MLA (`MLAAttention`
            is not an `Attention`: no FP8 k/v/q/prob_scale parameters).
        kv_heads_split_only: vLLM splits the KV heads and never replicates them (gpt-oss's
            `OAIAttention`: num_key_value_heads // tp), so --tp must divide num_key_value_heads.
    """

    _: KW_ONLY
    kv_cache: bool = True
    kv_heads_split_only: bool = False


@dataclass(frozen=True)
class Experts(Sourced):
    """Routed MoE experts, one checkpoint tensor per expert and projection, stacked into vLLM's
    w13 [gate; up] and w2 (down), split by TP or whole experts by EP.

    Attributes:
        source: the checkpoint prefix of the experts list (`mlp.experts`).
        names: the checkpoint names of (gate, up, down) under each expert (vLLM's
            `ckpt_gate_proj_name`, `ckpt_up_proj_name`, `ckpt_down_proj_name`).
        tp_at_most_experts: vLLM refuses a tensor-parallel size above the number of experts.
    """

    _: KW_ONLY
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    tp_at_most_experts: bool = False


@dataclass(frozen=True)
class FusedExperts(Rule):
    """Routed experts stacked per layer in one checkpoint tensor per projection (gpt-oss, Llama-4):
    bf16 `{p}` [E, in, out], or MXFP4 `{p}_blocks` / `{p}_scales`, with `{p}_bias` (gpt-oss).

    Attributes:
        gate_up / down: the checkpoint names of the two projections.
        halves: `gate_up`'s output columns are all gate then all up (Llama-4), not interleaved
            gate/up pairs (gpt-oss).
        tp_at_most_experts: vLLM refuses a tensor-parallel size above the number of experts.
    """

    gate_up: str
    down: str
    _: KW_ONLY
    halves: bool = False
    tp_at_most_experts: bool = False
