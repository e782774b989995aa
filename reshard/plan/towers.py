"""Multimodal encoders (vision towers): which layout the folder holds, and each rank's tensors of it.

vLLM builds a multimodal model's encoder beside its language model on every rank: its linear layers
TP-sharded by default (`--mm-encoder-tp-mode weights`), whole on every rank with `data` (vLLM's
`is_vit_use_data_parallel` -> `disable_tp`), absent with `--language-model-only`
(`SupportsMultiModal._mark_tower_model`). The folder holds one of the three, so the layout records it
and the serve line pins it. An encoder's modules are the generic styles (reshard.rules.styles),
planned with the encoder's own sizes (`Context.tower`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from reshard.errors import SourceError, UnsupportedError
from reshard.layout import Layout
from reshard.plan.context import Context
from reshard.plan.geometry import divisors
from reshard.plan.model import OutTensor
from reshard.plan.slicers import add_module
from reshard.rules import Architecture, Linear, Rule
from reshard.rules.spec import Tower


def resolve_mm(arch_name: str, arch: Architecture, layout: Layout) -> tuple[str | None, bool]:
    """(mm_encoder_tp_mode, language_model_only) of the folder, from what was asked.

    A text model takes neither; a multimodal model whose tower has no rule table is written
    --language-model-only whatever is asked (asking for an encoder layout is refused); otherwise
    --language-model-only, or the encoder in the mode asked: by default weights, or for a family
    written text-only before (Qwen3.5-MoE: `--language-model-only` in its serve_flags) text-only still."""
    asked, lm_only = layout.mm_encoder_tp_mode, layout.language_model_only
    if not arch.towers and not arch.text_only:
        if asked or lm_only:
            flag = "--language-model-only" if lm_only else f"--mm-encoder-tp-mode {asked}"
            raise UnsupportedError(f"{flag}: {arch_name} is a text model, it has no encoder", f"drop {flag}")
        return None, False
    if arch.text_only and not arch.towers:
        if asked:
            raise UnsupportedError(
                f"--mm-encoder-tp-mode {asked}: {arch_name}'s vision tower has no rule table in reshard; "
                "its folders hold the text model only, served --language-model-only",
                "drop --mm-encoder-tp-mode (the folder is written as with --language-model-only)",
            )
        return None, True
    if lm_only:  # no encoder in the folder; a mode asked is the one vLLM builds (and drops) it in
        if asked == "data" and not all(t.data_mode for t in arch.towers):
            raise UnsupportedError(
                f"--mm-encoder-tp-mode data: vLLM's {arch_name} does not support it and falls back to weights",
                "drop --mm-encoder-tp-mode (the folder holds no encoder with --language-model-only)",
            )
        return None, True
    mode = asked or (None if arch.text_only else "weights")
    if mode is None:  # a family written text-only before its tower had a rule table: still its default
        return None, True
    if mode == "data" and not all(t.data_mode for t in arch.towers):
        raise UnsupportedError(
            f"--mm-encoder-tp-mode data: vLLM's {arch_name} does not support it and falls back to weights "
            "(its encoder is then TP-sharded)",
            "use --mm-encoder-tp-mode weights (the default) or --language-model-only",
        )
    return mode, False


def skipped_prefixes(arch: Architecture, layout: Layout) -> tuple[str, ...]:
    """Checkpoint prefixes the folder leaves out: the architecture's (MTP, a tower without rules), the
    encoders' under --language-model-only, none of a tower it holds."""
    towers = tuple(p for t in arch.towers for p in t.skip)
    if layout.language_model_only:
        return tuple(dict.fromkeys(arch.skip_prefixes + towers))
    return tuple(p for p in arch.skip_prefixes if p not in towers)


def tower_pins(ctx: Context, layout: Layout, asked: str | None = None) -> tuple[str, ...]:
    """What the serve line must pin, beyond the encoder's mode, for the folder's encoder to be the one vLLM
    0.32 and 0.33 both build (checked diffing their sources):
    - `--no-mm-device-do-normalize` for towers that normalise on the device (Tower.device_normalize);
    - `VLLM_USE_V2_MODEL_RUNNER=0` with --pp: 0.33's Model Runner V2 (its default on CUDA) builds the
      encoder on the first pipeline stage only; V1, and 0.32, on every stage, as the folder holds it;
    - without the encoder, the --mm-encoder-tp-mode `asked` for, else data where vLLM could not split it
      (`_unsplittable`: its heads, or a width TP does not divide)."""
    arch = ctx.arch
    if layout.language_model_only:
        if asked:
            return (f"--mm-encoder-tp-mode {asked}",)
        return ("--mm-encoder-tp-mode data",) if _unsplittable(ctx) else ()
    if layout.mm_encoder_tp_mode is None:
        return ()
    pins = ["--no-mm-device-do-normalize"] if any(t.device_normalize for t in arch.towers) else []
    if layout.pp > 1:
        pins.append("VLLM_USE_V2_MODEL_RUNNER=0")
    return tuple(pins)


