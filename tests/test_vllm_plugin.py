"""The pure parts of `--load-format reshard` (reshard/vllm_plugin), without vLLM: what is compared
before a byte is read (manifest vs engine, model state vs recorded tensors, the rank's files), the
messages, the options, and the verified parallel reads into tensors. The loader on real vLLM ranks:
tests/against_vllm/test_plugin.py."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.hashing import hash_file
from reshard.layout import Layout
from reshard.manifest import Manifest, read_manifest
from reshard.names import MANIFEST
from reshard.vllm_plugin import checks, messages, reader, staged, striped
from reshard.vllm_plugin.checks import Engine, ReshardLoadError
from tests.fixtures.odirect import direct_io_works

ENGINE = Engine(Layout(tp=2, dtype="bfloat16"), quantization=None, vllm_version="0.32.0")


def _engine_for(manifest: Manifest, **kw) -> Engine:
    lay = manifest.layout
    return replace(ENGINE, layout=Layout(lay.tp, lay.pp, lay.ep, lay.dtype), **kw)


# ---- options ---------------------------------------------------------------------------------------------


def test_options():
    assert checks.parse_options(None) == checks.Options(checksums=True, threads=4)
    assert checks.parse_options({"checksums": False, "threads": 2}) == checks.Options(checksums=False, threads=2)
    assert checks.parse_options({"strict": False}) == checks.Options(strict=False)
    assert checks.parse_options(None).strict is True
    with pytest.raises(ValueError, match=r"unknown --model-loader-extra-config key\(s\) \['verify'\]"):
        checks.parse_options({"verify": False})
    with pytest.raises(ValueError, match='"checksums" must be true or false'):
        checks.parse_options({"checksums": "no"})
    with pytest.raises(ValueError, match='"threads" must be a positive integer'):
        checks.parse_options({"threads": 0})
    with pytest.raises(ValueError, match="\"strict\" must be true or false, not 'no'"):
        checks.parse_options({"strict": "no"})
    with pytest.raises(ValueError, match=r'\{"strict": false\}'):  # the unknown-key message lists it
        checks.parse_options({"lax": True})


# ---- manifest vs engine ----------------------------------------------------------------------------------


def test_engine_fits_its_folder(clean):
    m = read_manifest(clean[1])
    assert checks.engine_problems(m, _engine_for(m)) == []
    assert checks.engine_problems(m, _engine_for(m, vllm_version="0.33.1+cpu")) == []


def test_engine_differences_are_each_named(clean):
    m = read_manifest(clean[1])
    m = replace(m, layout=m.layout.but(moe_pin="deep_gemm", quantization={"method": "fp8"}))
    runs = Layout(tp=4, pp=2, ep=True, dtype="float16", moe_backend="triton")
    e = replace(_engine_for(m), layout=runs, vllm_version="0.34.0")
    assert checks.engine_problems(m, e) == [
        "made for tp=2, this engine runs tp=4",
        "made for pp=1, this engine runs pp=2",
        "made for ep=off, this engine runs ep=on",
        "made for dtype bfloat16, this engine runs float16",
        "made for quantization fp8, this engine runs quantization None",
        "made for --moe-backend deep_gemm (the experts' layout depends on it), this engine runs triton",
        "made for vLLM >=0.32,<0.34, this is vLLM 0.34.0",
    ]
    # a pinned backend against "auto": the model's state decides (auto builds the pinned layout on some
    # GPUs); the message then says the folder was made for the pinned one
    m = replace(m, layout=m.layout.but(quantization=None))
    assert checks.engine_problems(m, _engine_for(m)) == []
    msg = messages.mismatch_message(
        Path("OUT"), m, _engine_for(m), ["x.w13_weight: shape [2] in the folder, [4] in the model"]
    )
    assert "[4] in the model (the folder was made for --moe-backend deep_gemm, this engine runs auto). To fix" in msg
    # an unpinned backend is no difference: the layout does not depend on it
    m = replace(m, layout=m.layout.but(moe_pin=None))
    e = _engine_for(m)
    assert checks.engine_problems(m, replace(e, layout=e.layout.but(moe_backend="triton"))) == []


# ---- model state vs recorded tensors -----------------------------------------------------------------------


REC = {"a.weight": ("BF16", (8, 4)), "b.weight": ("BF16", (16, 4)), "c.scale": ("F32", ())}


def test_state_equal_is_no_problem():
    assert checks.state_problems(REC, dict(REC), lora=False) == []


def test_state_differences_in_model_order():
    model = {"x.weight": ("BF16", (2,)), "b.weight": ("BF16", (8, 4)), "a.weight": ("F16", (8, 4))}
    assert checks.state_problems(REC, model, lora=False) == [
        "x.weight: the model has it (bfloat16 [2]), the folder does not",
        "b.weight: shape [16, 4] in the folder, [8, 4] in the model",
        "a.weight: dtype bfloat16 in the folder, float16 in the model",
        "c.scale: in the folder, not in the model",
    ]


def test_not_strict_lets_only_missing_keys_through():
    """{"strict": false}: a key the folder lacks is no problem (named by missing_keys, for the WARNING);
    a key the model lacks, a dtype and a shape still are, exactly as strict tells them."""
    model = {"x.weight": ("BF16", (2,)), "b.weight": ("BF16", (8, 4)), "a.weight": ("F16", (8, 4)), "y": ("F32", ())}
    strict = checks.state_problems(REC, model, lora=False)
    assert (
        checks.state_problems(REC, model, lora=False, strict=False)
        == [p for p in strict if not p.startswith(("x.weight:", "y:"))]
        == [
            "b.weight: shape [16, 4] in the folder, [8, 4] in the model",
            "a.weight: dtype bfloat16 in the folder, float16 in the model",
            "c.scale: in the folder, not in the model",
        ]
    )
    assert checks.missing_keys(REC, model) == ["x.weight", "y"]
    only_missing = {**REC, "x.weight": ("BF16", (2,))}
    assert checks.state_problems(REC, only_missing, lora=False, strict=False) == []
    assert checks.missing_keys(REC, REC) == []
    msg = messages.missing_message(Path("OUT"), ENGINE, [f"k{i}" for i in range(5)])
    assert msg == (
        'reshard: OUT (rank 0): 5 parameter(s) of the model are not in the folder, left as initialised ({"strict": '
        "false}): k0, k1, k2 and 2 more"
    )


def test_lora_padding_is_the_one_exception():
    padded = {**REC, "b.weight": ("BF16", (32, 4))}  # vLLM pads with LoRA on; loads a narrowed view
    assert checks.state_problems(REC, padded, lora=True) == []
    assert checks.state_problems(REC, padded, lora=False) == [
        "b.weight: shape [16, 4] in the folder, [32, 4] in the model"
    ]
    smaller = {**REC, "b.weight": ("BF16", (8, 4))}  # never narrowed the other way
    assert checks.state_problems(REC, smaller, lora=True) == [
        "b.weight: shape [16, 4] in the folder, [8, 4] in the model"
    ]
    assert not checks.fits_narrowed((16, 4), (16,))


def test_mismatch_message_names_the_first_and_says_what_to_run(clean):
    m = read_manifest(clean[1])
    e = replace(_engine_for(m), layout=Layout(tp=4, ep=True, moe_backend="deep_gemm", dtype="float16"))
    msg = messages.mismatch_message(Path("OUT"), m, e, [f"p{i}" for i in range(5)])
    assert msg.startswith("--load-format reshard: OUT does not fit this engine (rank 0): p0; p1; p2; and 2 more. ")
    src = m.source["path"]
    assert f"`reshard save {src} OUT --tp 4 --ep --dtype float16 --moe-backend deep_gemm`" in msg
    # the folder as it is loaded (moved since its save: the recorded path would name another one)
    assert "`vllm serve OUT --load-format reshard --tensor-parallel-size 2" in msg, msg
    assert "\n" not in msg


def test_a_model_of_other_parameters_is_not_told_to_run_the_same_command(clean):
    """The engine's layout is the folder's, its model's parameters are not: a `reshard save` for this layout
    or the folder's own serve line would fail the same way, so neither is offered; a folder that only lacks
    parameters is told how to load it anyway ({"strict": false})."""
    m = read_manifest(clean[1])
    e = _engine_for(m)
    lacking = ["x.weight: the model has it (bfloat16 [2]), the folder does not"]
    msg = messages.state_message(Path("OUT"), m, e, lacking, missing_only=True)
    assert msg.startswith("--load-format reshard: OUT does not fit this engine (rank 0): x.weight: the model has it")
    assert "the 1 parameter(s) left as initialised" in msg and """'{"strict": false}'""" in msg, msg
    assert "reshard save" not in msg and "vllm serve" not in msg and "\n" not in msg
    other = ["a.weight: dtype bfloat16 in the folder, float16 in the model"]
    msg = messages.state_message(Path("OUT"), m, e, other, missing_only=False)
    assert "strict" not in msg and "vllm serve" not in msg
    assert f"reshard {m.reshard_version} for vLLM {m.vllm_versions}; this is vLLM 0.32.0" in msg, msg
    # the engine asks for a MoE backend the folder was not made for: a folder made for it is the fix
    asking = replace(e, layout=e.layout.but(moe_backend="deep_gemm"))
    msg = messages.state_message(Path("OUT"), m, asking, other, missing_only=False)
    assert f"make a folder for this engine's --moe-backend deep_gemm with `reshard save {m.source['path']}" in msg
    assert "--tp 2 --moe-backend deep_gemm`" in msg, msg
    # a pinned MoE backend against "auto": serving it as made (with the backend) is the fix
    pinned = replace(m, layout=m.layout.but(moe_pin="deep_gemm"))
    msg = messages.state_message(Path("OUT"), pinned, _engine_for(pinned), other, missing_only=False)
    assert "(the folder was made for --moe-backend deep_gemm, this engine runs auto). To fix: serve it" in msg, msg


def test_manifest_offers_both_serve_lines(clean):
    m = read_manifest(clean[1])
    assert " --load-format sharded_state " in m.serve
    assert m.serve_reshard == m.serve.replace("--load-format sharded_state", "--load-format reshard")


# ---- the rank's files ------------------------------------------------------------------------------------


def _files(folder: Path, rank: int = 1) -> list[checks.RankFile]:
    m = read_manifest(folder)
    e = replace(_engine_for(m), tp_rank=rank)
    return checks.check_files(folder, m, checks.rank_entries(m, e), e)


def _refused(folder: Path, rank: int = 1) -> str:
    with pytest.raises(ReshardLoadError) as info:
        _files(folder, rank)
    msg = str(info.value)
    assert msg.startswith(f"--load-format reshard: {folder} (rank {rank}): ") and "Nothing was loaded" in msg
    return msg


def test_files_fit(clean):
    m = read_manifest(clean[1])
    files = _files(clean[1])
    assert [f.path.name for f in files] == [e.name for e in m.files if e.tp_rank == 1]
    for f in files:
        assert f.digest == hash_file(f.path, "blake3") and f.header_bytes == f.tensors[0].offset


def test_missing_truncated_stray_and_foreign_files(out):
    name = "model-rank-1-part-0.safetensors"
    shutil.copy(out / name, out / "keep")
    (out / name).unlink()
    assert f"{name} is missing" in _refused(out)
    (out / name).write_bytes((out / "keep").read_bytes()[:-8])
    assert f"{name} has " in _refused(out) and "the manifest says" in _refused(out)
    shutil.copy(out / "keep", out / name)
    shutil.copy(out / "keep", out / "model-rank-1-part-7.safetensors")
    assert "model-rank-1-part-7.safetensors is not in the manifest" in _refused(out)
    (out / "model-rank-1-part-7.safetensors").unlink()
    m = json.loads((out / MANIFEST).read_text())
    m["run_id"] = "0" * 32
    (out / MANIFEST).write_text(json.dumps(m))
    assert "the manifest comes from another run" in _refused(out)


def test_a_file_vllm_reads_added_after_the_save_is_refused(out):
    """A chat template put beside the output after the save: vLLM would serve with it (verify fails it too)."""
    from reshard.vllm_plugin.copied import copied_problems

    m = read_manifest(out)
    (out / "NOTES.md").write_text("mine")
    assert copied_problems(out, m, hashed=False) == []
    (out / "chat_template.jinja").write_text("{{ messages }}")
    want = "chat_template.jinja is not in the manifest (added after the save?): vLLM or its tokenizer reads it"
    assert copied_problems(out, m, hashed=False) == [want]


def test_swapped_rank_files_are_refused_with_checksums_off(out):
    """With `{"checksums": false}` nothing hashes the files: their headers' own names tell a swap."""
    r0, r1 = "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"
    (out / r0).rename(out / "keep")
    (out / r1).rename(out / r0)
    (out / "keep").rename(out / r1)
    assert f"{r1} was written as {r0}: rank files were renamed or swapped" in _refused(out)


