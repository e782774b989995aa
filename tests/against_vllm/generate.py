"""Greedy generation with real vLLM, in a fresh subprocess (``.venv-vllm`` only).

    greedy_tokens(model_dir, tp, *, load_format="auto", ep=False, max_tokens=16) -> list[list[int]]

runs ``vllm.LLM(model=model_dir, tensor_parallel_size=tp, load_format=...,
enforce_eager=True, max_model_len=256, dtype=bfloat16)`` on ``PROMPTS`` (token
ids, so no tokenizer is needed) with ``SamplingParams(temperature=0,
max_tokens=..., ignore_eos=True)`` and returns the generated token ids.

vLLM needs ``if __name__ == "__main__"`` guards (its workers re-import the main
module), so the engine always runs in ``python generate.py _run <json>``; the
result comes back through a JSON file.  Speed (2 cores): the engine core runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and TP workers are forked
rather than spawned (set ``RESHARD_VLLM_SPAWN=1`` to keep vLLM's spawn); an
engine at TP 2 then takes ~15 s instead of ~55 s.  ``greedy_tokens_many`` runs
several engines in one process.

Does not run on the CPU build for pipeline parallelism, expert-parallel MoE or
FP8 MoE whose per-rank block was refined below 128x128 (see shared/README.md);
compare state for those instead.

CLI: ``python tests/against_vllm/generate.py MODEL_DIR --tp T [--load-format sharded_state]``
prints the token ids as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # textonly, also when run as a script (the `_run` subprocess)
import textonly  # noqa: E402
import vllm_ipc  # noqa: E402

# Fixed token-id prompts; 999 is the last real vocabulary row of the tiny
# checkpoints (1000 rows, padded by vLLM to a multiple of 64 per rank).
PROMPTS: list[list[int]] = [
    [1, 17, 245, 999, 3, 64, 128],
    [1, 500, 501, 502, 503],
    [1, 42, 7, 42, 7, 42, 7, 42, 7, 900, 11],
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Engine core in this process (one vLLM import less per engine); see _run
    # for the worker start method.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def greedy_tokens(
    model_dir: str | os.PathLike,
    tp: int,
    *,
    load_format: str = "auto",
    ep: bool = False,
    pp: int = 1,
    max_tokens: int = 16,
    prompts: list[list[int]] | None = None,
    skip_tokenizer_init: bool | None = None,
    dtype: str = "bfloat16",
    timeout: float = 600,
) -> list[list[int]]:
    """Greedy token ids vLLM generates for ``prompts`` (default ``PROMPTS``).

    skip_tokenizer_init: None = skip only when model_dir has no tokenizer files.
    Raises RuntimeError with the tail of vLLM's log when the engine fails.
    """
    return greedy_tokens_many(
        [dict(model_dir=str(model_dir), load_format=load_format)],
        tp,
        ep=ep,
        pp=pp,
        max_tokens=max_tokens,
        prompts=prompts,
        skip_tokenizer_init=skip_tokenizer_init,
        dtype=dtype,
        timeout=timeout,
    )[0]


def greedy_tokens_many(
    runs: list[dict],
    tp: int,
    *,
    ep: bool = False,
    pp: int = 1,
    max_tokens: int = 16,
    prompts: list[list[int]] | None = None,
    skip_tokenizer_init: bool | None = None,
    dtype: str = "bfloat16",
    timeout: float = 900,
) -> list[list[list[int]]]:
    """Several engines one after another in one subprocess (one vLLM import).

    runs: dicts with ``model_dir`` (a folder, or an ``s3://`` prefix: then ``config_dir``, a local copy of
    its config and tokenizer, tells whether it has a tokenizer), and optional ``load_format``, ``tp``
    (default: ``tp``) and ``model_loader_extra_config``.
    """
    specs = []
    for r in runs:
        remote = str(r["model_dir"]).startswith("s3://")
        d = Path(r["config_dir"] if remote else r["model_dir"]).resolve()
        skip = skip_tokenizer_init
        if skip is None:
            skip = not any((d / f).exists() for f in _TOKENIZER_FILES)
        extra = (
            {"model_loader_extra_config": r["model_loader_extra_config"]} if "model_loader_extra_config" in r else {}
        )
        specs.append(
            dict(
                model=str(r["model_dir"]) if remote else str(d),
                load_format=r.get("load_format", "auto"),
                tensor_parallel_size=r.get("tp", tp),
                pipeline_parallel_size=pp,
                enable_expert_parallel=ep,
                skip_tokenizer_init=skip,
                dtype=dtype,
                language_model_only=textonly.language_model_only(d),
                **extra,
            )
        )
    with tempfile.TemporaryDirectory(prefix="vllm-gen-") as tmp:
        out = Path(tmp) / "tokens.json"
        log = Path(tmp) / "log.txt"
        spec = dict(runs=specs, prompts=prompts or PROMPTS, max_tokens=max_tokens, out=str(out))
        env = textonly.env(specs[0]["model"], _env())
        with open(log, "w") as fh, vllm_ipc.private_ipc_dir(env):
            try:
                proc = subprocess.run(
                    [sys.executable, str(HERE), "_run", json.dumps(spec)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=timeout,
                    cwd=tmp,
                )
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-8000:]
            raise RuntimeError(f"vLLM generation failed (rc={rc}) for {specs}:\n{tail}")
        return json.loads(out.read_text())["tokens"]


def _run(spec_json: str) -> int:
    spec = json.loads(spec_json)
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if os.environ.get("RESHARD_VLLM_SPAWN", "0") != "1":
        # vLLM's CPU platform forces the "spawn" start method for TP workers
        # (platforms/cpu.py), so each worker re-imports vLLM: ~20 s per engine
        # on 2 cores.  Forking from this process (vLLM imported, no parallel
        # torch work done here) gives the same workers, model code, loaders and
        # gloo/shm collectives in ~5 s.  RESHARD_VLLM_SPAWN=1 keeps vLLM's way.
        import multiprocessing

        import vllm.v1.executor.multiproc_executor as mpe

        mpe.get_mp_context = lambda: multiprocessing.get_context("fork")

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    results = []
    timings = []
    for run in spec["runs"]:
        t0 = time.perf_counter()
        llm = LLM(
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=len(prompts),
            seed=0,
            distributed_executor_backend="mp"
            if run["tensor_parallel_size"] * run["pipeline_parallel_size"] > 1
            else None,
            **run,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outs])
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # stop the engine-core process and its workers
        del llm
        gc.collect()
        timings.append(round(time.perf_counter() - t0, 1))
        print(f"run {run['model']} {run['load_format']}: {timings[-1]}s", flush=True)
    Path(spec["out"]).write_text(json.dumps({"tokens": results, "seconds": timings}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_run":
        return _run(argv[1])
    ap = argparse.ArgumentParser(description="Greedy token ids from real vLLM.")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", action="store_true")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    toks = greedy_tokens(a.model_dir, a.tp, load_format=a.load_format, ep=a.ep, pp=a.pp, max_tokens=a.max_tokens)
    print(json.dumps(toks))
    print(f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
