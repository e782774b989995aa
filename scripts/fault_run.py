"""How the fault matrix's chain-of-custody rows (scripts/fault_cases.py) are run and checked.

Each row is a real `python -m reshard ...` process, run under a timeout (a hang is a row saying "HUNG",
never a hung script) and reaped with `os.wait4` for its own peak memory. What it may not touch is
planted and watched: a file outside the folders it was given is hashed and stat-ed before and after,
its atime first set to 0 so that any read of it moves the atime (relatime), and the work folder is
listed before and after for anything new or changed outside the paths the row may write.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_ENV = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
TIMEOUT = 60.0  # seconds per process: a row that takes longer is recorded as HUNG


@dataclass
class Result:
    code: int | str
    message: str
    wall: float
    rss_mb: float
    stdout: str = ""


# The process runs as the grandchild of a small Python that reports its ru_maxrss: a child forked from
# this script would count this script's own pages (a forked mm's high-water mark survives exec).
_WRAP = """import os, signal, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-m", "reshard", *sys.argv[2:]])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT) -> Result:
    """`python -m reshard ARGS`: exit code (or "HUNG"), the line the user reads, wall s, peak RSS MB."""
    with tempfile.TemporaryDirectory() as tmp:
        rss, out, err = Path(tmp) / "rss", Path(tmp) / "out", Path(tmp) / "err"
        with open(out, "wb") as o, open(err, "wb") as e:
            t0 = time.monotonic()
            cmd = [sys.executable, "-c", _WRAP, str(rss), *args]
            p = subprocess.Popen(cmd, stdout=o, stderr=e, env=env or BASE_ENV, start_new_session=True)
            try:
                code: int | str = p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the wrapper and reshard under it
                p.wait()
                code = "HUNG"
            wall = time.monotonic() - t0
        peak = int(rss.read_text()) / 1024 if rss.exists() and rss.read_text() else 0.0
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith("note: ")]  # a save's notes
    said = [ln for ln in lines if "error" in ln.lower()] or lines or stdout.strip().splitlines()[:1]
    msg = f"(no answer in {timeout:.0f} s: killed)" if code == "HUNG" else (said[-1] if said else "")
    return Result(code, msg, wall, peak, stdout)


def atime_is_kept(work: Path) -> bool:
    """Whether this filesystem moves a file's atime on a read (relatime from 0 does; noatime does not)."""
    probe = work / ".atime-probe"
    probe.write_text("x")
    os.utime(probe, ns=(0, probe.stat().st_mtime_ns))
    probe.read_text()
    moved = probe.stat().st_atime_ns != 0
    probe.unlink()
    return moved


def digest(folder: Path) -> str | None:
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if stat.S_ISREG(p.lstat().st_mode):
            h.update(p.relative_to(folder).as_posix().encode() + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


class Watch:
    """Planted files outside the folders a run is given (read: atime moved; written: bytes or mtime
    changed) and the work folder's listing outside `allowed` (anything new, gone or changed)."""

    def __init__(self, root: Path, targets: list[Path] = (), allowed: list[Path] = ()) -> None:
        self.root, self.targets, self.allowed = root, list(targets), [a.resolve() for a in allowed]
        self.before = {}
        for t in self.targets:
            sha = hashlib.sha256(t.read_bytes()).hexdigest()
            os.utime(t, ns=(0, t.stat().st_mtime_ns))  # after our own read: any later read moves it
            self.before[t] = (sha, *self._stat(t))
        self.listing = self._listing()

    @staticmethod
    def _stat(t: Path) -> tuple[int, int, int]:
        s = t.stat()
        return s.st_size, s.st_mtime_ns, s.st_atime_ns

    def _target(self, t: Path) -> tuple:
        size, mtime, atime = self._stat(t)  # the atime before this read of ours
        return hashlib.sha256(t.read_bytes()).hexdigest(), size, mtime, atime

    def _listing(self) -> dict[str, tuple]:
        seen = {}
        for p in self.root.rglob("*"):
            at = p.parent.resolve() / p.name  # a link itself, not what it points at
            if any(at == a or a in at.parents for a in self.allowed):
                continue
            if p in self.targets:
                continue
            s = p.lstat()
            seen[str(p.relative_to(self.root))] = (s.st_mode, s.st_size, s.st_mtime_ns)
        return seen

    def report(self) -> str:
        found = []
        for t, (sha, size, mtime, atime) in self.before.items():
            now = self._target(t)
            if now[:3] != (sha, size, mtime):
                found.append(f"**{t.name} WRITTEN**")
            elif now[3] != atime:
                found.append(f"**{t.name} READ** (atime moved)")
        after = self._listing()
        changed = sorted(k for k in set(after) | set(self.listing) if after.get(k) != self.listing.get(k))
        found += [f"**changed: {k}**" for k in changed[:3]]
        what = ", ".join(t.name for t in self.targets)
        return "; ".join(found) if found else (f"nothing ({what}: not read, not written)" if what else "nothing")


@dataclass
class Section:
    title: str
    note: str
    work: Path
    rows: list[tuple] = field(default_factory=list)

    def add(self, name: str, r: Result, src_ok: str, kept: str, outside: str) -> None:
        clean = r.message.replace("|", "\\|").replace(str(self.work), "…")
        self.rows.append((name, r.code, clean, src_ok, kept, outside, f"{r.wall:.1f} s / {r.rss_mb:.0f} MB"))
        print(f"{r.code!s:>4}  {name}: {clean[:100]}  [{outside[:60]}]", flush=True)

    def slowest(self) -> float:
        return max((float(r[6].split()[0]) for r in self.rows), default=0.0)


def case(
    sec: Section,
    name: str,
    args: list[str],
    *,
    source: Path | None = None,
    previous: Path | None = None,
    targets: list[Path] = (),
    allowed: list[Path] = (),
    env: dict | None = None,
    after: Callable[[Result], str] | None = None,
) -> Result:
    """One row: run, then check the source, the previous output and everything outside."""
    src0, prev0 = (digest(source) if source else None), (digest(previous) if previous else None)
    watch = Watch(sec.work, targets, [*allowed, *([previous] if previous else [])])
    r = run(args, env)
    src_ok = "n/a" if source is None else ("yes" if digest(source) == src0 else "**NO**")
    if previous is None:
        kept = "n/a"
    elif digest(previous) == prev0:
        kept = "yes, unchanged"
    else:
        kept = "yes, the new one verifies" if run(["verify", str(previous)]).code == 0 else "**NO**"
    outside = watch.report()
    if after is not None:
        outside += "; " + after(r)
    sec.add(name, r, src_ok, kept, outside)
    return r


def write_sections(sections: list[Section]) -> list[str]:
    """The sections as markdown, each with its slowest row."""
    lines: list[str] = []
    for s in sections:
        lines += [
            "",
            f"## {s.title}",
            "",
            f"{s.note}. Each process ran under a {TIMEOUT:.0f} s timeout; the slowest row took {s.slowest():.1f} s. "
            "Peak RSS: the process's own ru_maxrss.",
            "",
            "| case | exit | message (last line of stderr) | source untouched | previous output kept "
            "| read or written outside (must be nothing) | wall / peak RSS |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in s.rows]
    return lines
