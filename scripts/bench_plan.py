"""Section 5 of `python -m scripts.bench`: `build_plan`'s time from headers alone, in this process."""

from __future__ import annotations

import time

from reshard.layout import Layout


def plan_times(tp: int = 8, reps: int = 3) -> list[dict]:
    """`build_plan` from headers alone (tests/fixtures/synthetic.py: the real models' names and shapes, no
    bytes): best wall and CPU seconds of `reps`, for the largest dense and MoE configs we target."""
    from reshard.plan import build_plan
    from tests.fixtures.synthetic import LLAMA_3_70B, QWEN3_235B_A22B_FP8, synthetic_checkpoint

    out = []
    for name, config, files in (("Llama-3-70B", LLAMA_3_70B, 30), ("Qwen3-235B-A22B-FP8", QWEN3_235B_A22B_FP8, 48)):
        ckpt = synthetic_checkpoint(config, files=files)
        wall, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = build_plan(ckpt, Layout(tp=tp))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        tensors = sum(len(f.tensors) for f in plan.files)
        out.append({"model": name, "tp": tp, "tensors": tensors, "seconds": min(wall), "cpu": min(cpu)})
    return out