def test_copied_files_must_be_the_saved_ones(out):
    """vLLM built the engine from config.json before the loader runs: the plugin refuses a folder
    whose copied files differ from the manifest (edited, a link, a FIFO, gone), as verify does."""
    from reshard.vllm_plugin.copied import copied_message, copied_problems

    m = read_manifest(out)
    assert copied_problems(out, m, hashed=True) == []
    config = (out / "config.json").read_bytes()
    (out / "config.json").write_bytes(config.replace(b"1", b"2", 1))  # the same size, other contents
    assert copied_problems(out, m, hashed=True) == [
        f"config.json changed after the save ({m.checksum} differs from the manifest's)"
    ]
    assert copied_problems(out, m, hashed=False) == []  # {"checksums": false}: sizes only
    # ... but config.json, which built the engine, is hashed whatever they say (the loader asks so: a few KB)
    assert copied_problems(out, m, hashed=False, always=("config.json",)) == [
        f"config.json changed after the save ({m.checksum} differs from the manifest's)"
    ]
    (out / "config.json").write_bytes(config + b" ")
    assert copied_problems(out, m, hashed=False)[0].startswith("config.json has ")
    (out / "config.json").unlink()
    (out.parent / "elsewhere.json").write_bytes(config)  # outside: a JSON file inside is one vLLM may read
    os.symlink(out.parent / "elsewhere.json", out / "config.json")
    assert copied_problems(out, m, hashed=True) == [
        "config.json is a symlink (not followed), not a regular file in the folder"
    ]
    (out / "config.json").unlink()
    os.mkfifo(out / "config.json")  # never waited on
    assert "not a regular file" in copied_problems(out, m, hashed=True)[0]
    (out / "config.json").unlink()
    assert copied_problems(out, m, hashed=True) == ["config.json is missing"]
    text = copied_message(out, ["config.json is missing"], messages.SHOWN)
    assert "To fix: " in text and f"reshard verify {out}" in text


