"""`reshard plan` on a header-only copy of nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4, config in
hf_quant_config.json) at TP 8 and TP 8 + EP, against what vLLM 0.32's own model code builds (issue 26).

The expected names, dtypes and shapes are vLLM's: tests/against_vllm/release_shapes.py built the release
from its config (decoder layers cut to 4: three dense, one MoE) on 8 CPU ranks, with only the NVFP4
kernel/backend selection replaced and `--moe-backend flashinfer_trtllm` (what reshard's auto writes under
EP: every expert's input scales on each rank), and recorded them in tests/fixtures/fp4_releases/.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.fixtures.cli import run
from tests.fixtures.fp4_releases import CUT_LAYERS, RELEASES, cut, vllm_shapes, write_header_only
from tests.fixtures.releases import assert_rank_matches

LAYOUTS = {"tp8": False, "tp8-ep": True}
TORCH_NAMES = {**DTYPE_CODES, "U8": "uint8"}  # torch's names of the planned dtypes


def planned(plan, tp_rank: int) -> dict[str, list]:
    return {
        t.name: [TORCH_NAMES[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == tp_rank for t in f.tensors
    }


RELEASE = "deepseek-r1-fp4"


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp4-releases")
    return {
        full: write_header_only(
            root / ("full" if full else "cut"), RELEASE, RELEASES[RELEASE] if full else cut(RELEASES[RELEASE], 4)
        )
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
    e = "model.layers.3.mlp.experts.routed_experts."
    rank0 = want["states"][want["rank_state"][0]]
    assert rank0[e + "w13_weight"] == [
        "uint8",
        [32 if LAYOUTS[layout] else 256, 4096 if LAYOUTS[layout] else 512, 3584],
    ]
    assert rank0[e + "w13_input_scale"] == ["float32", [256, 2]]  # EP: every expert's (FlashInfer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_release_serve_line(copies, layout):
    args = ["plan", str(copies[True]), "--tp", "8", "--json", *(["--ep"] if LAYOUTS[layout] else [])]
    code, out, err = run(*args)
    assert code == 0, err
    summary = json.loads(out)
    pin = " --moe-backend flashinfer_trtllm" if LAYOUTS[layout] else ""
    flags = "--tensor-parallel-size 8" + (" --enable-expert-parallel" if LAYOUTS[layout] else "")
    assert summary["serve"] == f"vllm serve OUT_DIR --load-format sharded_state {flags} --dtype bfloat16{pin}"
    assert summary["total_bytes"] == sum(r["bytes"] for r in summary["ranks"])


LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def extrapolate(layout: str) -> list[tuple[int, int]]:
    """Per rank (keys, bytes) of the full release from vLLM's cut-down state (tests/test_releases.py's
    rule): the top tensors once, then each of the 61 decoder layers as the recorded layer of its kind."""
    config, expected = RELEASES[RELEASE], vllm_shapes(RELEASE)["layouts"][layout]
    codes = {v: k for k, v in TORCH_NAMES.items()}
    dense_below, n = config["first_k_dense_replace"], config["num_hidden_layers"]
    out = []
    for r in range(8):
        top, per_layer = [0, 0], defaultdict(lambda: [0, 0])
        for name, (dtype, shape) in expected["states"][expected["rank_state"][r]].items():
            m = LAYER.match(name)
            acc = per_layer[int(m.group(1))] if m else top
            acc[0] += 1
            acc[1] += math.prod(shape) * ITEMSIZE[codes[dtype]]
        kinds: dict[bool, set] = defaultdict(set)
        for layer, acc in per_layer.items():
            kinds[layer >= dense_below].add(tuple(acc))
        assert all(len(v) == 1 for v in kinds.values()), f"layers of one kind differ: {dict(kinds)}"
        moe, dense = next(iter(kinds[True])), next(iter(kinds[False]))
        out.append(
            (
                top[0] + dense_below * dense[0] + (n - dense_below) * moe[0],
                top[1] + dense_below * dense[1] + (n - dense_below) * moe[1],
            )
        )
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
