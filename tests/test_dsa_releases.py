"""`reshard plan` on header-only copies of DeepSeek-V3.2 (block FP8) and GLM-5 at TP 8, with and without
expert parallelism, against what vLLM 0.32's own model code builds (issue 27; tests/fixtures/dsa_releases.py).

vLLM here is the CPU build, whose DSA class is the generic deepseek_v2 one: `--platform cpu` plans are
compared as they are, the default CUDA-named plans through the documented renaming
(tests/against_vllm/dsa_names.py). The full-size copies plan to the per-rank key counts and bytes the
recorded cut-down state extrapolates to (top tensors once, dense layers below first_k_dense_replace, MoE
layers above), as tests/test_releases.py does.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest

from reshard.format import DTYPE_CODES, DTYPE_NAMES, ITEMSIZE
from reshard.layout import Layout
from reshard.plan import build_plan
from reshard.sources import open_source
from tests.against_vllm.dsa_names import cuda_to_cpu
from tests.fixtures.cli import run
from tests.fixtures.dsa_releases import CUT_LAYERS, HERE, RELEASES, cut
from tests.fixtures.releases import assert_rank_matches, write_header_only

LAYOUTS = {"tp8": False, "tp8-ep": True}
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def recorded(release: str) -> dict:
    path = HERE / f"{release}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not recorded yet: run tests/against_vllm/release_shapes.py {release}")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa-releases")
    cache: dict = {}

    def get(release: str, full: bool):
        if (release, full) not in cache:
            config = RELEASES[release] if full else cut(RELEASES[release], CUT_LAYERS[release])
            cache[release, full] = write_header_only(root / f"{release}-{'full' if full else 'cut'}", config)
        return cache[release, full]

    return get


def planned(plan, tp_rank: int, rename=lambda n: n) -> dict[str, list]:
    return {
        rename(t.name): [DTYPE_CODES[t.dtype], list(t.shape)]
        for f in plan.files
        if f.tp_rank == tp_rank
        for t in f.tensors
    }


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("release", RELEASES)
def test_cut_release_plans_as_vllm_builds(copies, release, layout, platform):
    expected = recorded(release)
    assert expected["num_hidden_layers"] == CUT_LAYERS[release] and expected["tp"] == 8
    want = expected["layouts"][layout]
    ckpt = open_source(str(copies(release, False))).checkpoint
    plan = build_plan(ckpt, Layout(tp=8, ep=LAYOUTS[layout], platform=platform))
    rename = cuda_to_cpu if platform == "cuda" else (lambda n: n)
    for r in range(8):
        got, exp = planned(plan, r, rename), want["states"][want["rank_state"][r]]
        assert_rank_matches(r, got, exp)


def extrapolate(release: str, layout: str) -> list[tuple[int, int]]:
    config, expected = RELEASES[release], recorded(release)["layouts"][layout]
    dense_below = config["first_k_dense_replace"]
    out = []
    for r in range(8):
        top, per_layer = [0, 0], defaultdict(lambda: [0, 0])
        for name, (dtype, shape) in expected["states"][expected["rank_state"][r]].items():
            m = LAYER.match(name)
            acc = per_layer[int(m.group(1))] if m else top
            acc[0] += 1
            acc[1] += math.prod(shape) * ITEMSIZE[DTYPE_NAMES[dtype]]
        kinds: dict[bool, set] = defaultdict(set)
        for layer, acc in per_layer.items():
            kinds[layer >= dense_below].add(tuple(acc))
        assert all(len(v) == 1 for v in kinds.values()), f"layers of one kind differ: {dict(kinds)}"
        moe, dense = next(iter(kinds[True])), next(iter(kinds[False]))
        n = config["num_hidden_layers"]
        keys = top[0] + dense_below * dense[0] + (n - dense_below) * moe[0]
        out.append((keys, top[1] + dense_below * dense[1] + (n - dense_below) * moe[1]))
    return out


SERVE = {
    "tp8": "--tensor-parallel-size 8 --dtype bfloat16",
    "tp8-ep": "--tensor-parallel-size 8 --enable-expert-parallel --dtype bfloat16",
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("release", RELEASES)
def test_full_release_plan_per_rank_bytes_and_serve_line(copies, release, layout):
    extra = ["--ep"] if LAYOUTS[layout] else []
    code, out, err = run("plan", str(copies(release, True)), "--tp", "8", "--json", *extra)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["serve"] == f"vllm serve OUT_DIR --load-format sharded_state {SERVE[layout]}"
    assert summary["platform"] == "cuda"
    got = [(r["keys"], r["bytes"]) for r in sorted(summary["ranks"], key=lambda r: r["tp_rank"])]
    assert got == extrapolate(release, layout)