def test_header_must_hold_the_recorded_tensors(out):
    m = json.loads((out / MANIFEST).read_text())
    entry = next(e for e in m["files"] if e["tp_rank"] == 1)
    entry["tensors"][0]["shape"] = [1, *entry["tensors"][0]["shape"]]
    (out / MANIFEST).write_text(json.dumps(m))
    assert "its header does not hold the tensors the manifest lists" in _refused(out)


# ---- verified reads into tensors ------------------------------------------------------------------------


def _targets(files: list[checks.RankFile]) -> dict[str, torch.Tensor]:
    from reshard.format import DTYPE_CODES

    return {
        t.name: torch.full(t.shape, 7, dtype=getattr(torch, DTYPE_CODES.get(t.dtype, "float32")))
        for f in files
        for t in f.tensors
    }


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize(
    ("chunk", "stripe_min", "threads"),
    [(striped.CHUNK, reader.STRIPE_MIN, 2), (4096, reader.STRIPE_MIN, 1), (4096, 8192, 3), (4096 * 3, 4096, 4)],
)
def test_read_rank_fills_every_tensor_exactly(clean, monkeypatch, chunk, stripe_min, threads, direct):
    # small chunks: many reads and hashed pieces per tensor; small stripes: several streams per file;
    # O_DIRECT through a bounce buffer smaller than a chunk: several reads and copies per chunk
    monkeypatch.setattr(striped, "CHUNK", chunk)
    monkeypatch.setattr(reader, "STRIPE_MIN", stripe_min)
    monkeypatch.setattr(striped, "BOUNCE", 8192)
    files = _files(clean[1])
    targets = _targets(files)
    lines: list[str] = []
    algo = read_manifest(clean[1]).checksum
    made = _spy_striped(monkeypatch)
    n, _, bad = reader.read_rank(
        files, targets, algorithm=algo, threads=threads, log=lines.append, label="rank 1", direct_reads=direct
    )
    assert bad == [] and n == sum(f.size for f in files)
    used = direct == "1" and direct_io_works(files[0].path)  # where O_DIRECT is refused: the page cache
    assert made and all(sum(s.direct_chunks) == (s.chunks if used else 0) for s in made)
    want = {k: v for f in files for k, v in load_file(f.path).items()}
    assert sorted(want) == sorted(targets)
    for k, v in want.items():
        assert targets[k].dtype == v.dtype and torch.equal(
            targets[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
        ), k


def _spy(monkeypatch, cls: type) -> list:
    """The `cls` objects (a way of reading a file) read_rank makes, as it makes them."""
    made: list = []
    init = cls.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", spy)
    return made


def _spy_striped(monkeypatch) -> list:
    return _spy(monkeypatch, striped.Striped)


def test_a_file_system_refusing_direct_reads_is_read_through_the_cache(clean, monkeypatch):
    """O_DIRECT accepted when asked for, then refused by the reads (EINVAL): the stream goes on
    through the page cache from the chunk that failed, and every byte still arrives."""
    monkeypatch.setattr(striped, "CHUNK", 4096)
    monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    files = _files(clean[1])
    if not direct_io_works(files[0].path):
        pytest.skip("this file system takes no O_DIRECT reads")
    real = os.preadv
    refused = []

    def preadv(fd, buffers, offset, *flags):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= 8192:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(striped.os, "preadv", preadv)
    made = _spy_striped(monkeypatch)
    targets = _targets(files)
    algo = read_manifest(clean[1]).checksum
    n, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=2, log=print, label="rank 1", direct_reads="1")
    assert (
        bad == []
        and n == sum(f.size for f in files)
        and refused
        and all(s.o_direct and 0 < sum(s.direct_chunks) < s.chunks for s in made)
    )
    want = {k: v for f in files for k, v in load_file(f.path).items()}
    assert all(
        torch.equal(targets[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)) for k, v in want.items()
    )


