"""pytest wiring for the real-vLLM suite (``make test-vllm``): markers and a timing summary."""

from __future__ import annotations

import pytest

MARKERS = {
    "generation": "greedy generation with vllm.LLM (default loader vs sharded_state)",
    "fp8": "block-FP8 checkpoints",
    "intquant": "integer checkpoints (CT W4A16 pack-quantized, W8A8-int8; GPTQ, AWQ)",
    "ep": "expert-parallel layouts (--ep / enable_expert_parallel)",
    "pp": "pipeline-parallel layouts (--pp)",
    "harness": "checks of the vLLM ground-truth harness itself (no reshard needed)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    for name, doc in {
        "vllm": "needs the vLLM environment of `make test-vllm`",
        "moe": "mixture-of-experts cases of the vLLM suite",
    }.items():
        # already in pyproject.toml; harmless if registered twice
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/against_vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = getattr(config, "_vllm_timings", None)
    if not rows:
        return
    tr = terminalreporter
    tr.section("vLLM suite timings (s)")
    for what, secs in rows:
        tr.write_line(f"{secs:7.1f}  {what}")
    tr.write_line(f"{sum(s for _, s in rows):7.1f}  total (sub-processes)")
