"""gpt-oss (bf16 and the released MXFP4 experts): plans from tiny checkpoints and the 120b release's headers.

Byte-for-byte agreement with vLLM itself is `tests/against_vllm/test_vllm.py` (gpt-oss cases); here
the layout is checked against vLLM 0.32's gpt-oss loaders read as formulas (`_load_weights_other`,
`_load_weights_mxfp4`), the streamed files against an independent torch reading of the plan, and the
120b release's TP 8 plan against names, dtypes and shapes dumped from vLLM's own model build
(tests/fixtures/releases/gpt-oss-120b.vllm-tp8*.json, see there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from reshard.errors import UnsupportedError
from reshard.layout import Layout
from reshard.plan import DEFAULT_MAX_PART, build_plan
from reshard.sources import open_source
from tests.fixtures.oss_release import RELEASES, write_release
from tests.fixtures.quant import convert
from tests.fixtures.reference import assert_streamed_files_equal_plan, load_source
from tests.fixtures.saving import save

EXPERTS = "model.layers.{L}.mlp.experts.routed_experts."


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory):
    bf16 = tiny("gpt-oss")
    mx = convert(bf16, tmp_path_factory.mktemp("oss") / "mxfp4", "mxfp4")
    return {"bf16": bf16, "mxfp4": mx}


def rank_file(out: Path, r: int) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(out.glob(f"model-rank-{r}-part-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return got


@pytest.mark.parametrize(
    "fmt, tp, ep, backend",
    [
        ("bf16", 2, False, "auto"),
        ("bf16", 4, True, "auto"),
        ("mxfp4", 4, False, "auto"),
        ("mxfp4", 2, False, "marlin"),
        ("mxfp4", 2, True, "auto"),
    ],
)
def test_streamed_files_equal_plan(sources, tmp_path, fmt, tp, ep, backend):
    assert_streamed_files_equal_plan(sources[fmt], tmp_path / "out", tp=tp, ep=ep, moe_backend=backend)


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_layout_as_vllm_loads_it(sources, tmp_path, tp):
    """_load_weights_other: w13 = gate_up_proj[:, :, 2s:2e] transposed (gate/up rows stay interleaved),
    w2 = down_proj[:, s:e, :] transposed, down bias on TP rank 0 only, sinks by heads."""
    src = sources["bf16"]
    save(str(src), tmp_path / "out", tp=tp, max_part_size=DEFAULT_MAX_PART)
    hf = load_source(src, open_source(str(src)).checkpoint)
    inter, heads = 192, 8
    ip = inter // tp
    for r in range(tp):
        got = rank_file(tmp_path / "out", r)
        e = EXPERTS.format(L=1)
        gu, dn = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.down_proj"]
        assert torch.equal(got[e + "w13_weight"], gu[:, :, 2 * r * ip : 2 * (r + 1) * ip].permute(0, 2, 1))
        assert torch.equal(got[e + "w2_weight"], dn[:, r * ip : (r + 1) * ip, :].permute(0, 2, 1))
        gb = hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
        assert torch.equal(got[e + "w13_bias"], gb[:, 2 * r * ip : 2 * (r + 1) * ip])
        db = hf["model.layers.1.mlp.experts.down_proj_bias"]
        assert torch.equal(got[e + "w2_bias"], db if r == 0 else torch.zeros_like(db))
        n = heads // tp
        assert torch.equal(got["model.layers.0.attn.sinks"], hf["model.layers.0.self_attn.sinks"][r * n : (r + 1) * n])
        assert torch.equal(got["model.layers.0.mlp.router.bias"], hf["model.layers.0.mlp.router.bias"])
        assert got["model.embedding.weight"].shape == (1024 // tp, 64)


def test_mxfp4_layout_as_vllm_loads_it(sources, tmp_path):
    """_load_weights_mxfp4 at TP 4: stride cdiv(6 blocks, 4) * 32 = 64 rows of the intermediate 192 per
    rank, into Triton's allocation round_up(48, 64) = 64: ranks 0-2 full, rank 3 only zeros."""
    src = sources["mxfp4"]
    result = save(str(src), tmp_path / "out", tp=4, max_part_size=DEFAULT_MAX_PART)
    assert result.plan.layout.moe_pin == "triton" and "--moe-backend triton" in result.plan.serve_command("OUT")
    hf = load_source(src, open_source(str(src)).checkpoint)
    e = EXPERTS.format(L=0)
    blocks = hf["model.layers.0.mlp.experts.gate_up_proj_blocks"].reshape(4, 384, 32)
    scales = hf["model.layers.0.mlp.experts.down_proj_scales"]
    for r in range(4):
        got = rank_file(tmp_path / "out", r)
        assert got[e + "w13_weight"].shape == (4, 128, 32) and got[e + "w13_weight"].dtype == torch.uint8
        assert got[e + "w2_weight_scale"].shape == (4, 64, 2)
        assert got[e + "w13_bias"].dtype == torch.bfloat16
        if r < 3:
            assert torch.equal(got[e + "w13_weight"], blocks[:, 128 * r : 128 * (r + 1)])
            assert torch.equal(got[e + "w2_weight_scale"], scales[:, :, 2 * r : 2 * (r + 1)])
        else:
            assert not got[e + "w13_weight"].any() and not got[e + "w2_weight_scale"].any()
            assert not got[e + "w13_bias"].any() and not got[e + "w2_bias"].any()


