"""`reshard plan` on a header-only copy of Qwen/Qwen3-30B-A3B-GPTQ-Int4 at TP 8 and TP 8 + EP, against what
vLLM 0.32's own model code builds from its config (tests/against_vllm/gptq_release_shapes.py recorded
the per-rank names, dtypes and shapes, decoder layers cut to 2, into tests/fixtures/releases).

TP 8 + EP: the experts keep their 768 intermediate rows per rank, vLLM builds Marlin's K-first layout.
TP 8: 768 / 8 = 96 rows per rank is not a multiple of the group 128, so vLLM builds MoeWNA16Method's
uint8 N-first experts. Both plans must equal vLLM's.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.gptq_releases import CUT_LAYERS, RELEASES, cut, vllm_shapes, write_header_only
from tests.fixtures.releases import assert_rank_matches

RELEASE = "qwen3-30b-a3b-gptq-int4"
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TORCH = {**DTYPE_CODES, "I32": "int32", "U8": "uint8"}  # safetensors code -> torch's name
CODE = {v: k for k, v in TORCH.items()}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq-release")
    cache: dict[bool, object] = {}

    def get(full: bool):
        if full not in cache:
            config = RELEASES[RELEASE] if full else cut(RELEASES[RELEASE], CUT_LAYERS[RELEASE])
            cache[full] = write_header_only(root / ("full" if full else "cut"), config)
        return cache[full]

    return get


def _planned(plan, r: int) -> dict[str, list]:
    return {t.name: [TORCH[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == r for t in f.tensors}


@pytest.mark.parametrize("layout", ["tp8", "tp8-ep"])
def test_cut_release_plans_as_vllm_builds(copies, layout):
    expected = vllm_shapes(RELEASE)
    assert expected["num_hidden_layers"] == CUT_LAYERS[RELEASE] and expected["tp"] == 8
    want = expected["layouts"][layout]
    plan = build_plan(open_source(str(copies(False))).checkpoint, Layout(tp=8, ep=layout == "tp8-ep"))
    for r in range(8):
        got, exp = _planned(plan, r), want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)


def test_tp8_without_ep_is_vllms_moe_wna16_layout(copies):
    state = vllm_shapes(RELEASE)["layouts"]["tp8"]["states"][0]
    e = "model.layers.0.mlp.experts.routed_experts."
    # what vLLM builds: uint8, N-first, scales at group 32 (128 halved until it divides 96)
    assert state[e + "w13_qweight"] == ["uint8", [128, 192, 1024]]
    assert state[e + "w13_scales"] == ["float16", [128, 192, 64]]
    assert state[e + "w2_qweight"] == ["uint8", [128, 2048, 48]]
    plan = build_plan(open_source(str(copies(False))).checkpoint, Layout(tp=8))
    assert any("MoeWNA16Method" in n and "96 is not a multiple of the group 128" in n for n in plan.notes)


def test_full_release_plan_with_ep_bytes_and_serve_line(copies):
    """Per-rank keys and bytes of the 48-layer release: the top tensors once and every layer as the
    recorded one (all 48 are MoE layers)."""
    code, out, err = run("plan", str(copies(True)), "--tp", "8", "--ep", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["serve"] == (
        "vllm serve OUT_DIR --load-format sharded_state --tensor-parallel-size 8 --enable-expert-parallel "
        "--dtype float16"
    )
    want = vllm_shapes(RELEASE)["layouts"]["tp8-ep"]
    layers = RELEASES[RELEASE]["num_hidden_layers"]
    for rank in summary["ranks"]:
        top, layer = [0, 0], [0, 0]
        for name, (dtype, shape) in want["states"][want["rank_state"][rank["tp_rank"]]].items():
            m = LAYER.match(name)
            if m and m.group(1) != "0":
                continue
            acc = layer if m else top
            acc[0] += 1
            acc[1] += math.prod(shape) * ITEMSIZE[CODE[dtype]]
        assert (rank["keys"], rank["bytes"]) == (top[0] + layers * layer[0], top[1] + layers * layer[1])
