"""Where output goes: results on stdout, progress and logs on stderr."""

from __future__ import annotations

import contextlib
import errno
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console

from reshard import settings
from reshard.errors import StdoutUnwritable, printable

if TYPE_CHECKING:
    from reshard.checkpoint import Downloads


class _Console(Console):
    """rich's Console, but a closed pipe does not exit 1 (rich's default): a closed stderr silences
    the progress and the run goes on; a closed stdout raises BrokenPipeError, which the CLI ends
    quietly with 141 (reshard.cli)."""

    def render_str(self, text: str, *args, **kwargs):  # every str printed, a table's cells too
        """A path or name with control characters (`\\x1b[31m`, a line break) is shown escaped, never acted on."""
        return super().render_str(printable(text), *args, **kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        if not self.stderr:
            raise BrokenPipeError(errno.EPIPE, "stdout closed")

    def _check_buffer(self) -> None:  # rich's write of its buffer, which catches BrokenPipeError only
        try:
            super()._check_buffer()
        except BrokenPipeError:
            raise
        except OSError as e:  # a full disk, EIO: a log that cannot be written never ends the run
            self.quiet = True
            if not self.stderr:
                raise StdoutUnwritable(e) from e


def _result_width() -> int | None:
    """The width results are laid out in: a terminal's own (None: rich asks it, or COLUMNS); a file
    or pipe has none, so wide enough that no table is squeezed (COLUMNS=20 in a CI job's
    environment emptied the tables' cells into `…`)."""
    try:
        return None if sys.stdout.isatty() else 1000
    except (AttributeError, ValueError):
        return 1000


def _log_file() -> bool:
    """stderr is a file or pipe (a CI log): its lines are not wrapped, so that a note or warning stays one
    line to grep whatever the length of the paths in it."""
    try:
        return not sys.stderr.isatty()
    except (AttributeError, ValueError):
        return True


stderr = _Console(stderr=True, highlight=False, soft_wrap=_log_file())
stdout = _Console(highlight=False, soft_wrap=True, width=_result_width())


def log_line(text: str) -> None:
    """One line on stderr, written at once (print() writes the text and its newline apart, and threads log
    together), its control characters escaped; a log that cannot be written (a full disk, a collector gone:
    EPIPE) never ends the run."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(printable(text) + "\n")
        sys.stderr.flush()


class _Notes:
    """`note:` lines (how the command went about it: what it checked, what it left): printed on stderr as they
    come, or, under --json, kept for the command's JSON object (`notes`), so that stdout holds the one object
    and stderr nothing but an error line. Set per command run (`keep_notes`, by the CLI)."""

    kept: list[str] | None = None


def keep_notes(as_json: bool) -> None:
    """A command starts: its notes are printed (as_json False) or kept for its JSON object."""
    _Notes.kept = [] if as_json else None


def note(line: str) -> None:
    """One `note:` line: on stderr, or kept under --json (`kept_notes`)."""
    kept = _Notes.kept
    if kept is not None:
        kept.append(line)
        return
    with contextlib.suppress(OSError, ValueError):  # a stderr closed or full: the run goes on
        stderr.print(f"note: {line}", markup=False, highlight=False)


def kept_notes() -> list[str]:
    """The notes kept under --json since the last call, for the JSON object the command prints."""
    kept = _Notes.kept
    if kept is None:
        return []
    got = list(kept)
    kept.clear()
    return got


def release_notes(lost: list[str] | None = None) -> None:
    """The notes kept so far on stderr, and the next ones as they come: a command that prints no JSON
    object after all (a torchrun process other than 0: process 0 reports), or whose object could not be
    written (`lost`: the notes it held, said first)."""
    lines = [*(lost or ()), *kept_notes()]
    _Notes.kept = None
    for line in lines:
        note(line)


def progress_disabled() -> bool:
    return settings.DISABLE_PROGRESS.get()


def emit_json(obj: object) -> None:
    try:
        sys.stdout.write(json.dumps(obj, indent=1) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:  # its notes are not lost with it: the CLI says them on stderr
        notes = obj.get("notes") if isinstance(obj, dict) else None
        raise StdoutUnwritable(e, notes if isinstance(notes, list) else None) from e


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


@contextmanager
def byte_progress(
    total: int, label: str, *, quiet: bool, downloads: Downloads | None = None
) -> Iterator[Callable[[int], None]]:
    """A callback advancing a bytes progress bar on stderr (rich on a terminal, plain lines else).

    downloads: a meter (`.done`, `.total` bytes) of a source being downloaded meanwhile; it gets
    its own row (bytes and rate) on the same display.
    """
    if quiet or progress_disabled() or total <= 0:
        yield lambda n: None
        return
    if stderr.is_terminal:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        cols = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*cols, console=stderr, transient=False) as bar:
            got = bar.add_task("downloading", total=downloads.total or None) if downloads else None
            task = bar.add_task(label, total=total)

            def advance(n: int) -> None:
                bar.advance(task, n)
                if got is not None and downloads is not None:
                    bar.update(got, completed=downloads.done, total=downloads.total or None)

            yield advance
            if got is not None and downloads is not None:
                bar.update(got, completed=downloads.done, total=downloads.done)
        return
    state = {"done": 0, "shown": time.monotonic(), "start": time.monotonic()}

    def advance(n: int) -> None:
        state["done"] += n
        now = time.monotonic()
        if now - state["shown"] >= 5 or state["done"] >= total:
            state["shown"] = now
            secs = max(now - state["start"], 1e-9)
            rate = state["done"] / secs
            pct = 100 * state["done"] / total
            line = f"{label}: {human_bytes(state['done'])} / {human_bytes(total)} ({pct:.0f}%, {human_bytes(rate)}/s)"
            if downloads is not None:
                got = downloads.done
                line += f"; downloaded: {human_bytes(got)} ({human_bytes(got / secs)}/s)"
            # a log that cannot be written (a full disk, a collector gone: EPIPE) never ends the run
            with contextlib.suppress(OSError, ValueError):
                print(line, file=sys.stderr, flush=True)

    yield advance
