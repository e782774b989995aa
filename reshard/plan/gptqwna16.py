"""GPTQ experts in vLLM 0.32's fallback layout, `MoeWNA16Method` (quantization/moe_wna16.py).

vLLM builds it instead of Marlin's K-first layout (reshard.plan.gptq) where `check_moe_marlin_supports_layer`
fails: on ROCm, or when the hidden size is not a multiple of 128, the group not one of -1/32/64/128, or
the per-rank intermediate size I_p not a multiple of the group (Qwen3-30B-A3B-GPTQ-Int4 at TP 4 and 8).
Its parameters before post-processing, per rank, for symmetric GPTQ (`create_weights`, `get_weight_loader`):

- `w13_qweight` U8 [E, 2 I_p, H * b / 8], `w2_qweight` U8 [E, H, I_p * b / 8]: each expert's int32 `qweight`
  transposed (`.T.contiguous()`) and viewed as bytes (`.view(torch.uint8)`), gate rows then up rows;
- `w13_scales` [E, 2 I_p, H / G'], `w2_scales` [E, H, I_p / G'] in the model dtype: the scales transposed,
  every group repeated G / G' times (`repeat_interleave`), G' the group halved until it divides I_p and H
  (at least 32);
- no zero points: symmetric GPTQ's `w13_qzeros` / `w2_qzeros` are empty parameters (not in the state).

The transposes are written by the executor (Slice.perm); an output holding them is not read back
(merge and re-shard refuse it, as for gpt-oss's bf16 experts).
"""

from __future__ import annotations

from reshard.errors import UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.geometry import MoeSplit
from reshard.plan.model import OutTensor, Slice


def wna16_group(group: int, ip: int, hidden: int, target: str) -> tuple[int, int]:
    """(G', G / G'): MoeWNA16Method.create_weights halves the group until it divides I_p and H."""
    g, div = group, 1
    while ip % g or hidden % g:
        g, div = g // 2, div * 2
        if g < 32:  # vLLM asserts group_size >= 32
            raise UnsupportedError(
                f"{target}: no group of at least 32 divides the per-rank intermediate size {ip}; vLLM's "
                "MoeWNA16Method fails an assertion for this split",
                "use --ep, or a smaller --tp",
            )
    return g, div


def wna16_rank(
    bits: int, group: int, split: MoeSplit, found: dict[tuple[str, str], list[TensorInfo]], r: int
) -> list[OutTensor]:
    """Rank r's MoeWNA16 expert tensors (`found`: (param, projection) -> every expert's tensor)."""
    kp, b8 = 32 // bits, 8 // bits
    hidden, ip, t = split.hidden, split.ip, split.target
    g2, div = wna16_group(group, ip, hidden, t)
    gate, up, down = split.names
    experts, start = split.experts(r), split.shard(r) * ip
    n = len(experts)
    w13 = tuple(
        Slice(found[("qweight", p)][e].name, (0, start), (hidden // kp, start + ip), perm=(1, 0))
        for e in experts
        for p in (gate, up)
    )
    w2 = tuple(
        Slice(found[("qweight", down)][e].name, (start // kp, 0), ((start + ip) // kp, hidden), perm=(1, 0))
        for e in experts
    )
    up13 = (div, 1)  # each group's row of scales repeated, then transposed
    s13 = tuple(
        Slice(found[("scales", p)][e].name, (0, start), (hidden // g2, start + ip), up=up13, perm=(1, 0))
        for e in experts
        for p in (gate, up)
    )
    s2 = tuple(
        Slice(found[("scales", down)][e].name, (start // g2, 0), ((start + ip) // g2, hidden), up=up13, perm=(1, 0))
        for e in experts
    )
    return [
        OutTensor(f"{t}.w13_qweight", "U8", (n, 2 * ip, hidden // b8), w13),
        OutTensor(f"{t}.w2_qweight", "U8", (n, hidden, ip // b8), w2),
        OutTensor(f"{t}.w13_scales", split.dtype, (n, 2 * ip, hidden // g2), s13),
        OutTensor(f"{t}.w2_scales", split.dtype, (n, hidden, ip // g2), s2),
    ]
