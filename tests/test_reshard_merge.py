"""An output as SOURCE (re-shard without the original) and `merge` back to Hugging Face."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import CorruptError
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART
from tests.fixtures.saving import save

MAX = DEFAULT_MAX_PART


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def load_dir(folder: Path, pattern: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(folder.glob(pattern)):
        tensors = load_file(str(p))
        assert not set(tensors) & set(out)
        out.update({(p.name.split("-part-")[0] + "/" + k if "-part-" in p.name else k): v for k, v in tensors.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(raw(a[k]), raw(b[k])), k


@pytest.mark.parametrize(
    "arch, first, second",
    [
        ("llama", dict(tp=4), dict(tp=2)),
        ("qwen3", dict(tp=2), dict(tp=4)),
        ("qwen3-moe", dict(tp=2), dict(tp=2, ep=True)),
        ("qwen3-moe", dict(tp=4, ep=True), dict(tp=2)),
        ("qwen3-moe-fp8", dict(tp=4), dict(tp=2, ep=True)),  # refined 32x32 scales read back
        ("qwen2-moe", dict(tp=2), dict(tp=1)),
        ("mixtral", dict(tp=2, ep=True), dict(tp=4)),
        ("llama", dict(tp=2), dict(tp=2, pp=2)),
    ],
)
def test_reshard_an_output_equals_resharding_the_original(tiny, tmp_path, arch, first, second):
    src = tiny(arch)
    save(str(src), tmp_path / "first", max_part_size=MAX, **first)
    via = save(str(tmp_path / "first"), tmp_path / "via", max_part_size=MAX, **second)
    save(str(src), tmp_path / "direct", max_part_size=MAX, **second)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))
    assert via.manifest.source["resharded_from"]["path"] == str(src.resolve())


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", dict(tp=2)),
        ("qwen3-moe", dict(tp=2, ep=True)),
        ("qwen3-moe-fp8", dict(tp=2)),
        ("qwen2-moe", dict(tp=4)),
    ],
)
def test_merge_round_trips_byte_identical(tiny, tmp_path, arch, layout):
    src = tiny(arch, shards=2)
    save(str(src), tmp_path / "out", max_part_size=MAX, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf", max_shard_size=400_000)
    assert result["not_in_output"] == []
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in (tmp_path / "hf").glob("model-*.safetensors")}
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "tokenizer.json").exists()


def test_output_with_a_damaged_file_is_refused_as_source(tiny, tmp_path):
    save(str(tiny("llama")), tmp_path / "out", tp=2, max_part_size=MAX)
    victim = tmp_path / "out" / "model-rank-1-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptError, match=r"model-rank-1-part-0\.safetensors fails its blake3 checksum"):
        save(str(tmp_path / "out"), tmp_path / "again", tp=1, max_part_size=MAX)
    with pytest.raises(CorruptError):
        merge(tmp_path / "out", tmp_path / "hf")


@pytest.mark.parametrize("damage", ["config edited", "tokenizer removed", "config removed", "stray rank file"])
def test_an_output_verify_would_fail_is_refused_as_source(tiny, tmp_path, damage):
    """What the checkpoint is read with (config.json, the tokenizer copied on) must be what was saved,
    and no rank file the manifest does not list may lie beside the ranks' (vLLM would load it): as
    `verify` says, exit 7, for re-shard and merge alike (an edited config.json was carried on)."""
    out = tmp_path / "out"
    save(str(tiny("qwen3")), out, tp=2, max_part_size=MAX)
    if damage == "config edited":
        (out / "config.json").write_text((out / "config.json").read_text().replace("1e-06", "0.5"))
    elif damage == "tokenizer removed":
        (out / "tokenizer.json").unlink()
    elif damage == "config removed":
        (out / "config.json").unlink()
    else:
        (out / "model-rank-0-part-1.safetensors").write_bytes((out / "model-rank-0-part-0.safetensors").read_bytes())
    word = "not in the manifest" if damage == "stray rank file" else "copied from the source"
    with pytest.raises(CorruptError, match=word):
        save(str(out), tmp_path / "again", tp=1, max_part_size=MAX)
    with pytest.raises(CorruptError, match=word):
        merge(out, tmp_path / "hf")
    assert not (tmp_path / "again").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "arch, layout, edit, says",
    [
        ("qwen3-moe", dict(tp=2, ep=True), {"ep": False}, "written for layout tp=2,pp=1,ep=1"),
        ("llama", dict(tp=2), {"dtype": "float16"}, "is BF16"),
        (
            "qwen3-moe",
            dict(tp=2, moe_backend="flashinfer_trtllm"),
            {"moe_backend": "triton", "moe_backend_pinned": "triton"},
            "the manifest's layout",
        ),
    ],
)
def test_a_manifest_whose_layout_was_edited_is_refused_as_source(tiny, tmp_path, arch, layout, edit, says):
    """The layout is read from the manifest and the rank files' bytes are cut by it: one edited there (ep,
    dtype, the MoE backend's padding) read the files back as other tensors, exit 0, and the re-sharded
    output then verified. Each file's own record (its run, layout tag, tensors' dtypes and shapes) must agree."""
    out = tmp_path / "out"
    save(str(tiny(arch)), out, max_part_size=MAX, **layout)
    m = json.loads((out / "reshard.json").read_text())
    m["layout"].update(edit)
    (out / "reshard.json").write_text(json.dumps(m))
    with pytest.raises(CorruptError, match=says):
        save(str(out), tmp_path / "again", tp=1, max_part_size=MAX)
    with pytest.raises(CorruptError, match=says):
        merge(out, tmp_path / "hf")
    assert not (tmp_path / "again").exists() and not (tmp_path / "hf").exists()


def test_swapped_rank_files_are_refused_as_source(tiny, tmp_path):
    """Rank 0's and rank 1's files of an output saved without digests swapped (same sizes, names and
    shapes): merged, they would put each rank's rows in the other's place; their headers' own names tell
    it before a byte is read."""
    out = tmp_path / "out"
    save(str(tiny("qwen3")), out, tp=2, max_part_size=MAX, checksum="none")
    r0, r1 = out / "model-rank-0-part-0.safetensors", out / "model-rank-1-part-0.safetensors"
    r0.rename(tmp_path / "keep")
    r1.rename(r0)
    (tmp_path / "keep").rename(r1)
    with pytest.raises(
        CorruptError, match=re.escape("was written as model-rank-1-part-0.safetensors: rank files were renamed")
    ):
        merge(out, tmp_path / "hf")
    with pytest.raises(CorruptError, match="renamed or swapped"):
        save(str(out), tmp_path / "again", tp=1, max_part_size=MAX)


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-moe-fp8"])
def test_an_output_split_into_many_parts_merges_and_reshards(tiny, tmp_path, arch):
    """--max-part-size is not recorded: which file holds which tensor is read from the manifest, not
    planned again with the default part size (merge, re-shard and plan from such an output said
    "tensor ... is missing (the output is damaged)" though verify passed it)."""
    src = tiny(arch, shards=2)
    out = tmp_path / "out"
    save(str(src), out, tp=2, max_part_size=10_000)
    assert len(list(out.glob("model-rank-0-part-*.safetensors"))) > 3
    merge(out, tmp_path / "hf")
    assert_same(load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors"))
    save(str(out), tmp_path / "tp4", tp=4, max_part_size=MAX)
    save(str(src), tmp_path / "direct", tp=4, max_part_size=MAX)
    for r in range(4):  # rank by rank: the same names on every rank
        name = f"model-rank-{r}-part-0.safetensors"
        assert_same(load_dir(tmp_path / "tp4", name), load_dir(tmp_path / "direct", name))


def test_resharding_a_lossy_output_into_another_dtype_is_refused(tiny, tmp_path):
    """A bf16 checkpoint saved as float16, re-sharded as bfloat16 (or float32): not the values of
    re-sharding the original, which merge already refuses as lossy; it was written without a word.
    Its own dtype (auto) re-shards as the original saved in float16 does; a float32 output of a
    bf16 original holds its values exactly and re-shards into bfloat16 as the original."""
    from reshard.errors import UnsupportedError

    src = tiny("llama")
    save(str(src), tmp_path / "f16", tp=2, dtype="float16", max_part_size=MAX)
    for dtype in ("bfloat16", "float32"):
        with pytest.raises(UnsupportedError, match="lost precision against the original"):
            save(str(tmp_path / "f16"), tmp_path / dtype, tp=4, dtype=dtype, max_part_size=MAX)
    save(str(tmp_path / "f16"), tmp_path / "auto", tp=4, max_part_size=MAX)
    save(str(src), tmp_path / "direct-f16", tp=4, dtype="float16", max_part_size=MAX)
    save(str(src), tmp_path / "f32", tp=2, dtype="float32", max_part_size=MAX)
    save(str(tmp_path / "f32"), tmp_path / "back", tp=4, dtype="bfloat16", max_part_size=MAX)
    save(str(src), tmp_path / "direct", tp=4, max_part_size=MAX)
    for r in range(4):
        name = f"model-rank-{r}-part-0.safetensors"
        assert_same(load_dir(tmp_path / "auto", name), load_dir(tmp_path / "direct-f16", name))
        assert_same(load_dir(tmp_path / "back", name), load_dir(tmp_path / "direct", name))


def test_merge_of_a_float16_output_is_refused_unless_lossy_is_allowed(tiny, tmp_path):
    from reshard.errors import UnsupportedError

    src = tiny("llama")
    save(str(src), tmp_path / "out", tp=2, dtype="float16", max_part_size=MAX)
    with pytest.raises(UnsupportedError, match="lost precision"):
        merge(tmp_path / "out", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    result = merge(tmp_path / "out", tmp_path / "hf", allow_lossy=True)
    assert result["lossy"] and all(e["original"] == "BF16" and e["stored"] == "F16" for e in result["lossy"])


def test_merge_of_a_float32_output_is_exact(tiny, tmp_path):
    src = tiny("llama")
    save(str(src), tmp_path / "out", tp=2, dtype="float32", max_part_size=MAX)
    result = merge(tmp_path / "out", tmp_path / "hf")
    assert result["lossy"] == []
    original, merged = load_dir(src, "*.safetensors"), load_dir(tmp_path / "hf", "*.safetensors")
    assert all(torch.equal(raw(original[k]), raw(merged[k])) for k in original)


def test_merge_of_deepseek_says_once_what_it_skipped_and_fixes_the_config(tiny, tmp_path):
    from tests.fixtures.cli import run

    save(str(tiny("deepseek-v3")), tmp_path / "out", tp=2, max_part_size=MAX)
    code, out, err = run("merge", str(tmp_path / "out"), str(tmp_path / "hf"))
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]  # on stderr: not the result
    assert len(notes) == 2, notes  # one for the skipped MTP tensors, one for the config
    assert "note:" not in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("arch", ["qwen3-next", "qwen3.5-moe"])
def test_merge_of_qwen_next_drops_its_mtp_layers_from_the_config_too(tiny, tmp_path, arch):
    """Its draft layers (`mtp.*`) are not in the output: the merged config.json must not announce them
    (mtp_num_hidden_layers stayed 1, in text_config for Qwen3.5)."""
    from tests.fixtures.cli import run

    src = tiny(arch)
    config = json.loads((src / "config.json").read_text())
    assert config.get("text_config", config)["mtp_num_hidden_layers"] == 1
    save(str(src), tmp_path / "out", tp=2, max_part_size=MAX)
    code, _, err = run("merge", str(tmp_path / "out"), str(tmp_path / "hf"))
    assert code == 0, err
    merged = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert merged.get("text_config", merged)["mtp_num_hidden_layers"] == 0
    assert not [k for k in load_dir(tmp_path / "hf", "model*.safetensors") if k.startswith("mtp.")]


def test_merge_errors_name_hf_dir(tiny, tmp_path):
    """merge writes HF_DIR (its OUT_DIR is the source): its refusals say HF_DIR."""
    from tests.fixtures.cli import run

    out = tmp_path / "out"
    save(str(tiny("llama")), out, tp=2, max_part_size=MAX)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "x").write_text("x")
    code, _, err = run("merge", str(out), str(hf))
    assert code == 5 and f"HF_DIR {hf} is not empty" in err and "replace the weights there" in err, err
    code, _, err = run("merge", str(out), str(out / "inside"))
    assert code == 5 and "HF_DIR" in err and "is inside the source folder" in err, err


def test_an_output_saved_without_checksums_says_so_when_read_back(tiny, tmp_path):
    from tests.fixtures.cli import run

    save(str(tiny("llama")), tmp_path / "out", tp=2, max_part_size=MAX, checksum="none")
    for args in (
        ["merge", str(tmp_path / "out"), str(tmp_path / "hf")],
        ["save", str(tmp_path / "out"), str(tmp_path / "again")],
    ):
        code, _, err = run(*args)
        assert code == 0 and "saved with --checksum none: its files' sizes were checked, not their bytes" in err, err


@pytest.mark.parametrize("command", ["merge", "save"])
def test_a_failing_disk_under_an_output_read_back_is_a_source_error(tiny, tmp_path, monkeypatch, command):
    """EIO (a failing disk or mount) reading an output's rank file while merging or re-sharding it is
    exit 4 naming that file, as for any source; it was told as `cannot write` the destination (exit 5)."""
    import errno
    import os

    from reshard.sources import output_reader
    from tests.fixtures.cli import run

    out, dest = tmp_path / "o", tmp_path / "dest"
    save(str(tiny("qwen3-moe")), out, tp=2, max_part_size=DEFAULT_MAX_PART)
    armed = []  # the rank files are read back (their checks, before, read them too)
    init = output_reader.OutputReader.__init__
    monkeypatch.setattr(
        output_reader.OutputReader, "__init__", lambda self, *a, **k: armed.append(1) or init(self, *a, **k)
    )
    real = os.pread

    def pread(fd, n, offset):
        if armed and os.readlink(f"/proc/self/fd/{fd}").endswith("model-rank-1-part-0.safetensors"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    args = ["merge", str(out), str(dest)] if command == "merge" else ["save", str(out), str(dest), "--tp", "1"]
    code, _, err = run(*args)
    assert armed and code == 4, err
    assert f"cannot read {out / 'model-rank-1-part-0.safetensors'}: Input/output error" in err, err
    assert not dest.exists()
