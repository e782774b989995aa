"""`reshard verify`: a fault matrix on real `save` outputs of tiny checkpoints.

Each case damages a copy of one clean output the way it happens in practice (a truncated copy, a
flipped bit, a file from another run, a hand-edited file) and checks the exit code and that the
message names the file and, where it applies, the tensor.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.cli import cli, main
from reshard.errors import CorruptError
from reshard.format import read_header
from reshard.manifest import read_manifest
from reshard.plan import DEFAULT_MAX_PART
from reshard.verify import verify
from tests.fixtures.saving import save

RANK0 = "model-rank-0-part-0.safetensors"
RANK1 = "model-rank-1-part-0.safetensors"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"
ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, ["verify", *map(str, args), "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


def errors(report: dict, kind: str | None = None) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] == "error" and (kind is None or f["kind"] == kind)]


def one(report: dict, kind: str, *, file: str | None = None, tensor: str | None = None) -> dict:
    """The finding of `kind`, checked to name `file` and `tensor` (field and message)."""
    found = [f for f in report["findings"] if f["kind"] == kind and (file is None or f["file"] == file)]
    assert found, f"no {kind} finding for {file}: {report['findings']}"
    f = found[0]
    if file:
        assert file in f["message"], f
    if tensor:
        assert f["tensor"] == tensor and tensor in f["message"], f
    return f


def tensor_at(path, name):
    tensors, _, _ = read_header(path)
    return tensors[name]


def rewrite(out_dir, name, mutate, *, relist: bool = False):
    """Rewrite one rank file with safetensors after `mutate(tensors)`, then fix its size and sha256
    in the manifest, so that only the key check can tell; `relist`: its tensor list too (a folder
    whose manifest records the file as it is, as `--load-format reshard` reads it)."""
    path = out_dir / name
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    mutate(tensors)
    save_file(tensors, str(path), metadata=meta)
    manifest = json.loads((out_dir / "reshard.json").read_text())
    for e in manifest["files"]:
        if e["name"] == name:
            e["size"] = path.stat().st_size
            e["blake3"] = blake3.blake3(path.read_bytes()).hexdigest()
            if relist:
                infos = sorted(read_header(path)[0].values(), key=lambda t: t.offset)
                e["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in infos]
    (out_dir / "reshard.json").write_text(json.dumps(manifest))


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# ---- clean outputs ------------------------------------------------------------------------------


def test_clean_output_passes(clean):
    code, rep = run(clean[1])
    assert code == 0, rep["findings"]
    assert rep["findings"] == []
    assert rep["checked"] == ["manifest", "structure", "keys", "checksums"]
    assert len(rep["files"]) == 2 and all(f["digest"] for f in rep["files"])
    assert rep["keys"] > 0 and rep["layout"]["tp"] == 2


def test_readable_report(clean):
    result = CliRunner().invoke(cli, ["verify", str(clean[1])])
    assert result.exit_code == 0
    assert RANK0 in result.stdout and "OK:" in result.stdout and "2 files" in result.stdout


@pytest.mark.parametrize(
    "arch, kw",
    [
        ("qwen3-moe", {"tp": 2, "ep": True}),
        ("qwen3-moe-fp8", {"tp": 2}),
        ("llama-tied", {"tp": 2, "pp": 2}),
        ("llama", {"tp": 2, "pp": 2, "pp_partition": [1, 3]}),  # not vLLM's default split
    ],
    ids=["qwen3-moe-tp2-ep", "qwen3-moe-fp8-tp2", "llama-tied-tp2-pp2", "llama-tp2-pp2-partition"],
)
def test_clean_layouts_pass(tiny, tmp_path, arch, kw):
    src = tiny(arch)
    save(str(src), tmp_path / "o", max_part_size=200_000, **kw)  # several parts per rank
    report = verify(tmp_path / "o")
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert "keys" in report.checked
    report = verify(tmp_path / "o", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["compared_bytes"] > 0 and all(s.digest for s in report.files)


def test_exit_code_through_main(out):
    (out / RANK1).unlink()
    with pytest.raises(SystemExit) as e:
        main(["verify", str(out), "--json"])
    assert e.value.code == 7


# ---- corruption: exit 7 -------------------------------------------------------------------------


def test_truncated_file(out):
    path = out / RANK1
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    code, rep = run(out)
    assert code == 7
    # the first tensor cut: qkv of the last layer, then model.norm
    f = one(rep, "size", file=RANK1, tensor="model.layers.3.self_attn.qkv_proj.weight")
    assert "truncated" in f["message"]


def test_flipped_byte(out):
    info = tensor_at(out / RANK0, QKV)
    flip(out / RANK0, info.offset + 100)
    code, rep = run(out)
    assert code == 7
    assert "--against SOURCE" in one(rep, "checksum", file=RANK0)["message"]
    assert [f["file"] for f in errors(rep)] == [RANK0]


def test_flipped_byte_named_with_against(clean, out):
    info = tensor_at(out / RANK0, QKV)
    flip(out / RANK0, info.offset + 100)
    code, rep = run(out, "--against", clean[0])
    assert code == 7
    one(rep, "checksum", file=RANK0)
    f = one(rep, "data", file=RANK0, tensor=QKV)
    assert "byte 100 " in f["message"]


def test_missing_rank_file(out):
    (out / RANK1).unlink()
    code, rep = run(out)
    assert code == 7
    assert "missing" in one(rep, "missing-file", file=RANK1)["message"]


def test_missing_manifest(out):
    (out / "reshard.json").unlink()
    code, rep = run(out)
    assert code == 7
    f = one(rep, "manifest")
    assert "reshard.json" in f["message"] and "--against SOURCE --tp T" in f["message"]


def test_malformed_manifest(out):
    (out / "reshard.json").write_text('{"format": "reshard-sharded-state", "files": [')
    code, rep = run(out)
    assert code == 7
    f = one(rep, "manifest", file="reshard.json")
    assert "malformed" in f["message"] and "--against SOURCE --tp T" in f["message"]


def test_manifest_with_hostile_file_name(out):
    manifest = json.loads((out / "reshard.json").read_text())
    manifest["files"][0]["name"] = "../../etc/passwd"
    (out / "reshard.json").write_text(json.dumps(manifest))
    code, rep = run(out)
    assert code == 7 and "not a rank file name" in one(rep, "manifest")["message"]


def test_a_manifest_that_leaves_config_json_out_is_malformed(out):
    """Edited out of copied_files, config.json would be checked by nothing (verify, --against, the plugin),
    and an edited one serves other tokens from the same weights. Save always records it."""
    manifest = json.loads((out / "reshard.json").read_text())
    manifest["copied_files"] = [c for c in manifest["copied_files"] if c["name"] != "config.json"]
    manifest["copied"] = [c for c in manifest["copied"] if c != "config.json"]
    (out / "reshard.json").write_text(json.dumps(manifest))
    code, rep = run(out)
    assert code == 7 and "copied_files does not list config.json" in one(rep, "manifest")["message"]
    with pytest.raises(CorruptError, match=r"copied_files does not list config\.json"):
        read_manifest(out)


def test_a_file_vllm_reads_added_after_the_save_fails(out):
    """A chat template (or tokenizer file, or config) put beside the output after the save: vLLM would serve
    with it and nothing the manifest records tells it. Files the engine does not read are left alone."""
    (out / "README.md").write_text("notes")
    (out / "notes.txt").write_text("notes")
    assert run(out)[0] == 0
    (out / "chat_template.jinja").write_text("{{ messages }}")
    code, rep = run(out)
    assert code == 7 and [f["file"] for f in errors(rep)] == ["chat_template.jinja"]
    assert "not in the manifest (added after the save?)" in one(rep, "unlisted-file")["message"]


def test_two_runs_mixed(clean, out, tmp_path):
    other = save(str(clean[0]), tmp_path / "other", tp=2, max_part_size=DEFAULT_MAX_PART)
    shutil.copy(Path(other.out_dir) / RANK1, out / RANK1)
    code, rep = run(out)
    assert code == 7
    f = one(rep, "run-mix", file=RANK1)
    assert other.manifest.run_id[:12] in f["message"] and "two runs" in f["message"]
    assert [x["file"] for x in errors(rep)] == [RANK1, RANK1]  # run-mix, checksum


def test_swapped_rank_files_are_named_without_checksums(out):
    """Rank 0's and rank 1's files (same size, same tensor names and shapes) swapped: each file's header
    records its own name, so the swap shows without reading a digest."""
    (out / RANK0).rename(out / "keep")
    (out / RANK1).rename(out / RANK0)
    (out / "keep").rename(out / RANK1)
    code, rep = run(out, "--no-checksums")
    assert code == 7
    assert [f["file"] for f in errors(rep, "renamed")] == [RANK0, RANK1]
    assert (
        f"{RANK0} was written as {RANK1}: rank files were renamed or swapped"
        in one(rep, "renamed", file=RANK0)["message"]
    )


def test_stray_rank_file(out):
    shutil.copy(out / RANK0, out / "model-rank-8-part-0.safetensors")  # left by an older --tp 16
    code, rep = run(out)
    assert code == 7
    one(rep, "stray", file="model-rank-8-part-0.safetensors")


def test_hostile_header(out):
    path = out / RANK0
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write((size * 1000).to_bytes(8, "little"))
    code, rep = run(out)
    assert code == 7
    f = one(rep, "header", file=RANK0)
    assert "header length" in f["message"]


# ---- layout: exit 6 -----------------------------------------------------------------------------


def test_wrong_tp(out):
    code, rep = run(out, "--tp", "4")
    assert code == 6
    f = one(rep, "layout")
    assert "made for tp=2 pp=1 ep=off, you asked tp=4 pp=1 ep=off" in f["message"]
    assert (rep["layout"]["tp"], rep["recorded_layout"]["tp"]) == (4, 2)  # checked as asked; as recorded


def test_wrong_ep(tiny, clean, tmp_path):
    src = tiny("qwen3-moe")
    save(str(src), tmp_path / "moe", tp=2, ep=True, max_part_size=DEFAULT_MAX_PART)
    code, rep = run(tmp_path / "moe", "--no-ep")
    assert code == 6
    assert "made for tp=2 pp=1 ep=on, you asked tp=2 pp=1 ep=off" in one(rep, "layout")["message"]
    # a dense model's files are the same with or without --enable-expert-parallel
    code, rep = run(clean[1], "--ep")
    assert code == 0 and one(rep, "layout")["severity"] == "warning"


def test_extra_key(out):
    rewrite(out, RANK1, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(4)}))
    code, rep = run(out)
    assert code == 6, rep["findings"]
    f = one(rep, "unexpected-key", file=RANK1, tensor="model.layers.0.mlp.extra.weight")
    assert "KeyError" in f["message"]
    assert len(errors(rep)) == 1  # the header-vs-manifest difference is not told twice


def test_missing_key_strict_and_lax(out):
    rewrite(out, RANK1, lambda t: t.pop(NORM), relist=True)
    code, rep = run(out)
    assert code == 6 and rep["loads_with"] is None
    f = one(rep, "missing-key", file=RANK1, tensor=NORM)
    assert f["severity"] == "error" and "Missing keys" in f["message"]
    code, rep = run(out, "--lax")
    assert code == 0, rep["findings"]
    f = one(rep, "missing-key", file=RANK1, tensor=NORM)
    assert f["severity"] == "warning" and """'{"strict": false}'` leaves it as initialised""" in f["message"]


def test_lax_says_which_loader_takes_the_folder(clean, out):
    """--lax passes exactly what `--load-format reshard` with {"strict": false} loads, and says so:
    the serve line for it (the manifest's serve_reshard plus the setting), and that stock
    sharded_state refuses the folder."""
    rewrite(out, RANK1, lambda t: t.pop(NORM), relist=True)
    serve = json.loads((out / "reshard.json").read_text())["serve_reshard"]  # names the folder copied
    serve = serve.replace(f"vllm serve {clean[1]} ", f"vllm serve {out} ")  # verify names the one it checks
    line = f"""{serve} --model-loader-extra-config '{{"strict": false}}'"""
    code, rep = run(out, "--lax")
    assert code == 0 and rep["ok"] and "error" not in rep
    assert rep["loads_with"] == {
        "load_format": "reshard",
        "strict": False,
        "model_loader_extra_config": {"strict": False},
        "serve": line,
    }
    f = one(rep, "sharded-state")
    assert f["severity"] == "warning" and "--load-format sharded_state refuses this folder" in f["message"]
    assert "1 key(s) in 1 file(s)" in f["message"]
    result = CliRunner().invoke(cli, ["verify", str(out), "--lax"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert f"loads with: `{line}` (not with stock --load-format sharded_state)" in text
    assert "warning: [sharded-state] vLLM's --load-format sharded_state refuses this folder" in text
    assert 'OK with 2 warning(s) (lax: loads only with --load-format reshard and {"strict": false})' in text
    # a folder vLLM loads as is: loads_with says stock sharded_state, strict
    code, rep = run(clean[1], "--lax")
    assert code == 0 and rep["loads_with"] == {
        "load_format": "sharded_state",
        "strict": True,
        "model_loader_extra_config": None,
        "serve": json.loads((clean[1] / "reshard.json").read_text())["serve"],
    }


def test_lax_does_not_excuse_what_the_loader_refuses(out):
    """The manifest still lists the missing key: `--load-format reshard` refuses the file (its header
    differs from the manifest), so --lax fails too, as corrupt."""
    rewrite(out, RANK1, lambda t: t.pop(NORM))
    code, rep = run(out, "--lax")
    assert code == 7 and rep["loads_with"] is None
    assert "the manifest lists " + NORM in one(rep, "manifest-mismatch", file=RANK1, tensor=NORM)["message"]
    assert one(rep, "missing-key", file=RANK1, tensor=NORM)["severity"] == "warning"


def test_lax_still_fails_on_corruption(out):
    rewrite(out, RANK1, lambda t: t.pop(NORM))
    flip(out / RANK0, tensor_at(out / RANK0, QKV).offset)
    code, _ = run(out, "--lax")
    assert code == 7


def test_shape_mismatch(out):
    rewrite(out, RANK0, lambda t: t.update({QKV: t[QKV][:-8].clone()}))
    code, rep = run(out)
    assert code == 6
    f = one(rep, "shape", file=RANK0, tensor=QKV)
    assert "[184, 64]" in f["message"] and "[192, 64]" in f["message"] and "uninitialised" in f["message"]


def test_dtype_mismatch(out):
    rewrite(out, RANK0, lambda t: t.update({NORM: t[NORM].float()}))
    code, rep = run(out, "--lax")  # lax does not excuse dtypes
    assert code == 6
    f = one(rep, "dtype", file=RANK0, tensor=NORM)
    assert "F32" in f["message"] and "BF16" in f["message"]


def test_corrupt_wins_over_layout(out):
    rewrite(out, RANK1, lambda t: t.pop(NORM))
    (out / RANK0).unlink()
    code, rep = run(out)
    assert code == 7
    assert {f["exit_code"] for f in errors(rep)} == {6, 7}


# ---- where the verdict goes -----------------------------------------------------------------------------


def test_a_failure_has_the_error_object_and_a_stderr_line(out):
    """--json: the report and, failing, the `error` object every command's --json failure has (the
    deciding error: 7 wins over 6). Both forms end with one `reshard: error:` line on stderr."""
    rewrite(out, RANK1, lambda t: t.pop(NORM), relist=True)  # 6
    (out / RANK0).unlink()  # 7
    result = CliRunner().invoke(cli, ["verify", str(out), "--json"])
    assert result.exit_code == 7
    rep = json.loads(result.stdout)
    first = errors(rep)[[f["exit_code"] for f in errors(rep)].index(7)]
    assert rep["ok"] is False and rep["error"] == {"code": 7, "kind": first["kind"], "message": first["message"]}
    assert first["kind"] == "missing-file" and RANK0 in first["message"]
    more = len(errors(rep)) - 1
    line = f"reshard: error: verify: corrupt or incomplete (exit 7): {first['message']} (and {more} more error(s))"
    assert result.stderr == line + "\n"
    human = CliRunner().invoke(cli, ["verify", str(out)])
    assert human.exit_code == 7 and human.stderr == line + "\n"
    assert "FAILED (corrupt or incomplete, exit 7)" in human.stdout and "reshard: error" not in human.stdout
    gone = CliRunner().invoke(cli, ["verify", str(out.parent / "nothing")])
    assert gone.exit_code == 7 and gone.stderr.startswith("reshard: error: verify: corrupt or incomplete (exit 7): ")


def test_a_passing_verify_writes_nothing_on_stderr(clean):
    result = CliRunner().invoke(cli, ["verify", str(clean[1]), "--json"], env={"RESHARD_DISABLE_PROGRESS": "1"})
    assert result.exit_code == 0 and result.stderr == ""
    assert "error" not in json.loads(result.stdout)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["verify", "OUT"], 141),
        (["verify", "OUT", "--json"], 141),
        (["verify", "BROKEN"], 141),
        (["plan", "SRC", "--tp", "2"], 141),
        (["plan", "SRC", "--tp", "2", "--json"], 141),
    ],
)
def test_a_closed_stdout_ends_quietly(clean, tmp_path, args, code):
    """`reshard verify OUT | head -1`: the reader is gone before reshard writes. Exit 141 (as SIGPIPE
    would end it), no traceback, no "internal error"; a failing verify still says why on stderr."""
    broken = tmp_path / "broken"
    shutil.copytree(clean[1], broken)
    (broken / RANK0).unlink()
    where = {"OUT": str(clean[1]), "SRC": str(clean[0]), "BROKEN": str(broken)}
    argv = [where.get(a, a) for a in args]
    r, w = os.pipe()
    os.close(r)  # the reader has exited: every write to stdout fails with EPIPE
    try:
        env = dict(os.environ, RESHARD_DISABLE_PROGRESS="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run(
            [sys.executable, "-m", "reshard", *argv], stdout=w, stderr=subprocess.PIPE, text=True, env=env, timeout=120
        )
    finally:
        os.close(w)
    assert proc.returncode == code, proc.stderr
    if "BROKEN" in args:
        assert proc.stderr.startswith("reshard: error: verify: corrupt or incomplete (exit 7): ")
        assert proc.stderr.count("\n") == 1
    else:
        assert proc.stderr == ""


# ---- --against SOURCE [--deep] ------------------------------------------------------------------


def test_deep_clean(clean):
    code, rep = run(clean[1], "--against", clean[0], "--deep")
    assert code == 0, rep["findings"]
    assert "deep" in rep["checked"]
    assert rep["stats"]["compared_bytes"] > 0
    # the digest came with the compare: no second pass over the files
    assert "hashed_bytes" not in rep["stats"] and rep["stats"]["hashed_in_compare_bytes"] == rep["bytes"]
    assert all(f["digest"] for f in rep["files"])


def test_deep_names_flipped_tensor(clean, out):
    info = tensor_at(out / RANK1, "model.layers.2.mlp.down_proj.weight")
    flip(out / RANK1, info.offset + 7)
    code, rep = run(out, "--against", clean[0], "--deep", "--no-checksums")
    assert code == 7
    f = one(rep, "data", file=RANK1, tensor="model.layers.2.mlp.down_proj.weight")
    assert "byte 7 " in f["message"] and "element 3" in f["message"]
    assert len(errors(rep)) == 1


@pytest.mark.parametrize("window, reads", [(4097, "auto"), (3 * 4096, "1"), (1 << 20, "1"), (1 << 20, "0")], ids=str)
def test_deep_reads_each_file_in_windows(clean, out, monkeypatch, tmp_path, window, reads):
    """The compare reads a file `WINDOW` bytes at a time, whatever its tensors' sizes: one read per
    window (not one per tensor, nor a buffer per write), with O_DIRECT where asked (RESHARD_DIRECT_READS;
    "auto": a file mostly not in the page cache) and the windows are whole pages, the digest out of
    the windows, and a flipped byte found where it is, across the windows' edges too."""
    from reshard.io import direct
    from reshard.verify import deep

    monkeypatch.setattr(deep, "WINDOW", window)
    monkeypatch.setenv("RESHARD_DIRECT_READS", reads)
    probe = os.open(tmp_path / "probe", os.O_CREAT | os.O_RDWR)
    can = direct.enable(probe)  # this file system takes O_DIRECT
    os.close(probe)
    fills: list[tuple[str, int, bool]] = []  # (file, window start, read with O_DIRECT)
    fill = deep._CompareSink._fill

    def spy(sink, off):
        fill(sink, off)
        fills.append((sink.file.name, sink.lo, sink.direct))

    freed = []  # per file: its windows let go once it is done (the compare keeps every sink to its end)
    close = deep._CompareSink.close

    def closing(sink, sync):
        written = close(sink, sync)
        freed.append(sink.bufs == [None, None] and sink.window.size == 0)
        return written

    monkeypatch.setattr(deep._CompareSink, "_fill", spy)
    monkeypatch.setattr(deep._CompareSink, "close", closing)
    code, rep = run(clean[1], "--against", clean[0], "--deep")
    assert code == 0, rep["findings"]
    assert rep["stats"]["hashed_in_compare_bytes"] == rep["bytes"]
    assert freed == [True, True]
    for name in (RANK0, RANK1):
        tensors, _, _ = read_header(clean[1] / name)
        start, size = min(t.offset for t in tensors.values()), (clean[1] / name).stat().st_size
        first = start - start % 4096 if window % 4096 == 0 else start  # whole pages where the window is
        got = [off for n, off, _ in fills if n == name]
        assert got == list(range(first, size, window))
        if reads != "auto":
            assert {d for n, _, d in fills if n == name} == {reads == "1" and can}
        if window == 1 << 20:
            assert len(got) < len(tensors)  # a window served many tensors

    info = tensor_at(out / RANK1, "model.layers.2.mlp.down_proj.weight")
    edge = window - (info.offset - first) % window  # the first byte of its second window (`first`: RANK1's)
    assert edge < info.nbytes or window == 1 << 20
    for at in (7, edge - 1, edge) if edge < info.nbytes else (7, info.nbytes - 1):
        flip(out / RANK1, info.offset + at)
        code, rep = run(out, "--against", clean[0], "--deep", "--no-checksums")
        flip(out / RANK1, info.offset + at)
        assert code == 7
        f = one(rep, "data", file=RANK1, tensor="model.layers.2.mlp.down_proj.weight")
        assert f"byte {at} " in f["message"], f["message"]
        assert len(errors(rep)) == 1


@pytest.mark.parametrize("where", ["window", "head"])
def test_deep_tells_an_output_file_it_cannot_read(clean, monkeypatch, where):
    """An I/O error reading an output file once the compare has begun (a failing disk: the checksum
    pass after it fails too) is exit 7 with one `cannot read` finding for that file, worded as the
    checksum pass words it, never an internal error (exit 1); the other file passes."""
    import errno

    from reshard.verify import deep

    fds: set[int] = set()  # descriptors of RANK1 opened since the compare began, still open
    armed = []
    real_open = os.open
    init = deep._CompareSink.__init__

    def compare_sink(sink, *a, **k):
        armed.append(True)
        init(sink, *a, **k)

    def open_(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        if armed and str(path).endswith(RANK1):
            fds.add(fd)
        return fd

    def failing(real):
        def read(fd, *a):
            if fd in fds:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, *a)

        return read

    def close(fd, real=os.close):
        fds.discard(fd)  # its number is free for another file
        real(fd)

    monkeypatch.setattr(deep._CompareSink, "__init__", compare_sink)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "close", close)
    for name in ("preadv", "readv", *(["pread"] if where == "head" else [])):
        monkeypatch.setattr(os, name, failing(getattr(os, name)))
    code, rep = run(clean[1], "--against", clean[0], "--deep")
    assert armed and code == 7, rep["findings"]
    assert [(f["kind"], f["file"]) for f in errors(rep)] == [("checksum", RANK1)]
    assert errors(rep)[0]["message"] == f"{RANK1}: cannot read (Input/output error)"


def test_deep_compare_tells_a_file_that_ends_early(clean, tmp_path, monkeypatch):
    """A file cut short under the compare (the structure check saw it whole): its tensor differs from
    the byte where the file ends, and the file is not hashed."""
    from reshard.folderview import LocalView
    from reshard.plan import OutTensor
    from reshard.verify import deep
    from reshard.verify.report import CheckedFile

    monkeypatch.setattr(deep, "WINDOW", 4096)
    folder = Path(shutil.copytree(clean[1], tmp_path / "o"))
    tensors, _, _ = read_header(folder / RANK0)
    last = max(tensors.values(), key=lambda t: t.offset)
    size = (folder / RANK0).stat().st_size
    f = CheckedFile(RANK0, 0, 0, 0, size=size, tensors=tensors)
    data = (folder / RANK0).read_bytes()
    os.truncate(folder / RANK0, size - 5)
    diffs: list = []
    sink = deep._CompareSink(LocalView(folder), f, diffs, checksum="blake3")
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        sink.begin(OutTensor(t.name, t.dtype, t.shape, ()))
        sink.write(memoryview(data)[t.offset : t.offset + t.nbytes])
    written = sink.close(sync=False)
    assert written.digest is None
    assert [name for _, name in diffs] == [last.name]
    assert f"from byte {last.nbytes - 5} of it" in diffs[0][0]


def _relist_side_file(out_dir, name):
    """Record `name`'s present bytes in the manifest, as a folder that lies would: the manifest's
    own checksums then pass, and only SOURCE can tell."""
    manifest = json.loads((out_dir / "reshard.json").read_text())
    path = out_dir / name
    entry = {"name": name, "size": path.stat().st_size, "blake3": blake3.blake3(path.read_bytes()).hexdigest()}
    rest = [e for e in manifest["copied_files"] if e["name"] != name]
    manifest["copied_files"] = sorted([*rest, entry], key=lambda e: e["name"])
    if name not in manifest["copied"]:
        manifest["copied"] = sorted([*manifest["copied"], name])
    (out_dir / "reshard.json").write_text(json.dumps(manifest))


def test_copied_files_are_compared_with_the_source(clean, out):
    code, rep = run(out, "--against", clean[0])
    assert code == 0 and "copied" in rep["checked"], rep["findings"]
    assert rep["stats"]["copied_files_compared"] == len(json.loads((out / "reshard.json").read_text())["copied_files"])
    assert run(out)[0] == 0  # the edits below pass the manifest's own checks: only SOURCE tells

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}, indent=2) + "\n")
    _relist_side_file(out, "config.json")
    (out / "chat_template.jinja").write_text("{{ messages }}")  # a file the source does not have
    _relist_side_file(out, "chat_template.jinja")
    assert run(out)[0] == 0
    code, rep = run(out, "--against", clean[0])
    assert code == 7, rep["findings"]
    assert "differs from what a save of" in one(rep, "copied", file="config.json")["message"]
    assert "is not a file a save of" in one(rep, "copied", file="chat_template.jinja")["message"]
    assert len(errors(rep)) == 2


def test_a_source_file_the_output_lacks_is_a_warning(clean, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(clean[0], src)
    (src / "README.md").write_text("added after the save\n")
    code, rep = run(clean[1], "--against", src)
    assert code == 0, rep["findings"]
    (warn,) = [f for f in rep["findings"] if f["kind"] == "copied"]
    assert warn["severity"] == "warning" and "README.md" in warn["message"]


def test_a_config_the_save_rewrote_is_derived_again(tiny, tmp_path):
    """config.json written anew by the save (an auto_map dropped without --trust-remote-code) is
    compared with what that rule gives, and with it the code's files left out."""
    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "modeling_x.py").write_text("raise SystemExit('never run')\n")
    save(str(src), tmp_path / "o", tp=2, max_part_size=DEFAULT_MAX_PART)
    assert "auto_map" not in json.loads((tmp_path / "o" / "config.json").read_text())
    code, rep = run(tmp_path / "o", "--against", src)
    assert code == 0 and "copied" in rep["checked"], rep["findings"]


def test_deep_needs_against(clean):
    result = CliRunner().invoke(cli, ["verify", str(clean[1]), "--deep"])
    assert result.exit_code == 2 and "--against" in result.output


def foreign(out):
    """What vLLM's own save leaves: rank files and config, no reshard.json."""
    (out / "reshard.json").unlink()
    return out


def test_foreign_folder_against_source(clean, out):
    code, rep = run(foreign(out), "--against", clean[0], "--tp", "2", "--deep")
    assert code == 0, rep["findings"]
    assert [f["kind"] for f in rep["findings"]] == ["manifest"]  # warning: no manifest, no checksums
    assert rep["findings"][0]["severity"] == "warning"
    assert "keys" in rep["checked"] and "deep" in rep["checked"] and "checksums" not in rep["checked"]


def test_foreign_folder_tells_what_vllm_rejects(clean, out):
    foreign(out)
    rewrite_foreign = {"model.layers.0.self_attn.extra": torch.zeros(2)}

    def mutate(t):
        t.pop(NORM)
        t.update(rewrite_foreign)

    path = out / RANK0
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    mutate(tensors)
    save_file(tensors, str(path))
    code, rep = run(out, "--against", clean[0], "--tp", "2")
    assert code == 6
    assert "Missing keys" in one(rep, "missing-key", file=RANK0, tensor=NORM)["message"]
    assert "KeyError" in one(rep, "unexpected-key", file=RANK0, tensor="model.layers.0.self_attn.extra")["message"]


def test_lax_does_not_excuse_missing_keys_without_a_manifest(clean, out):
    """`--load-format reshard` needs reshard.json: a foreign folder missing a key loads with no loader."""
    rewrite(out, RANK0, lambda t: t.pop(NORM))
    code, rep = run(foreign(out), "--against", clean[0], "--tp", "2", "--lax")
    assert code == 6 and rep["loads_with"] is None
    f = one(rep, "missing-key", file=RANK0, tensor=NORM)
    assert f["severity"] == "error" and "--lax does not excuse it: without reshard.json" in f["message"]


def test_foreign_folder_wrong_tp(clean, out):
    code, rep = run(foreign(out), "--against", clean[0], "--tp", "4")
    assert code == 6  # a whole tp=2 folder: the layout differs, nothing is corrupt
    assert "named for tp=2, you asked tp=4" in one(rep, "layout")["message"]
    assert len(errors(rep, "rank-missing")) == 2  # ranks 2 and 3 have no files
    assert errors(rep, "shape")  # and ranks 0, 1 hold halves where quarters are expected


def test_partial_ranks_save(clean, tmp_path):
    """A `save --ranks` piece alone: no reshard.json yet; verify says what is still missing."""
    out = tmp_path / "pieces"
    save(str(clean[0]), out, tp=2, max_part_size=DEFAULT_MAX_PART, ranks="0")
    code, rep = run(out)
    assert code == 7
    f = one(rep, "manifest")
    assert "incomplete --ranks save" in f["message"] and RANK1 in f["message"]


def test_deep_against_a_reshard_output(clean, tmp_path):
    """SOURCE may itself be a reshard output: the compare reads it through its own reader."""
    tp4 = tmp_path / "tp4"
    save(str(clean[1]), tp4, tp=4, max_part_size=DEFAULT_MAX_PART)
    code, rep = run(tp4, "--against", clean[1], "--deep")
    assert code == 0, rep["findings"]
    assert "deep" in rep["checked"] and rep["stats"]["compared_bytes"] > 0
    flip(tp4 / RANK1, tensor_at(tp4 / RANK1, QKV).offset + 3)
    code, rep = run(tp4, "--against", clean[1], "--deep")
    assert code == 7
    one(rep, "data", file=RANK1, tensor=QKV)
    one(rep, "checksum", file=RANK1)
    code, rep = run(tp4, "--against", clean[1])  # checksums find the file, the source names the tensor
    assert code == 7
    one(rep, "data", file=RANK1, tensor=QKV)


@pytest.mark.parametrize("name", ["model-rank-0-part-0.old.safetensors", "model-rank-1-part-0 (copy).safetensors"])
def test_files_vllm_would_load_but_the_manifest_does_not_list(out, name):
    """vLLM globs model-rank-{r}-part-*.safetensors: a stray copy would be loaded with that rank."""
    shutil.copy(out / RANK0, out / name)
    code, report = run(str(out))
    assert code == 7
    assert one(report, "stray", file=name)


def test_pp_stray_file_matched_by_the_pp_glob(tiny, tmp_path):
    out = tmp_path / "pp"
    save(str(tiny("llama")), out, tp=1, pp=2, max_part_size=DEFAULT_MAX_PART)
    shutil.copy(out / "model-pp-1-tp-0-part-0.safetensors", out / "model-pp-1-tp-0-part-0-backup.safetensors")
    code, report = run(str(out))
    assert code == 7 and one(report, "stray", file="model-pp-1-tp-0-part-0-backup.safetensors")


@pytest.mark.parametrize("edit", ["rms_norm_eps", "rope_theta", "num_attention_heads"])
def test_edited_config_is_caught(out, edit):
    cfg = json.loads((out / "config.json").read_text())
    cfg[edit] = cfg.get(edit, 1) * 2
    (out / "config.json").write_text(json.dumps(cfg))
    code, report = run(str(out))
    assert code == 7
    assert one(report, "checksum", file="config.json")


def test_edited_tokenizer_is_caught(out):
    path = out / "tokenizer.json"
    path.write_text(path.read_text().replace('"', "'", 1))
    code, report = run(str(out))
    assert code == 7 and one(report, "checksum", file="tokenizer.json")


def test_every_copied_file_has_a_checksum(out):
    manifest = json.loads((out / "reshard.json").read_text())
    sums = {e["name"]: e["blake3"] for e in manifest["copied_files"]}
    assert set(sums) == set(manifest["copied"]) and "config.json" in sums
    assert sums["config.json"] == blake3.blake3((out / "config.json").read_bytes()).hexdigest()


def test_the_serve_line_names_the_folder_as_given_and_checksum_none_checks_sizes(tiny, tmp_path):
    """A folder moved since its save: the line verify reports serves it where it is now (the manifest
    names the path it was saved to); a --checksum none folder's report says sizes were checked, not
    checksums."""
    out = tmp_path / "saved"
    save(str(tiny("qwen3")), out, tp=2, pp=2, pp_partition=[1, 3], checksum="none")
    moved = tmp_path / "moved here"
    out.rename(moved)
    code, report = run(moved)
    assert code == 0, report
    line = report["loads_with"]["serve"]
    assert line.startswith(f"VLLM_PP_LAYER_PARTITION=1,3 vllm serve '{moved}' --load-format sharded_state"), line
    assert "sizes" in report["checked"] and "checksums" not in report["checked"], report["checked"]


def test_a_serve_line_reshard_would_not_write_is_not_repeated(tiny, tmp_path):
    """Hostile folders: a manifest whose serve line holds what a shell acts on is not repeated to the
    user as the line to run (loads_with.serve is null); reshard's own lines are."""
    out = tmp_path / "out"
    save(str(tiny("qwen3")), out, tp=2)
    code, report = run(out)
    assert code == 0 and report["loads_with"]["serve"].startswith(f"vllm serve {out} --load-format sharded_state")
    m = json.loads((out / "reshard.json").read_text())
    hostile = (
        f"vllm serve {out}; rm -rf ~ --load-format sharded_state",
        f"vllm serve {out} --x $(id) --load-format sharded_state",
        f'vllm serve "{out}`id`" --load-format sharded_state',
        f"vllm serve '{out}",  # an unclosed quote
    )
    for bad in (*hostile, ["vllm", "serve"], "echo pwned"):
        m["serve"] = bad
        (out / "reshard.json").write_text(json.dumps(m))
        code, report = run(out)
        if code == 0:
            assert report["loads_with"]["serve"] is None, (bad, report["loads_with"])
        else:
            assert code == 7, (bad, report)  # a value of the wrong type is a malformed manifest


def test_a_folder_whose_path_a_shell_would_expand_keeps_its_serve_line(tiny, tmp_path):
    """A path holding `'`, `$` or a backtick is quoted in reshard's serve lines, and verify repeats
    them: quoted, they are plain words to the shell (they were dropped as hostile)."""
    out = tmp_path / "out it's $HOME `x`"
    save(str(tiny("llama")), out, tp=2)
    code, report = run(out)
    line = report["loads_with"]["serve"]
    assert code == 0 and line is not None, report["loads_with"]
    assert shlex.split(line)[:3] == ["vllm", "serve", str(out)], line


def test_no_checksums_still_checks_the_copied_files_sizes(out):
    """--no-checksums skips hashing, not the size check that costs nothing: a config.json that grew
    since the save fails (it passed)."""
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "foo": 1}))
    code, rep = run(out, "--no-checksums")
    assert code == 7 and "config.json" in one(rep, "size", file="config.json")["message"], rep["findings"]