def test_read_rank_leaves_parameters_the_folder_lacks_as_initialised(clean):
    """{"strict": false}: the state dict holds a parameter no file has; reading fills the others only."""
    files = _files(clean[1])
    targets = _targets(files)
    extra = torch.full((3, 2), 5, dtype=torch.bfloat16)
    targets["model.extra.weight"] = extra
    algo = read_manifest(clean[1]).checksum
    _, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=2, log=lambda s: None, label="rank 1")
    assert bad == [] and torch.equal(extra, torch.full((3, 2), 5, dtype=torch.bfloat16))
    want = {k: v for f in files for k, v in load_file(f.path).items()}
    assert all(torch.equal(targets[k], v) for k, v in want.items())


@pytest.mark.parametrize("stripes", [False, True])
def test_a_flipped_byte_is_caught_and_can_be_let_through(out, monkeypatch, stripes):
    if stripes:  # the byte lies in the last of several stripes, hashed after the others
        monkeypatch.setattr(striped, "CHUNK", 4096)
        monkeypatch.setattr(reader, "STRIPE_MIN", 4096)
    name = "model-rank-1-part-0.safetensors"
    data = bytearray((out / name).read_bytes())
    data[-3] ^= 0x10
    (out / name).write_bytes(bytes(data))
    files = _files(out)  # size and header unchanged: only the checksum can tell
    algo = read_manifest(out).checksum
    _, _, bad = reader.read_rank(files, _targets(files), algorithm=algo, threads=4, log=print, label="rank 1")
    assert [b.name for b in bad] == [name] and bad[0].want == (
        next(e for e in read_manifest(out).files if e.name == name).digest
    )
    assert bad[0].got == hash_file(out / name, algo)
    _, _, bad = reader.read_rank(files, _targets(files), algorithm=None, threads=1, log=print, label="rank 1")
    assert bad == []


