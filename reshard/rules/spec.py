"""The vocabulary of split rules: what kind of layer a vLLM module is, and where its HF tensors live.

An architecture is a table of `Module`s; the planner turns each kind into per-rank tensors. Nothing
here knows about bytes or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    REPLICATE = "replicate"  # whole tensor on every rank (norms, router gates, replicated linears)
    COLUMN = "column"  # output rows split across ranks; bias split the same way
    ROW = "row"  # input columns split across ranks; bias whole on every rank
    VOCAB = "vocab"  # embedding / lm_head rows, padded to a multiple of 64, then split
    QKV = "qkv"  # fused [q; k; v] rows; KV heads replicated when tp > num_kv_heads
    MERGED = "merged"  # fused column slots, e.g. [gate; up]
    EXPERTS = "experts"  # routed MoE experts -> w13 [gate; up] and w2 (down), by TP or EP
    ATTENTION = "attention"  # attention layer buffers; no source tensor
    HEADS = "heads"  # a 1-D per-attention-head parameter, split by heads (gpt-oss attention sinks)
    # routed experts stacked per layer in one HF tensor per projection (gpt-oss): `sources` are the
    # (gate_up, down) prefixes; bf16 `{p}` [E, in, out] or MXFP4 `{p}_blocks`/`{p}_scales`, `{p}_bias`
    FUSED_EXPERTS = "fused_experts"
    # a 1-D parameter over every head (MiniMax-M2's q_norm / k_norm over all heads): split like the
    # heads, q by TP, k by KV heads (one KV head's slice on tp / num_kv_heads ranks when fewer)
    HEAD_NORM = "head_norm"


@dataclass(frozen=True)
class Module:
    """One vLLM module and where its weights come from in the HF checkpoint.

    Attributes:
        name: vLLM path, relative to the decoder layer (`self_attn.qkv_proj`) or the model root.
        kind: how the module is split.
        sources: HF paths of its slots, in order (q, k, v / gate, up); empty means `(name,)`.
            For EXPERTS: the HF prefix of the experts list (`mlp.experts`).
        bias: whether the module has a bias: a literal, or the config key that says so.
        quant: whether the checkpoint's weight quantization can apply (a Linear that vLLM builds
            with the quant config). False for embeddings, norms and routers built without it.
            For ATTENTION, False means the quant config gives the layer no KV-cache
            method (MLA), so no FP8 k/v/q/prob_scale parameters.
        expert_names: EXPERTS only: the HF names of (gate, up, down) under each expert.
        tied: VOCAB only: when config.tie_word_embeddings, the module whose weight it shares.
        when: the module exists only if this config key is truthy, or this predicate of the
            config holds (DeepSeek's q_lora_rank, shared experts, noaux_tc bias).
        param: the parameter's name under both the vLLM and the HF module (REPLICATE, not
            quantized), e.g. `e_score_correction_bias`.
        dtype: the parameter's dtype (safetensors code) when vLLM fixes it, e.g. "F32";
            None is the model dtype.
        fused: the HF checkpoint stores all slots stacked along the rows of one tensor
            (`sources[0]`, Phi-3's qkv_proj / gate_up_proj); these name the slots. vLLM
            splits it with the global sizes (QKV: by the head counts; otherwise equal parts),
            then slices each slot per rank as if it had been separate.
        dims: the config keys of each slot's HF weight shape (rows, columns), checked before
            anything is written; None leaves that side unchecked (sizes config.json does not
            name directly). ROW modules always produce `hidden_size` rows (the residual stream).
        gate_up_halves: FUSED_EXPERTS only: `gate_up_proj`'s output columns are all gate then all up
            (Llama-4), not interleaved gate/up pairs (gpt-oss).
        deinterleave: QKV slots (0 q, 1 k) whose rows vLLM reorders within every head, even rows then
            odd rows, for its rotary embedding (Llama-4's `permute_qk_weight_for_rotary`).
        sizes: per slot, the config keys whose product is its row count; consecutive slots
            naming the same HF tensor are consecutive row ranges of it (vLLM's tuple shard ids,
            e.g. Qwen3.5's in_proj_qkv -> the q, k, v pieces of in_proj_qkvz; the gated delta
            net's conv1d pieces, mamba_v2_sharded_weight_loader). Each piece is split across ranks
            on its own; a rank's pieces are concatenated. Tensors of any rank (conv1d's
            [conv_dim, 1, kernel]) when the module is not quantized.
        kv_heads: HEAD_NORM only: the parameter spans the KV heads (else the query heads).
    """

    name: str
    kind: Kind
    sources: tuple[str, ...] = ()
    bias: bool | str = False
    quant: bool = True
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    tied: str | None = None
    when: str | Callable[[dict], bool] | None = None
    param: str = "weight"
    dtype: str | None = None
    fused: tuple[str, ...] = ()
    dims: tuple[str | None, str | None] = (None, None)
    gate_up_halves: bool = False
    deinterleave: tuple[int, ...] = ()
    sizes: tuple[tuple[str, ...], ...] = ()
    kv_heads: bool = False

    @property
    def slots(self) -> tuple[str, ...]:
        return self.sources or (self.name,)

    def present(self, config: dict) -> bool:
        if self.when is None:
            return True
        if isinstance(self.when, str):
            return bool(config.get(self.when))
        return bool(self.when(config))


def replicate(name: str, source: str | None = None, *, quant: bool = False, **kw) -> Module:
    return Module(name, Kind.REPLICATE, (source,) if source else (), quant=quant, **kw)


@dataclass(frozen=True)
class Architecture:
    """Split rules of one model family, as data.

    Attributes:
        names: the `architectures` values of config.json it covers.
        top: modules outside the decoder layers (embedding, final norm, lm_head).
        layer: modules of every decoder layer, under `layer_prefix`.
        layer_prefix: where decoder layer L's modules live, in vLLM and in the checkpoint
            (`{layer}` is replaced by L).
        embedding: the top module that is the input embedding: with pipeline parallelism it is
            on the first stage (and on the last when the lm_head is tied to it); the other top
            modules are on the last stage (unless top_on_every_stage).
        lm_head: the HF module of the output projection; a "tied" checkpoint that still ships
            its weight is written untied (as vLLM loads it), a tied one's stray copy is skipped.
        dense_mlp: the MLP of a dense layer.
        moe_mlp: the MLP of a mixture-of-experts layer.
        is_moe_layer: which layers use `moe_mlp` (config, layer index) -> bool.
        ignore: HF tensor-name suffixes that vLLM skips (e.g. rotary inv_freq).
        experts_key / moe_intermediate_key: config keys of the expert count (first found) and
            of the expert width.
        tp_at_most_experts: vLLM refuses a tensor-parallel size above the number of experts.
        top_on_every_stage: with pipeline parallelism, every top module on every stage.
        kv_heads_split_only: vLLM splits the KV heads and never replicates them (gpt-oss:
            `num_key_value_heads // tp`), so --tp must divide num_key_value_heads.
        spec_layers_key: config keys (first found) of the number of speculative (MTP) layers
            stored after the decoder layers, `model.layers.{num_hidden_layers + i}.*`, which
            vLLM's main model skips (DeepSeek-V3's num_nextn_predict_layers).
        mixers: per layer type, the layer's token mixer modules (hybrid models: Qwen3-Next's
            `linear_attention` / `full_attention`), chosen by `layer_type(config, layer)`, after
            `layer` and before the MLP.
        every_stage: top modules vLLM builds on every pipeline stage (unconditionally), whatever
            `embedding`/`top_on_every_stage` say of the others.
        skip_prefixes: checkpoint tensor-name prefixes vLLM's model does not load (`mtp.`: the
            draft model's; `model.visual.`: a vision tower not built under --language-model-only,
            which `serve_flags` then carries).
        hf_prefixes: (vLLM prefix, checkpoint prefix) pairs where the two differ: the inverse
            of vLLM's hf_to_vllm_mapper (Qwen3.5: `language_model.model.` <- `model.language_model.`).
        text_config: the config.json key whose dict holds the language model's settings (vLLM's
            hf_text_config, e.g. Llama-4's and Qwen3.5's `text_config`); its keys override the top
            level's (quantization_config stays top-level).
        serve_flags: `vllm serve` options the layout needs (--language-model-only).
    """

    names: tuple[str, ...]
    top: tuple[Module, ...]
    layer: tuple[Module, ...]
    dense_mlp: tuple[Module, ...] = ()
    moe_mlp: tuple[Module, ...] = ()
    is_moe_layer: Callable[[dict, int], bool] | None = None
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",)
    experts_key: tuple[str, ...] = ("num_experts", "num_local_experts")
    moe_intermediate_key: str = "moe_intermediate_size"
    tp_at_most_experts: bool = False
    top_on_every_stage: bool = False
    spec_layers_key: tuple[str, ...] = ()
    kv_heads_split_only: bool = False
    layer_prefix: str = "model.layers.{layer}."
    embedding: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    mixers: tuple[tuple[str, tuple[Module, ...]], ...] = ()
    layer_type: Callable[[dict, int], str] | None = None
    every_stage: tuple[str, ...] = ()
    skip_prefixes: tuple[str, ...] = ()
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    text_config: str | None = None
    serve_flags: tuple[str, ...] = ()

    def text(self, config: dict) -> dict:
        """The settings of the language model: config.json, or its text_config over it."""
        inner = config.get(self.text_config) if self.text_config else None
        return {**config, **inner} if isinstance(inner, dict) else config

    def layer_modules(self, config: dict, layer: int) -> tuple[Module, ...]:
        """Decoder layer `layer`'s modules before its MLP: the common ones, then its mixer's."""
        if not self.mixers or self.layer_type is None:
            return self.layer
        return self.layer + dict(self.mixers)[self.layer_type(config, layer)]

    def hf_name(self, name: str) -> str:
        """The checkpoint's name of a tensor named after vLLM's module path."""
        for vllm_prefix, hf_prefix in self.hf_prefixes:
            if name.startswith(vllm_prefix):
                return hf_prefix + name[len(vllm_prefix) :]
        return name

    def prefix(self, layer: int) -> str:
        """Decoder layer `layer`'s prefix (speculative layers after the last included)."""
        return self.layer_prefix.format(layer=layer)

    def layer_of(self, tensor: str) -> int | None:
        """The decoder layer a checkpoint tensor belongs to, or None (embedding, final norm, ...)."""
        head, _, tail = self.layer_prefix.partition("{layer}")
        if not tensor.startswith(head):
            return None
        number = tensor[len(head) :].split(tail, 1)[0] if tail else tensor[len(head) :]
        return int(number) if number.isdigit() else None
