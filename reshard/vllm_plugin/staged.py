"""Rank files whose parameters the reads cannot land in (GPU memory), read through host buffers.

Such a file is read as a CPU one is (`reshard.vllm_plugin.striped`): in chunks dealt to several
streams, each with its own descriptor (from a bucket: one ranged GET of a contiguous stripe each),
and hashed in file order by a thread of its own. Each stream reads a chunk into one of its `DEPTH`
host buffers (page-aligned, so a cold file is read with O_DIRECT straight into them; page-locked
by torch where the parameters are on a CUDA device, so that the copies to the device run on the
stream's own CUDA stream while it reads the next chunk into its other buffer), starts the chunk's
copies into the parameters, and hands the buffer to the hash thread. A buffer is read into again
only once its chunk is hashed and its copies are done; the copies are all done when the file's
streams end, and a failed file's buffers are unmapped only once its hash thread has stopped.

Memory: `DEPTH` x `SLOT` bytes per stream at work (`threads` of them at most), whatever the sizes.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import threading
from typing import Any

import torch

import reshard.io.direct as direct
from reshard.format import open_regular
from reshard.io.direct import ALIGN
from reshard.vllm_plugin.striped import Count, FileRead, byte_view, read_exact

SLOT = 16 * 1024 * 1024  # a chunk: read, copied and hashed as one (a multiple of ALIGN)
DEPTH = 2  # host buffers per stream: one being read into while the other's chunk is copied and hashed


class _Slot:
    """One host buffer of a stream, and what must end before it is read into again."""

    def __init__(self, size: int, cuda: torch.device | None) -> None:
        self.mem = None
        if cuda is not None:  # page-locked (torch's own host allocator): the copies run asynchronously
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self.tensor.numpy())  # keeps the tensor's memory while a slice of it lives
        else:
            self.mem = direct.buffer(size)
            self.tensor = torch.frombuffer(self.mem, dtype=torch.uint8)  # (holds no export of the mapping)
            self.view = memoryview(self.mem)  # an export: the mapping cannot be closed while a slice lives
        self.aligned = self.tensor.data_ptr() % ALIGN == 0  # O_DIRECT reads may land in it
        self.free = threading.Event()  # its last chunk is hashed (or needs no hash)
        self.free.set()
        self.copied: Any = None  # a CUDA event recorded after its last chunk's copies

    def wait(self) -> None:
        self.free.wait()
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a failed file's hash thread may still hold a view
            self.view.release()
            if self.mem is not None:
                self.mem.close()


class Staged(FileRead):
    """A file read into parameters through host buffers (see `FileRead`; the module docstring).
    `targets`: the file's parameters by name, each contiguous and of its recorded shape (any
    device); O_DIRECT when `o_direct` (straight into the buffers)."""

    @staticmethod
    def chunk_size() -> int:
        return SLOT

    def place(self, targets: dict[str, torch.Tensor]) -> None:
        # where the file's bytes go: (file offset, flat byte view of the parameter); the header nowhere
        self.segments = [(t.offset, byte_view(targets[t.name])) for t in self.rf.tensors if t.nbytes]
        self.starts = [off for off, _ in self.segments]  # in file order
        cuda = [d for _, d in self.segments if d.device.type == "cuda"]
        self.cuda = cuda[0].device if cuda else None
        # the caller's (the engine's) stream: the copies start after what it has queued on the parameters
        self.after = torch.cuda.current_stream(self.cuda) if self.cuda is not None else None
        self.filled: dict[int, tuple[_Slot, int]] = {}  # chunk -> its buffer and length, until hashed
        self.slots: list[_Slot] = []  # every stream's, while it reads (woken on a failure)
        self.lock = threading.Lock()

    def read_stripe(self, j: int, count: Count) -> None:
        slots = [_Slot(self.chunk, self.cuda) for _ in range(DEPTH)]
        with self.lock:
            self.slots += slots
        stream = None
        if self.cuda is not None:
            stream = torch.cuda.Stream(device=self.cuda)
            stream.wait_stream(self.after)
        try:
            if self.source is not None:
                self._stream_stripe(j, slots, stream, count)
            else:
                self._read_chunks(j, slots, stream, count)
            for s in slots:  # hashed, and copied to the device, before the buffers go
                s.wait()
        except BaseException:
            self.fail()
            raise
        finally:
            with self.lock:
                for s in slots:
                    self.slots.remove(s)
            if self.failed and self.hash_thread is not None:
                # a failed file's buffers were freed without being hashed: the hash thread may be
                # hashing one of them still (it stops before its next chunk)
                self.hash_thread.join()
            for s in slots:
                if s.copied is not None:  # a failed read: no copy may still read from a freed buffer
                    with contextlib.suppress(Exception):
                        s.copied.synchronize()
                s.close()

    def _read_chunks(self, j: int, slots: list[_Slot], stream: Any, count: Count) -> None:
        fd = open_regular(self.rf.path, follow=False)  # what check_files checked, not a link put there since
        try:
            o_direct = self.o_direct and all(s.aligned for s in slots) and direct.enable(fd)
            if not o_direct:
                with contextlib.suppress(AttributeError, OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for k, c in enumerate(range(j, self.chunks, self.streams)):
                slot = slots[k % DEPTH]
                if not self._take(slot):
                    return
                pos, n = c * self.chunk, min(self.chunk, self.rf.size - c * self.chunk)
                if o_direct:
                    try:
                        _read(fd, slot.view[: -(-n // ALIGN) * ALIGN], pos, n, self.rf.path.name)
                        self.direct_chunks[j] += 1
                    except OSError as e:  # O_DIRECT refused here after all: read through the cache
                        if e.errno != errno.EINVAL:
                            raise
                        direct.disable(fd)
                        o_direct = False
                if not o_direct:
                    _read(fd, slot.view[:n], pos, n, self.rf.path.name)
                count(n)
                self._hand_on(c, slot, n, stream)
        finally:
            os.close(fd)

    def _stream_stripe(self, j: int, slots: list[_Slot], stream: Any, count: Count) -> None:
        assert self.source is not None
        first, end = self.bounds[j], self.bounds[j + 1]
        with self.source.open(self.rf, first * self.chunk, min(self.rf.size, end * self.chunk)) as f:
            for k, c in enumerate(range(first, end)):
                slot = slots[k % DEPTH]
                if not self._take(slot):
                    return
                n = min(self.chunk, self.rf.size - c * self.chunk)
                read_exact(f, slot.view[:n], None, count)
                self._hand_on(c, slot, n, stream)

    def _take(self, slot: _Slot) -> bool:
        """Wait for `slot` to be free again; False when the file failed meanwhile."""
        slot.wait()
        if self.failed:
            return False
        slot.free.clear()
        return True

    def _hand_on(self, c: int, slot: _Slot, n: int, stream: Any) -> None:
        """Start chunk c's copies from `slot` (its first n bytes) into the parameters, and hand the
        slot to the hash thread (or free it at once)."""
        a, b = c * self.chunk, c * self.chunk + n
        for i in range(max(0, bisect.bisect_right(self.starts, a) - 1), len(self.segments)):
            off, dest = self.segments[i]
            if off >= b:
                break
            end = off + dest.numel()
            if end <= a:
                continue
            lo, hi = max(a, off), min(b, end)
            src = slot.tensor[lo - a : hi - a]
            if dest.device.type == "cuda":
                with torch.cuda.stream(stream):
                    dest[lo - off : hi - off].copy_(src, non_blocking=True)
            else:
                dest[lo - off : hi - off].copy_(src)
        if stream is not None:
            slot.copied = torch.cuda.Event()
            slot.copied.record(stream)
        if self.hasher is None:
            slot.free.set()
        else:
            self.filled[c] = (slot, n)
        self.ready[c].set()

    def hash_chunk(self, c: int) -> None:
        assert self.hasher is not None
        slot, n = self.filled.pop(c)
        self.hasher.update(slot.view[:n])
        slot.free.set()

    def fail(self) -> None:
        """Stop the file's streams (those waiting for a buffer too) and its hash thread."""
        super().fail()
        with self.lock:
            for s in self.slots:
                s.free.set()


def _read(fd: int, view: memoryview, pos: int, n: int, name: str) -> None:
    """Bytes [pos, pos + n) of `fd` into `view` (with O_DIRECT: rounded up to whole blocks, the
    file's last one a short read)."""
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], pos + got)
        if k <= 0:
            raise EOFError(f"{name}: ended early")
        got += k
