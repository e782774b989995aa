"""OUT_DIR before anything is written to it: checks (not inside the source, not a file, empty unless
--overwrite, writable, free space, a mount point or not), its lock, and write errors told as the
user's problem they are (disk full, the open-files limit), shared by `save`, `merge` and `assemble`.

One run at a time per OUT_DIR: `lock` takes an exclusive lock beside it and names the holder to a
second run, which fails with exit 5. The lock is opened without following a symbolic link, and only
a regular file of this user is used as one. The folder it lies in (OUT_DIR's parent, where the staging
folder goes too) must not be open to everyone's renames: one that others may write (o+w) without the
sticky bit is refused unless this user or root owns it (a sticky /tmp is fine).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from reshard.console import human_bytes
from reshard.errors import OutputError
from reshard.names import LOCK, sibling


def check_out_dir(out_dir: Path, source_root: Path | None, overwrite: bool, label: str = "OUT_DIR") -> None:
    """Refuse an OUT_DIR inside the source (or around it), a file, or a non-empty folder unasked;
    `label`: what the command calls it (merge writes HF_DIR)."""
    out = out_dir.resolve()
    check_apart(out_dir, source_root, label)
    _check_parents(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(
            f"{label} {out_dir} exists and is not a folder", f"remove the file, or choose another {label}"
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = "its reshard files" if label == "OUT_DIR" else "the weights there"
        raise OutputError(f"{label} {out_dir} is not empty", f"pass --overwrite to replace {what}")
    inner = sorted(p for p in _mount_points() if p.startswith(str(out) + "/")) if out.is_dir() else []
    if inner:  # the new folder would get a copy of its files, and the old one's removal empty the mount
        raise OutputError(
            f"{inner[0]} is a mount point inside {label} {out_dir}: replacing the folder would copy its files "
            "and then delete them from it",
            f"unmount it or move it out of {label}, or write to another folder",
        )


def check_apart(out_dir: Path, source_root: Path | None, label: str = "OUT_DIR") -> None:
    """Refuse an OUT_DIR inside the source or around it: checked before anything is made (the lock's
    folder included), so that a refused run leaves the source as it was."""
    if source_root is None:
        return
    out, src = out_dir.resolve(), source_root.resolve()
    if out == src or src in out.parents:
        raise OutputError(f"{label} {out_dir} is inside the source folder {source_root}", "write elsewhere")
    if out in src.parents:
        raise OutputError(f"the source folder {source_root} is inside {label} {out_dir}", "write elsewhere")


def is_mount(out_dir: Path) -> bool:
    """OUT_DIR is a mount point (or another filesystem than its parent's, or a bind mount of the
    same one: /proc/self/mountinfo): it cannot be swapped."""
    out = out_dir.resolve()
    try:
        if not out.is_dir():
            return False
        return os.path.ismount(out) or out.stat().st_dev != out.parent.stat().st_dev or str(out) in _mount_points()
    except OSError:
        return False


def _mount_points() -> set[str]:
    """Every mount point of this process's namespace (bind mounts included), as /proc/self/mountinfo
    lists them (field 5, octal escapes decoded); empty where it cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def holds_cwd(out_dir: Path) -> bool:
    """This process's working folder is OUT_DIR or inside it (`reshard save SRC .`): swapping the
    folder would leave the shell that ran reshard in the old, removed one."""
    try:
        cwd, out = Path.cwd().resolve(), out_dir.resolve()
    except OSError:
        return False
    return cwd == out or out in cwd.parents


def check_writable(out_dir: Path, base: Path) -> None:
    """Refuse, before anything is written, an OUT_DIR (or the folder the new output is staged in)
    that this process cannot write: a read-only mount, a folder of another user."""
    out = out_dir.resolve()
    for folder in dict.fromkeys([base, out]):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            what = "OUT_DIR" if folder == out else "the folder holding OUT_DIR"
            raise OutputError(
                f"{what} {folder} is not writable (read-only filesystem or permissions)", "choose another OUT_DIR"
            )


def _check_parents(out_dir: Path) -> None:
    for parent in out_dir.resolve().parents:
        if parent.exists() and not parent.is_dir():
            raise OutputError(f"OUT_DIR {out_dir} lies under {parent}, which is a file", "choose another OUT_DIR")


