"""Routed experts stored fused per layer in one HF tensor per projection: gpt-oss (gate and up
interleaved, biases, bf16 or MXFP4) and Llama-4 (gate then up, bf16, no biases).

Llama-4 (vLLM llama4.py `load_moe_expert_weights`): `gate_up_proj` [E, hidden, 2I] is transposed and
cut in halves (gate, up), then loaded by the generic expert loader: w13 = [gate rows of the TP shard;
up rows of it], w2 = `down_proj` [E, I, hidden] transposed, column shard; EP takes whole experts
(vLLM's linear placement, remainder to the first ranks: 3 experts over 2 ranks are 2 and 1).

vLLM 0.32 `models/gpt_oss.py` loads them itself (`GptOssModel._load_weights_other` for bf16,
`_load_weights_mxfp4` for the released MXFP4 checkpoints), not through the generic expert loader:

- the interleaved `gate_up_proj` rows (gate 2i, up 2i+1) are never separated: a TP rank takes the
  contiguous range [2 * start, 2 * end) of them;
- bf16: `gate_up_proj` [E, hidden, 2I] and `down_proj` [E, I, hidden] are transposed into
  w13 [E, 2I, hidden] and w2 [E, hidden, I];
- MXFP4: `*_blocks` [E, rows, cols / 32, 16] (two e2m1 values a byte) and `*_scales`
  [E, rows, cols / 32] (e8m0) keep their orientation; a TP rank's range has the stride
  cdiv(I / 32, tp) * 32, placed at the top-left of a parameter the MoE backend may have rounded
  up (`mxfp4_round_up_hidden_size_and_intermediate_size`, reshard.plan.backends); biases are
  bfloat16 whatever the model dtype (`GptOssMxfp4MoEMethod.create_weights`);
- `down_proj_bias` is added once: TP ranks other than 0 hold zeros; under EP every rank holds its
  experts' biases;
- EP gives rank r experts [r * E / tp, (r + 1) * E / tp) (`experts_per_rank = E // ep_size`).
"""

from __future__ import annotations

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan import backends
from reshard.plan.context import Context
from reshard.plan.geometry import cdiv, divisors, ep_experts, refuse_tp_above_experts
from reshard.plan.model import Fill, OutTensor, Piece, Slice
from reshard.rules import FusedExperts

MX_BLOCK = 32  # OCP_MX_BLOCK_SIZE: values per e8m0 scale
MX_BYTES = MX_BLOCK // 2  # two e2m1 values per byte


def fused_experts(ctx: Context, m: FusedExperts, prefix: str, per_tp: list[list[OutTensor]]) -> None:
    """Append the fused experts module `m` (gpt-oss, Llama-4) of the layer at `prefix` to every rank."""
    target = prefix + m.name
    gate_up, down = prefix + m.gate_up, prefix + m.down
    d, tp = ctx.dims, ctx.tp
    num, inter, hidden = d.num_experts, d.moe_intermediate, d.hidden
    if m.tp_at_most_experts:
        refuse_tp_above_experts(tp, num)
    # Llama-4, Qwen3-VL-MoE load through the generic expert loader: vLLM's linear placement, uneven where it must
    if ctx.ep and num % tp and (not m.halves or tp > num):
        why = (
            "some ranks would hold no expert (a layout not checked against vLLM)"
            if m.halves
            else f"vLLM's gpt-oss loader gives every rank experts [r * {num} // {tp}, (r + 1) * {num} // {tp}), "
            "not the ones its expert map routes to it"
        )
        raise UnsupportedError(
            f"--ep: {ctx.arch.names[0]}'s {num} experts do not divide among --tp {tp} ranks, and {why}",
            f"use a --tp that divides {num}: {divisors(num)}",
        )
    mx = ctx.quantized([gate_up.rsplit(".", 1)[0]], experts=True)
    if ctx.quant and not mx:
        raise UnsupportedError(
            f"{target}: {ctx.quant.method} experts of {ctx.arch.names[0]} are not supported (their vLLM layout is "
            "not checked)",
            "use the bf16 release",
        )
    if m.halves:
        _halves(ctx, target, gate_up, down, per_tp)
        return
    bias_gu = _src(ctx, f"{gate_up}_bias", target, (num, 2 * inter))
    bias_dn = _src(ctx, f"{down}_bias", target, (num, hidden))
    if mx:
        geo = _mx_geometry(ctx, target, inter, hidden)
        tensors = _mx_tensors(ctx, target, gate_up, down, num, inter, hidden)
    else:
        geo = _bf16_geometry(ctx, target, inter)
        tensors = (
            _src(ctx, gate_up, target, (num, hidden, 2 * inter)),
            _src(ctx, down, target, (num, inter, hidden)),
        )
    bias_dtype = "BF16" if mx else ctx.dtype
    for r in range(tp):
        if ctx.ep:
            experts, start, size = ep_experts(num, tp, r), 0, inter  # num divides by tp: E // tp each
        else:
            experts = range(num)
            start = min(r * geo.stride, inter)
            size = min(geo.stride, inter - start)
        out = (
            _mx_rank(target, tensors, experts, start, size, geo)
            if mx
            else _bf16_rank(target, tensors, experts, start, size, ctx.dtype)
        )
        n, alloc = len(experts), geo.alloc
        out.append(
            OutTensor(
                f"{target}.w13_bias",
                bias_dtype,
                (n, 2 * alloc),
                tuple(
                    _padded(bias_gu.name, (e, 2 * start), (e + 1, 2 * (start + size)), (1, 2 * alloc)) for e in experts
                ),
            )
        )
        if ctx.ep or r == 0:
            dn = tuple(_padded(bias_dn.name, (e, 0), (e + 1, hidden), (1, geo.hidden)) for e in experts)
        else:
            dn = (Fill(0.0, n * geo.hidden),)
        out.append(OutTensor(f"{target}.w2_bias", bias_dtype, (n, geo.hidden), dn))
        per_tp[r].extend(out)


