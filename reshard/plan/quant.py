"""The checkpoint's weight quantization: one strategy object per scheme, chosen once from config.json.

A strategy says which modules it quantizes, writes the scale tensors of a linear layer and of an MoE
layer's experts, and the KV-cache buffers vLLM's quantized attention registers. Two axes make a
scheme: the quantization config vLLM builds (`Fp8Config`, `CompressedTensorsConfig`: decides the
KV-cache buffers and whether MoE block scales may be refined) and the weight-scale layout (block,
per channel, per tensor). The planner never asks which scheme it has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.expertblocks import RankScales, block_expert_scales
from reshard.plan.geometry import LinearRank, MoeSplit, Sources, cdiv
from reshard.plan.kvscales import KvHeads, ct_kv_params, fp8_kv_params
from reshard.plan.model import OutTensor, Slice, scalar, whole


@dataclass(frozen=True)
class Quant:
    """A quantization scheme, as vLLM reads it (a concrete subclass below is one scheme)."""

    block: tuple[int, int] | None  # weight_block_size / block_structure
    static_activations: bool
    ignored: tuple[str, ...]
    kv_strategy: str | None = None  # compressed-tensors kv_cache_scheme: "tensor" or "attn_head"

    method: ClassVar[str]  # "fp8" (Fp8Config) or "compressed-tensors" (float-quantized W8A8)
    strategy: ClassVar[str]  # "block", "tensor" or "channel"
    scale_name: ClassVar[str] = "weight_scale"
    weight_dtype: ClassVar[str] = "F8_E4M3"  # the FP8 schemes' (reshard.plan.intquant: the integer ones)
    weight_param: ClassVar[str] = "weight"  # the weight's name, in the checkpoint and in vLLM
    k_first: ClassVar[bool] = False  # weights stored [in, out] (GPTQ / AWQ, reshard.plan.gptq): their own walks
    k_pack: ClassVar[int] = 1  # K-first weights: values per int32 along the input dim
    n_pack: ClassVar[int] = 1  # ... and along the output dim
    # the model dtypes vLLM runs the method in (its get_supported_act_dtypes; config/vllm.py refuses others)
    act_dtypes: ClassVar[tuple[str, ...]] = ("BF16", "F16", "F32")  # compressed-tensors

    @property
    def pack(self) -> int:
        """Weight values per stored element along the input dim (packed integer formats: 32 / bits)."""
        return 1

    def for_checkpoint(self, names: Iterable[str]) -> Quant:
        """The scheme once the checkpoint's tensor names are known (GPTQ: which modules it quantizes)."""
        return self

    def config_patch(self, config: dict) -> dict:
        """Keys the copied config.json needs for vLLM to build the same layers from the output's files."""
        return {}

    def check_weight(self, w: TensorInfo) -> None:
        """A weight this scheme quantizes must be stored quantized."""
        if w.dtype != self.weight_dtype:
            raise SourceError(f"{w.name} is {w.dtype}, but config.json says it is {self.weight_dtype}")

    def ignores(self, prefix: str) -> bool:
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], prefix):
                    return True
            elif entry == prefix:
                return True
        return False

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        """Whether the module whose HF slots are `prefixes` is quantized.

        `experts`: the prefix is a fused-MoE experts list, which vLLM (is_layer_skipped) also
        skips when an ignore entry contains it, e.g. names one of its experts.
        """
        skipped = [self.ignores(p) or (experts and any(p in entry for entry in self.ignored)) for p in prefixes]
        if any(skipped) and not all(skipped):
            raise UnsupportedError(f"some but not all shards of {prefixes[0]} are quantized; vLLM refuses this")
        return not all(skipped)

    def quantizes_experts(self, prefix: str, names: tuple[str, str, str]) -> bool:
        """Whether the experts list at `prefix` (each expert's projections `names`: gate, up, down) is quantized."""
        return self.quantizes([prefix], experts=True)

    def quantizes_lm_head(self) -> bool:
        """vLLM builds the (untied) lm_head with this scheme's linear method (GPTQ's `lm_head: true`)."""
        return False

    def to_json(self) -> dict:
        out = {
            "method": self.method,
            "strategy": self.strategy,
            "weight_block_size": list(self.block) if self.block else None,
            "activation_scheme": "static" if self.static_activations else "dynamic",
        }
        if self.kv_strategy:
            out["kv_cache_scheme"] = self.kv_strategy
        return out

    # ---- what each scheme provides -----------------------------------------------------------

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        """The attention layer's KV-cache method parameters on one rank (`dtype`: the model's;
        `found`: parameter -> the checkpoint tensor vLLM loads into it, reshard.plan.kvscales)."""
        raise NotImplementedError

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        """The scale tensors of a quantized linear layer on one rank."""
        raise NotImplementedError

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        """Looks up and checks every expert's scales once; returns a rank's scale tensors by rank."""
        raise NotImplementedError


