"""A local checkpoint's headers parsed by forked children (reshard/sources/headers.py, issue 28) give
exactly what one process parsing them in order gives: the same records (names, order, types), the
same first error, and no child left behind however the run ends."""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
from pathlib import Path

import pytest

from reshard.errors import SourceError
from reshard.sources import headers
from reshard.sources.headers import read_headers


def write_file(path: Path, entries: dict[str, tuple[str, list[int]]], raw_header: bytes | None = None) -> None:
    """A safetensors file of zero-filled tensors; `raw_header` replaces the JSON written."""
    header, pos = {}, 0
    for name, (dtype, shape) in entries.items():
        n = {"BF16": 2, "F32": 4, "U8": 1}[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(pos))


def shards(tmp_path: Path, n: int = 5) -> list[str]:
    """`n` shards of varied tensors: names with a NUL, an empty name, non-ASCII, a lone surrogate,
    shared and distinct shapes, a zero-sized tensor, a shard with none."""
    files = []
    for f in range(n):
        entries: dict[str, tuple[str, list[int]]] = {
            f"layers.{f}.{i}.w": ("BF16" if i % 3 else "F32", [i % 4 + 1, 3]) for i in range(40)
        }
        entries[f"odd.{f}.zero"] = ("U8", [0, 5])
        files.append(f"model-{f:05d}.safetensors")
        if f == 1:
            entries = {f"nul\x00{f}": ("U8", [2]), "": ("U8", [1]), "é\ud800": ("BF16", [1]), **entries}
        if f == n - 1:
            entries = {}
        write_file(tmp_path / files[-1], entries)
    return files


FORKED: list[int] = []


@pytest.fixture
def parallel(monkeypatch):
    """The tiny headers here forked out too; the children's pids in FORKED."""
    monkeypatch.setattr(headers, "PARALLEL_MIN", 0)
    fork = os.fork

    def recorded() -> int:
        pid = fork()
        if pid:
            FORKED.append(pid)
        return pid

    FORKED.clear()
    monkeypatch.setattr(os, "fork", recorded)


def read_all(root: Path, files: list[str], processes: int) -> list:
    return [(name, list(t.items()), size) for name, (t, size) in read_headers(root, files, processes)]


def no_children() -> bool:
    """Every child forked was reaped (other tests' servers may be this process's children too)."""
    assert FORKED
    for pid in FORKED:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        return False
    return True


@pytest.mark.parametrize("processes", [2, 3, 8])
def test_children_give_what_one_process_gives(tmp_path, parallel, processes):
    files = shards(tmp_path)
    one = read_all(tmp_path, files, 1)
    many = read_all(tmp_path, files, processes)
    assert many == one
    for (_, a, _), (_, b, _) in zip(one, many, strict=True):  # the records' types too, field by field
        assert [type(x) for _, t in a for x in t] == [type(x) for _, t in b for x in t]
    assert tuple(name for name, _ in one[1][1][:3]) == ("nul\x001", "", "é\ud800")
    assert no_children()


def test_children_were_forked(tmp_path, parallel, monkeypatch):
    """The comparison above compares something: a child parsed a share and answered."""
    files = shards(tmp_path, 4)
    answered = []
    collect = headers._collect
    monkeypatch.setattr(headers, "_collect", lambda *a: answered.append(got := collect(*a)) or got)
    read_all(tmp_path, files, 4)
    assert len(answered) == 3 and all(v is not None for got in answered for v in got.values())


def test_the_first_error_in_file_order(tmp_path, parallel):
    files = shards(tmp_path, 6)
    (tmp_path / files[4]).write_bytes(b"\x01")  # truncated (reading it fails)
    raw = (tmp_path / files[2]).read_bytes()
    (tmp_path / files[2]).write_bytes(raw[:8] + b"!" + raw[9:])  # corrupt JSON (parsing it fails)
    with pytest.raises(SourceError) as serial:
        read_all(tmp_path, files, 1)
    with pytest.raises(SourceError) as forked:
        read_all(tmp_path, files, 3)
    assert str(forked.value) == str(serial.value) and files[2] in str(serial.value)
    assert forked.value.hint == serial.value.hint
    assert no_children()


