"""`--load-format reshard` on real vLLM ranks for a vision-language folder (issue 27): a Qwen2.5-VL folder
loads into an engine run with the encoder mode it was made for (byte-for-byte as sharded_state loads it),
and is refused, with the explanation and the save line, by an engine run with the other mode or with
--language-model-only. Run under /work/tools/vllm-slot, as the rest of tests/against_vllm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.against_vllm import plugin_load
from tests.against_vllm.test_vllm import needs_reshard
from tests.fixtures.tiny import make_tiny


def _save(src: Path, out: Path, *args: str) -> Path:
    cmd = [sys.executable, "-m", "reshard", "save", str(src), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@needs_reshard
def test_plugin_checks_the_encoder_mode(tmp_path):
    src = make_tiny("qwen2.5-vl", tmp_path / "src")
    weights = _save(src, tmp_path / "weights", "--tp", "2")
    data = _save(src, tmp_path / "data", "--tp", "2", "--mm-encoder-tp-mode", "data")
    cases = {
        "weights": dict(folder=weights, tp=2, compare=True),
        "data": dict(folder=data, tp=2, mm_encoder_tp_mode="data", compare=True),
        "weights-on-data-engine": dict(folder=weights, tp=2, mm_encoder_tp_mode="data"),
        "weights-on-text-engine": dict(folder=weights, tp=2, language_model_only=True),
    }
    results = dict(zip(cases, plugin_load.load_cases(list(cases.values())), strict=True))
    for name in ("weights", "data"):
        for r in results[name]:
            assert r["ok"] and not r["mismatch"] and r["compared"] > 0, f"{name}: {r.get('error')} {r['mismatch']}"
    for r in results["weights-on-data-engine"]:
        assert not r["ok"]
        e = r["error"]
        assert "made for --mm-encoder-tp-mode weights (the vision tower TP-sharded), this engine runs " in e, e
        assert "--mm-encoder-tp-mode data`" in e, e  # the save line for this engine
    for r in results["weights-on-text-engine"]:
        assert not r["ok"]
        assert "this engine runs --language-model-only and would not load it" in r["error"], r["error"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