# ---- the quantization config vLLM builds -------------------------------------------------------


class _Fp8Config(Quant):
    method = "fp8"
    act_dtypes = ("BF16", "F16")
    refines_moe_blocks = True  # Fp8MoEMethod refines the MoE scale grid when a TP split cuts a block

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return fp8_kv_params(sources, target, dtype, found)


@dataclass(frozen=True)
class _CompressedTensors(Quant):
    """vLLM's CompressedTensorsConfig.get_scheme_dict: a layer not ignored is quantized where the config group's
    targets match it: its name (or every shard of a fused one) equal to a target or matching a `re:` one, or the
    `Linear` target (contained in every vLLM linear class's name). An experts list takes the scheme of its expert
    0's gate, up and down projections, checked one by one (CompressedTensorsMoEMethod.get_moe_method); `Linear`
    targets them too (`_add_fused_moe_to_target_scheme_map`)."""

    method = "compressed-tensors"
    refines_moe_blocks = False  # its MoE method validates the checkpoint's blocks as they are
    targets: tuple[str, ...] = field(default=("Linear",), kw_only=True)  # layer names, `re:` patterns or Linear

    def __post_init__(self) -> None:
        for t in self.targets:
            if not t.startswith("re:") and "." not in t and t != "Linear":
                raise UnsupportedError(
                    f"compressed-tensors config group target {t!r}: reshard matches layer names, `re:` patterns "
                    "and `Linear` (every linear layer)",
                    "this checkpoint's targets are not supported",
                )

    def _targeted(self, name: str) -> bool:
        return "Linear" in self.targets or any(
            re.match(t[3:], name) if t.startswith("re:") else t == name for t in self.targets
        )

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        if not super().quantizes(prefixes, experts=experts):
            return False  # ignored
        targeted = [self._targeted(p) for p in prefixes]
        if any(targeted) and not all(targeted):
            raise UnsupportedError(
                f"the compressed-tensors targets match some but not all shards of {prefixes[0]}; vLLM refuses this"
            )
        return all(targeted)

    def quantizes_experts(self, prefix: str, names: tuple[str, str, str]) -> bool:
        got = [not self.ignores(f"{prefix}.0.{n}") and self._targeted(f"{prefix}.0.{n}") for n in names]
        if any(got) and not all(got):
            raise UnsupportedError(
                f"{prefix}: the compressed-tensors ignore list or targets quantize some of expert 0's "
                f"{', '.join(names)} and not the others; vLLM refuses this (all MoE projections need the same scheme)"
            )
        return all(got)

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return ct_kv_params(sources, target, dtype, found, self.kv_strategy, heads)


# ---- the weight-scale layouts --------------------------------------------------------------------


def channel_scales(sources: Sources, lin: LinearRank) -> OutTensor:
    """`weight_scale` [out, 1], F32: each slot's rows of this rank, as the weight's."""
    pieces = []
    scales = lin.per_slot(sources, "weight_scale")
    for s, (a, b, _), off in zip(scales, lin.rows, lin.offs, strict=True):
        total = sum(lin.outs) if lin.fused else sum(n for t, n in zip(scales, lin.outs, strict=True) if t == s)
        if s.shape != (total, 1):
            raise SourceError(f"{s.name} has shape {list(s.shape)}, per-channel scales need {[total, 1]}")
        pieces.append(Slice(s.name, (off + a, 0), (off + b, 1)))
    n_rows = sum(b - a for a, b, _ in lin.rows)
    return OutTensor(f"{lin.target}.weight_scale", "F32", (n_rows, 1), tuple(pieces))


