"""Splitting one `save` across processes: torchrun (gloo), or `--ranks` pieces scheduled by the user.

No networking of our own: under torchrun, torch.distributed (gloo) carries the few small messages
(the run id, each process's list of written files, errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from datetime import timedelta

from reshard.errors import SettingError, UsageError
from reshard.hashing import hash_bytes
from reshard.layout import Layout

# what torchrun sets for each process, and env:// rendezvous reads; WORLD_SIZE over 1 needs them all
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_HINT = (
    "run it as `torchrun --nproc-per-node N -m reshard save ...`, which sets WORLD_SIZE, RANK, MASTER_ADDR "
    "and MASTER_PORT, or unset WORLD_SIZE for one process"
)


class Group:
    """The processes of one torchrun launch."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            _interruptible(lambda: dist.init_process_group("gloo", timeout=timedelta(hours=12)))
        self.dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    @staticmethod
    def from_env() -> Group | None:
        """The torchrun group this process belongs to, or None (WORLD_SIZE unset or 1). A WORLD_SIZE
        that is not a whole number, or over 1 without the rest of torchrun's variables, is a usage
        error (exit 2), not an internal one."""
        return Group() if world_from_env() > 1 else None

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


def world_from_env() -> int:
    """WORLD_SIZE (1 when unset), checked: a whole number >= 1, and over 1 only with RANK (below it),
    MASTER_ADDR and MASTER_PORT (a port) set, as torchrun sets them."""
    env = {  # by name: every environment read is one a reader can find (tests/test_structure.py)
        "WORLD_SIZE": os.environ.get("WORLD_SIZE", "").strip(),
        "RANK": os.environ.get("RANK", "").strip(),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "").strip(),
        "MASTER_PORT": os.environ.get("MASTER_PORT", "").strip(),
    }
    if not env["WORLD_SIZE"]:
        return 1
    try:
        world = int(env["WORLD_SIZE"])
    except ValueError:
        world = 0
    if world < 1:
        raise SettingError(f"WORLD_SIZE={env['WORLD_SIZE']!r} is not a whole number >= 1", _TORCHRUN_HINT)
    if world == 1:
        return 1
    missing = [k for k in TORCHRUN_ENV[1:] if not env[k]]
    if missing:
        names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        raise SettingError(
            f"WORLD_SIZE={world} is set but {names} {'is' if len(missing) == 1 else 'are'} not", _TORCHRUN_HINT
        )
    rank, port = env["RANK"], env["MASTER_PORT"]
    if not rank.isdigit() or int(rank) >= world:
        raise SettingError(f"RANK={rank!r} is not a whole number below WORLD_SIZE={world}", _TORCHRUN_HINT)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingError(f"MASTER_PORT={port!r} is not a port number", _TORCHRUN_HINT)
    return world


def _interruptible(fn: Callable[[], None]) -> None:
    """Run `fn` (the rendezvous: it waits, in C++, for every process of the launch to come) on a
    thread, the main thread waiting in short steps: Ctrl-C and SIGTERM reach their handlers (exit 130)
    while processes are still missing, where a main thread blocked in the rendezvous ignored them."""
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=target, name="reshard-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
    if box:
        raise box[0]


def parse_ranks(spec: str | None, world: int) -> list[int] | None:
    """'0-3', '0,2,5-7' -> sorted engine ranks; None (no --ranks) means all; '' is a usage error, never all."""
    if spec is None:
        return None
    if not spec.strip():
        raise UsageError(
            f"--ranks {spec!r} names no rank", "give a list like 0-3 or 0,2,5-7, or leave --ranks out for all"
        )
    ranks: set[int] = set()
    try:
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if b else int(a)
            if hi < lo:
                raise UsageError(f"--ranks {spec!r}: the range {part.strip()} runs backwards", f"write it {hi}-{lo}")
            ranks.update(range(lo, hi + 1))
    except ValueError:
        raise UsageError(f"--ranks {spec!r}: expected a list like 0-3 or 0,2,5-7") from None
    bad = sorted(r for r in ranks if not 0 <= r < world)
    if bad or not ranks:
        raise UsageError(
            f"--ranks {spec!r}: rank {bad[0] if bad else '?'} is not an engine rank of this layout",
            f"ranks lie in 0..{world - 1}: tp x pp = {world}",
        )
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


def shared_run_id(source: dict, layout: Layout, source_tensors: dict, version: str, max_part_size: int) -> str:
    """The same for every piece of one job, wherever it runs: a digest of what is being made (the part
    size too: pieces split at another one list other files, and could never be assembled)."""
    blob = json.dumps(
        [version, source, dataclasses.asdict(layout), source_tensors, max_part_size], sort_keys=True
    ).encode()
    return hash_bytes(blob, "sha256")[:32]  # sha256 whatever the files' checksum: run ids stay stable
