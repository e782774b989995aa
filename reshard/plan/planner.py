"""Build the plan: walk the architecture's rule table, stage by stage, into every rank's tensors.

Pure metadata in (config.json + safetensors headers), a `Plan` value out. No torch, no tensor bytes.
"""

from __future__ import annotations

from reshard import VLLM_LAYOUT
from reshard.bulk import paused_gc
from reshard.checkpoint import Checkpoint
from reshard.errors import SourceError, UnsupportedError
from reshard.format import DTYPE_CODES, DTYPE_NAMES
from reshard.layout import Layout, default_partition
from reshard.names import DEFAULT_MAX_PART
from reshard.plan.backends import check_backend
from reshard.plan.context import Context, NotHeld, dims_from_config
from reshard.plan.files import assign_files
from reshard.plan.geometry import divisors
from reshard.plan.kvscales import vllm_kv_name
from reshard.plan.model import OutTensor, Plan, Slice
from reshard.plan.remote import RemoteCode, remote_code
from reshard.plan.slicers import add_module, padded_vocab
from reshard.plan.towers import check_towers, plan_towers, resolve_mm, skipped_prefixes, tower_pins
from reshard.rules import Attention, Rule, Vocab, for_checkpoint, for_platform, get_architecture


def build_plan(
    ckpt: Checkpoint,
    layout: Layout,
    *,
    max_part_size: int = DEFAULT_MAX_PART,
    trust_remote_code: bool | None = None,
    pieces: bool = True,
) -> Plan:
    """Plan every rank's files for vLLM's sharded_state loader.

    Args:
        ckpt: source metadata (config + headers).
        layout: the engine asked for: tp, pp, ep (vLLM's --enable-expert-parallel layout for MoE
            experts), dtype ("auto": config's dtype or torch_dtype; float32 becomes bfloat16, as vLLM on
            GPUs), partition (layers per stage, VLLM_PP_LAYER_PARTITION; None: as vLLM),
            moe_backend (vLLM's --moe-backend; some make vLLM allocate padded experts: plan.backends).
        max_part_size: split a rank's tensors into parts of at most this many bytes.
        trust_remote_code: `--trust-remote-code` (plan.remote): True copies the checkpoint's code and
            trusts it in the serve line; False drops config.json's auto_map and the code, and refuses a
            tokenizer that needs its code; None (re-planning a written output): neither.
        pieces: False plans the layout alone (`reshard plan`): every check, file, tensor, dtype and
            shape as with True, but the routed experts' weights without their pieces (the map of
            which source bytes make them: an MoE's hundreds of thousands of slices, issue 28). Such a
            plan (`layout_only`) cannot be written.

    Returns the plan, whose `layout` is `layout` resolved: dtype, partition, quantization and the
    MoE backend the serve line must pin.

    Raises:
        UnsupportedError: unknown architecture or a layout vLLM would refuse.
        SourceError: a tensor the rules need is missing, or has the wrong shape.
    """
    with paused_gc():  # hundreds of thousands of pieces, no cycle among them (reshard.bulk)
        try:
            return _build_plan(ckpt, layout, max_part_size, trust_remote_code, pieces)
        except NotHeld as e:
            raise UnsupportedError(e.message, e.hint) from None


