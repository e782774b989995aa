"""Malformed input is a clear one-line error with a documented exit code, never exit 1 or a traceback."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from tests.fixtures.cli import run


def corrupt(tiny, tmp_path: Path, arch: str = "llama", shards: int = 1) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny(arch, shards=shards) if shards > 1 else tiny(arch), src)
    return src


def edit_json(path: Path, fn) -> None:
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def rewrite_header(path: Path, fn) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = fn(json.loads(raw[8 : 8 + n]))
    new = head if isinstance(head, bytes) else json.dumps(head).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


CONFIG_CASES = {
    "config is a list": lambda c: [c],
    "heads zero": lambda c: {**c, "num_attention_heads": 0},
    "heads a word": lambda c: {**c, "num_attention_heads": "eight"},
    "layers a float": lambda c: {**c, "num_hidden_layers": 2.5},
    "architectures a string": lambda c: {**c, "architectures": "LlamaForCausalLM"},
    "quantization_config a list": lambda c: {**c, "quantization_config": ["fp8"]},
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_malformed_config(tiny, tmp_path, case):
    src = corrupt(tiny, tmp_path)
    edit_json(src / "config.json", CONFIG_CASES[case])
    for cmd in (["plan", str(src), "--tp", "2"], ["save", str(src), str(tmp_path / "out"), "--tp", "2"]):
        code, _, err = run(*cmd)
        assert code == 4, err
        assert err.startswith("reshard: error: ") and err.count("\n") == 1 and "config.json" in err


def test_a_config_with_a_byte_order_mark_is_refused(tiny, tmp_path):
    """json.loads takes a UTF-8 BOM; transformers' reader (vLLM's) does not: the copy would not load."""
    src = corrupt(tiny, tmp_path)
    (src / "config.json").write_bytes(b"\xef\xbb\xbf" + (src / "config.json").read_bytes())
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and "byte-order mark" in err and "remove it" in err, err
    assert not (tmp_path / "out").exists()


INDEX_CASES = {
    "index a list": lambda i: [i],
    "weight_map a number": lambda i: {"weight_map": 5},
    "weight_map empty": lambda i: {"weight_map": {}},
    "file a number": lambda i: {"weight_map": dict.fromkeys(i["weight_map"], 7)},
    "file outside": lambda i: {"weight_map": dict.fromkeys(i["weight_map"], "../x.safetensors")},
    # vLLM globs the folder's own files: a shard in sub/ is never loaded (reshard read ./x.safetensors)
    "file in a subfolder": lambda i: {"weight_map": {k: f"sub/{v}" for k, v in i["weight_map"].items()}},
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_malformed_index(tiny, tmp_path, case):
    src = corrupt(tiny, tmp_path, shards=2)
    edit_json(src / "model.safetensors.index.json", INDEX_CASES[case])
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4, err
    assert "model.safetensors.index.json" in err and err.count("\n") == 1


HEADER_CASES = {
    "metadata a list": lambda h: {**h, "__metadata__": ["format", "pt"]},
    "metadata values not strings": lambda h: {**h, "__metadata__": {"format": 1}},
    "deeply nested": lambda h: b"[" * 100_000 + b"]" * 100_000,
    "dtype a list": lambda h: {k: ({**v, "dtype": ["BF16"]} if k != "__metadata__" else v) for k, v in h.items()},
    "shape of floats": lambda h: {
        k: ({**v, "shape": [float(x) for x in v["shape"]]} if k != "__metadata__" else v) for k, v in h.items()
    },
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_malformed_header(tiny, tmp_path, case):
    src = corrupt(tiny, tmp_path)
    rewrite_header(src / "model.safetensors", HEADER_CASES[case])
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4, err
    assert "model.safetensors" in err and err.count("\n") == 1


@pytest.mark.parametrize("what", ["absent", "a folder", "a FIFO", "a symlink loop", "a symlink to nothing"])
def test_a_shard_the_index_names_that_is_not_a_file(tiny, tmp_path, what):
    """A symlink loop or a dangling symlink is said to be one, not called missing (its name is there)."""
    import os

    src = corrupt(tiny, tmp_path, shards=2)
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.unlink()
    if what == "a folder":
        shard.mkdir()
    elif what == "a FIFO":
        os.mkfifo(shard)  # never opened, so never waited on
    elif what == "a symlink loop":
        shard.symlink_to(shard.name)
    elif what == "a symlink to nothing":
        shard.symlink_to("gone.safetensors")
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and err.count("\n") == 1, err
    says = {
        "absent": "are missing",
        "a symlink loop": "but a symlink that leads round in a loop",
        "a symlink to nothing": "but a symlink to 'gone.safetensors', which does not exist",
    }.get(what, f"not a regular file ({what})")
    assert shard.name in err and says in err, err


@pytest.mark.parametrize("how", ["a loop", "nowhere"])
def test_a_single_file_checkpoint_whose_file_is_a_broken_symlink(tiny, tmp_path, how):
    """model.safetensors, no index: a symlink loop or a symlink to nothing says so."""
    src = corrupt(tiny, tmp_path)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to("model.safetensors" if how == "a loop" else "gone.safetensors")
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    says = "a symlink that leads round in a loop" if how == "a loop" else "a symlink to 'gone.safetensors'"
    assert code == 4 and err.count("\n") == 1 and f"model.safetensors: {says}" in err, err


def test_an_empty_path_argument_is_a_usage_error(tiny):
    """`reshard save SRC ""` would silently write the current folder."""
    for args in (["save", str(tiny("llama")), ""], ["save", "", "out"], ["plan", " "], ["verify", ""]):
        code, _, err = run(*args)
        assert code == 2 and "is empty" in err and err.count("\n") == 1, (args, err)


@pytest.mark.parametrize(
    "args, where",
    [
        (["plan", "{long}"], "SOURCE"),
        (["save", "{long}", "{tmp}/out"], "SOURCE"),
        (["save", "{src}", "{long}/out"], "OUT_DIR"),
        (["verify", "{long}"], "OUT_DIR"),
        (["verify", "{tmp}", "--against", "{long}"], "--against"),
        (["merge", "{long}", "{tmp}/hf"], "OUT_DIR"),
        (["merge", "{tmp}", "{long}/hf"], "HF_DIR"),
        (["assemble", "{long}"], "OUT_DIR"),
    ],
)
def test_a_path_with_a_name_too_long_is_a_usage_error(tiny, tmp_path, args, where):
    """A path holding a name over 255 bytes, which no filesystem keeps: exit 2 naming the argument, in every
    command; it was exit 1 (`internal error: OSError: [Errno 36] File name too long`) from the first stat."""
    long = str(tmp_path / ("a" * 300))
    values = {"long": long, "tmp": str(tmp_path), "src": str(tiny("qwen3"))}
    args = [a.format(**values) for a in args]
    path = next(a for a in args if a.startswith(long))
    code, out, err = run(*args)
    told = (
        f"Invalid value for '{where}': {path}: File name too long (a name in a path is at most 255 bytes: shorten it)"
    )
    assert (code, out, err) == (2, "", f"reshard: error: {told} (see `reshard {args[0]} --help`)\n")


def test_an_unreadable_source_folder_is_a_bad_source(tiny, tmp_path, monkeypatch):
    """A folder this user cannot read: exit 4 saying so (click's readable check made it a usage
    error, and without it reading reshard.json raised PermissionError, exit 1). Root reads any
    folder, so the permission is denied through os.access, as a non-root user meets it."""
    import os

    import reshard.sources as sources

    src = corrupt(tiny, tmp_path)
    real = os.access
    monkeypatch.setattr(sources.os, "access", lambda p, mode: False if Path(p) == src else real(p, mode))
    for cmd in (["plan", str(src)], ["save", str(src), str(tmp_path / "out")]):
        code, _, err = run(*cmd)
        assert code == 4 and "cannot read the folder (permission denied)" in err, err


def test_merge_of_an_unreadable_output_is_a_bad_source(tiny, tmp_path, monkeypatch):
    """merge of an output folder this user cannot read: exit 4 as save's SOURCE, not exit 1 from a
    PermissionError reading reshard.json (denied through os.access, as a non-root user meets it)."""
    out = tmp_path / "out"
    assert run("save", str(tiny("qwen3")), str(out), "--tp", "2")[0] == 0
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out else real(p, mode))
    code, stdout, err = run("merge", str(out), str(tmp_path / "hf"))
    told = f"reshard: error: {out}: cannot read the folder (permission denied) (make it readable by this user)\n"
    assert (code, stdout, err) == (4, "", told)
    assert not (tmp_path / "hf").exists()


def test_out_dir_under_a_regular_file(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "file" / "out"), "--tp", "2")
    assert code == 5 and "is a file" in err


def test_out_dir_in_proc(tiny):
    code, _, err = run("save", str(tiny("llama")), "/proc/reshard-out", "--tp", "2")
    assert code == 5, err


def test_bad_layer_partition_is_a_usage_error(tiny):
    code, _, err = run("plan", str(tiny("llama")), "--pp", "2", "--pp-layer-partition", "5,-1")
    assert code == 2 and "--pp-layer-partition" in err and err.count("\n") == 1


def test_usage_errors_are_one_line(tiny):
    code, _, err = run("save", str(tiny("llama")))
    assert code == 2 and err.startswith("reshard: error: ") and err.count("\n") == 1
    assert "reshard save --help" in err


def test_mistyped_local_path_is_no_such_folder(tmp_path, monkeypatch):
    (tmp_path / "ck").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run("plan", "ck/llamaa", "--tp", "2")
    assert code == 4 and "ck/llamaa: no such folder" in err and "Hub" not in err


@pytest.mark.parametrize("cmd", ["plan", "save", "verify"])
def test_json_failures_are_json_on_stdout(tmp_path, cmd):
    args = {
        "plan": ["plan", str(tmp_path / "nope"), "--json"],
        "save": ["save", str(tmp_path / "nope"), str(tmp_path / "out"), "--json"],
        "verify": ["verify", str(tmp_path / "nope"), "--json"],
    }[cmd]
    code, out, _ = run(*args)
    assert code in (4, 7)
    obj = json.loads(out)
    assert obj["ok"] is False
    assert (obj.get("error") or {}).get("code", code) == code


def test_json_usage_error_is_json(tiny, tmp_path):
    code, out, _ = run("plan", str(tiny("llama")), "--tp", "zero", "--json")
    assert code == 2
    assert json.loads(out)["error"] == {"code": 2, "kind": "UsageError", "message": json.loads(out)["error"]["message"]}
    # every exit 2 is one kind, whoever found it: click, reshard's own checks, a RESHARD_* value
    bad = tmp_path / "sums"
    bad.write_text("junk\n")
    ours = run("save", str(tiny("llama")), str(tmp_path / "o"), "--source-sha256", str(bad), "--json")
    assert ours[0] == 2 and json.loads(ours[1])["error"]["kind"] == "UsageError"


def test_two_different_sha256_lines_for_a_file_are_a_usage_error(tiny, tmp_path):
    """`sha256sum -c` would fail one of them; the last one won silently."""
    src = tiny("llama")
    shard = next(src.glob("*.safetensors")).name
    good = hashlib.sha256((src / shard).read_bytes()).hexdigest()
    sums = tmp_path / "sums"
    sums.write_text(f"{'0' * 64}  {shard}\n{good}  {shard}\n")
    code, _, err = run("save", str(src), str(tmp_path / "o"), "--tp", "2", "--source-sha256", str(sums))
    assert code == 2 and f"sums:2: a second, different sha256 for {shard}" in err, err
    sums.write_text(f"{good}  {shard}\n{good}  ./{shard}\n")  # the same twice: fine
    assert run("save", str(src), str(tmp_path / "o"), "--tp", "2", "--source-sha256", str(sums))[0] == 0


def test_deep_verify_against_a_source_changed_since_the_save_blames_the_source(tiny, tmp_path):
    """The save checked the source's sha256 (--source-sha256) and recorded it; the source changed since:
    `verify --against SRC --deep` says so (exit 4, naming the file), not that the output is corrupt (7)."""
    src = Path(shutil.copytree(tiny("llama"), tmp_path / "src"))
    shard = next(src.glob("*.safetensors"))
    sums = tmp_path / "sums"
    sums.write_text(f"{hashlib.sha256(shard.read_bytes()).hexdigest()}  {shard.name}\n")
    out = tmp_path / "out"
    assert run("save", str(src), str(out), "--tp", "2", "--source-sha256", str(sums))[0] == 0
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    code, _, err = run("verify", str(out), "--against", str(src), "--deep")
    assert code == 4 and f"{shard}: sha256" in err and "SOURCE changed since the save?" in err, err


def test_debug_adds_the_traceback_and_keeps_the_code(tmp_path, monkeypatch):
    """RESHARD_DEBUG=1 is for reading a failure, not for changing it: the same exit code, the same
    --json object and error line, the traceback on stderr before them."""
    monkeypatch.setenv("RESHARD_DEBUG", "1")
    code, out, err = run("save", str(tmp_path / "nope"), str(tmp_path / "out"), "--json")
    assert code == 4 and json.loads(out)["error"]["kind"] == "SourceError"
    assert err.startswith("Traceback (most recent call last):") and "SourceError" in err
    assert err.splitlines()[-1].startswith("reshard: error: ") and "no such folder" in err.splitlines()[-1]


def test_tp_is_not_read_from_the_environment(tiny, monkeypatch):
    monkeypatch.setenv("RESHARD_TP", "4")
    code, out, _ = run("plan", str(tiny("llama")), "--json")
    assert code == 0 and json.loads(out)["tp"] == 1


def _set_shape(name: str, shape: list[int]):
    def fn(h: dict) -> dict:
        h[name] = {**h[name], "shape": shape}
        return h

    return fn


SHAPE_CASES = {
    # same bytes, other shapes: the kind of damage that loads silently into vLLM
    "transposed down_proj": ("model.layers.0.mlp.down_proj.weight", "T"),
    "reshaped q_proj": ("model.layers.0.self_attn.q_proj.weight", "half"),
    "up_proj beside gate_proj": ("model.layers.1.mlp.up_proj.weight", "half"),
    "transposed embedding": ("model.embed_tokens.weight", "T"),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_source_shapes_are_checked_against_config(tiny, tmp_path, case):
    name, how = SHAPE_CASES[case]
    src = corrupt(tiny, tmp_path)
    head = json.loads(
        (src / "model.safetensors").read_bytes()[
            8 : 8 + struct.unpack("<Q", (src / "model.safetensors").read_bytes()[:8])[0]
        ]
    )
    rows, cols = head[name]["shape"]
    shape = [cols, rows] if how == "T" else [rows * 2, cols // 2]
    rewrite_header(src / "model.safetensors", _set_shape(name, shape))
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4, err
    assert name in err and "expected" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_config_intermediate_size_disagreeing_with_the_tensors(tiny, tmp_path):
    src = corrupt(tiny, tmp_path)
    edit_json(src / "config.json", lambda c: {**c, "intermediate_size": c["intermediate_size"] * 2})
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 4 and "intermediate_size" in err


def test_ep_on_a_dense_model_is_refused(tiny, tmp_path):
    code, _, err = run("save", str(tiny("llama")), str(tmp_path / "out"), "--tp", "2", "--ep")
    assert code == 3 and "no experts" in err and "drop --ep" in err


def test_expert_substitution_is_refused(tiny, tmp_path):
    src = corrupt(tiny, tmp_path, "qwen3-moe")
    edit_json(src / "config.json", lambda c: {**c, "approximate_experts": True})
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 3 and "expert substitution" in err


@pytest.mark.parametrize(
    "edit, says",
    [
        (("num_key_value_heads", 4), "the weights give 16 rows per KV head (4 of them), config.json says head_dim 32"),
        (("head_dim", 16), "the weights give 32 rows per KV head (2 of them), config.json says head_dim 16"),
    ],
)
def test_a_config_whose_heads_the_weights_do_not_have_is_refused(tiny, tmp_path, edit, says):
    """k's rows per KV head must be the config's head_dim (or hidden_size / heads): else vLLM
    builds other q/k/v shapes than the folder would hold (it was written, and verify passed it)."""
    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3"), src)
    config = json.loads((src / "config.json").read_text())
    config[edit[0]] = edit[1]
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_merge_and_assemble_paths_answer_as_save_does(tiny, tmp_path):
    """A folder to read that is not there is a source not found (exit 4), for merge's OUT_DIR and
    assemble's as for save's SOURCE; a file where merge would write HF_DIR is refused (exit 5), as
    save's OUT_DIR. (They were click's usage errors, exit 2.)"""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for args in (["merge", str(tmp_path / "nope"), str(tmp_path / "hf")], ["assemble", str(tmp_path / "nope")],
                 ["merge", str(a_file), str(tmp_path / "hf")], ["assemble", str(a_file)]):  # fmt: skip
        code, _, err = run(*args)
        assert code == 4 and "OUT_DIR" in err and err.count("\n") == 1, (args, err)
    out = tmp_path / "out"
    assert run("save", str(tiny("llama")), str(out), "--tp", "2")[0] == 0
    code, _, err = run("merge", str(out), str(a_file))
    assert code == 5 and "HF_DIR" in err and "not a folder" in err, err


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_config_dtype_vllm_cannot_run_names_its_key_and_the_choices(tiny, tmp_path, key):
    src = corrupt(tiny, tmp_path)
    edit_json(src / "config.json", lambda c: {**{k: v for k, v in c.items() if "dtype" not in k}, key: "int4"})
    code, _, err = run("plan", str(src), "--tp", "2")
    assert code == 3, err
    assert f"config.json {key} 'int4'" in err and "--dtype bfloat16, float16 or float32" in err
    code, _, err = run("plan", str(src), "--tp", "2", "--dtype", "bfloat16")
    assert code == 0, err


def test_bytes_after_the_last_tensor_exit_4(tiny, tmp_path):
    """The safetensors library (so vLLM's default loader) refuses such a file; a save must not make it load."""
    src = corrupt(tiny, tmp_path)
    with open(src / "model.safetensors", "ab") as f:
        f.write(b"\0" * 3)
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and "3 bytes after its last tensor" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command, code", [("plan", 4), ("save", 4), ("verify", 7)])
def test_a_folder_that_cannot_be_listed_is_named(tiny, tmp_path, monkeypatch, command, code):
    """Listing the source (or the output verified) failing (EIO, a stale or disconnected mount): the exit code
    of a folder that cannot be read, naming it; it was exit 1, an internal error."""
    import errno

    src = tiny("llama")
    out = tmp_path / "out"
    if command == "verify":
        assert run("save", str(src), str(out), "--tp", "2")[0] == 0
    bad = out if command == "verify" else src
    real = Path.iterdir

    def iterdir(self):
        if self == bad:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    args = {"plan": ["plan", str(src)], "save": ["save", str(src), str(out)], "verify": ["verify", str(out)]}[command]
    got, _, err = run(*args, "--tp", "2")
    assert got == code and f"{bad}: Transport endpoint is not connected" in err and err.count("\n") == 1, err


def _touch(shard: Path) -> None:
    """A new modification time, as a write would leave."""
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _edit_and_set_mtime_back(shard: Path) -> None:
    """Bytes changed in place, the modification time set back (or within a coarse mtime's tick, as on some
    network file systems): only the change time, which no user can set, tells it."""
    st = shard.stat()
    time.sleep(0.01)  # a change time of its own, on file systems of coarse timestamps too
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 8)
        f.write(bytes(8))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change", [_touch, _edit_and_set_mtime_back], ids=["written", "mtime-set-back"])
