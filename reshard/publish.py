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

An OUT_DIR that is a mount point (a container volume) cannot be swapped: the folder beside it lies
on another filesystem. There the new files are staged in a hidden folder inside OUT_DIR and moved in
(`_publish_inside`): the previous manifest is removed first and the new one written last, so no half
state ever verifies; an interrupt between leaves a folder without a manifest (rerun save).

OUT_DIR's checks and lock are in `reshard.outdir`.

What was published is recorded (`published`) and checked on disk again after the fact, so an
interrupt that comes once the new output is in place is reported as such, not as "nothing published".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from reshard.format import fsync_dir
from reshard.names import (
    HIDDEN_PREFIX,
    LOCK,
    MANIFEST,
    OLD,
    STAGING,
    TMP_PREFIX,
    sibling,
    siblings,
)
from reshard.outdir import (
    check_apart,
    check_free_space,
    check_out_dir,
    check_writable,
    holds_cwd,
    is_mount,
    lock,
    make_dir,
    write_error,
)

# ---- the publish sequence -------------------------------------------------------------------------


@contextlib.contextmanager
def staged(
    out_dir: Path, tag: str, *, source: Path | None, overwrite: bool, need: int, label: str = "OUT_DIR"
) -> Iterator[Path]:
    """The one sequence that gets a new folder into OUT_DIR, for save, merge and assemble: lock
    OUT_DIR, repair what an interrupted run left, check it (`check_out_dir`: not inside `source`,
    empty unless `overwrite`) and its free space (`need` bytes), make the staging folder beside it,
    yield it; the caller fills it and publishes (`swap_in` or `move_into`) inside the block. A write
    error is told as an OutputError; the staging folder never outlives the block. OUT_DIR a mount
    point: the staging folder is made inside it (and `swap_in` moves the files in)."""
    check_apart(out_dir, source, label)  # before the lock's folder is made: a refused run touches no source
    with lock(out_dir):
        recover(out_dir)  # first: a folder an interrupted swap took away is put back
        check_out_dir(out_dir, source, overwrite, label)
        # staged inside it: beside it is another filesystem, or the shell that ran reshard stands in it
        inside = is_mount(out_dir) or holds_cwd(out_dir)
        base = out_dir.resolve() if inside else out_dir.resolve().parent
        make_dir(base)
        check_writable(out_dir, base)
        check_free_space(base, need)
        folder = staging_dir(out_dir, tag, inside=inside)
        make_dir(folder)
        try:
            yield folder
        except OSError as e:
            raise write_error(out_dir, e) from e
        finally:
            remove_tree(folder)


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
        remove_tree(leftover)
    if out.is_dir():  # staging folders of a mount point; temporary folders of older reshard versions
        for old in [*out.glob(f"{STAGING}*"), *out.glob(f"{TMP_PREFIX}*")]:
            remove_tree(old)


def staging_dir(out_dir: Path, tag: str, *, inside: bool = False) -> Path:
    """Where a run builds its new OUT_DIR (created by the caller): beside it, or inside a mount point."""
    return out_dir.resolve() / f"{STAGING}{tag}" if inside else sibling(out_dir, STAGING, tag)


def swap_in(staged: Path, out_dir: Path, *, ours: Callable[[str], bool], synced: Iterable[str] = ()) -> None:
    """Make `staged` OUT_DIR, atomically; files of the old OUT_DIR that `ours` does not claim (and
    the new folder lacks) are carried over. The old folder is removed afterwards. `synced`: files the
    caller already fsynced (the rank files), not synced again."""
    out = out_dir.resolve()
    if staged.parent == out:
        _publish_inside(staged, out, ours=ours, synced=synced)
        return
    with contextlib.ExitStack() as nested:
        if out.is_dir():
            for p in sorted(out.iterdir()):
                if not ours(p.name) and not (staged / p.name).exists() and not p.name.startswith(HIDDEN_PREFIX):
                    if _is_output(p):  # held until the swap: its own run must not publish into the copy's past
                        nested.enter_context(lock(p))
                    _link_tree(p, staged / p.name)
        _fsync_tree(staged, skip=set(synced))
        _swap(staged, out_dir, out)


def _is_output(p: Path) -> bool:
    """A folder holding a reshard output, or one a reshard run is writing (its lock beside it)."""
    return p.is_dir() and not p.is_symlink() and ((p / MANIFEST).exists() or sibling(p, LOCK).exists())


def _swap(staged: Path, out_dir: Path, out: Path) -> None:
    """`staged` in OUT_DIR's place, atomically where the file system allows; the old folder removed."""
    old = sibling(out_dir, OLD, staged.name.rsplit(STAGING, 1)[-1])
    new = os.stat(staged).st_ino
    with signals_held():
        if not out.exists():
            os.rename(staged, out)
        elif not _exchange(staged, out):
            os.rename(out, old)
            try:
                os.rename(staged, out)
            except OSError:  # OUT_DIR would be missing: the previous output back in its place
                with contextlib.suppress(OSError):
                    os.rename(old, out)
                raise
            staged = old
        fsync_dir(out.parent)
        _claim(out, out, new)
    remove_tree(staged)


