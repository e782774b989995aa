"""The command line: exit codes and one-line errors for bad input, JSON for CI, no half-written output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.cli import run
from tests.fixtures.saving import save


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_save_json_and_manifest(tiny, tmp_path):
    src = tiny("llama")
    code, out, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["ok"] and result["files"] == 2 and result["layout"]["tp"] == 2 and result["complete"] is True
    assert result["bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("model-rank-*"))
    assert result["serve"].startswith(f"vllm serve {tmp_path / 'out'} --load-format sharded_state")
    # merge's bytes are on disk too, as save's (the index's total_size is the tensors': tensor_bytes)
    code, out, err = run("merge", str(tmp_path / "out"), str(tmp_path / "hf"), "--max-shard-size", "200KB", "--json")
    merged = json.loads(out)
    assert code == 0 and merged["bytes"] == sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert merged["tensor_bytes"] == index["metadata"]["total_size"] < merged["bytes"]
    manifest = json.loads((tmp_path / "out" / "reshard.json").read_text())
    assert manifest["layout"]["architecture"] == "LlamaForCausalLM"
    assert manifest["source"]["path"] == str(src.resolve())
    assert {f["name"] for f in manifest["files"]} == {
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    }


def test_plan_json_lists_ranks(tiny):
    code, out, _ = run("plan", str(tiny("qwen3")), "--tp", "4", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["ok"] is True  # as on failure, and as every command's --json
    assert len(plan["ranks"]) == 4 and all(r["keys"] == plan["ranks"][0]["keys"] for r in plan["ranks"])
    assert "--tensor-parallel-size 4" in plan["serve"]


def test_unknown_architecture(tiny, tmp_path):
    src = copy_ckpt(tiny("llama"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 3
    assert "unsupported architecture (FancyNewForCausalLM)" in err and "LlamaForCausalLM" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_tp_that_does_not_divide(tiny, tmp_path):
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "3")
    assert code == 3 and "not divisible by --tp 3" in err and "1, 2, 4, 8" in err


def test_missing_shard(tiny, tmp_path):
    src = copy_ckpt(tiny("llama", shards=3), tmp_path / "src")
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and victim.name in err and "missing" in err


@pytest.mark.parametrize("cut", [4, 200], ids=["length-field", "header"])
def test_truncated_header(tiny, tmp_path, cut):
    src = copy_ckpt(tiny("llama"), tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:cut])
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and "model.safetensors" in err and ("truncated" in err or "corrupt" in err)


def test_out_dir_inside_source(tiny, tmp_path):
    src = copy_ckpt(tiny("llama"), tmp_path / "src")
    code, _, err = run("save", str(src), str(src / "out"), "--tp", "2")
    assert code == 5 and "inside the source" in err
    code, _, err = run("save", str(src), str(src), "--tp", "2")
    assert code == 5


def test_non_empty_out_dir_needs_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-rank-7-part-0.safetensors").write_bytes(b"old")
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 5 and "--overwrite" in err
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2", "--overwrite")
    assert code == 0, err
    # the stale rank file of the older run is gone
    assert sorted(p.name for p in out.glob("model-rank-*")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]


def test_interrupt_leaves_nothing_that_looks_complete(tiny, tmp_path, monkeypatch):
    import reshard.io.writer as ex

    calls = {"n": 0}
    real = ex.FileWriter.write

    def flaky(self, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(ex.FileWriter, "write", flaky)
    out = tmp_path / "out"
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 130 and "interrupted" in err
    # OUT_DIR as it was (absent), and no staging folder or lock left beside it
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_previous_output(tiny, tmp_path, monkeypatch):
    import reshard.io.writer as ex

    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(self, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(ex.FileWriter, "write", boom)
    code, _, _ = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
    assert code == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_disk_full(tiny, tmp_path, monkeypatch):
    import reshard.io.writer as ex

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ex.FileWriter, "write", full)
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2")
    assert code == 5 and "disk full" in err
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing left beside OUT_DIR


def test_not_enough_space_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    import reshard.publish as pub

    monkeypatch.setattr(pub.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2")
    assert code == 5 and "not enough disk space" in err


# ---- Hub repo ids, resolved offline from a cache the test lays out ---------------------------------


def lay_out_hub_cache(hf_home: Path, repo_id: str, src: Path, commit: str = "a" * 40) -> str:
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return commit


def cli_subprocess(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args], env={**os.environ, **env}, capture_output=True, text=True
    )


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_run_changes_nothing(tiny, tmp_path, sig):
    """A Ctrl-C or SIGTERM that lands while the interpreter exits (here: from an atexit hook, after
    the save finished) neither prints a traceback nor replaces exit 0 with death by the signal."""
    out = tmp_path / "out"
    code = (
        "import atexit, os, signal, sys\n"
        f"atexit.register(lambda: (os.kill(os.getpid(), signal.{sig}), print('sent', file=sys.stderr)))\n"
        f"sys.argv = ['reshard', 'save', {str(tiny('llama'))!r}, {str(out)!r}, '--tp', '2']\n"
        "from reshard.__main__ import run\n"
        "run()\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "RESHARD_DISABLE_PROGRESS": "1"},
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "sent" in p.stderr and "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert run("verify", str(out))[0] == 0


@pytest.mark.parametrize("as_json", [False, True])
def test_an_interrupt_while_importing_is_exit_130_and_json_too(tmp_path, as_json):
    """A Ctrl-C that lands while reshard's modules are still importing (here: raised by the first
    reshard import, as a signal there would): exit 130, one error line, and under --json the one
    object on stdout every failure gives."""
    code = (
        "import sys, reshard.bulk\n"
        "def stop(): raise KeyboardInterrupt\n"
        "reshard.bulk.as_command = stop\n"
        f"sys.argv = ['reshard', 'plan', {str(tmp_path)!r}] + {['--json'] if as_json else []!r}\n"
        "from reshard.__main__ import run\n"
        "run()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 130 and p.stderr.startswith("reshard: error: interrupted") and p.stderr.count("\n") == 1
    if as_json:
        assert json.loads(p.stdout)["error"] == {"code": 130, "kind": "interrupted", "message": p.stderr[16:].strip()}
    else:
        assert p.stdout == ""


def test_repo_id_offline_from_cache(tiny, tmp_path):
    commit = lay_out_hub_cache(tmp_path / "hf", "acme/tiny-llama", tiny("llama", shards=2))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "RESHARD_DISABLE_PROGRESS": "1"}
    out = tmp_path / "out"
    p = cli_subprocess(["save", "acme/tiny-llama", str(out), "--tp", "2", "--json"], env)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["source"] == {"repo_id": "acme/tiny-llama", "revision": "main", "commit": commit}
    p = cli_subprocess(["plan", "acme/tiny-llama", "--tp", "2", "--json"], env)
    assert p.returncode == 0 and json.loads(p.stdout)["source"]["commit"] == commit


def test_repo_id_not_in_cache_while_offline(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    p = cli_subprocess(["save", "acme/absent", str(tmp_path / "out"), "--tp", "2"], env)
    assert p.returncode == 4
    assert "not in the Hugging Face cache" in p.stderr and "hf download" in p.stderr
    assert p.stderr.count("\n") == 1


def test_help_explains_commands():
    code, out, _ = run("--help")
    assert code == 0 and "sharded_state" in out and "Exit codes" in out
    code, out, _ = run("save", "--help")
    assert code == 0 and "--max-part-size" in out and "--ep" in out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_the_run_is_one_error_line(tmp_path, sig):
    """A real Ctrl-C, SIGTERM or SIGHUP (a closed terminal or ssh session) while a save waits (here: a
    torchrun rendezvous no other process joins, which waited in C++ and ignored both): exit 130, and stderr is
    that one line, with no blank line before it (click's, for a terminal's `^C` echo) when stderr is not a
    terminal. (SIGHUP ended the process with 129 and left its staging folder and lock behind.)"""
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {**os.environ, **env, "RESHARD_DISABLE_PROGRESS": "1"}
    src = tmp_path / "src"
    src.mkdir()
    args = [sys.executable, "-m", "reshard", "save", str(src), str(tmp_path / "out"), "--tp", "2"]
    p = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # not ignored, as under nohup
    )
    time.sleep(4)  # torch imported, waiting for rank 1
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err == "reshard: error: interrupted; nothing was published and a previous output is unchanged\n", err


@pytest.mark.parametrize(
    "env, says",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR and MASTER_PORT are not"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='2'"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT='x'"),
    ],
)
def test_torchrun_variables_set_by_hand_are_a_usage_error(tiny, tmp_path, env, says):
    """WORLD_SIZE over 1 means a torchrun launch: without the rest of what torchrun sets, or with a
    value that cannot be, it is exit 2 saying how to run it (it was exit 1, or a wait for ever)."""
    p = cli_subprocess(["save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2"], env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and says in p.stderr and "torchrun --nproc-per-node" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
    assert (
        cli_subprocess(["save", str(tiny("llama")), str(tmp_path / "one"), "--tp", "2"], {"WORLD_SIZE": "1"}).returncode
        == 0
    )


def test_an_interrupted_verify_says_nothing_changed(tiny, tmp_path, monkeypatch):
    """verify and plan write nothing: an interrupt says so, not that nothing was published."""
    import reshard.verify as verify_mod

    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_mod.integrity, "check_sums", interrupted)
    code, _, err = run("verify", str(out))
    assert code == 130 and err == "reshard: error: interrupted; verify writes nothing, so nothing changed\n", err


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--max-memory", "1KB", "'1KB' is below 16MiB, the least a save can keep to"),
        ("--max-memory", "512", "'512' is below 16MiB"),  # bytes, where MiB was meant
        ("--max-memory", "0", "must be positive"),
        ("--max-part-size", "5 parsecs", "is not a size like 5GiB"),
    ],
)
def test_sizes_a_save_cannot_keep_to_are_usage_errors(tiny, tmp_path, option, value, says):
    code, out, _ = run("save", str(tiny("llama")), str(tmp_path / "out"), option, value, "--json")
    assert code == 2 and says in json.loads(out)["error"]["message"], out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command, says", [("verify", "interrupted (verify writes nothing)"), ("save", "nothing was published")]
)
def test_an_interrupt_while_the_modules_import_says_what_the_command_does(monkeypatch, capsys, command, says):
    """Ctrl-C before the CLI is imported (reshard.__main__): exit 130 and one line; a verify or plan
    wrote nothing, so it does not speak of a previous output."""
    import importlib.abc

    import reshard.__main__ as entry

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "reshard.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "reshard.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    monkeypatch.setattr(sys, "argv", ["reshard", command, "x"])
    import signal

    held = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # run() sets them
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # and blocks them once it has failed
    try:
        with pytest.raises(SystemExit) as e:
            entry.run()
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_log_that_cannot_be_written_does_not_end_the_save(tiny, tmp_path):
    """stderr on a full disk (or a log collector gone: EPIPE): the progress lines are dropped, the save completes.
    The last progress line's failed write ended a finished save with exit 1 and threw its output away."""
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [sys.executable, "-m", "reshard", "save", str(tiny("llama")), str(out), "--tp", "2"],
            stdout=subprocess.DEVNULL,
            stderr=full,
            env={**os.environ, "RESHARD_DISABLE_PROGRESS": "0"},
            timeout=120,
        )
    assert p.returncode == 0 and (out / "reshard.json").is_file()


