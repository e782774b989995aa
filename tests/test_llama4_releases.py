"""`reshard plan` on a header-only copy of Llama-4-Maverick at TP 8 and TP 8 + EP (issue 27): text-only (its
default, --language-model-only) and with its vision tower in both --mm-encoder-tp-mode values, against what
vLLM 0.32's own model code builds from the published config.json.

The expected names, dtypes and shapes are not reshard's: tests/against_vllm/release_shapes.py built the
release (text model cut to 2 layers, tower whole) on 8 CPU ranks with vLLM in each layout of
tests/fixtures/llama4_releases.LAYOUTS and recorded every rank's state dict in
tests/fixtures/releases/llama-4-maverick.json.
"""

from __future__ import annotations

import math

import pytest

from reshard.format import DTYPE_CODES, ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.fixtures.llama4_releases import CUT_LAYERS, LAYOUTS, RELEASES, cut, write_header_only
from tests.fixtures.releases import assert_rank_matches, vllm_shapes

CASES = [(r, lay) for r, lays in LAYOUTS.items() for lay in lays]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One header-only copy per release, shared by its layouts."""
    root = tmp_path_factory.mktemp("llama4-releases")
    return {r: write_header_only(root / r, cut(c, CUT_LAYERS[r])) for r, c in RELEASES.items()}


def _layout(keys: dict) -> Layout:
    """The layout reshard is asked for: text-only layouts without an encoder flag (Llama-4's default)."""
    return Layout(tp=8, ep=keys["ep"], mm_encoder_tp_mode=keys.get("mm_encoder_tp_mode"))


@pytest.mark.parametrize(("release", "layout"), CASES)
def test_release_plans_as_vllm_builds(copies, release, layout):
    expected = vllm_shapes(release)
    assert expected["num_hidden_layers"] == CUT_LAYERS[release] and expected["tp"] == 8
    assert set(expected["layouts"]) == set(LAYOUTS[release])
    want, keys = expected["layouts"][layout], LAYOUTS[release][layout]
    plan = build_plan(open_source(str(copies[release])).checkpoint, _layout(keys))
    line = plan.serve_command("OUT")
    mode = keys.get("mm_encoder_tp_mode")
    assert (f"--mm-encoder-tp-mode {mode}" if mode else "--language-model-only") in line
    assert ("--enable-expert-parallel" in line) == keys["ep"]
    assert plan.layout.language_model_only == keys.get("language_model_only", False)
    names = {v: k for k, v in DTYPE_CODES.items()}
    for r in range(8):
        got = {t.name: [DTYPE_CODES[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == r for t in f.tensors}
        exp = want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)
        nbytes = sum(math.prod(s) * ITEMSIZE[names[d]] for d, s in exp.values())
        assert plan.summary()["ranks"][r]["bytes"] == nbytes