def _publish_inside(staged: Path, out: Path, *, ours: Callable[[str], bool], synced: Iterable[str]) -> None:
    """OUT_DIR a mount point: the previous manifest goes first (OUT_DIR no longer verifies), then
    reshard's old files, then the new files are moved in, the manifest last. Signals wait meanwhile;
    a kill leaves a folder without a manifest, which the next save repairs; a failing move puts every
    file moved back, the previous manifest last."""
    _fsync_tree(staged, skip=set(synced))
    names = set(p.name for p in staged.iterdir() if p.name != MANIFEST)
    manifest = staged / MANIFEST
    new = manifest.stat().st_ino if manifest.exists() else None
    # the old files are moved aside into the staging folder (renames: the window without a manifest does
    # not grow with the output's size, as freeing GBs of rank files in it did) and freed after it
    aside = staged / f"{OLD}{out.name}"
    aside.mkdir()
    moved: list[tuple[Path, Path]] = []  # each rename done, undone in reverse if one fails

    def move(a: Path, b: Path) -> None:
        os.replace(a, b)
        moved.append((a, b))

    with signals_held():
        try:
            if (out / MANIFEST).exists():  # first: OUT_DIR no longer verifies; put back last on a failure
                move(out / MANIFEST, aside / MANIFEST)
            fsync_dir(out)
            for p in sorted(out.iterdir()):
                if p.name.startswith(HIDDEN_PREFIX):
                    continue
                if p.name in names or (ours(p.name) and not (staged / p.name).exists()):
                    if p.is_dir() and not p.is_symlink():  # a folder moves to another only where it may be written
                        _own_writable(p)
                    move(p, aside / p.name)
            for name in sorted(names):
                move(staged / name, out / name)
            fsync_dir(out)
            if new is not None:
                move(manifest, out / MANIFEST)
                fsync_dir(out)
        except OSError:  # the previous output back as it was, its manifest last (best effort)
            for a, b in reversed(moved):
                with contextlib.suppress(OSError):
                    os.replace(b, a)
            with contextlib.suppress(OSError):
                fsync_dir(out)
            raise
        if new is not None:
            _claim(out, out / MANIFEST, new)
        else:
            _claim(out, out, out.stat().st_ino)
    remove_tree(staged)


def remove_tree(path: Path) -> None:
    """Remove a folder reshard made or replaces (a staging or old folder, a copied folder), best effort:
    its folders made writable first, so that one copied read-only from a source (`chmod -R a-w`, mode 555),
    or made so during a run, does not stay behind (rmtree cannot empty a folder it may not write)."""
    with contextlib.suppress(OSError):
        _own_writable(path)
        for root, dirs, _ in os.walk(path):  # top-down: each folder opened up before it is entered
            for d in dirs:
                with contextlib.suppress(OSError):
                    _own_writable(Path(root, d))
    shutil.rmtree(path, ignore_errors=True)


def _own_writable(p: Path) -> None:
    st = os.lstat(p)
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
        os.chmod(p, stat.S_IMODE(st.st_mode) | 0o700)


# ---- what was published, checked after the fact -----------------------------------------------------

_WHOLE = "this run's new output, complete"
_claims: list[tuple[Path, Path, int, str]] = []


def _claim(out: Path, path: Path, inode: int, what: str = _WHOLE) -> None:
    """This run put `path` (inode `inode`) in place: `out` holds `what`."""
    _claims.append((out, path, inode, what))


_checked_claims: list[tuple[str, Callable[[], bool]]] = []


def claim_checked(text: str, still: Callable[[], bool]) -> None:
    """This run published `text` ("<where> holds <what>") somewhere not on this disk (a bucket);
    `still()` says whether it is still there."""
    _checked_claims.append((text, still))


def forget() -> None:
    """A new run starts in this process: nothing published yet."""
    _claims.clear()
    _checked_claims.clear()


def published() -> list[str]:
    """What this process published and is still there (each checked on disk now, by inode), as
    "<folder> holds <what>": what an interrupt that came after publishing leaves."""
    out: list[str] = []
    for folder, path, inode, what in _claims:
        with contextlib.suppress(OSError):
            if os.stat(path, follow_symlinks=False).st_ino == inode and f"{folder} holds {what}" not in out:
                out.append(f"{folder} holds {what}")
    for text, still in _checked_claims:
        with contextlib.suppress(Exception):
            if still() and text not in out:
                out.append(text)
    return out


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
def signals_held() -> Iterator[None]:
    """Ctrl-C / SIGTERM / SIGHUP wait until the swap is done (they are acted on right after).

    Python runs signal handlers in the main thread whichever thread the kernel gave the signal to
    (a pool thread of an upload, a library's own thread), so masking the main thread alone does not
    hold them: the handlers themselves are swapped for one that notes the signal."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread (and only it gets the exceptions)
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s in sigs:
            signal.signal(s, old[s])
        if got:
            handler = old[got[0]]
            if callable(handler):
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


def move_into(staged: Path, out_dir: Path, names: Iterable[str], *, last: Path) -> None:
    """Move `names` from `staged` into an existing OUT_DIR, replacing files of the same name, then
    `last` (a file in `staged`: the piece manifest), signals held meanwhile (a `save --ranks` piece
    joining the others; the folder is complete only once assembled)."""
    out = out_dir.resolve()
    with signals_held():
        for name in names:
            dst = out / name
            if dst.is_dir() and not dst.is_symlink():
                remove_tree(dst)
            (staged / name).replace(dst)
        fsync_dir(out)
        inode = last.stat().st_ino
        last.replace(out / last.name)
        fsync_dir(out)
        _claim(out, out / last.name, inode, f"this piece ({MANIFEST} appears once every piece is in)")
