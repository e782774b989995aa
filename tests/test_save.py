"""`save` end to end on tiny real checkpoints: the streamed files hold exactly what the plan says."""

from __future__ import annotations

import json

import blake3
import pytest
import torch
from safetensors import safe_open

from reshard.plan import DEFAULT_MAX_PART
from reshard.sources import open_source
from tests.fixtures.reference import assert_streamed_files_equal_plan, load_source
from tests.fixtures.saving import save

CASES = [
    ("llama", 1, False),
    ("llama", 4, False),
    ("llama-tied", 2, False),
    ("mistral", 2, False),
    ("qwen2", 2, False),
    ("qwen3", 4, False),
    ("qwen3-moe", 2, False),
    ("qwen3-moe", 4, True),
    ("mixtral", 2, True),
    ("qwen2-moe", 2, False),
    ("qwen3-moe-fp8", 2, False),
    ("qwen3-moe-fp8", 2, True),
]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def read_rank_files(out_dir, plan):
    got = {}
    for f in plan.files:
        with safe_open(str(out_dir / f.name), "pt") as h:
            assert h.metadata()["reshard_layout"].startswith(f"tp={plan.layout.tp},")
            for k in h.keys():  # noqa: SIM118
                got[(f.tp_rank, f.pp_rank, k)] = h.get_tensor(k)
    return got


@pytest.mark.parametrize("reads", ["direct", "buffered"])
@pytest.mark.parametrize("arch, tp, ep", CASES, ids=[f"{a}-tp{t}{'-ep' if e else ''}" for a, t, e in CASES])
def test_streamed_files_equal_plan(tiny, tmp_path, monkeypatch, arch, tp, ep, reads):
    # O_DIRECT reads land each chunk at its file offset's place in a page, buffered ones at the start
    monkeypatch.setenv("RESHARD_DIRECT_READS", "1" if reads == "direct" else "0")
    src = tiny(arch, shards=2)
    out = tmp_path / "out"
    plan = assert_streamed_files_equal_plan(src, out, tp=tp, ep=ep).plan
    for f in plan.files:
        with safe_open(str(out / f.name), "pt") as h:
            assert h.metadata()["reshard_layout"].startswith(f"tp={plan.layout.tp},")
            assert h.metadata()["reshard_file"] == f.name
    # the manifest's checksums are the files' checksums
    manifest = json.loads((out / "reshard.json").read_text())
    for entry in manifest["files"]:
        data = (out / entry["name"]).read_bytes()
        assert len(data) == entry["size"]
        assert manifest["checksum"] == "blake3" and blake3.blake3(data).hexdigest() == entry["blake3"]
    assert not list(out.glob(".reshard-tmp-*"))
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert not (out / "model.safetensors.index.json").exists()


def test_parts_split_at_max_part_size(tiny, tmp_path):
    src = tiny("llama")
    one = save(str(src), tmp_path / "one", tp=2, max_part_size=DEFAULT_MAX_PART)
    many = save(str(src), tmp_path / "many", tp=2, max_part_size=100_000)
    assert len(one.plan.files) == 2 and len(many.plan.files) > 4
    for f in many.plan.files:
        assert f.data_bytes <= 100_000 or len(f.tensors) == 1
    a, b = read_rank_files(tmp_path / "one", one.plan), read_rank_files(tmp_path / "many", many.plan)
    assert a.keys() == b.keys()
    assert all(torch.equal(raw(a[k]), raw(b[k])) for k in a)


def test_dtype_cast_matches_torch(tiny, tmp_path):
    src = tiny("qwen3")
    result = save(str(src), tmp_path / "out", tp=2, dtype="float16", max_part_size=DEFAULT_MAX_PART)
    source = load_source(src, open_source(str(src)).checkpoint)
    with safe_open(str(tmp_path / "out" / "model-rank-1-part-0.safetensors"), "pt") as h:
        norm = h.get_tensor("model.layers.0.input_layernorm.weight")
        scale = h.get_tensor("model.layers.0.self_attn.attn._k_scale")
    assert norm.dtype == torch.float16
    assert torch.equal(norm, source["model.layers.0.input_layernorm.weight"].to(torch.float16))
    assert scale.dtype == torch.float32 and scale.item() == 1.0
    assert "--dtype float16" in result.manifest.serve


def test_bf16_scales_become_fp32(tiny, tmp_path):
    src = tiny("qwen3-moe-fp8", scale_dtype="bfloat16")
    save(str(src), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    source = load_source(src, open_source(str(src)).checkpoint)
    with safe_open(str(tmp_path / "out" / "model-rank-0-part-0.safetensors"), "pt") as h:
        s = h.get_tensor("model.layers.1.self_attn.o_proj.weight_scale_inv")
        kv = h.get_tensor("model.layers.1.self_attn.attn.k_scale")
    hf = source["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    assert s.dtype == torch.float32 and torch.equal(s, hf[:, : s.shape[1]].float())
    assert kv.dtype == torch.bfloat16 and kv.item() == -1.0


@pytest.mark.parametrize(("arch", "backend"), [("qwen3-moe-fp8", "deep_gemm"), ("qwen3-moe", "flashinfer_trtllm")])
def test_padded_moe_backend_verifies_and_reshards(tiny, tmp_path, arch, backend):
    """A padded experts layout (Slice.pad, Fill) round-trips: verify re-plans the recorded backend,
    and re-sharding the output reads the real regions back out of the padded tensors."""
    import json as _json

    from safetensors.torch import load_file

    from tests.fixtures.cli import run

    src = tiny(arch)
    out, again, direct = tmp_path / "out", tmp_path / "again", tmp_path / "direct"
    code, _, err = run("save", str(src), str(out), "--tp", "2", "--moe-backend", backend)
    assert code == 0, err
    manifest = _json.loads((out / "reshard.json").read_text())
    assert manifest["layout"]["moe_backend"] == backend and f"--moe-backend {backend}" in manifest["serve"]
    code, _, err = run("verify", str(out), "--deep", "--against", str(src))
    assert code == 0, err
    for dst, source in ((again, out), (direct, src)):
        code, _, err = run("save", str(source), str(dst), "--tp", "4", "--moe-backend", backend)
        assert code == 0, err
    for r in range(4):
        a = load_file(str(again / f"model-rank-{r}-part-0.safetensors"))
        b = load_file(str(direct / f"model-rank-{r}-part-0.safetensors"))
        assert a.keys() == b.keys()
        assert all(
            a[k].dtype == b[k].dtype
            and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
            for k in a
        )


def test_weights_in_a_copied_folder_are_left_out(tiny, tmp_path):
    """A Llama download's `original/` holds the same weights in Meta's format (16 GB for an 8B
    model): its other files are copied, as vLLM's save_sharded_state example copies folders, the
    weights never."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny("llama"), src)
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    (src / "original" / "params.json").write_text('{"dim": 64}')
    (src / "original" / "tokenizer.model").write_bytes(b"tok")
    out = tmp_path / "out"
    save(str(src), out, tp=2, max_part_size=DEFAULT_MAX_PART)
    assert sorted(p.name for p in (out / "original").iterdir()) == ["params.json", "tokenizer.model"]
    manifest = json.loads((out / "reshard.json").read_text())
    assert "original" in manifest["copied"]
    copied = [e["name"] for e in manifest["copied_files"]]
    assert "original/params.json" in copied and not [n for n in copied if n.endswith(".pth")]
    from tests.fixtures.cli import run

    code, stdout, err = run("verify", str(out), "--against", str(src))
    assert code == 0, stdout + err