class _BlockScales(Quant):
    """One scale per [bn, bk] block of a weight: sliced by block rows / columns with the weight."""

    strategy = "block"
    refines_moe_blocks: ClassVar[bool]

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        assert self.block is not None
        scales = lin.per_slot(sources, self.scale_name)
        bn, bk = self.block
        in_r = lin.cols[1] - lin.cols[0]
        if lin.splits_cols and in_r % bk:
            raise UnsupportedError(
                f"{lin.target}: per-rank input size {in_r} is not divisible by the FP8 block {bk}",
                "vLLM refuses this split; use a smaller --tp",
            )
        parts = [b - a for a, b, _ in lin.rows]
        # ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch: a layer of several slots,
        # one of which is not a block multiple, skips the block-shape validation (DeepSeek's
        # fused_qkv_a_proj, [q_lora_rank, kv_lora_rank + rope])
        several = len(lin.slots) > 1
        mismatch_allowed = several and any(p % bn for p in parts)
        nc = cdiv(in_r, bk)
        c0 = (lin.cols[0] // in_r) * nc  # row-parallel: this rank's block columns
        total = sum(lin.outs) if lin.fused else None
        pieces = []
        for i, (s, (a, b, shard), off) in enumerate(zip(scales, lin.rows, lin.offs, strict=True)):
            part = b - a
            checked = lin.splits_rows or (several and i < len(lin.slots) - 1)
            if checked and part % bn and not mismatch_allowed:
                raise UnsupportedError(
                    f"{lin.target}: per-rank output size {part} is not divisible by the FP8 block {bn}",
                    "vLLM refuses this split; use a smaller --tp",
                )
            # a fused HF tensor's rows, or those of the slots sharing this slot's tensor (the styles' `sizes`)
            rows_in = total if total is not None else sum(n for t, n in zip(scales, lin.outs, strict=True) if t == s)
            if s.shape != (cdiv(rows_in, bn), cdiv(lin.in_size, bk)):
                raise SourceError(
                    f"{s.name} has shape {list(s.shape)}, block {list(self.block)} of a [{rows_in}, {lin.in_size}] "
                    f"weight needs {[cdiv(rows_in, bn), cdiv(lin.in_size, bk)]}"
                )
            if off % bn:
                raise UnsupportedError(
                    f"{lin.target}: slot {lin.fused[i] if lin.fused else i} of the fused {s.name} starts at row "
                    f"{off}, not on an FP8 block boundary ({bn})"
                )
            nr = cdiv(part, bn)
            r0 = off // bn + shard * nr
            pieces.append(Slice(s.name, (r0, c0), (r0 + nr, c0 + nc)))
        n_rows = sum(p.stop[0] - p.start[0] for p in pieces)
        if n_rows != cdiv(sum(parts), bn):
            raise UnsupportedError(
                f"{lin.target}: FP8 block scales do not tile the fused weight: each rank holds {parts} rows of "
                f"its slots, pieces of different {bn}-row blocks that vLLM would put under one scale block",
                "use a smaller --tp",
            )
        return [OutTensor(f"{lin.target}.{self.scale_name}", "F32", (n_rows, nc), tuple(pieces))]

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        assert self.block is not None
        return block_expert_scales(self.block, self.refines_moe_blocks, self.scale_name, sources, split)


class _ChannelScales(Quant):
    """One scale per output row, [out, 1]: sliced like the weight's rows."""

    strategy = "channel"

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        if self.static_activations:
            raise UnsupportedError(f"{lin.target}: static input scales with per-channel weights are not supported")
        return [channel_scales(sources, lin)]

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        gate, up, down = split.names
        s13: list[tuple[TensorInfo, TensorInfo]] = []
        for e in range(split.num):
            pair = (split.tensor(sources, e, gate, "weight_scale"), split.tensor(sources, e, up, "weight_scale"))
            for sc in pair:
                if sc.shape != (split.inter, 1):
                    raise SourceError(f"{sc.name} has shape {list(sc.shape)}, expected {[split.inter, 1]}")
            s13.append(pair)
        s2 = [whole(split.tensor(sources, e, down, "weight_scale")) for e in range(split.num)]

        def rank(r: int) -> list[OutTensor]:
            experts, ip = split.experts(r), split.ip
            off = split.shard(r) * ip
            b13 = ((off, 0), (off + ip, 1))  # bounds shared by every expert
            p13 = tuple(Slice(sc.name, *b13) for e in experts for sc in s13[e])
            n = len(experts)
            return [
                OutTensor(f"{split.target}.w13_weight_scale", "F32", (n, 2 * ip, 1), p13),
                OutTensor(
                    f"{split.target}.w2_weight_scale", "F32", (n, split.hidden, 1), tuple(s2[e] for e in experts)
                ),
            ]

        return rank


class _TensorScales(Quant):
    """One scale per weight (and, with static activations, one input scale): whole on every rank."""

    strategy = "tensor"

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        n = len(lin.outs)
        if not lin.fused and len(set(lin.slots)) < n:
            raise UnsupportedError(
                f"{lin.target}: one per-tensor scale shared by several of vLLM's shards (Qwen3.5's in_proj_qkv) "
                "is a layout reshard has not checked against vLLM",
                "use the bf16 or block-FP8 checkpoint",
            )
        scales = tuple(scalar(s) for s in lin.per_slot(sources, "weight_scale"))
        out = [OutTensor(f"{lin.target}.weight_scale", "F32", (n,), scales)]
        if self.static_activations:
            inputs = tuple(scalar(s) for s in lin.per_slot(sources, "input_scale"))
            out.append(OutTensor(f"{lin.target}.input_scale", "F32", (n,), inputs))
        return out

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        gate, up, down = split.names
        num = range(split.num)
        s13 = [
            (
                scalar(split.tensor(sources, e, gate, "weight_scale")),
                scalar(split.tensor(sources, e, up, "weight_scale")),
            )
            for e in num
        ]
        s2 = [scalar(split.tensor(sources, e, down, "weight_scale")) for e in num]
        if self.static_activations:
            # one slot per expert; vLLM keeps the last of gate/up it loads (up sorts last)
            i13 = [scalar(split.tensor(sources, e, up, "input_scale")) for e in num]
            i2 = [scalar(split.tensor(sources, e, down, "input_scale")) for e in num]
            for e in num:
                sources.mark_used(f"{split.base}.{e}.{gate}.input_scale")

        def rank(r: int) -> list[OutTensor]:
            experts = split.experts(r)
            n, t = len(experts), split.target
            out = [
                OutTensor(f"{t}.w13_weight_scale", "F32", (n, 2), tuple(s for e in experts for s in s13[e])),
                OutTensor(f"{t}.w2_weight_scale", "F32", (n,), tuple(s2[e] for e in experts)),
            ]
            if self.static_activations:
                out.append(OutTensor(f"{t}.w13_input_scale", "F32", (n,), tuple(i13[e] for e in experts)))
                out.append(OutTensor(f"{t}.w2_input_scale", "F32", (n,), tuple(i2[e] for e in experts)))
            return out

        return rank


# ---- the schemes ---------------------------------------------------------------------------------


class Fp8Block(_Fp8Config, _BlockScales):
    """`quant_method: fp8` with `weight_block_size` (DeepSeek-V3, Qwen3-*-FP8): `weight_scale_inv` blocks."""

    scale_name = "weight_scale_inv"


class Fp8Tensor(_Fp8Config, _TensorScales):
    """`quant_method: fp8` without blocks: per-tensor scales, dynamic or static input scales."""


class CompressedTensorsBlock(_CompressedTensors, _BlockScales):
    """compressed-tensors FP8 with `strategy: block`."""


class CompressedTensorsChannel(_CompressedTensors, _ChannelScales):
    """compressed-tensors FP8 with `strategy: channel` (llm-compressor's FP8_DYNAMIC)."""


class CompressedTensorsTensor(_CompressedTensors, _TensorScales):
    """compressed-tensors FP8 with `strategy: tensor`."""


class Mxfp4(Quant):
    """`quant_method: mxfp4` (gpt-oss): only the routed experts are quantized, as `*_blocks` / `*_scales`
    (laid out by reshard.plan.fusedexperts). vLLM's Mxfp4Config gives linear layers the unquantized
    method and attention no KV-cache method, whatever `modules_to_not_convert` says."""

    method = "mxfp4"
    act_dtypes = ("BF16",)  # Mxfp4Config, and gpt_oss_mxfp4 it becomes
    strategy = "mx-block"
    weight_dtype = "U8"

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        return experts

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return []
