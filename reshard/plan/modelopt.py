"""NVIDIA ModelOpt FP8 (`quant_method: modelopt`, quant_algo FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO).

vLLM 0.32 builds `ModelOptFp8Config` (quantization/modelopt.py) from config.json's
`quantization_config`, or, where config.json has none (ModelOpt <= 0.29), from `hf_quant_config.json`
beside it (transformers_utils/config.py; reshard.sources.local reads it the same way). Two shapes:
`{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}` (hf_quant_config.json,
`producer.name: modelopt`) or `{"quant_method": "modelopt", "quant_algo", "kv_cache_scheme", "ignore"}`.
Its `ModelOptLinearMethod` registers, per rank, before post-processing:

- FP8: F8_E4M3 `weight` [N_p, K_p]; `weight_scale` F32 [slots] and `input_scale` F32 [slots], one
  per shard of a merged layer, initialised to FP8_SCALE_SENTINEL (float32's lowest) where the
  checkpoint has no tensor.
- FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` F32 [N_p] (1-D, sliced with the rows, whole in a
  row-parallel layer); dynamic inputs: no input scale.
- FP8_PB_WO: `weight_scale` F32 [ceil(N_p / 128), 1, K_p / 128, 1] (128x128 blocks; vLLM refuses
  K_p % 128).
Routed experts get `ModelOptFp8MoEMethod` whatever the algo: per-tensor `w13_weight_scale` [E, 2],
`w2_weight_scale` [E], `w13_input_scale` / `w2_input_scale` [E] (initialised to 1.0; w13's input scale
keeps the last of gate/up loaded). Attention gets the plain KV-cache method (k/v/q/prob scales,
reshard.plan.kvscales.fp8_kv_params) and the default cache-scale name mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import ClassVar

from reshard.errors import SourceError, UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.expertblocks import RankScales
from reshard.plan.geometry import LinearRank, MoeSplit, Sources, cdiv
from reshard.plan.kvscales import KvHeads, fp8_kv_params
from reshard.plan.model import Fill, OutTensor, Piece, Slice, scalar
from reshard.plan.quant import Quant

FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")  # ModelOptFp8Config's (LINEAR_ALGOS "modelopt")
FP8_SCALE_SENTINEL = -3.4028234663852886e38  # torch.finfo(torch.float32).min: vLLM's fp8_utils.FP8_SCALE_SENTINEL
BLOCK = 128  # FP8_PB_WO's block, both dims


@dataclass(frozen=True)
class ModelOptSettings:
    """What vLLM's ModelOptQuantConfigBase.from_config reads."""

    algo: str
    kv_algo: str | None
    exclude: tuple[str, ...]


def modelopt_algo(qc: dict) -> str | None:
    """The upper-cased ModelOpt quant_algo of a quantization config, or None when it is not ModelOpt's
    (vLLM: `quant_method` starting with modelopt, or `producer.name: modelopt` with a `quantization`
    object, which vLLM's config normaliser turns into one)."""
    producer = qc.get("producer")
    inner = qc.get("quantization")
    by_producer = isinstance(producer, dict) and producer.get("name") == "modelopt" and isinstance(inner, dict)
    if not str(qc.get("quant_method") or "").lower().startswith("modelopt") and not by_producer:
        return None
    algo = inner.get("quant_algo") if isinstance(inner, dict) else qc.get("quant_algo")
    return str(algo or "").upper()


def excluded(entries: tuple[str, ...], prefix: str) -> bool:
    """vLLM's ModelOptQuantConfigBase.is_layer_excluded: an exact name, a name the module's path contains,
    or a wildcard (`x*` stands for `x` and `x.*`, apply_vllm_mapper)."""
    return any(entry == prefix or entry in prefix or fnmatch(prefix, entry) for entry in entries)


def config_json_ignore(qc: dict) -> object:
    """The excluded modules of config.json's form of a ModelOpt config: `ignore`. vLLM 0.33 falls back to
    `exclude_modules` where `ignore` is absent (modelopt.py from_config), 0.32 does not: such a config
    quantizes other modules in the two versions reshard writes for, so it is refused."""
    if "ignore" not in qc and qc.get("exclude_modules"):
        raise UnsupportedError(
            "the ModelOpt quantization_config in config.json lists `exclude_modules` but no `ignore`: vLLM 0.32 "
            "quantizes those modules, vLLM 0.33 keeps them unquantized, so the layout depends on the version",
            'add `"ignore": [...]` with the same list to config.json\'s quantization_config (what 0.33 reads)',
        )
    return qc.get("ignore")


