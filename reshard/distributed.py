"""Splitting one `save` across processes: torchrun (gloo), or `--ranks` pieces scheduled by the user.

No networking of our own: under torchrun, torch.distributed (gloo) carries the few small messages
(the run id, each process's list of written files, errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

from reshard.errors import UnsupportedError
from reshard.hashing import hash_bytes
from reshard.layout import Layout


class Group:
    """The processes of one torchrun launch."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(hours=12))
        self.dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    @staticmethod
    def from_env() -> Group | None:
        return Group() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None

    def broadcast(self, obj: object) -> object:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Wait for every process, then tear gloo down: exiting with it alive aborts the process."""
        try:
            self.dist.barrier()
        finally:
            self.dist.destroy_process_group()

    def gather(self, obj: object) -> list:
        out: list = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out


def parse_ranks(spec: str | None, world: int) -> list[int] | None:
    """'0-3', '0,2,5-7' -> sorted engine ranks; None means all."""
    if not spec:
        return None
    ranks: set[int] = set()
    try:
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if b else int(a)
            ranks.update(range(lo, hi + 1))
    except ValueError:
        raise UnsupportedError(f"--ranks {spec!r}: expected a list like 0-3 or 0,2,5-7") from None
    bad = sorted(r for r in ranks if not 0 <= r < world)
    if bad or not ranks:
        raise UnsupportedError(f"--ranks {spec!r}: ranks must lie in 0..{world - 1} (tp x pp = {world})")
    return sorted(ranks)


def ranks_tag(ranks: list[int]) -> str:
    """Compact name of a rank set: [0,1,2,3,6] -> '0-3_6'."""
    out, start = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None], strict=True):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return "_".join(out)


def ranks_text(ranks: list[int]) -> str:
    """A rank set for people: [3] -> '3', [0,1,2,3,6] -> '0-3,6' (file names keep `ranks_tag`)."""
    return ranks_tag(ranks).replace("_", ",")


def shared_run_id(source: dict, layout: Layout, source_tensors: dict, version: str) -> str:
    """The same for every piece of one job, wherever it runs: a digest of what is being made."""
    blob = json.dumps([version, source, dataclasses.asdict(layout), source_tensors], sort_keys=True).encode()
    return hash_bytes(blob, "sha256")[:32]  # sha256 whatever the files' checksum: run ids stay stable
