"""Routed MoE experts: every expert's gate/up/down stacked into vLLM's w13 [gate; up] and w2 (down).

Under tensor parallelism every rank holds a slice of every expert's intermediate size; under expert
parallelism (--ep) whole experts, split linearly across ranks. Each expert's tensors are looked up
and checked once per layer, then sliced per rank.
"""

from __future__ import annotations

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.context import Context
from reshard.plan.geometry import MoeSplit, divisors
from reshard.plan.model import OutTensor, Slice
from reshard.plan.quant import Quant
from reshard.rules import Module


def experts(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append the experts module `m` of the layer at `prefix` to every rank."""
    split = _split(ctx, m, prefix)
    scheme = ctx.quant if ctx.quantized(m, [split.base]) else None
    weights = _weights(ctx, split, scheme)
    scales = scheme.expert_scales(ctx, split) if scheme else None
    wdtype = scheme.weight_dtype if scheme else ctx.dtype
    ip, hidden = split.ip, split.hidden
    for r in range(ctx.tp):
        local = split.experts(r)
        off = split.shard(r) * ip
        # every expert's slice has the same bounds: one pair of tuples for all of them
        r13, r2 = ((off, 0), (off + ip, hidden)), ((0, off), (hidden, off + ip))
        w13 = tuple(Slice(w.name, *r13) for e in local for w in weights[e][:2])
        w2 = tuple(Slice(weights[e][2].name, *r2) for e in local)
        n = len(local)
        per_tp[r].append(OutTensor(f"{split.target}.w13_weight", wdtype, (n, 2 * ip, hidden), w13))
        per_tp[r].append(OutTensor(f"{split.target}.w2_weight", wdtype, (n, hidden, ip), w2))
        if scales:
            per_tp[r].extend(scales(r))


def _split(ctx: Context, m: Module, prefix: str) -> MoeSplit:
    """How this layer's experts cut across ranks; refused where vLLM refuses the layout."""
    d, tp = ctx.dims, ctx.tp
    split = MoeSplit(
        target=prefix + m.name,
        base=prefix + m.slots[0],
        names=m.expert_names,
        num=d.num_experts,
        inter=d.moe_intermediate,
        hidden=d.hidden,
        tp=tp,
        ep=ctx.ep,
    )
    if ctx.arch.tp_at_most_experts and tp > split.num:
        raise UnsupportedError(f"--tp {tp} is greater than the number of experts {split.num}; vLLM refuses this")
    if ctx.ep and split.num < tp:
        raise UnsupportedError(f"--ep with --tp {tp} needs at least {tp} experts, the model has {split.num}")
    if split.inter % split.moe_tp:
        raise UnsupportedError(
            f"moe intermediate size {split.inter} is not divisible by --tp {tp}",
            f"use --ep, or a --tp that divides it: {divisors(split.inter)}",
        )
    return split


def _weights(ctx: Context, split: MoeSplit, scheme: Quant | None) -> list[tuple[TensorInfo, TensorInfo, TensorInfo]]:
    """Every expert's (gate, up, down) weight, shapes and dtype checked."""
    inter, hidden = split.inter, split.hidden
    gate, up, down = split.names
    out = []
    for e in range(split.num):
        g, u, dn = (split.tensor(ctx, e, proj, "weight") for proj in (gate, up, down))
        for w, shape in ((g, (inter, hidden)), (u, (inter, hidden)), (dn, (hidden, inter))):
            if w.shape != shape:
                raise SourceError(f"{w.name} has shape {list(w.shape)}, expected {list(shape)}")
            if scheme:
                scheme.check_weight(w)
        out.append((g, u, dn))
    return out