def modelopt_settings(qc: dict) -> ModelOptSettings:
    inner = qc.get("quantization")
    if isinstance(inner, dict):  # hf_quant_config.json
        algo, kv, exclude = inner.get("quant_algo"), inner.get("kv_cache_quant_algo"), inner.get("exclude_modules")
    else:  # config.json's compressed-tensors-like form
        algo, exclude = qc.get("quant_algo"), config_json_ignore(qc)
        scheme = qc.get("kv_cache_scheme")
        fp8_kv = isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
        kv = "FP8" if fp8_kv else None
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise SourceError(
            f"ModelOpt exclude_modules / ignore must be a list of names, found {exclude!r}"[:300],
            "the checkpoint's quantization config is damaged: download it again or fix it",
        )
    if kv is not None and not isinstance(kv, str):
        raise SourceError(f"ModelOpt kv_cache_quant_algo must be a string, found {kv!r}"[:300])
    return ModelOptSettings(str(algo or "").upper(), kv.upper() if kv else None, tuple(exclude))


def modelopt_fp8(qc: dict) -> ModelOptFp8:
    """The ModelOpt FP8 scheme of `qc` (its algo one of FP8_ALGOS)."""
    s = modelopt_settings(qc)
    cls = {"FP8": ModelOptFp8Tensor, "FP8_PER_CHANNEL_PER_TOKEN": ModelOptFp8Channel, "FP8_PB_WO": ModelOptFp8Block}
    if s.algo not in cls:
        raise UnsupportedError(f"ModelOpt quant_algo {s.algo!r} is not an FP8 algo reshard writes: {list(cls)}")
    return cls[s.algo](None, s.algo == "FP8", s.exclude, None, s.kv_algo)


# ---- the scheme ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelOptFp8(Quant):
    """ModelOptFp8Config: `ignored` are its exclude_modules; `kv_algo` its kv_cache_quant_algo (the KV-cache
    dtype at run time; the attention layer's scale parameters are the same either way)."""

    kv_algo: str | None = None

    method = "modelopt"
    act_dtypes = ("BF16", "F16")  # ModelOptFp8Config
    algo: ClassVar[str]

    def to_json(self) -> dict:
        return {**super().to_json(), "quant_algo": self.algo, "kv_cache_quant_algo": self.kv_algo}

    def ignores(self, prefix: str) -> bool:
        """vLLM's ModelOptQuantConfigBase.is_layer_excluded: an exact name, a name the module's path
        contains, or a wildcard (`x*` stands for `x` and `x.*`, apply_vllm_mapper)."""
        return excluded(self.ignored, prefix)

    def quantizes(self, prefixes: list[str], *, experts: bool = False) -> bool:
        skipped = [self.ignores(p) for p in prefixes]
        if any(skipped) and not all(skipped):
            raise UnsupportedError(
                f"some but not all shards of {prefixes[0]} are on ModelOpt's exclude_modules; vLLM refuses this"
            )
        return not all(skipped)

    def kv_buffers(
        self, sources: Sources, target: str, dtype: str, found: dict[str, str], heads: KvHeads
    ) -> list[OutTensor]:
        return fp8_kv_params(sources, target, dtype, found)

    def linear_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        if lin.fused:
            raise UnsupportedError(
                f"{lin.target}: a fused HF tensor of ModelOpt FP8 weights is a layout reshard has not checked "
                "against vLLM",
                "use the bf16 checkpoint",
            )
        return self.weight_scales(sources, lin)

    def weight_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        raise NotImplementedError

    def expert_scales(self, sources: Sources, split: MoeSplit) -> RankScales:
        """ModelOptFp8MoEMethod: per-tensor scales, whatever the linear algo."""
        if self.algo != "FP8":
            raise UnsupportedError(
                f"{split.target}: ModelOpt {self.algo} experts; vLLM's ModelOpt FP8 MoE method takes per-tensor "
                "scales only (quant_algo FP8)",
                "use a ModelOpt FP8 (per-tensor) checkpoint of this model, or add the experts to exclude_modules",
            )
        gate, up, down = split.names
        num = range(split.num)
        s13 = [(_scale(sources, split, e, gate), _scale(sources, split, e, up)) for e in num]
        s2 = [_scale(sources, split, e, down) for e in num]
        # one input scale per expert: vLLM keeps the last of gate/up it loads (up sorts last); 1.0 if none
        i13 = [_optional_scalar(sources, f"{split.base}.{e}.{up}.input_scale", 1.0) for e in num]
        i2 = [_optional_scalar(sources, f"{split.base}.{e}.{down}.input_scale", 1.0) for e in num]
        for e in num:
            sources.mark_used(f"{split.base}.{e}.{gate}.input_scale")

        def rank(r: int) -> list[OutTensor]:
            experts = split.experts(r)
            n, t = len(experts), split.target
            return [
                OutTensor(f"{t}.w13_weight_scale", "F32", (n, 2), tuple(s for e in experts for s in s13[e])),
                OutTensor(f"{t}.w2_weight_scale", "F32", (n,), tuple(s2[e] for e in experts)),
                OutTensor(f"{t}.w13_input_scale", "F32", (n,), tuple(i13[e] for e in experts)),
                OutTensor(f"{t}.w2_input_scale", "F32", (n,), tuple(i2[e] for e in experts)),
            ]

        return rank


