"""Linear layers and plain parameters: replicate, column, row, merged and qkv modules.

A module has one or more slots (q, k, v / gate, up), each a separate HF tensor or a row range of one
fused HF tensor. Column-parallel kinds give every rank a row range of each slot; row-parallel ones
a column range of the whole weight; replicated ones all of it.
"""

from __future__ import annotations

from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.plan.context import Context
from reshard.plan.geometry import LinearRank
from reshard.plan.model import OutTensor, Slice, rows, whole
from reshard.rules import Kind, Module

COLUMN_KINDS = (Kind.COLUMN, Kind.MERGED, Kind.QKV)


def linear(ctx: Context, m: Module, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append module `m` of the layer at `prefix` (its weight, scales and bias) to every rank."""
    target = prefix + m.name
    slots = [prefix + s for s in m.slots]
    if m.quant is False and m.kind is Kind.REPLICATE:
        # norms and other plain parameters: whole, model dtype unless vLLM fixes one
        t = ctx.src(f"{slots[0]}.{m.param}", target)
        for r in range(ctx.tp):
            per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, t.shape, (whole(t),)))
        return
    if m.quant is False and m.kind in (Kind.COLUMN, Kind.MERGED):
        _plain_rows(ctx, m, target, slots, per_tp)
        return
    if m.param != "weight":
        raise AssertionError(f"{target}: only plain replicated parameters may be named {m.param!r}")
    weights, offs, outs = slot_sources(ctx, m, target, slots)
    check_shapes(ctx, m, weights, outs)
    quant = ctx.quantized(m, slots)
    in_size = weights[0].shape[1]
    bias = ctx.flag(m.bias)
    if m.kind is Kind.ROW:
        in_r = ctx.split(in_size, f"input size of {target}")
    scheme = ctx.quant if quant else None
    if scheme:
        for w in weights:
            scheme.check_weight(w)
    wdtype = scheme.weight_dtype if scheme else (m.dtype or ctx.dtype)
    for r in range(ctx.tp):
        slot_rows = rank_rows(ctx, m, target, outs, r)  # per slot: (start, stop, shard index)
        cols = (r * in_r, (r + 1) * in_r) if m.kind is Kind.ROW else (0, in_size)
        pieces = tuple(
            p
            for i, (w, o, (a, b, _)) in enumerate(zip(weights, offs, slot_rows, strict=True))
            for p in _rows_of(ctx, m, i, w.name, o + a, o + b, outs[i], cols)
        )
        shape = (sum(b - a for a, b, _ in slot_rows), cols[1] - cols[0])
        per_tp[r].append(OutTensor(f"{target}.weight", wdtype, shape, pieces))
        if scheme:
            lin = LinearRank(
                target=target,
                slots=tuple(slots),
                fused=m.fused,
                outs=tuple(outs),
                offs=tuple(offs),
                rows=tuple(slot_rows),
                in_size=in_size,
                cols=cols,
                splits_rows=m.kind in COLUMN_KINDS and ctx.tp > 1,
                splits_cols=m.kind is Kind.ROW and ctx.tp > 1,
            )
            per_tp[r].extend(scheme.linear_scales(ctx, lin))
        if bias:
            per_tp[r].append(_bias(ctx, m, target, slots, offs, slot_rows))


def _rows_of(
    ctx: Context, m: Module, slot: int, name: str, a: int, b: int, out: int, cols: tuple[int, int]
) -> list[Slice]:
    """Rows [a, b) of slot `slot`; per head even rows then odd rows where the rule says vLLM reorders them."""
    if slot not in m.deinterleave:
        return [Slice(name, (a, cols[0]), (b, cols[1]))]
    hd = out // (ctx.dims.num_heads if slot == 0 else ctx.dims.num_kv_heads)
    return [Slice(name, (h + odd, cols[0]), (h + hd, cols[1]), step=2) for h in range(a, b, hd) for odd in (0, 1)]


def _plain_rows(ctx: Context, m: Module, target: str, slots: list[str], per_tp: list[list[OutTensor]]) -> None:
    """Unquantized column-parallel parameters of any rank, cut along dim 0 (the gated delta net's
    conv1d [conv_dim, 1, kernel], A_log, dt_bias): each slot's rows split across ranks on its own,
    a rank's slots concatenated; the other dims whole."""
    ts, offs, outs = slot_sources(ctx, m, target, slots, m.param)
    rest = ts[0].shape[1:]
    for t in ts:
        if t.shape[1:] != rest:
            raise SourceError(f"{t.name} has shape {list(t.shape)}, its sibling slots {[outs[0], *rest]}")
    for r in range(ctx.tp):
        slot_rows = rank_rows(ctx, m, target, outs, r)
        pieces = tuple(
            Slice(t.name, (o + a, *(0,) * len(rest)), (o + b, *rest))
            for t, o, (a, b, _) in zip(ts, offs, slot_rows, strict=True)
        )
        shape = (sum(b - a for a, b, _ in slot_rows), *rest)
        per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, shape, pieces))


