"""Splitting a save: `--ranks` pieces and a 2-process torchrun give the same files as one process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import OutputError
from reshard.manifest.pieces import assemble
from reshard.plan import DEFAULT_MAX_PART
from tests.fixtures.saving import save
from tests.fixtures.torchrun import torchrun


def tensors(folder):
    out = {}
    for p in sorted(folder.glob("model-rank-*.safetensors")):
        out.update({f"{p.name}/{k}": v for k, v in load_file(str(p)).items()})
    return out


def same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(
            a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)
        ), k


def test_rank_pieces_assemble_into_the_whole(tiny, tmp_path):
    src = tiny("qwen3-moe")
    whole = tmp_path / "whole"
    save(str(src), whole, tp=4, max_part_size=DEFAULT_MAX_PART)
    out = tmp_path / "pieces"
    first = save(str(src), out, tp=4, max_part_size=DEFAULT_MAX_PART, ranks="0-1")
    assert not (out / "reshard.json").exists() and first.ranks == [0, 1] and first.manifest is None
    with pytest.raises(OutputError, match="not written yet"):
        assemble(out)
    save(str(src), out, tp=4, max_part_size=DEFAULT_MAX_PART, ranks="2,3")
    manifest = json.loads((out / "reshard.json").read_text())
    assert [f["name"] for f in manifest["files"]] == [f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    assert not list(out.glob("reshard.ranks-*.json"))
    same_tensors(tensors(out), tensors(whole))


def test_pieces_of_another_job_are_refused(tiny, tmp_path):
    out = tmp_path / "out"
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    with pytest.raises(OutputError, match="holds --ranks pieces of another job"):
        save(str(tiny("llama")), out, tp=2, dtype="float16", max_part_size=DEFAULT_MAX_PART, ranks="1")


def test_assemble_refuses_pieces_of_two_jobs_and_a_file_no_piece_lists(tiny, tmp_path):
    """Pieces copied together from two jobs: their manifests disagree (exit 7, naming both, saying
    what to do); a rank file no piece lists (a stale part): exit 5 naming it, nothing written. Each
    was assembled, or exit 5 without a hint, and verify then failed the folder."""
    import shutil

    from tests.fixtures.cli import run

    a, b, mixed = tmp_path / "a", tmp_path / "b", tmp_path / "mixed"
    save(str(tiny("qwen3")), a, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    save(str(tiny("qwen3")), b, tp=2, dtype="float16", max_part_size=DEFAULT_MAX_PART, ranks="1")
    shutil.copytree(a, mixed)
    for f in b.iterdir():
        shutil.copy(f, mixed / f.name)
    code, _, err = run("assemble", str(mixed))
    assert code == 7 and "pieces of two different jobs" in err and "remove the other job's" in err, err
    full = tmp_path / "full"
    shutil.copytree(a, full)
    save(str(tiny("qwen3")), tmp_path / "b2", tp=2, max_part_size=DEFAULT_MAX_PART, ranks="1")
    for f in (tmp_path / "b2").iterdir():  # the same job's other piece: files and piece manifest
        shutil.copy(f, full / f.name)
    stale = full / "model-rank-1-part-1.safetensors"
    shutil.copy(full / "model-rank-1-part-0.safetensors", stale)
    code, _, err = run("assemble", str(full))
    assert code == 5 and stale.name in err and "remove it" in err, err
    assert not (full / "reshard.json").exists()
    stale.unlink()
    code, out, err = run("assemble", str(full), "--json")
    assert code == 0 and run("verify", str(full))[0] == 0, err
    got = json.loads(out)  # what save --json says of a whole output
    assert got["ok"] and got["out_dir"] == str(full) and got["files"] == 2
    assert got["run_id"] == json.loads((full / "reshard.json").read_text())["run_id"]


def test_torchrun_two_processes_write_the_same_bytes(tiny, tmp_path):
    src = tiny("qwen3-moe")
    pieces = tmp_path / "pieces"
    for spec in ("0-1", "2-3"):
        save(str(src), pieces, tp=4, max_part_size=DEFAULT_MAX_PART, ranks=spec)
    env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    p = torchrun(
        tmp_path / "logs", ["-m", "reshard", "save", str(src), str(tmp_path / "tr"), "--tp", "4", "--json"], env
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert any((tmp_path / "logs").iterdir())  # torchrun's logs there, not in a /tmp/torchelastic_* left behind
    for r in range(4):
        name = f"model-rank-{r}-part-0.safetensors"
        # one job, one run id: byte for byte the files the single-process pieces wrote
        assert (tmp_path / "tr" / name).read_bytes() == (pieces / name).read_bytes()
    manifest = json.loads((tmp_path / "tr" / "reshard.json").read_text())
    assert len(manifest["files"]) == 4


def test_torchrun_into_a_locked_folder_fails_on_every_process(tiny, tmp_path):
    """Process 0 cannot take OUT_DIR's lock: every process exits 5, none waits for the others for ever."""
    import fcntl

    out = tmp_path / "out"
    fd = os.open(tmp_path / ".out.reshard.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
        p = torchrun(tmp_path / "logs", ["-m", "reshard", "save", str(tiny("llama")), str(out), "--tp", "2"], env)
        assert p.returncode != 0 and "another reshard run" in p.stderr, p.stderr[-2000:]
        assert not out.exists()
    finally:
        os.close(fd)


COUNTING = """
import os, sys
from pathlib import Path
import reshard.hashing as hashing

plain = hashing.hash_file

def counted(path, algorithm, **kw):  # each source file hashed (sha256), by this process's RANK
    if algorithm == "sha256":
        with open(Path(sys.argv[1]) / os.environ["RANK"], "a") as f:
            f.write(Path(path).name + "\\n")
    return plain(path, algorithm, **kw)

hashing.hash_file = counted
from reshard.cli import main
main(sys.argv[2:])
"""


def torchrun_counting(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    """`reshard ARGS` under a 2-process torchrun; what each process (by RANK) hashed with sha256."""
    script, log = tmp_path / "counting.py", tmp_path / "hashed"
    script.write_text(COUNTING)
    log.mkdir()
    env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    p = torchrun(tmp_path / "logs", [str(script), str(log), *args], env)
    return p, {f.name: sorted(f.read_text().split()) for f in log.iterdir()}


def test_torchrun_hashes_a_checked_source_once_in_process_0(tiny, tmp_path):
    """With sha256s for the source (--source-sha256), process 0 checks every file before any process
    reads one; the others take its records instead of hashing everything again."""
    import hashlib
    import shutil

    src = Path(shutil.copytree(tiny("qwen3-moe"), tmp_path / "src"))
    names = sorted(p.name for p in src.glob("*.safetensors"))
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("".join(f"{hashlib.sha256((src / n).read_bytes()).hexdigest()}  {n}\n" for n in names))
    p, hashed = torchrun_counting(
        tmp_path, "save", str(src), str(tmp_path / "out"), "--tp", "4", "--source-sha256", str(sums)
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert hashed == {"0": names}  # process 1 hashed nothing
    manifest = json.loads((tmp_path / "out" / "reshard.json").read_text())
    assert {f["name"]: f["check"] for f in manifest["source_files"]} == dict.fromkeys(names, "sha256-file verified")

    data = bytearray((src / names[-1]).read_bytes())
    data[-1] ^= 1
    (src / names[-1]).write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "hashed")
    p, hashed = torchrun_counting(
        tmp_path, "save", str(src), str(tmp_path / "bad"), "--tp", "4", "--source-sha256", str(sums)
    )
    assert p.returncode != 0 and names[-1] in p.stderr and "sha256" in p.stderr, p.stderr[-2000:]
    assert "0" in hashed and "1" not in hashed  # every process stops on process 0's error
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("damage", ["not json {", '{"format": "reshard-sharded-state", "format_version": 1}', "[]"])
def test_a_damaged_piece_manifest_is_exit_7_naming_it(tiny, tmp_path, damage):
    """A piece manifest that does not parse or validate (a disk error, a hand edit) stops assemble, the
    next --ranks piece and verify with exit 7 and one line naming the file, never a traceback (exit 1)."""
    from tests.fixtures.cli import run

    src, out = tiny("llama"), tmp_path / "pieces"
    assert run("save", str(src), str(out), "--tp", "2", "--ranks", "0")[0] == 0
    piece = next(out.glob("reshard.ranks-*.json"))
    piece.write_text(damage)
    for args in (["assemble", str(out)], ["save", str(src), str(out), "--tp", "2", "--ranks", "1"]):
        code, _, err = run(*args)
        assert code == 7 and f"{piece.name}: damaged piece manifest" in err and len(err.strip().splitlines()) == 1
    code, out_text, _ = run("verify", str(out))
    assert code == 7 and piece.name in out_text


def test_json_says_whether_a_piece_completed_the_output(tiny, tmp_path):
    """`complete` in every save --json: false for a piece that leaves others to come, true for the
    one that completes the output (it printed the full save object without the key)."""
    import json

    from tests.fixtures.cli import run

    src, out = tiny("llama"), tmp_path / "pieces"
    code, first, _ = run("save", str(src), str(out), "--tp", "2", "--ranks", "0", "--json")
    assert code == 0 and json.loads(first)["complete"] is False
    code, last, _ = run("save", str(src), str(out), "--tp", "2", "--ranks", "1", "--json")
    assert code == 0 and json.loads(last)["complete"] is True and (out / "reshard.json").is_file()


def test_pieces_of_two_copies_of_the_checkpoint_are_refused(tmp_path):
    """Two machines' copies of the checkpoint at one path, one of them another model: the job's run id is
    the same (it names the path, arguments and tensor shapes, not bytes), but the pieces hashed their
    source files (--source-sha256) and those differ: exit 7, not an output mixing two models that verifies."""
    import hashlib
    import shutil

    from tests.fixtures.cli import run
    from tests.fixtures.tiny import make_tiny

    src, joined = tmp_path / "m", tmp_path / "joined"
    pieces = []
    for seed, rank in ((0, "0"), (1, "1")):
        if src.exists():
            shutil.rmtree(src)
        make_tiny("llama", src, seed=seed)
        sums = tmp_path / f"sums{seed}"
        sums.write_text(
            "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in src.glob("*.safetensors"))
        )
        piece = tmp_path / f"piece{seed}"
        code, _, err = run("save", str(src), str(piece), "--tp", "2", "--ranks", rank, "--source-sha256", str(sums))
        assert code == 0, err
        pieces.append(piece)
    joined.mkdir()
    for piece in pieces:
        for f in piece.iterdir():
            if not (joined / f.name).exists():
                shutil.copy(f, joined / f.name)
    code, _, err = run("assemble", str(joined))
    assert code == 7 and "pieces of two different sources: model.safetensors has sha256" in err, err
    assert not (joined / "reshard.json").exists()


def test_a_piece_never_joins_another_jobs_pieces_even_with_overwrite(tiny, tmp_path):
    """`--ranks 3 --overwrite` into a folder of another job's pieces: refused before anything is written
    (it was exit 7 after writing its rank file, its piece manifest and another model's config.json)."""
    from tests.fixtures.cli import run

    out = tmp_path / "out"
    save(str(tiny("qwen3-moe")), out, tp=4, max_part_size=DEFAULT_MAX_PART, ranks="0-2")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = run("save", str(tiny("llama")), str(out), "--tp", "4", "--ranks", "3", "--overwrite")
    assert code == 5 and "holds --ranks pieces of another job" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_pieces_split_at_another_part_size_are_another_job(tiny, tmp_path):
    """A piece saved with another --max-part-size lists other files: it is another job (refused at once),
    not a folder that waits forever for files no piece will write."""
    out = tmp_path / "out"
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    with pytest.raises(OutputError, match="holds --ranks pieces of another job"):
        save(str(tiny("llama")), out, tp=2, max_part_size=100_000, ranks="1")


def test_assemble_finishes_removing_the_piece_manifests_of_an_assembled_folder(tiny, tmp_path):
    """A kill between writing reshard.json and removing the piece manifests: assemble again removes them
    (it said 'no piece manifest lists' a rank file and 'rerun the --ranks piece', which a complete output
    refuses)."""
    import shutil

    from tests.fixtures.cli import run

    out = tmp_path / "out"
    save(str(tiny("llama")), tmp_path / "p0", tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    kept = tmp_path / "kept.json"
    shutil.copy(next((tmp_path / "p0").glob("reshard.ranks-*.json")), kept)
    shutil.copytree(tmp_path / "p0", out)
    save(str(tiny("llama")), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="1")  # the last piece assembles
    assert (out / "reshard.json").exists() and not list(out.glob("reshard.ranks-*.json"))
    shutil.copy(kept, out / "reshard.ranks-0.json")  # as a kill would have left it
    code, _, err = run("assemble", str(out))
    assert code == 0, err
    assert not list(out.glob("reshard.ranks-*.json")) and run("verify", str(out))[0] == 0
    # and once more, every piece manifest gone (a kill just after the last was removed): done already, exit 0
    # (it said "no piece manifests to assemble (copy the folders ... into this one first)")
    code, _, err = run("assemble", str(out))
    assert code == 0 and "model-rank-" not in err, err
