"""Linear layers and plain parameters: the Replicate, Column, Row, Merged and QKV styles.

A module has one or more slots (q, k, v / gate, up), each a separate HF tensor or a row range of one
fused HF tensor. Column-parallel styles give every rank a row range of each slot; row-parallel ones
a column range of the whole weight; replicated ones all of it. Each style's slicer says so in a
`_Layout`, which the one walk below follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.context import Context
from reshard.plan.geometry import LinearRank
from reshard.plan.model import OutTensor, Slice, rows, whole
from reshard.rules import QKV, Column, Linear, Merged, Replicate, Row

# per slot, rank r's rows [start, stop) of it and which shard of the slot they are
RankRows = Callable[[Context, str, list[int], int], list[tuple[int, int, int]]]


def _whole_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    return [(0, o, 0) for o in outs]


def _split_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    out = []
    for i, o in enumerate(outs):
        n = ctx.split(o, f"output size of {target} (slot {i})")
        out.append((r * n, (r + 1) * n, r))
    return out


@dataclass(frozen=True)
class _Layout:
    """How one linear style lays its module out, for the walk.

    Attributes:
        rule: the style (its bias, dims, dtype, quant).
        slots: HF paths of its slots, relative to the layer; one per slot, or one for a fused tensor.
        rows: each rank's rows of every slot (whole, split, or by heads).
        cols: the input columns are split (row-parallel).
        fused / sizes / param: as the styles' fields of those names.
        heads: a fused tensor is cut by the head counts (q/k/v), not in equal parts.
        deinterleave: QKV's slots whose rows vLLM reorders per head.
    """

    rule: Linear
    slots: tuple[str, ...]
    rows: RankRows = _whole_rows
    cols: bool = False
    fused: tuple[str, ...] = ()
    sizes: tuple[tuple[str, ...], ...] = ()
    param: str = "weight"
    heads: bool = False
    deinterleave: tuple[int, ...] = ()


# ---- the styles --------------------------------------------------------------------------------


def replicate(ctx: Context, m: Replicate, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Whole on every rank: a plain parameter (norms: the model dtype unless vLLM fixes one), or a
    replicated linear built with the quant config."""
    if not m.quant:
        target = prefix + m.name
        t = ctx.src(f"{prefix}{m.hf}.{m.param}", target)
        for r in range(ctx.tp):
            per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, t.shape, (whole(t),)))
        return
    _linear(ctx, _Layout(m, (m.hf,), param=m.param), prefix, per_tp)


