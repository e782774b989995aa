"""Scratch files outside OUT_DIR (an S3 save's side files, verify's, an S3 source's; a Hugging Face cache blob
fetched again), named after the process that writes them, so that a later run removes those of a run that was
killed (SIGKILL, the OOM killer, a crash: no cleanup of its own ran) and never those of a run still going.

A name carries an owner, `<machine>-<pid>-<start>`: this boot of the kernel and this pid namespace (where a
pid names one process), the pid, and the process's start time (a pid used again names another process). An
entry is removed when its owner is of this machine and no process with that pid and start time exists; one of
another machine (a shared cache, another container's /tmp) or of another user is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reshard.names import SCRATCH_DIR, SCRATCH_DIR_GLOB

_OWNER = re.compile(r"\.([0-9a-f]+)-(\d+)-(\d+)\.")


def _start(pid: int) -> str | None:
    """Process `pid`'s start time (clock ticks since boot, /proc/PID/stat's 22nd field), None when none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]  # after the command name, which may hold spaces


def _machine() -> str | None:
    """This boot and pid namespace, in hex; None where /proc cannot say (then nothing is swept)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
        return f"{boot}{os.stat('/proc/self/ns/pid').st_ino:x}"
    except (OSError, ValueError):
        return None


def owner() -> str:
    """This process, as scratch names carry it (`0-<pid>-0` where /proc cannot say: never swept)."""
    pid = os.getpid()
    return f"{_machine() or '0'}-{pid}-{_start(pid) or 0}"


def left_by_a_dead_run(name: str) -> bool:
    """Whether `name` is scratch whose owner, of this machine, has ended."""
    found = _OWNER.search(name)
    machine = _machine()
    if found is None or machine is None or found[1] != machine:
        return False
    return _start(int(found[2])) != found[3]


def sweep(folder: Path, pattern: str) -> None:
    """Remove the entries of `folder` matching `pattern` that dead runs of this user left (a folder whole)."""
    with contextlib.suppress(OSError):
        for entry in folder.glob(pattern):
            with contextlib.suppress(OSError):
                if not left_by_a_dead_run(entry.name) or entry.lstat().st_uid != os.getuid():
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()


def make_scratch_dir(kind: str) -> Path:
    """A new folder in the temp folder (TMPDIR), named after this process; what killed runs left there first
    removed. The caller removes it."""
    root = Path(tempfile.gettempdir())
    sweep(root, SCRATCH_DIR_GLOB)
    return Path(tempfile.mkdtemp(prefix=SCRATCH_DIR.format(kind=kind, owner=owner()), dir=root))


@contextlib.contextmanager
def scratch_dir(kind: str) -> Iterator[Path]:
    """make_scratch_dir(kind), removed on the way out."""
    path = make_scratch_dir(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
