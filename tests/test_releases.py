"""`reshard plan` on header-only copies of GLM-4.6, MiniMax-M2 and Kimi-K2 at TP 8, with and without
expert parallelism, against what vLLM 0.32's own model code builds (issue 15).

The expected shapes are not reshard's: tests/against_vllm/release_shapes.py built each release's
model from its published config.json (decoder layers cut to a few) on 8 CPU ranks with vLLM and
recorded every rank's state-dict names, dtypes and shapes in tests/fixtures/releases/<release>.json.
Here the cut-down copies must plan to exactly those, and the full-size copies to the per-rank key
counts and bytes they extrapolate to: the top tensors once, then each decoder layer as the recorded
layer of its kind (dense below first_k_dense_replace, MoE above, as vLLM's decoder layers choose).
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
from tests.fixtures.releases import CUT_LAYERS, RELEASES, assert_rank_matches, cut, vllm_shapes, write_header_only

# torch's names of the safetensors codes (the packed integer formats' too: issue 26, Kimi-K2-Thinking)
CODES = {**DTYPE_CODES, "I32": "int32", "I64": "int64", "I8": "int8", "U8": "uint8"}
NAMES = {v: k for k, v in CODES.items()}
LAYOUTS = {"tp8": False, "tp8-ep": True}
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """release -> (cut-down copy, full-size copy), written once (headers only: a few MB each)."""
    root = tmp_path_factory.mktemp("releases")
    cache: dict[tuple[str, bool], object] = {}

    def get(release: str, full: bool):
        if (release, full) not in cache:
            config = RELEASES[release] if full else cut(RELEASES[release], CUT_LAYERS[release])
            cache[release, full] = write_header_only(root / f"{release}-{'full' if full else 'cut'}", config)
        return cache[release, full]

    return get


def planned(plan, tp_rank: int) -> dict[str, list]:
    return {t.name: [CODES[t.dtype], list(t.shape)] for f in plan.files if f.tp_rank == tp_rank for t in f.tensors}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("release", RELEASES)
def test_cut_release_plans_as_vllm_builds(copies, release, layout):
    expected = vllm_shapes(release)
    assert expected["num_hidden_layers"] == CUT_LAYERS[release] and expected["tp"] == 8
    want = expected["layouts"][layout]
    plan = build_plan(open_source(str(copies(release, False))).checkpoint, Layout(tp=8, ep=LAYOUTS[layout]))
    for r in range(8):
        got, exp = planned(plan, r), want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)


def extrapolate(release: str, layout: str) -> list[tuple[int, int]]:
    """Per rank (keys, bytes) of the full release, from vLLM's cut-down state: top tensors once, then
    each of the release's decoder layers as the recorded layer of the same kind."""
    config, expected = RELEASES[release], vllm_shapes(release)["layouts"][layout]
    dense_below = config.get("first_k_dense_replace", 0)
    out = []
    for r in range(8):
        top, per_layer = [0, 0], defaultdict(lambda: [0, 0])
        for name, (dtype, shape) in expected["states"][expected["rank_state"][r]].items():
            size = math.prod(shape) * ITEMSIZE[NAMES[dtype]]
            m = LAYER.match(name)
            acc = per_layer[int(m.group(1))] if m else top
            acc[0] += 1
            acc[1] += size
        kinds: dict[bool, set] = defaultdict(set)
        for layer, acc in per_layer.items():
            kinds[layer >= dense_below].add(tuple(acc))
        assert all(len(v) == 1 for v in kinds.values()), f"layers of one kind differ: {dict(kinds)}"
        moe, dense = next(iter(kinds[True])), next(iter(kinds.get(False, {(0, 0)})))
        n = config["num_hidden_layers"]
        out.append(
            (
                top[0] + dense_below * dense[0] + (n - dense_below) * moe[0],
                top[1] + dense_below * dense[1] + (n - dense_below) * moe[1],
            )
        )
    return out


# the serve lines: vLLM's flags for the layout; GLM-4.6's TP shard of 1536 / 8 = 192 is not a
# multiple of 128 (Blackwell's default bf16 MoE backend rounds it up), so Triton is pinned; both
# FP8 releases keep 128x128 blocks (TP: 192 refined to 64x64 by vLLM 0.32 itself, on every backend
# reshard writes for); config.json auto_map: vLLM loads both natively, so MiniMax-M2's is dropped;
# Kimi-K2's tokenizer runs its own code (tokenization_kimi.py): planned with --trust-remote-code.
SERVE = {
    ("glm-4.6", "tp8"): "--tensor-parallel-size 8 --dtype bfloat16 --moe-backend triton",
    ("glm-4.6", "tp8-ep"): "--tensor-parallel-size 8 --enable-expert-parallel --dtype bfloat16",
    ("minimax-m2", "tp8-ep"): "--tensor-parallel-size 8 --enable-expert-parallel --dtype bfloat16",
    ("kimi-k2", "tp8-ep"): "--tensor-parallel-size 8 --enable-expert-parallel --dtype bfloat16 --trust-remote-code",
    # issue 26: Kimi-K2-Thinking's INT4 experts (I_p 2048 / 8 = 256, whole groups of 32) have one layout on
    # every backend: nothing pinned
    ("kimi-k2-thinking", "tp8"): "--tensor-parallel-size 8 --dtype bfloat16 --trust-remote-code",
    ("kimi-k2-thinking", "tp8-ep"): "--tensor-parallel-size 8 --enable-expert-parallel --dtype bfloat16 "
    "--trust-remote-code",
}


@pytest.mark.parametrize("release, layout", list(SERVE))
def test_full_release_plan_per_rank_bytes_and_serve_line(copies, release, layout):
    folder = copies(release, True)
    args = ["plan", str(folder), "--tp", "8", "--json", *(["--ep"] if LAYOUTS[layout] else [])]
    args += ["--trust-remote-code"] if release.startswith("kimi-k2") else []
    code, out, err = run(*args)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["serve"] == f"vllm serve OUT_DIR --load-format sharded_state {SERVE[release, layout]}"
    got = [(r["keys"], r["bytes"]) for r in sorted(summary["ranks"], key=lambda r: r["tp_rank"])]
    assert got == extrapolate(release, layout)
    assert summary["total_bytes"] == sum(b for _, b in got)
