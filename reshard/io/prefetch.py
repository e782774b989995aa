"""The reader threads: source reads made ahead of their use, in order, into reused buffers."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from reshard.checkpoint import Reader
from reshard.format import TensorInfo
from reshard.io.memory import ALIGN, Lease, Memory, Stopped
from reshard.io.reader import AlignedReader, ByteRange, Prepared

READ_THREADS = 4  # source reads in flight
# small reads (an MoE checkpoint's experts: ~200k of a few KB) are taken, made and handed over in runs:
# the locks and wake-ups per read were ~10 us, more than the read itself (issue 28). Not O_DIRECT reads
# (a source not in the page cache): one per thread, so that the disk has several in flight (a run
# of them, made one after the other, lowers the disk's queue depth)
SMALL_READ = 256 * 1024
RUN_READS = 64
RUN_BYTES = 2 * 1024 * 1024


class Prefetcher:
    """Reads `reads` ahead of their use, in order, on `threads` threads, as far as memory allows;
    `get` hands them out in that same order.

    Several reads in flight keep the device busy through the many small reads of MoE checkpoints
    (one per expert and scale tensor). Reads are allocated in order, so the arena stays sequential.
    A reader that is not an `AlignedReader` is read on one thread, into regions of the read's size.
    """

    def __init__(self, reader: Reader, mem: Memory, reads: Sequence[ByteRange], threads: int = READ_THREADS) -> None:
        self.reader = reader
        self.aligned = reader if isinstance(reader, AlignedReader) else None
        self.mem = mem
        self.reads = reads
        self.lock = threading.Lock()  # hands out reads and their memory, in order
        self.cond = threading.Condition()  # results
        self.next = 0
        self.want = 0
        self.done: dict[int, tuple[memoryview, Lease] | BaseException] = {}
        self.ready: deque[tuple[memoryview, Lease] | BaseException] = deque()  # handed over, not yet got
        self.stopped = False
        if self.aligned is not None:
            self.aligned.expect(reads)
        if self.aligned is not None and self.aligned.threads:  # a reader may want more (HTTP connections)
            threads = self.aligned.threads
        n = max(1, min(threads if self.aligned is not None else 1, len(reads)))
        self.threads = [threading.Thread(target=self._run, name="reshard-reader", daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def get(self) -> tuple[memoryview, Lease]:
        """The next read's bytes, and the lease on their memory (one reference, now the caller's)."""
        if not self.ready:
            with self.cond:
                while self.want not in self.done:
                    self.cond.wait()
                while self.want in self.done:  # every read done in order: handed over in one go
                    self.ready.append(self.done.pop(self.want))
                    self.want += 1
        item = self.ready.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _take(self) -> list[tuple[int, TensorInfo, int, int, Prepared | None, memoryview, Lease]]:
        """The next reads to make (under `lock`): one, or a run of small ordinary (not O_DIRECT) ones
        (up to RUN_READS and RUN_BYTES), given regions of one allocation, each with its own reference
        to it."""
        runs: list[tuple[int, TensorInfo, int, int, Prepared | None, int]] = []
        total, limit = 0, min(RUN_BYTES, self.mem.slab // 2)
        while self.next < len(self.reads) and len(runs) < RUN_READS:
            r = self.reads[self.next]
            info, start, nbytes = r.info, r.start, r.nbytes
            if runs and nbytes > SMALL_READ:
                break
            prepared = self.aligned.prepare(info, start, nbytes) if self.aligned is not None else None
            direct = prepared is not None and prepared.fd is not None
            size = prepared.size if prepared is not None else nbytes
            rounded = -(-size // ALIGN) * ALIGN
            if runs and (direct or total + rounded > limit):
                break
            runs.append((self.next, info, start, nbytes, prepared, size))
            self.next += 1
            total += rounded
            if nbytes > SMALL_READ or direct:
                break
        region, lease = self.mem.alloc(total if len(runs) > 1 else runs[0][-1])
        if len(runs) > 1:
            lease.hold(len(runs) - 1)
        taken, off = [], 0
        for i, info, start, nbytes, prepared, size in runs:
            taken.append((i, info, start, nbytes, prepared, region[off : off + size], lease))
            off += -(-size // ALIGN) * ALIGN
        return taken

    def _run(self) -> None:
        while True:
            taken: list = []
            items: list[tuple[int, tuple[memoryview, Lease] | BaseException]] = []
            try:
                with self.lock:
                    if self.stopped or self.next >= len(self.reads):
                        return
                    taken = self._take()
                for k, (i, info, start, nbytes, prepared, region, lease) in enumerate(taken):
                    try:
                        if prepared is not None:
                            view = self.aligned.read_prepared(info, start, nbytes, prepared, region)
                        else:
                            view = self.reader.read(info, start, nbytes, region)
                    except BaseException:
                        for t in taken[k:]:
                            t[-1].release()
                        raise
                    items.append((i, (view, lease)))
            except Stopped:
                return
            except BaseException as e:
                with self.lock:
                    self.stopped = True
                # failed before taking a read: reported as the next one; else as the read it failed at
                i = taken[len(items)][0] if len(items) < len(taken) else -1
                items.append((i, e))
            with self.cond:
                for i, item in items:
                    self.done[i if i >= 0 else self.want] = item
                self.cond.notify_all()
            if items and isinstance(items[-1][1], BaseException):
                return

    def stop(self) -> None:
        """End the threads; what was read but not used is dropped.

        Memory first: a reader waiting for a free slab holds `self.lock` (reads take their memory
        in order under it), so it must be woken (Stopped) before the lock can be had. The other
        order deadlocked a Ctrl-C that came while the read-ahead was waiting for the writers."""
        self.mem.stop()
        with self.lock:
            self.stopped = True
        for t in self.threads:
            t.join()
        with self.lock:
            self.mem.drop_arena()
        with self.cond:
            for item in self.done.values():
                if not isinstance(item, BaseException):
                    item[1].release()
            self.done.clear()
            for item in self.ready:
                if not isinstance(item, BaseException):
                    item[1].release()
            self.ready.clear()
