"""Errors that reach the user: one line, a hint that says what to do, a documented exit code."""

from __future__ import annotations

import errno
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug in reshard: rerun with RESHARD_DEBUG=1 and report it
    USAGE = 2  # bad command line (click's own code) or a bad RESHARD_* value
    UNSUPPORTED = 3  # architecture, quantization or layout reshard/vLLM cannot produce
    BAD_SOURCE = 4  # source missing, incomplete or corrupt
    BAD_OUTPUT = 5  # output folder refused (not empty, inside source, disk full, permissions)
    LAYOUT_MISMATCH = 6  # verify: the folder is not the layout asked for / recorded
    CORRUPT = 7  # verify: missing, truncated or altered files
    INTERRUPTED = 130  # Ctrl-C; partial output removed


def printable(text: str) -> str:
    """`text` with each character a terminal or a log reader would act on written as a repr writes it (`\\x1b`,
    `\\n`, `\\r`, `\\u202e`): a path given on the command line, or a name from a hostile folder, cannot colour,
    erase or forge a line of reshard's output."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class ReshardError(Exception):
    """Base of every expected failure. `hint` says what the user can do about it."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(ReshardError):
    """A value the command line (or the environment) cannot mean, known before any file is read."""

    exit_code = ExitCode.USAGE


class SettingError(UsageError):
    """A RESHARD_* environment variable holds a value it does not accept: a usage error."""


class UnsupportedError(ReshardError):
    exit_code = ExitCode.UNSUPPORTED


class SourceError(ReshardError):
    exit_code = ExitCode.BAD_SOURCE


def unreadable_source(where: object, e: OSError) -> SourceError:
    """An I/O error reading the source (EIO, a stale or disconnected mount), naming what could not be read."""
    return SourceError(
        f"cannot read {e.filename or where}: {e.strerror or e}", "check the disk or mount the source is on, then rerun"
    )


def permission_denied(path: object) -> tuple[str, str]:
    """The message and hint of a file this user may not read: a permission to grant, not damage to repair."""
    return f"cannot read {path} (permission denied)", "give this user read access to it"


# What a shared library that cannot be mapped (numpy's, torch's, blake3's under a `ulimit -v`) or a thread that
# cannot start says; not glibc's "cannot allocate memory in static TLS block", which no memory limit causes.
_NO_MEMORY = ("failed to map segment", "cannot allocate memory", "can't start new thread")


def memory_refused(e: BaseException | None) -> bool:
    """Whether an error (or one it was raised from) says this process may not take more memory: a
    MemoryError, ENOMEM, a thread that cannot start, a module whose shared library cannot be mapped."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM):
            return True
        text = str(e).lower() if isinstance(e, (ImportError, RuntimeError)) else ""
        if "static tls" not in text and any(s in text for s in _NO_MEMORY):
            return True
        e = e.__cause__ or e.__context__
    return False


class OutputError(ReshardError):
    exit_code = ExitCode.BAD_OUTPUT


class CorruptError(ReshardError):
    exit_code = ExitCode.CORRUPT


class StdoutUnwritable(Exception):
    """stdout cannot be written (a file on a full disk, EIO): the command's result cannot be delivered.
    `notes`: those of the --json object that was lost, for stderr (reshard.cli); `failed`: why the command
    failed, where the result lost was a failure's (a failing verify's report), for the one error line."""

    def __init__(self, e: OSError, notes: list[str] | None = None) -> None:
        super().__init__(e.strerror or str(e))
        self.notes = list(notes or ())
        self.failed: str | None = None
