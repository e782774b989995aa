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


def test_a_name_with_glob_characters_takes_no_other_outputs_leftovers(tiny, tmp_path):
    """`m[1]`'s leftovers are `.m[1].reshard-*`, not `.m1.reshard-*`: the previous output of `m1` that a crash
    between the two renames left there (its only copy) is neither taken over nor deleted."""
    m1 = tmp_path / "m1"
    assert run("save", str(tiny("llama")), str(m1), "--tp", "2")[0] == 0
    before = snapshot(m1)
    old = tmp_path / ".m1.reshard-old-abc"
    os.rename(m1, old)
    other = tmp_path / "m[1]"
    assert run("save", str(tiny("qwen3")), str(other), "--tp", "1")[0] == 0
    assert snapshot(old) == before
    assert run("save", str(tiny("qwen3")), str(other), "--tp", "1", "--overwrite")[0] == 0
    assert snapshot(old) == before
    assert run("save", str(tiny("llama")), str(m1), "--tp", "2")[0] == 5  # its own: the previous output is back
    assert snapshot(m1) == before


def test_a_users_file_named_like_a_rank_file_is_refused_not_deleted(tiny, previous):
    """`model-rank-0-part-0.backup.safetensors` (a user's copy): vLLM's glob would load it with the new
    output, so it cannot be kept, and --overwrite deleted it without a word. Exit 5, naming it; the
    previous output and the file stay."""
    out, before = previous
    backup = out / "model-rank-0-part-0.backup.safetensors"
    backup.write_bytes((out / "model-rank-0-part-0.safetensors").read_bytes())
    (out / "model-rank-9-part-0.safetensors").write_bytes(b"stale")  # a rank file name no manifest lists
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")
    assert code == 5 and f"holds {backup.name} (and 1 more), which the output there does not list" in err, err
    assert backup.is_file() and {k: v for k, v in snapshot(out).items() if k in before} == before
    backup.unlink()
    (out / "model-rank-9-part-0.safetensors").unlink()
    assert run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")[0] == 0


def test_a_nested_output_is_held_while_the_outer_save_carries_it_over(tiny, tmp_path, monkeypatch):
    """OUT_DIR holds another output (OUT/sub). A save over OUT copies sub into its new folder; a save into
    sub that published in between was undone by the swap (its output reverted to the copy, both exit 0), or
    mixed into it. The outer save holds sub's lock from the copy to the swap: the inner one is refused
    (exit 5) meanwhile, and sub stays whole."""
    out, sub = tmp_path / "out", tmp_path / "out" / "sub"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    assert run("save", str(tiny("qwen3")), str(sub), "--tp", "2")[0] == 0
    before = snapshot(sub)
    real, inner = publish._exchange, {}

    def exchange(a, b):  # the moment between the copy and the swap: another run saves into sub
        env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1"}
        args = [sys.executable, "-m", "reshard", "save", str(tiny("qwen3")), str(sub), "--tp", "1", "--overwrite"]
        inner["run"] = subprocess.run(args, capture_output=True, text=True, env=env)
        return real(a, b)

    monkeypatch.setattr(publish, "_exchange", exchange)
    assert run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")[0] == 0
    r = inner["run"]
    assert r.returncode == 5 and f"is writing {sub}" in r.stderr, r.stderr
    assert snapshot(sub) == before and run("verify", str(sub), "--tp", "2")[0] == 0


def test_swap_without_rename_exchange(tiny, previous, monkeypatch):
    out, _ = previous
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    assert run("save", str(tiny("llama")), str(out), "--tp", "4", "--overwrite")[0] == 0
    assert run("verify", str(out), "--tp", "4")[0] == 0
    assert siblings(out) == []


def test_merge_over_a_reshard_output_leaves_no_stale_manifest(tiny, previous):
    """`merge OUT HF --overwrite` into a folder that held a reshard output: its rank files were replaced and
    its reshard.json kept, describing files that were gone (verify: exit 7; as SOURCE: exit 7). The user's
    file stays."""
    out, _ = previous
    other = out.parent / "tp4"
    assert run("save", str(tiny("llama")), str(other), "--tp", "4")[0] == 0
    assert run("merge", str(other), str(out), "--overwrite")[0] == 0
    assert not (out / "reshard.json").exists() and (out / "NOTES.md").read_text() == "mine\n"
    assert not list(out.glob("model-rank-*"))
    assert run("plan", str(out), "--tp", "2")[0] == 0  # an HF checkpoint again


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


def _as_a_user() -> list[str] | None:
    """A command prefix without root's permission overrides (a folder's mode then binds, as for a user), or
    None where this cannot be had."""
    if os.geteuid() != 0:
        return []
    import shutil

    if not shutil.which("setpriv"):
        return None
    probe = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all", "--"]
    ok = subprocess.run([*probe, "true"], capture_output=True).returncode == 0
    return probe if ok else None


