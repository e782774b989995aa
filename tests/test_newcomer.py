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


def test_a_partition_other_than_vllms_default_is_in_the_serve_line(tiny, tmp_path):
    """vLLM splits the layers evenly unless VLLM_PP_LAYER_PARTITION says otherwise: the printed and
    recorded serve lines set it where --pp-layer-partition is not vLLM's own split, and only there.
    (Checked in vLLM CPU 0.32: the state it builds with the variable set is the folder's, byte for
    byte, for qwen3 at 1,3 and qwen3-moe TP 2 at 3,1.)"""
    import json

    from reshard.layout import default_partition

    assert default_partition(4, 2) == (2, 2) and default_partition(7, 3) == (2, 3, 2)
    assert default_partition(9, 4) == (2, 2, 3, 2) and default_partition(5, 4) == (1, 1, 2, 1)
    src = str(tiny("qwen3"))  # 4 layers
    for part, env in (("1,3", "VLLM_PP_LAYER_PARTITION=1,3 "), ("2,2", "")):
        out = tmp_path / part.replace(",", "-")
        code, stdout, err = run("save", src, str(out), "--pp", "2", "--pp-layer-partition", part)
        assert code == 0, err
        manifest = json.loads((out / "reshard.json").read_text())
        for key in ("serve", "serve_reshard"):
            line = manifest[key]
            assert line.startswith(f"{env}vllm serve "), line
            assert line in stdout
        code, stdout, _ = run("plan", src, "--pp", "2", "--pp-layer-partition", part)
        assert code == 0 and f"{env}vllm serve " in stdout and ("VLLM_PP" in stdout) == bool(env)


# A run in an install without torch: `import torch` fails as it would there.
NO_TORCH = "import sys; sys.modules['torch'] = None; sys.argv[0] = 'reshard'; from reshard.__main__ import run; run()"


def without_torch(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", NO_TORCH, *args]
    return subprocess.run(cmd, env={**os.environ, "RESHARD_DISABLE_PROGRESS": "1"}, capture_output=True, text=True)


def test_plan_save_verify_merge_need_no_torch(tiny, tmp_path):
    """torch is the `reshard[torch]` extra: the commands that only move bytes never import it."""
    src, out = str(tiny("qwen3")), tmp_path / "out"
    for args in (
        ["plan", src, "--tp", "2"],
        ["save", src, str(out), "--tp", "2"],
        ["verify", str(out), "--against", src, "--deep"],
        ["save", str(out), str(tmp_path / "tp1"), "--tp", "1"],
        ["merge", str(out), str(tmp_path / "hf")],
    ):
        p = without_torch(*args)
        assert p.returncode == 0, (args, p.stderr)


def test_a_cast_without_torch_says_how_to_install_it(tiny, tmp_path):
    out = tmp_path / "out"
    p = without_torch("save", str(tiny("qwen3")), str(out), "--tp", "2", "--dtype", "float16")
    assert p.returncode == 3, p.stderr
    assert p.stderr.count("\n") == 1 and "needs torch" in p.stderr, p.stderr
    assert "pip install 'reshard[torch]'" in p.stderr and "download.pytorch.org/whl/cpu" in p.stderr
    assert not out.exists()


def test_declared_dependencies():
    """torch is an extra (in `dev`, for the tests), huggingface_hub 2.x with the httpx2 reshard imports,
    the license an SPDX string (no setuptools deprecation warning at install)."""
    from pathlib import Path

    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    project = meta["project"]
    deps = project["dependencies"]
    assert not [d for d in deps if d.startswith("torch")]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.1"]
    assert "reshard[torch]" in project["optional-dependencies"]["dev"]
    assert "huggingface_hub>=2.0,<3" in deps and "httpx2>=2.0,<3" in deps
    assert project["license"] == "Apache-2.0"
    assert meta["build-system"]["requires"] == ["setuptools>=77"]


def test_shell_completion_as_the_readme_says():
    """`eval "$(_RESHARD_COMPLETE=bash_source reshard)"` (README): the script, then its answers."""
    p = cli(env={"_RESHARD_COMPLETE": "bash_source"})
    assert p.returncode == 0 and "_reshard_completion()" in p.stdout and "complete " in p.stdout
    p = cli(env={"_RESHARD_COMPLETE": "bash_complete", "COMP_WORDS": "reshard sa", "COMP_CWORD": "1"})
    assert p.returncode == 0 and p.stdout.split() == ["plain,save"], p.stdout
    p = cli(env={"_RESHARD_COMPLETE": "bash_complete", "COMP_WORDS": "reshard save --trust", "COMP_CWORD": "2"})
    assert p.stdout.split() == ["plain,--trust-remote-code"], p.stdout
    # "paths as files": every command's SOURCE / OUT_DIR / HF_DIR is completed by the shell as a file
    for words in ("reshard save x", "reshard save src x", "reshard plan x", "reshard verify x", "reshard merge x",
                  "reshard merge out x", "reshard assemble x"):  # fmt: skip
        env = {"_RESHARD_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        p = cli(env=env)
        assert p.stdout.split()[0].split(",")[0] in ("file", "dir"), (words, p.stdout)


def test_ranks_a_command_line_cannot_mean_are_usage_errors(tiny, tmp_path):
    """--ranks is known without the model (tp x pp are on the command line): a malformed list, a
    backwards range or a rank outside the layout is exit 2, one line saying what would do."""
    src = str(tiny("llama"))
    cases = (("x", "expected a list like 0-3"), ("1-0", "write it 0-1"), ("5", "ranks lie in 0..1"), ("", "no rank"))
    for spec, says in (*cases, (" ", "no rank"), (",", "expected a list like 0-3")):
        code, _, err = run("save", src, str(tmp_path / "out"), "--tp", "2", "--ranks", spec)
        assert code == 2 and says in err and err.count("\n") == 1, (spec, err)
    assert not (tmp_path / "out").exists()


def test_options_of_a_repo_id_given_for_a_folder_are_usage_errors(tiny, tmp_path):
    """--stream and --revision are a Hub repo id's: given with a local folder (or verify's --revision
    without --against) they would do nothing, and say so (exit 2) rather than being ignored."""
    src = str(tiny("llama"))
    for extra, says in (
        (["--stream"], "--stream applies to Hub repo ids"),
        (["--revision", "main"], "--revision applies"),
    ):
        code, _, err = run("save", src, str(tmp_path / "out"), "--tp", "2", *extra)
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    code, _, err = run("verify", str(tmp_path), "--revision", "main")
    assert code == 2 and "--against" in err, err
