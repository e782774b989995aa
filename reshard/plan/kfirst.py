"""Linear layers whose weight is stored [in, out] and packed: GPTQ's qweight [K / 8, N] and AWQ's
[K, N / 8] (reshard.plan.gptq)."""

from __future__ import annotations

from reshard.errors import SourceError, UnsupportedError
from reshard.plan.context import Context
from reshard.plan.geometry import LinearRank
from reshard.plan.linearslots import LinearLayout, bias_tensor, config_int, whole_rows
from reshard.plan.model import OutTensor, Slice, side_by_side


def k_first(ctx: Context, lay: LinearLayout, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """A linear layer whose weight is stored [in, out] and packed (GPTQ's qweight [K / 8, N], AWQ's
    [K, N / 8], reshard.plan.gptq): a rank's input rows, and its output columns of every slot side by
    side (a merged layer's slots are column ranges of vLLM's parameter)."""
    m, scheme = lay.rule, ctx.quant
    assert scheme is not None
    target = prefix + m.name
    if lay.fused or lay.sizes or lay.deinterleave:
        raise UnsupportedError(
            f"{target}: a fused or reordered HF tensor of {scheme.method} weights is a layout reshard has not "
            "checked against vLLM",
            "use the bf16 checkpoint",
        )
    slots = [prefix + s for s in lay.slots]
    kp, npk = scheme.k_pack, scheme.n_pack
    weights = [ctx.src(f"{s}.{scheme.weight_param}", target) for s in slots]
    for w in weights:
        if len(w.shape) != 2:
            raise SourceError(f"{w.name} has shape {list(w.shape)}; a linear weight is 2-D")
        scheme.check_weight(w)
    in_size, outs = weights[0].shape[0] * kp, [w.shape[1] * npk for w in weights]
    rows_key, cols_key = m.dims
    if lay.cols and rows_key is None:
        rows_key = "hidden_size"
    for w, n in zip(weights, outs, strict=True):
        want = (config_int(ctx, rows_key) or n, config_int(ctx, cols_key) or in_size)
        if (n, w.shape[0] * kp) != want:
            raise SourceError(
                f"{w.name} has shape {list(w.shape)}: [{w.shape[0] * kp}, {n}] unpacked, expected "
                f"{list(want)[::-1]} ([in, out], from config.json and the sibling slots)",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )
    in_r = ctx.split(in_size, f"input size of {target}") if lay.cols else in_size
    if in_r % kp:
        raise UnsupportedError(
            f"{target}: per-rank input size {in_r} cuts the weights packed {kp} to an int32", "use a smaller --tp"
        )
    for r in range(ctx.tp):
        slot_rows = lay.rows(ctx, target, outs, r)
        cols = (r * in_r, (r + 1) * in_r) if lay.cols else (0, in_size)
        for i, (a, b, _) in enumerate(slot_rows):
            if a % npk or b % npk:
                raise UnsupportedError(
                    f"{target}: output columns [{a}, {b}) of slot {i} on a rank cut the weights packed {npk} "
                    "to an int32",
                    "use a smaller --tp",
                )
        parts = [
            Slice(w.name, (cols[0] // kp, a // npk), (cols[1] // kp, b // npk))
            for w, (a, b, _) in zip(weights, slot_rows, strict=True)
        ]
        n = sum(b - a for a, b, _ in slot_rows)
        shape = ((cols[1] - cols[0]) // kp, n // npk)
        per_tp[r].append(OutTensor(f"{target}.{scheme.weight_param}", "I32", shape, (side_by_side(parts),)))
        lin = LinearRank(
            target=target,
            slots=tuple(slots),
            fused=(),
            outs=tuple(outs),
            offs=(0,) * len(slots),
            rows=tuple(slot_rows),
            in_size=in_size,
            cols=cols,
            splits_rows=lay.rows is not whole_rows and ctx.tp > 1,
            splits_cols=lay.cols and ctx.tp > 1,
            dtype=ctx.dtype,
        )
        per_tp[r].extend(scheme.linear_scales(ctx, lin))
        if ctx.flag(m.bias):
            per_tp[r].append(bias_tensor(ctx, lay, target, slots, list(lin.offs), slot_rows))
