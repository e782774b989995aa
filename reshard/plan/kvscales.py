"""FP8 KV-cache scales: which checkpoint tensor vLLM 0.32 loads into an attention layer's scales.

Checkpoints name them in several ways (llm-compressor, AutoFP8, ModelOpt, older compressed-tensors).
vLLM's AutoWeightsLoader renames every checkpoint tensor with the quantization config's
`get_cache_scale_mapper()` before loading (quantization/base_config.py; `Fp8Config` adds the
compressed-tensors output-scale suffixes, fp8.py). As in vLLM's `WeightsMapper`, every regex applies
in turn to the result of the one before, then the suffixes. This module is that mapping as data,
and one function that applies it; the strategies in reshard.plan.quant say what each parameter
holds once a tensor has been found for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from operator import methodcaller

from reshard import VLLM_LAYOUT
from reshard.errors import SourceError, UnsupportedError
from reshard.plan.geometry import Sources
from reshard.plan.model import Fill, OutTensor, Piece, rows, scalar

# vLLM 0.32 QuantizationConfig.get_cache_scale_mapper: orig_to_new_regex, in order
CACHE_SCALE_REGEX: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\.kv_scale$", r".attn.k_scale"),  # deprecated: one scale, loaded into k_scale only
        (r"\.self_attn\.[kv]_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),  # ModelOpt
        (r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),  # fused qkv_proj
        (r"\.mixer\.[kv]_proj\.([kv])_scale$", r".mixer.attn.\1_scale"),  # NemotronH
        (r"\.self_attn\.q\.scale$", r".self_attn.attn.q_scale"),  # HYV3
        (r"\.self_attn\.([kv])_cache\.scale$", r".self_attn.attn.\1_scale"),  # HYV3
        (r"(?<!\.attn)\.([qkv])_scale$", r".attn.\1_scale"),  # the default
        (r"(?<!\.attn)\.([qkv])_zero_point$", r".attn.\1_zero_point"),
    )
)

# vLLM 0.32 Fp8Config.get_cache_scale_mapper: orig_to_new_suffix (applied after the regexes)
FP8_CACHE_SCALE_SUFFIX: dict[str, str] = {
    ".k_proj.output_scale": ".attn.k_scale",
    ".v_proj.output_scale": ".attn.v_scale",
    ".q_proj.output_scale": ".attn.q_scale",
    ".self_attn.prob_output_scale": ".self_attn.attn.prob_scale",
}

# the attention layer's KV-cache method parameters a checkpoint tensor can be loaded into
KV_PARAMS = ("k_scale", "v_scale", "q_scale", "prob_scale", "k_zero_point", "v_zero_point", "q_zero_point")
# How every name that can be one of them ends: each regex and suffix above matches only at such an end,
# and a name none renames is one only when it ends in a KV_PARAMS name (issue 28: the regexes are
# applied to the few tensors so named, not to each of 200k)
KV_ENDINGS = ("_scale", ".scale", "_zero_point")


def vllm_kv_name(name: str, *, fp8_config: bool) -> str | None:
    """The vLLM parameter checkpoint tensor `name` is loaded into, when it is a KV-cache scale
    (`model.layers.0.self_attn.k_proj.k_scale` -> `model.layers.0.self_attn.attn.k_scale`); None
    for any other tensor. `fp8_config`: the checkpoint is `quant_method: fp8` (Fp8Config)."""
    if not name.endswith(KV_ENDINGS):
        return None  # no regex or suffix above renames it, and it names no KV-cache parameter as it is
    key = name
    for pattern, new in CACHE_SCALE_REGEX:
        if pattern.search(key):
            key = pattern.sub(new, key)
    if fp8_config:
        for suffix, new in FP8_CACHE_SCALE_SUFFIX.items():
            if key.endswith(suffix):
                key = new.join(key.rsplit(suffix, 1))
    head, _, param = key.rpartition(".")
    if param not in KV_PARAMS or not head.endswith(".attn"):
        return None
    return key


def kv_scale_sources(names: Iterable[str], *, fp8_config: bool) -> dict[str, list[str]]:
    """vLLM KV-cache parameter -> the checkpoint tensors vLLM would load into it."""
    out: dict[str, list[str]] = {}
    for name in filter(methodcaller("endswith", KV_ENDINGS), names):  # vllm_kv_name's first test, in C
        target = vllm_kv_name(name, fp8_config=fp8_config)
        if target is not None:
            out.setdefault(target, []).append(name)
    return out


def kv_cache_scheme(scheme: dict | None) -> str | None:
    """A compressed-tensors kv_cache_scheme's strategy, refused where vLLM 0.32 refuses it
    (CompressedTensorsKVCacheMethod.validate_kv_cache_scheme)."""
    if not scheme:
        return None
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise UnsupportedError(
            f"compressed-tensors kv_cache_scheme {scheme.get('type')} {scheme.get('num_bits')}-bit: "
            f"vLLM {VLLM_LAYOUT} supports only FP8 (type float, 8 bits)"
        )
    strategy = str(scheme.get("strategy"))
    if strategy not in ("tensor", "attn_head"):
        raise UnsupportedError(
            f"compressed-tensors kv_cache_scheme strategy {strategy!r}: "
            f"vLLM {VLLM_LAYOUT} supports tensor and attn_head"
        )
    if not scheme.get("symmetric"):
        raise UnsupportedError(
            f"compressed-tensors kv_cache_scheme is asymmetric: vLLM {VLLM_LAYOUT} supports symmetric only"
        )
    return strategy


# ---- what the attention layer holds, per KV-cache method --------------------------------------


def fp8_kv_params(sources: Sources, target: str, dtype: str, found: dict[str, str]) -> list[OutTensor]:
    """Fp8KVCacheMethod (quantization/kv_cache.py): four KVCacheScaleParameter, 0-d in the model
    dtype, -1.0 until a checkpoint tensor of one value is loaded (cast to the model dtype).
    Zero points have no parameter here: vLLM ignores them."""
    out = []
    for p in ("k_scale", "v_scale", "q_scale", "prob_scale"):
        name = found.get(p)
        piece = scalar(sources.src(name, f"{target}.{p}")) if name else Fill(-1.0, 1)
        out.append(OutTensor(f"{target}.{p}", dtype, (), (piece,)))
    if found:
        sources.note(
            "FP8 KV-cache scales are written in the model dtype, as vLLM's parameters hold them: "
            "`reshard merge` gives back their names, and their values rounded to that dtype (--allow-lossy)"
        )
    return out


def ct_kv_params(
    sources: Sources, target: str, dtype: str, found: dict[str, str], strategy: str | None, heads: KvHeads
) -> list[OutTensor]:
    """CompressedTensorsKVCacheMethod (compressed_tensors.py): k/v/q scales F32 of ones and zero
    points of zeros in the model dtype, [1] each, or [KV heads on this rank] with `strategy:
    attn_head` (k/v sliced per rank, replicated like the KV heads; q reduced, zero points never
    loaded)."""
    if strategy != "attn_head":
        out = []
        for p in ("k_scale", "v_scale", "q_scale"):
            name = found.get(p)
            piece = scalar(sources.src(name, f"{target}.{p}")) if name else Fill(1.0, 1)
            out.append(OutTensor(f"{target}.{p}", "F32", (1,), (piece,)))
        for p in ("k_zero_point", "v_zero_point", "q_zero_point"):
            name = found.get(p)
            piece = scalar(sources.src(name, f"{target}.{p}")) if name else Fill(0.0, 1)
            out.append(OutTensor(f"{target}.{p}", dtype, (1,), (piece,)))
        return out
    if found.get("q_scale"):
        raise UnsupportedError(
            f"{found['q_scale']}: per-head q scales (kv_cache_scheme strategy attn_head) are reduced by vLLM "
            "to one maximum per KV-head group when loaded, which reshard cannot write as slices"
        )
    n, first = heads.on_rank()
    out = []
    for p in ("k_scale", "v_scale"):
        name = found.get(p)
        if name:
            t = sources.src(name, f"{target}.{p}")
            if t.numel != heads.total or t.shape[0] != heads.total:
                raise SourceError(f"{name} has shape {list(t.shape)}, per-head scales need {heads.total} values")
            piece: Piece = rows(t, first, first + n)
        else:
            piece = Fill(1.0, n)
        out.append(OutTensor(f"{target}.{p}", "F32", (n,), (piece,)))
    out.append(OutTensor(f"{target}.q_scale", "F32", (n,), (Fill(1.0, n),)))
    out += [
        OutTensor(f"{target}.{p}", dtype, (n,), (Fill(0.0, n),))
        for p in ("k_zero_point", "v_zero_point", "q_zero_point")
    ]
    return out


class KvHeads:
    """One rank's KV heads, as vLLM's QKVParallelLinear places them (replicated when tp > heads)."""

    def __init__(self, total: int, tp: int, rank: int) -> None:
        self.total, self.tp, self.rank = total, tp, rank

    def on_rank(self) -> tuple[int, int]:
        """(KV heads on this rank, the first one)."""
        if self.total >= self.tp:
            n = self.total // self.tp
            return n, self.rank * n
        return 1, self.rank // (self.tp // self.total)
