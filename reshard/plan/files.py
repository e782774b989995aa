"""Which file each planned tensor goes to: one rank's tensors, in one order, cut into parts."""

from __future__ import annotations

import re

from reshard.format import ITEMSIZE
from reshard.names import rank_file_name
from reshard.plan.model import OutFile, OutTensor

_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key that orders `layers.2` before `layers.10`."""
    parts: list = _NUM.split(name)  # text, digits, text, ...: the digits at odd places
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)


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


def assign_files(per_rank: dict[tuple[int, int], list[OutTensor]], *, pp: int, max_part_size: int) -> list[OutFile]:
    """Every rank's files, keyed by (pp_rank, tp_rank), in rank order."""
    files = []
    for (pp_rank, tp_rank), tensors in sorted(per_rank.items()):
        # Widest dtypes first keeps every tensor aligned to its element size (as safetensors does);
        # then by name, so that all ranks share one order and sources are read roughly in order.
        ordered = sorted(tensors, key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))
        for part, chunk in enumerate(split_by_size(ordered, max_part_size)):
            name = rank_file_name(tp_rank=tp_rank, pp_rank=pp_rank, part=part, pp=pp)
            files.append(OutFile(name, tp_rank, pp_rank, part, tuple(chunk)))
    return files
