"""One rule of the table -> its tensors on every rank, by its style: `SLICERS` maps each style class
of reshard.rules to its slicer.

Linear styles live in reshard.plan.linear, routed experts in reshard.plan.experts and
reshard.plan.fusedexperts; the vocabulary (embedding, lm_head), the attention buffers and the per-head
parameters, which have no quantized weight, are here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reshard.errors import SourceError, UnsupportedError
from reshard.plan.context import Context
from reshard.plan.experts import experts
from reshard.plan.fusedexperts import fused_experts
from reshard.plan.geometry import cdiv, divisors
from reshard.plan.kvscales import KvHeads
from reshard.plan.linear import column, merged, qkv, replicate, row
from reshard.plan.model import Fill, OutTensor, Piece, Slice, rows
from reshard.rules import (
    QKV,
    Attention,
    Column,
    Experts,
    FusedExperts,
    HeadNorm,
    Heads,
    Merged,
    Replicate,
    Row,
    Rule,
    Vocab,
)

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE

# a slicer appends one rule, under a layer's prefix ("" for a top module), to every rank's tensors
Slicer = Callable[[Context, Any, str, list[list[OutTensor]]], None]


def padded_vocab(vocab: int) -> int:
    return cdiv(vocab, VOCAB_PADDING) * VOCAB_PADDING


def add_module(ctx: Context, m: Rule, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append rule `m`, under `prefix` ("" for a top module), to every rank's tensors."""
    slicer = SLICERS.get(type(m))
    if slicer is None:
        raise AssertionError(f"{prefix}{m.name}: no slicer for the style {type(m).__name__}")
    slicer(ctx, m, prefix, per_tp)


def attention(ctx: Context, m: Attention, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """The attention layer's buffers: vLLM's unit scales, plus the quantized KV-cache method's."""
    target = prefix + m.name
    kv = ctx.dims.num_kv_heads
    if m.kv_heads_split_only and kv % ctx.tp:
        raise UnsupportedError(
            f"num_key_value_heads={kv} is not divisible by --tp {ctx.tp}: vLLM's {ctx.arch.names[0]} "
            "gives each rank num_key_value_heads // tp heads and fails to build with fewer than one",
            f"use a --tp that divides it: {divisors(kv)}",
        )
    buffers = [
        OutTensor(f"{target}.{s}", "F32", (), (Fill(1.0, 1),))
        for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    ]
    # ModelOpt gives MLA attention a KV-cache method too (ModelOptQuantConfigBase.get_quant_method): issue 26
    quant = ctx.quant if m.kv_cache or getattr(ctx.quant, "mla_kv_cache", False) else None
    found = ctx.kv_found(target) if quant else {}
    for r in range(ctx.tp):
        per_tp[r].extend(buffers)
        if quant:
            per_tp[r].extend(quant.kv_buffers(ctx, target, ctx.dtype, found, KvHeads(ctx.dims.num_kv_heads, ctx.tp, r)))


def heads(ctx: Context, m: Heads, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """A per-head vector (gpt-oss `sinks`): rank r holds heads [r * n, (r + 1) * n), n = heads / tp."""
    target = prefix + m.name
    t = ctx.src(f"{prefix}{m.hf}.{m.param}", target)
    if t.shape != (ctx.dims.num_heads,):
        raise SourceError(
            f"{t.name} has shape {list(t.shape)}, expected [{ctx.dims.num_heads}] (config.json num_attention_heads)"
        )
    n = ctx.dims.num_heads // ctx.tp  # check_attention: num_heads divides by tp
    for r in range(ctx.tp):
        per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, (n,), (rows(t, r * n, (r + 1) * n),)))


def vocab(ctx: Context, m: Vocab, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Embedding / lm_head rows, padded to a multiple of 64 with zero rows, then split."""
    target = prefix + m.name
    if ctx.quant is not None and ctx.quant.quantizes_lm_head() and prefix + m.hf == ctx.arch.lm_head:
        _quantized_lm_head(ctx, m, prefix, per_tp)
        return
    source = prefix + (m.tied if (m.tied and ctx.dims.tie) else m.hf)
    t = ctx.src(f"{source}.weight", target)
    v, h = ctx.dims.vocab, ctx.dims.hidden
    if t.shape != (v, h):
        raise SourceError(
            f"{t.name} has shape {list(t.shape)}, expected {[v, h]} (from config.json vocab_size and hidden_size)",
            "the tensor is transposed or reshaped, or config.json does not match the weights",
        )
    n = padded_vocab(v) // ctx.tp
    for r in range(ctx.tp):
        a, b = min(r * n, v), min((r + 1) * n, v)
        pieces: list[Piece] = []
        if b > a:
            pieces.append(rows(t, a, b))
        if n - (b - a):
            pieces.append(Fill(0.0, (n - (b - a)) * h))
        per_tp[r].append(OutTensor(f"{target}.weight", ctx.dtype, (n, h), tuple(pieces)))


def _quantized_lm_head(ctx: Context, m: Vocab, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """GPTQ's `lm_head: true`: vLLM's ParallelLMHead with the GPTQ linear method, its packed [hidden, vocab]
    parameters split over the vocabulary as a column-parallel layer's output; loaded only where the vocabulary
    needs no padding (vLLM's loader fails otherwise: the padded rows have no packed counterpart)."""
    v = ctx.dims.vocab
    if ctx.dims.tie:
        raise UnsupportedError(
            f"{ctx.quant.method} with a quantized lm_head (lm_head: true) and tie_word_embeddings: vLLM ties the "
            "lm_head to the unquantized embedding",
            "use a checkpoint whose lm_head is not quantized, or not tied",
        )
    if padded_vocab(v) != v:
        raise UnsupportedError(
            f"a quantized lm_head (lm_head: true) over vocab_size {v}: vLLM pads the vocabulary to "
            f"{padded_vocab(v)} and fails to load its packed weights",
            "use a checkpoint whose lm_head is not quantized",
        )
    column(ctx, Column(m.name, m.hf, dims=("vocab_size", "hidden_size")), prefix, per_tp)


def head_norm(ctx: Context, m: HeadNorm, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """A norm weight over every head, split like the heads (vLLM minimax_rms_norm.MiniMaxText01RMSNormTP):
    query heads into tp equal parts; KV heads into tp parts, or into num_kv_heads parts when fewer,
    rank r holding part r // (tp // num_kv_heads)."""
    target = prefix + m.name
    t = ctx.src(f"{prefix}{m.hf}.weight", target)
    heads = ctx.dims.num_kv_heads if m.kv_heads else ctx.dims.num_heads
    if len(t.shape) != 1 or t.shape[0] % heads:
        raise SourceError(
            f"{t.name} has shape {list(t.shape)}, expected one weight per element of {heads} heads",
            "the checkpoint does not match its config.json",
        )
    parts, per = (ctx.tp, 1) if heads >= ctx.tp else (heads, ctx.tp // heads)
    n = ctx.split(t.shape[0], f"size of {target}") if parts == ctx.tp else t.shape[0] // parts
    for r in range(ctx.tp):
        k = r // per
        per_tp[r].append(
            OutTensor(f"{target}.weight", m.dtype or ctx.dtype, (n,), (Slice(t.name, (k * n,), ((k + 1) * n,)),))
        )


SLICERS: dict[type[Rule], Slicer] = {
    Replicate: replicate,
    Column: column,
    Row: row,
    Merged: merged,
    QKV: qkv,
    Vocab: vocab,
    Heads: heads,
    HeadNorm: head_norm,
    Attention: attention,
    Experts: experts,
    FusedExperts: fused_experts,
}