@pytest.mark.parametrize("how", ["raises", "killed", "garbage"])
def test_a_child_that_fails_is_parsed_again(tmp_path, parallel, monkeypatch, how):
    files = shards(tmp_path, 4)
    one = read_all(tmp_path, files, 1)
    parent = os.getpid()

    def broken(*a):
        if os.getpid() != parent:
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "garbage":  # an answer that does not unpack
                return ("not", "a", "pack")
            raise MemoryError
        return pack(*a)

    pack = headers._pack
    monkeypatch.setattr(headers, "_pack", broken)
    reparsed = []
    parse = headers._parse
    monkeypatch.setattr(headers, "_parse", lambda *a: reparsed.append(a[1]) or parse(*a))
    assert read_all(tmp_path, files, 4) == one
    assert len(reparsed) == len(files)  # every file by the parent: its own, then the children's again
    assert no_children()


def test_an_interrupt_leaves_no_child(tmp_path, parallel, monkeypatch):
    files = shards(tmp_path, 4)
    parent = os.getpid()
    parse = headers._parse

    def interrupted(*a):
        if os.getpid() == parent:
            raise KeyboardInterrupt
        return parse(*a)

    monkeypatch.setattr(headers, "_parse", interrupted)
    with pytest.raises(KeyboardInterrupt):
        read_all(tmp_path, files, 4)
    assert no_children()


def test_no_fork_beside_another_thread(tmp_path):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert headers._processes() == 1
    finally:
        stop.set()
        t.join()


def test_small_headers_stay_in_this_process(tmp_path, monkeypatch):
    files = shards(tmp_path, 3)
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked for a few KB of headers"))
    assert read_all(tmp_path, files, 3) == read_all(tmp_path, files, 1)


@pytest.mark.parametrize(
    ("v2", "v1", "cpus"),
    [
        ("250000 100000\n", None, 3),  # 2.5 CPUs: 3 processes
        ("max 100000\n", None, None),
        (None, ("150000", "100000"), 2),
        (None, ("-1", "100000"), None),
        (None, None, None),
    ],
)
def test_a_container_cpu_quota_bounds_the_processes(tmp_path, monkeypatch, v2, v1, cpus):
    """A pod limited to a few CPUs sees every core of its node in its affinity: the quota counts."""
    paths = (tmp_path / "cpu.max", tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us")
    if v2 is not None:
        paths[0].write_text(v2)
    if v1 is not None:
        paths[1].write_text(v1[0])
        paths[2].write_text(v1[1])
    monkeypatch.setattr(headers, "CPU_MAX", tuple(map(str, paths)))
    assert headers._cpu_quota() == cpus
    monkeypatch.setattr(os, "listdir", lambda p: ["1"] if p == "/proc/self/task" else [])  # no other thread
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert headers._processes() == min(64, cpus or os.cpu_count())


@pytest.mark.parametrize("refused", ["fork", "modules"])
def test_no_process_to_be_had_parses_here(tmp_path, parallel, monkeypatch, refused):
    """fork refused (EAGAIN: a pids limit) or a module refused by a tight `ulimit -v`: the headers are
    parsed by this process, not reported as a source that cannot be read."""
    files = shards(tmp_path, 4)
    one = read_all(tmp_path, files, 1)
    if refused == "fork":
        monkeypatch.setattr(os, "fork", lambda: (_ for _ in ()).throw(OSError(11, "Resource temporarily unavailable")))
    else:
        monkeypatch.setattr(headers, "_modules", lambda: False)
        monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked without the modules its answer needs"))
    assert read_all(tmp_path, files, 4) == one
