"""Metadata of hundreds of thousands of tensors without the garbage collector's rescans (issue 28).

Headers, the plan, the schedule and the manifest of a 200k-tensor MoE are millions of small tuples
and records, built in one go and none of them part of a reference cycle. CPython's cyclic collector
would still walk every one of them each time a generation fills (its full collections, ever larger,
were about a quarter of `plan`'s time). `paused_gc()` turns it off while they are built.

When reshard runs as its own command (`python -m reshard`, the `reshard` script: `as_command()`),
leaving a paused block also moves everything alive into the permanent generation (`gc.freeze()`):
the metadata lives as long as the run, so the collections of the write phase never walk it again.
A library caller's objects are never frozen (their garbage would be kept for the life of the process).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_command = False


def as_command() -> None:
    """reshard is the process (its `__main__`): what a paused block leaves alive is frozen."""
    global _command
    _command = True


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting frees as always); nestable."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _command:
            gc.freeze()
        if was:
            gc.enable()
