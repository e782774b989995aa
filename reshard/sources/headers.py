"""A local checkpoint's safetensors headers, parsed by several processes at once (issue 28).

The headers of a 200k-tensor MoE are ~24 MB of JSON. Parsing them is work under one GIL (~2.5 us a
tensor for a compact header, `reshard.fastheader`; ~3.5 us for another, 0.5-0.7 s in all), and
threads would take turns at it. Where the machine has spare cores and the headers are large, this
process reads every header's bytes itself, in file order, then forks children that parse a share of
them each with the same checks and send back their records through a pipe, as columns (the names in
one string, a table of the distinct (dtype, shape), the offsets in an array: a compact header's as
`fastheader.scan` finds them, another's packed from `parse_header`'s records), while it parses its
own share; rebuilding a child's records costs it ~0.5 us a tensor, in C loops (0.5 s of headers took
0.34-0.36 s on 2 cores). A container's CPU quota bounds the children as the affinity does.

Errors are the serial ones, in file order: a header this process cannot read or parse is raised
when its turn comes, and whatever a child did not hand back whole (a damaged header, a child killed
or out of memory) is parsed again here, which raises that file's own error. A fork beside other
threads can deadlock the child on a lock one of them held, so a process with more than one thread
(a library caller's, torch's) parses everything itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from reshard.errors import SourceError
from reshard.fastheader import Columns, build, scan
from reshard.format import ITEMSIZE, TensorInfo, parse_header, read_raw_header

PARALLEL_MIN = 4 * 1024 * 1024  # header bytes in all below which one process parses them (a fork costs ms)
MAX_CHILDREN = 7  # beyond ~8 processes this one's rebuilding of their records is the longer part

Parsed = tuple[dict[str, TensorInfo], int]  # a file's tensors by name, and the file's size


def read_headers(root: Path, files: list[str], processes: int | None = None) -> Iterator[tuple[str, Parsed]]:
    """(name, (tensors, size)) of each of `files` in `root`, in order; raises a file's SourceError at
    its turn, as reading them one by one would. `processes`: how many may parse (None: as many as
    this process may run on at once, if it has no other thread and the headers are large)."""
    raws: list[tuple[bytes, int] | SourceError] = []
    for name in files:
        try:
            raws.append(read_raw_header(root / name))
        except SourceError as e:
            raws.append(e)
    shares = _shares(raws, _processes() if processes is None else processes)
    if len(shares) > 1 and not _modules():
        shares = shares[:1]  # the rest parsed below, by this process
    results: dict[int, Parsed | SourceError | None] = {}
    live: dict[int, int] = {}  # pid -> the read end of its pipe, of each child not yet reaped
    try:
        forked = []
        for share in shares[1:]:
            try:
                forked.append((_fork(root, files, raws, share, live), share))
            except OSError:  # no process to be had (EAGAIN, ENOMEM): this share parsed below, here
                break
        for i in shares[0]:
            results[i] = _parse(root, files[i], raws[i])
        for pid, share in forked:
            results.update(_collect(pid, live, share))
    finally:
        for pid in list(live):  # interrupted, or a bug: no child is left behind
            _end(pid, live, kill=True)
    for i, name in enumerate(files):
        got, raw, raws[i] = results.get(i), raws[i], None  # the header's bytes are not needed again
        if got is None:  # not parsed (one process), or a child's that did not come back whole
            got = _parse(root, name, raw)
        if isinstance(got, SourceError):
            raise got
        yield name, got


def _modules() -> bool:
    """Load what children and their answers need, here, before forking (one process never does);
    whether it could be (a tight `ulimit -v` may refuse a module's library)."""
    try:
        import array  # noqa: F401
        import pickle  # noqa: F401
    except Exception:  # MemoryError, an ImportError, a SystemError from a module's init
        return False
    return True


def _processes() -> int:
    """The processes worth forking now: the cores this one may run on, if it is the only thread."""
    if not hasattr(os, "fork") or not hasattr(os, "sched_getaffinity"):
        return 1
    try:
        threads = len(os.listdir("/proc/self/task"))  # the OS's count: threads of C libraries too
    except OSError:
        return 1
    return min(len(os.sched_getaffinity(0)), _cpu_quota() or os.cpu_count() or 1) if threads == 1 else 1


CPU_MAX = ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _cpu_quota() -> int | None:
    """The CPUs a container's quota allows (cgroup v2 `cpu.max`, or v1's CFS quota), rounded up;
    None without one. A pod limited to 2 CPUs on a 64-core node still sees 64 in its affinity."""
    v2, v1_quota, v1_period = CPU_MAX
    try:
        quota, period = Path(v2).read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = Path(v1_quota).read_text().strip(), Path(v1_period).read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)  # "max" (v2) or -1 (v1): no quota
    except ValueError:
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def _shares(raws: list, processes: int) -> list[list[int]]:
    """Indexes of the parsable headers for this process (first) and each child, dealt largest first
    to the least loaded; one share (this process's) when parallel parsing does not pay."""
    sizes = {i: len(r[0]) for i, r in enumerate(raws) if not isinstance(r, SourceError)}
    n = min(processes, MAX_CHILDREN + 1, len(sizes))
    if n < 2 or sum(sizes.values()) < PARALLEL_MIN:
        return [sorted(sizes)]
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(sizes, key=lambda i: -sizes[i]):
        k = load.index(min(load))
        shares[k].append(i)
        load[k] += sizes[i]
    return [sorted(s) for s in shares]


