"""Neighbouring small tensors of a Hub file fetched by one range request, shared by their reads.

An MoE checkpoint has tens of thousands of tensors of a few KB (FP8 block scales: Qwen3-235B-A22B-FP8
has ~36k of 1.5 KB); one request each would make the download latency-bound. safetensors files keep
tensors of one dtype together, so the small ones lie side by side: runs of tensors smaller than
RESHARD_HUB_SMALL (1 MiB), contiguous in their file, are cut into groups of at most GROUP bytes, and
the first read of a group's tensor fetches the whole group. Fetched groups stay in memory (at most KEEP bytes, least
recently used dropped first, on top of --max-memory) for the reads of the other tensors in them.

A group dropped and read again is fetched again, and not hashed again: the file's hash has moved on
(reshard.sources.prefixhash). Where groups can be dropped (more than KEEP bytes of them), the BLAKE3
digest of each group's first fetch is kept, and a fetch again must match it (else exit 4): the bytes
used are the bytes hashed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from reshard import settings
from reshard.format import TensorInfo
from reshard.sources.prefixhash import changed, digest

GROUP = 4 << 20
KEEP = 64 << 20

Key = tuple[str, int, int]  # file, start, end


class Groups:
    def __init__(self, tensors: dict[str, TensorInfo], where: Callable[[str], str] = str) -> None:
        self.of: dict[str, Key] = {}
        small_below = settings.HUB_SMALL.get()  # 0: every read its own request
        by_file: dict[str, list[TensorInfo]] = {}
        for t in tensors.values():
            by_file.setdefault(t.file, []).append(t)
        for file, ts in by_file.items():
            run: list[TensorInfo] = []
            for t in [*sorted(ts, key=lambda t: t.offset), None]:
                small = t is not None and t.nbytes < small_below
                fits = small and run and t.offset == run[-1].offset + run[-1].nbytes
                if fits and t.offset + t.nbytes - run[0].offset <= GROUP:  # type: ignore[union-attr]
                    run.append(t)  # type: ignore[arg-type]
                    continue
                if len(run) > 1:
                    key = (file, run[0].offset, run[-1].offset + run[-1].nbytes)
                    self.of.update((r.name, key) for r in run)
                run = [t] if small else []  # type: ignore[list-item]
        self.where = where  # a file's name in messages
        self.drops = sum(b - a for _, a, b in set(self.of.values())) > KEEP  # whether a group can be dropped
        self.digests: dict[Key, bytes] = {}  # each group's first fetch, where `drops`
        self.lock = threading.Lock()
        self.kept: OrderedDict[Key, bytearray] = OrderedDict()
        self.size = 0
        self.pending: dict[Key, threading.Event] = {}

    def get(self, key: Key, fill: Callable[[memoryview, bool], None]) -> bytearray:
        """The group's bytes: kept, being fetched by another thread (waited for), or fetched here by
        `fill(out, again)` (`again`: fetched before, and dropped)."""
        while True:
            with self.lock:
                if key in self.kept:
                    self.kept.move_to_end(key)
                    return self.kept[key]
                event = self.pending.get(key)
                if event is None:
                    event = self.pending[key] = threading.Event()
                    break
            event.wait()  # the other thread's fetch; if it failed, try again here
        data = None
        try:
            buf = bytearray(key[2] - key[1])
            first = self.digests.get(key)
            fill(memoryview(buf), first is not None)
            if self.drops:
                got = digest(buf)
                if first is not None and got != first:
                    raise changed(self.where(key[0]), key[1], key[2])
                self.digests[key] = got
            data = buf
            return data
        finally:
            with self.lock:
                del self.pending[key]
                if data is not None:
                    self.kept[key] = data
                    self.size += len(data)
                    while self.size > KEEP and len(self.kept) > 1:
                        self.size -= len(self.kept.popitem(last=False)[1])
                event.set()
