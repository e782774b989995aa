"""NVIDIA ModelOpt FP8 (quant_algo FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO): the config read as vLLM reads
it (config.json or hf_quant_config.json), per-rank layout, refusals, merge back to the original bytes,
re-shard of an output, verify --deep. vLLM's own state: tests/against_vllm (test_vllm.py's mo-fp8 cases)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.errors import SourceError, UnsupportedError
from reshard.merge import merge
from reshard.plan import DEFAULT_MAX_PART
from reshard.plan.modelopt import FP8_SCALE_SENTINEL
from reshard.plan.quantconfig import quant_from_config
from reshard.verify import verify
from tests.fixtures.saving import rank_tensors, save
from tests.test_reshard_merge import assert_same, load_dir

MAX = DEFAULT_MAX_PART
A = "model.layers.0.self_attn."


@pytest.fixture(scope="module")
def mo(quantized):
    """mo(arch, scheme) -> a tiny checkpoint as ModelOpt write(s) `scheme` (conftest.quantized)."""
    return quantized


_rank = rank_tensors


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_config_forms_as_vllm_reads_them():
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "fp8", "exclude_modules": ["lm_head"]}}
    q = quant_from_config({"quantization_config": legacy})
    assert q.to_json()["quant_algo"] == "FP8" and q.ignored == ("lm_head",) and q.static_activations
    new = {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO", "ignore": ["lm_head"], "kv_cache_scheme": None}
    q = quant_from_config({"quantization_config": new})
    assert (q.method, q.strategy, q.kv_algo) == ("modelopt", "block", None)
    kv = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    assert quant_from_config({"quantization_config": kv}).kv_algo == "FP8"
    fp4 = quant_from_config({"quantization_config": {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}})
    assert fp4.method == "modelopt_fp4"  # the NVFP4 strategy (tests/test_nvfp4.py), not an FP8 one
    with pytest.raises(UnsupportedError, match="'modelopt MXFP8' is not supported"):
        quant_from_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}})
    with pytest.raises(SourceError, match="exclude_modules / ignore must be a list"):
        quant_from_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": "x"}})


def test_exclude_modules_without_ignore_in_config_json_is_refused():
    """vLLM 0.33 reads config.json's `exclude_modules` where `ignore` is absent, 0.32 does not: the two
    versions reshard writes for would quantize different modules."""
    for algo in ("FP8", "NVFP4"):
        qc = {"quant_method": "modelopt", "quant_algo": algo, "exclude_modules": ["lm_head"], "group_size": 16}
        with pytest.raises(UnsupportedError, match=r"exclude_modules.*no `ignore`"):
            quant_from_config({"quantization_config": qc})
        both = quant_from_config({"quantization_config": {**qc, "ignore": ["lm_head"]}})
        assert both.ignored == ("lm_head",)
    # hf_quant_config.json's form names them exclude_modules in both versions
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    assert quant_from_config({"quantization_config": legacy}).ignored == ("lm_head",)


def test_exclusion_follows_vllm():
    q = quant_from_config(
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["model.layers.1*"]}}
    )
    assert q.ignores("model.layers.1.self_attn.q_proj") and q.ignores("model.layers.10.mlp.down_proj")
    assert not q.ignores("model.layers.2.mlp.down_proj")
    q = quant_from_config(
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["self_attn.k_proj"]}}
    )
    with pytest.raises(UnsupportedError, match="some but not all shards"):
        q.quantizes(["m.self_attn.q_proj", "m.self_attn.k_proj", "m.self_attn.v_proj"])


def test_fp8_from_hf_quant_config_json_tp2(mo, tmp_path):
    src = mo("llama", "mo-fp8")
    assert "quantization_config" not in json.loads((src / "config.json").read_text())
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    assert res.plan.layout.quantization["quant_algo"] == "FP8"
    sd, hf = _rank(tmp_path / "o", 1), load_file(str(src / "model.safetensors"))
    # per-shard scales: slot i holds shard i's 0-d scale
    want = torch.stack([hf[A + f"{p}_proj.weight_scale"] for p in "qkv"])
    assert torch.equal(sd[A + "qkv_proj.weight_scale"], want)
    assert torch.equal(sd[A + "qkv_proj.input_scale"], torch.stack([hf[A + f"{p}_proj.input_scale"] for p in "qkv"]))
    assert sd[A + "qkv_proj.weight"].dtype == torch.float8_e4m3fn and list(sd[A + "qkv_proj.weight"].shape) == [
        192,
        64,
    ]
    assert list(sd[A + "o_proj.weight_scale"].shape) == [1]
    # ModelOpt's KV-cache scale names, in the model dtype
    assert sd[A + "attn.k_scale"].dtype == torch.bfloat16
    assert sd[A + "attn.k_scale"].item() == hf[A + "k_proj.k_scale"].to(torch.bfloat16).item()
    assert sd[A + "attn.q_scale"].item() == -1.0
    # the config stays in hf_quant_config.json, copied as it is
    out = tmp_path / "o"
    assert (out / "hf_quant_config.json").read_bytes() == (src / "hf_quant_config.json").read_bytes()
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    summary = res.plan.summary()
    for r in (0, 1):
        held = _rank(out, r)
        assert summary["ranks"][r]["bytes"] == sum(t.numel() * t.element_size() for t in held.values())


def test_missing_input_scale_is_the_sentinel(mo, tmp_path):
    src = _copy(mo("llama", "mo-fp8-cfg"), tmp_path / "src")
    hf = load_file(str(src / "model.safetensors"))
    del hf[A + "k_proj.input_scale"]
    from safetensors.torch import save_file

    save_file(hf, str(src / "model.safetensors"), metadata={"format": "pt"})
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    sd = _rank(tmp_path / "o", 0)
    assert sd[A + "qkv_proj.input_scale"][1].item() == FP8_SCALE_SENTINEL == torch.finfo(torch.float32).min
    assert any("FP8_SCALE_SENTINEL" in n for n in res.plan.notes)


def test_moe_per_tensor_experts_tp2_and_ep(mo, tmp_path):
    src = mo("qwen3-moe", "mo-fp8-cfg")
    save(str(src), tmp_path / "tp", tp=2, max_part_size=MAX)
    save(str(src), tmp_path / "ep", tp=2, ep=True, max_part_size=MAX)
    e = "model.layers.1.mlp.experts.routed_experts."
    tp, ep = _rank(tmp_path / "tp", 1), _rank(tmp_path / "ep", 1)
    shapes = {k[len(e) :]: (str(v.dtype), list(v.shape)) for k, v in tp.items() if k.startswith(e)}
    assert shapes == {
        "w13_weight": ("torch.float8_e4m3fn", [8, 32, 64]),
        "w2_weight": ("torch.float8_e4m3fn", [8, 64, 16]),
        "w13_weight_scale": ("torch.float32", [8, 2]),
        "w2_weight_scale": ("torch.float32", [8]),
        "w13_input_scale": ("torch.float32", [8]),
        "w2_input_scale": ("torch.float32", [8]),
    }
    hf = load_file(str(src / "model.safetensors"))
    x = "model.layers.1.mlp.experts.5."
    assert ep[e + "w13_weight_scale"][1].tolist() == [hf[x + "gate_proj.weight_scale"], hf[x + "up_proj.weight_scale"]]
    assert ep[e + "w13_input_scale"][1] == hf[x + "up_proj.input_scale"]
    assert list(ep[e + "w13_weight"].shape) == [4, 64, 64]


def test_per_channel_and_block_layouts(mo, tmp_path):
    save(str(mo("llama", "mo-fp8-pc")), tmp_path / "pc", tp=2, max_part_size=MAX)
    save(str(mo("llama-256", "mo-fp8-pb")), tmp_path / "pb", tp=2, max_part_size=MAX)
    pc, pb = _rank(tmp_path / "pc", 1), _rank(tmp_path / "pb", 1)
    hf = load_file(str(mo("llama", "mo-fp8-pc") / "model.safetensors"))
    assert list(pc[A + "qkv_proj.weight_scale"].shape) == [192]  # q 128 + k 32 + v 32 on a rank
    assert torch.equal(pc[A + "qkv_proj.weight_scale"][128:160], hf[A + "k_proj.weight_scale"][32:])
    assert torch.equal(pc[A + "o_proj.weight_scale"], hf[A + "o_proj.weight_scale"])  # whole in a row layer
    assert "qkv_proj.input_scale" not in {k[len(A) :] for k in pc}
    hb = load_file(str(mo("llama-256", "mo-fp8-pb") / "model.safetensors"))
    # q 256 + k 128 + v 128 rows: 4 row blocks; K 256: 2 column blocks
    assert list(pb[A + "qkv_proj.weight_scale"].shape) == [4, 1, 2, 1]
    assert torch.equal(pb[A + "qkv_proj.weight_scale"][2], hb[A + "k_proj.weight_scale"][1])
    assert torch.equal(pb[A + "o_proj.weight_scale"], hb[A + "o_proj.weight_scale"][:, :, 2:])


def test_block_scales_refuse_a_cut_row_block():
    """A rank's rows of a merged layer's slot must be whole 128-row blocks (vLLM's loader offsets the scale
    rows by ceil(offset / 128): a cut block takes another block's scales)."""
    from reshard.format import TensorInfo
    from reshard.plan.geometry import LinearRank

    class Src:
        def src(self, name, why):
            n = {"m.q_proj": 384, "m.k_proj": 128}[name.rsplit(".", 1)[0]]
            return TensorInfo(name, "F32", (-(-n // 128), 1, 2, 1), "f", 0, 0)

        def mark_used(self, name): ...

        def note(self, text): ...

    q = quant_from_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}})

    def lin(rows):
        return LinearRank("m.qk", ("m.q_proj", "m.k_proj"), (), (384, 128), (0, 0), rows, 256, (0, 256), True, False)

    with pytest.raises(UnsupportedError, match=r"rows \[192, 384\) of m.q_proj on a rank cut a 128-row block"):
        q.linear_scales(Src(), lin(((192, 384, 1), (64, 128, 1))))
    (scale,) = q.linear_scales(Src(), lin(((0, 384, 0), (0, 128, 0))))
    assert scale.shape == (4, 1, 2, 1)
    row = LinearRank("m.q", ("m.q_proj",), (), (384,), (0,), ((0, 384, 0),), 256, (128, 256), False, True)
    with pytest.raises(UnsupportedError, match="per-rank input size 64 is not a multiple of 128") as e:
        q.linear_scales(Src(), replace(row, cols=(64, 128)))
    assert "per-rank input size 64 is not a multiple of 128" in str(e.value)


@pytest.mark.parametrize(
    "arch, scheme, layout, message",
    [
        ("qwen3-moe", "mo-fp8-pc", dict(tp=2), "ModelOpt FP8_PER_CHANNEL_PER_TOKEN experts"),
        ("qwen3-moe", "mo-fp8-pc", dict(tp=2, ep=True), "takes per-tensor scales only"),
    ],
)
def test_refusals(mo, tmp_path, arch, scheme, layout, message):
    with pytest.raises(UnsupportedError, match=message) as e:
        save(str(mo(arch, scheme)), tmp_path / "o", max_part_size=MAX, **layout)
    assert e.value.exit_code == 3


@pytest.mark.parametrize(
    "arch, scheme, layout",
    [
        ("llama", "mo-fp8", dict(tp=2)),
        ("llama", "mo-fp8-cfg", dict(tp=4)),
        ("qwen3-moe", "mo-fp8-cfg", dict(tp=2, ep=True)),
        ("llama", "mo-fp8-pc", dict(tp=4)),
        ("llama-256", "mo-fp8-pb", dict(tp=2, pp=2)),
    ],
)
def test_merge_round_trips_byte_identical(mo, tmp_path, arch, scheme, layout):
    src = mo(arch, scheme)
    save(str(src), tmp_path / "out", max_part_size=MAX, **layout)
    result = merge(tmp_path / "out", tmp_path / "hf", allow_lossy=True)
    # FP8 KV-cache scales come back rounded to the model dtype (reshard.plan.kvscales); everything else exact
    lossy = {n for n in load_dir(src, "model*.safetensors") if n.endswith(("k_proj.k_scale", "v_proj.v_scale"))}
    merged, orig = load_dir(tmp_path / "hf", "model*.safetensors"), load_dir(src, "model*.safetensors")
    # vLLM keeps one input scale per expert (the last of gate/up): gate's is not in the output
    dropped = {n for n in orig if ".experts." in n and n.endswith("gate_proj.input_scale")}
    assert set(result["not_in_output"]) == dropped
    assert set(merged) == set(orig) - dropped
    skip = lossy | dropped
    assert_same({k: v for k, v in merged.items() if k not in skip}, {k: v for k, v in orig.items() if k not in skip})
    assert (tmp_path / "hf" / "hf_quant_config.json").read_bytes() == (src / "hf_quant_config.json").read_bytes()
    report = verify(tmp_path / "out", against=str(src), deep=True)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["compared_bytes"] > 0


@pytest.mark.parametrize(
    "arch, scheme, first, second",
    [
        ("llama", "mo-fp8", dict(tp=4), dict(tp=2, pp=2)),
        ("qwen3-moe", "mo-fp8-cfg", dict(tp=2), dict(tp=2, ep=True)),
        ("llama-256", "mo-fp8-pb", dict(tp=2), dict(tp=4)),
    ],
)
def test_reshard_an_output_equals_resharding_the_original(mo, tmp_path, arch, scheme, first, second):
    src = mo(arch, scheme)
    save(str(src), tmp_path / "first", max_part_size=MAX, **first)
    save(str(tmp_path / "first"), tmp_path / "via", max_part_size=MAX, **second)
    save(str(src), tmp_path / "direct", max_part_size=MAX, **second)
    assert_same(load_dir(tmp_path / "via", "model-*.safetensors"), load_dir(tmp_path / "direct", "model-*.safetensors"))


def test_a_patched_config_json_does_not_gain_hf_quant_configs(mo, tmp_path):
    """config.json is rewritten when the plan patches it (a "tied" model with its own lm_head): the
    quantization config read from hf_quant_config.json stays there, as ModelOpt wrote it."""
    src = mo("llama-tied-lmhead", "mo-fp8")
    res = save(str(src), tmp_path / "o", tp=2, max_part_size=MAX)
    assert res.plan.config_patch == {"tie_word_embeddings": False}
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert written["tie_word_embeddings"] is False and "quantization_config" not in written
    assert (tmp_path / "o" / "hf_quant_config.json").read_bytes() == (src / "hf_quant_config.json").read_bytes()
    save(str(tmp_path / "o"), tmp_path / "again", tp=4, max_part_size=MAX)  # the output re-read the same way
    assert (tmp_path / "again" / "hf_quant_config.json").is_file()