@pytest.mark.parametrize("fault", ["ENOMEM", "MemoryError"])
def test_out_of_memory_says_so(tiny, tmp_path, monkeypatch, fault):
    """Memory refused (a `ulimit -v`, a container's limit): the buffers' mmap fails with ENOMEM, Python raises
    MemoryError. Exit 5 saying out of memory and what to lower, not `cannot write OUT: Cannot allocate memory`
    or exit 1 (an internal error)."""
    import errno
    import mmap

    from reshard.io import memory

    def refuse(*args, **kwargs):
        if fault == "ENOMEM":
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        raise MemoryError

    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2")
    monkeypatch.setattr(memory.mmap, "mmap", mmap.mmap)
    assert code == 5 and "out of memory" in err and "--max-memory" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_result_that_cannot_be_written_to_stdout_is_one_line(tiny, tmp_path, json_flag):
    """stdout a file on a full disk: exit 5, one line on stderr saying the save itself finished (its output
    verifies), not exit 1 with tracebacks. stdout closed (`>&-`): the same, exit 5 once the save is done; it was
    exit 0 with the result thrown away, which a job could not tell from a result it saw."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "reshard", "save", str(tiny("llama")), str(out), "--tp", "2", *json_flag]
    env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1"}
    with open("/dev/full", "w") as full:
        p = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert p.returncode == 5, p.stderr
    assert p.stderr.startswith("reshard: error: cannot write the result to stdout: No space left on device")
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert run("verify", str(out))[0] == 0
    closed = subprocess.run(
        [*args[:5], str(tmp_path / "two"), *args[6:]],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=lambda: os.close(1),
    )
    lost = "reshard: error: cannot write the result to stdout: it was closed when reshard started"
    done = " (the command itself had finished: `reshard verify` the output it wrote)\n"
    assert (closed.returncode, closed.stderr) == (5, lost + done)
    assert run("verify", str(tmp_path / "two"))[0] == 0


def _closed_pipe() -> int:
    """The writing end of a pipe whose reader is gone (`| head -0`)."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["save", "--help"]])
