"""FP8 block scales of an MoE layer's experts: sliced with the weights, refined or padded as vLLM does.

vLLM 0.32's `Fp8MoEMethod` adapts the checkpoint's block grid to the TP split
(`fused_moe/oracle/fp8.py:resolve_fp8_moe_weight_block_shape`): a per-rank intermediate size that
cuts a block is served by refining the scale grid (every scale up-sampled to f x f blocks), or, with
a backend that only takes whole blocks, by padding the shard (reshard.plan.backends): scale rows and
columns past a rank's real size are 1.0 (`destination.fill_(1)` in the experts' weight loader).
"""

from __future__ import annotations

from collections.abc import Callable

from reshard import VLLM_LAYOUT
from reshard.errors import UnsupportedError
from reshard.format import TensorInfo
from reshard.plan.backends import refined_block
from reshard.plan.geometry import MoeSplit, Sources, cdiv
from reshard.plan.model import OutTensor, padded_cols, padded_rows, slices

# per rank: the scale tensors of an MoE layer's experts on that rank
RankScales = Callable[[int], list[OutTensor]]


def moe_block(
    block: tuple[int, int], refines: bool, sources: Sources, split: MoeSplit
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The FP8 block grid of the MoE scales and the up-sampling factors (oracle/fp8.py)."""
    bn, bk = block
    ip = split.ip
    if split.blocked:
        return (bn, bk), (1, 1)
    f = refined_block(block, ip, split.moe_tp, split.hidden)
    if ip % bn == 0 and (split.moe_tp == 1 or ip % bk == 0):
        return (bn, bk), (1, 1)
    if f is not None and refines:
        sources.note(
            f"FP8 MoE block scales refined from [{bn}, {bk}] to [{f}, {f}] for the per-rank "
            f"intermediate size {ip}, as vLLM {VLLM_LAYOUT} does"
        )
        return (f, f), (bn // f, bk // f)
    what = "output_size of gate's and up's weight" if ip % bn else "input_size of down's weight"
    raise UnsupportedError(
        f"{split.target}: {what} = {ip} per rank is not divisible by the FP8 block {bn}, and no finer block >= 32 fits",
        "use --ep, or a smaller --tp; or, for `quant_method: fp8`, an explicit --moe-backend such as "
        "deep_gemm, with which vLLM pads the shard to whole blocks",
    )


def block_expert_scales(
    block: tuple[int, int], refines: bool, scale_name: str, sources: Sources, split: MoeSplit
) -> RankScales:
    """Looks up and checks every expert's block scales once; returns a rank's scale tensors by rank."""
    (bn, bk), upf = moe_block(block, refines, sources, split)
    up = upf if upf != (1, 1) else None
    width = split.width
    nr13, nc13 = cdiv(width, bn), cdiv(split.hidden, bk)
    nr2, nc2 = cdiv(split.hidden, bn), cdiv(width, bk)
    g13 = (cdiv(split.inter, bn), nc13)  # the checkpoint's grids
    g2 = (nr2, cdiv(split.inter, bk))
    gate, up_proj, down = split.names
    s13: list[tuple[TensorInfo, TensorInfo]] = []
    s2: list[TensorInfo] = []
    for e in range(split.num):
        pair = (split.tensor(sources, e, gate, scale_name), split.tensor(sources, e, up_proj, scale_name))
        s = split.tensor(sources, e, down, scale_name)
        if split.blocked:
            bad = [t for t, g in ((pair[0], g13), (pair[1], g13), (s, g2)) if t.shape != g]
        else:
            bad = [t for t in pair if (t.shape[0] * upf[0]) // split.moe_tp != nr13 or t.shape[1] * upf[1] != nc13]
            if (s.shape[1] * upf[1]) // split.moe_tp != nc2 or s.shape[0] * upf[0] != nr2:
                bad.append(s)
        if bad:
            raise UnsupportedError(f"{bad[0].name}: FP8 block scales do not tile this split")
        s13.append(pair)
        s2.append(s)

    def rank(r: int) -> list[OutTensor]:
        experts = split.experts(r)
        start, size = split.real(r)
        if split.blocked:  # whole blocks: start and size are multiples of the block
            r13, n13 = start // bn, size // bn
            c2, n2 = start // bk, size // bk
            p13 = tuple(p for e in experts for s in s13[e] for p in padded_rows(s.name, r13, n13, nr13, nc13, 1.0))
            p2 = tuple(padded_cols(s2[e].name, nr2, c2, n2, nc2, 1.0) for e in experts)
        else:
            r13, c2 = nr13 * split.shard(r), nc2 * split.shard(r)
            b13 = ((r13, 0), (r13 + nr13, nc13))  # bounds shared by every expert
            b2 = ((0, c2), (nr2, c2 + nc2))
            p13 = tuple(slices([s.name for e in experts for s in s13[e]], *b13, up))  # in bulk (issue 28)
            p2 = tuple(slices([s2[e].name for e in experts], *b2, up))
        n = len(experts)
        return [
            OutTensor(f"{split.target}.w13_{scale_name}", "F32", (n, 2 * nr13, nc13), p13),
            OutTensor(f"{split.target}.w2_{scale_name}", "F32", (n, nr2, nc2), p2),
        ]

    return rank
