"""The writer threads: one per open output file, feeding its sink in submission order.

Each gets *views* of source rows (strided column slices included) and gathers them into its sink;
file I/O, numpy copies and hashlib release the GIL, so the writers use every core. Writers free
memory (releasing the leases of what they wrote) and never wait for any.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import TYPE_CHECKING

import numpy as np

from reshard.errors import SourceError
from reshard.io import writer
from reshard.io.memory import Lease
from reshard.io.writer import Sink, Written

if TYPE_CHECKING:
    from reshard.plan import OutTensor

_BEGIN, _WRITE, _CLOSE, _ABORT, _FLUSH = range(5)


class Worker:
    """Feeds one sink from its own thread, in submission order."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.aborting = False
        self.result: Written | None = None
        self.tensor: OutTensor | None = None  # the tensor being written, and the bytes it got so far
        self.got = 0
        self.thread = threading.Thread(target=self._run, name="reshard-writer", daemon=True)
        self.thread.start()

    # main thread
    def begin(self, tensor: OutTensor) -> None:
        self._check()
        self.q.put((_BEGIN, tensor, None))

    def write(self, data: np.ndarray | bytes, lease: Lease) -> None:
        """Queue `data`; `lease` (one reference, owned by the caller) is released once written."""
        if self.error is not None:
            lease.release()
            self._check()
        self.q.put((_WRITE, data, lease))

    def flush_held(self) -> None:
        """From any thread: have the sink write what it holds (memory is short: free it soon)."""
        self.q.put((_FLUSH, None, None))

    def close(self, sync: bool) -> None:
        self._check()
        self.q.put((_CLOSE, sync, None))

    def abort(self) -> None:
        self.aborting = True  # queued writes are dropped, not written
        self.q.put((_ABORT, None, None))

    def join(self) -> Written:
        self.thread.join()
        self._check()
        assert self.result is not None
        return self.result

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    # writer thread
    def _run(self) -> None:
        while True:
            if self.q.empty():
                self._flush_held(if_short=True)  # idle next: what it holds must not keep a thread waiting
            op, arg, lease = self.q.get()
            if op == _WRITE:
                try:
                    if self.error is None and not self.aborting:
                        self._write(arg, lease)
                except BaseException as e:
                    self._fail(e)
                finally:
                    del arg
                    lease.release()
            elif op == _BEGIN:
                if self.error is None:
                    try:
                        self._tensor_done()
                        self.tensor, self.got = arg, 0
                        self.sink.begin(arg)
                    except BaseException as e:
                        self._fail(e)
            elif op == _FLUSH:
                self._flush_held(if_short=False)
            elif op == _CLOSE:
                if self.error is None and not self.aborting:
                    try:
                        self._tensor_done()
                        self.result = self.sink.close(arg)
                    except BaseException as e:
                        self._fail(e)
                if self.result is None:
                    with contextlib.suppress(Exception):
                        self.sink.abort()
                return
            else:
                with contextlib.suppress(Exception):
                    self.sink.abort()
                return

    def _flush_held(self, if_short: bool) -> None:
        if self.error is None and not self.aborting:
            try:
                self.sink.flush_held(if_short=if_short)
            except BaseException as e:
                self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """Record the sink's first error, and give back the memory it holds: the file will be
        aborted, and a held piece's lease (a read buffer, a batch buffer) must not keep the main
        thread or a reader waiting for memory that would never come back (a hang on a full disk)."""
        self.error = e
        with contextlib.suppress(Exception):
            self.sink.drop_held()

    def _tensor_done(self) -> None:
        """Every tensor must get exactly the bytes its header declares, or the file is unreadable."""
        t = self.tensor
        if t is not None and self.got != t.nbytes:
            raise SourceError(
                f"{t.name}: its pieces gave {self.got} bytes, its header declares {t.nbytes} "
                f"({t.dtype} {list(t.shape)}): a source tensor's shape disagrees with its neighbours'",
                "check the source checkpoint's headers (a damaged or hand-edited file?)",
            )
        self.tensor = None

    def _write(self, data: np.ndarray | bytes, lease: Lease) -> None:
        self.got += len(data) if isinstance(data, bytes) else data.nbytes
        if isinstance(data, bytes):
            self.sink.write(data)
        elif data.flags.c_contiguous:  # the sink may keep the lease's memory instead of copying it
            self.sink.write_held(memoryview(data).cast("B"), lease)
        elif data.ndim > 1 and data[0].nbytes >= writer.HELD_MIN and data[0].flags.c_contiguous:
            # blocks of rows, each contiguous (a rank's rows of each expert in a batch buffer): each
            # may be held or go through like a contiguous piece (no copy), else staged as before
            for block in data:
                self.sink.write_held(memoryview(block).cast("B"), lease)
        else:  # a strided slice: the sink gathers it (FileWriter into its stage; others by row blocks)
            self.sink.write_array(data)
