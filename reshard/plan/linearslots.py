"""What the linear styles share: how a style lays its module out (`LinearLayout`), each rank's rows
of a slot, the slots' HF weights and their checks against config.json, the bias (reshard.plan.linear
walks the N-first layouts, reshard.plan.kfirst the K-first packed ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reshard.errors import SourceError
from reshard.format import TensorInfo
from reshard.plan.context import Context
from reshard.plan.model import OutTensor, rows, whole
from reshard.rules import Linear

# per slot, rank r's rows [start, stop) of it and which shard of the slot they are
RankRows = Callable[[Context, str, list[int], int], list[tuple[int, int, int]]]


def whole_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    return [(0, o, 0) for o in outs]


def split_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    out = []
    for i, o in enumerate(outs):
        n = ctx.split(o, f"output size of {target} (slot {i})")
        out.append((r * n, (r + 1) * n, r))
    return out


@dataclass(frozen=True)
class LinearLayout:
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
    rows: RankRows = whole_rows
    cols: bool = False
    fused: tuple[str, ...] = ()
    sizes: tuple[tuple[str, ...], ...] = ()
    param: str = "weight"
    heads: bool = False
    deinterleave: tuple[int, ...] = ()


def bias_tensor(
    ctx: Context,
    lay: LinearLayout,
    target: str,
    slots: list[str],
    offs: list[int],
    slot_rows: list[tuple[int, int, int]],
) -> OutTensor:
    bs = [ctx.src(f"{s}.bias", target) for s in slots]
    bs = bs * len(offs) if lay.fused else bs  # a fused tensor's bias holds every slot (Qwen2.5-VL's attn.qkv)
    if lay.rows is whole_rows:
        pieces = tuple(dict.fromkeys(whole(b) for b in bs))  # a fused bias once
        n = sum(b.shape[0] for b in dict.fromkeys(bs))
    else:
        pieces = tuple(rows(b, o + a, o + e) for b, o, (a, e, _) in zip(bs, offs, slot_rows, strict=True))
        n = sum(e - a for a, e, _ in slot_rows)
    return OutTensor(f"{target}.bias", lay.rule.dtype or ctx.dtype, (n,), pieces)


def check_shapes(ctx: Context, lay: LinearLayout, weights: list[TensorInfo], outs: list[int], pk: int = 1) -> None:
    """Each slot's HF weight against config.json (the module's `dims`; a row-parallel layer feeds the
    residual stream, so its rows are `hidden_size`) and against its sibling slots: a transposed or
    reshaped tensor would otherwise be sliced into garbage that loads without a word."""
    rows_key, cols_key = lay.rule.dims
    if lay.cols and rows_key is None:
        rows_key = "hidden_size"
    for w, n in zip(weights, outs, strict=True):
        if len(w.shape) != 2:
            raise SourceError(f"{w.name} has shape {list(w.shape)}; a linear weight is 2-D")
        want = (config_int(ctx, rows_key) or n, config_int(ctx, cols_key) or weights[0].shape[1] * pk)
        if (n, w.shape[1] * pk) != want:
            got = list(w.shape) if not lay.fused else f"{n} rows of {list(w.shape)}"
            said = " and ".join(f"{k}" for k in (rows_key, cols_key) if k) or "the other slots"
            raise SourceError(
                f"{w.name} has shape {got}, expected {list(want)} (from config.json {said})",
                "the tensor is transposed or reshaped, or config.json does not match the weights",
            )


def _not_scalar(w: TensorInfo) -> TensorInfo:
    """A layer's weight has rows: a 0-d one is a damaged checkpoint (exit 4), not an IndexError."""
    if not w.shape:
        raise SourceError(
            f"{w.name} is a scalar (shape []); a linear layer's weight has rows",
            "the checkpoint is damaged or not of the architecture its config.json names",
        )
    return w


def config_int(ctx: Context, key: str | None) -> int | None:
    """A size config.json gives under `key`, or None; the expert count under whichever of the table's
    `experts_key` names it spells (transformers 5 writes Qwen3-MoE's `num_local_experts`)."""
    if key in ctx.arch.experts_key and ctx.dims.num_experts:
        return ctx.dims.num_experts
    value = ctx.config.get(key) if key else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def slot_sources(
    ctx: Context, lay: LinearLayout, target: str, slots: list[str], param: str = "weight"
) -> tuple[list[TensorInfo], list[int], list[int]]:
    """Each slot's HF weight, its first row there and its global row count.

    Separate HF tensors: one per slot, from row 0. A fused HF tensor (Phi-3): the slots are
    consecutive row ranges of it, sized as vLLM's `_load_fused_module_from_checkpoint`
    does: q/k/v by the head counts, other merged layers in equal parts. Slots sized by config
    keys (the styles' `sizes`): consecutive slots of one HF tensor are consecutive row ranges of it.
    """
    if lay.sizes:
        return sized_slots(ctx, lay.sizes, target, slots, param)
    if not lay.fused:
        weights = [ctx.src(f"{s}.{param}", target) for s in slots]
        for w in weights:
            _not_scalar(w)
        return weights, [0] * len(weights), [w.shape[0] for w in weights]
    w = _not_scalar(ctx.src(f"{slots[0]}.{param}", target))
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


def sized_slots(
    ctx: Context, sizes: tuple[tuple[str, ...], ...], target: str, slots: list[str], param: str
) -> tuple[list[TensorInfo], list[int], list[int]]:
    if len(sizes) != len(slots):
        raise AssertionError(f"{target}: {len(sizes)} sizes for {len(slots)} slots")
    ts, offs, outs = [], [], []
    for i, (slot, keys) in enumerate(zip(slots, sizes, strict=True)):
        t = ctx.src(f"{slot}.{param}", target)
        n = 1
        for key in keys:
            value = config_int(ctx, key)
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


def qkv_rows(ctx: Context, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
    """q by heads; k and v by KV heads, each replicated on tp / num_kv_heads ranks when fewer."""
    d, tp = ctx.dims, ctx.tp
    q, k, v = outs
    # head sizes from the weights: vLLM's Qwen2 ignores config.head_dim, others use it
    if q % d.num_heads or k % d.num_kv_heads or v % d.num_kv_heads:
        raise SourceError(f"{target}: q/k/v rows {q}/{k}/{v} do not split into {d.num_heads}/{d.num_kv_heads} heads")
    check_head_size(ctx, target, k // d.num_kv_heads)
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


def check_head_size(ctx: Context, target: str, k_head: int) -> None:
    """The head size the weights give (k's rows per KV head) against config.json: it must be its
    head_dim or hidden_size / num_attention_heads (what vLLM builds the layer with; Qwen2's ignores
    head_dim). A num_key_value_heads or head_dim the weights do not have would otherwise be written
    and served with other shapes than vLLM builds: exit 4 before anything is written. (q is not
    checked: gated attention, Qwen3-Next's, holds twice the rows per head there.)"""
    d = ctx.dims
    head_dim = config_int(ctx, "head_dim")
    sizes = {head_dim, d.hidden // d.num_heads if d.hidden % d.num_heads == 0 else None} - {None}
    if sizes and k_head not in sizes:
        said = " or ".join(
            [f"head_dim {head_dim}"] * bool(head_dim)
            + [f"hidden_size / num_attention_heads = {d.hidden // d.num_heads}"] * (d.hidden % d.num_heads == 0)
        )
        raise SourceError(
            f"{target}: the weights give {k_head} rows per KV head ({d.num_kv_heads} of them), config.json says {said}",
            "the config.json does not belong to these weights, or was edited",
        )
