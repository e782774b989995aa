"""Routed MoE experts: every expert's gate/up/down stacked into vLLM's w13 [gate; up] and w2 (down).

Under tensor parallelism every rank holds a slice of every expert's intermediate size; under expert
parallelism (--ep) whole experts, split linearly across ranks. Each expert's tensors are looked up
and checked once per layer, then sliced per rank. Some of vLLM's MoE backends allocate a larger
per-rank intermediate size (reshard.plan.backends): the rest is zeros.
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan import backends, nvfp4
from reshard.plan.context import Context
from reshard.plan.geometry import MoeSplit, divisors, refuse_tp_above_experts
from reshard.plan.model import OutTensor, padded_cols_each, padded_rows_each
from reshard.plan.quant import Quant
from reshard.rules import Experts


def experts(ctx: Context, m: Experts, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append the experts module `m` of the layer at `prefix` to every rank."""
    split = _split(ctx, m, prefix)
    scheme = ctx.quant if ctx.quantized_experts(split.base, m.names) else None
    split = _allocation(ctx, split, scheme)
    if scheme is not None and scheme.k_first:  # GPTQ / AWQ: the scheme lays out the weights too
        rank = scheme.expert_scales(ctx, split)
        for r in range(ctx.tp):
            per_tp[r].extend(rank(r))
        return
    weights = _weights(ctx, split, scheme)
    scales = scheme.expert_scales(ctx, split) if scheme else None
    wdtype = scheme.weight_dtype if scheme else ctx.dtype
    param, pk = (scheme.weight_param, scheme.pack) if scheme else ("weight", 1)  # packed along the input dim
    width, hidden = split.width, split.hidden
    gate_up = tuple(w.name for g, u, _ in weights for w in (g, u))  # tuples: TP ranks share one (a whole slice)
    down = tuple(dn.name for _, _, dn in weights)
    for r in range(ctx.tp):
        local = split.experts(r)
        start, size = split.real(r)
        # every expert's pieces of this rank at once, their bounds shared (issue 28); none for the layout alone
        w13 = w2 = ()
        if ctx.pieces:
            w13 = padded_rows_each(gate_up[2 * local.start : 2 * local.stop], start, size, width, hidden // pk, 0.0)
            w2 = padded_cols_each(down[local.start : local.stop], hidden, start // pk, size // pk, width // pk, 0.0)
        n = len(local)
        per_tp[r].append(OutTensor(f"{split.target}.w13_{param}", wdtype, (n, 2 * width, hidden // pk), w13))
        per_tp[r].append(OutTensor(f"{split.target}.w2_{param}", wdtype, (n, hidden, width // pk), w2))
        if scales:
            per_tp[r].extend(scales(r))


def _allocation(ctx: Context, split: MoeSplit, scheme: Quant | None) -> MoeSplit:
    """The per-rank size vLLM allocates with the asked --moe-backend, and what the serve line pins."""
    backend, ip = ctx.moe_backend, split.ip
    if backend != "auto":
        ctx.moe_pin = backend  # asked for: the serve line names it, whatever the layout
    if scheme is None:
        if backend == "humming" and backends.unquantized_depends(ip):
            raise UnsupportedError(
                f"--moe-backend humming: vLLM serves {split.target}'s unquantized experts with auto's choice, "
                f"whose layout depends on the GPU for a per-rank intermediate size of {ip}",
                "use --moe-backend triton or flashinfer_trtllm for this model",
            )
        alloc = backends.unquantized_alloc(backend, ip)
        if backend == "auto" and backends.unquantized_depends(ip):
            ctx.moe_pin = "triton"
            ctx.note(backends.pin_note(ip, backends.unquantized_alloc("flashinfer_trtllm", ip)))
        elif alloc != ip:
            ctx.note(backends.round_note(backend, ip, alloc))
        return replace(split, alloc=alloc) if alloc != ip else split
    if isinstance(scheme, nvfp4._Nvfp4):  # issue 26: NVFP4 experts; ModelOpt's EP input scales follow the backend
        backends.nvfp4_backend(backend)
        if not isinstance(scheme, nvfp4.ModelOptNvfp4):
            return split
        split, pin = scheme.moe_split(ctx, backend, split)
        ctx.moe_pin = pin or ctx.moe_pin
        return split
    if scheme.block is None or not getattr(scheme, "refines_moe_blocks", False):
        return split  # per-tensor / per-channel / compressed-tensors experts: one layout for every backend
    bn = scheme.block[0]
    refinable = backends.refined_block(scheme.block, ip, split.moe_tp, split.hidden) is not None
    if not backends.fp8_block_pads(backend, scheme.block, ip, split.moe_tp, refinable):
        return split
    if split.inter % bn or split.hidden % bn:
        raise UnsupportedError(
            f"--moe-backend {backend}: vLLM pads {split.target}'s TP shard to whole {bn}-blocks only when the "
            f"intermediate size ({split.inter}) and hidden size ({split.hidden}) are multiples of {bn}",
            "vLLM refuses this layout; use --ep, or --moe-backend auto",
        )
    alloc = -(-ip // bn) * bn
    ctx.note(backends.pad_note(backend, ip, alloc, split.inter, ctx.tp))
    return replace(split, alloc=alloc, blocked=True)


def _split(ctx: Context, m: Experts, prefix: str) -> MoeSplit:
    """How this layer's experts cut across ranks; refused where vLLM refuses the layout."""
    d, tp = ctx.dims, ctx.tp
    split = MoeSplit(
        target=prefix + m.name,
        base=prefix + m.hf,
        names=m.names,
        num=d.num_experts,
        inter=d.moe_intermediate,
        hidden=d.hidden,
        tp=tp,
        ep=ctx.ep,
        dtype=ctx.dtype,
    )
    if m.tp_at_most_experts:
        refuse_tp_above_experts(tp, split.num)
    if ctx.ep and split.num < tp:
        raise UnsupportedError(f"--ep with --tp {tp} needs at least {tp} experts, the model has {split.num}")
    if split.inter % split.moe_tp:
        raise UnsupportedError(
            f"moe intermediate size {split.inter} is not divisible by --tp {tp}",
            f"use --ep, or a --tp that divides it: {divisors(split.inter)}",
        )
    return split


_SHAPE = attrgetter("shape")


def _weights(ctx: Context, split: MoeSplit, scheme: Quant | None) -> list[tuple[TensorInfo, TensorInfo, TensorInfo]]:
    """Every expert's (gate, up, down) weight, shapes and dtype checked."""
    inter, hidden = split.inter, split.hidden
    param, pk = (scheme.weight_param, scheme.pack) if scheme else ("weight", 1)
    if split.ip % pk or hidden % pk:
        raise UnsupportedError(
            f"{split.target}: per-rank intermediate size {split.ip} or hidden size {hidden} cuts the weights "
            f"packed {pk} to an int32",
            "use --ep, or a smaller --tp",
        )
    found = split.tensors(ctx, split.names, param)  # in bulk (issue 28); None: one by one, as their errors say
    shapes = ((inter, hidden // pk), (inter, hidden // pk), (hidden, inter // pk))
    if found is not None and scheme is None:  # a layer's experts checked at once (issue 28)
        columns = zip(*found, strict=True)  # every expert's gate, then up, then down
        if [set(map(_SHAPE, c)) for c in columns] == [{shape} for shape in shapes]:
            return found
    # one by one, to name the tensor that is wrong (or the scheme checks each)
    out = []
    for e in range(split.num):
        g, u, dn = found[e] if found is not None else (split.tensor(ctx, e, proj, param) for proj in split.names)
        for w, shape in zip((g, u, dn), shapes, strict=True):
            if w.shape != shape:
                raise SourceError(f"{w.name} has shape {list(w.shape)}, expected {list(shape)}")
            if scheme:
                scheme.check_weight(w)
        out.append((g, u, dn))
    return out
