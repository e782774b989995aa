"""Section 4 of `python -m scripts.bench`: vLLM's own "Loading weights took" for load_format
"sharded_state" on reshard's output against the default loader on the original checkpoint (needs
.venv-vllm). `python -m scripts.bench loaders` (scripts/bench_loaders.py) is the fuller comparison."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from scripts.benchlib import ROOT, Bench, med, run_measured
from tests.against_vllm.vllm_ipc import private_ipc_dir

VLLM_SCRIPT = r"""
import sys, time
if __name__ == "__main__":
    from vllm import LLM
    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], load_format=sys.argv[2], tensor_parallel_size=int(sys.argv[3]), enforce_eager=True,
              max_model_len=256, max_num_seqs=1, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              distributed_executor_backend="mp")
    print(f"BENCH_ENGINE_READY {time.perf_counter() - t0:.3f}", flush=True)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
"""


def vllm(b: Bench, ck: dict, tp: int) -> dict | None:
    """Section 4: vLLM engines at `tp` on `ck` (default loader) and on its reshard output (sharded_state),
    --vllm-reps rounds; None (and a note) without .venv-vllm or when vLLM fails."""
    vpy = ROOT / ".venv-vllm" / "bin" / "python"
    if not vpy.exists():
        b.notes.append("vLLM comparison skipped: no .venv-vllm (see shared/README.md or `make test-vllm`)")
        return None
    src, out = Path(ck["path"]), b.work / f"out-vllm-tp{tp}"
    shutil.rmtree(out, ignore_errors=True)
    run_measured(b.save_cmd(src, out, tp), log=b.log)
    script = b.work / "vllm_load.py"
    script.write_text(VLLM_SCRIPT)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "INFO",
        "TOKENIZERS_PARALLELISM": "false",
    }
    loaders = {"default (HF safetensors)": ("auto", src), "sharded_state (reshard output)": ("sharded_state", out)}
    runs: dict[str, list[dict]] = {k: [] for k in loaders}
    for _ in range(b.a.vllm_reps):
        for name, (fmt, path) in loaders.items():
            b.cache.drop([path])
            log = b.work / f"vllm-{fmt}.log"
            log.write_text("")
            try:
                with private_ipc_dir(env):  # its ZMQ sockets, else left in /tmp
                    r = run_measured(
                        [str(vpy), str(script), str(path), fmt, str(tp)],
                        log=log,
                        env=env,
                        timeout=b.a.vllm_timeout,
                        sync=False,
                    )
            except RuntimeError as e:
                b.notes.append(f"vLLM {fmt} failed: {str(e).splitlines()[0]} (log kept: {log})")
                b.a.keep = True
                return None
            text = log.read_text(errors="replace")
            took = [float(x) for x in re.findall(r"Loading weights took ([0-9.]+) seconds", text)]
            ready = re.findall(r"BENCH_ENGINE_READY ([0-9.]+)", text)
            r.update(weights=max(took) if took else float("nan"), ready=float(ready[-1]) if ready else float("nan"))
            runs[name].append(r)
            b.say(f"  vllm {fmt}: weights {r['weights']:.2f} s, engine {r['ready']:.1f} s")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "checkpoint": ck,
        "tp": tp,
        "rows": {
            n: {
                "weights": [r["weights"] for r in rs],
                "weights_med": med([r["weights"] for r in rs]),
                "ready_med": med([r["ready"] for r in rs]),
                "rss": max(r["rss"] for r in rs),
            }
            for n, rs in runs.items()
        },
    }
