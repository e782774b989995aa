"""`reshard plan` on a header-only copy of RedHatAI/Qwen3-30B-A3B-NVFP4 (compressed-tensors nvfp4-pack-quantized,
W4A4, router and lm_head ignored) at TP 8 and TP 8 + EP, against what vLLM 0.32's own model code builds (issue 26).

The expected names, dtypes and shapes are vLLM's: tests/against_vllm/release_shapes.py built the release from its
config (decoder layers cut to 2) on 8 CPU ranks, with only the NVFP4 kernel/backend selection replaced
(vllm_patches.allow_nvfp4), and recorded them in tests/fixtures/fp4_releases/qwen3-30b-a3b-nvfp4.json. At TP 8
the 4 KV heads are replicated (two ranks each) and each rank holds 96 of every expert's 768 intermediate rows
(6 whole NVFP4 groups); under EP, 16 whole experts.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest

from reshard.format import ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.fp4_releases import CUT_LAYERS, RELEASES, cut, vllm_shapes, write_header_only
from tests.fixtures.releases import assert_rank_matches
from tests.test_fp4_releases import LAYOUTS, TORCH_NAMES, planned

RELEASE = "qwen3-30b-a3b-nvfp4"


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp4-qwen-release")
    config = RELEASES[RELEASE]
    return {
        full: write_header_only(root / ("full" if full else "cut"), RELEASE, config if full else cut(config, 2))
        for full in (False, True)
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cut_release_plans_as_vllm_builds(copies, layout):
    expected = vllm_shapes(RELEASE)
    assert expected["num_hidden_layers"] == CUT_LAYERS[RELEASE] and expected["tp"] == 8
    want = expected["layouts"][layout]
    plan = build_plan(open_source(str(copies[False])).checkpoint, Layout(tp=8, ep=LAYOUTS[layout]))
    for r in range(8):
        got, exp = planned(plan, r), want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)
    ep = LAYOUTS[layout]
    rank0 = want["states"][want["rank_state"][0]]
    e = "model.layers.1.mlp.experts.routed_experts."
    assert rank0[e + "w13_weight_packed"] == ["uint8", [16 if ep else 128, 1536 if ep else 192, 1024]]
    assert rank0[e + "w2_weight_scale"] == ["float8_e4m3fn", [16 if ep else 128, 2048, 48 if ep else 6]]
    assert rank0[e + "w13_input_global_scale"] == ["float32", [16 if ep else 128, 2]]  # the rank's own experts
    assert rank0["model.layers.1.mlp.experts.gate.weight"] == ["bfloat16", [128, 2048]]  # the ignored router
    # q (4096 / 8) + k + v (4 KV heads of 128 on 8 ranks: one replicated head each), global scales per slot
    assert rank0["model.layers.1.self_attn.qkv_proj.weight_packed"] == ["uint8", [768, 1024]]
    assert rank0["model.layers.1.self_attn.qkv_proj.weight_global_scale"] == ["float32", [3]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_release_serve_line(copies, layout):
    args = ["plan", str(copies[True]), "--tp", "8", "--json", *(["--ep"] if LAYOUTS[layout] else [])]
    code, out, err = run(*args)
    assert code == 0, err
    summary = json.loads(out)
    flags = "--tensor-parallel-size 8" + (" --enable-expert-parallel" if LAYOUTS[layout] else "")
    assert summary["serve"] == f"vllm serve OUT_DIR --load-format sharded_state {flags} --dtype bfloat16"
    assert summary["quantization"]["format"] == "nvfp4-pack-quantized"
    assert summary["total_bytes"] == sum(r["bytes"] for r in summary["ranks"])


LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def extrapolate(layout: str) -> list[tuple[int, int]]:
    """Per rank (keys, bytes) of the full release from vLLM's cut-down state: the top tensors once, then each of
    the 48 decoder layers (all alike: attention + MoE) as the recorded ones."""
    n, expected = RELEASES[RELEASE]["num_hidden_layers"], vllm_shapes(RELEASE)["layouts"][layout]
    codes = {v: k for k, v in TORCH_NAMES.items()}
    out = []
    for r in range(8):
        top, per_layer = [0, 0], defaultdict(lambda: [0, 0])
        for name, (dtype, shape) in expected["states"][expected["rank_state"][r]].items():
            m = LAYER.match(name)
            acc = per_layer[int(m.group(1))] if m else top
            acc[0] += 1
            acc[1] += math.prod(shape) * ITEMSIZE[codes[dtype]]
        kinds = {tuple(acc) for acc in per_layer.values()}
        assert len(kinds) == 1 and len(per_layer) == CUT_LAYERS[RELEASE], f"layers differ: {dict(per_layer)}"
        keys, size = next(iter(kinds))
        out.append((top[0] + n * keys, top[1] + n * size))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_release_per_rank_bytes(copies, layout):
    """The full-size copy plans to the per-rank key counts and bytes vLLM's cut-down state extrapolates to
    (U8 weights and F8 scales counted at one byte an element)."""
    args = ["plan", str(copies[True]), "--tp", "8", "--json", *(["--ep"] if LAYOUTS[layout] else [])]
    code, out, err = run(*args)
    assert code == 0, err
    ranks = sorted(json.loads(out)["ranks"], key=lambda r: r["tp_rank"])
    assert [(r["keys"], r["bytes"]) for r in ranks] == extrapolate(layout)
