"""The command's start-up, before any command runs: a memory limit that leaves no room to load its modules."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

MIB = 1 << 20


def _limited(args: list[str], limit: int) -> subprocess.CompletedProcess:
    """`reshard ARGS` under `ulimit -v` (RLIMIT_AS) of `limit` bytes."""
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
        env={**os.environ, "RESHARD_DISABLE_PROGRESS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _refused_or_done(p: subprocess.CompletedProcess) -> bool:
    """Exit 5 with one line saying out of memory and the same message in --json's object, or a run that worked."""
    if p.returncode == 0:
        return True
    message = p.stderr.removeprefix("reshard: error: ").rstrip("\n")
    error = {"code": 5, "kind": "OutputError", "message": message}
    return (
        p.returncode == 5
        and p.stderr.count("\n") == 1
        and message.startswith("out of memory")
        and json.loads(p.stdout) == {"ok": False, "error": error}
    )


def test_a_memory_limit_too_low_to_start_is_exit_5(tiny, tmp_path):
    """A `ulimit -v` that leaves no room for Python's imports (a MemoryError), for numpy's shared libraries
    (an ImportError: "failed to map segment") or for OpenBLAS's buffer (which ends the process from C with
    exit 1 and its own line): exit 5 and one line, under --json the error object too; never exit 1."""
    src = str(tiny("llama"))
    runs = {mib: _limited(["plan", src, "--tp", "2", "--json"], mib * MIB) for mib in range(24, 136, 8)}
    wrong = {mib: (p.returncode, p.stderr[-300:]) for mib, p in runs.items() if not _refused_or_done(p)}
    assert wrong == {}
    assert any(p.returncode == 5 for p in runs.values())


def test_torch_that_cannot_be_loaded_under_a_memory_limit_is_exit_5(tiny, tmp_path):
    """torch installed, but its libraries cannot be mapped under the limit (a cast needs it): exit 5, out of
    memory, not exit 3 saying torch is not installed."""
    pytest.importorskip("torch")
    src = str(tiny("llama"))
    runs = {
        mib: _limited(
            ["save", src, str(tmp_path / f"out{mib}"), "--tp", "2", "--dtype", "float16", "--json"], mib * MIB
        )
        for mib in (200, 300, 400)
    }
    wrong = {mib: (p.returncode, p.stderr[-300:]) for mib, p in runs.items() if not _refused_or_done(p)}
    assert wrong == {}
    assert any(p.returncode == 5 for p in runs.values())


# stderr that sends this process a second Ctrl-C as the error line is written (a double press)
_TWICE = """
import os, signal, sys
real = sys.stderr
class Twice:
    def write(self, s):
        if s.strip():
            os.kill(os.getpid(), signal.SIGINT)
        return real.write(s)
    def flush(self):
        real.flush()
    def isatty(self):
        return False
    def fileno(self):
        return real.fileno()
sys.stderr = Twice()
"""


@pytest.mark.parametrize("where", ["reshard.bulk.as_command", "reshard.settings.check_all"])
def test_a_second_ctrl_c_while_the_interrupt_is_told_changes_nothing(tiny, where):
    """A Ctrl-C while the modules import (as_command) or once the command started (check_all), and a second one
    while its line is written: exit 130 and that one line, not a traceback, exit 1 or death by SIGINT (-2)."""
    module, name = where.rsplit(".", 1)
    code = (
        f"{_TWICE}import {module}\n"
        "def stop():\n    raise KeyboardInterrupt\n"
        f"{module}.{name} = stop\n"
        f"sys.argv = ['reshard', 'plan', {str(tiny('llama'))!r}, '--tp', '2']\n"
        "from reshard.__main__ import run\n"
        "run()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr.count("\n")) == (130, 1) and p.stderr.startswith("reshard: error: interrupted"), (
        p.returncode,
        p.stderr,
    )
