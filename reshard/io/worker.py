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
from reshard.io.memory import Lease
from reshard.io.writer import STAGE_BYTES, GatheringSink, Sink, Written

if TYPE_CHECKING:
    from reshard.plan import OutTensor

_BEGIN, _WRITE, _CLOSE, _ABORT, _FLUSH = range(5)


class Worker:
    """Feeds one sink from its own thread, in submission order."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.gather = sink.write_array if isinstance(sink, GatheringSink) else None
        self.hold = getattr(sink, "write_held", None)  # a FileWriter: may hold aligned pieces (no copy)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.aborting = False
        self.result: Written | None = None
        self.stage: np.ndarray | None = None
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
        if self.hold is not None:
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
            if self.hold is not None and self.q.empty():
                self._flush_held(if_short=True)  # idle next: what it holds must not keep a thread waiting
            op, arg, lease = self.q.get()
            if op == _WRITE:
                try:
                    if self.error is None and not self.aborting:
                        self._write(arg, lease)
                except BaseException as e:
                    self.error = e
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
                        self.error = e
            elif op == _FLUSH:
                self._flush_held(if_short=False)
            elif op == _CLOSE:
                if self.error is None and not self.aborting:
                    try:
                        self._tensor_done()
                        self.result = self.sink.close(arg)
                    except BaseException as e:
                        self.error = e
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
                self.sink.flush_held(if_short=if_short)  # type: ignore[attr-defined]
            except BaseException as e:
                self.error = e

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
        elif data.flags.c_contiguous:
            if self.hold is not None:  # the sink may keep the lease's memory instead of copying it
                self.hold(memoryview(data).cast("B"), lease)
            else:
                self.sink.write(memoryview(data).cast("B"))
        elif self.gather is not None:
            self.gather(data)
        else:  # a strided slice for a sink that takes bytes only: gather row blocks here
            row = data[0].nbytes
            step = max(1, STAGE_BYTES // row)
            if self.stage is None or self.stage.nbytes < min(step, data.shape[0]) * row:
                self.stage = np.empty(max(STAGE_BYTES, row), np.uint8)
            for r0 in range(0, data.shape[0], step):
                part = data[r0 : r0 + step]
                dst = self.stage[: part.nbytes].reshape(part.shape)
                np.copyto(dst, part)
                self.sink.write(memoryview(dst).cast("B"))
