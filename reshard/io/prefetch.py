"""The reader threads: source reads made ahead of their use, in order, into reused buffers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from reshard.checkpoint import Reader
from reshard.format import TensorInfo
from reshard.io.memory import Lease, Memory, Stopped
from reshard.io.reader import AlignedReader

READ_THREADS = 4  # source reads in flight


class ByteRange(Protocol):
    """One read: bytes [start, start + nbytes) of a source tensor."""

    @property
    def info(self) -> TensorInfo: ...
    @property
    def start(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


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
        self.stopped = False
        if self.aligned is not None and self.aligned.threads:  # a reader may want more (HTTP connections)
            threads = self.aligned.threads
        n = max(1, min(threads if self.aligned is not None else 1, len(reads)))
        self.threads = [threading.Thread(target=self._run, name="reshard-reader", daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def get(self) -> tuple[memoryview, Lease]:
        """The next read's bytes, and the lease on their memory (one reference, now the caller's)."""
        with self.cond:
            while self.want not in self.done:
                self.cond.wait()
            item = self.done.pop(self.want)
            self.want += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def _run(self) -> None:
        while True:
            i = -1
            try:
                with self.lock:
                    if self.stopped or self.next >= len(self.reads):
                        return
                    i = self.next
                    self.next += 1
                    r = self.reads[i]
                    info, start, nbytes = r.info, r.start, r.nbytes
                    if self.aligned is not None:
                        prepared = self.aligned.prepare(info, start, nbytes)
                        region, lease = self.mem.alloc(prepared.size)
                    else:
                        region, lease = self.mem.alloc(nbytes)
                try:
                    if self.aligned is not None:
                        view = self.aligned.read_prepared(info, start, nbytes, prepared, region)
                    else:
                        view = self.reader.read(info, start, nbytes, region)
                except BaseException:
                    lease.release()
                    raise
                item: tuple[memoryview, Lease] | BaseException = (view, lease)
            except Stopped:
                return
            except BaseException as e:
                item = e
                with self.lock:
                    self.stopped = True
            if i < 0:  # failed before taking a read: report it as the next one
                with self.cond:
                    i = self.want
            with self.cond:
                self.done[i] = item
                self.cond.notify_all()
            if isinstance(item, BaseException):
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
