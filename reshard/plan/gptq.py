"""GPTQ (`quant_method: gptq`) and AWQ (`quant_method: awq`): int32-packed weights stored K-first.

vLLM 0.32 builds `AutoGPTQConfig` (also for `--quantization gptq_marlin / auto_gptq / marlin`) and
`AutoAWQConfig` (`awq_marlin`, `auto_awq`) for them (model_executor/layers/quantization/auto_gptq.py,
auto_awq.py). The layouts before vLLM's post-processing, per rank (K / N: in / out features, G: group):

- GPTQ linear: `qweight` I32 [K_p / (32 / b), N_p] (packed along K), `scales` [K_p / G, N_p] in the
  model dtype, `qzeros` I32 [K_p / G, N_p / (32 / b)] (packed along N; written for symmetric
  checkpoints too). Channelwise (G = -1): one group; a row-parallel layer holds it whole on every rank
  (`marlin_repeat_scales_on_all_ranks`). `g_idx` is not a parameter: vLLM drops it at load.
- AWQ linear (4-bit): `qweight` I32 [K_p, N_p / 8] (packed along N), `qzeros` [K_p / G, N_p / 8], `scales`
  [K_p / G, N_p].
- MoE, Marlin (`AutoGPTQMoEMethod` / `AutoAWQMoEMethod`, K-first, `is_transposed`): GPTQ `w13_qweight`
  [E, H / pk, 2 I_p], `w2_qweight` [E, I_p / pk, H], `w13_scales` [E, H / G, 2 I_p], `w2_scales` [E, I_p / G, H],
  `w13_qzeros` [E, H / G, 2 I_p / pk], `w2_qzeros` [E, I_p / G, H / pk], and zero `w13_bias` [E, 2 I_p],
  `w2_bias` [E, H] that no checkpoint tensor fills; AWQ: `w13_qweight` [E, H, 2 I_p / 8], `w2_qweight`
  [E, I_p, H / 8], scales and zero points as GPTQ's, no biases. vLLM takes this method when
  `check_moe_marlin_supports_layer` holds: not ROCm, H % 128 == 0, G in {-1, 32, 64, 128}, I_p % G == 0
  (the same on every CUDA GPU, whatever --moe-backend says); otherwise `MoeWNA16Method` (uint8, N-first,
  scales repeated to a smaller group): written for symmetric grouped GPTQ (reshard.plan.gptqwna16),
  refused for AWQ (its nibbles are reordered at load).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.expertblocks import RankScales
from reshard.plan.geometry import LinearRank, MoeSplit, Sources
from reshard.plan.gptqwna16 import wna16_group, wna16_rank
from reshard.plan.kvscales import KvHeads
from reshard.plan.model import Fill, OutTensor, Slice, side_by_side
from reshard.plan.quant import Quant

MARLIN_MOE_GROUPS = (-1, 32, 64, 128)  # check_moe_marlin_supports_config


def _tps(size: int, unit: int) -> str:
    """The TP sizes up to 16 that cut `size` into whole `unit`s."""
    return ", ".join(str(t) for t in (1, 2, 4, 8, 16) if size % t == 0 and (size // t) % unit == 0)


def _check(t: TensorInfo, shape: tuple[int, ...], dtype: str | None = None) -> TensorInfo:
    if t.shape != shape or (dtype and t.dtype != dtype):
        raise SourceError(f"{t.name} is {t.dtype} {list(t.shape)}, expected {dtype or ''} {list(shape)}".strip())
    return t


@dataclass(frozen=True)
class _KFirst(Quant):
    """Weights, scales and zero points stored [in, out]; every module with a `qweight` quantized."""

    bits: int = 4
    group: int = 128
    layers: tuple[str, ...] | None = None  # modules vLLM quantizes (matched as substrings); None: every linear

    k_first = True
    weight_dtype = "I32"
    weight_param = "qweight"
    method: ClassVar[str]
    experts_bias: ClassVar[bool] = False  # the MoE method registers zero w13_bias / w2_bias

    @property
    def zpack(self) -> int:
        """Zero points per int32 (packed along N)."""
        return 32 // self.bits

    def to_json(self) -> dict:
        return {**super().to_json(), "bits": self.bits, "group_size": self.group}

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return []  # no KV-cache method for attention

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        if experts:
            return not any(self.ignores(p) for p in prefixes)
        found = [self.layers is None or any(m in p for m in self.layers) for p in prefixes]
        found = [f and not self.ignores(p) for f, p in zip(found, prefixes, strict=True)]
        if any(found) and not all(found):
            raise UnsupportedError(f"some but not all shards of {prefixes[0]} are quantized; vLLM refuses this")
        return all(found)

    def _drop(self, sources: Sources, slot: str, in_size: int) -> None:
        """Tensors vLLM reads and drops (GPTQ's g_idx)."""

    # ---- linear layers -----------------------------------------------------------------------

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        g, zp = self.group, self.zpack
        in_r = lin.cols[1] - lin.cols[0]
        if g <= 0:  # one group: whole on a row-parallel rank, its output columns elsewhere
            g0, ng, gtot = 0, 1, 1
        else:
            if lin.in_size % g:
                raise SourceError(f"{lin.target}: input size {lin.in_size} is not a multiple of the group {g}")
            if in_r % g:
                raise UnsupportedError(
                    f"{lin.target}: per-rank input size {in_r} is not a multiple of the quantization group {g}; "
                    "vLLM refuses a split that cuts a group",
                    f"use a --tp that keeps whole groups: {_tps(lin.in_size, g)}",
                )
            g0, ng, gtot = lin.cols[0] // g, in_r // g, lin.in_size // g
        sparts, zparts = [], []
        for slot, n, (a, b, _) in zip(lin.slots, lin.outs, lin.rows, strict=True):
            s = _check(sources.src(f"{slot}.scales", lin.target), (gtot, n))
            z = _check(sources.src(f"{slot}.qzeros", lin.target), (gtot, n // zp), "I32")
            if n % zp or a % zp or b % zp:
                raise UnsupportedError(
                    f"{lin.target}: output columns [{a}, {b}) of {slot} on a rank cut the zero points packed {zp} "
                    "to an int32",
                    f"use a --tp that keeps whole int32s: {_tps(n, zp)}",
                )
            self._drop(sources, slot, lin.in_size)
            sparts.append(Slice(s.name, (g0, a), (g0 + ng, b)))
            zparts.append(Slice(z.name, (g0, a // zp), (g0 + ng, b // zp)))
        n = sum(b - a for a, b, _ in lin.rows)
        return [
            OutTensor(f"{lin.target}.scales", lin.dtype, (ng, n), (side_by_side(sparts),)),
            OutTensor(f"{lin.target}.qzeros", "I32", (ng, n // zp), (side_by_side(zparts),)),
        ]

    # ---- routed experts (Marlin's K-first layout) ------------------------------------------------

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        """Every expert tensor of the layer, weights included (reshard.plan.experts hands K-first
        schemes the whole layer)."""
        g, kp, npk, zp = self.group, self.k_pack, self.n_pack, self.zpack
        hidden, inter, ip = split.hidden, split.inter, split.ip
        why = self._marlin_refused(split)
        wna16 = why is not None
        if wna16:
            self._check_wna16(split, why)
        for size, unit, what in ((ip, kp, "weights"), (ip, npk, "weights"), (ip, zp, "zero points")):
            if size % unit:
                raise UnsupportedError(
                    f"{split.target}: per-rank intermediate size {ip} cuts the {what} packed {unit} to an int32",
                    f"use --ep, or a --tp that keeps whole int32s: {_tps(inter, unit)}",
                )
        g13, g2 = (1, 1) if g <= 0 else (hidden // g, inter // g)
        gate, up, down = split.names
        want = {  # per projection: qweight, scales, qzeros ([in, out])
            gate: ((hidden // kp, inter // npk), (g13, inter), (g13, inter // zp)),
            up: ((hidden // kp, inter // npk), (g13, inter), (g13, inter // zp)),
            down: ((inter // kp, hidden // npk), (g2, hidden), (g2, hidden // zp)),
        }
        found: dict[tuple[str, str], list[TensorInfo]] = {}
        for proj, shapes in want.items():
            for param, shape in zip(("qweight", "scales", "qzeros"), shapes, strict=True):
                dtype = None if param == "scales" else "I32"
                found[(param, proj)] = [
                    _check(split.tensor(sources, e, proj, param), shape, dtype) for e in range(split.num)
                ]
            for e in range(split.num):
                with contextlib.suppress(SourceError):
                    bias = split.tensor(sources, e, proj, "bias")
                    raise UnsupportedError(
                        f"{bias.name}: vLLM keeps GPTQ expert biases only when its weight loader records them "
                        "(`_loaded_expert_biases`); a sharded_state load copies tensors directly and drops them",
                        "serve this checkpoint with vLLM's default loader",
                    )
                self._drop(sources, f"{split.base}.{e}.{proj}", inter if proj == down else hidden)
        if wna16:
            sources.note(
                f"{split.target}: {why}, so vLLM builds MoeWNA16Method's experts (uint8, N-first, scales repeated "
                "to a finer group), on every GPU: written so; `reshard merge` and re-shard cannot read them back"
            )
            return lambda r: wna16_rank(self.bits, self.group, split, found, r)
        sources.note(self.moe_note())
        return lambda r: self._expert_rank(split, found, r)

    def _expert_rank(self, split: MoeSplit, found: dict, r: int) -> list[OutTensor]:
        g, kp, npk, zp = self.group, self.k_pack, self.n_pack, self.zpack
        hidden, ip, t = split.hidden, split.ip, split.target
        gate, up, down = split.names
        experts, start = split.experts(r), split.shard(r) * ip
        n = len(experts)
        g13 = 1 if g <= 0 else hidden // g
        # w2's groups along this rank's intermediate rows (channelwise: the one group, whole)
        r0, r1 = (0, 1) if g <= 0 else (start // g, (start + ip) // g)
        out = []
        for param, rows13, div13, cols2, div2 in (
            ("qweight", hidden // kp, npk, hidden // npk, kp),
            ("scales", g13, 1, hidden, 0),
            ("qzeros", g13, zp, hidden // zp, 0),
        ):
            w13 = tuple(
                side_by_side(
                    [
                        Slice(x.name, (0, start // div13), (rows13, (start + ip) // div13))
                        for x in (found[(param, gate)][e], found[(param, up)][e])
                    ]
                )
                for e in experts
            )
            a, b = (start // div2, (start + ip) // div2) if div2 else (r0, r1)
            w2 = tuple(Slice(found[(param, down)][e].name, (a, 0), (b, cols2)) for e in experts)
            dtype = split.dtype if param == "scales" else "I32"
            out.append(OutTensor(f"{t}.w13_{param}", dtype, (n, rows13, 2 * ip // div13), w13))
            out.append(OutTensor(f"{t}.w2_{param}", dtype, (n, b - a, cols2), w2))
        if self.experts_bias:  # torch.zeros parameters no checkpoint tensor fills
            out.append(OutTensor(f"{t}.w13_bias", split.dtype, (n, 2 * ip), (Fill(0.0, n * 2 * ip),)))
            out.append(OutTensor(f"{t}.w2_bias", split.dtype, (n, hidden), (Fill(0.0, n * hidden),)))
        return out

    def _marlin_refused(self, split: MoeSplit) -> str | None:
        """Why vLLM's check_moe_marlin_supports_layer (allow_tile_padding) fails: it then builds MoeWNA16Method."""
        g, ip, hidden = self.group, split.ip, split.hidden
        return (
            f"hidden size {hidden} is not a multiple of 128"
            if hidden % 128
            else f"group size {g} is not one of {list(MARLIN_MOE_GROUPS)}"
            if g not in MARLIN_MOE_GROUPS
            else f"per-rank intermediate size {ip} is not a multiple of the group {g}"
            if g > 0 and ip % g
            else None
        )

    def _check_wna16(self, split: MoeSplit, why: str) -> None:
        """MoeWNA16Method's layout is written for symmetric grouped GPTQ only (AWQ's nibbles are reordered
        and GPTQ zero points shifted at load: values, not copies)."""
        g = self.group
        if self.method != "gptq" or g <= 0:
            works = f"use --ep, or a --tp that keeps whole groups: {_tps(split.inter, g)}" if g > 0 else "use --ep"
            raise UnsupportedError(
                f"{split.target}: {why}, so vLLM serves these {self.method} experts with MoeWNA16Method (uint8, "
                "N-first, values converted at load), a layout reshard does not write for this format",
                works if not split.hidden % 128 and g in MARLIN_MOE_GROUPS else "serve with vLLM's default loader",
            )
        wna16_group(g, split.ip, split.hidden, split.target)

    def moe_note(self) -> str:
        return (
            f"{self.method} experts written in vLLM's Marlin layout (K-first), what every CUDA GPU builds for this "
            "split whatever --moe-backend says; on ROCm vLLM builds MoeWNA16Method's instead, and this folder does "
            "not load there"
        )


@dataclass(frozen=True)
class Gptq(_KFirst):
    """`quant_method: gptq`, symmetric 4/8-bit, no act-order with groups (AutoGPTQ / GPTQModel)."""

    method = "gptq"
    act_dtypes = ("BF16", "F16")  # AutoGPTQConfig
    strategy = "gptq"
    experts_bias = True
    lm_head: bool = False  # `lm_head: true`: vLLM's ParallelLMHead built with the GPTQ method

    def quantizes_lm_head(self) -> bool:
        return self.lm_head

    @property
    def k_pack(self) -> int:  # type: ignore[override]
        return 32 // self.bits

    def for_checkpoint(self, names: Iterable[str]) -> Quant:
        if self.layers is not None:
            return self
        # vLLM's maybe_update_config: the modules holding a tensor of a non-float dtype
        floats = ("qweight", "qzeros", "g_idx")
        return replace(self, layers=tuple(sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(floats)})))

    def config_patch(self, config: dict) -> dict:
        """vLLM finds GPTQ's quantized modules in the checkpoint's files (maybe_update_config: those with a
        non-float tensor) unless config.json lists them; in an output's files they are fused (qkv_proj,
        gate_up_proj), which vLLM's substring match takes for unquantized: list the source's instead
        (its linear modules: vLLM's MoE method does not look)."""
        qc = config.get("quantization_config") or {}
        if qc.get("modules_in_block_to_quantize") or not self.layers:
            return {}
        linear = [m for m in self.layers if not re.search(r"\.experts\.\d+\.", m)] or list(self.layers)
        return {"quantization_config": {**qc, "modules_in_block_to_quantize": linear}}

    def _drop(self, sources: Sources, slot: str, in_size: int) -> None:
        with contextlib.suppress(SourceError):
            t = sources.src(f"{slot}.g_idx", slot)
            _check(t, (in_size,), "I32")
            sources.note(
                "GPTQ g_idx is not in vLLM's state (it drops it at load); `reshard merge` writes it back as "
                "arange(K) // group, what desc_act: false means"
            )


@dataclass(frozen=True)
class Awq(_KFirst):
    """`quant_method: awq`, 4-bit with zero points (AutoAWQ GEMM)."""

    method = "awq"
    act_dtypes = ("BF16", "F16")  # AutoAWQConfig
    strategy = "awq"
    n_pack = 8

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        # is_layer_skipped(..., match_mode="substring") on modules_to_not_convert
        skipped = [any(m in p for m in self.ignored) for p in prefixes]
        if any(skipped) and not all(skipped):
            raise UnsupportedError(f"some but not all shards of {prefixes[0]} are quantized; vLLM refuses this")
        return not all(skipped)


def gptq_from_config(qc: dict) -> Quant:
    """The GPTQ scheme of a `quant_method: gptq` quantization_config; refused where vLLM refuses it."""
    bits, group = qc.get("bits"), qc.get("group_size")
    dynamic = qc.get("dynamic") or {}
    fmt = qc.get("checkpoint_format")
    if fmt not in (None, "gptq"):  # vLLM 0.32 reads no checkpoint_format: a gptq_v2 one would load wrong
        raise UnsupportedError(
            f"GPTQ checkpoint_format {fmt!r}: vLLM 0.32 reads the gptq (v1) format only, and would misread this one",
            "convert it to the gptq format (GPTQModel saves it with format='gptq')",
        )
    if bits not in (4, 8):
        raise UnsupportedError(
            f"GPTQ with {bits}-bit weights: vLLM supports 4 and 8 bits", "use a 4- or 8-bit checkpoint"
        )
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise UnsupportedError(f"GPTQ group_size {group!r} is not supported")
    if not qc.get("sym", True):
        raise UnsupportedError(
            "asymmetric GPTQ (sym: false): vLLM 0.32 refuses it", "use a symmetric GPTQ checkpoint, or AWQ"
        )
    if qc.get("desc_act") and group != -1:
        raise UnsupportedError(
            "GPTQ with act-order (desc_act: true) and groups: vLLM 0.32 refuses it",
            "use a checkpoint quantized with desc_act: false (or static groups)",
        )
    skipped = []
    for pattern, over in dynamic.items():
        if pattern.startswith("-:"):
            skipped.append("re:" + pattern[2:])
        elif over:
            raise UnsupportedError(
                f"GPTQ dynamic rule {pattern!r} overrides {sorted(over)} for some modules: a layout reshard has not "
                "checked against vLLM",
                "use a checkpoint with one bit width and group size",
            )
    blocks = qc.get("modules_in_block_to_quantize")
    layers = None if not blocks else tuple(_flatten(blocks))
    return Gptq(None, False, tuple(skipped), None, bits, group, layers, lm_head=bool(qc.get("lm_head")))


def _flatten(x) -> list[str]:
    return [y for z in x for y in _flatten(z)] if isinstance(x, list) else [str(x)]


def awq_from_config(qc: dict) -> Quant:
    bits = qc.get("w_bit", qc.get("bits"))
    group = qc.get("q_group_size", qc.get("group_size"))
    if bits != 4:
        raise UnsupportedError(f"AWQ with {bits}-bit weights: vLLM 0.32's AWQ takes 4 bits", "use a 4-bit checkpoint")
    if not isinstance(group, int) or group <= 0:
        raise UnsupportedError(f"AWQ group size {group!r}: reshard writes grouped AWQ only", "use a grouped checkpoint")
    if str(qc.get("version", "gemm")).lower() != "gemm":  # vLLM's AWQ reads GEMM's [K, N / 8] only
        raise UnsupportedError(
            f"AWQ version {qc.get('version')!r}: vLLM 0.32 loads AutoAWQ's GEMM layout only", "use a GEMM checkpoint"
        )
    if not qc.get("zero_point", True):
        raise UnsupportedError("AWQ without zero points: vLLM 0.32's AWQ kernels take zero points")
    return Awq(None, False, tuple(qc.get("modules_to_not_convert") or []), None, 4, group)


def restore_g_idx(missing: dict[str, tuple[str, tuple[int, ...]]], quant: dict | None) -> list[OutTensor]:
    """GPTQ `g_idx` tensors (I32 [K]) an output does not hold: arange(K) // group, what desc_act: false
    means (name -> (dtype, shape) of the missing tensors; `quant`: the manifest's quantization)."""
    if not quant or quant.get("method") != "gptq":
        return []
    g = quant.get("group_size")
    out = []
    for name, (dtype, shape) in missing.items():
        if not name.endswith(".g_idx") or dtype != "I32" or len(shape) != 1:
            continue
        size = shape[0] if g is None or g <= 0 else g
        out.append(OutTensor(name, dtype, shape, tuple(Fill(float(i), size) for i in range(shape[0] // size))))
    return out
