"""The manifest's `layout` object: written from a `Layout`, parsed back into one."""

from __future__ import annotations

from reshard import VLLM_LAYOUT
from reshard.format import DTYPE_CODES
from reshard.layout import Layout
from reshard.manifest.validate import MAX_PART, MAX_PP, MAX_TP, MAX_WORLD, ManifestProblem, need
from reshard.names import file_pattern


def layout_json(lay: Layout, architecture: str, vllm_layout: str = VLLM_LAYOUT) -> dict:
    """The manifest's `layout` object (also what `plan --json` prints)."""
    return {
        "vllm_layout": vllm_layout,
        "architecture": architecture,
        "tp": lay.tp,
        "pp": lay.pp,
        "ep": lay.ep,
        "dtype": lay.dtype,
        "quantization": lay.quantization,
        "pattern": file_pattern(lay.pp),
        "pp_layer_partition": list(lay.partition or ()),
        "moe_backend": lay.moe_backend,
        "moe_backend_pinned": lay.moe_pin,
        **({"platform": lay.platform} if lay.platform else {}),  # only where the key names depend on it
        # issue 27: a multimodal model's encoder, as vLLM's --mm-encoder-tp-mode / --language-model-only
        "mm_encoder_tp_mode": lay.mm_encoder_tp_mode,
        "language_model_only": lay.language_model_only,
    }


def parse_layout(lay: object) -> tuple[str, Layout, str]:
    need(isinstance(lay, dict), "layout is not an object")
    assert isinstance(lay, dict)
    for k, most in (("tp", MAX_TP), ("pp", MAX_PP)):
        need(type(lay.get(k)) is int and 1 <= lay[k] <= most, f"layout.{k} is {lay.get(k)!r} (at most {most})")
    need(lay["tp"] * lay["pp"] <= MAX_WORLD, f"layout.tp * layout.pp is over {MAX_WORLD}")
    need(isinstance(lay.get("ep"), bool), f"layout.ep is {lay.get('ep')!r}")
    part = lay.get("pp_layer_partition")
    need(
        part is None
        or part == []
        or (
            isinstance(part, list)
            and len(part) == lay["pp"]
            and all(type(x) is int and 1 <= x <= MAX_PART for x in part)
        ),
        f"layout.pp_layer_partition is {str(part)[:100]} (one layer count per pipeline stage)",
    )
    dtype = lay.get("dtype") or "auto"
    dtype = DTYPE_CODES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    quant = lay.get("quantization")
    need(quant is None or isinstance(quant, dict), f"layout.quantization is {quant!r}")
    backend, pin = lay.get("moe_backend") or "auto", lay.get("moe_backend_pinned")
    need(isinstance(backend, str) and (pin is None or isinstance(pin, str)), f"layout.moe_backend is {backend!r}")
    platform = lay.get("platform")
    need(platform is None or isinstance(platform, str), f"layout.platform is {platform!r}")
    mm, lm_only = lay.get("mm_encoder_tp_mode"), lay.get("language_model_only", False)  # absent before issue 27
    need(mm is None or isinstance(mm, str), f"layout.mm_encoder_tp_mode is {mm!r}")
    need(isinstance(lm_only, bool), f"layout.language_model_only is {lm_only!r}")
    try:
        layout = Layout(
            lay["tp"],
            lay["pp"],
            lay["ep"],
            dtype,
            tuple(part) if part else None,
            backend,
            pin,
            quant,
            platform,
            mm,
            lm_only,
        )
    except ValueError as e:
        raise ManifestProblem(f"layout: {e}") from None
    arch = lay.get("architecture")
    return (arch if isinstance(arch, str) else ""), layout, str(lay.get("vllm_layout") or "")