@pytest.mark.parametrize("stripe_min", [reader.STRIPE_MIN, 4096])
def test_a_file_that_shrank_since_the_check_is_a_read_error(out, monkeypatch, stripe_min):
    monkeypatch.setattr(striped, "CHUNK", 4096)
    monkeypatch.setattr(reader, "STRIPE_MIN", stripe_min)
    files = _files(out)  # checked at full size
    path = files[0].path
    os.truncate(path, path.stat().st_size // 2)
    algo = read_manifest(out).checksum
    before = set(threading.enumerate())  # other tests' pools may still be winding down
    with pytest.raises(reader.ReadError, match="ended early"):
        reader.read_rank(files, _targets(files), algorithm=algo, threads=4, log=print, label="rank 1")
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("reshard-")]  # none left waiting


@pytest.mark.parametrize("stripe_min", [4096, 1 << 40])  # striped reads, and one stream per file
def test_a_file_swapped_for_a_link_since_the_check_is_not_read(out, tmp_path, monkeypatch, stripe_min):
    """check_files refuses links; a rank file replaced by one after the check (another user on a shared
    runner) is not followed by the reads either: a read error, nothing read through it."""
    monkeypatch.setattr(reader, "STRIPE_MIN", stripe_min)
    files = _files(out)
    path = files[0].path
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(path, elsewhere)
    path.symlink_to(elsewhere)
    algo = read_manifest(out).checksum
    before = set(threading.enumerate())  # other tests' pools may still be winding down
    with pytest.raises(reader.ReadError, match="symlink"):
        reader.read_rank(files, _targets(files), algorithm=algo, threads=4, log=print, label="rank 1")
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("reshard-")]


