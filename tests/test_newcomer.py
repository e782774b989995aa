"""A newcomer's first runs (issue 24's papercuts): bare `reshard`, serve lines that paste into a shell,
exit codes of --device and --pp-layer-partition, shell completion, the install's declared dependencies."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from tests.fixtures.cli import run


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args], env={**os.environ, **(env or {})}, capture_output=True, text=True
    )


def test_bare_reshard_prints_the_help_and_exits_2():
    """No command: the help laid out as `--help` does (not folded into one error line), on stderr, exit 2."""
    p = cli()
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith("Usage: reshard [OPTIONS] COMMAND [ARGS]...\n")
    assert "\nCommands:\n" in p.stderr and not p.stderr.startswith("reshard: error")


def test_serve_line_quotes_a_folder_with_spaces(tiny, tmp_path):
    out = tmp_path / "my models" / "qwen3 tp2"
    code, stdout, stderr = run("save", str(tiny("qwen3")), str(out), "--tp", "2", "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    for line in (result["serve"], result["serve_reshard"]):
        assert shlex.split(line)[:3] == ["vllm", "serve", str(out)], line
    code, stdout, _ = run("plan", str(tiny("qwen3")), "--tp", "2", "--out-dir", "a b", "--json")
    assert code == 0 and shlex.split(json.loads(stdout)["serve"])[2] == "a b"
