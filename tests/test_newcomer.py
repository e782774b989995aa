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


def test_device_without_it_is_unsupported_here(tiny, tmp_path):
    """--device cuda on a machine without CUDA: exit 3 (not available here), nothing written."""
    import torch

    if torch.cuda.is_available():
        return  # this machine has the device: nothing to refuse
    out = tmp_path / "out"
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2", "--device", "cuda")
    assert code == 3, err
    assert "--device cuda is not available here" in err and "use --device cpu" in err
    assert not out.exists()


def test_pp_layer_partition_usage_is_2_and_a_misfit_is_3(tiny):
    """Malformed or not one count per stage (known without the model): usage, exit 2; counts that do
    not add up to the model's layers: unsupported, exit 3."""
    src = str(tiny("llama"))
    for bad in ("5,-1", "x", "1,1,1"):
        code, _, err = run("plan", src, "--pp", "2", "--pp-layer-partition", bad)
        assert code == 2 and "--pp-layer-partition" in err and err.count("\n") == 1, (bad, err)
    code, _, err = run("plan", src, "--pp", "2", "--pp-layer-partition", "1,1")
    assert code == 3 and "sums to 2, the model has" in err, err
