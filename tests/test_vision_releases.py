"""`reshard plan` on header-only copies of Qwen3-VL-235B-A22B and Gemma-3-27B with their vision towers at
TP 8 (issue 27), against what vLLM 0.32's own model code builds from the published config.json.

The expected names, dtypes and shapes are not reshard's: tests/against_vllm/release_shapes.py built each
release (text model cut to a few layers, towers whole) on 8 CPU ranks with vLLM (`--mm-encoder-tp-mode
weights`, its default) and recorded every rank's state dict in tests/fixtures/releases/<release>.json.
"""

from __future__ import annotations

import math

import pytest

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.fixtures.releases import assert_rank_matches, vllm_shapes
from tests.fixtures.vision_releases import CUT_LAYERS, RELEASES, cut, write_header_only

LAYOUTS = {"qwen3-vl-235b-a22b": ("tp8", "tp8-ep"), "gemma-3-27b": ("tp8",)}  # Gemma-3 is dense: no EP


@pytest.mark.parametrize(("release", "layout"), [(r, lay) for r, lays in LAYOUTS.items() for lay in lays])
def test_release_plans_as_vllm_builds(tmp_path, release, layout):
    expected = vllm_shapes(release)
    assert expected["num_hidden_layers"] == CUT_LAYERS[release] and expected["tp"] == 8
    want = expected["layouts"][layout]
    folder = write_header_only(tmp_path / release, cut(RELEASES[release], CUT_LAYERS[release]))
    plan = build_plan(open_source(str(folder)).checkpoint, Layout(tp=8, ep=layout == "tp8-ep"))
    line = plan.serve_command("OUT")
    assert "--mm-encoder-tp-mode weights" in line
    assert ("--no-mm-device-do-normalize" in line) == release.startswith("qwen")  # Qwen-VL: on-device norm
    for r in range(8):
        got = {t.name: [DTYPE_CODES[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == r for t in f.tensors}
        exp = want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)
        names = {v: k for k, v in DTYPE_CODES.items()}
        nbytes = sum(math.prod(s) * ITEMSIZE[names[d]] for d, s in exp.values())
        assert plan.summary()["ranks"][r]["bytes"] == nbytes
