#!/usr/bin/env python
"""Record what vLLM 0.32 builds for openai/gpt-oss-120b at TP 8 (and TP 8 + EP), from its config alone.

    PYTHONPATH=. /work/tools/vllm-slot .venv-vllm/bin/python tests/against_vllm/oss_release_shapes.py

Builds the model on 8 gloo CPU ranks from the release's config.json (tests/fixtures/releases/) cut to
one decoder layer (every gpt-oss layer has the same parameters; sliding-window attention adds none),
with Triton's MXFP4 allocation forced (the backend reshard pins; this CPU has no MXFP4 kernel), and
writes each rank's `_filter_subtensors(model.state_dict())` names, dtypes and shapes to
tests/fixtures/releases/gpt-oss-120b.vllm-tp8[-ep].json, which tests/test_gptoss.py checks reshard's
plan of the full 36-layer release against. Nothing is loaded (vllm_state `shapes_only`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.against_vllm import vllm_state  # noqa: E402

RELEASES = ROOT / "tests" / "fixtures" / "releases"


def main() -> int:
    config = json.loads((RELEASES / "gpt-oss-120b.config.json").read_text())
    config["num_hidden_layers"] = 1
    config["layer_types"] = config["layer_types"][:1]
    with tempfile.TemporaryDirectory() as tmp:
        src, dumps = Path(tmp) / "src", Path(tmp) / "dumps"
        src.mkdir()
        (src / "config.json").write_text(json.dumps(config))
        cases = [
            dict(
                dump_dir=str(dumps / f"ep{int(ep)}"),
                tp=8,
                ep=ep,
                dtype="bfloat16",
                moe_backend="triton",
                shapes_only=True,
            )
            for ep in (False, True)
        ]
        vllm_state.dump_expected_many(src, cases, timeout=1800)
        for c in cases:
            ranks = {str(r): json.loads((Path(c["dump_dir"]) / f"info-pp0-tp{r}.json").read_text()) for r in range(8)}
            out = RELEASES / f"gpt-oss-120b.vllm-tp8{'-ep' if c['ep'] else ''}.json"
            out.write_text(json.dumps(ranks, indent=0, sort_keys=True) + "\n")
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