def check_towers(ctx: Context, layout: Layout, asked: str | None = None) -> None:
    """vLLM splits an encoder across the TP ranks in weights mode; it fails to build where its heads do not divide.

    Under --language-model-only vLLM still constructs the encoder (on the meta device, then drops it:
    `SupportsMultiModal._mark_tower_model`), in the mode --mm-encoder-tp-mode says (weights by default),
    so the same division must hold; where it does not, the serve line asks for data mode, which builds
    it whole (`tower_pins`), or the layout is refused where the model has no data mode or weights mode
    was `asked` for."""
    _check_choices(ctx, layout)
    if layout.language_model_only:
        if asked == "data":
            return  # built whole: nothing to divide
        for tower, why, hint in _unsplittable(ctx):
            if asked == "weights":
                raise UnsupportedError(
                    f"{why}: vLLM builds the vision encoder even with --language-model-only (then drops it), "
                    "in the --mm-encoder-tp-mode weights asked for, and fails to split it",
                    "use --mm-encoder-tp-mode data, or drop it: the serve line then asks for data mode",
                )
            if not tower.data_mode:
                raise UnsupportedError(
                    f"{why}: vLLM builds the vision encoder even with --language-model-only (then drops it), "
                    f"split across the TP ranks, and fails to build; {ctx.arch.names[0]} has no "
                    "--mm-encoder-tp-mode data",
                    hint,
                )
            ctx.note(
                f"{why}: vLLM builds the vision encoder even with --language-model-only (then drops it) and "
                "would fail to split it; the serve line adds --mm-encoder-tp-mode data, which builds it whole "
                "(the folder is the same)"
            )
        return
    if layout.mm_encoder_tp_mode != "weights":
        return
    for tower in ctx.arch.towers:
        heads = ctx.tower(tower, ctx.tp).dims.num_heads
        if heads % ctx.tp and tower.heads_fallback:
            ctx.note(
                f"{tower.config}.{tower.heads}={heads} is not divisible by --tp {ctx.tp}: vLLM builds the vision "
                "encoder whole on every rank (as with --mm-encoder-tp-mode data), and so does this folder"
            )
        elif heads % ctx.tp:
            raise UnsupportedError(
                f"{tower.config}.{tower.heads}={heads} is not divisible by --tp {ctx.tp}: vLLM splits the encoder's "
                "heads across the TP ranks (--mm-encoder-tp-mode weights) and fails to build",
                f"use --mm-encoder-tp-mode data (the encoder whole on every rank), --language-model-only, "
                f"or a --tp that divides it: {divisors(heads)}",
            )


def _check_choices(ctx: Context, layout: Layout) -> None:
    """An encoder setting of a value vLLM's model cannot build (it raises even under --language-model-only), or,
    where the encoder is written, one the table has no rule for, is refused (exit 3)."""
    for tower in ctx.arch.towers:
        settings = tower.settings(ctx.ckpt.config)
        for choice in tower.choices:
            if choice.accepts(settings) or (choice.by != "vLLM" and layout.mm_encoder_tp_mode is None):
                continue
            built = ", ".join(json.dumps(v) for v in choice.values)
            if choice.same_as:
                built += f" or {tower.config}.{choice.same_as}'s value"
            where = f"{tower.config}.{choice.key} = {json.dumps(settings.get(choice.key))}"
            if choice.by == "vLLM":
                raise UnsupportedError(
                    f"{where}: vLLM's {ctx.arch.names[0]} does not build it (it builds {built}) and fails to start",
                    "this checkpoint cannot be served by this vLLM release",
                )
            raise UnsupportedError(
                f"{where}: reshard has no rule for this encoder variant of {ctx.arch.names[0]} (it writes {built})",
                "pass --language-model-only to write the text model alone",
            )