def test_help_and_version_on_a_stdout_that_fails(args):
    """Help and --version are results too: into a pipe whose reader is gone they end quietly with 141, into a
    full disk with exit 5 and the one line; the root's were exit 1 both ways (click's own broken-pipe exit,
    or `internal error: OSError`)."""
    command = [sys.executable, "-m", "reshard", *args]
    pipe = _closed_pipe()
    closed = subprocess.run(command, stdout=pipe, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(pipe)
    assert (closed.returncode, closed.stderr) == (141, "")
    with open("/dev/full", "w") as full:
        p = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (
        5,
        "reshard: error: cannot write the result to stdout: No space left on device\n",
    )


def test_a_json_failure_on_a_full_stdout_is_exit_5_and_one_line(tiny):
    """--json's error object that cannot be written (a file on a full disk): exit 5 and one line saying both what
    was lost and why the command failed; it was exit 1 with two tracebacks."""
    command = [sys.executable, "-m", "reshard", "plan", str(tiny("qwen3")), "--tp", "3", "--json"]
    with open("/dev/full", "w") as full:
        p = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    failed = "num_attention_heads=8 is not divisible by --tp 3 (use a --tp that divides it: 1, 2, 4, 8)"
    line = f"reshard: error: cannot write the result to stdout: No space left on device; the command had failed: {failed}\n"
    assert (p.returncode, p.stderr) == (5, line)


@pytest.fixture(scope="module")
def unchecked(tiny, tmp_path_factory):
    """An output saved with --checksum none: a command reading it notes that its bytes are not checked."""
    out = tmp_path_factory.mktemp("unchecked") / "out"
    save(str(tiny("qwen3")), out, tp=2, checksum="none")
    return out


def run_without_stdout(stdout: str, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """`reshard ARGS` with stdout a full disk ("full") or closed ("closed"); the reason reshard gives for each."""
    command = [sys.executable, "-m", "reshard", *args]
    if stdout == "full":
        with open("/dev/full", "w") as full:
            p = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        return p, "No space left on device"
    p = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    return p, "it was closed when reshard started"


@pytest.mark.parametrize("tp", ["1", "3"])
@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_the_notes_of_a_json_object_that_cannot_be_written_go_to_stderr(unchecked, tp, stdout):
    """--json keeps the notes for its object; stdout a full disk or closed (`>&-`): the object is lost, and its
    notes were lost with it (exit 5 and the error line only). They are said on stderr, as without --json, before
    the one error line."""
    args = ["plan", str(unchecked), "--tp", tp, "--json"]
    code, out, err = run(*args)
    assert code == (0 if tp == "1" else 3) and json.loads(out)["notes"], err
    notes = [f"note: {n}" for n in json.loads(out)["notes"]]
    failed = "" if tp == "1" else f"; the command had failed: {json.loads(out)['error']['message']}"
    p, why = run_without_stdout(stdout, *args)
    line = f"reshard: error: cannot write the result to stdout: {why}{failed}"
    assert (p.returncode, p.stderr.splitlines()) == (5, [*notes, line])


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_a_failing_verify_whose_report_cannot_be_written_says_so_in_one_line(tiny, tmp_path, stdout, json_flag):
    """verify's report is its result, a failing one's too: stdout a full disk or closed, exit 5 and one line that
    says why verify failed, as a failing command's --json object lost does; it was two `reshard: error:` lines,
    verify's own first."""
    out = tmp_path / "out"
    save(str(tiny("llama")), out, tp=2)
    rank = out / "model-rank-1-part-0.safetensors"
    rank.write_bytes(rank.read_bytes()[:-8])
    code, _, err = run("verify", str(out), *json_flag)
    assert code == 7 and err.count("\n") == 1 and err.startswith("reshard: error: verify: corrupt"), err
    p, why = run_without_stdout(stdout, "verify", str(out), *json_flag)
    failed = err.removeprefix("reshard: error: ")
    assert (p.returncode, p.stderr) == (
        5,
        f"reshard: error: cannot write the result to stdout: {why}; the command had failed: {failed}",
    )


def test_the_notes_of_a_failure_whose_object_a_closed_pipe_lost_go_to_stderr(unchecked):
    """stdout a pipe whose reader is gone: a failing command's object is lost, its error line (and exit code) are
    not; nor, now, its notes."""
    args = ["plan", str(unchecked), "--tp", "3", "--json"]
    _, out, _ = run(*args)
    pipe = _closed_pipe()
    p = subprocess.run([sys.executable, "-m", "reshard", *args], stdout=pipe, stderr=subprocess.PIPE, text=True)
    os.close(pipe)
    said = [*(f"note: {n}" for n in json.loads(out)["notes"]), f"reshard: error: {json.loads(out)['error']['message']}"]
    assert (p.returncode, p.stderr.splitlines()) == (3, said)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_failure_with_stderr_gone_keeps_its_exit_code(tiny, json_flag):
    """stderr a pipe whose reader is gone (`2>&1 >/dev/null | true`): the error line is lost, its exit code is
    not (3 here, was 1); under --json stdout still holds the object."""
    command = [sys.executable, "-m", "reshard", "plan", str(tiny("qwen3")), "--tp", "3", *json_flag]
    pipe = _closed_pipe()
    p = subprocess.run(command, stdout=subprocess.PIPE, stderr=pipe, text=True, timeout=120)
    os.close(pipe)
    assert p.returncode == 3
    assert (json.loads(p.stdout)["error"]["code"] if json_flag else p.stdout) == (3 if json_flag else "")


def test_a_closed_stderr_keeps_logs_off_stdout(tiny):
    """stderr closed (`2>&-`): Python makes sys.stderr None and print(file=None) writes to stdout, so the error line
    followed --json's object there (invalid JSON). stdout holds the object alone."""
    command = [sys.executable, "-m", "reshard", "plan", str(tiny("qwen3")), "--tp", "3", "--json"]
    p = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(2))
    failed = "num_attention_heads=8 is not divisible by --tp 3 (use a --tp that divides it: 1, 2, 4, 8)"
    error = {"code": 3, "kind": "UnsupportedError", "message": failed}
    assert (p.returncode, json.loads(p.stdout)) == (3, {"ok": False, "error": error})


def test_notes_go_to_stderr_and_results_to_stdout(tiny, tmp_path):
    """plan's and save's notes (the vLLM releases, the plugin) are logs, not the result: on stderr, so that stdout
    holds the summary and the serve lines alone (they were among them)."""
    from reshard.serve import PLUGIN_NOTE
    from reshard.vllm_versions import serve_note

    notes = [f"note: {serve_note()}", f"note: {PLUGIN_NOTE}"]
    code, out, err = run("plan", str(tiny("qwen3")), "--tp", "2")
    assert (code, err.splitlines()) == (0, notes)
    assert out.splitlines()[-2:] == [
        "vllm serve OUT_DIR --load-format sharded_state --tensor-parallel-size 2 --dtype bfloat16",
        "vllm serve OUT_DIR --load-format reshard --tensor-parallel-size 2 --dtype bfloat16",
    ]
    assert "note:" not in out
    out_dir = tmp_path / "out"
    code, out, err = run("save", str(tiny("qwen3")), str(out_dir), "--tp", "2")
    assert (code, [line for line in err.splitlines() if line.startswith("note:")]) == (0, notes)
    assert out.splitlines()[1:] == [
        f"vllm serve {out_dir} --load-format sharded_state --tensor-parallel-size 2 --dtype bfloat16",
        f"vllm serve {out_dir} --load-format reshard --tensor-parallel-size 2 --dtype bfloat16",
    ]


@pytest.mark.parametrize(
    "command, codes",
    [
        ("plan", {0, 2, 3, 4, 5, 7, 130, 141}),
        ("save", {0, 2, 3, 4, 5, 7, 130, 141}),
        ("verify", {0, 2, 3, 4, 5, 6, 7, 130, 141}),
        ("merge", {0, 2, 3, 4, 5, 7, 130, 141}),
        ("assemble", {0, 2, 4, 5, 7, 130, 141}),
    ],
)
def test_each_commands_help_lists_the_exit_codes_it_can_give(command, codes):
    """Each command's --help lists the codes README's table gives it: plan's left out 7 (an output as SOURCE that
    fails its checksums), and none but verify's had 5 for a stdout that cannot be written or 141."""
    code, out, _ = run(command, "--help")
    paragraph = out[out.index("Exit codes:") :].split("\n\n")[0]
    assert (code, {int(n) for n in re.findall(r"\b\d+\b", paragraph)}) == (0, codes)


def test_json_puts_the_notes_in_its_object_and_none_on_stderr(tiny, tmp_path):
    """Every command's `note:` lines: on stderr as they come, or with --json in the object's `notes` (save and plan
    kept theirs there, but a source's own note, such as an output saved with --checksum none read back, went to
    stderr beside the object and was missing from it; verify printed its notes in both). A failing command's
    object has them too."""
    out = tmp_path / "out"
    save(str(tiny("qwen3")), out, tp=2, checksum="none")
    said = f"{out} was saved with --checksum none: its files' sizes were checked, not their bytes"
    code, _, err = run("merge", str(out), str(tmp_path / "hf"))
    notes = [line.removeprefix("note: ") for line in err.splitlines() if line.startswith("note:")]
    assert code == 0 and [n.split(" (")[0] for n in notes] == [said], err
    runs = {
        "merge": ["merge", str(out), str(tmp_path / "hf2"), "--json"],
        "save": ["save", str(out), str(tmp_path / "tp1"), "--tp", "1", "--json"],
        "plan": ["plan", str(out), "--tp", "1", "--json"],
        "failing save": ["save", str(out), str(tmp_path / "tp3"), "--tp", "3", "--json"],
    }
    for what, args in runs.items():
        code, stdout, err = run(*args)
        obj = json.loads(stdout)
        assert code == (3 if what == "failing save" else 0), err
        assert obj["notes"][:1] == notes, (what, obj)  # save's and plan's own notes follow
        assert [line for line in err.splitlines() if not line.startswith("reshard: error:")] == [], (what, err)