def _halves(ctx: Context, target: str, gate_up: str, down: str, per_tp: list[list[OutTensor]]) -> None:
    """Llama-4: gate columns [0, I), up columns [I, 2I) of `gate_up_proj`, no biases."""
    d, tp = ctx.dims, ctx.tp
    num, inter, hidden = d.num_experts, d.moe_intermediate, d.hidden
    geo = _bf16_geometry(ctx, target, inter)
    gu = _src(ctx, gate_up, target, (num, hidden, 2 * inter))
    dn = _src(ctx, down, target, (num, inter, hidden))
    ip = geo.alloc
    for r in range(tp):
        if ctx.ep:
            experts, start = ep_experts(num, tp, r), 0
        else:
            experts, start = range(num), r * ip
        w13 = tuple(
            Slice(gu.name, (e, 0, half + start), (e + 1, hidden, half + start + ip), perm=(0, 2, 1))
            for e in experts
            for half in (0, inter)
        )
        e0, e1, n = experts.start, experts.stop, len(experts)
        w2 = (Slice(dn.name, (e0, start, 0), (e1, start + ip, hidden), perm=(0, 2, 1)),)
        per_tp[r].append(OutTensor(f"{target}.w13_weight", ctx.dtype, (n, 2 * ip, hidden), w13))
        per_tp[r].append(OutTensor(f"{target}.w2_weight", ctx.dtype, (n, hidden, ip), w2))


class _Geometry:
    """A rank's share: `stride` rows of the intermediate dim per TP rank (the loader's), `alloc`
    rows allocated (the backend's), `hidden` columns allocated."""

    def __init__(self, stride: int, alloc: int, hidden: int) -> None:
        self.stride, self.alloc, self.hidden = stride, alloc, hidden


def _bf16_geometry(ctx: Context, target: str, inter: int) -> _Geometry:
    """bf16: gpt-oss's `_load_weights_other` copies whole TP shards with `param.copy_`, which takes no
    padding; reshard writes Llama-4's unpadded too (a padding backend is refused)."""
    moe_tp = 1 if ctx.ep else ctx.tp
    if inter % moe_tp:
        raise UnsupportedError(
            f"the experts' intermediate size {inter} is not divisible by --tp {ctx.tp}",
            f"use --ep, or a --tp that divides it: {divisors(inter)}",
        )
    ip = inter // moe_tp
    backend = ctx.moe_backend
    if backend != "auto":
        ctx.moe_pin = backend
    alloc = backends.unquantized_alloc(backend, ip)
    if alloc != ip:
        raise UnsupportedError(
            f"--moe-backend {backend} allocates {target}'s per-rank intermediate size {ip} rounded up to {alloc}; "
            "reshard writes this model's experts unpadded (vLLM's gpt-oss bf16 loader cannot load padded ones)",
            "use --moe-backend triton",
        )
    if backend == "auto" and backends.unquantized_depends(ip):
        ctx.moe_pin = "triton"
        ctx.note(backends.pin_note(ip, backends.unquantized_alloc("flashinfer_trtllm", ip)))
    return _Geometry(ip, ip, ctx.dims.hidden)


