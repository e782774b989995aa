"""The deep layer (`--against SOURCE --deep`): every output byte regenerated from the source by the
executor and compared with the file, naming the first differing tensor of each file.

The same compare names the damaged tensor of a file whose checksum differs (`--against` alone).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import time
from dataclasses import replace

import numpy as np

from reshard import settings
from reshard.checkpoint import Source
from reshard.errors import ReshardError
from reshard.execute import Executor, WriteOptions
from reshard.folderview import FolderView
from reshard.format import ITEMSIZE, TensorInfo
from reshard.hashing import NONE, new_hasher
from reshard.io import direct
from reshard.io.memory import DEFAULT_MAX_MEMORY
from reshard.io.writer import STAGE_BYTES, Sink, Written
from reshard.plan import OutFile, OutTensor, Plan, natural_key
from reshard.verify.keys import expected_by_rank
from reshard.verify.report import CORRUPT, CheckedFile, Progress, Report, advance_for
from reshard.verify.structure import Folder

MAX_PER_FILE = 20  # differing tensors reported per file (the count of the rest is given)
WINDOW = STAGE_BYTES  # an output file is read this many bytes at a time, twice per open file as a save's writers stage


def compare(
    report: Report,
    folder: Folder,
    expected: Plan,
    source: Source,
    files: list[CheckedFile],
    progress: Progress | None,
    *,
    hash_too: bool,
    rss_base: int | None = None,
) -> None:
    """Regenerate each file's tensors from the source with the executor; compare byte for byte.

    hash_too: compute each file's digest (the manifest's checksum) on the way when the compare reads all of it.
    rss_base: the process's resident bytes before verify read any metadata: what it grew by since
    counts inside the executor's memory (`WriteOptions.rss_base`), as in a save.
    """
    plan = _compare_plan(expected, files)
    total = sum(f.data_bytes for f in plan.files)
    infos = {f.name: f for f in files}
    diffs: dict[str, list[tuple[str, str]]] = {}  # file -> (message, tensor)
    sinks: dict[str, _CompareSink] = {}

    def sink(of: OutFile, header: bytes) -> _CompareSink:
        f = infos[of.name]
        s = sinks[f.name] = _CompareSink(
            folder.view, f, diffs.setdefault(f.name, []), checksum=folder.checksum if hash_too else None
        )
        return s

    # the source's own reader: a reshard output as SOURCE is read back out of its rank files
    ckpt = source.checkpoint
    t0 = time.monotonic()
    # the sinks hash, not the executor
    options = WriteOptions(checksum=NONE, max_memory=DEFAULT_MAX_MEMORY, rss_base=rss_base)
    reader, advance = source.open_reader(), advance_for(progress, "comparing", total)
    Executor(
        plan, reader, ckpt.tensors, folder.out, options, metadata={}, sync=False, sink=sink, progress=advance
    ).run()
    report.count("compared_bytes", total)
    report.stats["deep_seconds"] = round(report.stats.get("deep_seconds", 0) + time.monotonic() - t0, 3)
    for name, s in sinks.items():
        if s.digest is not None:
            infos[name].digest = s.digest
            report.count("hashed_in_compare_bytes", infos[name].size)
    for f in files:
        s = sinks.get(f.name)
        if s is not None and s.error is not None:  # as the checksum pass says it (Report.add keeps one)
            report.add("checksum", f"{f.name}: cannot read ({s.error})", code=CORRUPT, file=f.name)
        _tell_diffs(report, f, diffs.get(f.name, []))


def _compare_plan(expected: Plan, files: list[CheckedFile]) -> Plan:
    """`expected`, narrowed to the given files and the tensors their headers hold as expected."""
    want = expected_by_rank(expected)
    out_files = []
    for f in files:
        w = want.get(f.rank, {})
        ts = [w[n] for n, i in f.tensors.items() if n in w and w[n].dtype == i.dtype and w[n].shape == i.shape]
        ts.sort(key=lambda t: (-ITEMSIZE[t.dtype], natural_key(t.name)))  # the executor's global order
        out_files.append(OutFile(f.name, f.tp_rank, f.pp_rank, f.part, tuple(ts)))
    return replace(expected, files=out_files)


def _tell_diffs(report: Report, f: CheckedFile, found: list[tuple[str, str]]) -> None:
    found = sorted(found, key=lambda d: f.tensors[d[1]].offset)
    for msg, tensor in found[:MAX_PER_FILE]:
        report.add("data", msg, code=CORRUPT, file=f.name, tensor=tensor)
    if len(found) > MAX_PER_FILE:
        more = f"{f.name}: {len(found) - MAX_PER_FILE} more tensors differ from the source"
        report.add("data", more, code=CORRUPT, file=f.name)


def locate(
    report: Report,
    folder: Folder,
    damaged: list[CheckedFile],
    expected: Plan | None,
    source: Source | None,
    against: str | None,
    progress: Progress | None,
    rss_base: int | None = None,
) -> None:
    """With --against (not --deep): compare the files whose checksum differs with the source, to
    name the damaged tensor."""
    if source is None or expected is None or source.checkpoint.root is None:
        return
    files = [f for f in damaged if f.ok]
    compare(report, folder, expected, source, files, progress, hash_too=False, rss_base=rss_base)
    for f in damaged:
        if f.ok and not any(x.kind == "data" for x in report.file_findings(f.name)):
            msg = f"{f.name}: every tensor equals what {against} produces: the change is in the header or its metadata"
            report.add("checksum", msg, code=CORRUPT, file=f.name, warn=True)


# ---- the compare sink ------------------------------------------------------------------------------


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """a == b for two uint8 arrays of one length, 8 bytes at a time (several GB/s)."""
    k = a.size & ~7
    if k and not np.array_equal(a[:k].view(np.uint64), b[:k].view(np.uint64)):
        return False
    return a[k:].tobytes() == b[k:].tobytes()


class _CompareSink(Sink):
    """A Sink for the executor: compares each regenerated tensor with the file's bytes.

    The file is read where its own header puts each tensor, so the header's metadata (run id, ...)
    does not matter. It is read WINDOW bytes at a time into two reused buffers, and every write is
    compared against the window that holds it: the reads and the memory stay the same whatever the
    tensors' sizes (three buffers per file grown to the largest write took 1.1 GB for a 4.4 GB
    output; a pread per write cost a system call per tiny tensor). When the windows come in file
    order, as they do for reshard's own files, they cover the whole file; the digest is then
    computed on a helper thread as a side effect, and the checksum pass skips the file.
    """

    def __init__(self, view: FolderView, f: CheckedFile, diffs: list, *, checksum: str | None) -> None:
        self.view = view
        self.file = f
        self.diffs = diffs
        self.fd = os.open(view.local / f.name, os.O_RDONLY) if view.local is not None else -1
        self.direct = False
        self.info: TensorInfo | None = None
        self.pos = 0
        self.bad = False
        # made when first read into; rotated, so hashing trails the compare
        self.bufs: list[bytearray | None] = [None, None]
        self.pending: list[cf.Future | None] = [None, None]
        self.turn = 0
        self.window = np.empty(0, np.uint8)  # the file's bytes [lo, hi)
        self.lo = self.hi = 0
        self.hasher = None
        self.sha = None
        self.sha_pos = 0
        self.digest: str | None = None
        self.error: str | None = None  # why the file could not be read (it is compared no further)
        if checksum is not None:
            start = min((t.offset for t in f.tensors.values()), default=f.size)
            try:
                head = os.pread(self.fd, start, 0) if self.fd >= 0 else view.read_range(f.name, 0, start)
            except (OSError, ReshardError) as e:
                self._failed(e)
                return
            self.sha = new_hasher(checksum)
            self.sha.update(head)
            self.sha_pos = len(head)
            self.hasher = cf.ThreadPoolExecutor(1, thread_name_prefix="reshard-deep-sha")
        # a file mostly not in the page cache (just saved: written with O_DIRECT) is read with O_DIRECT
        # while the windows stay aligned: through the cache, the kernel's copy of its every page
        # cost ~60% of a cold compare's CPU here
        if self.fd >= 0:
            if WINDOW % direct.ALIGN == 0 and direct.wants_direct(view.local / f.name, settings.DIRECT_READS.get()):
                self.direct = direct.enable(self.fd)
            if not self.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def begin(self, tensor: OutTensor) -> None:
        self.info = self.file.tensors[tensor.name]
        self.pos = 0
        self.bad = False

    def write(self, data: memoryview | bytes) -> None:
        if self.error is not None:
            return
        got = np.frombuffer(data, np.uint8)
        n, a = got.size, 0
        while a < n:
            off = self.info.offset + self.pos + a
            if not self.lo <= off < self.hi:
                try:
                    self._fill(off)
                except (OSError, ReshardError) as e:
                    self._failed(e)
                    return
                if self.hi <= off:  # the file ends before this byte
                    if not self.bad:
                        self._tell(got[a:], self.window[:0], a)
                    break
            k = min(n - a, self.hi - off)
            have = self.window[off - self.lo : off - self.lo + k]
            if not self.bad and not _equal(got[a : a + k], have):
                self._tell(got[a : a + k], have, a)
            a += k
        self.pos += n

    def _fill(self, off: int) -> None:
        """Read the window that holds `off` (WINDOW bytes from the page `off` is in: fewer at the
        file's end) into the next buffer, once the hash of its previous bytes is done; hash the
        bytes past `sha_pos` in it."""
        i = self.turn
        self.turn = 1 - i
        if self.pending[i] is not None:
            self.pending[i].result()
            self.pending[i] = None
        buf = self.bufs[i]
        if buf is None:
            buf = self.bufs[i] = direct.buffer(WINDOW) if self.direct else bytearray(WINDOW)
        view = memoryview(buf)
        if WINDOW % direct.ALIGN == 0:
            off -= off % direct.ALIGN  # windows on whole pages, for O_DIRECT
        if self.fd < 0:  # a bucket folder: one ranged read
            size = self.file.size
            data = self.view.read_range(self.file.name, off, WINDOW if size is None else min(WINDOW, size - off))
            view[: len(data)] = data
            m = len(data)
        else:
            m = 0
            while m < WINDOW:
                try:
                    k = os.preadv(self.fd, [view[m:]], off + m)
                except OSError as e:
                    if not (self.direct and e.errno == errno.EINVAL):
                        raise
                    self._buffered()  # the file system took O_DIRECT at open, not for reads
                    continue
                if k == 0:
                    break
                m += k
                if self.direct and m % direct.ALIGN:  # the file's end: no aligned read follows
                    break
        self.window = np.frombuffer(buf, np.uint8)[:m]
        self.lo, self.hi = off, off + m
        if self.sha is None or self.sha_pos >= self.hi:
            return
        if self.sha_pos < off:  # a stretch no window holds: the checksum pass hashes the file
            self._drop_hash()
            return
        self.pending[i] = self.hasher.submit(self.sha.update, view[self.sha_pos - off : m])
        self.sha_pos = self.hi

    def _failed(self, e: OSError | ReshardError) -> None:
        self.error = e.strerror if isinstance(e, OSError) else e.message
        self._drop_hash()

    def _buffered(self) -> None:
        direct.disable(self.fd)
        self.direct = False

    def _tell(self, got: np.ndarray, have: np.ndarray, base: int) -> None:
        """`got` (the tensor's bytes from `base` on) differs from `have` (the file's; shorter where
        the file ends): note the first differing byte, once per tensor."""
        self.bad = True
        info = self.info
        done = have.size
        diff = np.flatnonzero(got[:done] != have)
        first = int(diff[0]) if diff.size else done  # the file ends early
        at = self.pos + base + first
        elem = at // ITEMSIZE[info.dtype]
        self.diffs.append(
            (
                f"{self.file.name}: tensor {info.name} differs from the source from byte {at} of it "
                f"(element {elem}; file offset {info.offset + at})",
                info.name,
            )
        )

    def _drop_hash(self) -> None:
        self.sha = None
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)
            self.hasher = None
        self.pending = [None, None]

    def close(self, sync: bool) -> Written:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True)
            self.hasher = None
        if self.sha is not None and self.sha_pos == self.file.size:
            self.digest = self.sha.hexdigest()
        self._free()
        if self.fd >= 0:
            os.close(self.fd)
        return Written(self.file.name, self.file.size or 0, self.digest)

    def _free(self) -> None:
        """Let go of the windows (no hash reads them now): the compare keeps every sink until its
        end, and an output of many parts per rank would hold every file's windows."""
        self.bufs, self.pending = [None, None], [None, None]
        self.window = np.empty(0, np.uint8)

    def abort(self) -> None:
        if self.hasher is not None:
            self.hasher.shutdown(wait=True, cancel_futures=True)
            self.hasher = None
        self._free()
        with contextlib.suppress(OSError):
            if self.fd >= 0:
                os.close(self.fd)
