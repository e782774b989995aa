"""RESHARD_* environment variables (reshard/settings.py, issue 23): a value a setting does not accept
is a usage error (exit 2, one line naming the variable and what it accepts) before the command
starts, also with --json; accepted values are honoured, read when used rather than at import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import settings
from reshard.errors import SettingError
from tests.fixtures.cli import run

ROOT = Path(__file__).resolve().parents[1]

# one value each setting refuses, and more for the in-process checks
BAD = {
    "RESHARD_DEBUG": ["maybe", "2"],
    "RESHARD_DISABLE_PROGRESS": ["on-ish", "-1"],
    "RESHARD_O_DIRECT": ["sometimes", "off"],
    "RESHARD_DIRECT_READS": ["sometimes", "2"],
    "RESHARD_HUB_CONNECTIONS": ["abc", "0", "2.5"],
    "RESHARD_HUB_RETRIES": ["abc", "-1", "1e3"],
    "RESHARD_HUB_BACKOFF": ["abc", "-0.5", "nan"],
    "RESHARD_HUB_TIMEOUT": ["abc", "0", "inf"],
    "RESHARD_HUB_MIN_SPEED": ["64KiB", "-1", "2.5"],
    "RESHARD_HUB_SMALL": ["1MiB", "-1"],
    "RESHARD_STREAM_SPILL": ["8GiB", "-1"],
    "RESHARD_S3_CONCURRENCY": ["many", "0"],
    "RESHARD_S3_PART_SIZE": ["16MiB", "1048576", "6442450944"],  # 6 GiB: above S3's largest part
    "RESHARD_S3_RETRIES": ["abc", "-1"],
    "RESHARD_S3_TIMEOUT": ["abc", "0"],
}


def test_every_setting_has_bad_values_here():
    assert sorted(BAD) == sorted(s.name for s in settings.ALL)


def _clean_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_")}
    return {**base, "PYTHONPATH": str(ROOT), "RESHARD_DISABLE_PROGRESS": "1", **env}


def _check_one_line(err: str, name: str, value: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"reshard: error: {name}={value!r} "), err
    setting = next(s for s in settings.ALL if s.name == name)
    assert f"({name}: {setting.doc}, {setting.accepts}; default " in lines[0], err


def test_bad_values_exit_2_from_the_command_line(tiny):
    """`python -m reshard plan` with each setting's bad value (all started at once: they are slow)."""
    src = str(tiny("llama"))
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "reshard", "plan", src, "--tp", "1"],
            env=_clean_env(**{name: values[0]}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, values in BAD.items()
    }
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, (name, err)
        assert out == ""
        _check_one_line(err, name, BAD[name][0])