def _bias(
    ctx: Context, m: Module, target: str, slots: list[str], offs: list[int], slot_rows: list[tuple[int, int, int]]
) -> OutTensor:
    bs = [ctx.src(f"{s}.bias", target) for s in slots]
    if m.kind in (Kind.ROW, Kind.REPLICATE):
        pieces = tuple(dict.fromkeys(whole(b) for b in bs))  # a fused bias once
        n = sum(b.shape[0] for b in dict.fromkeys(bs))
    else:
        pieces = tuple(rows(b, o + a, o + e) for b, o, (a, e, _) in zip(bs, offs, slot_rows, strict=True))
        n = sum(e - a for a, e, _ in slot_rows)
    return OutTensor(f"{target}.bias", m.dtype or ctx.dtype, (n,), pieces)


def check_shapes(ctx: Context, m: Module, weights: list[TensorInfo], outs: list[int]) -> None:
    """Each slot's HF weight against config.json (the module's `dims`; a row-parallel layer feeds the
    residual stream, so its rows are `hidden_size`) and against its sibling slots: a transposed or
    reshaped tensor would otherwise be sliced into garbage that loads without a word."""
    rows_key, cols_key = m.dims
    if m.kind is Kind.ROW and rows_key is None:
        rows_key = "hidden_size"
    for w, n in zip(weights, outs, strict=True):
        if len(w.shape) != 2:
            raise SourceError(f"{w.name} has shape {list(w.shape)}; a linear weight is 2-D")
        want = (_config_int(ctx, rows_key) or n, _config_int(ctx, cols_key) or weights[0].shape[1])
        if (n, w.shape[1]) != want:
            got = list(w.shape) if not m.fused else f"{n} rows of {list(w.shape)}"
            said = " and ".join(f"{k}" for k in (rows_key, cols_key) if k) or "the other slots"
            raise SourceError(
                f"{w.name} has shape {got}, expected {list(want)} (from config.json {said})",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )


def _config_int(ctx: Context, key: str | None) -> int | None:
    value = ctx.config.get(key) if key else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def slot_sources(
    ctx: Context, m: Module, target: str, slots: list[str], param: str = "weight"
) -> tuple[list[TensorInfo], list[int], list[int]]:
    """Each slot's HF weight, its first row there and its global row count.

    Separate HF tensors: one per slot, from row 0. A fused HF tensor (Phi-3): the slots are
    consecutive row ranges of it, sized as vLLM's `_load_fused_module_from_checkpoint`
    does: q/k/v by the head counts, other merged layers in equal parts. Slots sized by config
    keys (`Module.sizes`): consecutive slots of one HF tensor are consecutive row ranges of it.
    """
    if m.sizes:
        return _sized_slots(ctx, m, target, slots, param)
    if not m.fused:
        weights = [ctx.src(f"{s}.weight", target) for s in slots]
        return weights, [0] * len(weights), [w.shape[0] for w in weights]
    w = ctx.src(f"{slots[0]}.weight", target)
    total, n = w.shape[0], len(m.fused)
    if m.kind is Kind.QKV:
        d = ctx.dims
        heads = d.num_heads + 2 * d.num_kv_heads
        if n != 3 or total % heads:
            raise SourceError(f"{w.name}: {total} rows do not split into q/k/v of {d.num_heads}/{d.num_kv_heads} heads")
        hd = total // heads
        outs = [d.num_heads * hd, d.num_kv_heads * hd, d.num_kv_heads * hd]
    else:
        if total % n:
            raise SourceError(f"{w.name}: {total} rows do not split into {n} equal parts ({', '.join(m.fused)})")
        outs = [total // n] * n
    offs = [sum(outs[:i]) for i in range(n)]
    return [w] * n, offs, outs


def _sized_slots(
    ctx: Context, m: Module, target: str, slots: list[str], param: str
) -> tuple[list[TensorInfo], list[int], list[int]]:
    if len(m.sizes) != len(slots):
        raise AssertionError(f"{target}: {len(m.sizes)} sizes for {len(slots)} slots")
    ts, offs, outs = [], [], []
    for i, (slot, keys) in enumerate(zip(slots, m.sizes, strict=True)):
        t = ctx.src(f"{slot}.{param}", target)
        n = 1
        for key in keys:
            value = _config_int(ctx, key)
            if value is None:
                raise SourceError(f"config.json lacks {key!r}, which sizes vLLM's {target}")
            n *= value
        offs.append(offs[-1] + outs[-1] if i and slots[i - 1] == slot else 0)
        ts.append(t)
        outs.append(n)
    for i, t in enumerate(ts):
        last = i + 1 == len(ts) or slots[i + 1] != slots[i]
        if last and (not t.shape or t.shape[0] != offs[i] + outs[i]):
            keys = " + ".join("*".join(k) for s, k in zip(slots, m.sizes, strict=True) if s == slots[i])
            raise SourceError(
                f"{t.name} has shape {list(t.shape)}, expected {offs[i] + outs[i]} rows (from config.json {keys})",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )
    return ts, offs, outs


def rank_rows(ctx: Context, m: Module, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    """Per slot, rank r's rows [start, stop) of it and which shard of the slot they are."""
    if m.kind in (Kind.ROW, Kind.REPLICATE):
        return [(0, o, 0) for o in outs]
    if m.kind is Kind.QKV:
        return _qkv_rows(ctx, target, outs, r)
    out = []
    for i, o in enumerate(outs):
        n = ctx.split(o, f"output size of {target} (slot {i})")
        out.append((r * n, (r + 1) * n, r))
    return out


def _qkv_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    """q by heads; k and v by KV heads, each replicated on tp / num_kv_heads ranks when fewer."""
    d, tp = ctx.dims, ctx.tp
    q, k, v = outs
    # head sizes from the weights: vLLM's Qwen2 ignores config.head_dim, others use it
    if q % d.num_heads or k % d.num_kv_heads or v % d.num_kv_heads:
        raise SourceError(f"{target}: q/k/v rows {q}/{k}/{v} do not split into {d.num_heads}/{d.num_kv_heads} heads")
    qn = q // tp
    if tp >= d.num_kv_heads:
        kv_per_rank, shard = 1, r // (tp // d.num_kv_heads)
    else:
        kv_per_rank, shard = d.num_kv_heads // tp, r
    kn, vn = kv_per_rank * (k // d.num_kv_heads), kv_per_rank * (v // d.num_kv_heads)
    return [
        (r * qn, (r + 1) * qn, r),
        (shard * kn, (shard + 1) * kn, shard),
        (shard * vn, (shard + 1) * vn, shard),
    ]
