"""What every part of `python -m scripts.bench` (scripts/bench.py) shares: timing a command in its own
process (wall and CPU seconds, peak RSS), dropping or filling the page cache, the lock that keeps timed
runs apart, the disk's own speeds, the machine's description, number formatting, scrubbing a machine's
paths out of a report, and `Bench`: the run's settings, work folder, log and notes.

scripts/bench_hub.py and scripts/bench_loaders.py use it too; it imports none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from scripts.make_synthetic import make_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]

GB = 1e9
GIB = 2**30
TIME = Path("/usr/bin/time")


# ---- measuring -----------------------------------------------------------------------------


class Cache:
    """Drops the page cache before a run when we may (root on Linux); says which."""

    def __init__(self) -> None:
        self.enabled = self._try()

    @staticmethod
    def _try() -> bool:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

    def prepare(self, state: str, src: Path) -> None:
        """state "dropped": nothing of `src` in the page cache (if we may); "warm": all of it."""
        if state == "warm":
            os.sync()
            subprocess.run(["cat", *map(str, sorted(src.glob("*.safetensors")))], stdout=subprocess.DEVNULL)
        else:
            self.drop([src])

    def drop(self, warm: list[Path] | None = None) -> None:
        if self.enabled:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        elif warm:  # cache-fair instead: every run starts with the source in the page cache
            for p in warm:
                subprocess.run(["cat", *map(str, sorted(p.glob("*.safetensors")))], stdout=subprocess.DEVNULL)

    def describe(self) -> str:
        if self.enabled:
            return (
                "dropped before every timed run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root), or for the "
                "*warm* tables filled with the source (`cat` of its shards) instead"
            )
        return (
            "could not be dropped (not root): every run starts with the source read once into the page "
            "cache (hot, cache-fair); the checkpoints fit in RAM, so cold-cache numbers are not measured"
        )


LOCK = Path("/tmp/bench.lock")


@contextlib.contextmanager
def timed_alone() -> Iterator[None]:
    """Hold LOCK (flock) while a run is prepared and timed: timed runs of benchmarks sharing the
    machine (ours and others' using the same lock) never overlap."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_measured(
    cmd: list[str], *, log: Path, env: dict | None = None, timeout: float = 3600, sync: bool = True
) -> dict:
    """Run cmd (then `sync`, so buffered writes count): wall seconds, CPU seconds, peak RSS."""
    rss_file = log.with_suffix(".rss")
    rss_file.unlink(missing_ok=True)
    # the child's own peak: wait4's ru_maxrss would include this process's image, copied by fork
    timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd] if TIME.exists() else cmd
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        t0 = time.perf_counter()
        p = subprocess.Popen(timed, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # this tree's reshard
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        t1 = time.perf_counter()
        if sync:
            os.sync()
        t2 = time.perf_counter()
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[:4]} failed (rc={p.returncode}):\n{tail}")
    rss = ru.ru_maxrss
    if rss_file.exists():
        with contextlib.suppress(ValueError, IndexError):
            rss = int(rss_file.read_text().split()[-1])
        rss_file.unlink()
    return {
        "seconds": t2 - t0,
        "sync_seconds": t2 - t1,
        "cpu": ru.ru_utime + ru.ru_stime,
        "rss": rss * 1024,
        "load": os.getloadavg()[0],
    }


def disk_speeds(files: list[Path], scratch: Path, nbytes: int = 2 * 10**9, block: int = 16 * 2**20) -> dict:
    """The disk's own sequential speeds, page cache bypassed (O_DIRECT): read `files` (dropped
    cache), write `nbytes` to `scratch` and fsync. GB/s; None where O_DIRECT is refused."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    out: dict = {"read": None, "write": None}
    try:
        total, t0 = 0, time.perf_counter()
        for p in files:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                while n := os.readv(fd, [buf]):
                    total += n
            finally:
                os.close(fd)
        out["read"] = total / (time.perf_counter() - t0) / GB
    except OSError:
        pass
    try:
        buf.write(os.urandom(block))
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            t0 = time.perf_counter()
            for _ in range(nbytes // block):
                os.write(fd, buf)
            os.fsync(fd)
            out["write"] = nbytes // block * block / (time.perf_counter() - t0) / GB
        finally:
            os.close(fd)
            scratch.unlink()
    except OSError:
        pass
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt_s(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def fmt_b(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def mem_total() -> int:
    """This machine's memory (MemTotal), bytes."""
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024


