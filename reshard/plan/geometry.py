"""Sizes the split rules work with: the model's dimensions and how one layer cuts across ranks.

Plain values shared by the slicers and the quantization strategies, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from reshard.errors import UnsupportedError
from reshard.format import TensorInfo


class Sources(Protocol):
    """The checkpoint as the split rules see it (the planner's context implements it)."""

    def src(self, name: str, why: str) -> TensorInfo:
        """The source tensor `name`, marked used; SourceError naming `why` when it is missing."""
        ...

    def src_each(self, names: list[str]) -> list[TensorInfo] | None:
        """`src` of every name at once, or None (then `src` them one by one: its errors)."""
        ...

    def mark_used(self, name: str) -> None:
        """A source tensor vLLM reads and drops: not an unexpected one."""
        ...

    def note(self, text: str) -> None:
        """Tell the user something about the plan (once per text)."""
        ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def refuse_tp_above_experts(tp: int, num: int) -> None:
    """For MoE blocks vLLM builds only with at most as many TP ranks as experts (a rule's tp_at_most_experts)."""
    if tp > num:
        raise UnsupportedError(f"--tp {tp} is greater than the number of experts {num}; vLLM refuses this")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def ep_experts(num: int, ranks: int, r: int) -> range:
    """The experts rank r of `ranks` holds under expert parallelism: vLLM's linear placement
    (expert_map_manager.determine_expert_map), consecutive experts, the remainder one each to the
    first ranks. gpt-oss's own loader (E // ranks each) is the same where `ranks` divides `num`."""
    base, rem = divmod(num, ranks)
    start = r * base + min(r, rem)
    return range(start, start + base + (r < rem))


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


@dataclass(frozen=True)
class LinearRank:
    """One linear module's weight on one rank.

    Attributes:
        target: the vLLM module path.
        slots: HF prefixes of its slots (one for a fused HF tensor).
        fused: the slot names when the HF checkpoint stores them stacked in one tensor, else ().
        outs / offs: per slot, its global row count and its first row in its HF tensor.
        rows: per slot, this rank's rows [start, stop) of the slot and the shard index they are.
        in_size: the weight's global input size; cols: this rank's input columns [start, stop).
        splits_rows / splits_cols: tensor parallelism cuts the output rows (column-parallel
            styles) or the input columns (row-parallel), with more than one rank.
        dtype: the model dtype (vLLM's params_dtype, that of integer formats' group scales).
    """

    target: str
    slots: tuple[str, ...]
    fused: tuple[str, ...]
    outs: tuple[int, ...]
    offs: tuple[int, ...]
    rows: tuple[tuple[int, int, int], ...]
    in_size: int
    cols: tuple[int, int]
    splits_rows: bool
    splits_cols: bool
    dtype: str = "BF16"

    def per_slot(self, sources: Sources, param: str) -> list[TensorInfo]:
        """Per slot, the HF tensor `param` (a fused weight has one for every slot)."""
        if self.fused:
            return [sources.src(f"{self.slots[0]}.{param}", self.target)] * len(self.outs)
        return [sources.src(f"{s}.{param}", self.target) for s in self.slots]


@dataclass(frozen=True)
class MoeSplit:
    """How one MoE layer's routed experts cut across ranks: by TP (slices of every expert) or EP."""

    target: str
    base: str  # HF prefix of the experts list: `{base}.{e}.{gate|up|down}.{param}`
    names: tuple[str, str, str]  # HF names of gate, up and down under each expert
    num: int  # experts
    inter: int  # the experts' intermediate size
    hidden: int
    tp: int
    ep: bool
    alloc: int = 0  # per-rank intermediate size vLLM allocates, when a backend pads it (backends.py)
    blocked: bool = False  # FP8 block padding: rank r holds [r * alloc, (r + 1) * alloc) of `inter`
    dtype: str = "BF16"  # the model dtype (vLLM's params_dtype)
    global_scales: bool = False  # ModelOpt NVFP4 + FlashInfer under EP: input scales of every expert on each rank

    def tensor(self, sources: Sources, e: int, proj: str, param: str) -> TensorInfo:
        return sources.src(f"{self.base}.{e}.{proj}.{param}", f"{self.target} (expert {e})")

    def tensors(self, sources: Sources, projs: tuple[str, ...], param: str) -> list[tuple[TensorInfo, ...]] | None:
        """Per expert, its `param` tensor of each of `projs`, looked up in bulk; None where the sources
        cannot (one is missing: the caller's `tensor` by `tensor` loop says which, as before)."""
        found = []
        for proj in projs:
            got = sources.src_each([f"{self.base}.{e}.{proj}.{param}" for e in range(self.num)])
            if got is None:
                return None
            found.append(got)
        return list(zip(*found, strict=True))

    @property
    def moe_tp(self) -> int:
        return 1 if self.ep else self.tp

    @property
    def ip(self) -> int:
        """Intermediate size per rank."""
        return self.inter // self.moe_tp

    @property
    def width(self) -> int:
        """The per-rank intermediate size of the parameters (ip, or what a backend pads it to)."""
        return self.alloc or self.ip

    def real(self, r: int) -> tuple[int, int]:
        """Rank r's first row of the unsharded intermediate dim and how many it holds (<= width)."""
        if self.blocked:
            start = min(r * self.width, self.inter)
            return start, min(self.width, self.inter - start)
        return self.shard(r) * self.ip, self.ip

    def shard(self, r: int) -> int:
        """Which of the moe_tp slices of every expert rank r holds."""
        return 0 if self.ep else r

    def experts(self, r: int) -> range:
        """Rank r's experts: all of them under TP, its share under EP (`ep_experts`)."""
        return ep_experts(self.num, self.tp, r) if self.ep else range(self.num)
