"""compressed-tensors' integer schemes: W4A16 / W8A16 (`pack-quantized`) and W8A8-int8 (`int-quantized`).

vLLM 0.32 builds `CompressedTensorsWNA16` / `CompressedTensorsWNA16MoEMethod` and
`CompressedTensorsW8A8Int8` / `CompressedTensorsW8A8Int8MoEMethod` for them (docs: shared reference
vllm-quant-formats.md). The layouts before vLLM's post-processing, per rank:

- WNA16 linear: `weight_packed` I32 [N_p, K_p * b / 32] (packed along the input dim); `weight_scale`
  [N_p, K_p / G] in the model dtype (per channel: [N_p, 1], whole on a row-parallel layer);
  asymmetric: `weight_zero_point` I32 [N_p * b / 32, K_p / G] (packed along the output dim);
  `weight_shape` I64 [2], a plain parameter every shard of a merged layer loads whole: it keeps the
  last shard's (v_proj's, up_proj's).
- WNA16 experts, N-first: `w13_weight_packed` [E, 2 I_p, H * b / 32], `w2_weight_packed` [E, H, I_p * b / 32],
  scales [E, 2 I_p, H / G] / [E, H, I_p / G], zero points packed along N, `w*_weight_shape` [E, 2] in
  the model dtype (each expert's unpacked [N, K]).
- W8A8-int8: I8 `weight`, F32 `weight_scale` [N_p, 1] (channel) or one per shard (tensor); static
  inputs: `input_scale` F32 [1] and, asymmetric, `input_zero_point` I8 [1]: plain parameters, the
  last shard's. Experts: per-channel weights with dynamic per-token inputs only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.expertblocks import RankScales
from reshard.plan.geometry import LinearRank, MoeSplit, Sources, cdiv
from reshard.plan.model import Fill, OutTensor, Slice, scalar, whole
from reshard.plan.quant import Quant, _ChannelScales, _CompressedTensors, channel_scales

WNA16_BITS = (4, 8)  # vLLM's WNA16_SUPPORTED_BITS


def _optional(sources: Sources, name: str, why: str) -> None:
    """Mark `name` used when the checkpoint holds it."""
    with contextlib.suppress(SourceError):
        sources.src(name, why)


def _tps(size: int, unit: int) -> str:
    """The TP sizes up to 16 that cut `size` into whole `unit`s."""
    return ", ".join(str(t) for t in (1, 2, 4, 8, 16) if size % t == 0 and (size // t) % unit == 0)


@dataclass(frozen=True)
class CompressedTensorsWNA16(_CompressedTensors):
    """`format: pack-quantized`, int weights of `bits` bits, groups of `group` input columns (-1: one per
    output channel), symmetric or with zero points; no input activations (W4A16, W8A16)."""

    bits: int = 4
    group: int = -1
    symmetric: bool = True

    strategy = "wNa16"
    weight_dtype = "I32"
    weight_param = "weight_packed"

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def to_json(self) -> dict:
        return {
            **super().to_json(),
            "format": "pack-quantized",
            "num_bits": self.bits,
            "group_size": self.group,
            "symmetric": self.symmetric,
        }

    # ---- linear layers -----------------------------------------------------------------------

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        if lin.fused:
            raise UnsupportedError(
                f"{lin.target}: a fused HF tensor of {self.bits}-bit compressed-tensors weights is a layout reshard "
                "has not checked against vLLM",
                "use the bf16 checkpoint",
            )
        pk, in_r = self.pack, lin.cols[1] - lin.cols[0]
        channel = self.group <= 0
        if not channel and lin.in_size % self.group:
            raise SourceError(f"{lin.target}: input size {lin.in_size} is not a multiple of the group {self.group}")
        if not channel and in_r % self.group:
            raise UnsupportedError(
                f"{lin.target}: per-rank input size {in_r} is not a multiple of the quantization group {self.group}; "
                "vLLM refuses a split that cuts a group",
                f"use a --tp that keeps whole groups: {_tps(lin.in_size, self.group)}",
            )
        # vLLM partitions the scales (and zero points) by groups; per-channel ones are whole in a row layer
        if channel:
            gcols, g0, ng = 1, 0, 1
        else:
            gcols, g0, ng = lin.in_size // self.group, lin.cols[0] // self.group, in_r // self.group
        scales = lin.per_slot(sources, "weight_scale")
        pieces, zpieces = [], []
        zps = [] if self.symmetric else lin.per_slot(sources, "weight_zero_point")
        for i, (s, n, (a, b, _)) in enumerate(zip(scales, lin.outs, lin.rows, strict=True)):
            if s.shape != (n, gcols):
                raise SourceError(f"{s.name} has shape {list(s.shape)}, expected {[n, gcols]}")
            pieces.append(Slice(s.name, (a, g0), (b, g0 + ng)))
            if zps:
                z = zps[i]
                if z.shape != (cdiv(n, pk), gcols) or z.dtype != "I32":
                    raise SourceError(f"{z.name} is {z.dtype} {list(z.shape)}, expected I32 {[cdiv(n, pk), gcols]}")
                if a % pk or b % pk:
                    raise UnsupportedError(
                        f"{lin.target}: rows [{a}, {b}) of slot {i} on a rank cut the zero points packed {pk} "
                        "to an int32",
                        f"use a --tp that keeps whole int32s: {_tps(n, pk)}",
                    )
                zpieces.append(Slice(z.name, (a // pk, g0), (b // pk, g0 + ng)))
        rows = sum(b - a for a, b, _ in lin.rows)
        out = [OutTensor(f"{lin.target}.weight_scale", lin.dtype, (rows, ng), tuple(pieces))]
        if zpieces:
            out.append(OutTensor(f"{lin.target}.weight_zero_point", "I32", (rows // pk, ng), tuple(zpieces)))
        # a plain parameter every shard loads whole: the last shard's stays (the others' are read and dropped;
        # a reshard output, re-sharded or merged, holds the last one only)
        for s in lin.slots[:-1]:
            _optional(sources, f"{s}.weight_shape", lin.target)
        last = sources.src(f"{lin.slots[-1]}.weight_shape", lin.target)
        if last.shape != (2,) or last.dtype != "I64":
            raise SourceError(f"{last.name} is {last.dtype} {list(last.shape)}, expected I64 [2]")
        out.append(OutTensor(f"{lin.target}.weight_shape", "I64", (2,), (whole(last),)))
        return out

    # ---- routed experts ----------------------------------------------------------------------

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        pk, ip, inter, hidden = self.pack, split.ip, split.inter, split.hidden
        channel = self.group <= 0
        if not channel:
            if hidden % self.group or inter % self.group:
                raise SourceError(
                    f"{split.target}: hidden {hidden} and intermediate {inter} sizes must be multiples of the group "
                    f"{self.group}"
                )
            if ip % self.group:
                raise UnsupportedError(
                    f"{split.target}: per-rank intermediate size {ip} is not a multiple of the quantization group "
                    f"{self.group}; vLLM refuses a split that cuts a group",
                    f"use --ep, or a --tp that keeps whole groups: {_tps(inter, self.group)}",
                )
        if not self.symmetric and ip % pk:
            raise UnsupportedError(
                f"{split.target}: per-rank intermediate size {ip} cuts the zero points packed {pk} to an int32",
                f"use --ep, or a --tp that keeps whole int32s: {_tps(inter, pk)}",
            )
        g13, g2 = (1, 1) if channel else (hidden // self.group, inter // self.group)
        gate, up, down = split.names
        want = {gate: (inter, g13), up: (inter, g13), down: (hidden, g2)}
        zwant = {p: (cdiv(n, pk), g) for p, (n, g) in want.items()}
        params = [("weight_scale", want, None)] + ([] if self.symmetric else [("weight_zero_point", zwant, "I32")])
        found: dict[tuple[str, str], list[TensorInfo]] = {}
        for param, shapes, dtype in params:
            for proj, shape in shapes.items():
                ts = [split.tensor(sources, e, proj, param) for e in range(split.num)]
                for t in ts:
                    if t.shape != shape or (dtype and t.dtype != dtype):
                        raise SourceError(f"{t.name} is {t.dtype} {list(t.shape)}, expected {list(shape)}")
                found[(param, proj)] = ts
        for e in range(split.num):  # written from the shapes (vLLM casts them to the model dtype)
            for proj in (gate, up, down):
                _optional(sources, f"{split.base}.{e}.{proj}.weight_shape", split.target)

        def rank(r: int) -> list[OutTensor]:
            experts, start = split.experts(r), split.shard(r) * ip
            n, t, out = len(experts), split.target, []
            for param, _, dtype in params:
                div = 1 if dtype is None else pk  # zero points: packed along N
                r0, r1 = start // div, (start + ip) // div
                w13 = tuple(
                    Slice(x.name, (r0, 0), (r1, g13))
                    for e in experts
                    for x in (found[(param, gate)][e], found[(param, up)][e])
                )
                if channel:  # w2's per-channel scales: whole
                    w2 = tuple(whole(found[(param, down)][e]) for e in experts)
                    c2 = 1
                else:
                    c0, c2 = start // self.group, ip // self.group
                    w2 = tuple(Slice(found[(param, down)][e].name, (0, c0), (hidden // div, c0 + c2)) for e in experts)
                out.append(OutTensor(f"{t}.w13_{param}", dtype or split.dtype, (n, 2 * ip // div, g13), w13))
                out.append(OutTensor(f"{t}.w2_{param}", dtype or split.dtype, (n, hidden // div, c2), w2))
            # torch.empty(E, 2) in the model dtype; each expert's loader writes the checkpoint's unpacked [N, K]
            shape13 = tuple(Fill(float(v), 1) for _ in experts for v in (inter, hidden))
            shape2 = tuple(Fill(float(v), 1) for _ in experts for v in (hidden, inter))
            out.append(OutTensor(f"{t}.w13_weight_shape", split.dtype, (n, 2), shape13))
            out.append(OutTensor(f"{t}.w2_weight_shape", split.dtype, (n, 2), shape2))
            return out

        return rank


# ---- W8A8-int8 ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Int8(_CompressedTensors):
    input_symmetric: bool = True

    weight_dtype = "I8"

    def to_json(self) -> dict:
        return {**super().to_json(), "format": "int-quantized", "input_symmetric": self.input_symmetric}

    def weight_scales(self, sources: Sources, lin: LinearRank) -> OutTensor:
        raise NotImplementedError

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        if lin.fused:
            raise UnsupportedError(
                f"{lin.target}: a fused HF tensor of int8 weights is a layout reshard has not checked against vLLM",
                "use the bf16 checkpoint",
            )
        out = [self.weight_scales(sources, lin)]
        if self.static_activations:
            # plain [1] parameters every shard loads whole: the last shard's stays
            params = [("input_scale", "F32")] + ([] if self.input_symmetric else [("input_zero_point", "I8")])
            for param, dtype in params:
                ts = lin.per_slot(sources, param)
                out.append(OutTensor(f"{lin.target}.{param}", dtype, (1,), (scalar(ts[-1]),)))
        return out


@dataclass(frozen=True)
class CompressedTensorsInt8Channel(_Int8, _ChannelScales):
    """W8A8-int8 with one weight scale per output channel (llm-compressor's W8A8 / SmoothQuant+GPTQ)."""

    def weight_scales(self, sources: Sources, lin: LinearRank) -> OutTensor:
        return channel_scales(sources, lin)

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        return _Int8.linear_scales(self, sources, lin)

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        if self.static_activations:
            raise UnsupportedError(
                f"{split.target}: int8 experts with static input scales; vLLM's INT8 fused MoE takes dynamic "
                "per-token inputs only"
            )
        return _ChannelScales.expert_scales(self, sources, split)


@dataclass(frozen=True)
class CompressedTensorsInt8Tensor(_Int8):
    """W8A8-int8 with one weight scale per tensor (per shard slot of a merged layer)."""

    strategy = "tensor"

    def weight_scales(self, sources: Sources, lin: LinearRank) -> OutTensor:
        scales = tuple(scalar(s) for s in lin.per_slot(sources, "weight_scale"))
        return OutTensor(f"{lin.target}.weight_scale", "F32", (len(scales),), scales)

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        raise UnsupportedError(
            f"{split.target}: int8 experts with per-tensor weight scales; vLLM's INT8 fused MoE takes per-channel "
            "weights with dynamic per-token inputs only"
        )


def int_compressed_tensors(qc: dict, group: dict, kv: str | None) -> Quant:
    """The integer compressed-tensors scheme of config group `group` (weights of `type: int`)."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations") or {}
    fmt = str(group.get("format") or qc.get("format") or "")
    ignored = tuple(qc.get("ignore") or [])
    bits, strategy = weights.get("num_bits"), str(weights.get("strategy"))
    actorder = weights.get("actorder")
    if actorder not in (None, "static", "weight"):
        raise UnsupportedError(
            f"compressed-tensors actorder {actorder!r}: the activation-order permutation (weight_g_idx) is a layout "
            "reshard does not write",
            "use a checkpoint quantized without act-order, or with actorder: weight",
        )
    if fmt == "pack-quantized" and not inputs:
        if bits not in WNA16_BITS:
            raise UnsupportedError(
                f"compressed-tensors pack-quantized with {bits}-bit weights: vLLM supports {list(WNA16_BITS)}"
            )
        if strategy == "group":
            size = weights.get("group_size")
            if not isinstance(size, int) or size <= 0:
                raise UnsupportedError(f"compressed-tensors group strategy with group_size {size!r}")
            return CompressedTensorsWNA16(None, False, ignored, kv, bits, size, bool(weights.get("symmetric", True)))
        if strategy == "channel":
            return CompressedTensorsWNA16(None, False, ignored, kv, bits, -1, bool(weights.get("symmetric", True)))
        raise UnsupportedError(f"compressed-tensors pack-quantized weight strategy {strategy!r} is not supported")
    if fmt == "int-quantized" and bits == 8 and inputs.get("type") == "int" and inputs.get("num_bits") == 8:
        if not weights.get("symmetric", True):
            raise UnsupportedError("compressed-tensors int8 with asymmetric weights: vLLM refuses it")
        static = not inputs.get("dynamic", True)
        sym = bool(inputs.get("symmetric", True))
        if strategy == "channel":
            return CompressedTensorsInt8Channel(None, static, ignored, kv, sym)
        if strategy == "tensor":
            return CompressedTensorsInt8Tensor(None, static, ignored, kv, sym)
        raise UnsupportedError(f"compressed-tensors int8 weight strategy {strategy!r} is not supported")
    raise UnsupportedError(
        f"compressed-tensors format {fmt!r} with {bits}-bit int weights and "
        f"{'no' if not inputs else str(inputs.get('num_bits')) + '-bit ' + str(inputs.get('type'))} input activations "
        "is not supported",
        "supported: pack-quantized W4A16 / W8A16 (no input activations), int-quantized W8A8-int8",
    )


def weight_shapes(
    missing: dict[str, tuple[str, tuple[int, ...]]], held: dict[str, tuple[str, tuple[int, ...]]], quant: dict | None
) -> list[OutTensor]:
    """`weight_shape` tensors (I64 [2], the unpacked [N, K]) that an output of a pack-quantized
    checkpoint does not hold, rebuilt from their `weight_packed` siblings' shapes (name -> (dtype, shape))."""
    if not quant or quant.get("format") != "pack-quantized" or quant.get("num_bits") not in WNA16_BITS:
        return []
    pk = 32 // quant["num_bits"]
    out = []
    for name, (dtype, shape) in missing.items():
        packed = held.get(name.removesuffix("weight_shape") + "weight_packed")
        if not name.endswith(".weight_shape") or packed is None or (dtype, shape) != ("I64", (2,)):
            continue
        n, k = packed[1][0], packed[1][1] * pk
        out.append(OutTensor(name, dtype, shape, (Fill(float(n), 1), Fill(float(k), 1))))
    return out
