"""Splitting a save: `--ranks` pieces and a 2-process torchrun give the same files as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import OutputError
from reshard.manifest.pieces import assemble
from reshard.plan import DEFAULT_MAX_PART
from tests.fixtures.saving import save


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
    with pytest.raises(OutputError, match="not empty"):
        save(str(tiny("llama")), out, tp=2, dtype="float16", max_part_size=DEFAULT_MAX_PART, ranks="1")


def test_torchrun_two_processes_write_the_same_bytes(tiny, tmp_path):
    src = tiny("qwen3-moe")
    pieces = tmp_path / "pieces"
    for spec in ("0-1", "2-3"):
        save(str(src), pieces, tp=4, max_part_size=DEFAULT_MAX_PART, ranks=spec)
    env = {**os.environ, "RESHARD_DISABLE_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    cmd = [*torchrun, "-m", "reshard", "save", str(src), str(tmp_path / "tr"), "--tp", "4", "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
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
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
        cmd = [*torchrun, "-m", "reshard", "save", str(tiny("llama")), str(out), "--tp", "2"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode != 0 and "another reshard run" in p.stderr, p.stderr[-2000:]
        assert not out.exists()
    finally:
        os.close(fd)


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