def test_a_shard_written_to_during_the_run_is_refused(tiny, tmp_path, monkeypatch, change):
    """A source file written to while the save reads it (a second download over it, an editor): the output
    would hold a mix, and a --source-sha256 check recorded as verified would be false. Exit 4, nothing published.
    (The change is made once the reads start.)"""
    from reshard.sources.local import LocalSource

    src = Path(shutil.copytree(tiny("llama"), tmp_path / "src"))
    shard = next(src.glob("*.safetensors"))
    real = LocalSource.open_reader

    def open_reader(self):
        reader = real(self)
        change(shard)
        return reader

    monkeypatch.setattr(LocalSource, "open_reader", open_reader)
    code, _, err = run("save", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 4 and f"{shard} changed while this run read it" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_source_file_this_user_cannot_read_says_so(tiny, tmp_path, monkeypatch, name):
    """config.json or the index without read permission: exit 4 saying to grant it; it was `cannot parse ([Errno
    13] Permission denied)` with a hint to download the checkpoint again (denied by hand: root reads any file)."""
    import reshard.sources.local as local

    src = tiny("qwen3", shards=2)
    real = local.open_regular

    def denied(path, **kwargs):
        if Path(path) == src / name:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(local, "open_regular", denied)
    code, out, err = run("plan", str(src), "--tp", "2")
    told = f"reshard: error: cannot read {src / name} (permission denied) (give this user read access to it)\n"
    assert (code, out, err) == (4, "", told)


def test_a_manifest_this_user_cannot_read_says_so(tiny, tmp_path, monkeypatch):
    """reshard.json without read permission: exit 7 as verify's unreadable folder, saying to grant it; it was
    `malformed manifest ([Errno 13] Permission denied)` with a hint to rerun the save."""
    import reshard.manifest as manifest

    out = tmp_path / "out"
    assert run("save", str(tiny("qwen3")), str(out), "--tp", "2")[0] == 0
    real = manifest.open_regular

    def denied(path, **kwargs):
        if Path(path) == out / "reshard.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(manifest, "open_regular", denied)
    denial = f"cannot read {out / 'reshard.json'} (permission denied) (give this user read access to it)"
    code, _, err = run("merge", str(out), str(tmp_path / "hf"))
    assert (code, err) == (7, f"reshard: error: {denial}\n")
    code, _, err = run("verify", str(out))
    foreign = ", or check a folder without manifest with --against SOURCE --tp T"  # verify's hint for any manifest
    assert (code, err) == (7, f"reshard: error: verify: corrupt or incomplete (exit 7): {denial[:-1]}{foreign})\n")


def test_control_characters_in_a_path_are_shown_escaped(tiny, tmp_path):
    """A path argument holding an escape sequence, a line break, a carriage return or a bidi override: every
    line reshard prints (an error on stderr and in --json, verify's findings, a save's result and notes) shows
    them as a repr does, so that a terminal or a CI log cannot be coloured, erased or given a forged line."""
    name = "d\x1b[31m\nreshard: ok\r\u202e"
    shown = f"{tmp_path}/d\\x1b[31m\\nreshard: ok\\r\\u202e"

    def raw(text: str) -> set[str]:
        return {c for c in text if not c.isprintable() and c != "\n"}

    code, out, err = run("save", str(tmp_path / name), str(tmp_path / "out"), "--tp", "2", "--json")
    message = json.loads(out)["error"]["message"]
    assert (code, err) == (4, f"reshard: error: {message}\n") and message.startswith(f"{shown}: no such folder")
    code, out, err = run("verify", str(tmp_path / name))
    assert code == 7 and raw(out + err) == set() and err.count("\n") == 1, (out, err)
    assert f"error: [missing] {shown}: no such folder" in out and f"(exit 7): {shown}: no such folder" in err
    code, out, err = run("save", str(tiny("llama")), str(tmp_path / name), "--tp", "2")
    assert code == 0 and raw(out + err) == set() and f" to {shown}\n" in out, (out, err)
    assert (tmp_path / name / "reshard.json").is_file()