def test_bad_value_with_json_is_a_json_failure(tiny):
    p = subprocess.run(
        [sys.executable, "-m", "reshard", "plan", str(tiny("llama")), "--tp", "1", "--json"],
        env=_clean_env(RESHARD_HUB_RETRIES="abc"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    obj = json.loads(p.stdout)
    assert obj == {
        "ok": False,
        "error": {
            "code": 2,
            "kind": "UsageError",  # as every exit 2
            "message": "RESHARD_HUB_RETRIES='abc' is not a whole number (RESHARD_HUB_RETRIES: retries of a "
            "failing Hub request, a whole number >= 0; default 8)",
        },
    }
    assert p.stderr == f"reshard: error: {obj['error']['message']}\n"


@pytest.mark.parametrize("name, value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_bad_values_exit_2(tiny, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    code, out, err = run("plan", str(tiny("llama")), "--tp", "1")
    assert code == 2 and out == ""
    _check_one_line(err, name, value)


def test_bad_value_fails_before_a_save_writes_anything(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_HUB_TIMEOUT", "-5")  # a local save never reads it: still refused up front
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2")
    assert code == 2 and "RESHARD_HUB_TIMEOUT='-5'" in err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_help_works_whatever_the_environment_holds(monkeypatch):
    monkeypatch.setenv("RESHARD_DIRECT_READS", "sometimes")
    code, out, _ = run("--help")
    assert code == 0
    for s in settings.ALL:  # and it lists every setting
        assert s.name in out
    assert run("save", "--help")[0] == 0


def test_every_setting_is_documented_in_the_readme():
    text = " ".join((ROOT / "README.md").read_text().split())
    bullet = text[text.index("- Environment:") : text.index("`NO_COLOR` (no colours) change behaviour.")]
    for s in settings.ALL:
        assert f"`{s.name}" in bullet, s.name


@pytest.mark.parametrize(
    "setting, value, expect",
    [
        (settings.DEBUG, "YES", True),
        (settings.DEBUG, "0", False),
        (settings.DISABLE_PROGRESS, "true", True),
        (settings.DISABLE_PROGRESS, "no", False),
        (settings.O_DIRECT, "false", False),
        (settings.O_DIRECT, " 1 ", True),
        (settings.DIRECT_READS, " Auto ", "auto"),
        (settings.DIRECT_READS, "TRUE", "1"),
        (settings.DIRECT_READS, "no", "0"),
        (settings.HUB_CONNECTIONS, "3", 3),
        (settings.HUB_RETRIES, "0", 0),
        (settings.HUB_BACKOFF, "0", 0.0),
        (settings.HUB_BACKOFF, "1.5", 1.5),
        (settings.HUB_TIMEOUT, "2.5", 2.5),
        (settings.HUB_SMALL, "0", 0),
    ],
)
def test_good_values_are_read_when_used(monkeypatch, setting, value, expect):
    monkeypatch.setenv(setting.name, value)  # after reshard was imported: read on demand
    assert setting.get() == expect
    monkeypatch.setenv(setting.name, "")  # empty: the default
    assert setting.get() == setting.default
    monkeypatch.delenv(setting.name)
    assert setting.get() == setting.default


def test_check_all_raises_for_the_bad_one(monkeypatch):
    monkeypatch.setenv("RESHARD_HUB_CONNECTIONS", "0")
    with pytest.raises(SettingError, match=r"^RESHARD_HUB_CONNECTIONS='0' is less than 1 \("):
        settings.check_all()
    monkeypatch.setenv("RESHARD_HUB_CONNECTIONS", "4")
    settings.check_all()


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("RESHARD_DEBUG", "yes")
    code, _, err = run("plan", "/nonexistent/reshard-settings", "--tp", "1")
    assert code == 4 and "Traceback (most recent call last)" in err  # the traceback, and the same code
    monkeypatch.setenv("RESHARD_DEBUG", "0")
    code, _, err = run("plan", "/nonexistent/reshard-settings", "--tp", "1")
    assert code == 4 and "Traceback" not in err


def test_progress_lines_follow_the_setting(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_DISABLE_PROGRESS", "no")
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "a"), "--tp", "2")
    assert code == 0 and re.search(r"^writing: .*\(100%", err, re.M), err
    monkeypatch.setenv("RESHARD_DISABLE_PROGRESS", "TRUE")
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "b"), "--tp", "2")
    assert code == 0 and "writing:" not in err


def test_o_direct_setting_reaches_the_writer(tmp_path, monkeypatch):
    from reshard.io.writer import FileWriter

    monkeypatch.setenv("RESHARD_O_DIRECT", "false")
    w = FileWriter(tmp_path / "buffered", b"h" * 8, "blake3")
    assert not w.direct
    w.abort()
    monkeypatch.setenv("RESHARD_O_DIRECT", "1")
    w = FileWriter(tmp_path / "direct", b"h" * 8, "blake3")
    direct = w.direct
    w.abort()
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT")


def test_direct_reads_setting_reaches_the_reader(tmp_path, monkeypatch):
    from reshard.io.reader import FileReader

    monkeypatch.setenv("RESHARD_DIRECT_READS", "yes")
    assert FileReader(tmp_path).mode == "1"


def test_hub_retries_and_backoff_are_honoured(monkeypatch):
    from reshard.sources.hubhttp import Unreachable, with_retries

    calls = []

    def failing() -> None:
        calls.append(1)
        raise OSError("connection reset")

    monkeypatch.setenv("RESHARD_HUB_RETRIES", "2")
    monkeypatch.setenv("RESHARD_HUB_BACKOFF", "0")
    with pytest.raises(Unreachable, match="failed 3 times in a row"):
        with_retries(failing, "acme/x")
    assert len(calls) == 3


def test_hub_small_is_honoured(monkeypatch):
    from reshard.format import TensorInfo
    from reshard.sources.hubgroups import Groups

    tensors = {f"t{i}": TensorInfo(f"t{i}", "U8", (100,), "a.safetensors", 100 * i, 100) for i in range(4)}
    monkeypatch.setenv("RESHARD_HUB_SMALL", "0")
    assert Groups(tensors).of == {}
    monkeypatch.setenv("RESHARD_HUB_SMALL", "1000")
    assert len(set(Groups(tensors).of.values())) == 1
