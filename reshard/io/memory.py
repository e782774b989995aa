"""The executor's memory: reused page-aligned chunk buffers (slabs) and a byte budget for fresh arrays.

Memory is bounded by `max_memory`: a fixed set of reused chunk buffers (one comes back once every
writer is done with the views into it) plus a byte budget for the rare pieces that are fresh
arrays (dtype casts, up-sampled scales, fills). Each open output file adds its two staging buffers
on top (`reshard.io.writer`). Readers wait for buffers, the main thread for budget; writers never
wait on memory, so all waits end.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

from reshard.io.direct import ALIGN as ALIGN  # O_DIRECT's alignment (the executor's modules take it from here)
from reshard.io.direct import populate

DEFAULT_MAX_MEMORY = 512 * 1024 * 1024
MIN_SLAB = 1024 * 1024


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm), or 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def metadata_budget(max_memory: int, rss_base: int | None) -> int:
    """What is left of `max_memory` for tensor data once the checkpoint's metadata is resident
    (issue 28): the process's growth since `rss_base` (headers, plan, schedule: a 200k-tensor MoE's
    are a few hundred MB) is taken out of it, down to a quarter of it (the executor needs a few
    chunks to move at all; past that the bound is exceeded by the metadata alone)."""
    if rss_base is None or rss_base <= 0:
        return max_memory
    grown = max(0, resident_bytes() - rss_base)
    return max(max_memory // 4, max_memory - grown)


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned private memory (as O_DIRECT needs), faulted in at once: page by page costs
    ~2x more, and buffers are reused, so they are touched in full anyway. Faulted in with the GIL
    released where Linux can (madvise MADV_POPULATE_WRITE, 5.14+): mmap(2) with MAP_POPULATE holds
    it, and the reader threads making the first buffers of a save (~0.4 GB of them) starved the
    thread that hands their bytes on for ~0.4 s on this project's VM."""
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    try:
        m = mmap.mmap(-1, size, flags=private)
    except (OSError, TypeError, ValueError):
        return mmap.mmap(-1, size)
    if populate(m):
        return m
    m.close()
    try:
        return mmap.mmap(-1, size, flags=private | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, TypeError, ValueError):
        return mmap.mmap(-1, size)


class Stopped(Exception):
    """The run is being torn down: a thread waiting for memory gives up."""


class Lease:
    """A counted claim on memory: given back to the budget when its last holder releases it."""

    __slots__ = ("mem", "refs")

    mem: Memory
    refs: int

    def hold(self, n: int = 1) -> None:
        with self.mem.cond:
            self.refs += n

    def short(self) -> bool:
        """Does a thread wait for memory now? (A holder should then let go soon.)"""
        return self.mem.waiting > 0

    def release(self, n: int = 1) -> None:
        with self.mem.cond:
            self.refs -= n
            if self.refs == 0:
                self._give_back()
                self.mem.cond.notify_all()

    def _give_back(self) -> None:
        raise NotImplementedError


class Slab(Lease):
    """A reused page-aligned buffer; free again once every holder of a view into it let go."""

    __slots__ = ("buf",)

    def __init__(self, mem: Memory, size: int) -> None:
        self.mem = mem
        self.buf = aligned_buffer(size)
        self.refs = 0

    def _give_back(self) -> None:
        self.mem.free.append(self)


class Reused(Slab):
    """A buffer the main thread fills again and again (the executor's batch buffers, reshard.batch),
    its views written by the writers: free again once every holder let go."""

    __slots__ = ()

    def _give_back(self) -> None:
        self.mem.reused.append(self)


class Fresh(Lease):
    """The budget share of one fresh array, given back when its last holder is done with it."""

    __slots__ = ("nbytes",)

    def __init__(self, mem: Memory, nbytes: int) -> None:
        self.mem = mem
        self.nbytes = nbytes
        self.refs = 1

    def _give_back(self) -> None:
        self.mem.fresh -= self.nbytes