def _build_plan(
    ckpt: Checkpoint, layout: Layout, max_part_size: int, trust_remote_code: bool | None, pieces: bool
) -> Plan:
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    arch_name, arch = get_architecture(ckpt.config)
    arch, platform = for_platform(
        arch_name, for_checkpoint(arch_name, arch, ckpt.tensors), ckpt.config, layout.platform
    )
    _refuse_opt_in_layouts(ckpt.config)
    code = RemoteCode() if trust_remote_code is None else remote_code(ckpt, arch_name, trust_remote_code)
    ctx = Context(
        ckpt,
        arch,
        tp=tp,
        ep=ep,
        dtype=model_dtype(arch.text(ckpt.config), layout.dtype, ckpt.config.get("model_type")),
        moe_backend=check_backend(layout.moe_backend),
    )
    ctx.pieces = pieces
    if ep and not ctx.dims.num_experts:
        raise UnsupportedError(
            f"--ep is vLLM's expert-parallel layout, and this {arch_name} has no experts",
            "drop --ep: a dense model's layout is the same without it",
        )
    check_attention(ctx)
    asked_mode = layout.mm_encoder_tp_mode  # with --language-model-only, how vLLM builds the encoder it drops
    mm_mode, lm_only = resolve_mm(arch_name, arch, layout)  # issue 27: the encoder's layout
    layout = layout.but(mm_encoder_tp_mode=mm_mode, language_model_only=lm_only)
    check_towers(ctx, layout, asked_mode)
    ranges = pp_ranges(ctx.dims.num_layers, pp, list(layout.partition) if layout.partition else None)
    check_stages(ctx, ranges)
    per_rank = {}
    for pp_rank in range(len(ranges)):
        for tp_rank, tensors in enumerate(plan_stage(ctx, ranges, pp_rank)):
            per_rank[(pp_rank, tp_rank)] = tensors
        plan_towers(ctx, layout, [per_rank[(pp_rank, r)] for r in range(tp)])  # on every stage, as vLLM
    check_casts(ctx, per_rank)
    check_unused(ctx, ranges, skipped_prefixes(arch, layout))
    return Plan(
        source=ckpt.ref,
        architecture=arch_name,
        layout=layout.but(
            dtype=DTYPE_CODES[ctx.dtype],
            partition=tuple(b - a for a, b in ranges),
            quantization=ctx.quant.to_json() if ctx.quant else None,
            moe_pin=ctx.moe_pin,
            platform=platform,
        ),
        files=assign_files(per_rank, pp=pp, max_part_size=max_part_size),
        layer_ranges=ranges,
        notes=ctx.notes + ([code.note] if code.note else []) + platform_note(arch_name, platform),
        config_patch=ctx.config_patch,
        serve_flags=tuple(f for f in arch.serve_flags if f != "--language-model-only")
        + layout.mm_flags()
        + tower_pins(ctx, layout, asked_mode),
        remote_code=code,
        layout_only=not pieces,
    )


FLOATS = frozenset(("F16", "BF16", "F32"))  # what a plain slice is cast between (reshard.io.dtypes)


def check_casts(ctx: Context, per_rank: dict[tuple[int, int], list[OutTensor]]) -> None:
    """A floating-point parameter is filled from floating-point tensors only: a norm stored as I64,
    BOOL or F64 is a damaged checkpoint (exit 4 here, before anything is written; it failed in the
    middle of the save). Quantized parameters (integer, FP8, FP4) follow their formats' own rules."""
    tensors = ctx.ckpt.tensors
    for rank in per_rank.values():
        for t in rank:
            if t.dtype not in FLOATS:
                continue
            for p in t.pieces:
                if type(p) is not Slice or p.scale is not None:
                    continue
                src = tensors.get(p.source)
                if src is not None and src.dtype != t.dtype and src.dtype not in FLOATS:
                    raise SourceError(
                        f"{src.name} is {src.dtype}, where vLLM's {t.name} holds {t.dtype}",
                        "the checkpoint is damaged, or config.json does not describe these weights",
                    )


def platform_note(arch_name: str, platform: str | None) -> list[str]:
    if platform is None:
        return []
    return [
        f"key names of vLLM's {arch_name} on {platform.upper()} (they differ per platform): the folder loads only "
        f"on {platform.upper()} (`--platform` cuda|cpu); reshard's loader refuses it elsewhere"
    ]


def _refuse_opt_in_layouts(config: dict) -> None:
    """vLLM 0.33's expert substitution (opt-in, from config.json) changes the MoE layout it builds;
    reshard does not write it (docs/vllm-versions.md)."""
    transform = (config.get("compression_config") or {}).get("transform_config") or {}
    if config.get("approximate_experts") or (isinstance(transform, dict) and transform.get("expert_substitution")):
        raise UnsupportedError(
            "config.json asks for vLLM 0.33's expert substitution, whose MoE layout reshard does not write",
            "remove approximate_experts / expert_substitution from config.json, or serve the original checkpoint",
        )


def num_experts(config: dict) -> int:
    """How many routed experts the model has (0 for a dense model)."""
    _, arch = get_architecture(config)
    return dims_from_config(arch.text(config), arch).num_experts


# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS (config/model.py, the same in 0.32 and 0.33): --dtype float16 is refused
# for these model types ("numerical instability"), and an auto dtype that would be float16 falls back to the
# platform's first supported dtype, bfloat16 on GPUs that have it
NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})