def check_free_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OutputError(
            f"not enough disk space in {folder}: need {human_bytes(need)}, {human_bytes(free)} free",
            "free space or choose another OUT_DIR",
        )


# ---- one run at a time ---------------------------------------------------------------------------


@contextlib.contextmanager
def lock(out_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock of OUT_DIR (a file beside it, removed at the end)."""
    path = sibling(out_dir, LOCK)
    _check_parents(out_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {path.parent}: {e.strerror or e}", "choose another OUT_DIR") from e
    check_holder(path.parent)
    while True:
        try:
            fd = os.open(path, _LOCK_FLAGS, 0o644)
        except OSError as e:
            raise _lock_error(out_dir, path, e) from e
        _check_lock_file(fd, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            other = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OutputError(
                    f"another reshard run ({'pid ' + other if other else 'another process'}) is writing {out_dir}",
                    "wait for it to finish, or write elsewhere",
                ) from None
            raise OutputError(f"cannot lock {path}: {e.strerror or e}") from e
        # the file may have been removed (and recreated) by the previous holder: lock the live one
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as e:  # a disk already full (a rerun after a failed one) fails here first
            raise write_error(out_dir, e) from e
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def check_holder(folder: Path) -> None:
    """Refuse a folder to hold the lock and staging folder that anyone may write (rename, replace our
    files in) without the sticky bit, unless this user or root owns it (it was opened up on purpose)."""
    try:
        st = os.stat(folder)
    except OSError as e:
        raise OutputError(f"cannot read {folder}: {e.strerror or e}", "choose another OUT_DIR") from e
    if open_to_others(st.st_mode, st.st_uid, os.geteuid()):
        raise OutputError(
            f"the folder holding OUT_DIR, {folder}, is writable by every user without the sticky bit and "
            f"belongs to uid {st.st_uid}: another user could replace reshard's lock and staging folder there",
            f"choose OUT_DIR in a folder of yours, or have its owner run `chmod +t {folder}` (or `chmod o-w`)",
        )


def open_to_others(mode: int, owner: int, me: int) -> bool:
    """A folder anyone may write (o+w) without the sticky bit, owned by neither `me` nor root."""
    return bool(mode & stat.S_IWOTH) and not mode & stat.S_ISVTX and owner not in (me, 0)


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _lock_error(out_dir: Path, path: Path, e: OSError) -> OutputError:
    if e.errno == errno.ELOOP:
        return OutputError(
            f"the lock path {path} is a symbolic link, not reshard's lock (it is not followed)",
            "remove it, then rerun",
        )
    if e.errno == errno.EISDIR:
        return OutputError(f"the lock path {path} is a folder, not reshard's lock", "remove it, then rerun")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return too_many_files()
    return OutputError(f"cannot write beside {out_dir}: {e.strerror or e}", "choose another OUT_DIR")


def _check_lock_file(fd: int, path: Path) -> None:
    """Only a regular file of this user is a lock: anything else planted there is left alone."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"belongs to uid {st.st_uid}"
        raise OutputError(f"the lock path {path} {what}, not reshard's lock", "remove it, then rerun")


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    return ""


def make_dir(path: Path) -> None:
    """mkdir -p, with a failure told as an output error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {path}: {e.strerror or e}", "choose another folder") from e


def write_error(out_dir: Path, e: OSError) -> OutputError:
    """An OSError while writing into OUT_DIR, as the user-facing error."""
    if e.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {out_dir}", "free space or choose another OUT_DIR")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return too_many_files()
    if e.errno == errno.ENOMEM:  # the read and write buffers' mmap under a `ulimit -v` or a container's limit
        return OutputError(
            f"out of memory while writing {out_dir}: the process may not take what this run needs",
            "lower --max-memory (default 512MiB), or raise the limit (`ulimit -v`, the container's)",
        )
    return OutputError(f"cannot write {out_dir}: {e.strerror or e}")


def too_many_files() -> OutputError:
    """EMFILE/ENFILE: the process's (or system's) limit on open files, not OUT_DIR, is the cause."""
    return OutputError(
        "too many open files: the process limit on open files was reached (not a problem of OUT_DIR)",
        "raise it (e.g. `ulimit -n 4096`) and rerun",
    )
