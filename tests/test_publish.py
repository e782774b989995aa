"""Never lose a good output: `save --overwrite` and `merge` publish by swapping whole folders."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import publish
from tests.fixtures.cli import run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def previous(tiny, tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A good TP 2 output, plus a file of the user's, in tmp_path/out."""
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    (out / "NOTES.md").write_text("mine\n")
    return out, snapshot(out)


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and p.name != "src")


@pytest.mark.parametrize("where", ["write_manifest", "swap"])
def test_late_interrupt_keeps_the_previous_output(tiny, previous, monkeypatch, where):
    """Ctrl-C after every rank file is written (manifest, or just before the folders swap)."""
    out, before = previous
    import reshard.destination as dst

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dst, "write_manifest" if where == "write_manifest" else "swap_in", boom)
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
    assert code == 130 and "interrupted" in err
    assert snapshot(out) == before
    assert run("verify", str(out))[0] == 0
    assert siblings(out) == []


def test_disk_full_while_writing_the_manifest_keeps_the_previous_output(tiny, previous, monkeypatch):
    out, before = previous
    import reshard.manifest as mf

    def full(manifest):  # called once the temporary manifest file is created
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mf, "manifest_bytes", full)
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
    assert code == 5 and "disk full" in err
    assert snapshot(out) == before
    assert siblings(out) == []


def test_stale_manifest_temp_folder_does_not_cost_the_output(tiny, previous):
    out, _ = previous
    (out / ".reshard.json.tmp").mkdir()
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
    assert code == 0, err
    assert run("verify", str(out), "--tp", "4")[0] == 0


def test_overwrite_replaces_reshard_files_and_keeps_the_users(tiny, previous):
    out, before = previous
    assert run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")[0] == 0
    after = snapshot(out)
    assert after["NOTES.md"] == b"mine\n"
    assert "model-rank-3-part-0.safetensors" in after
    assert after["model-rank-0-part-0.safetensors"] != before["model-rank-0-part-0.safetensors"]
    assert siblings(out) == []
    assert run("verify", str(out))[0] == 0


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(tiny, previous):
    out, before = previous
    lock = out.parent / f".{out.name}.reshard.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT); "
            "os.write(fd, b'4242'); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
        assert code == 5 and "another reshard run (pid 4242)" in err
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_released_and_removed(tmp_path):
    out = tmp_path / "out"
    with publish.lock(out):
        fd = os.open(tmp_path / ".out.reshard.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_between_the_two_renames_is_repaired_by_the_next_run(tiny, previous):
    """Where RENAME_EXCHANGE is missing, OUT_DIR is briefly absent; a kill -9 there is recovered."""
    out, before = previous
    old = out.parent / f".{out.name}.reshard-old-deadbeef"
    os.rename(out, old)
    (out.parent / f".{out.name}.reshard-new-deadbeef").mkdir()
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")  # no --overwrite: it is the old output
    assert code == 5 and "not empty" in err
    assert snapshot(out) == before
    assert siblings(out) == []


def test_swap_without_rename_exchange(tiny, previous, monkeypatch):
    out, _ = previous
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    assert run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")[0] == 0
    assert run("verify", str(out), "--tp", "4")[0] == 0
    assert siblings(out) == []


def test_merge_overwrite_keeps_the_previous_checkpoint_on_failure(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    hf = tmp_path / "hf"
    assert run("merge", str(out), str(hf))[0] == 0
    before = snapshot(hf)
    import reshard.merge as mg

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mg, "swap_in", boom)
    assert run("merge", str(out), str(hf), "--overwrite")[0] == 130
    assert snapshot(hf) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