def machine(work: Path) -> dict:
    """CPUs, memory, the disk under `work`, kernel, versions and commit, for the report's Machine table."""

    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    du = shutil.disk_usage(work)
    fstype = (sh("df", "--output=fstype", str(work)).splitlines()[-1:] or [""])[0].strip()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    from importlib.metadata import version  # no import: this process stays small (see run_measured)

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram": mem_total(),
        "disk": f"{fstype}, {du.total / GB:.0f} GB, {du.free / GB:.0f} GB free",
        "uname": sh("uname", "-srvmo") or " ".join(platform.uname()),
        "python": platform.python_version(),
        "versions": f"torch {version('torch')}, safetensors {version('safetensors')}, numpy {version('numpy')}, "
        f"blake3 {version('blake3')}",
        "commit": sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD")
        + (" (+ uncommitted changes)" if sh("git", "-C", str(ROOT), "status", "--porcelain", "reshard") else ""),
    }


_PY = re.compile(r"(?<![\w.])/\S*/bin/python[\d.]*")
_IN_TREE = re.compile(r"(?<![\w.])/\S*?/(build|docs|tests|scripts|reshard)/")
_ABS = re.compile(r"(?<![\w.])/(?:tmp|work|home|root)/\S*/")


def scrub(text: str) -> str:
    """`text` without the absolute paths of the machine it ran on: interpreters become `python`,
    paths inside a checkout relative to it, other folders dropped down to the file's name."""
    return _ABS.sub("", _IN_TREE.sub(r"\1/", _PY.sub("python", text)))


# ---- one run's settings and folder --------------------------------------------------------------


class Bench:
    """One benchmark run: its arguments (`a`), work folder, log, page-cache policy, results and notes.
    The sections (scripts/bench_save.py, bench_rank.py, bench_vllm.py) take it as their first argument."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = a.work.resolve()
        self.log = self.work / "bench.log"
        self.cache = Cache()
        self.results: dict = {"started": _dt.datetime.now().isoformat(timespec="seconds")}
        self.notes: list[str] = []
        self.py = sys.executable

    def say(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def make(self, name: str, arch: str, size: int, *, fp8: bool = False) -> dict:
        out = self.work / name
        if out.exists():
            shutil.rmtree(out)
        self.say(f"generating {name}: {arch}{' fp8' if fp8 else ''} {size / GB:.1f} GB")
        info = write_checkpoint(out, make_config(arch, size, fp8=fp8))
        info["arch"] = arch + (" fp8" if fp8 else "")
        return info

    def free(self) -> int:
        return shutil.disk_usage(self.work).free

    def save_cmd(self, src: Path, out: Path, tp: int) -> list[str]:
        return [self.py, "-m", "reshard", "save", str(src), str(out), "--tp", str(tp)]

    def shown(self, cmd: list[str]) -> str:
        """A command as the doc shows it: paths relative to the repository, `python` for this one."""
        out = []
        for x in cmd:
            if x == self.py:
                x = "python"
            elif x.startswith(str(ROOT) + os.sep):
                x = os.path.relpath(x, ROOT)
            out.append(x)
        return " ".join(out)


def section_of(path: Path, heading: str) -> str:
    """The section of a Markdown file that starts with `heading` (up to the next `## `), or ""."""
    if not path.exists():
        return ""
    text = path.read_text()
    start = text.find(heading)
    if start < 0:
        return ""
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start : end + 1]


def put_section(path: Path, heading: str, section: str) -> None:
    """Replace the section of `path` that starts with `heading` with `section`, or append it."""
    text = path.read_text() if path.exists() else ""
    old = section_of(path, heading)
    if old.endswith("\n\n") and not section.endswith("\n\n"):  # a section followed by another: keep the blank line
        section = section.rstrip("\n") + "\n\n"
    text = text.replace(old, section) if old else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
