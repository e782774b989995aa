"""vLLM weight-load time by loader: `python -m scripts.bench loaders [--size 600MB] [--tp 2] [--reps 2]`.

For one synthetic Llama-shaped bf16 checkpoint (scripts/make_synthetic.py) and its `reshard save --tp T`
output, starts a vLLM engine (`vllm.LLM`, CPU build) per loader and cache state, interleaved:

* `auto` (vLLM's default loader) on the original checkpoint,
* `sharded_state` on the reshard output,
* `reshard` (reshard's plugin, checksums verified) on the same output,
* `reshard` with `--model-loader-extra-config '{"checksums": false}'`,

each with a cold page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, needs root) and a warm one
(the files read once just before). In every cold round the disk's own floor is timed too: every rank's
files read once with O_DIRECT, all at once, four streams per file (as the plugin reads them), into
memory touched beforehand: no cold load of those bytes can beat it on this disk. Recorded: vLLM's own "Loading weights took" (the slowest rank) and
the engine start (`LLM(...)` returning). Run it under /work/tools/vllm-slot where vLLM runs are
rationed; `--vllm-python` must have reshard's entry point installed (`pip install --no-deps -e .`).
Prints a Markdown section (and writes it to --out when given) and the raw runs as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reshard.names import parse_rank_file, rank_files_in
from scripts.benchlib import ROOT, put_section, scrub
from scripts.make_synthetic import make_config, parse_size, write_checkpoint
from tests.against_vllm.vllm_ipc import private_ipc_dir

SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    import multiprocessing
    import vllm.v1.executor.multiproc_executor as mpe
    from vllm import LLM
    mpe.get_mp_context = lambda: multiprocessing.get_context("fork")  # as tests/against_vllm/generate.py
    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], load_format=sys.argv[2], tensor_parallel_size=int(sys.argv[3]), enforce_eager=True,
              max_model_len=256, max_num_seqs=1, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              distributed_executor_backend="mp", model_loader_extra_config=json.loads(sys.argv[4]))
    print(f"BENCH_ENGINE_READY {time.perf_counter() - t0:.3f}", flush=True)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
"""

HEADING = "## vLLM weight loading: `--load-format reshard` vs `sharded_state` vs the default loader"


LOADERS = {
    "default loader (original checkpoint)": ("auto", "src", {}),
    "sharded_state": ("sharded_state", "out", {}),
    "reshard, checksums verified": ("reshard", "out", {}),
    "reshard, checksums off": ("reshard", "out", {"checksums": False}),
}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def warm(folder: Path) -> None:
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def disk_floor(files: list[Path], streams: int = 4, chunk: int = 32 << 20) -> float:
    """Seconds to read `files` once with O_DIRECT, all at once, `streams` readers per file each taking
    every `streams`-th chunk (the plugin's pattern), into buffers touched beforehand."""

    def stream(path: Path, k: int) -> None:
        buf = mmap.mmap(-1, chunk)
        buf.write(b"\0" * chunk)  # touched: the floor is the disk's, not the first touch of memory
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            pos = k * chunk
            while os.preadv(fd, [buf], pos) == chunk:
                pos += streams * chunk
        finally:
            os.close(fd)
            buf.close()

    jobs = [(p, k) for p in files for k in range(streams)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: stream(*j), jobs))
    return time.perf_counter() - t0


