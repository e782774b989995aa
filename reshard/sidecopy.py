"""Copying a source's side files (config, tokenizer, ...) without trusting what the folder holds.

A side file that is a symlink is copied (as a regular file holding the target's bytes) only when its
target lies inside the source: the source folder itself or, for a Hugging Face cache snapshot, the
cache folder of its repo (`models--ORG--NAME`, whose snapshots link into `../../blobs/`). A link
that leads elsewhere (a secret, `/dev/zero`) and any special file (FIFO, device, socket) is refused
with a SourceError (exit 4) naming it: nothing outside the source is read, nothing blocks.

A copied folder's weight files (`WEIGHT_SUFFIXES`: a Llama download's `original/consolidated.00.pth`,
the same weights in Meta's format, 16 GB for an 8B model) are left out: vLLM reads the rank files.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from reshard.errors import SourceError
from reshard.format import kind, open_regular
from reshard.names import WEIGHT_SUFFIXES

HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")  # the Hub cache's repo folders


def allowed_roots(src: Path) -> list[Path]:
    """Where a side file's symlink may lead: the source, and the Hub cache repo folder it lies in."""
    root = src.resolve()
    roots = [root]
    for parent in root.parents:
        if parent.name.startswith(HF_REPO_PREFIXES):
            roots.append(parent)
            break
    return roots


def check_side_file(src: Path, path: Path, roots: list[Path] | None = None) -> Path:
    """The real path of the side file (or folder) `path` of source `src`: inside the source, and a
    regular file or folder. Raises SourceError naming it otherwise."""
    roots = roots or allowed_roots(src)
    name = _shown(src, path)
    try:
        st = path.lstat()
        real = path.resolve(strict=True) if stat.S_ISLNK(st.st_mode) else path
        if stat.S_ISLNK(st.st_mode):
            if not any(real == r or real.is_relative_to(r) for r in roots):
                raise SourceError(
                    f"{src}: side file {name} is a symlink to {real}, outside the source: not copied",
                    "replace the link with the file itself, or remove it",
                )
            st = real.stat()
    except RuntimeError as e:  # Path.resolve's "Symlink loop" (Python < 3.13)
        raise SourceError(f"{src}: side file {name} is a symlink loop ({e})", _FIX) from e
    except OSError as e:
        raise SourceError(f"{src}: cannot read side file {name} ({e.strerror or e})", _FIX) from e
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise SourceError(
            f"{src}: side file {name} is not a regular file ({kind(st.st_mode)}): not copied",
            "remove it from the source folder",
        )
    return real


_FIX = "replace it with the file itself, or remove it from the source folder"


def copy_side_files(src: Path, names: list[str], dst: Path) -> None:
    """Copy `names` (files and folders) from `src` into `dst` as regular files, keeping times and
    modes (a folder's with the owner's rwx added); every file checked by `check_side_file` first.
    Raises SourceError for a refused or unreadable source file, OSError for a failed write."""
    roots = allowed_roots(src)
    for name in names:
        _copy(src, src / name, dst / name, roots, ())


def _copy(src: Path, path: Path, to: Path, roots: list[Path], above: tuple[Path, ...]) -> None:
    real = check_side_file(src, path, roots)
    if real.is_dir():
        here = real.resolve()
        if here in above:  # a link to a folder it lies in (`x/up -> ..`): copied, it would never end
            raise SourceError(f"{src}: side folder {_shown(src, path)} is a link back to a folder above it", _FIX)
        to.mkdir(exist_ok=True)
        for child in sorted(real.iterdir()):
            if child.name.endswith(WEIGHT_SUFFIXES):  # weights in another format (Llama's original/*.pth)
                continue
            _copy(src, path / child.name, to / child.name, roots, (*above, here))
        shutil.copystat(real, to)
        # always the owner's to write: a copied folder read-only (a `chmod -R a-w` source, mode 555) could not
        # be moved into OUT_DIR nor removed by the next save, and the previous output was lost to it
        os.chmod(to, stat.S_IMODE(os.stat(to).st_mode) | 0o700)
        return
    try:
        fd = open_regular(real, follow=False)  # swapped for a link or a FIFO since the check: refused
    except OSError as e:
        raise SourceError(f"{src}: cannot read side file {_shown(src, path)} ({e.strerror or e})") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        with open(to, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)  # type: ignore[misc]
    os.chmod(to, stat.S_IMODE(st.st_mode))
    os.utime(to, ns=(st.st_atime_ns, st.st_mtime_ns))


def _shown(src: Path, path: Path) -> str:
    try:
        return path.relative_to(src).as_posix()
    except ValueError:
        return str(path)
