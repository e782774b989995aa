"""Issue 24, "never lose or fake an output": --ranks and assemble never cost a complete output,
an interrupt says what is on disk, mount points and read-only OUT_DIRs, planted locks and temp files."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.cli import run

ROOT = Path(__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))


@pytest.fixture
def complete(tiny, tmp_path) -> Path:
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    return out


@pytest.fixture
def pieces(tiny, tmp_path) -> Path:
    """Both pieces of a TP 2 job in one folder, not assembled yet (the second piece's manifest held back)."""
    out = tmp_path / "pieces"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2", "--ranks", "0")[0] == 0
    held = tmp_path / "held"
    assert run("save", str(tiny("llama")), str(held), "--tp", "2", "--ranks", "1")[0] == 0
    for p in held.iterdir():
        if not (out / p.name).exists():
            shutil.copy2(p, out / p.name)
    return out


# ---- case 4: a --ranks piece never touches a complete output ------------------------------------


def test_a_piece_over_a_complete_output_is_refused_and_the_output_kept(tiny, complete):
    before = snapshot(complete)
    for overwrite in (["--overwrite"], []):  # without it too: the same refusal, not "pass --overwrite"
        code, _, err = run("save", str(tiny("llama")), str(complete), "--tp", "2", "--ranks", "0", *overwrite)
        assert code == 5, err
        assert "complete output" in err and "reshard assemble" in err and len(err.splitlines()) == 1
        assert "pass --overwrite" not in err
    assert snapshot(complete) == before
    assert run("verify", str(complete))[0] == 0
    assert beside(complete) == []


# ---- case 5: assemble checks every file before writing or removing anything ---------------------


def test_assemble_refuses_a_set_with_a_rank_file_absent(pieces):
    (pieces / "model-rank-1-part-0.safetensors").unlink()
    manifests = sorted(p.name for p in pieces.glob("reshard.ranks-*.json"))
    code, _, err = run("assemble", str(pieces))
    assert code == 7, err
    assert "model-rank-1-part-0.safetensors" in err and "missing" in err
    assert not (pieces / "reshard.json").exists()
    assert sorted(p.name for p in pieces.glob("reshard.ranks-*.json")) == manifests


def test_assemble_refuses_a_truncated_rank_file(pieces):
    with open(pieces / "model-rank-0-part-0.safetensors", "r+b") as f:
        f.truncate(100)
    code, _, err = run("assemble", str(pieces))
    assert code == 7 and "model-rank-0-part-0.safetensors" in err and "100 bytes" in err
    assert not (pieces / "reshard.json").exists()


def test_assemble_refuses_a_rank_file_of_another_run(tiny, pieces, tmp_path):
    other = tmp_path / "other"
    assert run("save", str(tiny("llama")), str(other), "--tp", "2", "--dtype", "float16")[0] == 0
    shutil.copy2(other / "model-rank-1-part-0.safetensors", pieces / "model-rank-1-part-0.safetensors")
    code, _, err = run("assemble", str(pieces))
    assert code == 7 and "model-rank-1-part-0.safetensors" in err, err
    assert "another run" in err or "bytes" in err  # same size: the header's run id tells


def test_a_present_file_whose_piece_manifest_is_gone_is_not_called_unwritten(pieces):
    (pieces / "reshard.ranks-1.json").unlink()
    code, _, err = run("assemble", str(pieces))
    assert code == 5, err
    assert "model-rank-1-part-0.safetensors is in the folder but no piece manifest lists it" in err
    assert "not written yet" not in err


def test_two_piece_manifests_listing_one_file_differently_are_named(pieces):
    stale = json.loads((pieces / "reshard.ranks-1.json").read_text())
    stale["ranks"] = [0, 1]
    stale["files"][0]["size"] += 1
    (pieces / "reshard.ranks-0-1.json").write_text(json.dumps(stale))
    code, _, err = run("assemble", str(pieces))
    assert code == 7, err
    assert "reshard.ranks-0-1.json and reshard.ranks-1.json both list model-rank-1-part-0.safetensors" in err


def test_assemble_serve_line_names_the_assembled_folder(pieces, tmp_path):
    moved = tmp_path / "moved here"
    shutil.copytree(pieces, moved)
    code, out, err = run("assemble", str(moved), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert str(pieces) not in result["serve"] and str(moved) in result["serve"]
    assert json.loads((moved / "reshard.json").read_text())["serve"] == result["serve"]
    assert run("verify", str(moved))[0] == 0


def test_assemble_does_not_follow_a_planted_manifest_temp_link(pieces, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (pieces / ".reshard.json.tmp").symlink_to(victim)
    code, out, err = run("assemble", str(pieces))
    assert code == 0, err
    assert victim.read_text() == "keep me\n"
    assert (pieces / "reshard.json").is_file() and not (pieces / "reshard.json").is_symlink()
    assert "assembled 2 files" in out
    assert run("verify", str(pieces))[0] == 0


# ---- case 6: an interrupt after publishing is told as such ------------------------------------------


@pytest.fixture
def ctrl_c_as_published(monkeypatch):
    """A real SIGINT sent as the output (or a piece) is put in place, while signals are held: delivered
    right after it."""
    import reshard.publish as pub

    real = pub._claim

    def claim_then_ctrl_c(*args):
        real(*args)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(pub, "_claim", claim_then_ctrl_c)


def test_an_interrupt_that_comes_as_the_output_is_published_says_it_was_published(tiny, complete, ctrl_c_as_published):
    code, _, err = run("save", str(tiny("llama")), str(complete), "--tp", "4", "--overwrite")
    assert code == 130, err
    assert "interrupted after publishing" in err and str(complete) in err and "nothing was published" not in err
    assert json.loads((complete / "reshard.json").read_text())["layout"]["tp"] == 4
    assert run("verify", str(complete), "--tp", "4")[0] == 0
    assert beside(complete) == []


def test_an_interrupt_as_a_piece_moves_in_says_the_piece_is_in(tiny, tmp_path, ctrl_c_as_published):
    out = tmp_path / "pieces"
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2", "--ranks", "0")
    assert code == 130, err
    assert "interrupted after publishing" in err and "holds this piece" in err
    assert (out / "reshard.ranks-0.json").is_file() and (out / "model-rank-0-part-0.safetensors").is_file()


def test_an_interrupt_before_publishing_still_says_nothing_was_published(tiny, complete, monkeypatch):
    import reshard.destination as dst

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dst.FolderStaging, "publish", boom)
    code, _, err = run("save", str(tiny("llama")), str(complete), "--tp", "4", "--overwrite")
    assert code == 130 and "nothing was published" in err
    assert json.loads((complete / "reshard.json").read_text())["layout"]["tp"] == 2


# ---- case 7: mount points and read-only OUT_DIRs (a private mount namespace) -----------------------


def _in_mount_namespace(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESHARD_DISABLE_PROGRESS": "1"}
    return subprocess.run(["unshare", "-rm", "sh", "-ec", script], capture_output=True, text=True, env=env, timeout=300)


def _unshare_works() -> bool:
    try:
        return _in_mount_namespace("true").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mounts = pytest.mark.skipif(not shutil.which("unshare") or not _unshare_works(), reason="no mount namespace")


@needs_mounts
def test_a_mount_point_out_dir_is_published_inside_itself(tiny, tmp_path):
    out = tmp_path / "vol"
    out.mkdir()
    rs = f"{sys.executable} -m reshard"
    src = tiny("llama")
    r = _in_mount_namespace(
        f"""
        mount -t tmpfs vol {out}
        {rs} save {src} {out} --tp 2
        {rs} verify {out} --tp 2
        echo mine > {out}/NOTES.md
        {rs} save {src} {out} --tp 4 --overwrite
        {rs} verify {out} --tp 4
        ls -A {out}
        ls -A {tmp_path}
        """
    )
    assert r.returncode == 0, r.stderr
    listing = r.stdout.split("wrote 4 files")[-1]
    assert "NOTES.md" in listing and "model-rank-3-part-0.safetensors" in listing
    assert ".reshard" not in listing  # no staging folder left inside, none beside


@needs_mounts
def test_a_bind_mount_of_the_same_filesystem_is_published_inside_itself(tiny, tmp_path):
    """A bind mount shares its parent's device: only /proc/self/mountinfo tells it is one (the swap
    failed with EBUSY, exit 5)."""
    (tmp_path / "backing").mkdir()
    out = tmp_path / "vol"
    out.mkdir()
    rs = f"{sys.executable} -m reshard"
    r = _in_mount_namespace(
        f"""
        mount --bind {tmp_path / "backing"} {out}
        {rs} save {tiny("llama")} {out} --tp 2
        {rs} save {tiny("llama")} {out} --tp 4 --overwrite
        {rs} verify {out} --tp 4
        """
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "backing" / "reshard.json").is_file()  # the files went through the mount


@needs_mounts
def test_a_mount_inside_out_dir_is_refused_not_emptied(tiny, tmp_path):
    """A file system mounted in OUT_DIR (a data volume): --overwrite carried it over by copying its files
    into the new folder, then removed the old folder, deleting every file on the mount. Exit 5 instead,
    before anything is written; the mount keeps its files."""
    out = tmp_path / "out"
    rs = f"{sys.executable} -m reshard"
    r = _in_mount_namespace(
        f"""
        {rs} save {tiny("llama")} {out} --tp 2
        mkdir {out / "data"}
        mount -t tmpfs data {out / "data"}
        echo precious > {out / "data" / "precious.txt"}
        {rs} save {tiny("llama")} {out} --tp 4 --overwrite || echo "exit $?"
        cat {out / "data" / "precious.txt"}
        {rs} verify {out} --tp 2
        """
    )
    assert r.returncode == 0, r.stderr
    assert "exit 5" in r.stdout and "precious" in r.stdout, r.stdout
    assert f"{out / 'data'} is a mount point inside OUT_DIR {out}" in r.stderr, r.stderr


def test_a_save_into_the_current_folder_keeps_the_folder(tiny, tmp_path, monkeypatch):
    """`reshard save SRC .` from an empty folder: the files are moved into the folder, which stays
    the same folder (a swap put a new one in its place: the shell stood in a removed folder, and
    the serve line `vllm serve .` named nothing)."""
    out = tmp_path / "here"
    out.mkdir()
    inode = out.stat().st_ino
    monkeypatch.chdir(out)
    for extra in ([], ["--tp", "4", "--overwrite"]):
        code, _, err = run("save", str(tiny("llama")), ".", "--tp", "2", *extra)
        assert code == 0, err
        assert out.stat().st_ino == inode and Path.cwd().samefile(out)
        assert run("verify", ".")[0] == 0
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_an_out_dir_inside_the_source_creates_nothing_there(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    code, _, err = run("save", str(src), str(src / "a" / "b" / "out"), "--tp", "2")
    assert code == 5 and "inside the source folder" in err, err
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before


@needs_mounts
def test_a_read_only_out_dir_is_refused_before_anything_is_written(tiny, tmp_path):
    out = tmp_path / "vol"
    out.mkdir()
    rs = f"{sys.executable} -m reshard"
    src = tiny("llama")
    r = _in_mount_namespace(
        f"""
        mount -t tmpfs vol {out}
        {rs} save {src} {out} --tp 2
        mount -o remount,ro {out}
        rc=0; {rs} save {src} {out} --tp 4 --overwrite || rc=$?
        echo "rc=$rc"
        {rs} verify {out} --tp 2
        ls -A {tmp_path}
        """
    )
    assert r.returncode == 0, r.stderr
    assert "rc=5" in r.stdout
    assert "not writable" in r.stderr and len([ln for ln in r.stderr.splitlines() if "error" in ln]) == 1
    assert ".vol.reshard-new" not in r.stdout


# ---- case 9: a planted lock ----------------------------------------------------------------------


def test_a_symlink_at_the_lock_path_is_not_followed(tiny, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    (tmp_path / ".out.reshard.lock").symlink_to(victim)
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 5 and "symbolic link" in err, err
    assert victim.read_text() == "precious\n"
    assert not out.exists()


@pytest.mark.parametrize("what", ["a FIFO", "a folder"])
def test_a_lock_path_that_is_not_a_regular_file_is_refused(tiny, tmp_path, what):
    out = tmp_path / "out"
    planted = tmp_path / ".out.reshard.lock"
    os.mkfifo(planted) if what == "a FIFO" else planted.mkdir()
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 5 and "not reshard's lock" in err and "remove it, then rerun" in err, err
    assert "not a regular file" in err if what == "a FIFO" else "is a folder" in err
    assert planted.exists() and not out.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_folder_others_may_write_without_sticky_bit_is_refused_to_hold_the_lock(tiny, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)  # nobody's folder, open to every user's renames
    shared.chmod(0o777)
    out = shared / "out"
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 5, err
    assert len(err.splitlines()) == 1 and "without the sticky bit" in err and "chmod +t" in err, err
    assert list(shared.iterdir()) == []  # no lock, no staging folder, no OUT_DIR
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot rename or remove our files
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    shutil.rmtree(out)
    os.chown(shared, os.geteuid(), os.getegid())  # our own folder, opened up on purpose
    shared.chmod(0o777)
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0


def test_which_folders_are_open_to_others():
    from reshard.outdir import open_to_others

    me, other = 1000, 1001
    assert open_to_others(0o40777, other, me)
    assert open_to_others(0o40773, other, me)
    assert not open_to_others(0o41777, other, me)  # sticky: /tmp
    assert not open_to_others(0o40777, me, me)
    assert not open_to_others(0o40777, 0, me)
    assert not open_to_others(0o40775, other, me)  # group-writable: the group is trusted
    assert not open_to_others(0o40755, other, me)


# ---- papercuts ---------------------------------------------------------------------------------------


def test_out_dir_that_is_a_file_is_exit_5(tiny, tmp_path):
    out = tmp_path / "out"
    out.write_text("a file\n")
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "2")
    assert code == 5 and "not a folder" in err, err
    assert out.read_text() == "a file\n"


def test_too_many_open_files_blames_the_process_limit(tiny, tmp_path):
    out = tmp_path / "out"
    code = (
        "import resource; from reshard.cli import main; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (12, 12)); "
        f"main(['save', {str(tiny('llama'))!r}, {str(out)!r}, '--tp', '8'])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESHARD_DISABLE_PROGRESS": "1"}
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft > 12
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 5, r.stderr
    assert "too many open files" in r.stderr and "ulimit -n" in r.stderr
    assert "cannot write" not in r.stderr
    assert beside(out) == []


def test_counts_and_ranks_read_as_english(tiny, tmp_path):
    code, out, err = run("save", str(tiny("llama")), str(tmp_path / "one"), "--tp", "1")
    assert code == 0, err
    assert "wrote 1 file," in out and "(1 rank)" in out
    code, out, err = run("save", str(tiny("llama")), str(tmp_path / "p"), "--tp", "4", "--ranks", "3-3")
    assert code == 0, err
    assert "wrote rank 3 (1 file of 4)" in out and "3-3" not in out
    assert (tmp_path / "p" / "reshard.ranks-3.json").is_file()  # the file name is unchanged


def test_verify_warns_about_a_leftover_staging_folder(complete):
    left = complete.parent / ".out.reshard-new-0123abcd"
    left.mkdir()
    (left / "model-rank-0-part-0.safetensors").write_bytes(b"x" * 3000)
    code, out, err = run("verify", str(complete))
    assert code == 0, out + err
    text = out + err
    assert ".out.reshard-new-0123abcd" in text and "safe to remove, or rerun save" in text and "KB" in text