def run_one(vpy: str, script: Path, path: Path, fmt: str, tp: int, extra: dict, log: Path) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "INFO",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    t0 = time.perf_counter()
    with private_ipc_dir(env):  # its ZMQ sockets, else left in /tmp
        p = subprocess.run(
            [vpy, str(script), str(path), fmt, str(tp), json.dumps(extra)],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    wall = time.perf_counter() - t0
    text = p.stdout + p.stderr
    with open(log, "a") as fh:
        fh.write(f"$ {fmt} {path} {extra}\n{text}\n")
    if p.returncode != 0:
        raise RuntimeError(f"vLLM {fmt} failed (rc={p.returncode}); log {log}:\n{text[-3000:]}")
    # vLLM's loaders log it on rank 0 only (info_once); so does the plugin (its per-rank lines aside)
    lines = [ln for ln in text.splitlines() if "Loading weights took" in ln]
    lines = [ln for ln in lines if "TP0 " in ln] or lines
    took = [float(x) for ln in lines for x in re.findall(r"Loading weights took ([0-9.]+) seconds", ln)]
    ready = re.findall(r"BENCH_ENGINE_READY ([0-9.]+)", text)
    return {
        "weights": max(took) if took else float("nan"),
        "ready": float(ready[-1]) if ready else float("nan"),
        "wall": wall,
        "load": os.getloadavg()[0],
    }


def bench(a: argparse.Namespace) -> dict:
    work = a.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src, out, log = work / "src", work / "out", work / "vllm.log"
    info = write_checkpoint(src, make_config("llama", a.size, fp8=False))
    subprocess.run(
        [sys.executable, "-m", "reshard", "save", str(src), str(out), "--tp", str(a.tp)],
        check=True,
        env={**os.environ, "RESHARD_DISABLE_PROGRESS": "1"},
        stdout=subprocess.DEVNULL,
    )
    script = work / "vllm_load.py"
    script.write_text(SCRIPT)
    cold_ok = drop_caches()
    runs: dict[str, list[dict]] = {f"{n}|{c}": [] for n in LOADERS for c in ("cold", "warm")}
    floors: list[float] = []
    for rep in range(a.reps):
        if cold_ok:
            drop_caches()
            floors.append(disk_floor(rank_files_in(out)))
            print(f"[loaders] round {rep + 1} disk floor (O_DIRECT, every rank file): {floors[-1]:.2f} s", flush=True)
        for name, (fmt, where, extra) in LOADERS.items():
            path = src if where == "src" else out
            for cache in ("cold", "warm"):
                if cache == "cold" and not cold_ok:
                    continue
                if cache == "cold":
                    drop_caches()
                else:
                    warm(path)
                r = run_one(a.vllm_python, script, path, fmt, a.tp, extra, log)
                runs[f"{name}|{cache}"].append(r)
                print(
                    f"[loaders] round {rep + 1} {name} {cache}: weights {r['weights']:.2f} s, engine {r['ready']:.1f} s"
                    f" (load avg {r['load']:.1f})",
                    flush=True,
                )
    rank0 = [p for p in rank_files_in(out) if (rf := parse_rank_file(p.name)) and rf.tp_rank == 0]
    result = {
        "checkpoint": {k: info[k] for k in ("bytes",) if k in info},
        "size_arg": a.size,
        "tp": a.tp,
        "reps": a.reps,
        "cold": cold_ok,
        "runs": runs,
        "floors": floors,
        "rank_bytes": sum(p.stat().st_size for p in rank0),
        "started": a.started,
        "load_end": os.getloadavg(),
    }
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def report(r: dict, command: str) -> str:
    def med(xs):
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")

    lines = [
        f"{HEADING} (TP {r['tp']})",
        "",
        f"`{command}` on {r['started']}: a synthetic Llama-shaped bf16 checkpoint of "
        f"{r['checkpoint'].get('bytes', r['size_arg']) / 1e6:.0f} MB ({r['rank_bytes'] / 1e6:.0f} MB per rank after "
        f"`reshard save --tp {r['tp']}`), vllm-cpu 0.32.0, one engine per run, {r['reps']} interleaved rounds. "
        '*weights*: vLLM\'s "Loading weights took" (rank 0, as vLLM logs it; the plugin logs the same line); *engine*: '
        "`vllm.LLM(...)` until it returns (model build, load, KV cache). Cold: page cache dropped before the run; "
        "warm: the files read once just before.",
        "",
        "| loader | cache | weights s (median) | runs | engine s (median) |",
        "|---|---|---:|---|---:|",
    ]
    for key, rs in r["runs"].items():
        if not rs:
            continue
        name, cache = key.split("|")
        w = [x["weights"] for x in rs]
        each, ready = " ".join(f"{x:.3f}" for x in w), med([x["ready"] for x in rs])
        lines.append(f"| {name} | {cache} | {med(w):.3f} | {each} | {ready:.1f} |")
    floors, default = r.get("floors") or [], r["runs"].get("default loader (original checkpoint)|cold") or []
    if floors and default:
        cold = {key.split("|")[0]: rs for key, rs in r["runs"].items() if key.endswith("|cold") and rs}

        def ratio(rs: list[dict], to: list[float]) -> float:
            return med([x["weights"] / t for x, t in zip(rs, to, strict=False)])

        to_default = ", ".join(
            f"{name} {ratio(rs, [d['weights'] for d in default]):.2f}" for name, rs in cold.items() if rs is not default
        )
        to_floor = ", ".join(f"{name} {ratio(rs, floors):.2f}" for name, rs in cold.items())
        lines += [
            "",
            f"Disk floor, cold: every rank file read once with O_DIRECT, all at once, 4 streams per file, into "
            f"memory touched beforehand, at the start of each round: {med(floors):.3f} s (runs "
            f"{' '.join(f'{x:.2f}' for x in floors)}), "
            f"{med([f / d['weights'] for f, d in zip(floors, default, strict=False)]):.2f} of the default loader's "
            "time (median of per-round ratios): a cold load of these bytes is bound by it (this shared disk's "
            "speed moves from minute to minute, so a load can beat its round's floor by a little). Cold, "
            f"per-round ratio to the default loader (median): {to_default}; to the round's floor: {to_floor}.",
        ]
    lines += ["", f"Load average at the end: {r['load_end'][0]:.1f} (other jobs share this 2-core machine).", ""]
    return scrub("\n".join(lines))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench loaders", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("600MB"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-loaders")
    ap.add_argument("--out", type=Path, help="also put the Markdown section into this file (docs/benchmarks.md)")
    ap.add_argument("--json", type=Path, help="write the raw runs here")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    a.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r = bench(a)
    text = report(r, "python -m scripts.bench loaders " + " ".join(argv))
    print(text)
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    if a.out:
        put_section(a.out, HEADING, text)
    return 0
