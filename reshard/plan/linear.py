"""Linear layers and plain parameters: the Replicate, Column, Row, Merged and QKV styles.

A module has one or more slots (q, k, v / gate, up), each a separate HF tensor or a row range of one
fused HF tensor. Column-parallel styles give every rank a row range of each slot; row-parallel ones
a column range of the whole weight; replicated ones all of it. Each style's slicer says so in a
`LinearLayout`, which the one walk below follows.
"""

from __future__ import annotations

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.context import Context
from reshard.plan.geometry import LinearRank
from reshard.plan.kfirst import k_first
from reshard.plan.linearslots import (
    LinearLayout,
    bias_tensor,
    check_shapes,
    config_int,
    qkv_rows,
    slot_sources,
    split_rows,
    whole_rows,
)
from reshard.plan.model import OutTensor, Slice, whole
from reshard.rules import QKV, Column, Merged, Replicate, Row

# ---- the styles --------------------------------------------------------------------------------


def replicate(ctx: Context, m: Replicate, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Whole on every rank: a plain parameter (norms: the model dtype unless vLLM fixes one), or a
    replicated linear built with the quant config."""
    if not m.quant:
        target = prefix + m.name
        t = ctx.src(f"{prefix}{m.hf}.{m.param}", target)
        if m.shape:
            _check_whole_shape(ctx, t, m.shape)
        for r in range(ctx.tp):
            per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or ctx.dtype, t.shape, (whole(t),)))
        return
    _linear(ctx, LinearLayout(m, (m.hf,), param=m.param), prefix, per_tp)


def _check_whole_shape(ctx: Context, t: TensorInfo, keys: tuple[str | int | None, ...]) -> None:
    """A replicated tensor's shape against config.json (`Replicate.shape`)."""
    want = [k if isinstance(k, int) else config_int(ctx, k) for k in keys]
    if len(t.shape) != len(want) or any(w is not None and w != s for w, s in zip(want, t.shape, strict=True)):
        within = f"{ctx.config_key}." if ctx.config_key else ""
        said = ", ".join(
            f"{within}{k} {w}" for k, w in zip(keys, want, strict=True) if isinstance(k, str) and w is not None
        )
        raise SourceError(
            f"{t.name} has shape {list(t.shape)}, expected {[w if w is not None else '*' for w in want]}"
            + (f" (from config.json {said})" if said else ""),
            "the tensor is damaged or reshaped, or config.json does not match the weights",
        )


def column(ctx: Context, m: Column, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Output rows split; a tensor in config-sized pieces splits each piece."""
    lay = LinearLayout(m, (m.hf,) * max(1, len(m.sizes)), split_rows, sizes=m.sizes, param=m.param)
    (_linear if m.quant else _plain_rows)(ctx, lay, prefix, per_tp)


def row(ctx: Context, m: Row, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Input columns split; the output (and the bias) whole."""
    _linear(ctx, LinearLayout(m, (m.hf,), cols=True), prefix, per_tp)


def merged(ctx: Context, m: Merged, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Column slots, each split on its own (whole with disable_tp)."""
    slots = (m.hf,) if m.fused else _stacked(ctx, m)
    lay = LinearLayout(m, slots, whole_rows if m.disable_tp else split_rows, fused=m.fused, sizes=m.sizes)
    (_linear if m.quant else _plain_rows)(ctx, lay, prefix, per_tp)


def qkv(ctx: Context, m: QKV, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """[q; k; v]: q by heads, k and v by KV heads (replicated when fewer than ranks)."""
    slots = (m.hf,) if m.fused else _stacked(ctx, m)
    if not m.fused and len(slots) != 3:
        raise AssertionError(f"{m.name}: {len(slots)} stacked slots, QKV needs q, k and v")
    lay = LinearLayout(m, slots, qkv_rows, fused=m.fused, heads=True, deinterleave=m.deinterleave)
    _linear(ctx, lay, prefix, per_tp)


def _stacked(ctx: Context, m: Merged | QKV) -> tuple[str, ...]:
    """The slots vLLM's mapper stacks into the module (reshard.rules.spec.WeightsMapper)."""
    slots = ctx.arch.shards(m.hf)
    if not slots:
        raise AssertionError(f"{m.name}: {ctx.arch.names[0]}'s hf_to_vllm stacks nothing into {m.hf}")
    return slots


# ---- the walk ----------------------------------------------------------------------------------


def _check_fused_late(ctx: Context, target: str, stored: bool) -> None:
    """vLLM decides a module the model fuses late (`Architecture.fused_late`) by its fused name alone; a
    checkpoint storing it otherwise (its slots named on the ignore list, the fused name not) is refused."""
    built = ctx.quantized([target])
    if built == stored:
        return
    how = {True: "quantized", False: "unquantized"}
    raise UnsupportedError(
        f"{target}: vLLM's {ctx.arch.names[0]} decides this layer's quantization by its fused name (it registers "
        f"{target.rsplit('.', 1)[-1]} as fused only after reading the quantization config), which builds it "
        f"{how[built]}, while the checkpoint stores it {how[stored]}: vLLM cannot load this checkpoint as it is",
        f"name the fused module ({target}) in the quantization config as its parts are named (ignore, "
        "modules_to_not_convert or modules_in_block_to_quantize)",
    )


def _linear(ctx: Context, lay: LinearLayout, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append the module of the layer at `prefix` (its weight, scales and bias) to every rank."""
    m = lay.rule
    target = prefix + m.name
    slots = [prefix + s for s in lay.slots]
    if lay.param != "weight":
        raise AssertionError(f"{target}: only plain parameters may be named {lay.param!r}")
    scheme = ctx.quant if m.quant and ctx.quantized(slots) else None
    if m.quant and ctx.quant and target.rsplit(".", 1)[-1] in ctx.arch.fused_late:
        _check_fused_late(ctx, target, scheme is not None)
    if scheme is not None and scheme.k_first:
        k_first(ctx, lay, prefix, per_tp)
        return
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
                splits_rows=lay.rows is not whole_rows and ctx.tp > 1,
                splits_cols=lay.cols and ctx.tp > 1,
                dtype=ctx.dtype,
            )
            per_tp[r].extend(scheme.linear_scales(ctx, lin))
        if bias:
            per_tp[r].append(bias_tensor(ctx, lay, target, slots, offs, slot_rows))


def _rows_of(
    ctx: Context, lay: LinearLayout, slot: int, name: str, a: int, b: int, out: int, cols: tuple[int, int]
) -> list[Slice]:
    """Rows [a, b) of slot `slot`; per head even rows then odd rows where the rule says vLLM reorders them."""
    if slot not in lay.deinterleave:
        return [Slice(name, (a, cols[0]), (b, cols[1]))]
    hd = out // (ctx.dims.num_heads if slot == 0 else ctx.dims.num_kv_heads)
    return [Slice(name, (h + odd, cols[0]), (h + hd, cols[1]), step=2) for h in range(a, b, hd) for odd in (0, 1)]


def _plain_rows(ctx: Context, lay: LinearLayout, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Unquantized column-parallel parameters of any rank, cut along dim 0 (the gated delta net's
    conv1d [conv_dim, 1, kernel], A_log, dt_bias): each slot's rows split across ranks on its own,
    a rank's slots concatenated; the other dims whole."""
    m = lay.rule
    target = prefix + m.name
    slots = [prefix + s for s in lay.slots]
    ts, offs, outs = slot_sources(ctx, lay, target, slots, lay.param)
    scales = [_dequant_scale(ctx, lay, target, i, t) for i, t in enumerate(ts)]
    rest = ts[0].shape[1:]
    for t in ts:
        if t.shape[1:] != rest:
            raise SourceError(f"{t.name} has shape {list(t.shape)}, its sibling slots {[outs[0], *rest]}")
    for r in range(ctx.tp):
        slot_rows = lay.rows(ctx, target, outs, r)
        pieces = tuple(
            Slice(t.name, (o + a, *(0,) * len(rest)), (o + b, *rest), scale=s)
            for t, o, s, (a, b, _) in zip(ts, offs, scales, slot_rows, strict=True)
        )
        shape = (sum(b - a for a, b, _ in slot_rows), *rest)
        per_tp[r].append(OutTensor(f"{target}.{lay.param}", m.dtype or ctx.dtype, shape, pieces))


def _dequant_scale(ctx: Context, lay: LinearLayout, target: str, slot: int, t: TensorInfo) -> str | None:
    """The scale tensor of slot `slot`'s FP8 weight `t` that vLLM dequantises at load into the unquantized
    module (Merged.dequant: DeepSeek-V3.2's indexer wk, deepseek_v2._try_load_fp8_indexer_wk); None for a
    plain weight. Any other FP8 weight of an unquantized module is refused: vLLM would copy its values
    without their scales."""
    if not t.dtype.startswith("F8"):
        return None
    if slot not in getattr(lay.rule, "dequant", ()) or t.dtype != "F8_E4M3" or len(t.shape) != 2:
        raise UnsupportedError(
            f"{t.name} is {t.dtype}, and vLLM builds {target} unquantized: it would load the FP8 values without "
            "their scales",
            f"store {t.name} in bf16 in the checkpoint, or serve it with vLLM's default loader",
        )
    base = t.name.removesuffix(".weight")
    found = [n for n in (f"{base}.weight_scale_inv", f"{base}.weight_scale") if n in ctx.ckpt.tensors]
    if len(found) != 1:
        raise SourceError(
            f"{t.name} is FP8 and the checkpoint has {len(found) or 'no'} scale tensor(s) for it "
            f"({', '.join(found) or base + '.weight_scale_inv'}): vLLM dequantises it with exactly one",
            "the checkpoint is incomplete",
        )
    s = ctx.src(found[0], target)
    if len(s.shape) != 2 or not all(s.shape) or t.shape[0] % s.shape[0] or t.shape[1] % s.shape[1]:
        raise UnsupportedError(
            f"{s.name} has shape {list(s.shape)}, not blocks that divide {t.name}'s {list(t.shape)}: "
            "vLLM's scaled_dequantize fails on it (its group shape asserts), reshard writes 2-D block scales only",
            "serve the original checkpoint with vLLM's default loader",
        )
    if s.dtype not in ("F32", "BF16", "F16", "F8_E8M0", "U8"):
        raise UnsupportedError(f"{s.name} is {s.dtype}: not a scale dtype vLLM dequantises with")
    return s.name
