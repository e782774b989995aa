"""Hostile folders and malformed input (issue 24, cases 10-13): symlinks out of the source, FIFOs,
`/dev/zero`, names with `..`, huge manifest values and deep nesting end in a documented exit code
and a one-line message, never a hang, exit 1, or a byte read or written outside the folders.

The CLI runs in a subprocess with a timeout wherever the old behaviour was a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.manifest import read_manifest
from tests.fixtures.cli import run

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 20  # seconds: a hang fails the test instead of the suite


def cli(*args: str) -> tuple[int, str]:
    """`reshard ARGS` in a subprocess; (exit code, stderr + stdout). A hang fails the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESHARD_DISABLE_PROGRESS": "1", "NO_COLOR": "1"}
    try:
        p = subprocess.run(
            [sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=TIMEOUT, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reshard {' '.join(args)} hung for {TIMEOUT} s")
    return p.returncode, p.stderr + p.stdout


def edit_manifest(folder: Path, fn) -> None:
    path = folder / "reshard.json"
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


@pytest.fixture
def src(tiny, tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(tiny("llama"), dst)
    return dst


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text("TOP-SECRET-TOKEN\n")
    return path


def nothing_holds(folder: Path, text: str) -> bool:
    """No regular file under `folder` holds `text`."""
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()] if folder.exists() else []
    return all(text.encode() not in p.read_bytes() for p in files)


# ---- case 10: the source's side files --------------------------------------------------------------


@pytest.mark.parametrize("target", ["secret", "/dev/zero", "/etc/hostname"])
def test_side_file_linked_outside_the_source_is_refused(src, secret, tmp_path, target):
    link = src / "special_tokens_map.json"
    os.symlink(secret if target == "secret" else target, link)
    out = tmp_path / "out"
    code, err = cli("save", str(src), str(out), "--tp", "2")
    assert code == 4, err
    assert "special_tokens_map.json" in err and "outside the source" in err and "Traceback" not in err
    assert not out.exists() and nothing_holds(tmp_path / "out", "TOP-SECRET")


def test_side_file_fifo_is_refused_and_blamed_on_the_source(src, tmp_path):
    os.mkfifo(src / "tokenizer.model")
    out = tmp_path / "out"
    code, err = cli("save", str(src), str(out), "--tp", "2")
    assert code == 4, err
    assert "tokenizer.model" in err and "not a regular file (a FIFO)" in err and "OUT_DIR" not in err
    assert not out.exists()


@pytest.mark.parametrize("how", ["two links to each other", "a folder's link to its parent", "a dangling link"])
def test_side_file_links_that_lead_nowhere_are_refused(src, tmp_path, how):
    """Links a copy would chase forever or that point at nothing: exit 4 naming them, not a
    RuntimeError (exit 1) or a copy 40 folders deep."""
    if how == "two links to each other":
        os.symlink("loopb", src / "loopa")
        os.symlink("loopa", src / "loopb")
    elif how == "a folder's link to its parent":
        (src / "x").mkdir()
        os.symlink("..", src / "x" / "up")
    else:
        os.symlink("nothere", src / "vocab.txt")
    out = tmp_path / "out"
    code, err = cli("save", str(src), str(out), "--tp", "2")
    assert code == 4 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "remove it from the source folder" in err
    assert not out.exists()


def test_side_file_linked_inside_the_source_is_copied_as_a_file(src, tmp_path):
    (src / "extra").mkdir()
    (src / "extra" / "chat_template.jinja").write_text("{{ messages }}\n")
    os.symlink("extra/chat_template.jinja", src / "chat_template.jinja")
    out = tmp_path / "out"
    code, _, err = run("save", str(src), str(out), "--tp", "2")
    assert code == 0, err
    copied = out / "chat_template.jinja"
    assert not copied.is_symlink() and copied.read_text() == "{{ messages }}\n"
    assert run("verify", str(out))[0] == 0


def hub_snapshot(src: Path, cache: Path) -> Path:
    """`src` laid out as the Hub cache does: blobs in models--ORG--NAME/blobs, the snapshot's files
    symlinks into ../../blobs/."""
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, p in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(p, blob)
        os.symlink(f"../../blobs/{blob.name}", snap / p.name)
    return snap


def test_hub_cache_snapshot_source_still_works(src, tmp_path):
    """Hub-cache snapshots are symlinks out of the snapshot folder into the repo's blobs: allowed."""
    snap = hub_snapshot(src, tmp_path / "hub")
    out = tmp_path / "out"
    code, _, err = run("save", str(snap), str(out), "--tp", "2")
    assert code == 0, err
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert run("verify", str(out))[0] == 0


def test_hub_cache_snapshot_link_out_of_the_repo_is_refused(src, secret, tmp_path):
    snap = hub_snapshot(src, tmp_path / "hub")
    os.symlink(secret, snap / "special_tokens_map.json")
    code, err = cli("save", str(snap), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and "special_tokens_map.json" in err and "outside the source" in err, err


def test_merge_refuses_a_copied_file_linked_outside(out, secret, tmp_path):
    (out / "generation_config.json").unlink()
    os.symlink(secret, out / "generation_config.json")
    hf = tmp_path / "hf"
    code, err = cli("merge", str(out), str(hf))
    # an output's copied file that is a symlink: the output fails its checks (as verify says, exit 7)
    assert code == 7 and "generation_config.json" in err and "symlink" in err, err
    assert nothing_holds(hf, "TOP-SECRET")


# ---- case 10/11: verify and the plugin on rank files and copied files that are not regular ---------------


def _replace(path: Path, how: str, tmp_path: Path) -> None:
    if how == "link-outside":  # the very same bytes, but outside the folder
        kept = tmp_path / ("kept-" + path.name)
        shutil.copyfile(path, kept)
        path.unlink()
        os.symlink(kept, path)
    elif how == "dev-zero":
        path.unlink()
        os.symlink("/dev/zero", path)
    else:
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize("how", ["link-outside", "dev-zero", "fifo"])
@pytest.mark.parametrize("name", ["model-rank-1-part-0.safetensors", "tokenizer.json"])
def test_verify_refuses_files_that_are_not_regular(out, tmp_path, how, name):
    _replace(out / name, how, tmp_path)
    code, err = cli("verify", str(out))
    assert code == 7, err
    assert name in err and ("symlink" in err or "FIFO" in err), err


@pytest.mark.parametrize("how", ["link-outside", "dev-zero", "fifo"])
def test_reshard_from_an_output_refuses_rank_files_that_are_not_regular(out, tmp_path, how):
    _replace(out / "model-rank-0-part-0.safetensors", how, tmp_path)
    code, err = cli("save", str(out), str(tmp_path / "again"), "--tp", "1")
    assert code == 7 and "model-rank-0-part-0.safetensors" in err, err


@pytest.mark.parametrize("how", ["link-outside", "dev-zero", "fifo"])
def test_plugin_check_files_refuses_rank_files_that_are_not_regular(out, tmp_path, how):
    _replace(out / "model-rank-1-part-0.safetensors", how, tmp_path)
    script = (
        "import sys; from dataclasses import replace; from pathlib import Path\n"
        "from reshard.manifest import read_manifest\n"
        "from reshard.vllm_plugin import checks\n"
        "from reshard.vllm_plugin.checks import ReshardLoadError\n"
        "folder = Path(sys.argv[1]); m = read_manifest(folder)\n"
        "e = checks.Engine(m.layout, quantization=None, vllm_version='0.32.0', tp_rank=1)\n"
        "try:\n    checks.check_files(folder, m, checks.rank_entries(m, e), e)\n"
        "except ReshardLoadError as err:\n    print(err)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr
    assert "model-rank-1-part-0.safetensors" in p.stdout and "not a regular file" in p.stdout, p.stdout


def test_fifo_manifest_is_malformed_not_waited_on(out):
    (out / "reshard.json").unlink()
    os.mkfifo(out / "reshard.json")
    code, err = cli("verify", str(out))
    assert code == 7 and "reshard.json" in err, err


@pytest.mark.parametrize("how", ["link-outside", "dev-zero"])
def test_a_manifest_that_is_a_symlink_is_not_followed(out, tmp_path, how):
    """The manifest must lie in the folder too: a link to a good manifest elsewhere (or to a device)
    is not read (verify passed a folder whose reshard.json led out of it)."""
    _replace(out / "reshard.json", how, tmp_path)
    code, err = cli("verify", str(out))
    assert code == 7 and "reshard.json" in err and "symlink" in err, err


def test_fifo_config_in_the_source_is_refused(src, tmp_path):
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    code, err = cli("plan", str(src), "--tp", "2")
    assert code == 4 and "config.json" in err and "FIFO" in err, err


# ---- case 11: names in the manifest that leave the folder ------------------------------------------------


def _side(name: str):
    def fn(m: dict) -> None:
        m["copied_files"].append({"name": name, "size": 10, m["checksum"]: "0" * 64})

    return fn


NAMES = {
    "copied /dev/zero": _side("/dev/zero"),
    "copied ../../etc/hostname": _side("../../etc/hostname"),
    "copied a/../../x": _side("a/../../x"),
    "copied list ..": lambda m: m["copied"].append("../../etc/hostname"),
    "copied list absolute": lambda m: m["copied"].append("/etc/hostname"),
    "rank file in a folder": lambda m: m["files"][0].update(name="sub/model-rank-0-part-0.safetensors"),
    "rank file absolute": lambda m: m["files"][0].update(name="/tmp/model-rank-0-part-0.safetensors"),
}


@pytest.mark.parametrize("case", sorted(NAMES))
def test_manifest_names_outside_the_folder_are_malformed(out, case):
    edit_manifest(out, NAMES[case])
    code, err = cli("verify", str(out))
    assert code == 7 and "malformed manifest" in err, err
    assert "hostname" not in err or "not a name inside the folder" in err


# ---- case 12: manifest values bounded -------------------------------------------------------------------


BOUNDS = {
    "tp 10**9": lambda m: m["layout"].update(tp=10**9),
    "pp 10**9": lambda m: m["layout"].update(pp=10**9),
    "tp*pp over the world": lambda m: m["layout"].update(tp=4096, pp=4096),
    "partition longer than pp": lambda m: m["layout"].update(pp_layer_partition=[1] * 10**6),
    "part 10**12": lambda m: m["files"][0].update(part=10**12),
    "size 2**60": lambda m: m["files"][0].update(size=2**60),
    "tp_rank 10**9": lambda m: m["files"][0].update(tp_rank=10**9),
    "shape 10**30": lambda m: m["files"][0]["tensors"][0].update(shape=[10**30]),
    "source tensor 10**30": lambda m: m["source_tensors"].update(x=["BF16", [10**30]]),
    "source tensor dtype": lambda m: m["source_tensors"].update(x=["Q9", [1]]),
    "total_bytes 2**60": lambda m: m.update(total_bytes=2**60),
}


@pytest.mark.parametrize("case", sorted(BOUNDS))
def test_huge_manifest_values_are_malformed_at_once(out, case):
    edit_manifest(out, BOUNDS[case])
    code, err = cli("verify", str(out))
    assert code == 7 and "malformed manifest" in err, err


# ---- case 13: never exit 1 on malformed input; merge and re-shard validate as verify does ------------------


MALFORMED = {
    "nested 200k deep": lambda p: p.write_text("[" * 200_000 + "]" * 200_000),
    "format_version true": lambda p: edit_manifest(p.parent, lambda m: m.update(format_version=True)),
    "files empty": lambda p: edit_manifest(p.parent, lambda m: m.update(files=[])),
    "files of one rank only": lambda p: edit_manifest(p.parent, lambda m: m.update(files=m["files"][:1])),
    "copied_files an int": lambda p: edit_manifest(p.parent, lambda m: m.update(copied_files=5)),
    "copied_files zero": lambda p: edit_manifest(p.parent, lambda m: m.update(copied_files=0)),
    "source_tensors bad": lambda p: edit_manifest(p.parent, lambda m: m.update(source_tensors={"x": 5})),
    "source_tensors a list": lambda p: edit_manifest(p.parent, lambda m: m.update(source_tensors=[1])),
    # each entry is checked with the others in bulk first (schema._well_formed), then alone to name it
    "source tensor dtype a list": lambda p: edit_manifest(p.parent, lambda m: m["source_tensors"].update(x=[[], [1]])),
    "source tensor size true": lambda p: edit_manifest(
        p.parent, lambda m: m["source_tensors"].update(x=["BF16", [True]])
    ),
    "source tensor size 1.0": lambda p: edit_manifest(
        p.parent, lambda m: m["source_tensors"].update(x=["BF16", [1.0]])
    ),
    "source tensor size -1": lambda p: edit_manifest(p.parent, lambda m: m["source_tensors"].update(x=["BF16", [-1]])),
    "source tensor of 3 items": lambda p: edit_manifest(
        p.parent, lambda m: m["source_tensors"].update(x=["BF16", [1], 1])
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_refused_by_verify_merge_and_reshard(out, tmp_path, case):
    MALFORMED[case](out / "reshard.json")
    for cmd in (["verify", str(out)], ["merge", str(out), str(tmp_path / "hf")]):
        code, err = cli(*cmd)
        assert code == 7, (cmd, err)
        assert "internal error" not in err and "Traceback" not in err
    code, err = cli("save", str(out), str(tmp_path / "again"), "--tp", "1")
    assert code == 7, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "again").exists()


CONFIGS = {
    "compression_config": "x",
    "layer_types": "x",
    "interleave_moe_layer_step": float("nan"),
    "full_attention_interval": "x",
}


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_malformed_config_values_exit_4_naming_the_key(src, key):
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, key: CONFIGS[key]}))
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4 and key in err and err.count("\n") == 1, err


def test_layer_types_shorter_than_the_layers_exit_4(tiny, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"]}))
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4 and "layer_types" in err, err


def test_string_quantization_in_the_manifest_is_malformed(out):
    edit_manifest(out, lambda m: m["layout"].update(quantization="fp8"))
    with pytest.raises(Exception) as info:
        read_manifest(out)
    assert "layout.quantization" in str(info.value)