@pytest.mark.parametrize("where", ["beside", "inside"])
def test_a_read_only_folder_copied_from_the_source_never_costs_the_previous_output(tiny, tmp_path, where):
    """A source with a read-only subfolder (`chmod -R a-w`, or a download's `original/` at 555): saved over
    and over into the same OUT_DIR, every run publishes and leaves nothing behind. Beside: the old OUT_DIR
    stayed as a hidden folder, one more per run. Inside (OUT_DIR published in place: a mount point, or the
    shell's current folder): moving the copied folder in failed (EACCES) after the old manifest was gone,
    every run, and the previous output was lost."""
    import shutil

    prefix = _as_a_user()
    if prefix is None:
        pytest.skip("cannot drop root's permission overrides here (setpriv)")
    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("hi")
    (src / "extra").chmod(0o555)
    out = tmp_path / "parent" / "out"
    out.mkdir(parents=True)
    env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    try:
        for tp in ("2", "4", "2"):
            args = [*prefix, sys.executable, "-m", "reshard", "save", str(src), "." if where == "inside" else str(out)]
            p = subprocess.run([*args, "--tp", tp, "--overwrite"], cwd=out, env=env, capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
            assert run("verify", str(out))[0] == 0
            assert (out / "extra" / "notes.txt").read_text() == "hi"
            assert sorted(p.name for p in out.parent.iterdir()) == ["out"], list(out.parent.iterdir())
            assert not [p.name for p in out.iterdir() if p.name.startswith(".reshard")]
    finally:
        for p in [tmp_path, *tmp_path.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)


def test_verify_of_a_missing_out_dir_points_at_the_previous_output_kept_beside_it(tiny, tmp_path):
    """A save killed between the two renames (no RENAME_EXCHANGE) leaves OUT_DIR missing and the previous
    output at `.OUT.reshard-old-*`: verify says where it is, and the next save puts it back."""
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    kept = tmp_path / ".out.reshard-old-x"
    out.rename(kept)
    code, _, err = run("verify", str(out))
    assert code == 7 and f"a previous output is kept beside it at {kept}" in err, err


def test_verify_says_a_leftover_inside_a_relative_out_dir_is_inside(tiny, tmp_path, monkeypatch):
    """A staging folder a killed in-place save left inside OUT_DIR, OUT_DIR given as a relative path:
    verify's warning says it is inside the folder (it said beside)."""
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    (out / ".reshard-new-x").mkdir()
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run("verify", "out")
    assert code == 0 and ".reshard-new-x inside the folder: left by an interrupted save" in stdout, stdout


def test_a_disk_already_full_is_exit_5_not_an_internal_error(tiny, tmp_path, monkeypatch):
    """A rerun on a disk left full: the lock file's pid is the first write, and failed with exit 1 (internal error)."""
    import errno

    from reshard.names import LOCK
    from tests.fixtures.cli import run

    real = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2")
    assert code == 5 and "disk full while writing" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock left behind


def test_overwrite_keeps_files_of_the_users_that_only_start_like_rank_files(previous, tiny):
    """--overwrite replaces what vLLM's rank-file globs would load, not every name starting `model-rank-`."""
    out, _ = previous
    (out / "model-rank-README.md").write_text("mine\n")
    (out / "model-pp-notes.txt").write_text("mine\n")
    assert run("save", str(tiny("llama")), str(out), "--tp", "2", "--overwrite")[0] == 0
    assert (out / "model-rank-README.md").read_text() == (out / "model-pp-notes.txt").read_text() == "mine\n"
    assert run("verify", str(out))[0] == 0


@pytest.mark.parametrize("where", ["beside", "inside"])
def test_a_failing_rename_while_publishing_puts_the_previous_output_back(previous, tiny, monkeypatch, where):
    """An I/O error moving the new output in (a filesystem without RENAME_EXCHANGE: NFS, CIFS; or OUT_DIR
    published in place: a mount point, the current folder): exit 5 and OUT_DIR the previous output, byte for
    byte. Beside, OUT_DIR was left missing (the old one renamed aside); inside, the old files moved aside were
    deleted with the staging folder and OUT_DIR kept only some files, no manifest."""
    import errno

    from reshard import publish
    from reshard.names import STAGING

    out, before = previous
    real_rename, real_replace = os.rename, os.replace

    def failing(real):
        def call(a, b, *args, **kwargs):
            new = STAGING in Path(a).name or STAGING in Path(a).parent.name  # the staging folder, or a new file
            if new and Path(b).parent in (out, out.parent):
                raise OSError(errno.EIO, "Input/output error")
            return real(a, b, *args, **kwargs)

        return call

    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", failing(real_rename))
    monkeypatch.setattr(os, "replace", failing(real_replace))
    if where == "inside":
        monkeypatch.chdir(out)
    code, _, err = run("save", str(tiny("llama")), "." if where == "inside" else str(out), "--tp", "4", "--overwrite")
    monkeypatch.setattr(os, "rename", real_rename)
    monkeypatch.setattr(os, "replace", real_replace)
    assert code == 5, err
    assert snapshot(out) == before
    assert run("verify", str(out))[0] == 0