class Memory:
    """`count` slabs of `slab` bytes handed out as an arena (by the reader threads, one at a time),
    and a budget of `fresh_limit` bytes for fresh arrays (main thread and readers).

    Only writers free memory and they never wait for any, so every wait here ends; an oversized
    request waits only until nothing fresh is in flight.
    """

    def __init__(self, max_memory: int, chunk_bytes: int) -> None:
        self.slab = -(-max(chunk_bytes, MIN_SLAB) // ALIGN) * ALIGN + 2 * ALIGN  # + room to align reads
        self.fresh_limit = max(self.slab, max_memory // 4)
        self.count = max(2, (max_memory - self.fresh_limit) // self.slab)
        self.cond = threading.Condition()
        self.free: list[Slab] = []
        self.made = 0
        self.reused: list[Reused] = []  # free batch buffers (`take_reused`)
        self.reused_made = 0
        self.fresh = 0
        self.stopped = False
        self.cur: Slab | None = None  # the arena's slab; the allocating thread holds one reference
        self.off = 0
        # called (under the lock; it must not block) when a thread starts waiting for memory: the
        # writers then write out the pieces they hold, whose leases they give back once written;
        # while one waits (`waiting`), an idle writer holds nothing (Lease.short)
        self.on_short: Callable[[], None] = lambda: None
        self.waiting = 0

    def alloc(self, nbytes: int) -> tuple[memoryview, Lease]:
        """A page-aligned region; its holder owns one reference to the returned lease."""
        if nbytes > self.slab:
            fresh = self.account(nbytes)
            return memoryview(aligned_buffer(nbytes)), fresh
        if self.cur is None or self.off + nbytes > self.slab:
            if self.cur is not None:
                self.cur.release()
                self.cur = None
            self.cur = self._take()
            self.cur.refs = 1
            self.off = 0
        start = self.off
        self.off += -(-nbytes // ALIGN) * ALIGN
        self.cur.hold()
        return memoryview(self.cur.buf)[start : start + nbytes], self.cur

    def _take(self) -> Slab:
        with self.cond:
            if not self.free and self.made >= self.count:
                self._wait_for(lambda: bool(self.free) or self.made < self.count)
            if self.free:
                return self.free.pop()
            self.made += 1
        return Slab(self, self.slab)

    def account(self, nbytes: int) -> Fresh:
        """Count a fresh array against the budget, first waiting for writers to free some if needed."""
        nbytes = max(nbytes, 256)  # a queued write costs something even when tiny
        with self.cond:
            if self.fresh and self.fresh + nbytes > self.fresh_limit:
                self._wait_for(lambda: not self.fresh or self.fresh + nbytes <= self.fresh_limit)
            self.fresh += nbytes
        return Fresh(self, nbytes)

    def reserve(self, nbytes: int) -> int:
        """Set aside up to a quarter of the fresh budget for a buffer held across many accounts (the
        executor's batch buffer, reshard.batch): the budget shrinks by what is returned, so that
        holding it never makes `account` wait for itself."""
        nbytes = min(nbytes, self.fresh_limit // 4)
        with self.cond:
            self.fresh_limit -= nbytes
        return nbytes

    def take_reused(self, size: int, count: int) -> Reused:
        """One of `count` buffers of `size` bytes (made when first needed; their bytes set aside with
        `reserve`), once one is free; its holder owns one reference. Writers free them, and never wait."""
        with self.cond:
            if not self.reused and self.reused_made >= count:
                self._wait_for(lambda: bool(self.reused))
            got = self.reused.pop() if self.reused else None
            if got is None:
                self.reused_made += 1
        if got is None:
            got = Reused(self, size)
        got.refs = 1
        return got

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Wait (holding `cond`) until `ready()`, having asked the writers for what they hold."""
        self.waiting += 1
        try:
            self.on_short()
            while not ready():
                if self.stopped:
                    raise Stopped
                self.cond.wait()
        finally:
            self.waiting -= 1

    def drop_arena(self) -> None:
        """Give back the arena's own reference to its current slab (allocating threads stopped)."""
        if self.cur is not None:
            self.cur.release()
            self.cur = None

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def close(self) -> None:
        self.drop_arena()
        self.free.clear()
        self.reused.clear()