def model_dtype(config: dict, dtype: str, model_type: str | None = None) -> str:
    """The output's model dtype (safetensors code) for --dtype `dtype`; `model_type`: config.json's
    top-level one, which vLLM checks."""
    model_type = model_type if model_type is not None else config.get("model_type")
    no_f16 = model_type in NO_FLOAT16
    if dtype != "auto":
        if dtype not in ("bfloat16", "float16", "float32"):
            raise UnsupportedError(f"--dtype {dtype}: use auto, bfloat16, float16 or float32")
        if dtype == "float16" and no_f16:
            raise UnsupportedError(
                f"--dtype float16: vLLM refuses float16 for model type {model_type!r} (numerical instability)",
                "use --dtype bfloat16 or float32",
            )
        return DTYPE_NAMES[dtype]
    # transformers 5 (vLLM's) takes `dtype` over the older `torch_dtype` where a config has both
    key = "dtype" if config.get("dtype") else "torch_dtype"
    name = str(config.get(key) or "float32").removeprefix("torch.")
    if name == "float32":
        name = "bfloat16"  # vLLM's auto dtype on GPUs downcasts float32 checkpoints
    if name == "float16" and no_f16:
        name = "bfloat16"  # vLLM's auto falls back from float16 for these (NO_FLOAT16)
    if name not in ("bfloat16", "float16"):
        raise UnsupportedError(
            f"config.json {key} {name!r} is not a dtype vLLM runs a model in",
            "pass --dtype bfloat16, float16 or float32, the one you will serve it with",
        )
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
        sizes = list(default_partition(num_layers, pp))
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


# ---- the walk ---------------------------------------------------------------------------------


def check_stages(ctx: Context, ranges: list[tuple[int, int]]) -> None:
    """Refuse pipeline stages vLLM fails to build: one without a MoE layer where its model class needs one
    (Architecture.moe_on_every_stage)."""
    arch = ctx.arch
    if not arch.moe_on_every_stage or arch.is_moe_layer is None:
        return
    for p, (first, stop) in enumerate(ranges):
        if not any(arch.is_moe_layer(ctx.config, layer) for layer in range(first, stop)):
            raise UnsupportedError(
                f"pipeline stage {p} holds {_layers(first, stop)}, no MoE layer: vLLM's {arch.names[0]} fails "
                "to build a stage without one",
                "choose a --pp-layer-partition that gives every stage a MoE layer, or another --pp",
            )


def _layers(first: int, stop: int) -> str:
    return f"layer {first}" if stop - first == 1 else f"layers {first}-{stop - 1}"


def plan_stage(ctx: Context, ranges: list[tuple[int, int]], pp_rank: int) -> list[list[OutTensor]]:
    """Pipeline stage `pp_rank`'s tensors, per tensor-parallel rank: its top modules, then its layers."""
    arch, config = ctx.arch, ctx.config
    last = len(ranges) - 1
    per_tp: list[list[OutTensor]] = [[] for _ in range(ctx.tp)]
    on_stage = [m for m in arch.top if top_on_stage(ctx, m, pp_rank, last)]
    for m in on_stage:
        if not m.present(config):
            continue
        if ctx.dims.tie and any(isinstance(t, Vocab) and t.tied == m.name for t in on_stage):
            continue  # tied: vLLM's state dict keeps only the lm_head alias
        add_module(ctx, m, "", per_tp)
    first, stop = ranges[pp_rank]
    for layer in range(first, stop):
        moe = arch.is_moe_layer is not None and arch.is_moe_layer(config, layer)
        for m in arch.layer_modules(config, layer) + (arch.moe_mlp if moe else arch.dense_mlp):
            if m.present(config):
                add_module(ctx, m, arch.prefix(layer), per_tp)
    return per_tp


def top_on_stage(ctx: Context, m: Rule, pp_rank: int, last: int) -> bool:
    """The embedding on the first stage (and the last, when tied), other top modules on the last."""
    if ctx.arch.top_on_every_stage or m.name in ctx.arch.every_stage:
        return True
    if m.name == ctx.arch.embedding:
        return pp_rank == 0 or (ctx.dims.tie and pp_rank == last)
    return pp_rank == last


# ---- checks -------------------------------------------------------------------------------------


def check_attention(ctx: Context) -> None:
    """Head counts and the padded vocabulary must split as vLLM splits them."""
    d, tp = ctx.dims, ctx.tp
    if d.num_heads % tp:
        raise UnsupportedError(
            f"num_attention_heads={d.num_heads} is not divisible by --tp {tp}",
            f"use a --tp that divides it: {divisors(d.num_heads)}",
        )
    if (d.num_kv_heads >= tp and d.num_kv_heads % tp) or (d.num_kv_heads < tp and tp % d.num_kv_heads):
        raise UnsupportedError(
            f"num_key_value_heads={d.num_kv_heads} and --tp {tp} do not divide each other",
            "vLLM needs one to divide the other",
        )
    padded = padded_vocab(d.vocab)
    if padded % tp:
        raise UnsupportedError(f"padded vocabulary {padded} (vocab_size {d.vocab}) is not divisible by --tp {tp}")