def column(ctx: Context, m: Column, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Output rows split; a tensor in config-sized pieces splits each piece."""
    lay = _Layout(m, (m.hf,) * max(1, len(m.sizes)), _split_rows, sizes=m.sizes, param=m.param)
    (_linear if m.quant else _plain_rows)(ctx, lay, prefix, per_tp)


def row(ctx: Context, m: Row, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Input columns split; the output (and the bias) whole."""
    _linear(ctx, _Layout(m, (m.hf,), cols=True), prefix, per_tp)


def merged(ctx: Context, m: Merged, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Column slots, each split on its own (whole with disable_tp)."""
    slots = (m.hf,) if m.fused else _stacked(ctx, m)
    lay = _Layout(m, slots, _whole_rows if m.disable_tp else _split_rows, fused=m.fused, sizes=m.sizes)
    (_linear if m.quant else _plain_rows)(ctx, lay, prefix, per_tp)


def qkv(ctx: Context, m: QKV, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """[q; k; v]: q by heads, k and v by KV heads (replicated when fewer than ranks)."""
    slots = (m.hf,) if m.fused else _stacked(ctx, m)
    if not m.fused and len(slots) != 3:
        raise AssertionError(f"{m.name}: {len(slots)} stacked slots, QKV needs q, k and v")
    lay = _Layout(m, slots, _qkv_rows, fused=m.fused, heads=True, deinterleave=m.deinterleave)
    _linear(ctx, lay, prefix, per_tp)


def _stacked(ctx: Context, m: Merged | QKV) -> tuple[str, ...]:
    """The slots vLLM's mapper stacks into the module (reshard.rules.spec.WeightsMapper)."""
    slots = ctx.arch.shards(m.hf)
    if not slots:
        raise AssertionError(f"{m.name}: {ctx.arch.names[0]}'s hf_to_vllm stacks nothing into {m.hf}")
    return slots


# ---- the walk ----------------------------------------------------------------------------------


def _linear(ctx: Context, lay: _Layout, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append the module of the layer at `prefix` (its weight, scales and bias) to every rank."""
    m = lay.rule
    target = prefix + m.name
    slots = [prefix + s for s in lay.slots]
    if lay.param != "weight":
        raise AssertionError(f"{target}: only plain parameters may be named {lay.param!r}")
    scheme = ctx.quant if m.quant and ctx.quantized(slots) else None
    # packed integer weights: `pk` values per stored element along the input dim
    param, pk = (scheme.weight_param, scheme.pack) if scheme else ("weight", 1)
    weights, offs, outs = slot_sources(ctx, lay, target, slots, param)
    check_shapes(ctx, lay, weights, outs, pk)
    in_size = weights[0].shape[1] * pk
    bias = ctx.flag(m.bias)
    if lay.cols:
        in_r = ctx.split(in_size, f"input size of {target}")
        if in_r % pk:
            raise UnsupportedError(
                f"{target}: per-rank input size {in_r} cuts the weights packed {pk} to an int32",
                "use a smaller --tp",
            )
    if scheme:
        for w in weights:
            scheme.check_weight(w)
    wdtype = scheme.weight_dtype if scheme else (m.dtype or ctx.dtype)
    for r in range(ctx.tp):
        slot_rows = lay.rows(ctx, target, outs, r)  # per slot: (start, stop, shard index)
        cols = (r * in_r, (r + 1) * in_r) if lay.cols else (0, in_size)
        stored = (cols[0] // pk, cols[1] // pk)
        pieces = tuple(
            p
            for i, (w, o, (a, b, _)) in enumerate(zip(weights, offs, slot_rows, strict=True))
            for p in _rows_of(ctx, lay, i, w.name, o + a, o + b, outs[i], stored)
        )
        shape = (sum(b - a for a, b, _ in slot_rows), stored[1] - stored[0])
        per_tp[r].append(OutTensor(f"{target}.{param}", wdtype, shape, pieces))
        if scheme:
            lin = LinearRank(
                target=target,
                slots=tuple(slots),
                fused=lay.fused,
                outs=tuple(outs),
                offs=tuple(offs),
                rows=tuple(slot_rows),
                in_size=in_size,
                cols=cols,
                splits_rows=lay.rows is not _whole_rows and ctx.tp > 1,
                splits_cols=lay.cols and ctx.tp > 1,
                dtype=ctx.dtype,
            )
            per_tp[r].extend(scheme.linear_scales(ctx, lin))
        if bias:
            per_tp[r].append(_bias(ctx, lay, target, slots, offs, slot_rows))


def _rows_of(
    ctx: Context, lay: _Layout, slot: int, name: str, a: int, b: int, out: int, cols: tuple[int, int]
) -> list[Slice]:
    """Rows [a, b) of slot `slot`; per head even rows then odd rows where the rule says vLLM reorders them."""
    if slot not in lay.deinterleave:
        return [Slice(name, (a, cols[0]), (b, cols[1]))]
    hd = out // (ctx.dims.num_heads if slot == 0 else ctx.dims.num_kv_heads)
    return [Slice(name, (h + odd, cols[0]), (h + hd, cols[1]), step=2) for h in range(a, b, hd) for odd in (0, 1)]


def _plain_rows(ctx: Context, lay: _Layout, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Unquantized column-parallel parameters of any rank, cut along dim 0 (the gated delta net's
    conv1d [conv_dim, 1, kernel], A_log, dt_bias): each slot's rows split across ranks on its own,
    a rank's slots concatenated; the other dims whole."""
    m = lay.rule
    target = prefix + m.name
    slots = [prefix + s for s in lay.slots]
    ts, offs, outs = slot_sources(ctx, lay, target, slots, lay.param)
    rest = ts[0].shape[1:]
    for t in ts:
        if t.shape[1:] != rest:
            raise SourceError(f"{t.name} has shape {list(t.shape)}, its sibling slots {[outs[0], *rest]}")
    for r in range(ctx.tp):
        slot_rows = lay.rows(ctx, target, outs, r)
        pieces = tuple(
            Slice(t.name, (o + a, *(0,) * len(rest)), (o + b, *rest))
            for t, o, (a, b, _) in zip(ts, offs, slot_rows, strict=True)
        )
        shape = (sum(b - a for a, b, _ in slot_rows), *rest)
        per_tp[r].append(OutTensor(f"{target}.{lay.param}", m.dtype or ctx.dtype, shape, pieces))


def _bias(
    ctx: Context, lay: _Layout, target: str, slots: list[str], offs: list[int], slot_rows: list[tuple[int, int, int]]
) -> OutTensor:
    bs = [ctx.src(f"{s}.bias", target) for s in slots]
    bs = bs * len(offs) if lay.fused else bs  # a fused tensor's bias holds every slot (Qwen2.5-VL's attn.qkv)
    if lay.rows is _whole_rows:
        pieces = tuple(dict.fromkeys(whole(b) for b in bs))  # a fused bias once
        n = sum(b.shape[0] for b in dict.fromkeys(bs))
    else:
        pieces = tuple(rows(b, o + a, o + e) for b, o, (a, e, _) in zip(bs, offs, slot_rows, strict=True))
        n = sum(e - a for a, e, _ in slot_rows)
    return OutTensor(f"{target}.bias", lay.rule.dtype or ctx.dtype, (n,), pieces)


def check_shapes(ctx: Context, lay: _Layout, weights: list[TensorInfo], outs: list[int], pk: int = 1) -> None:
    """Each slot's HF weight against config.json (the module's `dims`; a row-parallel layer feeds the
    residual stream, so its rows are `hidden_size`) and against its sibling slots: a transposed or
    reshaped tensor would otherwise be sliced into garbage that loads without a word."""
    rows_key, cols_key = lay.rule.dims
    if lay.cols and rows_key is None:
        rows_key = "hidden_size"
    for w, n in zip(weights, outs, strict=True):
        if len(w.shape) != 2:
            raise SourceError(f"{w.name} has shape {list(w.shape)}; a linear weight is 2-D")
        want = (_config_int(ctx, rows_key) or n, _config_int(ctx, cols_key) or weights[0].shape[1] * pk)
        if (n, w.shape[1] * pk) != want:
            got = list(w.shape) if not lay.fused else f"{n} rows of {list(w.shape)}"
            said = " and ".join(f"{k}" for k in (rows_key, cols_key) if k) or "the other slots"
            raise SourceError(
                f"{w.name} has shape {got}, expected {list(want)} (from config.json {said})",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )


def _config_int(ctx: Context, key: str | None) -> int | None:
    value = ctx.config.get(key) if key else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def slot_sources(
    ctx: Context, lay: _Layout, target: str, slots: list[str], param: str = "weight"
) -> tuple[list[TensorInfo], list[int], list[int]]:
    """Each slot's HF weight, its first row there and its global row count.

    Separate HF tensors: one per slot, from row 0. A fused HF tensor (Phi-3): the slots are
    consecutive row ranges of it, sized as vLLM's `_load_fused_module_from_checkpoint`
    does: q/k/v by the head counts, other merged layers in equal parts. Slots sized by config
    keys (the styles' `sizes`): consecutive slots of one HF tensor are consecutive row ranges of it.
    """
    if lay.sizes:
        return _sized_slots(ctx, lay.sizes, target, slots, param)
    if not lay.fused:
        weights = [ctx.src(f"{s}.{param}", target) for s in slots]
        return weights, [0] * len(weights), [w.shape[0] for w in weights]
    w = ctx.src(f"{slots[0]}.{param}", target)
    total, n = w.shape[0], len(lay.fused)
    if lay.heads:
        d = ctx.dims
        heads = d.num_heads + 2 * d.num_kv_heads
        if n != 3 or total % heads:
            raise SourceError(f"{w.name}: {total} rows do not split into q/k/v of {d.num_heads}/{d.num_kv_heads} heads")
        hd = total // heads
        outs = [d.num_heads * hd, d.num_kv_heads * hd, d.num_kv_heads * hd]
    else:
        if total % n:
            raise SourceError(f"{w.name}: {total} rows do not split into {n} equal parts ({', '.join(lay.fused)})")
        outs = [total // n] * n
    offs = [sum(outs[:i]) for i in range(n)]
    return [w] * n, offs, outs


def _sized_slots(
    ctx: Context, sizes: tuple[tuple[str, ...], ...], target: str, slots: list[str], param: str
) -> tuple[list[TensorInfo], list[int], list[int]]:
    if len(sizes) != len(slots):
        raise AssertionError(f"{target}: {len(sizes)} sizes for {len(slots)} slots")
    ts, offs, outs = [], [], []
    for i, (slot, keys) in enumerate(zip(slots, sizes, strict=True)):
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
            keys = " + ".join("*".join(k) for s, k in zip(slots, sizes, strict=True) if s == slots[i])
            raise SourceError(
                f"{t.name} has shape {list(t.shape)}, expected {offs[i] + outs[i]} rows (from config.json {keys})",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )
    return ts, offs, outs


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
