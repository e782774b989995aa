"""One module of the rule table -> its tensors on every rank, by kind.

Linear kinds live in reshard.plan.linear, routed experts in reshard.plan.experts; the vocabulary
(embedding, lm_head) and the attention buffers, which have no quantized weight, are here.
"""

from __future__ import annotations

from reshard.errors import SourceError
from reshard.plan.context import Context
from reshard.plan.experts import experts
from reshard.plan.fusedexperts import fused_experts
from reshard.plan.geometry import cdiv
from reshard.plan.kvscales import KvHeads
from reshard.plan.linear import linear
from reshard.plan.model import Fill, OutTensor, Piece, Slice, rows
from reshard.rules import Kind, Module

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab: int) -> int:
    return cdiv(vocab, VOCAB_PADDING) * VOCAB_PADDING


def add_module(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append module `m`, under `prefix` ("" for a top module), to every rank's tensors."""
    if m.kind is Kind.ATTENTION:
        attention(ctx, m, prefix, per_tp)
    elif m.kind is Kind.EXPERTS:
        experts(ctx, m, prefix, per_tp)
    elif m.kind is Kind.FUSED_EXPERTS:
        fused_experts(ctx, m, prefix, per_tp)
    elif m.kind is Kind.HEADS:
        heads(ctx, m, prefix, per_tp)
    elif m.kind is Kind.VOCAB:
        vocab(ctx, m, prefix, per_tp)
    elif m.kind is Kind.HEAD_NORM:
        head_norm(ctx, m, prefix, per_tp)
    else:
        linear(ctx, m, prefix, per_tp)


def attention(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """The attention layer's buffers: vLLM's unit scales, plus the quantized KV-cache method's."""
    target = prefix + m.name
    buffers = [
        OutTensor(f"{target}.{s}", "F32", (), (Fill(1.0, 1),))
        for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    ]
    quant = ctx.quant if m.quant else None
    found = ctx.kv_found(target) if quant else {}
    for r in range(ctx.tp):
        per_tp[r].extend(buffers)
        if quant:
            per_tp[r].extend(quant.kv_buffers(ctx, target, ctx.dtype, found, KvHeads(ctx.dims.num_kv_heads, ctx.tp, r)))


def heads(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """A per-head vector (gpt-oss `sinks`): rank r holds heads [r * n, (r + 1) * n), n = heads / tp."""
    target = prefix + m.name
    t = ctx.src(f"{prefix}{m.slots[0]}.{m.param}", target)
    if t.shape != (ctx.dims.num_heads,):
        raise SourceError(
            f"{t.name} has shape {list(t.shape)}, expected [{ctx.dims.num_heads}] (config.json num_attention_heads)"
        )
    n = ctx.dims.num_heads // ctx.tp  # check_attention: num_heads divides by tp
    for r in range(ctx.tp):
        per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, (n,), (rows(t, r * n, (r + 1) * n),)))


def vocab(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Embedding / lm_head rows, padded to a multiple of 64 with zero rows, then split."""
    target = prefix + m.name
    source = prefix + (m.tied if (m.tied and ctx.dims.tie) else m.slots[0])
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


def head_norm(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """A norm weight over every head, split like the heads (vLLM minimax_rms_norm.MiniMaxText01RMSNormTP):
    query heads into tp equal parts; KV heads into tp parts, or into num_kv_heads parts when fewer,
    rank r holding part r // (tp // num_kv_heads)."""
    target = prefix + m.name
    t = ctx.src(f"{prefix}{m.slots[0]}.weight", target)
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