def _parse(root: Path, name: str, raw: tuple[bytes, int] | SourceError) -> Parsed | SourceError:
    """`read_header`'s parsing half (its SourceError returned, not raised)."""
    if isinstance(raw, SourceError):
        return raw
    path = root / name
    try:
        tensors, _, size = parse_header(raw[0], raw[1], str(path), path.name)
    except SourceError as e:
        return e
    return tensors, size


def _fork(root: Path, files: list[str], raws: list, share: list[int], live: dict[int, int]) -> int:
    """A child parsing `share`, entered in `live` with the read end of the pipe it answers through."""
    import pickle

    r, w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: never returns, never runs the parent's clean-up (os._exit)
        code = 1
        try:
            for fd in (r, *live.values()):  # the pipes of this one and of the children before it
                os.close(fd)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)  # a Ctrl-C ends it at once; the parent reports it
            out = {}
            for i in share:
                out[i] = _scanned(raws[i], files[i])
                if out[i] is None:  # not compact: parsed the general way, then packed
                    got = _parse(root, files[i], raws[i])
                    if not isinstance(got, SourceError):  # errors are the parent's to raise
                        out[i] = _pack(*got)
            data = memoryview(pickle.dumps(out, pickle.HIGHEST_PROTOCOL))
            while data:
                data = data[os.write(w, data) :]
            code = 0
        finally:
            os._exit(code)
    live[pid] = r
    os.close(w)
    return pid


def _collect(pid: int, live: dict[int, int], share: list[int]) -> dict[int, Parsed | None]:
    """What the child answered for each file of its share; None where it did not (parsed again)."""
    import pickle

    chunks = []
    try:
        while chunk := os.read(live[pid], 1 << 20):
            chunks.append(chunk)
    except OSError:
        chunks = []
    ok = _end(pid, live, kill=False)
    got: dict[int, Parsed | None] = dict.fromkeys(share)
    if not ok:
        return got
    try:
        out = pickle.loads(b"".join(chunks))
    except Exception:  # a truncated answer: the child died writing it
        return got
    for i, packed in out.items():
        try:
            got[i] = _unpack(*packed) if packed is not None else None
        except Exception:  # not an answer `_pack` makes: parsed again (a bug's, never trusted)
            got[i] = None
    return got


def _scanned(raw: tuple[bytes, int] | SourceError, file: str) -> tuple | None:
    """A compact header's columns (reshard.fastheader) as a child sends them, with no record made."""
    import array

    scanned = scan(raw[0], raw[1], ITEMSIZE) if not isinstance(raw, SourceError) else None
    if scanned is None:
        return None
    names, kinds, ids, offsets = scanned[0]
    return names, kinds, array.array("I", ids).tobytes(), array.array("q", offsets).tobytes(), file, raw[1]


def _pack(tensors: dict[str, TensorInfo], size: int) -> tuple | None:
    """A file's records as a child sends them: the names in one string, each tensor's (dtype, shape)
    as an index into a table of the distinct ones, its offset in an array; None for names that hold
    the separator (JSON allows a NUL in a name: the parent parses that header itself)."""
    import array

    names = "\0".join(tensors)
    if names.count("\0") != max(len(tensors) - 1, 0):
        return None
    kinds: dict[tuple[str, tuple[int, ...], int], int] = {}  # (dtype, shape, bytes) -> its index
    ids = array.array("I", [kinds.setdefault((t.dtype, t.shape, t.nbytes), len(kinds)) for t in tensors.values()])
    offsets = array.array("q", [t.offset for t in tensors.values()])
    file = next(iter(tensors.values())).file if tensors else ""
    return names.encode("utf-8", "surrogatepass"), list(kinds), ids.tobytes(), offsets.tobytes(), file, size


def _unpack(names: bytes, table: list, ids: bytes, offsets: bytes, file: str, size: int) -> Parsed | None:
    """`_pack`'s or `_scanned`'s records again, in header order (C loops only: reshard.fastheader.build);
    None where they do not make one record per name."""
    import array

    if not ids:  # no tensor (`names` is "" for one named "" too)
        return {}, size
    tensors = build(Columns(names, table, array.array("I", ids), array.array("q", offsets)), file, TensorInfo)
    return (tensors, size) if tensors is not None else None


def _end(pid: int, live: dict[int, int], kill: bool) -> bool:
    """Reap the child (killed first if `kill`) and close its pipe; whether it exited 0."""
    os.close(live.pop(pid))
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