def _mx_geometry(ctx: Context, target: str, inter: int, hidden: int) -> _Geometry:
    """`_load_weights_mxfp4`'s stride and the backend's allocation (oracle/mxfp4.py)."""
    if inter % MX_BLOCK or hidden % MX_BLOCK:
        raise SourceError(
            f"{target}: MXFP4 experts need intermediate ({inter}) and hidden ({hidden}) sizes "
            f"that are multiples of {MX_BLOCK}"
        )
    moe_tp = 1 if ctx.ep else ctx.tp
    stride = cdiv(inter // MX_BLOCK, moe_tp) * MX_BLOCK
    ip = inter // moe_tp  # FusedMoE's intermediate_size_per_partition, before the backend rounds it
    backend = backends.mxfp4_backend(ctx.moe_backend)
    hidden_alloc, alloc = backends.mxfp4_alloc(backend, hidden, ip)
    if ctx.moe_backend == "auto":
        ctx.note(backends.mxfp4_pin_note(ip, alloc, hidden_alloc))
    ctx.moe_pin = backend
    if alloc < stride:
        raise UnsupportedError(
            f"{target}: vLLM's gpt-oss MXFP4 loader copies {stride} intermediate rows per rank into a "
            f"parameter of {alloc} (--moe-backend {backend}) and fails",
            f"use a --tp that divides {inter // MX_BLOCK} (the intermediate size in MXFP4 blocks), or --ep",
        )
    return _Geometry(stride, alloc, hidden_alloc)


def _src(ctx: Context, name: str, target: str, shape: tuple[int, ...], dtype: str | None = None) -> TensorInfo:
    t = ctx.src(name, target)
    if t.shape != shape:
        raise SourceError(f"{t.name} has shape {list(t.shape)}, expected {list(shape)} (from config.json)")
    if dtype and t.dtype != dtype:
        raise SourceError(f"{t.name} is {t.dtype}, MXFP4 experts store {dtype}")
    return t


def _mx_tensors(ctx: Context, target: str, gate_up: str, down: str, num: int, inter: int, hidden: int):
    gh, dh = hidden // MX_BLOCK, inter // MX_BLOCK
    return (
        _src(ctx, f"{gate_up}_blocks", target, (num, 2 * inter, gh, MX_BYTES), "U8"),
        _src(ctx, f"{gate_up}_scales", target, (num, 2 * inter, gh), "U8"),
        _src(ctx, f"{down}_blocks", target, (num, hidden, dh, MX_BYTES), "U8"),
        _src(ctx, f"{down}_scales", target, (num, hidden, dh), "U8"),
    )


def _padded(name: str, start: tuple[int, ...], stop: tuple[int, ...], extent: tuple[int, ...]) -> Piece:
    """source[start:stop] at the origin of `extent`, zeros elsewhere; all zeros when empty."""
    sizes = tuple(b - a for a, b in zip(start, stop, strict=True))
    if any(s <= 0 for s in sizes):
        count = 1
        for x in extent:
            count *= x
        return Fill(0.0, count)
    return Slice(name, start, stop, pad=None if sizes == extent else extent)


def _mx_rank(target, tensors, experts, start, size, geo: _Geometry) -> list[OutTensor]:
    """MXFP4: w13 rows [2 start, 2 (start + size)) of every local expert, w2 columns [start, start + size)."""
    gu_b, gu_s, dn_b, dn_s = tensors
    hidden = dn_b.shape[1]
    gh, ah, ai = hidden // MX_BLOCK, geo.hidden // MX_BLOCK, geo.alloc // MX_BLOCK
    r0, r1 = 2 * start, 2 * (start + size)
    c0, c1 = start // MX_BLOCK, (start + size) // MX_BLOCK
    n, a2 = len(experts), 2 * geo.alloc
    return [
        OutTensor(
            f"{target}.w13_weight",
            "U8",
            (n, a2, geo.hidden // 2),
            tuple(_padded(gu_b.name, (e, r0, 0, 0), (e + 1, r1, gh, MX_BYTES), (1, a2, ah, MX_BYTES)) for e in experts),
        ),
        OutTensor(
            f"{target}.w13_weight_scale",
            "U8",
            (n, a2, ah),
            tuple(_padded(gu_s.name, (e, r0, 0), (e + 1, r1, gh), (1, a2, ah)) for e in experts),
        ),
        OutTensor(
            f"{target}.w2_weight",
            "U8",
            (n, geo.hidden, geo.alloc // 2),
            tuple(
                _padded(dn_b.name, (e, 0, c0, 0), (e + 1, hidden, c1, MX_BYTES), (1, geo.hidden, ai, MX_BYTES))
                for e in experts
            ),
        ),
        OutTensor(
            f"{target}.w2_weight_scale",
            "U8",
            (n, geo.hidden, ai),
            tuple(_padded(dn_s.name, (e, 0, c0), (e + 1, hidden, c1), (1, geo.hidden, ai)) for e in experts),
        ),
    ]


def _bf16_rank(target, tensors, experts, start, size, dtype) -> list[OutTensor]:
    """bf16: w13 = gate_up_proj[e, :, 2 start : 2 (start + size)] transposed, w2 = down_proj[e, start:start+size, :]
    transposed (unpadded: `_bf16_geometry`)."""
    gu, dn = tensors
    hidden = gu.shape[1]
    e0, e1, n = experts.start, experts.stop, len(experts)
    return [
        OutTensor(
            f"{target}.w13_weight",
            dtype,
            (n, 2 * size, hidden),
            (Slice(gu.name, (e0, 0, 2 * start), (e1, hidden, 2 * (start + size)), perm=(0, 2, 1)),),
        ),
        OutTensor(
            f"{target}.w2_weight",
            dtype,
            (n, hidden, size),
            (Slice(dn.name, (e0, start, 0), (e1, start + size, hidden), perm=(0, 2, 1)),),
        ),
    ]
