"""Every `RESHARD_*` environment variable: declared once here, read when used, validated.

Each `Setting` has a name, a default, what it accepts and a one-line doc. `Setting.get()` reads the
environment at the moment it is called (never at import), so a value set after reshard was
imported counts; an unset or empty variable is the default. A value the setting does not accept
raises `SettingError` (exit 2), one line naming the variable and what it accepts. The CLI calls
`check_all()` before a command runs, so a bad value fails at the start and not midway through a save.

Nothing else in reshard reads a `RESHARD_*` variable (tests/test_structure.py checks it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from reshard.errors import SettingError

T = TypeVar("T")

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable. `parse` turns a (stripped, non-empty) value into the setting's value,
    or raises ValueError saying what is wrong with it ("is not a whole number")."""

    name: str
    default: T
    accepts: str  # what a value may be: "a whole number >= 0"
    doc: str  # what it changes: "retries of a failing Hub request"
    parse: Callable[[str], T]

    def get(self) -> T:
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError as e:
            raise SettingError(f"{self.name}={raw!r} {e}", self.describe()) from None

    def describe(self) -> str:
        """One line: the name, what it does, what it accepts and the default."""
        d = self.default
        shown = ("1" if d else "0") if isinstance(d, bool) else f"{d:g}" if isinstance(d, float) else str(d)
        return f"{self.name}: {self.doc}, {self.accepts}; default {shown}"


def _flag(value: str) -> bool:
    v = value.lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError("is not a flag")


def _whole(least: int, most: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise ValueError("is not a whole number") from None
        if n < least:
            raise ValueError(f"is less than {least}")
        if most is not None and n > most:
            raise ValueError(f"is more than {most}")
        return n

    return parse


def _seconds(positive: bool) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise ValueError("is not a number of seconds") from None
        if not math.isfinite(x):
            raise ValueError("is not a finite number of seconds")
        if x < 0 or (positive and x == 0):
            raise ValueError("is not more than 0" if positive else "is less than 0")
        return x

    return parse


def _direct_reads(value: str) -> str:
    v = value.lower()
    if v == "auto":
        return "auto"
    if v in _TRUE or v in _FALSE:
        return "1" if v in _TRUE else "0"
    raise ValueError("is not auto, 1 or 0")


FLAG = "1 (also true, yes) or 0 (also false, no)"

DEBUG = Setting("RESHARD_DEBUG", False, FLAG, "show the traceback of an error", _flag)
DISABLE_PROGRESS = Setting("RESHARD_DISABLE_PROGRESS", False, FLAG, "no progress output on stderr", _flag)
O_DIRECT = Setting(
    "RESHARD_O_DIRECT", True, FLAG, "write output files with O_DIRECT where possible (0: buffered)", _flag
)
DIRECT_READS = Setting(
    "RESHARD_DIRECT_READS",
    "auto",
    "auto (those not in the page cache), 1 (all; also true, yes) or 0 (none; also false, no)",
    "which files are read with O_DIRECT: save's sources, the files verify hashes, the loader plugin's",
    _direct_reads,
)
HUB_CONNECTIONS = Setting(
    "RESHARD_HUB_CONNECTIONS", 8, "a whole number >= 1", "HTTP connections at once to a Hub repo", _whole(1)
)
HUB_RETRIES = Setting("RESHARD_HUB_RETRIES", 8, "a whole number >= 0", "retries of a failing Hub request", _whole(0))
HUB_BACKOFF = Setting(
    "RESHARD_HUB_BACKOFF",
    0.5,
    "seconds >= 0",
    "first wait before retrying a Hub request (doubled each time, at most 30 s)",
    _seconds(positive=False),
)
HUB_TIMEOUT = Setting(
    "RESHARD_HUB_TIMEOUT",
    60.0,
    "seconds > 0",
    "a Hub request fails after this long without a byte",
    _seconds(positive=True),
)
HUB_MIN_SPEED = Setting(
    "RESHARD_HUB_MIN_SPEED",
    64 << 10,
    "a whole number of bytes per second >= 0",
    "a Hub body slower than this after its first RESHARD_HUB_TIMEOUT is retried (0: no floor)",
    _whole(0),
)
HUB_SMALL = Setting(
    "RESHARD_HUB_SMALL",
    1 << 20,
    "a whole number of bytes >= 0",
    "Hub tensors smaller than this, side by side in a file, are fetched together (0: each its own request)",
    _whole(0),
)
STREAM_SPILL = Setting(
    "RESHARD_STREAM_SPILL",
    8 << 30,
    "a whole number of bytes >= 0",
    "with --stream, bytes read ahead of a file's sha256 kept on disk in the temp folder (TMPDIR) rather than "
    "fetched a second time (0: none; at most half the folder's free space, none where it is in memory)",
    _whole(0),
)
S3_CONCURRENCY = Setting(
    "RESHARD_S3_CONCURRENCY",
    8,
    "a whole number >= 1",
    "parts uploaded to object storage at once (each holds RESHARD_S3_PART_SIZE bytes in memory)",
    _whole(1),
)
S3_PART_SIZE = Setting(
    "RESHARD_S3_PART_SIZE",
    16 << 20,
    "a whole number of bytes from 5242880 to 5368709120 (S3's smallest and largest part)",
    "bytes per part of an object storage upload (grown for files over 10000 parts); each file being "
    "uploaded holds one part buffer",
    _whole(5 << 20, 5 << 30),
)
S3_RETRIES = Setting(
    "RESHARD_S3_RETRIES", 8, "a whole number >= 0", "retries of a failing object storage request", _whole(0)
)
S3_TIMEOUT = Setting(
    "RESHARD_S3_TIMEOUT",
    60.0,
    "seconds > 0",
    "an object storage connection or read fails after this long without progress",
    _seconds(positive=True),
)

ALL: tuple[Setting, ...] = (
    DEBUG,
    DISABLE_PROGRESS,
    O_DIRECT,
    DIRECT_READS,
    HUB_CONNECTIONS,
    HUB_RETRIES,
    HUB_BACKOFF,
    HUB_TIMEOUT,
    HUB_MIN_SPEED,
    HUB_SMALL,
    STREAM_SPILL,
    S3_CONCURRENCY,
    S3_PART_SIZE,
    S3_RETRIES,
    S3_TIMEOUT,
)


def check_all() -> None:
    """Read every setting once: the first bad value raises SettingError."""
    for setting in ALL:
        setting.get()