def _scale(sources: Sources, split: MoeSplit, e: int, proj: str) -> Piece:
    return scalar(split.tensor(sources, e, proj, "weight_scale"))


def _optional_scalar(sources: Sources, name: str, fill: float) -> Piece:
    """The one-value tensor `name`, or `fill` (the parameter's initial value) where the checkpoint lacks it."""
    t = _found(sources, name, name.rsplit(".", 1)[0])
    return scalar(t) if t is not None else Fill(fill, 1)


def _found(sources: Sources, name: str, why: str) -> TensorInfo | None:
    """The source tensor `name` (marked used), None where the checkpoint lacks it."""
    try:
        return sources.src(name, why)
    except SourceError:  # src raises only for a missing tensor
        return None


class ModelOptFp8Tensor(ModelOptFp8):
    """quant_algo FP8: per-tensor weight scales and static per-tensor input scales, one per shard."""

    algo = "FP8"
    strategy = "tensor"

    def weight_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        n = len(lin.slots)
        weights = tuple(scalar(s) for s in lin.per_slot(sources, "weight_scale"))
        inputs: list[Piece] = []
        for slot in lin.slots:
            t = _found(sources, f"{slot}.input_scale", lin.target)
            inputs.append(scalar(t) if t is not None else Fill(FP8_SCALE_SENTINEL, 1))
        if any(isinstance(p, Fill) for p in inputs):
            sources.note(
                "ModelOpt FP8 layers without an input_scale are written with vLLM's initial value "
                "(FP8_SCALE_SENTINEL, float32's lowest), as vLLM holds them"
            )
        return [
            OutTensor(f"{lin.target}.weight_scale", "F32", (n,), weights),
            OutTensor(f"{lin.target}.input_scale", "F32", (n,), tuple(inputs)),
        ]


class ModelOptFp8Channel(ModelOptFp8):
    """quant_algo FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` F32 [N] per output channel, dynamic inputs."""

    algo = "FP8_PER_CHANNEL_PER_TOKEN"
    strategy = "channel"

    def weight_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        pieces = []
        for s, n, (a, b, _) in zip(lin.per_slot(sources, "weight_scale"), lin.outs, lin.rows, strict=True):
            if s.shape != (n,) or s.dtype != "F32":
                raise SourceError(f"{s.name} is {s.dtype} {list(s.shape)}, per-channel scales are F32 {[n]}")
            pieces.append(Slice(s.name, (a,), (b,)))
        rows = sum(b - a for a, b, _ in lin.rows)
        return [OutTensor(f"{lin.target}.weight_scale", "F32", (rows,), tuple(pieces))]


class ModelOptFp8Block(ModelOptFp8):
    """quant_algo FP8_PB_WO: one scale per 128x128 block, stored 4-D [ceil(N / 128), 1, K / 128, 1]."""

    algo = "FP8_PB_WO"
    strategy = "block"

    def weight_scales(self, sources: Sources, lin: LinearRank) -> list[OutTensor]:
        in_r = lin.cols[1] - lin.cols[0]
        if in_r % BLOCK:
            raise UnsupportedError(
                f"{lin.target}: per-rank input size {in_r} is not a multiple of 128; vLLM's FP8_PB_WO refuses it",
                f"use a --tp that keeps whole 128-column blocks: {_tps(lin.in_size)}",
            )
        nc, c0 = in_r // BLOCK, lin.cols[0] // BLOCK
        several = len(lin.slots) > 1
        pieces = []
        for s, n, (a, b, _) in zip(lin.per_slot(sources, "weight_scale"), lin.outs, lin.rows, strict=True):
            want = (cdiv(n, BLOCK), 1, cdiv(lin.in_size, BLOCK), 1)
            if s.shape != want or s.dtype != "F32":
                raise SourceError(f"{s.name} is {s.dtype} {list(s.shape)}, 128x128 block scales are F32 {list(want)}")
            if (several or lin.splits_rows) and (a % BLOCK or (b - a) % BLOCK):
                raise UnsupportedError(
                    f"{lin.target}: rows [{a}, {b}) of {s.name.rsplit('.', 1)[0]} on a rank cut a 128-row block; "
                    "vLLM's block-scale loader would give them another block's scales",
                    "use a smaller --tp",
                )
            pieces.append(Slice(s.name, (a // BLOCK, 0, c0, 0), (a // BLOCK + cdiv(b - a, BLOCK), 1, c0 + nc, 1)))
        nr = sum(p.stop[0] - p.start[0] for p in pieces)
        return [OutTensor(f"{lin.target}.weight_scale", "F32", (nr, 1, nc, 1), tuple(pieces))]


def _tps(size: int) -> str:
    return ", ".join(str(t) for t in (1, 2, 4, 8, 16) if size % t == 0 and (size // t) % BLOCK == 0) or "1"
