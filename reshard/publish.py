"""Getting files into OUT_DIR without ever losing a good output, shared by `save` and `merge`.

A run builds its complete new folder beside OUT_DIR (`names.STAGING`, same filesystem),
manifest included, every file and the folder fsynced. Publishing is then one atomic exchange of the
two folders (Linux renameat2 RENAME_EXCHANGE), after which the old folder is removed. So at every
instant OUT_DIR is either the previous output or the new one, both complete: an interrupt, a
failure or a full disk before the exchange leaves OUT_DIR exactly as it was. Files of OUT_DIR that
reshard did not write are carried into the new folder (hard links) before the exchange.

Where the exchange is not available, two renames are used (OUT_DIR -> `names.OLD`,
new -> OUT_DIR) with signals held off between them; a crash in that instant is repaired by the
next run (`recover`), which puts the old folder back.

One run at a time per OUT_DIR: `lock` takes an exclusive lock beside it and names the holder to a
second run, which fails with exit 5.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from reshard.console import human_bytes
from reshard.errors import OutputError
from reshard.format import fsync_dir
from reshard.names import (
    CONFIG,
    HIDDEN_PREFIX,
    INDEX,
    LOCK,
    MANIFEST,
    OLD,
    STAGING,
    TMP_PREFIX,
    WEIGHT_SUFFIXES,
    is_rank_file_name,
    sibling,
    siblings,
)
from reshard.sidecopy import copy_side_files


def check_out_dir(out_dir: Path, source_root: Path | None, overwrite: bool) -> None:
    """Refuse an OUT_DIR inside the source (or around it), a file, or a non-empty folder unasked."""
    out = out_dir.resolve()
    if source_root is not None:
        src = source_root.resolve()
        if out == src or src in out.parents:
            raise OutputError(f"OUT_DIR {out_dir} is inside the source folder {source_root}", "write elsewhere")
        if out in src.parents:
            raise OutputError(f"the source folder {source_root} is inside OUT_DIR {out_dir}", "write elsewhere")
    _check_parents(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"OUT_DIR {out_dir} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"OUT_DIR {out_dir} is not empty", "pass --overwrite to replace its reshard files")


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


def side_files(root: Path) -> list[str]:
    """Non-weight files vLLM's example copies next to the rank files: config, tokenizer, generation
    config, ... (not weights, indexes, manifests or hidden files)."""
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or p.name in (INDEX, MANIFEST) or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        if is_rank_file_name(p.name):
            continue
        out.append(p.name)
    return out


def copy_files(src: Path, names: Iterable[str], dst: Path) -> None:
    """Copy files (and folders) `names` from `src` into `dst` as regular files, keeping times and
    modes. A symlink leading out of the source (or its Hub cache repo folder) or a special file
    (FIFO, device, socket) raises SourceError (exit 4) naming it (reshard.sidecopy)."""
    copy_side_files(src, list(names), dst)


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
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise OutputError(f"cannot write beside {out_dir}: {e.strerror or e}", "choose another OUT_DIR") from e
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
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    return ""


# ---- the publish sequence -------------------------------------------------------------------------


@contextlib.contextmanager
def staged(out_dir: Path, tag: str, *, source: Path | None, overwrite: bool, need: int) -> Iterator[Path]:
    """The one sequence that gets a new folder into OUT_DIR, for save, merge and assemble: lock
    OUT_DIR, repair what an interrupted run left, check it (`check_out_dir`: not inside `source`,
    empty unless `overwrite`) and its free space (`need` bytes), make the staging folder beside it,
    yield it; the caller fills it and publishes (`swap_in` or `move_into`) inside the block. A write
    error is told as an OutputError; the staging folder never outlives the block."""
    with lock(out_dir):
        recover(out_dir)  # first: a folder an interrupted swap took away is put back
        check_out_dir(out_dir, source, overwrite)
        make_dir(out_dir.resolve().parent)
        check_free_space(out_dir.resolve().parent, need)
        folder = staging_dir(out_dir, tag)
        make_dir(folder)
        try:
            yield folder
        except OSError as e:
            raise write_error(out_dir, e) from e
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def write_config(folder: Path, config: dict, patch: dict) -> None:
    """config.json with `patch` applied (to its text_config too, where the model keeps one)."""
    config = {**config, **patch}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **patch}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


# ---- staging and the swap ------------------------------------------------------------------------


def recover(out_dir: Path) -> None:
    """Repair what an earlier run killed mid-publish left (call with the lock held): put an old
    folder back if OUT_DIR is missing, then remove leftover staging and old folders."""
    out = out_dir.resolve()
    olds = siblings(out_dir, OLD)
    if olds and not out.exists():
        os.rename(olds.pop(), out)
        fsync_dir(out.parent)
    for leftover in [*olds, *siblings(out_dir, STAGING)]:
        shutil.rmtree(leftover, ignore_errors=True)
    if out.is_dir():  # temporary folders of older reshard versions, inside OUT_DIR
        for old in out.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(old, ignore_errors=True)


def staging_dir(out_dir: Path, tag: str) -> Path:
    """Where a run builds its new OUT_DIR (created by the caller)."""
    return sibling(out_dir, STAGING, tag)


def make_dir(path: Path) -> None:
    """mkdir -p, with a failure told as an output error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {path}: {e.strerror or e}", "choose another folder") from e


def swap_in(staged: Path, out_dir: Path, *, ours: Callable[[str], bool], synced: Iterable[str] = ()) -> None:
    """Make `staged` OUT_DIR, atomically; files of the old OUT_DIR that `ours` does not claim (and
    the new folder lacks) are carried over. The old folder is removed afterwards. `synced`: files the
    caller already fsynced (the rank files), not synced again."""
    out = out_dir.resolve()
    if out.is_dir():
        for p in sorted(out.iterdir()):
            if not ours(p.name) and not (staged / p.name).exists() and not p.name.startswith(HIDDEN_PREFIX):
                _link_tree(p, staged / p.name)
    _fsync_tree(staged, skip=set(synced))
    old = sibling(out_dir, OLD, staged.name.rsplit(STAGING, 1)[-1])
    with _signals_held():
        if not out.exists():
            os.rename(staged, out)
        elif not _exchange(staged, out):
            os.rename(out, old)
            os.rename(staged, out)
            staged = old
        fsync_dir(out.parent)
    shutil.rmtree(staged, ignore_errors=True)


def _link_tree(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(src), str(dst))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _fsync_tree(root: Path, skip: set[str]) -> None:
    """Make every file and folder under `root` durable before it becomes visible as OUT_DIR."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path) or (folder == str(root) and name in skip):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C / SIGTERM wait until the swap is done (they are delivered right after)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def write_error(out_dir: Path, e: OSError) -> OutputError:
    """An OSError while writing into OUT_DIR, as the user-facing error."""
    if e.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {out_dir}", "free space or choose another OUT_DIR")
    return OutputError(f"cannot write {out_dir}: {e.strerror or e}")


def move_into(staged: Path, out_dir: Path, names: Iterable[str]) -> None:
    """Move `names` from `staged` into an existing OUT_DIR, replacing files of the same name (a
    `save --ranks` piece joining the others; the folder is complete only once assembled)."""
    out = out_dir.resolve()
    for name in names:
        dst = out / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        (staged / name).replace(dst)
    fsync_dir(out)
