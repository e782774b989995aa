"""NVFP4 (float4 e2m1 weights in groups of 16 with an FP8 scale each, plus one F32 global scale per
tensor): compressed-tensors `nvfp4-pack-quantized` and ModelOpt `quant_algo: NVFP4`.

vLLM 0.32 builds `CompressedTensorsW4A4Fp4` / `CompressedTensorsW4A4Nvfp4MoEMethod` (CT, `use_a16` without
input activations) and `ModelOptLinearMethod` (KNvfp4Static + KNvfp4Dynamic, or W4A16_NVFP4) /
`ModelOptNvFp4FusedMoE` (modelopt_fp4). Scales are swizzled only after loading; before it, per rank:

- linear: the packed weight U8 [N_p, K_p / 2] (CT `weight_packed`, ModelOpt `weight`), `weight_scale`
  F8_E4M3 [N_p, K_p / 16] (sliced as the weight; K_p must hold whole groups), the global weight scale F32
  [slots] (CT `weight_global_scale`, ModelOpt `weight_scale_2`: one per shard slot of a merged layer, whole
  in a row layer) and, W4A4, the global input scale likewise (CT `input_global_scale`, ModelOpt
  `input_scale`). ModelOpt W4A16 registers `input_scale` [slots] as NaN and drops it after loading (an
  older export's tensor is loaded into it).
- experts, N-first: `w13_<weight>` U8 [E, 2 I_p, H / 2], `w2_<weight>` U8 [E, H, I_p / 2], group scales
  [E, 2 I_p, H / 16] / [E, H, I_p / 16], global weight scales [E, 2] (gate, up) / [E], input scales likewise.
  Without input activations vLLM still registers the expert input scales (`torch.empty`, never loaded:
  the A16 kernels do not read them); the folder holds 1.0 there. ModelOpt's expert input scales have the
  GLOBAL expert count as first dim under EP when the backend is one of FlashInfer's (`use_global_sf`):
  `--moe-backend` decides (reshard.plan.backends.nvfp4_global_scales) and the serve line pins it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import ClassVar

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan import backends
from reshard.plan.expertblocks import RankScales
from reshard.plan.geometry import LinearRank, MoeSplit, Sources
from reshard.plan.kvscales import KvHeads, fp8_kv_params
from reshard.plan.model import Fill, OutTensor, Piece, Slice, scalar
from reshard.plan.modelopt import config_json_ignore, excluded, modelopt_algo
from reshard.plan.quant import Quant, _CompressedTensors

GROUP = 16  # NVFP4's group: vLLM accepts no other (CT _is_nvfp4_format; ModelOpt's group_size)
UNREAD = 1.0  # what the folder holds where vLLM leaves an A16 expert input scale uninitialised


def _tps(size: int) -> str:
    return ", ".join(str(t) for t in (1, 2, 4, 8, 16) if size % t == 0 and (size // t) % GROUP == 0)


def _maybe(sources: Sources, name: str, why: str) -> TensorInfo | None:
    with contextlib.suppress(SourceError):
        return sources.src(name, why)
    return None


@dataclass(frozen=True)
class _Nvfp4(Quant):
    """What both producers share: the packed weight, group scales, and per-tensor global scales."""

    a16: bool = False  # no input activations (W4A16 NVFP4)

    strategy = "tensor_group"
    weight_dtype = "U8"
    global_name: ClassVar[str]  # the global weight scale
    input_name: ClassVar[str]  # the global input scale
    format: ClassVar[str]  # the producer's format, in the plan's quantization summary

    @property
    def pack(self) -> int:
        return 2  # two e2m1 values per byte along the input dim

    def to_json(self) -> dict:
        return {**super().to_json(), "format": self.format, "group_size": GROUP, "input_activations": not self.a16}

    # ---- linear layers -----------------------------------------------------------------------

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        if lin.fused or len(set(lin.slots)) < len(lin.outs):
            raise UnsupportedError(
                f"{lin.target}: a fused HF tensor of NVFP4 weights is a layout reshard has not checked against vLLM",
                "use the bf16 checkpoint",
            )
        in_r = lin.cols[1] - lin.cols[0]
        if lin.in_size % GROUP:
            raise SourceError(f"{lin.target}: input size {lin.in_size} is not a multiple of the NVFP4 group {GROUP}")
        if in_r % GROUP:
            raise UnsupportedError(
                f"{lin.target}: per-rank input size {in_r} is not a multiple of the NVFP4 group {GROUP}; a split "
                "that cuts a group has no per-rank scale layout",
                f"use a --tp that keeps whole groups: {_tps(lin.in_size)}",
            )
        g0, ng = lin.cols[0] // GROUP, in_r // GROUP
        pieces = []
        for s, n, (a, b, _) in zip(lin.per_slot(sources, "weight_scale"), lin.outs, lin.rows, strict=True):
            if s.shape != (n, lin.in_size // GROUP) or s.dtype != "F8_E4M3":
                raise SourceError(
                    f"{s.name} is {s.dtype} {list(s.shape)}, expected F8_E4M3 {[n, lin.in_size // GROUP]}"
                )
            pieces.append(Slice(s.name, (a, g0), (b, g0 + ng)))
        rows = sum(b - a for a, b, _ in lin.rows)
        n = len(lin.outs)
        out = [
            OutTensor(f"{lin.target}.weight_scale", "F8_E4M3", (rows, ng), tuple(pieces)),
            OutTensor(
                f"{lin.target}.{self.global_name}",
                "F32",
                (n,),
                tuple(scalar(s) for s in lin.per_slot(sources, self.global_name)),
            ),
        ]
        inputs = self.linear_inputs(sources, lin)
        if inputs is not None:
            out.append(OutTensor(f"{lin.target}.{self.input_name}", inputs[0], (n,), inputs[1]))
        return out

    def linear_inputs(self, sources: Sources, lin: LinearRank) -> tuple[str, tuple[Piece, ...]] | None:
        """The global input scale's dtype and pieces, per slot; None where vLLM has none."""
        if self.a16:
            return None
        return "F32", tuple(scalar(s) for s in lin.per_slot(sources, self.input_name))

    # ---- routed experts ----------------------------------------------------------------------

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        ip, inter, hidden = split.ip, split.inter, split.hidden
        if hidden % GROUP or inter % GROUP:
            raise SourceError(
                f"{split.target}: hidden {hidden} and intermediate {inter} sizes must be multiples of the NVFP4 "
                f"group {GROUP}"
            )
        if ip % GROUP:
            raise UnsupportedError(
                f"{split.target}: per-rank intermediate size {ip} is not a multiple of the NVFP4 group {GROUP}; "
                "a split that cuts a group has no per-rank scale layout (vLLM would load empty down scales)",
                f"use --ep, or a --tp that keeps whole groups: {_tps(inter)}",
            )
        gate, up, down = split.names
        want = {gate: (inter, hidden // GROUP), up: (inter, hidden // GROUP), down: (hidden, inter // GROUP)}
        gs: dict[str, list[TensorInfo]] = {}
        for proj, shape in want.items():
            gs[proj] = [split.tensor(sources, e, proj, "weight_scale") for e in range(split.num)]
            for t in gs[proj]:
                if t.shape != shape or t.dtype != "F8_E4M3":
                    raise SourceError(f"{t.name} is {t.dtype} {list(t.shape)}, expected F8_E4M3 {list(shape)}")
        num = range(split.num)
        glob = {p: [scalar(split.tensor(sources, e, p, self.global_name)) for e in num] for p in (gate, up, down)}
        glob13 = [(glob[gate][e], glob[up][e]) for e in num]
        inputs = self.expert_inputs(sources, split)
        # ModelOpt + a FlashInfer backend under EP: every rank holds every expert's input scales
        in_rows = split.global_scales

        def rank(r: int) -> list[OutTensor]:
            experts, start = split.experts(r), split.shard(r) * ip
            n, t = len(experts), split.target
            c0, c2 = start // GROUP, ip // GROUP
            b13 = ((start, 0), (start + ip, hidden // GROUP))
            w13 = tuple(Slice(x.name, *b13) for e in experts for x in (gs[gate][e], gs[up][e]))
            w2 = tuple(Slice(gs[down][e].name, (0, c0), (hidden, c0 + c2)) for e in experts)
            out = [
                OutTensor(f"{t}.w13_weight_scale", "F8_E4M3", (n, 2 * ip, hidden // GROUP), w13),
                OutTensor(f"{t}.w2_weight_scale", "F8_E4M3", (n, hidden, c2), w2),
                OutTensor(f"{t}.w13_{self.global_name}", "F32", (n, 2), tuple(p for e in experts for p in glob13[e])),
                OutTensor(f"{t}.w2_{self.global_name}", "F32", (n,), tuple(glob[down][e] for e in experts)),
            ]
            held = num if in_rows else experts
            m = len(held)
            if inputs is None:
                p13: tuple[Piece, ...] = (Fill(UNREAD, 2 * m),)
                p2: tuple[Piece, ...] = (Fill(UNREAD, m),)
            else:
                p13 = tuple(p for e in held for p in (inputs[gate][e], inputs[up][e]))
                p2 = tuple(inputs[down][e] for e in held)
            out.append(OutTensor(f"{t}.w13_{self.input_name}", "F32", (m, 2), p13))
            out.append(OutTensor(f"{t}.w2_{self.input_name}", "F32", (m,), p2))
            return out

        return rank

    def expert_inputs(self, sources: Sources, split: MoeSplit) -> dict[str, list[Piece]] | None:
        """Each expert's global input scales (gate, up, down), or None where vLLM loads none."""
        if self.a16:
            return None
        return {
            p: [scalar(split.tensor(sources, e, p, self.input_name)) for e in range(split.num)] for p in split.names
        }


@dataclass(frozen=True)
class CompressedTensorsNvfp4(_CompressedTensors, _Nvfp4):
    """compressed-tensors `nvfp4-pack-quantized` (llm-compressor's NVFP4 and NVFP4A16 schemes)."""

    weight_param = "weight_packed"
    global_name = "weight_global_scale"
    input_name = "input_global_scale"
    format = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class ModelOptNvfp4(_Nvfp4):
    """ModelOpt `quant_algo: NVFP4` (W4A4; W4A16 when no config group quantizes input activations)."""

    method = "modelopt_fp4"
    act_dtypes = ("BF16", "F16")  # ModelOptNvFp4Config (and FP8 activations, not a model dtype)
    weight_param = "weight"
    global_name = "weight_scale_2"
    input_name = "input_scale"
    format = "modelopt"
    mla_kv_cache = True  # get_quant_method gives Attention and MLAAttention the (unit, -1.0) KV-cache method

    def ignores(self, prefix: str) -> bool:
        return excluded(self.ignored, prefix)

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return fp8_kv_params(sources, target, dtype, found)  # BaseKVCacheMethod, as Fp8KVCacheMethod's

    def linear_inputs(self, sources: Sources, lin: LinearRank) -> tuple[str, tuple[Piece, ...]] | None:
        if not self.a16:
            return super().linear_inputs(sources, lin)
        # W4A16_NVFP4 (_DropInputScale): torch.full(slots, nan) in the default dtype (the model's), an older
        # export's input_scale loaded into it
        found = [_maybe(sources, f"{s}.input_scale", lin.target) for s in lin.slots]
        return lin.dtype, tuple(scalar(t) if t is not None else Fill(float("nan"), 1) for t in found)

    def moe_split(self, sources: Sources, backend: str, split: MoeSplit) -> tuple[MoeSplit, str | None]:
        """The experts' input-scale layout `backend` gives, and the backend the serve line must pin (None:
        none needed)."""
        glob, pin = backends.nvfp4_global_scales(backend, split.ep, a16=self.a16)
        if pin and backend == "auto":
            sources.note(backends.nvfp4_pin_note(pin))
        return (replace(split, global_scales=True) if glob else split), pin

    def expert_inputs(self, sources: Sources, split: MoeSplit) -> dict[str, list[Piece]] | None:
        if not self.a16:
            return super().expert_inputs(sources, split)
        for e in range(split.num):  # an older W4A16 export's expert input scales: vLLM reads and never uses them
            for p in split.names:
                _maybe(sources, f"{split.base}.{e}.{p}.input_scale", split.target)
        return None


def ct_nvfp4(qc: dict, group: dict, kv: str | None) -> Quant:
    """compressed-tensors NVFP4: float 4-bit weights, tensor_group strategy, groups of 16, symmetric."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations") or None
    if not _is_nvfp4(weights):
        raise UnsupportedError(
            f"compressed-tensors float 4-bit weights with strategy {weights.get('strategy')!r}, group size "
            f"{weights.get('group_size')!r}: vLLM reads NVFP4 only (tensor_group, 16, symmetric)",
            "MXFP4 (group 32) compressed-tensors checkpoints are not supported by reshard",
        )
    if inputs is not None and not _is_nvfp4(inputs):
        raise UnsupportedError(
            "compressed-tensors NVFP4 weights with non-NVFP4 input activations: vLLM refuses them "
            "(NVFP4 inputs, or none for NVFP4A16)"
        )
    ignored = tuple(qc.get("ignore") or [])
    return CompressedTensorsNvfp4(None, False, ignored, kv, inputs is None)


def _is_nvfp4(args: dict) -> bool:
    """CompressedTensorsConfig._is_nvfp4_format."""
    return (
        args.get("strategy") == "tensor_group"
        and args.get("type") == "float"
        and args.get("num_bits") == 4
        and args.get("group_size") == GROUP
        and bool(args.get("symmetric", True))
    )


def is_modelopt_fp4(qc: dict) -> bool:
    """ModelOptNvFp4Config.override_quantization_method: an algo naming FP4 is modelopt_fp4."""
    algo = modelopt_algo(qc)
    return algo is not None and ("NVFP4" in algo or "FP4" in algo)


def modelopt_nvfp4(qc: dict) -> Quant:
    """ModelOptNvFp4Config.from_config / _from_config."""
    algo = modelopt_algo(qc) or ""
    legacy = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else None
    src = legacy if legacy is not None else qc
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise UnsupportedError(f"ModelOpt quant_algo {algo!r}: vLLM's modelopt_fp4 reads NVFP4 and W4A16_NVFP4")
    group = src.get("group_size")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise SourceError(f"ModelOpt quantization config: group_size must be an integer, found {group!r}")
    if group is not None and group != GROUP:
        raise UnsupportedError(f"ModelOpt NVFP4 with group_size {group}: vLLM's NVFP4 kernels take {GROUP}")
    if legacy is not None:
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in legacy]
        if missing:
            raise UnsupportedError(f"ModelOpt NVFP4 hf_quant_config.json lacks {missing}: vLLM refuses it")
        kv_algo = legacy.get("kv_cache_quant_algo")
        ignored = legacy.get("exclude_modules") or []
    else:
        scheme = qc.get("kv_cache_scheme")
        kv_algo = "FP8" if isinstance(scheme, dict) and scheme.get("type") == "float" else None
        ignored = config_json_ignore(qc) or []
    groups = qc.get("config_groups")
    weights_only = (
        isinstance(groups, dict)
        and groups
        and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())
    )
    if algo == "NVFP4" and weights_only:
        algo = "W4A16_NVFP4"
    if not isinstance(ignored, list) or not all(isinstance(e, str) for e in ignored):
        raise SourceError(
            f"ModelOpt quantization config: the excluded modules must be a list of names, found {ignored!r}"
        )
    if kv_algo not in (None, "FP8"):
        raise UnsupportedError(f"ModelOpt kv_cache_quant_algo {kv_algo!r} is not supported", "supported: none, FP8")
    # apply_vllm_mapper: "path*" (no dot before the star) also means "path" and "path.*"
    expanded: list[str] = []
    for e in ignored:
        expanded += [e[:-1], e[:-1] + ".*"] if len(e) >= 2 and e[-1] == "*" and e[-2] != "." else [e]
    return ModelOptNvfp4(None, False, tuple(expanded), None, algo == "W4A16_NVFP4")