@pytest.mark.parametrize("off_cpu", [False, True])  # True: the other parameters taken as a GPU's
def test_lora_padded_parameter_gets_the_leading_corner(clean, monkeypatch, off_cpu):
    """A file with a parameter larger than its recorded tensor is read front to back by one thread
    (neither striped nor staged), which fills the parameter's leading corner."""
    made = [_spy(monkeypatch, striped.Striped), _spy(monkeypatch, staged.Staged)]
    if off_cpu:
        monkeypatch.setattr(reader, "_direct", lambda param, shape: False)
    files = _files(clean[1])
    targets = _targets(files)
    big = max((t for f in files for t in f.tensors if len(t.shape) == 2), key=lambda t: t.nbytes)
    padded = torch.zeros(big.shape[0] + 8, big.shape[1] + 2, dtype=targets[big.name].dtype)
    targets[big.name] = padded
    algo = read_manifest(clean[1]).checksum
    _, _, bad = reader.read_rank(files, targets, algorithm=algo, threads=1, log=print, label="rank 1")
    assert bad == []
    holder = next(f for f in files if big.name in {t.name for t in f.tensors})
    assert holder.path not in {s.rf.path for kind in made for s in kind}
    assert len(made[1 if off_cpu else 0]) == len(files) - 1  # the rank's other files
    rows, cols = big.shape
    assert torch.equal(padded[:rows, :cols], load_file(holder.path)[big.name])
    assert not padded[rows:].any() and not padded[:, cols:].any()


def test_a_tensor_in_two_files_of_a_rank_is_named(clean):
    """Two of a rank's files holding one tensor: read into one parameter, the last file's bytes winning (and
    racing both files' checksums). The key check, a dict of the recorded tensors, let it through; verify
    calls the folder malformed, and so does the loader now."""
    from dataclasses import replace

    m = read_manifest(clean[1])
    entries = [f for f in m.files if f.tp_rank == 0]
    assert checks.duplicates(entries) == []
    copy = replace(entries[0], name="model-rank-0-part-1.safetensors", tensors=entries[0].tensors[:1])
    assert checks.duplicates([*entries, copy]) == [
        f"{entries[0].tensors[0].name} is in {entries[0].name} and model-rank-0-part-1.safetensors"
    ]


# ---- control characters ------------------------------------------------------------------------------------

HOSTILE = "out\x1b[31m\nx"  # a colour escape and a line break
ESCAPED = "out\\x1b[31m\\nx"  # as reshard.errors.printable writes them


def test_control_characters_in_a_folder_or_file_name_are_escaped_in_what_the_plugin_raises(clean, tmp_path):
    """As on the CLI (reshard.errors.printable): a folder or rank file named with an escape sequence or a line
    break cannot colour, erase or forge a line of vLLM's log; the message is the one of a folder whose name
    holds the escapes as text."""
    folder = tmp_path / HOSTILE
    shutil.copytree(clean[1], folder)
    name, stray = "model-rank-1-part-0.safetensors", "model-rank-1-part-\x1b[2K.safetensors"
    (folder / name).rename(folder / stray)  # vLLM's glob takes it: a stray file, and the rank's file missing
    with pytest.raises(ReshardLoadError) as info:
        _files(folder)
    problems = [f"{name} is missing", "model-rank-1-part-\\x1b[2K.safetensors is not in the manifest (a stray file "
                "sharded_state would also load)"]  # fmt: skip
    e = replace(_engine_for(read_manifest(folder)), tp_rank=1)
    assert str(info.value) == messages.files_message(tmp_path / ESCAPED, e, problems)
    with pytest.raises(ReshardLoadError) as info:
        checks.parse_options({"weights": "s3://bucket/a\nb/"})
    assert str(info.value).startswith("--load-format reshard: s3://bucket/a\\nb/: "), str(info.value)


def test_control_characters_are_escaped_in_what_the_plugin_logs():
    """The WARNINGs the loader logs name the folder (and the parameters left as initialised): escaped."""
    got = messages.missing_message(Path(HOSTILE), ENGINE, ["x\ny"])
    assert got == messages.missing_message(Path(ESCAPED), ENGINE, ["x\\ny"]) and "\\x1b[31m" in got
    got = messages.unverified_message(Path(HOSTILE), ENGINE)
    assert got == messages.unverified_message(Path(ESCAPED), ENGINE) and "\\x1b[31m" in got