def test_mxfp4_backend_allocations(sources):
    """oracle/mxfp4.py: Triton rounds the per-rank intermediate to 64, Marlin to 128 and hidden to 256;
    backends whose layout reshard does not write are refused."""
    ckpt = open_source(str(sources["mxfp4"])).checkpoint

    def shapes(**kw):
        plan = build_plan(ckpt, Layout(tp=2, **kw))
        return {t.name: t.shape for f in plan.files if f.tp_rank == 1 for t in f.tensors}

    e = EXPERTS.format(L=0)
    tri = shapes(moe_backend="triton")
    assert tri[e + "w13_weight"] == (4, 256, 32) and tri[e + "w2_weight"] == (4, 64, 64)
    mar = shapes(moe_backend="marlin")
    assert mar[e + "w13_weight"] == (4, 256, 128) and mar[e + "w2_weight"] == (4, 256, 64)
    assert mar[e + "w2_bias"] == (4, 256) and mar[e + "w13_weight_scale"] == (4, 256, 8)
    with pytest.raises(UnsupportedError, match="aiter"):
        build_plan(ckpt, Layout(tp=2, moe_backend="aiter"))


def test_refusals(sources, tmp_path):
    ckpt = open_source(str(sources["bf16"])).checkpoint
    with pytest.raises(UnsupportedError, match="fails to build"):
        build_plan(ckpt, Layout(tp=8))  # 4 KV heads: vLLM's gpt-oss cannot split them 8 ways
    head_dim = ckpt.config["head_dim"]
    ckpt.config.update(num_key_value_heads=2, head_dim=2 * head_dim)  # k's rows read as 2 heads twice as wide
    with pytest.raises(UnsupportedError, match="num_key_value_heads=2"):
        build_plan(ckpt, Layout(tp=4))
    three = _with_experts(sources["bf16"], 3, tmp_path / "three")
    with pytest.raises(UnsupportedError, match=r"do not divide|divide by"):
        build_plan(open_source(str(three)).checkpoint, Layout(tp=2, ep=True))


def _with_experts(src: Path, n: int, out: Path) -> Path:
    """A copy of the tiny gpt-oss with its first n experts (router rows, fused experts) and config to match."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_local_experts": n}))
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: v[:n].contiguous() if ".mlp." in k else v for k, v in tensors.items()}, out / f.name)
    return out


def test_merge_of_transposed_bf16_output_refused(sources, tmp_path):
    from reshard.sources.output import OutputSource

    save(str(sources["bf16"]), tmp_path / "out", tp=2, max_part_size=DEFAULT_MAX_PART)
    with pytest.raises(UnsupportedError, match="transposed"):
        OutputSource(tmp_path / "out")


# ---- the real gpt-oss-120b, from its headers ----------------------------------------------------


@pytest.mark.parametrize("ep", [False, True])
def test_gpt_oss_120b_tp8_matches_vllm_build(tmp_path, ep):
    """Every rank's names, dtypes and shapes against vLLM 0.32's own model built from the release's
    config (tests/against_vllm/vllm_state.py shapes_only, 2 layers; layers repeat), and the serve line."""
    src = write_release("gpt-oss-120b", tmp_path / "src")
    plan = build_plan(open_source(str(src)).checkpoint, Layout(tp=8, ep=ep))
    expected = json.loads((RELEASES / f"gpt-oss-120b.vllm-tp8{'-ep' if ep else ''}.json").read_text())
    layers = 36
    for r in range(8):
        want = {}
        for name, (dtype, shape) in expected[str(r)].items():
            if ".layers.0." in name:
                for layer in range(layers):
                    want[name.replace(".layers.0.", f".layers.{layer}.")] = (dtype, tuple(shape))
            elif ".layers.1." not in name:
                want[name] = (dtype, tuple(shape))
        have = {t.name: (_torch_name(t.dtype), t.shape) for f in plan.files if f.tp_rank == r for t in f.tensors}
        assert have == want, r
        size = {"bfloat16": 2, "float32": 4, "uint8": 1}
        nbytes = sum(math.prod(shape) * size[dtype] for dtype, shape in want.values())
        assert plan.summary()["ranks"][r]["bytes"] == nbytes
    serve = plan.serve_command("OUT")
    assert "--tensor-parallel-size 8" in serve and "--moe-backend triton" in serve
    assert ("--enable-expert-parallel" in serve) == ep


def _torch_name(code: str) -> str:
    return {"BF16": "bfloat16", "F32": "float32", "U8": "uint8", "F16": "float16"}[code]


def test_mxfp4_merge_round_trip(sources, tmp_path):
    """Padded MXFP4 ranks (TP 4: rank 3 all padding) read back to the original bytes."""
    from reshard.merge import merge

    src = sources["mxfp4"]
    save(str(src), tmp_path / "out", tp=4, max_part_size=DEFAULT_MAX_PART)
    merge(tmp_path / "out", tmp_path / "hf")
    want = load_source(src, open_source(str(src)).checkpoint)
    got = load_source(tmp_path / "hf", open_source(str(tmp_path / "hf")).checkpoint)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