def plan_towers(ctx: Context, layout: Layout, per_tp: list[list[OutTensor]]) -> None:
    """Append the encoders' tensors to every rank: split over the ranks (weights) or whole on each (data)."""
    if layout.mm_encoder_tp_mode is None:
        return
    data = layout.mm_encoder_tp_mode == "data"
    for tower in ctx.arch.towers:
        if not any(n.startswith(tower.skip) for n in ctx.ckpt.tensors):
            raise SourceError(
                f"the checkpoint holds no tensor of {ctx.arch.names[0]}'s vision tower (under "
                f"{' or '.join(tower.skip)}): a text-only export, or an output saved with --language-model-only",
                "pass --language-model-only, or save from a checkpoint with the tower",
            )
        whole = (data and not tower.split_in_data_mode) or _falls_back(ctx, tower)
        sub = _encoder(ctx, tower, 1 if whole else ctx.tp)
        for m, prefix in _modules(sub, tower):
            _check_unquantized(sub, m, prefix)
        try:
            parts = _tower_parts(sub, tower)
        except UnsupportedError as e:  # a size the split does not divide
            if whole or data or not tower.data_mode:
                raise
            raise UnsupportedError(
                f"{e.message} (vLLM's --mm-encoder-tp-mode weights split)",
                "use --mm-encoder-tp-mode data (the encoder whole on every rank), --language-model-only, "
                f"or {(e.hint or 'another --tp').removeprefix('use ')}",
            ) from e
        for r in range(ctx.tp):
            per_tp[r].extend(parts[0 if whole else r])


def _encoder(ctx: Context, tower: Tower, tp: int) -> Context:
    """The context the encoder is planned in: its sizes, `tp` ranks, and the quant config vLLM builds it with."""
    sub = ctx.tower(tower, tp)
    if sub.quant is not None and sub.quant.method in tower.unquantized_with:
        sub.quant = None  # vLLM builds the encoder without the quant config
    return sub


def _modules(sub: Context, tower: Tower) -> Iterator[tuple[Rule, str]]:
    """The encoder's modules present in its config, each with its prefix."""
    for m in tower.top:
        if m.present(sub.config):
            yield m, ""
    for blocks in tower.blocks:
        for i in range(blocks.number(sub.config)):
            for m in blocks.rules:
                if m.present(sub.config):
                    yield m, blocks.prefix.format(layer=i)


def _tower_parts(sub: Context, tower: Tower) -> list[list[OutTensor]]:
    """Each of `sub.tp` ranks' tensors of the encoder (refused where the split does not divide)."""
    parts: list[list[OutTensor]] = [[] for _ in range(sub.tp)]
    for m, prefix in _modules(sub, tower):
        add_module(sub, m, prefix, parts)
    return parts


def _unsplittable(ctx: Context) -> list[tuple[Tower, str, str]]:
    """The encoders vLLM would split across the TP ranks in weights mode and cannot, each with why and what to
    do: its heads, or a size a split does not divide (planned aside from the checkpoint's encoder tensors,
    then dropped). What config.json and the checkpoint do not describe is not counted: vLLM builds it from
    its config class's defaults, which reshard does not know for every family."""
    out = []
    for t in ctx.arch.towers:
        try:
            aside = ctx.tower(t, ctx.tp)
        except SourceError:
            continue
        heads = aside.dims.num_heads
        if heads % ctx.tp:
            if not t.heads_fallback:  # otherwise vLLM builds it whole
                why = f"{t.config}.{t.heads}={heads} is not divisible by --tp {ctx.tp}"
                out.append((t, why, f"use a --tp that divides it: {divisors(heads)}"))
            continue
        # nothing of this plan is kept; planned unquantized, so that only the split is judged (a quantized tower
        # is refused only when it is written, `plan_towers`: --language-model-only leaves it out)
        aside.used, aside.notes, aside.quant = set(), [], None
        try:
            _tower_parts(aside, t)
        except UnsupportedError as e:
            out.append((t, e.message, e.hint or "use another --tp"))
        except SourceError:
            continue
    return out


def _falls_back(ctx: Context, tower: Tower) -> bool:
    """vLLM builds this encoder whole on every rank because its heads do not divide TP (Tower.heads_fallback)."""
    return tower.heads_fallback and ctx.tower(tower, ctx.tp).dims.num_heads % ctx.tp != 0


QUANT_WEIGHTS = (".weight", ".weight_packed", ".qweight")


def _check_unquantized(ctx: Context, m: Rule, prefix: str) -> None:
    """A tower layer the checkpoint's quantization applies to (not on its ignore list) is refused: no
    quantized tower's vLLM layout is checked (the releases leave their towers in bf16)."""
    if ctx.quant is None or not isinstance(m, Linear) or not m.quant:
        return
    names = ctx.arch.hf_names(prefix + m.hf)
    name = next((n for n in names if any(n + w in ctx.ckpt.tensors for w in QUANT_WEIGHTS)), names[0])
    if ctx.quant.quantizes([name]):
        raise UnsupportedError(
            f"{name}: the checkpoint's {ctx.quant.method} quantization applies to this vision tower layer, "
            "whose quantized vLLM layout reshard has not checked",
            "pass --language-model-only (the text model alone), or use a checkpoint whose quantization_config "
            "leaves the tower out",
        )