def check_unused(ctx: Context, ranges: list[tuple[int, int]], skip_prefixes: tuple[str, ...]) -> None:
    """With every layer planned, a checkpoint tensor no rule read means the wrong architecture.

    skip_prefixes: checkpoint prefixes the layout leaves out (MTP, an encoder under --language-model-only)."""
    if ranges[0][0] != 0 or ranges[-1][1] != ctx.dims.num_layers:
        return
    arch = ctx.arch
    spec = spec_layer_prefixes(ctx) + skip_prefixes
    ignore, used = tuple(arch.ignore), ctx.used
    extra = [n for n in ctx.ckpt.tensors if n not in used and not n.endswith(ignore) and not n.startswith(spec)]
    for prefix in skip_prefixes:
        skipped = sum(1 for n in ctx.ckpt.tensors if n.startswith(prefix))
        if skipped:
            ctx.note(
                f"{skipped} checkpoint tensor(s) under {prefix} left out: vLLM's {arch.names[0]} does not load them"
            )
    if ctx.dims.tie:
        extra = [n for n in extra if n not in arch.hf_names(f"{arch.lm_head}.weight")]  # vLLM skips it when tied
    skipped = skip_kv_scales_vllm_ignores(ctx, extra)
    extra = [n for n in extra if n not in skipped]
    if extra:
        raise SourceError(
            f"{len(extra)} checkpoint tensor(s) match no rule of {arch.names[0]}, e.g. {extra[0]!r}",
            "the checkpoint does not match its config.json architecture",
        )


def spec_layer_prefixes(ctx: Context) -> tuple[str, ...]:
    """The MTP layers after the decoder layers, which vLLM's main model skips (get_spec_layer_idx_from_weight_name).

    Only layers the checkpoint holds are named (a config may announce more than it ships)."""
    n = next((int(ctx.config[k]) for k in ctx.arch.spec_layers_key if ctx.config.get(k)), 0)
    if not n:
        return ()  # the config announces no MTP layer: no scan of every tensor name
    first = ctx.dims.num_layers
    held = {layer for name in ctx.ckpt.tensors if (layer := ctx.arch.layer_of(name)) is not None}
    return tuple(ctx.arch.prefix(i) for i in sorted(held) if first <= i < first + n)


def skip_kv_scales_vllm_ignores(ctx: Context, extra: list[str]) -> set[str]:
    """KV-cache scales no attention layer took. Where vLLM 0.32 drops them at load (MLA attention has
    no KV-cache scale parameters; `quant_method: fp8` has no zero points), they are left out as vLLM
    leaves them, with a note; where it would fail or mis-load, refuse. Returns the names left out."""
    kv = [(n, m) for n in extra if (m := vllm_kv_name(n, fp8_config=True)) is not None]
    if not kv:
        return set()
    name, mapped = kv[0]
    if ctx.quant and any(isinstance(m, Attention) and not m.kv_cache for m in ctx.arch.layer):
        ctx.note(
            f"{len(kv)} KV-cache scale tensor(s) left out, e.g. {name}: vLLM {VLLM_LAYOUT} drops them with a warning "
            "(MLA attention has no FP8 KV-cache scale parameters; its scales stay 1.0), so the output matches it"
        )
        return {n for n, _ in kv}
    zero_points = [n for n, m in kv if m.endswith("_zero_point")]
    if ctx.quant and ctx.quant.method == "fp8" and len(zero_points) == len(kv):
        ctx.note(
            f"{len(kv)} KV-cache zero point(s) left out, e.g. {name}: quant_method fp8 has none, "
            f"vLLM {VLLM_LAYOUT} ignores them"
        )
        return set(zero_points)
    if not ctx.quant:
        why = (
            f"vLLM {VLLM_LAYOUT} maps KV-cache scale names only for a quantized checkpoint; "
            "without a quantization_config it fails on the unknown name"
        )
    else:
        why = f"vLLM {VLLM_LAYOUT} renames it {mapped!r}, which this model does not have, and does not load it"
    raise UnsupportedError(
        f"{len(kv)} KV-cache scale tensor(s) that vLLM would not load, e.g. {name!r}: {why}",
        "remove them from the checkpoint to serve it as vLLM does",
    )
