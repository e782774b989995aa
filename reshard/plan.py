"""Build the plan: for every rank, every output tensor and the source bytes it is made of.

Pure metadata in (config.json + safetensors headers), a `Plan` value out. No torch, no tensor bytes.
An output tensor is the concatenation, in row-major order, of its pieces: hyper-rectangular slices
of source tensors (optionally up-sampled, for refined FP8 block scales) and constant fills (vocab
padding rows, attention buffers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from reshard import VLLM_LAYOUT, __version__
from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.format import DTYPE_CODES, DTYPE_NAMES, ITEMSIZE, TensorInfo
from reshard.rules import Architecture, Kind, Module, get_architecture

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_MAX_PART = 5 * 1024**3  # as vLLM's save_sharded_state example
TP_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"


@dataclass(frozen=True, slots=True)
class Slice:
    """source[start[0]:stop[0], start[1]:stop[1], ...], after up-sampling each dim by `up`."""

    source: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    up: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in zip(self.start, self.stop, strict=True))


@dataclass(frozen=True, slots=True)
class Fill:
    """`count` elements equal to `value`."""

    value: float
    count: int

    @property
    def numel(self) -> int:
        return self.count


Piece = Slice | Fill


@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class OutFile:
    name: str
    tp_rank: int
    pp_rank: int
    part: int
    tensors: tuple[OutTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Quant:
    """The checkpoint's weight quantization, as vLLM reads it.

    `method` is "fp8" (vLLM's Fp8Config) or "compressed-tensors" (float-quantized FP8 W8A8, as
    llm-compressor writes it); `strategy` is "block", "tensor" or "channel".
    """

    method: str
    strategy: str
    block: tuple[int, int] | None  # weight_block_size / block_structure
    static_activations: bool
    ignored: tuple[str, ...]

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"

    @property
    def refines_moe_blocks(self) -> bool:
        # Fp8MoEMethod refines the MoE scale grid when a TP split cuts a block; the
        # compressed-tensors MoE method validates the checkpoint's blocks as they are
        return self.method == "fp8"

    def ignores(self, prefix: str) -> bool:
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], prefix):
                    return True
            elif entry == prefix:
                return True
        return False

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "strategy": self.strategy,
            "weight_block_size": list(self.block) if self.block else None,
            "activation_scheme": "static" if self.static_activations else "dynamic",
        }


@dataclass(frozen=True)
class Dims:
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    tie: bool
    num_experts: int = 0
    moe_intermediate: int = 0


@dataclass
class Plan:
    """What `save` writes. Serialisable; built before any tensor byte is read."""

    source: dict
    architecture: str
    tp: int
    pp: int
    ep: bool
    dtype: str  # model dtype, safetensors code
    quant: Quant | None
    files: list[OutFile]
    layer_ranges: list[tuple[int, int]]  # per pipeline stage: [first, last) layer
    notes: list[str] = field(default_factory=list)
    config_patch: dict = field(default_factory=dict)  # keys to change in the copied config.json

    @property
    def pattern(self) -> str:
        return PP_PATTERN if self.pp > 1 else TP_PATTERN

    @property
    def total_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    def serve_command(self, out_dir: str) -> str:
        parts = [f"vllm serve {out_dir} --load-format sharded_state"]
        parts.append(f"--tensor-parallel-size {self.tp}")
        if self.pp > 1:
            parts.append(f"--pipeline-parallel-size {self.pp}")
        if self.ep:
            parts.append("--enable-expert-parallel")
        parts.append(f"--dtype {DTYPE_CODES[self.dtype]}")
        return " ".join(parts)

    def layout(self) -> dict:
        return {
            "vllm_layout": VLLM_LAYOUT,
            "architecture": self.architecture,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "dtype": DTYPE_CODES[self.dtype],
            "quantization": self.quant.to_json() if self.quant else None,
            "pattern": self.pattern,
            "pp_layer_partition": [b - a for a, b in self.layer_ranges],
        }

    def ranks(self) -> dict[tuple[int, int], list[OutFile]]:
        out: dict[tuple[int, int], list[OutFile]] = {}
        for f in self.files:
            out.setdefault((f.pp_rank, f.tp_rank), []).append(f)
        return out

    def summary(self) -> dict:
        """Per-rank key count and bytes, plus the layout: what `reshard plan --json` prints."""
        ranks = []
        for (pp_rank, tp_rank), files in sorted(self.ranks().items()):
            tensors = [t for f in files for t in f.tensors]
            ranks.append(
                {
                    "pp_rank": pp_rank,
                    "tp_rank": tp_rank,
                    "files": [f.name for f in files],
                    "keys": len(tensors),
                    "bytes": sum(t.nbytes for t in tensors),
                    "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in tensors],
                }
            )
        return {
            "reshard_version": __version__,
            "source": self.source,
            **self.layout(),
            "total_bytes": self.total_bytes,
            "ranks": ranks,
            "notes": self.notes,
        }


def build_plan(
    ckpt: Checkpoint,
    *,
    tp: int,
    pp: int = 1,
    ep: bool = False,
    dtype: str = "auto",
    max_part_size: int = DEFAULT_MAX_PART,
    pp_partition: list[int] | None = None,
) -> Plan:
    """Plan every rank's files for vLLM's sharded_state loader.

    Args:
        ckpt: source metadata (config + headers).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        ep: vLLM's --enable-expert-parallel layout for MoE experts.
        dtype: "auto" (config's torch_dtype; float32 becomes bfloat16, as vLLM on GPUs) or a name.
        max_part_size: split a rank's tensors into parts of at most this many bytes.
        pp_partition: layers per stage (VLLM_PP_LAYER_PARTITION); default as vLLM.

    Raises:
        UnsupportedError: unknown architecture or a layout vLLM would refuse.
        SourceError: a tensor the rules need is missing, or has the wrong shape.
    """
    if tp < 1 or pp < 1:
        raise UnsupportedError("--tp and --pp must be at least 1")
    arch_name, arch = get_architecture(ckpt.config)
    planner = _Planner(ckpt, arch, tp=tp, ep=ep, dtype=_model_dtype(ckpt.config, dtype))
    ranges = pp_ranges(planner.dims.num_layers, pp, pp_partition)
    per_rank = planner.run(ranges)
    files = _assign_files(per_rank, tp=tp, pp=pp, max_part_size=max_part_size)
    return Plan(
        source=ckpt.ref,
        architecture=arch_name,
        tp=tp,
        pp=pp,
        ep=ep,
        dtype=planner.dtype,
        quant=planner.quant,
        files=files,
        layer_ranges=ranges,
        notes=planner.notes,
        config_patch=planner.config_patch,
    )


def _model_dtype(config: dict, dtype: str) -> str:
    if dtype != "auto":
        if dtype not in ("bfloat16", "float16", "float32"):
            raise UnsupportedError(f"--dtype {dtype}: use auto, bfloat16, float16 or float32")
        return DTYPE_NAMES[dtype]
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name == "float32":
        name = "bfloat16"  # vLLM's auto dtype on GPUs downcasts float32 checkpoints
    if name not in ("bfloat16", "float16"):
        raise UnsupportedError(f"config.json torch_dtype {name!r} is not supported; pass --dtype")
    return DTYPE_NAMES[name]


def pp_ranges(num_layers: int, pp: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """Layers of each pipeline stage, as vLLM's get_pp_indices (distributed/utils.py)."""
    if partition is not None:
        if len(partition) != pp:
            raise UnsupportedError(f"--pp-layer-partition has {len(partition)} entries for --pp {pp}")
        if sum(partition) != num_layers:
            raise UnsupportedError(f"--pp-layer-partition sums to {sum(partition)}, the model has {num_layers} layers")
        sizes = list(partition)
    else:
        if pp > num_layers:
            raise UnsupportedError(f"--pp {pp} is larger than the number of layers ({num_layers})")
        sizes = [num_layers // pp] * pp
        for i in range(num_layers % pp):
            sizes[-2 - i] += 1  # extra layers go to the stages before the last, backwards
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def _dims(config: dict, arch: Architecture, untied_by_checkpoint: bool = False) -> Dims:
    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise SourceError(f"config.json lacks {key!r}, which {arch.names[0]} needs")
        return int(config[key])

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    return Dims(
        hidden=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab=need("vocab_size"),
        tie=bool(config.get("tie_word_embeddings", False)) and not untied_by_checkpoint,
        num_experts=next((int(config[k]) for k in arch.experts_key if config.get(k)), 0) if arch.moe_mlp else 0,
        moe_intermediate=int(config.get(arch.moe_intermediate_key) or 0) if arch.moe_mlp else 0,
    )


def _quant(config: dict) -> Quant | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", ""))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method != "fp8":
        raise UnsupportedError(
            f"quantization {method!r} is not supported",
            "supported: fp8 (block, per-tensor) and compressed-tensors FP8 (tensor, channel, block)",
        )
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise UnsupportedError(f"weight_block_size must have 2 dimensions, got {block}")
        block = (int(block[0]), int(block[1]))
    static = qc.get("activation_scheme", "dynamic") == "static"
    if block and static:
        raise UnsupportedError("block FP8 with a static activation scheme is refused by vLLM")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    return Quant("fp8", "block" if block else "tensor", block, static, tuple(ignored))


def _compressed_tensors(qc: dict) -> Quant:
    """Compressed-tensors FP8 (W8A8, float-quantized): one config group targeting Linear layers."""
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("kv_cache_scheme"):
        raise UnsupportedError("compressed-tensors kv_cache_scheme is not supported yet")
    if len(groups) != 1:
        raise UnsupportedError(f"compressed-tensors with {len(groups)} config groups is not supported")
    weights = groups[0].get("weights") or {}
    inputs = groups[0].get("input_activations") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedError(
            "compressed-tensors: only FP8 weights (type float, 8 bits) are supported",
            f"this checkpoint has {weights.get('type')} {weights.get('num_bits')}-bit weights",
        )
    strategy = str(weights.get("strategy"))
    if strategy not in ("tensor", "channel", "block"):
        raise UnsupportedError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    static = bool(inputs) and not inputs.get("dynamic", True)
    return Quant("compressed-tensors", strategy, block, static, tuple(qc.get("ignore") or []))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


class _Planner:
    def __init__(self, ckpt: Checkpoint, arch: Architecture, *, tp: int, ep: bool, dtype: str):
        self.ckpt = ckpt
        self.arch = arch
        self.tp = tp
        self.ep = ep
        self.dtype = dtype
        self.notes: list[str] = []
        # vLLM (ModelConfig.maybe_untie_word_embeddings) unties a "tied" model whose checkpoint
        # ships its own lm_head; the sharded loader does not, so the output config must say so.
        untie = bool(ckpt.config.get("tie_word_embeddings")) and "lm_head.weight" in ckpt.tensors
        self.config_patch: dict = {"tie_word_embeddings": False} if untie else {}
        if untie:
            self.notes.append(
                "config.json says tie_word_embeddings but the checkpoint has its own lm_head: "
                "written untied, and the copied config.json says tie_word_embeddings: false"
            )
        self.dims = _dims(ckpt.config, arch, untie)
        self.quant = _quant(ckpt.config)
        self.used: set[str] = set()
        self._check_attention()

    # ---- inputs -------------------------------------------------------------------------------

    def src(self, name: str, why: str) -> TensorInfo:
        t = self.ckpt.tensors.get(name)
        if t is None:
            raise SourceError(
                f"checkpoint lacks tensor {name!r} (needed for vLLM's {why})",
                "the checkpoint is incomplete or not of the architecture its config.json names",
            )
        self.used.add(name)
        return t

    def has(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def flag(self, value: bool | str) -> bool:
        return bool(self.ckpt.config.get(value, False)) if isinstance(value, str) else value

    def quantized(self, module: Module, hf_prefixes: list[str]) -> bool:
        if not self.quant or not module.quant:
            return False
        skipped = [self.quant.ignores(p) or self._expert_ignored(p) for p in hf_prefixes]
        if any(skipped) and not all(skipped):
            raise UnsupportedError(f"some but not all shards of {hf_prefixes[0]} are quantized; vLLM refuses this")
        return not all(skipped)

    def _expert_ignored(self, prefix: str) -> bool:
        return any("experts" in i and prefix in i for i in self.quant.ignored) if self.quant else False

    # ---- checks -------------------------------------------------------------------------------

    def _check_attention(self) -> None:
        d, tp = self.dims, self.tp
        if d.num_heads % tp:
            raise UnsupportedError(
                f"num_attention_heads={d.num_heads} is not divisible by --tp {tp}",
                f"use a --tp that divides it: {_divisors(d.num_heads)}",
            )
        if (d.num_kv_heads >= tp and d.num_kv_heads % tp) or (d.num_kv_heads < tp and tp % d.num_kv_heads):
            raise UnsupportedError(
                f"num_key_value_heads={d.num_kv_heads} and --tp {tp} do not divide each other",
                "vLLM needs one to divide the other",
            )
        padded = _cdiv(d.vocab, VOCAB_PADDING) * VOCAB_PADDING
        if padded % tp:
            raise UnsupportedError(f"padded vocabulary {padded} (vocab_size {d.vocab}) is not divisible by --tp {tp}")

    def split(self, size: int, what: str) -> int:
        if size % self.tp:
            raise UnsupportedError(
                f"{what} = {size} is not divisible by --tp {self.tp}",
                f"use a --tp that divides it: {_divisors(size)}",
            )
        return size // self.tp

    # ---- walk -------------------------------------------------------------------------------

    def run(self, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], list[OutTensor]]:
        arch, d = self.arch, self.dims
        out: dict[tuple[int, int], list[OutTensor]] = {}
        last = len(ranges) - 1
        top = {m.name: m for m in arch.top}
        for pp_rank, (first, stop) in enumerate(ranges):
            per_tp: list[list[OutTensor]] = [[] for _ in range(self.tp)]
            for m in arch.top:
                if not m.present(self.ckpt.config) or not self._top_on_stage(m, pp_rank, last):
                    continue
                if d.tie and any(t.tied == m.name for t in arch.top if self._top_on_stage(t, pp_rank, last)):
                    continue  # tied: vLLM's state dict keeps only the lm_head alias
                self.module(m, "", per_tp, top)
            for layer in range(first, stop):
                prefix = f"model.layers.{layer}."
                mods = arch.layer + (
                    arch.moe_mlp if arch.is_moe_layer and arch.is_moe_layer(self.ckpt.config, layer) else arch.dense_mlp
                )
                for m in mods:
                    if m.present(self.ckpt.config):
                        self.module(m, prefix, per_tp, top)
            for r in range(self.tp):
                out[(pp_rank, r)] = per_tp[r]
        self._check_unused(ranges)
        return out

    def _top_on_stage(self, m: Module, pp_rank: int, last: int) -> bool:
        if self.arch.top_on_every_stage:
            return True
        if m.name.endswith("embed_tokens"):
            return pp_rank == 0 or (self.dims.tie and pp_rank == last)
        return pp_rank == last

    def _check_unused(self, ranges: list[tuple[int, int]]) -> None:
        if ranges[0][0] != 0 or ranges[-1][1] != self.dims.num_layers:
            return
        spec = self.spec_layer_prefixes()
        extra = [
            n
            for n in self.ckpt.tensors
            if n not in self.used and not any(n.endswith(s) for s in self.arch.ignore) and not n.startswith(spec)
        ]
        if self.dims.tie:
            extra = [n for n in extra if n != "lm_head.weight"]  # vLLM skips it when tied
        if extra:
            raise SourceError(
                f"{len(extra)} checkpoint tensor(s) match no rule of {self.arch.names[0]}, e.g. {extra[0]!r}",
                "the checkpoint does not match its config.json architecture",
            )

    def spec_layer_prefixes(self) -> tuple[str, ...]:
        """`model.layers.{N+i}.` of the MTP layers vLLM's main model skips (get_spec_layer_idx_from_weight_name)."""
        config = self.ckpt.config
        n = next((int(config[k]) for k in self.arch.spec_layers_key if config.get(k)), 0)
        return tuple(f"model.layers.{self.dims.num_layers + i}." for i in range(n))

    # ---- modules ----------------------------------------------------------------------------

    def module(self, m: Module, prefix: str, per_tp: list[list[OutTensor]], top: dict) -> None:
        target = prefix + m.name
        if m.kind is Kind.ATTENTION:
            return self.attention(m, target, per_tp)
        if m.kind is Kind.EXPERTS:
            return self.experts(m, prefix, target, per_tp)
        if m.kind is Kind.VOCAB:
            source = m.tied if (m.tied and self.dims.tie) else m.name
            return self.vocab(target, prefix + source, per_tp)
        return self.linear(m, prefix, target, per_tp)

    def attention(self, m: Module, target: str, per_tp: list[list[OutTensor]]) -> None:
        for r in range(self.tp):
            for s in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
                per_tp[r].append(OutTensor(f"{target}.{s}", "F32", (), (Fill(1.0, 1),)))
            if self.quant and m.quant and self.quant.method == "fp8":
                # Fp8KVCacheMethod parameters (0-d, model dtype, -1.0), deleted after loading
                for s in ("k_scale", "v_scale", "q_scale", "prob_scale"):
                    per_tp[r].append(OutTensor(f"{target}.{s}", self.dtype, (), (Fill(-1.0, 1),)))
            elif self.quant and m.quant:
                # CompressedTensorsKVCacheMethod without a kv_cache_scheme: scales [1] of ones,
                # zero points [1] of zeros in the model dtype
                for s in ("k_scale", "v_scale", "q_scale"):
                    per_tp[r].append(OutTensor(f"{target}.{s}", "F32", (1,), (Fill(1.0, 1),)))
                for s in ("k_zero_point", "v_zero_point", "q_zero_point"):
                    per_tp[r].append(OutTensor(f"{target}.{s}", self.dtype, (1,), (Fill(0.0, 1),)))

    def vocab(self, target: str, source: str, per_tp: list[list[OutTensor]]) -> None:
        t = self.src(f"{source}.weight", target)
        v, h = self.dims.vocab, t.shape[1] if len(t.shape) == 2 else 0
        if t.shape[0] != v:
            raise SourceError(f"{t.name} has {t.shape[0]} rows, config vocab_size is {v}")
        rows = _cdiv(v, VOCAB_PADDING) * VOCAB_PADDING // self.tp
        for r in range(self.tp):
            a, b = min(r * rows, v), min((r + 1) * rows, v)
            pieces: list[Piece] = []
            if b > a:
                pieces.append(_rows(t, a, b))
            if rows - (b - a):
                pieces.append(Fill(0.0, (rows - (b - a)) * h))
            per_tp[r].append(OutTensor(f"{target}.weight", self.dtype, (rows, h), tuple(pieces)))

    def linear(self, m: Module, prefix: str, target: str, per_tp: list[list[OutTensor]]) -> None:
        slots = [prefix + s for s in m.slots]
        if m.quant is False and m.kind is Kind.REPLICATE:
            # norms and other plain parameters: whole, model dtype unless vLLM fixes one
            t = self.src(f"{slots[0]}.{m.param}", target)
            for r in range(self.tp):
                per_tp[r].append(OutTensor(f"{target}.{m.param}", m.dtype or self.dtype, t.shape, (_whole(t),)))
            return
        if m.param != "weight":
            raise AssertionError(f"{target}: only plain replicated parameters may be named {m.param!r}")
        # per slot: the HF tensor, the slot's first row in it and its global size
        weights, offs, outs = self.linear_slots(m, target, slots)
        quant = self.quantized(m, slots)
        in_size = weights[0].shape[1]
        bias = self.flag(m.bias)
        if m.kind is Kind.ROW:
            in_r = self.split(in_size, f"input size of {target}")
        for r in range(self.tp):
            rows = self.slot_rows(m, target, outs, r)  # per slot: (start, stop, shard index)
            cols = (r * in_r, (r + 1) * in_r) if m.kind is Kind.ROW else (0, in_size)
            wdtype = "F8_E4M3" if quant else (m.dtype or self.dtype)
            pieces = tuple(
                Slice(w.name, (o + a, cols[0]), (o + b, cols[1]))
                for w, o, (a, b, _) in zip(weights, offs, rows, strict=True)
            )
            shape = (sum(b - a for a, b, _ in rows), cols[1] - cols[0])
            per_tp[r].append(OutTensor(f"{target}.weight", wdtype, shape, pieces))
            if quant:
                for w in weights:
                    if w.dtype != "F8_E4M3":
                        raise SourceError(f"{w.name} is {w.dtype}, but config.json says it is FP8")
                per_tp[r].extend(self.linear_scales(m, target, slots, outs, offs, rows, in_size, cols))
            if bias:
                bs = [self.src(f"{s}.bias", target) for s in slots]
                if m.kind in (Kind.ROW, Kind.REPLICATE):
                    bp = tuple(dict.fromkeys(_whole(b) for b in bs))  # a fused bias once
                    n = sum(b.shape[0] for b in dict.fromkeys(bs))
                else:
                    bp = tuple(_rows(b, o + a, o + e) for b, o, (a, e, _) in zip(bs, offs, rows, strict=True))
                    n = sum(e - a for a, e, _ in rows)
                per_tp[r].append(OutTensor(f"{target}.bias", m.dtype or self.dtype, (n,), bp))

    def linear_slots(self, m: Module, target: str, slots: list[str]) -> tuple[list[TensorInfo], list[int], list[int]]:
        """Each slot's HF weight, its first row there and its global row count.

        Separate HF tensors: one per slot, from row 0. A fused HF tensor (Phi-3): the slots are
        consecutive row ranges of it, sized as vLLM's `_load_fused_module_from_checkpoint`
        does: q/k/v by the head counts, other merged layers in equal parts.
        """
        if not m.fused:
            weights = [self.src(f"{s}.weight", target) for s in slots]
            return weights, [0] * len(weights), [w.shape[0] for w in weights]
        w = self.src(f"{slots[0]}.weight", target)
        total, n = w.shape[0], len(m.fused)
        if m.kind is Kind.QKV:
            d = self.dims
            heads = d.num_heads + 2 * d.num_kv_heads
            if n != 3 or total % heads:
                raise SourceError(
                    f"{w.name}: {total} rows do not split into q/k/v of {d.num_heads}/{d.num_kv_heads} heads"
                )
            hd = total // heads
            outs = [d.num_heads * hd, d.num_kv_heads * hd, d.num_kv_heads * hd]
        else:
            if total % n:
                raise SourceError(f"{w.name}: {total} rows do not split into {n} equal parts ({', '.join(m.fused)})")
            outs = [total // n] * n
        offs = [sum(outs[:i]) for i in range(n)]
        return [w] * n, offs, outs

    def slot_rows(self, m: Module, target: str, outs: list[int], r: int) -> list[tuple[int, int, int]]:
        if m.kind in (Kind.ROW, Kind.REPLICATE):
            return [(0, o, 0) for o in outs]
        if m.kind is Kind.QKV:
            d = self.dims
            q, k, v = outs
            # head sizes from the weights: vLLM's Qwen2 ignores config.head_dim, others use it
            if q % d.num_heads or k % d.num_kv_heads or v % d.num_kv_heads:
                raise SourceError(
                    f"{target}: q/k/v rows {q}/{k}/{v} do not split into {d.num_heads}/{d.num_kv_heads} heads"
                )
            qn = q // self.tp
            if self.tp >= d.num_kv_heads:
                kv_per_rank, shard = 1, r // (self.tp // d.num_kv_heads)
            else:
                kv_per_rank, shard = d.num_kv_heads // self.tp, r
            kn, vn = kv_per_rank * (k // d.num_kv_heads), kv_per_rank * (v // d.num_kv_heads)
            return [
                (r * qn, (r + 1) * qn, r),
                (shard * kn, (shard + 1) * kn, shard),
                (shard * vn, (shard + 1) * vn, shard),
            ]
        out = []
        for i, o in enumerate(outs):
            n = self.split(o, f"output size of {target} (slot {i})")
            out.append((r * n, (r + 1) * n, r))
        return out

    def linear_scales(
        self,
        m: Module,
        target: str,
        slots: list[str],
        outs: list[int],
        offs: list[int],
        rows: list[tuple[int, int, int]],
        in_size: int,
        cols: tuple[int, int],
    ) -> list[OutTensor]:
        q = self.quant
        assert q is not None
        if m.fused:  # one scale tensor for every slot of the fused HF weight
            scales = [self.src(f"{slots[0]}.{q.scale_name}", target)] * len(outs)
        else:
            scales = [self.src(f"{s}.{q.scale_name}", target) for s in slots]
        out: list[OutTensor] = []
        if q.block:
            bn, bk = q.block
            tp_split = m.kind in (Kind.COLUMN, Kind.MERGED, Kind.QKV) and self.tp > 1
            in_r = cols[1] - cols[0]
            if m.kind is Kind.ROW and self.tp > 1 and in_r % bk:
                raise UnsupportedError(
                    f"{target}: per-rank input size {in_r} is not divisible by the FP8 block {bk}",
                    "vLLM refuses this split; use a smaller --tp",
                )
            parts = [b - a for a, b, _ in rows]
            # ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch: a layer of several
            # slots, one of which is not a block multiple, skips the block-shape validation
            # (DeepSeek's fused_qkv_a_proj, [q_lora_rank, kv_lora_rank + rope])
            mismatch_allowed = len(slots) > 1 and any(p % bn for p in parts)
            nc = _cdiv(in_r, bk)
            c0 = (cols[0] // in_r) * nc  # row-parallel: this rank's block columns
            total = sum(outs) if m.fused else None
            pieces = []
            for i, (s, (a, b, shard), o, off) in enumerate(zip(scales, rows, outs, offs, strict=True)):
                part = b - a
                checked = tp_split or (len(slots) > 1 and i < len(slots) - 1)
                if checked and part % bn and not mismatch_allowed:
                    raise UnsupportedError(
                        f"{target}: per-rank output size {part} is not divisible by the FP8 block {bn}",
                        "vLLM refuses this split; use a smaller --tp",
                    )
                rows_in = total if total is not None else o
                if s.shape != (_cdiv(rows_in, bn), _cdiv(in_size, bk)):
                    raise SourceError(
                        f"{s.name} has shape {list(s.shape)}, block {list(q.block)} of a "
                        f"[{rows_in}, {in_size}] weight needs {[_cdiv(rows_in, bn), _cdiv(in_size, bk)]}"
                    )
                if off % bn:
                    raise UnsupportedError(
                        f"{target}: slot {m.fused[i] if m.fused else i} of the fused {s.name} starts at row {off}, "
                        f"not on an FP8 block boundary ({bn})"
                    )
                nr = _cdiv(part, bn)
                r0 = off // bn + shard * nr
                pieces.append(Slice(s.name, (r0, c0), (r0 + nr, c0 + nc)))
            n_rows = sum(p.stop[0] - p.start[0] for p in pieces)
            if n_rows != _cdiv(sum(parts), bn):
                raise UnsupportedError(f"{target}: FP8 block scales do not tile the fused weight")
            out.append(OutTensor(f"{target}.{q.scale_name}", "F32", (n_rows, nc), tuple(pieces)))
        elif q.strategy == "channel":
            # ChannelQuantScaleParameter [out, 1]: sliced like the weight's rows
            pieces = []
            for s, (a, b, _), o, off in zip(scales, rows, outs, offs, strict=True):
                total = sum(outs) if m.fused else o
                if s.shape != (total, 1):
                    raise SourceError(f"{s.name} has shape {list(s.shape)}, per-channel scales need {[total, 1]}")
                pieces.append(Slice(s.name, (off + a, 0), (off + b, 1)))
            n_rows = sum(b - a for a, b, _ in rows)
            out.append(OutTensor(f"{target}.weight_scale", "F32", (n_rows, 1), tuple(pieces)))
            if q.static_activations:
                raise UnsupportedError(f"{target}: static input scales with per-channel weights are not supported")
        else:
            out.append(OutTensor(f"{target}.weight_scale", "F32", (len(outs),), tuple(_scalar(s) for s in scales)))
            if q.static_activations:
                if m.fused:
                    ins = [self.src(f"{slots[0]}.input_scale", target)] * len(outs)
                else:
                    ins = [self.src(f"{s}.input_scale", target) for s in slots]
                out.append(OutTensor(f"{target}.input_scale", "F32", (len(outs),), tuple(_scalar(s) for s in ins)))
        return out

    def experts(self, m: Module, prefix: str, target: str, per_tp: list[list[OutTensor]]) -> None:
        d, tp = self.dims, self.tp
        num, inter, hidden = d.num_experts, d.moe_intermediate, d.hidden
        base = prefix + m.slots[0]
        gate, up, down = m.expert_names
        moe_tp = 1 if self.ep else tp
        if self.arch.tp_at_most_experts and tp > num:
            raise UnsupportedError(f"--tp {tp} is greater than the number of experts {num}; vLLM refuses this")
        if self.ep and num < tp:
            raise UnsupportedError(f"--ep with --tp {tp} needs at least {tp} experts, the model has {num}")
        if inter % moe_tp:
            raise UnsupportedError(
                f"moe intermediate size {inter} is not divisible by --tp {tp}",
                f"use --ep, or a --tp that divides it: {_divisors(inter)}",
            )
        ip = inter // moe_tp
        quant = self.quantized(m, [base])
        block = self.moe_block(target, ip, moe_tp) if quant and self.quant and self.quant.block else None
        channel = quant and self.quant is not None and self.quant.strategy == "channel"
        wdtype = "F8_E4M3" if quant else self.dtype

        def t(e: int, proj: str, param: str) -> TensorInfo:
            info = self.src(f"{base}.{e}.{proj}.{param}", f"{target} (expert {e})")
            return info

        for r in range(tp):
            experts = self.local_experts(r) if self.ep else range(num)
            off = 0 if self.ep else r * ip
            w13, w2 = [], []
            for e in experts:
                g, u, dn = t(e, gate, "weight"), t(e, up, "weight"), t(e, down, "weight")
                for w, shape in ((g, (inter, hidden)), (u, (inter, hidden)), (dn, (hidden, inter))):
                    if w.shape != shape:
                        raise SourceError(f"{w.name} has shape {list(w.shape)}, expected {list(shape)}")
                    if quant and w.dtype != "F8_E4M3":
                        raise SourceError(f"{w.name} is {w.dtype}, but config.json says it is FP8")
                w13 += [_rows(g, off, off + ip), _rows(u, off, off + ip)]
                w2.append(Slice(dn.name, (0, off), (hidden, off + ip)))
            n = len(experts)
            per_tp[r].append(OutTensor(f"{target}.w13_weight", wdtype, (n, 2 * ip, hidden), tuple(w13)))
            per_tp[r].append(OutTensor(f"{target}.w2_weight", wdtype, (n, hidden, ip), tuple(w2)))
            if not quant:
                continue
            q = self.quant
            assert q is not None
            if block:
                (bn, bk), upf = block
                nr13, nc13 = _cdiv(ip, bn), _cdiv(hidden, bk)
                nr2, nc2 = _cdiv(hidden, bn), _cdiv(ip, bk)
                s13, s2 = [], []
                for e in experts:
                    for proj in (gate, up):
                        s = t(e, proj, q.scale_name)
                        rows = s.shape[0] * upf[0]
                        start = (rows // moe_tp) * (0 if self.ep else r)
                        if rows // moe_tp != nr13 or s.shape[1] * upf[1] != nc13:
                            raise UnsupportedError(f"{s.name}: FP8 block scales do not tile this split")
                        s13.append(Slice(s.name, (start, 0), (start + nr13, nc13), upf if upf != (1, 1) else None))
                    s = t(e, down, q.scale_name)
                    cols = s.shape[1] * upf[1]
                    start = (cols // moe_tp) * (0 if self.ep else r)
                    if cols // moe_tp != nc2 or s.shape[0] * upf[0] != nr2:
                        raise UnsupportedError(f"{s.name}: FP8 block scales do not tile this split")
                    s2.append(Slice(s.name, (0, start), (nr2, start + nc2), upf if upf != (1, 1) else None))
                per_tp[r].append(OutTensor(f"{target}.w13_{q.scale_name}", "F32", (n, 2 * nr13, nc13), tuple(s13)))
                per_tp[r].append(OutTensor(f"{target}.w2_{q.scale_name}", "F32", (n, nr2, nc2), tuple(s2)))
            elif channel:
                s13, s2 = [], []
                for e in experts:
                    for proj in (gate, up):
                        sc = t(e, proj, "weight_scale")
                        if sc.shape != (inter, 1):
                            raise SourceError(f"{sc.name} has shape {list(sc.shape)}, expected {[inter, 1]}")
                        s13.append(_rows(sc, off, off + ip))
                    s2.append(_whole(t(e, down, "weight_scale")))
                per_tp[r].append(OutTensor(f"{target}.w13_weight_scale", "F32", (n, 2 * ip, 1), tuple(s13)))
                per_tp[r].append(OutTensor(f"{target}.w2_weight_scale", "F32", (n, hidden, 1), tuple(s2)))
            else:
                s13 = [_scalar(t(e, proj, "weight_scale")) for e in experts for proj in (gate, up)]
                s2 = [_scalar(t(e, down, "weight_scale")) for e in experts]
                per_tp[r].append(OutTensor(f"{target}.w13_weight_scale", "F32", (n, 2), tuple(s13)))
                per_tp[r].append(OutTensor(f"{target}.w2_weight_scale", "F32", (n,), tuple(s2)))
                if q.static_activations:
                    # one slot per expert; vLLM keeps the last of gate/up it loads (up sorts last)
                    i13 = [_scalar(t(e, up, "input_scale")) for e in experts]
                    i2 = [_scalar(t(e, down, "input_scale")) for e in experts]
                    for e in experts:
                        self.used.add(f"{base}.{e}.{gate}.input_scale")
                    per_tp[r].append(OutTensor(f"{target}.w13_input_scale", "F32", (n,), tuple(i13)))
                    per_tp[r].append(OutTensor(f"{target}.w2_input_scale", "F32", (n,), tuple(i2)))

    def local_experts(self, r: int) -> range:
        """vLLM's linear expert placement (expert_map_manager.determine_expert_map)."""
        num, size = self.dims.num_experts, self.tp
        base, rem = divmod(num, size)
        count = base + 1 if r < rem else base
        start = r * base + min(r, rem)
        return range(start, start + count)

    def moe_block(self, target: str, ip: int, moe_tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The FP8 block grid of the MoE scales and the up-sampling factors (oracle/fp8.py)."""
        assert self.quant and self.quant.block
        bn, bk = self.quant.block
        if ip % bn == 0 and (moe_tp == 1 or ip % bk == 0):
            return (bn, bk), (1, 1)
        f = math.gcd(bn, bk, ip, self.dims.hidden)
        if f >= 32 and self.quant.refines_moe_blocks:
            note = (
                f"FP8 MoE block scales refined from [{bn}, {bk}] to [{f}, {f}] for the per-rank "
                f"intermediate size {ip}, as vLLM 0.32 does"
            )
            if note not in self.notes:
                self.notes.append(note)
            return (f, f), (bn // f, bk // f)
        what = "output_size of gate's and up's weight" if ip % bn else "input_size of down's weight"
        raise UnsupportedError(
            f"{target}: {what} = {ip} per rank is not divisible by the FP8 block {bn}, and no finer block >= 32 fits",
            "use --ep, or a smaller --tp",
        )


def _whole(t: TensorInfo) -> Slice:
    return Slice(t.name, (0,) * len(t.shape), t.shape)


def _rows(t: TensorInfo, a: int, b: int) -> Slice:
    return Slice(t.name, (a,) + (0,) * (len(t.shape) - 1), (b, *t.shape[1:]))


def _scalar(t: TensorInfo) -> Slice:
    if t.numel != 1:
        raise SourceError(f"{t.name} should hold one value, has shape {list(t.shape)}")
    return _whole(t)


_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(name))


def split_by_size(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a group of its own)."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def _assign_files(
    per_rank: dict[tuple[int, int], list[OutTensor]], *, tp: int, pp: int, max_part_size: int
) -> list[OutFile]:
    files = []
    for (pp_rank, tp_rank), tensors in sorted(per_rank.items()):
        # Widest dtypes first keeps every tensor aligned to its element size (as safetensors does);
        # then by name, so that all ranks share one order and sources are read roughly in order.
        ordered = sorted(tensors, key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))
        for part, chunk in enumerate(split_by_size(ordered, max_part_size)):
            if pp > 1:
                name = PP_PATTERN.format(pp_rank=pp_rank, tp_rank=tp_rank, part=part)
            else:
                name = TP_PATTERN.format(rank=tp_rank, part=part)
            files.append(OutFile(name, tp_rank, pp_rank, part, tuple(chunk)))
    return files
